"""MXNet in float16, the precision a GPU trains in by default (--precision auto), run on the CPU.

HVDTRAIN_GPU_STAND_IN=fp16 puts each rank on mx.cpu(local_rank + 1) with a GPU's precision: the network cast to
float16 (BatchNorm stays float32), dynamic loss scaling, and MXNet's multi-precision optimizer keeping float32 master
weights in its state. The tiny recipe's ``half_ops`` model uses only operators MXNet runs in float16 on the CPU, so
everything the backend does with float16 (the master copies, --init-from, --shard-optimizer, checkpoints and resume)
runs here as it would on a GPU. (MXNet has no elastic mode in Horovod: nothing of that to run.)
"""
import numpy as np
import pytest

from hvdtrain.backends.mxnet_sharded import flatten_state
from tests.dist.conftest import assert_same_on_every_rank, fingerprint
from tests.dist.test_trainer import assert_moved, tiny, trained

# float16 keeps 11 significant bits: 1e-3 relative per rounding; two update paths that round in other places (a
# float16 allreduce against a float32 reduce-scatter) differ by a few of those after 12 steps.
HALF = 2e-2


@pytest.fixture(autouse=True)
def stand_in(framework, monkeypatch):
    if framework != "mxnet":
        pytest.skip("MXNet's float16 path (PyTorch's fp16 autocast runs on the CPU as it is: test_trainer)")
    monkeypatch.setenv("HVDTRAIN_GPU_STAND_IN", "fp16")


def half(tmp_path_factory, **kw):
    args = dict(half_ops=True, precision="auto", momentum=0.9, weight_decay=1e-4, epochs=2)
    return tiny("mxnet", tmp_path_factory, **{**args, **kw})


def _weights(t):
    return {n: np.asarray(v, np.float32) for n, v in t.backend.parameters_numpy().items()}


def test_auto_trains_in_float16_with_float32_master_weights(tmp_path_factory):
    t = half(tmp_path_factory, max_steps=12)
    start, end = trained(t)
    b = t.backend
    assert t.cfg.precision == "fp16" and b.loss_scale() is not None
    dtypes = {n: str(v.dtype) for n, v in b.parameters_numpy().items()}
    assert dtypes["0.weight"] == dtypes["3.weight"] == "float16" and dtypes["2.gamma"] == "float32", dtypes
    assert str(b.ctx) == f"cpu({b.local_rank + 1})"
    masters = [s[b._master_at] for s in b._updater().states.values() if isinstance(s, tuple)]
    assert masters and all(m.dtype == np.float32 for m in masters)
    # the float16 weights are the master copies rounded: the update went through the master copies
    for p in b.trainer._params:
        if np.dtype(p.dtype) == np.float16:
            state = b._updater().states[b.trainer._params.index(p)]
            np.testing.assert_array_equal(p.data(b.ctx).asnumpy(), state[b._master_at].asnumpy().astype(np.float16))
    assert_moved(start, {n: np.asarray(v, np.float32) for n, v in end.items()})
    assert_same_on_every_rank(b, fingerprint(end), "float16 weights after 12 steps")


def test_init_from_reaches_the_master_weights(tmp_path_factory):
    # A run's checkpoint to start from; then one step at a vanishing rate from it: the weights must stay the loaded
    # ones (before the fix they became the random initialisation's, kept in the master copies).
    source = half(tmp_path_factory, epochs=1, seed=7)
    source.fit()
    path = source.backend.broadcast_object(source.cfg.output_dir if source.backend.rank == 0 else None)
    loaded = _weights(source)
    step = dict(base_lr=1e-30, warmup_epochs=0, lr_mode="constant", max_steps=1, epochs=1, weight_decay=0.0,
                momentum=0.0)
    scratch = half(tmp_path_factory, **step)
    scratch.setup()
    fresh = _weights(scratch)  # the random initialisation the run below starts from before --init-from
    scratch.reporter.stop()  # not Horovod: under mpirun a shut-down Horovod cannot start again in this process
    t = half(tmp_path_factory, init_from=path, **step)
    t.fit()
    after = _weights(t)
    trained_names = [n for n in after if "running" not in n]
    for n in trained_names:
        np.testing.assert_array_equal(after[n], loaded[n], err_msg=n)
    assert any(np.abs(loaded[n] - fresh[n]).max() > 1e-2 for n in trained_names), "the source differs from a fresh run"


