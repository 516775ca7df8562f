"""--overlap-forward at np=2 (issue 60): the largest gradient of the first group goes in two halves with the first
layers' group between them, and its layer is updated as the next forward pass reaches it. The updates are those of
the plain groups to the bit (tests/overlap_check.py, at a new rate every step, with SGD, Adam, AdamW and LAMB; a
weight used outside its module is refused); a training run is the same, record for record and bit for bit, and so is
one stopped inside an epoch and resumed, with DDP's buckets and with one group; on the wire, the second half starts
only after every other allreduce of its step (with DDP's buckets, the first layers' group, reduced apart from it),
which is what lets their next forward pass run while it is sent."""
import json
import os

import pytest

from tests.e2e.conftest import read_metrics
from tests.e2e.test_resume import assert_same_end
from tests.helpers import PY, ROOT, describe, horovodrun, run

CHECK = os.path.join(ROOT, "tests", "overlap_check.py")


@pytest.mark.parametrize("optimizers", [("sgd", "adamw"), ("adam", "lamb")])
def test_the_late_update_equals_the_plain_groups_to_the_bit(optimizers):
    result = run(horovodrun(2, PY, CHECK, *optimizers), timeout=240)
    assert result.returncode == 0, describe(result)
    for optimizer in optimizers:
        assert result.output.count(f"6 steps of {optimizer} equal to the bit in DDP's buckets and in one group; the "
                                   f"functional use refused") == 2, \
            describe(result)


def _allreduces(timeline: str) -> dict:
    """Each tensor's allreduces in Horovod's timeline as (begin, end) pairs, in order, by tensor name."""
    with open(timeline) as f:
        events = json.load(f)
    names = {e["pid"]: e["args"].get("name") for e in events if e.get("name") == "process_name"}
    spans, depth, begun = {}, {}, {}
    for e in events:
        pid = e.get("pid")
        if e.get("ph") == "B":
            depth[pid] = depth.get(pid, 0) + 1
            if e["name"] == "ALLREDUCE":
                begun[pid] = (e["ts"], depth[pid])
        elif e.get("ph") == "E":
            if pid in begun and begun[pid][1] == depth.get(pid):
                spans.setdefault(names[pid], []).append((begun.pop(pid)[0], e["ts"]))
            depth[pid] = depth.get(pid, 0) - 1
    return spans


def _train(digits, out, *extra):
    # bf16 (emulated where the CPU has none): the late update runs in the forward pass's autocast region
    cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", "torch", "--data-dir", digits, "--epochs", "2",
           "--precision", "bf16", "--output-dir", str(out), *extra]
    result = run(horovodrun(2, *cmd), timeout=240)
    assert result.returncode == 0, describe(result)
    return result


@pytest.fixture(scope="module")
def plain(digits, tmp_path_factory):
    """The run without --overlap-forward (DDP's buckets, the CPU default at np=2) and its last global step. At two
    ranks a sum has one order whatever the grouping (a + b), so one group's runs hold the same bits as well."""
    out = tmp_path_factory.mktemp("plain")
    _train(digits, out, "--resume", "never")
    return str(out), read_metrics(str(out))[-1]["global_step"]


def _assert_second_half_last(timeline: str) -> dict:
    """Every step of the window: the late parameter's second half begins after every other allreduce of the step
    has ended (with DDP's buckets, the first layers' group reduced apart from it; with one group, the group). The
    other allreduces' spans, by tensor name."""
    spans = _allreduces(timeline)
    second = next(spans.pop(name) for name in list(spans) if name.endswith(".second_half_1of1"))
    # The window opens and closes with no second half on the wire: each step's is recorded whole, and no earlier one.
    assert len(second) >= 2 and spans and all(len(s) == len(second) for s in spans.values()), spans
    for step, (begin, _) in enumerate(second):
        ends = {name: s[step][1] for name, s in spans.items()}
        assert max(ends.values()) <= begin, f"step {step + 1} of the window: the second half began at {begin}, " \
                                            f"before the end of {max(ends, key=ends.get)} ({max(ends.values())})"
    return spans


def test_a_run_is_the_plain_runs_bits_resumes_mid_epoch_and_sends_the_second_half_last(digits, plain, tmp_path):
    (plain, steps), full, split = plain, tmp_path / "overlap", tmp_path / "overlap-split"
    told = _train(digits, full, "--resume", "never", "--overlap-forward", "--timeline-steps", "3:5")
    assert "hvdtrain: --overlap-forward: 7.weight" in told.output, describe(told)
    assert_same_end(plain, str(full), epochs=2, steps=steps)
    # The stop comes inside epoch 1 with the second half of its last step still to be applied: the checkpoint holds it.
    _train(digits, split, "--resume", "never", "--overlap-forward", "--max-steps", "7")
    resumed = _train(digits, split, "--overlap-forward")
    assert "(epoch 0, step 7)" in resumed.output, describe(resumed)
    assert_same_end(str(full), str(split), epochs=2, steps=steps)
    spans = _assert_second_half_last(str(full / "timeline.json"))  # DDP's buckets: the first layers' group is one
    assert any(name.startswith("grouped_allreduce.3.bias_") for name in spans), spans


def test_one_group_stopped_mid_epoch_and_resumed_is_the_plain_runs_bits(digits, plain, tmp_path):
    """--allreduce-groups 1 (the default under a quota below a core per rank): the second half goes right behind the
    one group; a run stopped inside an epoch, with that half still to apply, and resumed ends as the plain run."""
    (plain, steps), split = plain, tmp_path / "one-group-split"
    one = ["--allreduce-groups", "1", "--overlap-forward"]
    _train(digits, split, "--resume", "never", *one, "--max-steps", "7", "--timeline-steps", "3:5")
    _assert_second_half_last(str(split / "timeline.json"))
    resumed = _train(digits, split, *one)
    assert "(epoch 0, step 7)" in resumed.output, describe(resumed)
    assert_same_end(plain, str(split), epochs=2, steps=steps)
