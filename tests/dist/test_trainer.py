"""The Trainer on 2+ ranks: identical weights, the learning-rate schedule, accumulation, equal steps."""
import numpy as np
import pytest

from tests.dist.conftest import assert_same_on_every_rank, fingerprint
from tests.tiny_recipe import TinyConfig, TinyTrainer


def tiny(framework, tmp_path_factory, **kw):
    out = tmp_path_factory.mktemp("run")  # rank 0's output; other ranks write nothing
    args = dict(framework=framework, output_dir=str(out), resume="never", batch_size=16, epochs=2, base_lr=0.05)
    cfg = TinyConfig(**{**args, **kw})
    return TinyTrainer(cfg)


def test_parameters_identical_after_setup_and_after_steps(framework, tmp_path_factory):
    t = tiny(framework, tmp_path_factory, perturb_by_rank=True, max_steps=5)
    t.setup()
    assert_same_on_every_rank(t.backend, fingerprint(t.backend.parameters_numpy()), "weights after setup")
    t.train()
    assert t.global_step == 5
    assert_same_on_every_rank(t.backend, fingerprint(t.backend.parameters_numpy()), "weights after 5 steps")


def test_learning_rate_after_warmup_is_base_times_size(framework, tmp_path_factory):
    t = tiny(framework, tmp_path_factory, warmup_epochs=1.0, lr_mode="constant")
    record = t.fit()
    size = t.backend.size
    assert t.lr_at(0.0) == pytest.approx(0.05)
    assert t.backend.get_lr() == pytest.approx(0.05 * size)
    assert record["lr"] == pytest.approx(0.05 * size)
    assert record["world_size"] == size


def test_accumulation_equals_one_larger_batch(framework, tmp_path_factory):
    # 2 micro-batches of 8 at base_lr b (scaled by size x 2) == 1 batch of 16 at base_lr 2b (scaled by size).
    common = dict(epochs=2, max_steps=12, momentum=0.9)
    a = tiny(framework, tmp_path_factory, accumulate=2, batch_size=8, **common)
    a.fit()
    b = tiny(framework, tmp_path_factory, accumulate=1, batch_size=16, base_lr=0.1, **common)
    b.fit()
    assert a.global_step == b.global_step == 12
    pa, pb = a.backend.parameters_numpy(), b.backend.parameters_numpy()
    assert sorted(pa) == sorted(pb)
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # and it trained: the weights moved from their start
    assert any(np.abs(pa[n]).sum() > 0 for n in pa)


def test_uneven_shards_run_equal_steps(framework, tmp_path_factory):
    # 515 samples over the ranks: shards are padded so that every rank runs the same number of steps.
    t = tiny(framework, tmp_path_factory, epochs=1, batch_size=7)
    record = t.fit()
    per_rank = -(-515 // t.backend.size)
    assert t.global_step == per_rank // 7
    assert_same_on_every_rank(t.backend, np.array([float(t.global_step)]), "steps per epoch")
    assert record["val_accuracy"] is not None


def test_nonfinite_gradient_skips_the_step_on_every_rank(framework, tmp_path_factory):
    if framework != "torch":
        pytest.skip("dynamic loss scaling is the PyTorch fp16 path; MXNet's fp16 needs a GPU, bf16 needs no scaler")
    import torch
    t = tiny(framework, tmp_path_factory, precision="fp16")
    t.setup()
    backend = t.backend
    before = fingerprint(backend.parameters_numpy())
    scale = backend.scaler.get_scale()
    x, y = torch.randn(8, 16), torch.zeros(8, dtype=torch.long)
    if backend.rank == 1:
        x[0, 0] = float("inf")  # only rank 1 sees it; the allreduce spreads the inf to every rank's gradient
    backend.train_step([(x, y)])
    after = fingerprint(backend.parameters_numpy())
    np.testing.assert_array_equal(before, after, err_msg="the step must be skipped")
    assert_same_on_every_rank(backend, after, "weights after a skipped step")
    assert backend.scaler.get_scale() < scale, "the loss scale is lowered"
    backend.train_step([(torch.randn(8, 16), y)])
    moved = fingerprint(backend.parameters_numpy())
    assert not np.array_equal(after, moved), "a finite step updates the weights"
    assert_same_on_every_rank(backend, moved, "weights after a finite step")
