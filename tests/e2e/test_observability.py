"""Observability on 2 ranks: per-phase step times, the timeline window, autotune, the heartbeat table, and report."""
import json
import os
import re
import subprocess
import time

import pytest

from hvdtrain.phases import PHASES
from hvdtrain.timeline import read_events, summarize as timeline_summary
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, ROOT, describe, env, horovodrun, hvdtrain, kill_tree, run

TINY = "tests.tiny_recipe:TinyTrainer"
ROW = re.compile(r"^\s+(\d+)\s+\S+\s+\d+\s+\d+\s+\w+\s.*$")  # rank host pid step phase ...


@pytest.mark.parametrize("framework,extra", [("torch", []), ("mxnet", ["--profile-steps", "1"])])
def test_phase_times_add_up_to_the_step_and_find_the_data_wait(tmp_path, framework, extra):
    out = tmp_path / "out"
    # 100 ms of "data loading" per batch (the tiny recipe sleeps in its dataset): the data phase must carry it. The
    # other phases of this tiny MLP take about 1 ms each, and up to 30 ms were seen on a loaded 2-core machine.
    r = run(horovodrun(2, *hvdtrain("recipe", TINY, "--framework", framework, "--epochs", "2", "--step-sleep", "0.1",
                                    "--output-dir", str(out), *extra)), timeout=180)
    assert r.returncode == 0, describe(r)
    for rec in read_metrics(str(out)):
        phases = rec["phase_seconds"]
        assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values()), rec
        assert rec["phase_clock"] == ("synchronized" if extra else "host")
        # The phases cover the whole step: their sum is within 10% of the step time measured apart from them.
        assert sum(phases.values()) == pytest.approx(rec["step_seconds"], rel=0.10), rec
        assert phases["data"] >= 0.1, rec  # every step sleeps 100 ms while loading: never less
        assert phases["data"] == max(phases[p] for p in PHASES if p != "allreduce"), rec
        assert {s["rank"] for s in rec["phase_slowest"].values()} <= {0, 1}
    assert "step " in r.stdout and "data " in r.stdout  # the per-epoch phase line

    report = run(hvdtrain("report", str(out)), timeout=120)
    assert report.returncode == 0, describe(report)
    assert "state: finished; epochs done: 2 of 2" in report.stdout, report.stdout
    assert "where the step time goes" in report.stdout and "val accuracy: 100.00%" in report.stdout, report.stdout
    with open(out / "report.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_directory_that_is_no_job(tmp_path):
    r = run(hvdtrain("report", str(tmp_path)), timeout=60)
    assert r.returncode == 2 and "holds no config.json or metrics.jsonl" in r.stderr, describe(r)
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_timeline_window_records_only_its_steps(tmp_path, framework):
    out = tmp_path / "out"
    timeline = tmp_path / "trace" / "t.json"
    # One epoch of 4 steps; the window is steps 2..3: the gradients' allreduces of two steps and nothing else (the
    # epoch-end metrics allreduce comes after step 4).
    r = run(horovodrun(2, *hvdtrain("recipe", TINY, "--framework", framework, "--epochs", "1",
                                    "--timeline-file", str(timeline), "--timeline-steps", "2:3", "--output-dir", str(out))),
            timeout=180)
    assert r.returncode == 0, describe(r)
    assert f"Horovod timeline of steps 2..3 written to {timeline}" in r.stdout
    events = json.loads(timeline.read_text())  # valid JSON, as chrome://tracing and Perfetto need
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    assert tensors and not [t for t in tensors.values() if "hvdtrain" in t], tensors
    starts = [e["pid"] for e in events if e.get("ph") == "B" and e.get("name") == "ALLREDUCE"]
    assert sorted(starts.count(pid) for pid in tensors) == [2] * len(tensors), (tensors, starts)
    assert len(tensors) == 4  # two layers, weight and bias
    # its summary, in the job's report: each collective of the window ran twice; a writer cut off mid-event reads
    summary = timeline_summary(str(timeline), 2)
    assert summary["collectives"] and all(c["runs"] == 2 and c["transfer"] > 0
                                          for c in summary["collectives"].values()), summary
    assert sum(c["tensors"] for c in summary["collectives"].values()) == 4, summary
    assert 0 < summary["transfer_busy_fraction"] <= 1 and summary["window_seconds"] > 0, summary
    report = run(hvdtrain("report", str(out)), timeout=60)
    assert "Horovod timeline of steps 2..3 (rank 0):" in report.stdout, describe(report)
    assert "the link carried transfers" in report.stdout and "2 run(s), medians: negotiation" in report.stdout
    text = timeline.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[:text.rindex('"ph"')])  # as a killed writer leaves it: no closing bracket, half an event
    assert read_events(str(cut)) == events[:len(read_events(str(cut)))] and len(read_events(str(cut))) > 4


