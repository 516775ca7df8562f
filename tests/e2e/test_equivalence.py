"""Data parallelism changes nothing but speed: np=1 with batch 2B equals np=2 with batch B per worker.

With the same global batch (the padded shards of 2 ranks interleave to exactly the samples of one rank's batch) and the
same effective learning rate (base_lr x world size), the two runs take the same optimizer steps on the same samples.
They differ only in float summation order (one mean over 64 versus the average of two means over 32, and 2 threads
versus 1 per convolution). Measured here: the first epoch's losses agree to 2e-7 relative (bound: 1e-5); training
amplifies the rounding differences, to about 3e-4 after the second epoch (bound: 2e-3).
Dropout and augmentation are off: their random draws depend on how samples are split across ranks.
"""
import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_np1_and_np2_give_the_same_loss_curve(framework, digits, tmp_path):
    common = ["--framework", framework, "--data-dir", digits, "--epochs", "2", "--dropout", "0",
              "--max-shift", "0", "--resume", "never", "--warmup-epochs", "0"]
    curves = {}
    for np_, batch, lr in ((1, 64, 0.06), (2, 32, 0.03)):
        out = str(tmp_path / f"np{np_}")
        cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", *common, "--batch-size", str(batch), "--base-lr", str(lr),
               "--output-dir", out]
        result = run(horovodrun(np_, *cmd), timeout=240)
        assert result.returncode == 0, describe(result)
        curves[np_] = read_metrics(out)
    assert len(curves[1]) == len(curves[2]) == 2
    for (one, two), rel in zip(zip(curves[1], curves[2]), (1e-5, 2e-3)):
        assert two["lr"] == pytest.approx(one["lr"])
        assert two["global_step"] == one["global_step"]
        assert two["train_loss"] == pytest.approx(one["train_loss"], rel=rel), (one, two)
        assert two["val_loss"] == pytest.approx(one["val_loss"], rel=rel), (one, two)
