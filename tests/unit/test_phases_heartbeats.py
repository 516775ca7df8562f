"""Phase timing, straggler lines, the heartbeat table and the autotune log, without Horovod."""
import json
import os
import time

import pytest

from hvdtrain.faults import explain_failure, heartbeat_table
from hvdtrain.phases import PHASES, PhaseTimer, stragglers, summarize
from hvdtrain.report import autotune_best, format_autotune


def test_phases_partition_the_step_and_tell_the_observer():
    seen = []
    timer = PhaseTimer(observer=seen.append)
    start = time.perf_counter()
    for step in (1, 2):
        timer.begin_step(step)
        time.sleep(0.02)
        timer.enter("forward")
        time.sleep(0.01)
        timer.enter("backward")
        timer.enter("allreduce")
        time.sleep(0.005)
        timer.enter("step")
        timer.enter("other")
        timer.end_step()
    elapsed = time.perf_counter() - start
    means = timer.local_means()
    assert timer.steps == 2
    assert sum(means.values()) * 2 == pytest.approx(elapsed, rel=0.02)
    # Each phase holds at least its own sleep (a sleep never ends early; on a loaded machine it may end late).
    assert means["data"] >= 0.02 and means["forward"] >= 0.01 and means["allreduce"] >= 0.005
    assert seen[:6] == ["data", "forward", "backward", "allreduce", "step", "other"]


def test_profiled_steps_synchronize_between_phases_and_only_they_count():
    syncs = []
    timer = PhaseTimer(synchronize=lambda: syncs.append(1), profile_every=2)
    for step in (1, 2, 3, 4):
        timer.begin_step(step)
        timer.enter("forward")
        timer.end_step()
    assert timer.steps == 2 and len(syncs) == 4  # steps 2 and 4: one sync per phase closed


def test_phases_outside_a_step_are_not_timed():
    timer = PhaseTimer()
    timer.enter("forward")  # e.g. evaluation marks nothing, but a backend may call enter() outside a step
    timer.end_step()
    assert timer.steps == 0 and sum(timer.totals.values()) == 0


def test_summary_averages_ranks_and_names_the_slowest_in_compute_phases_only():
    fast = {p: 0.01 for p in PHASES}
    slow = dict(fast, data=0.05, allreduce=0.0)
    waiting = dict(fast, allreduce=0.05)
    rec = summarize([waiting, slow], "host", [0.1, 0.08])
    assert rec["phase_seconds"]["data"] == pytest.approx(0.03)
    assert rec["phase_slowest"]["data"] == {"rank": 1, "seconds": 0.05}
    assert rec["step_seconds"] == pytest.approx(0.09)
    lines = stragglers(rec)
    assert lines == ["rank 1 is slowest in data: 50.0 ms/step against 30.0 ms/step on average"]
    # Launch-time clocks (an asynchronous device): only the host-side data wait can name a straggler.
    slow_forward = summarize([fast, dict(fast, forward=0.2)], "launch", [0.06, 0.25])
    assert stragglers(slow_forward) == []
    assert stragglers(summarize([fast, dict(fast, forward=0.2)], "host", [0.06, 0.25]))[0].startswith("rank 1 is slowest in forward")


def _beat(beat_dir, rank, step, phase, age):
    with open(os.path.join(beat_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": step, "phase": phase, "time": time.time() - age, "in_phase": 3.0,
                   "pid": 100 + rank, "host": "node"}, f)


def test_heartbeat_table_marks_the_rank_behind_and_the_silent_one(tmp_path):
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    _beat(beats, 0, 40, "allreduce", 0.5)
    _beat(beats, 1, 40, "data", 0.5)
    _beat(beats, 2, 40, "allreduce", 0.5)
    table = heartbeat_table(str(tmp_path), "test").splitlines()
    assert "behind" in table[3] and table[3].split()[0] == "1"
    assert "behind" not in table[2] and "behind" not in table[4]
    _beat(beats, 2, 38, "forward", 30)
    table = heartbeat_table(str(tmp_path), "test").splitlines()
    assert "silent" in table[4] and "30.0s ago" in table[4]


def test_a_collective_failure_names_the_live_rank_the_others_waited_for(tmp_path):
    # Horovod's stall shutdown ends the job while rank 1 is still in its data loading of the same step (alive: its
    # heartbeat is fresh): every rank's error names rank 1, where it was and for how long
    beats = tmp_path / "heartbeats"
    beats.mkdir()
    _beat(beats, 0, 19, "allreduce", 0.5)
    _beat(beats, 1, 19, "data", 0.5)
    with open(beats / "rank-1.json") as f:
        beat = json.load(f)
    beat.update(in_phase=61.0, host="h1", pid=4242)
    (beats / "rank-1.json").write_text(json.dumps(beat))
    why = explain_failure(str(tmp_path), 0, wait=0)
    assert why.startswith("rank 1 (h1, pid 4242) fell behind: 61s in data at step 19 while the others waited"), why
    _beat(beats, 1, 19, "allreduce", 0.5)  # every rank at the same point: nothing to name
    assert explain_failure(str(tmp_path), 0, wait=0) is None


def test_autotune_log_best_row(tmp_path):
    log = tmp_path / "autotune.csv"
    assert autotune_best(str(log)) is None
    # Horovod's own format, including the stray space it writes after the third column.
    log.write_text("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
                   "tensor_fusion_threshold,score\n0,0,0, 1,5,64,120.5\n0,0,0, 1,2.5,32,180.25\n0,0,0, 0,1,8,90\n")
    best = autotune_best(str(log))
    assert best["tensor_fusion_threshold"] == 32 and best["cycle_time_ms"] == 2.5 and best["samples"] == 3
    assert format_autotune(best).startswith("fusion threshold 32 MB, cycle time 2.5 ms, cache on")
    assert "no sample" in format_autotune(None)


def test_stopping_the_heartbeat_ends_its_wait_at_once_and_writes_the_last_beat(tmp_path):
    # Every rank stops its reporter on the way out: the heartbeat thread's wait between beats must not delay the exit.
    from hvdtrain.faults import RankReporter
    reporter = RankReporter(str(tmp_path), rank=0, interval=60.0).start()
    time.sleep(0.2)  # the thread is inside its wait by now
    reporter.progress(7, "done")
    began = time.monotonic()
    reporter.stop()
    assert time.monotonic() - began < 30.0  # the old wait ran out the 60 s interval
    assert not reporter._thread.is_alive()
    with open(tmp_path / "heartbeats" / "rank-0.json") as f:
        beat = json.load(f)
    assert beat["step"] == 7 and beat["phase"] == "done"
    reporter.stop()  # a second stop (fit's finally after a failure's) is harmless
