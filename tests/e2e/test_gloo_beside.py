"""A large Gloo allreduce runs beside Horovod's background thread, and the small ones queued behind it are reduced
while it is on the wire (scripts/patch_horovod.py fix 11; tests/beside_check.py says what each round checks).

Every value is compared exactly, and training with it is training without it, to the bit; the ranks must agree to
run nothing beside when the variable is set on one of them; a large allreduce left in flight at hvd.shutdown() ends
the job cleanly, and one whose peer is gone fails at once. Without the fix, or with the variable 0, a small allreduce
queued after a large one never completes first, which is what the first test's count tells apart."""
import json
import os
import re

import pytest

from hvdtrain.faults import COLLECTIVE_FAILURE_MARKERS
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, ROOT, describe, horovodrun, hvdtrain, run

CHECK = os.path.join(ROOT, "tests", "beside_check.py")


def _beside(result) -> list:
    assert result.returncode == 0, describe(result)
    lines = re.findall(r"rank (\d): (\d+) rounds right, (\d+) small completed beside", result.output)
    assert len(lines) == 2, describe(result)
    return [int(n) for _, _, n in sorted(lines)]


def test_small_allreduces_complete_beside_a_large_one_with_every_value_exact():
    on = _beside(run(horovodrun(2, PY, CHECK, "6"), timeout=240, HOROVOD_GLOO_ASYNC_BYTES=1 << 20,
                     HOROVOD_IDLE_WAIT=2))
    # each round's small ones are queued while the 32 MB one is on the wire (tens of ms even on the loopback): they
    # complete first in most rounds; one round suffices to show they ran beside it
    assert all(n >= 1 for n in on), on
    off = _beside(run(horovodrun(2, PY, CHECK, "3"), timeout=240, HOROVOD_GLOO_ASYNC_BYTES=0, HOROVOD_IDLE_WAIT=2))
    assert off == [0, 0], off


def test_ranks_that_disagree_run_nothing_beside_and_a_large_one_in_flight_at_shutdown_ends_cleanly(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result = run(horovodrun(2, PY, CHECK, "3", "--only-rank0", "--leave-one-in-flight"), timeout=240,
                 HOROVOD_GLOO_ASYNC_BYTES=1 << 20, HOROVOD_IDLE_WAIT=2, BESIDE_CHECK_DIR=str(tmp_path / "a"))
    assert _beside(result) == [0, 0], describe(result)
    result = run(horovodrun(2, PY, CHECK, "2", "--leave-one-in-flight"), timeout=240, HOROVOD_GLOO_ASYNC_BYTES=1 << 20,
                 HOROVOD_IDLE_WAIT=2, BESIDE_CHECK_DIR=str(tmp_path / "b"))
    assert all(n >= 1 for n in _beside(result)), describe(result)


def test_a_peer_gone_in_the_middle_of_a_large_allreduce_fails_it_at_once():
    # Gloo's timeout is 60 s here: the failure must come from the lost connection, not from waiting it out. The
    # rank sees the transport's error (the peer closed or reset it), or Horovod's shutdown when its background thread
    # saw it first: the collective failures hvdtrain's failure report already recognises (and replaces by the failed
    # rank's own error), less the timeout.
    result = run(horovodrun(2, PY, CHECK, "1", "--peer-exits"), timeout=240, HOROVOD_GLOO_ASYNC_BYTES=1 << 20,
                 HOROVOD_IDLE_WAIT=2, HOROVOD_GLOO_TIMEOUT_SECONDS=60)
    failed = re.search(r"rank 0: the large allreduce failed after (\d+\.\d) s: HorovodInternalError: (.*)",
                       result.output)
    assert failed, describe(result)
    lost = [m for m in COLLECTIVE_FAILURE_MARKERS if m not in ("Timed out waiting", "HorovodInternalError")]
    assert float(failed[1]) < 50 and any(m in failed[2] for m in lost), describe(result)


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_training_with_the_large_group_beside_equals_training_one_collective_at_a_time(framework, digits, tmp_path):
    # --hidden 512: 6.5 MB of gradients, the first layer's 1.6 MB of them past hvdtrain's 1 MiB (PyTorch's first
    # bucket, MXNet's one group), so every step's large allreduce runs beside the background thread by default
    records = {}
    for name, extra in (("beside", {}), ("one at a time", {"HOROVOD_GLOO_ASYNC_BYTES": 0})):
        out = str(tmp_path / name.replace(" ", "-"))
        result = run(horovodrun(2, *hvdtrain("recipe", "mnist", "--framework", framework, "--data-dir", digits,
                                             "--epochs", "2", "--hidden", "512", "--output-dir", out,
                                             "--resume", "never")), timeout=300, **extra)
        assert result.returncode == 0, describe(result)
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["horovod_gloo_async_bytes"] == ("0" if extra else str(1 << 20))
        records[name] = [{k: r[k] for k in ("epoch", "global_step", "train_loss", "val_loss", "val_accuracy", "lr")}
                         for r in read_metrics(out)]
    assert len(records["beside"]) == 2 and records["beside"] == records["one at a time"], records