def test_an_armed_timeline_leaves_an_idle_job_idle():
    """--timeline-steps arms Horovod's timeline at start-up (HOROVOD_TIMELINE=DYNAMIC, so that a window can open
    later). Horovod 0.28.1's timeline writer then spun in a yield loop for the whole job, recording or not: a core's
    worth of CPU per rank, and under a quota the training's share (fix 10 makes it sleep while nothing is queued)."""
    code = ("import time, torch, horovod.torch as hvd; hvd.init(); hvd.allreduce(torch.ones(1), name='warm'); "
            "c = time.process_time(); time.sleep(1.5); "
            "print('idle cpu', hvd.rank(), round(time.process_time() - c, 3), flush=True)")
    r = run(horovodrun(2, PY, "-c", code), timeout=120, HOROVOD_TIMELINE="DYNAMIC", HOROVOD_IDLE_WAIT="1")
    assert r.returncode == 0, describe(r)
    cpu = [float(x) for x in re.findall(r"idle cpu \d ([\d.]+)", r.stdout)]
    assert len(cpu) == 2 and max(cpu) < 0.3, (cpu, r.stdout[-2000:])  # spinning: about 1.5 s each


def test_autotune_writes_its_log_and_prints_the_choice(tmp_path):
    out = tmp_path / "out"
    # Horovod's autotuner warms up for 3 samples of 10 steps by default: shortened so that 24 steps score samples.
    r = run(horovodrun(2, *hvdtrain("recipe", TINY, "--epochs", "6", "--autotune", "--output-dir", str(out))),
            timeout=180, HOROVOD_AUTOTUNE_WARMUP_SAMPLES=1, HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE=2)
    assert r.returncode == 0, describe(r)
    lines = (out / "autotune.csv").read_text().splitlines()
    assert lines[0].startswith("hierarchical_allreduce,") and lines[0].endswith(",score")
    assert len(lines) >= 2, "at least one sample was scored"
    printed = [line for line in r.stdout.splitlines() if "hvdtrain: autotune: " in line]
    assert len(printed) == 1 and "fusion threshold" in printed[0] and "MB, cycle time" in printed[0], r.stdout


def test_heartbeat_table_names_the_slow_rank_on_a_stall_and_on_sigusr1(tmp_path):
    out = tmp_path / "out"
    marker = tmp_path / "slept"
    # Rank 1 stops for 15 s in its data loading at its 6th batch; with --stall-timeout 22 rank 0 prints the table
    # after 11 s of waiting by itself, and once more when it gets SIGUSR1. The job then finishes normally: Horovod's
    # stall shutdown would end it only after 22 s.
    cmd = horovodrun(2, *hvdtrain("recipe", TINY, "--epochs", "3", "--stall-timeout", "22", "--fault", "sleep",
                                  "--fault-rank", "1", "--fault-step", "6", "--fault-seconds", "15",
                                  "--fault-once", str(marker), "--output-dir", str(out)))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "rank 1 never reached its slow batch"
        time.sleep(2)
        with open(out / "heartbeats" / "rank-0.json") as f:
            os.kill(json.load(f)["pid"], 10)  # SIGUSR1
        output, _ = proc.communicate(timeout=120)
    except (subprocess.TimeoutExpired, AssertionError):
        kill_tree(proc)
        raise
    assert proc.returncode == 0, output[-6000:]
    lines = [re.sub(r"^\[\d+\]<std(out|err)>:", "", line) for line in output.splitlines()]
    tables = {}  # why -> {rank: row} of the first table printed for that reason
    for i, line in enumerate(lines):
        if line.startswith("hvdtrain: ranks "):
            why = "signal" if "(on SIGUSR1)" in line else "stall" if "has waited" in line else line
            rows = [m for m in (ROW.match(x) for x in lines[i + 1:i + 8]) if m]
            tables.setdefault(why, {m.group(1): m.group(0) for m in rows})
    assert {"signal", "stall"} <= set(tables), output[-6000:]
    for rows in tables.values():
        assert "behind" in rows["1"] and " data " in rows["1"], rows
        assert "behind" not in rows["0"], rows
    records = read_metrics(str(out))
    assert records[1]["phase_slowest"]["data"]["rank"] == 1  # the slow batch was in epoch 2
    assert "straggler: rank 1 is slowest in data" in output
