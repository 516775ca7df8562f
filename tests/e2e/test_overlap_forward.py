"""--overlap-forward at np=2 (issue 60): the largest gradient of the first group goes in two halves with the first
layers' group between them, and its layer is updated as the next forward pass reaches it. The updates are those of
the plain groups to the bit (tests/overlap_check.py, at a new rate every step, with SGD, Adam, AdamW and LAMB; a
weight used outside its module is refused); a training run is the same, record for record and bit for bit, and so is one stopped
inside an epoch and resumed; on the wire, the second half starts only after the first layers' group has been reduced
apart from it, which is what lets their next forward pass run while it is sent."""
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


def test_a_run_is_the_plain_runs_bits_resumes_mid_epoch_and_sends_the_second_half_last(digits, tmp_path):
    def train(out, *extra):
        # bf16 (emulated where the CPU has none): the late update runs in the forward pass's autocast region
        cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", "torch", "--data-dir", digits, "--epochs", "2",
               "--precision", "bf16", "--output-dir", str(out), *extra]
        result = run(horovodrun(2, *cmd), timeout=240)
        assert result.returncode == 0, describe(result)
        return result

    plain, full, split = tmp_path / "plain", tmp_path / "overlap", tmp_path / "overlap-split"
    train(plain, "--resume", "never")
    told = train(full, "--resume", "never", "--overlap-forward", "--timeline-steps", "3:5")
    assert "hvdtrain: --overlap-forward: 7.weight" in told.output, describe(told)
    steps = read_metrics(str(plain))[-1]["global_step"]
    assert_same_end(str(plain), str(full), epochs=2, steps=steps)
    # The stop comes inside epoch 1 with the second half of its last step still to be applied: the checkpoint holds it.
    train(split, "--resume", "never", "--overlap-forward", "--max-steps", "7")
    resumed = train(split, "--overlap-forward")
    assert "(epoch 0, step 7)" in resumed.output, describe(resumed)
    assert_same_end(str(full), str(split), epochs=2, steps=steps)

    spans = _allreduces(str(full / "timeline.json"))
    second = spans.pop("grouped_allreduce.7.weight.second_half_1of1")
    first_layers = [s for name, s in spans.items() if name.startswith("grouped_allreduce.3.bias_")]
    # (The window may close while the last step's second half is still on the wire: it is then not recorded.)
    assert len(second) >= 2 and first_layers and all(len(s) >= len(second) for s in first_layers), spans
    for step, (begin, _) in enumerate(second):
        ends = [s[step][1] for s in first_layers]
        assert max(ends) <= begin, f"step {step + 1} of the window: the second half began at {begin}, the first " \
                                   f"layers' group ended at {max(ends)}: reduced together, or after it"