@pytest.mark.parametrize("loss_scale", ["none", "dynamic"])
def test_sharded_float16_update_equals_the_plain_one_and_keeps_a_shard(loss_scale, tmp_path_factory):
    # Without loss scaling the two paths take the same steps. With it, each skips the steps whose gradients
    # overflowed: the plain path adds the ranks' float16 gradients in float16 and overflows where the sharded one
    # (float32 on the wire beside BatchNorm's float32 parameters) does not, so the runs part; each must still train.
    plain = half(tmp_path_factory, max_steps=12, loss_scale=loss_scale)
    plain_start, a = trained(plain)
    sharded = half(tmp_path_factory, max_steps=12, shard_optimizer=True, loss_scale=loss_scale)
    start, b = trained(sharded)
    assert_moved({n: np.asarray(v, np.float32) for n, v in start.items()},
                 {n: np.asarray(v, np.float32) for n, v in b.items()})
    for n in a:  # before the fix every float16 weight became 0 (master copies of zeros); BatchNorm raised
        assert b[n].dtype == a[n].dtype, n
        if loss_scale == "dynamic":
            continue
        np.testing.assert_allclose(np.asarray(b[n], np.float32), np.asarray(a[n], np.float32), rtol=HALF, atol=HALF,
                                   err_msg=n)
    assert_same_on_every_rank(sharded.backend, fingerprint(b), "sharded float16 weights")
    # The shard's momentum and master weights only: 1/size of what the plain optimizer holds.
    whole = sum(a.size for s in plain.backend._updater().states.values() for a in flatten_state(s))
    assert sharded.backend.sharded.held_elements() <= -(-whole // sharded.backend.size) + 8


@pytest.mark.parametrize("shard", [False, True], ids=["plain", "sharded"])
def test_float16_run_resumes_where_it_stopped(shard, tmp_path_factory):
    whole = half(tmp_path_factory, shard_optimizer=shard)
    whole.fit()
    first = half(tmp_path_factory, epochs=1, shard_optimizer=shard)
    first.fit()
    out = first.backend.broadcast_object(first.cfg.output_dir if first.backend.rank == 0 else None)
    resumed = half(tmp_path_factory, shard_optimizer=shard)
    resumed.cfg.output_dir, resumed.cfg.resume = out, "auto"
    resumed.fit()
    assert resumed.global_step == whole.global_step
    a, b = whole.backend.parameters_numpy(), resumed.backend.parameters_numpy()
    for name in a:  # the master copies came back from the checkpoint: the same float16 weights, to the bit
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert resumed.backend.loss_scale() == whole.backend.loss_scale()


def test_a_float32_checkpoint_resumes_in_float16(tmp_path_factory, monkeypatch):
    # Trained on a CPU (fp32), continued on a GPU (fp16): the master copies start from the checkpoint's weights.
    monkeypatch.setenv("HVDTRAIN_GPU_STAND_IN", "1")
    first = half(tmp_path_factory, epochs=1)
    first.fit()
    assert first.cfg.precision == "fp32"
    saved = _weights(first)
    out = first.backend.broadcast_object(first.cfg.output_dir if first.backend.rank == 0 else None)
    monkeypatch.setenv("HVDTRAIN_GPU_STAND_IN", "fp16")
    resumed = half(tmp_path_factory, epochs=2, max_steps=first.global_step + 1, base_lr=1e-30, warmup_epochs=0,
                   lr_mode="constant", weight_decay=0.0)
    resumed.cfg.output_dir, resumed.cfg.resume = out, "auto"
    resumed.fit()
    assert resumed.cfg.precision == "fp16" and resumed.global_step == first.global_step + 1
    after = _weights(resumed)
    for n in after:
        if "running" not in n:
            np.testing.assert_allclose(after[n], saved[n], rtol=1e-3, atol=1e-3, err_msg=n)


@pytest.mark.parametrize("optimizer, rate", [("adamw", 0.01), ("lars", 4.0), ("lamb", 0.01)])
def test_large_batch_optimizers_update_float32_master_weights(optimizer, rate, tmp_path_factory):
    """--optimizer adamw, lars and lamb in float16 with dynamic loss scaling (issue 48, item 2): MXNet's
    multi-precision path gives them the float32 master copies (the trust ratio's norms are taken there, on the
    unscaled gradient), the float16 weights are those copies rounded, and every rank holds the same."""
    t = half(tmp_path_factory, max_steps=12, optimizer=optimizer, base_lr=rate, momentum=0.9 if optimizer == "lars"
             else 0.0)
    start, end = trained(t)
    b = t.backend
    assert t.cfg.precision == "fp16" and b.loss_scale() is not None
    checked = 0
    for p in b.trainer._params:
        if np.dtype(p.dtype) == np.float16:
            state = b._updater().states[b.trainer._params.index(p)]
            master = state[b._master_at]
            assert master.dtype == np.float32
            np.testing.assert_array_equal(p.data(b.ctx).asnumpy(), master.asnumpy().astype(np.float16))
            checked += 1
    assert checked >= 2
    assert_moved(start, {n: np.asarray(v, np.float32) for n, v in end.items()})
    assert_same_on_every_rank(b, fingerprint(end), f"float16 weights after 12 steps of {optimizer}")
