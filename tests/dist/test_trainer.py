"""The Trainer on 2+ ranks: identical weights, the learning-rate schedule, accumulation, equal steps."""
import gc

import numpy as np
import pytest

from hvdtrain import ArrayDataset, ConfigError
from tests.dist.conftest import assert_same_on_every_rank, fingerprint
from tests.tiny_recipe import TinyConfig, TinyTrainer


def tiny(framework, tmp_path_factory, **kw):
    out = tmp_path_factory.mktemp("run")  # rank 0's output; other ranks write nothing
    # fp32: these tests compare runs with float32 bounds; --precision auto would be bf16 on a CPU with native bf16.
    args = dict(framework=framework, output_dir=str(out), resume="never", batch_size=16, epochs=2, base_lr=0.05,
                precision="fp32")
    cfg = TinyConfig(**{**args, **kw})
    return TinyTrainer(cfg)


def test_parameters_identical_after_setup_and_after_steps(framework, tmp_path_factory):
    t = tiny(framework, tmp_path_factory, perturb_by_rank=True, max_steps=5)
    t.setup()
    assert_same_on_every_rank(t.backend, fingerprint(t.backend.parameters_numpy()), "weights after setup")
    t.train()
    assert t.global_step == 5
    assert gc.get_freeze_count() == 0, "what the run froze is collectable again after it (a later run's garbage)"
    assert_same_on_every_rank(t.backend, fingerprint(t.backend.parameters_numpy()), "weights after 5 steps")


def test_learning_rate_after_warmup_is_base_times_size(framework, tmp_path_factory):
    t = tiny(framework, tmp_path_factory, warmup_epochs=1.0, lr_mode="constant")
    record = t.fit()
    size = t.backend.size
    assert t.lr_at(0.0) == pytest.approx(0.05)
    assert t.backend.get_lr() == pytest.approx(0.05 * size)
    assert record["lr"] == pytest.approx(0.05 * size)
    assert record["world_size"] == size


def trained(t):
    """Set up, remember the weights, train; returns (weights before, weights after)."""
    t.setup()
    before = {k: np.array(v, copy=True) for k, v in t.backend.parameters_numpy().items()}
    t.train()
    return before, t.backend.parameters_numpy()


def assert_moved(before, after):
    moved = [n for n in before if np.abs(after[n] - before[n]).max() > 1e-3]
    assert sorted(moved) == sorted(before), f"parameters that did not train: {sorted(set(before) - set(moved))}"


def test_accumulation_equals_one_larger_batch(framework, tmp_path_factory):
    # 2 micro-batches of 8 at base_lr b (scaled by size x 2) == 1 batch of 16 at base_lr 2b (scaled by size). The
    # same gradients summed in another order: float32 rounding, amplified over 12 steps, stays far below 1e-3.
    common = dict(epochs=2, max_steps=12, momentum=0.9)
    start, pa = trained(tiny(framework, tmp_path_factory, accumulate=2, batch_size=8, **common))
    b = tiny(framework, tmp_path_factory, accumulate=1, batch_size=16, base_lr=0.1, **common)
    b.fit()
    assert b.global_step == 12
    pb = b.backend.parameters_numpy()
    assert sorted(pa) == sorted(pb)
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-3, atol=1e-4, err_msg=name)
    assert_moved(start, pa)  # and it trained: every parameter moved from its start


def test_uneven_shards_run_equal_steps(framework, tmp_path_factory):
    # 515 samples over the ranks: shards are padded so that every rank runs the same number of steps.
    t = tiny(framework, tmp_path_factory, epochs=1, batch_size=7)
    record = t.fit()
    per_rank = -(-515 // t.backend.size)
    assert t.global_step == per_rank // 7
    assert_same_on_every_rank(t.backend, np.array([float(t.global_step)]), "steps per epoch")
    assert record["val_accuracy"] is not None


def _scale(backend) -> float:
    return backend.scaler.get_scale() if hasattr(backend.scaler, "get_scale") else backend.scaler.scale


def _batch(backend, poison: bool):
    """A training batch of the tiny recipe on the backend's device; ``poison``: one input is infinite."""
    x = np.random.default_rng(backend.rank).normal(size=(8, 16)).astype(np.float32)
    if poison:
        x[0, 0] = np.inf
    return next(backend.loader(ArrayDataset(x, np.zeros(8, dtype=np.int64)), range(8), 8, drop_last=True))


# PyTorch: its GradScaler under fp16 autocast and under fp32; MXNet: hvdtrain's own dynamic loss scale (fp16 needs a
# GPU there: --loss-scale dynamic runs the same scaler in fp32 on the CPU).
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_nonfinite_gradient_skips_the_step_on_every_rank(framework, precision, tmp_path_factory):
    if framework == "mxnet" and precision == "fp16":
        pytest.skip("MXNet has no fp16 GEMM on the CPU; the fp32 case runs the same loss scaler")
    t = tiny(framework, tmp_path_factory, precision=precision, loss_scale="dynamic")
    t.setup()
    backend = t.backend
    before = fingerprint(backend.parameters_numpy())
    scale = _scale(backend)
    # only rank 1 sees the inf; the allreduce spreads it to every rank's gradient, so every rank skips together
    out = backend.train_step([_batch(backend, poison=backend.rank == 1)])
    after = fingerprint(backend.parameters_numpy())
    np.testing.assert_array_equal(before, after, err_msg="the step must be skipped")
    assert not backend.last_step_applied()
    t.health.observe(out["loss"], 1)  # rank 1's loss is not finite, but nothing reached the weights:
    assert not t.health.seen, "a step the scaler skipped must not bar the epoch's checkpoint"
    assert_same_on_every_rank(backend, after, "weights after a skipped step")
    assert _scale(backend) == scale / 2, "the loss scale is halved"
    backend.train_step([_batch(backend, poison=False)])
    assert backend.last_step_applied()
    moved = fingerprint(backend.parameters_numpy())
    assert not np.array_equal(after, moved), "a finite step updates the weights"
    assert_same_on_every_rank(backend, moved, "weights after a finite step")
    assert _scale(backend) == scale / 2, "a finite step keeps the scale"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_setup_leaves_the_weights_and_optimizer_of_a_fresh_single_process_run(framework, optimizer, tmp_path_factory):
    # Rank 0's weights everywhere, and nothing else: no step taken to create optimizer state (weight decay would move
    # every weight), no update counted.
    t = tiny(framework, tmp_path_factory, optimizer=optimizer, weight_decay=0.1, momentum=0.9)
    t.setup()
    t.backend.seed(t.cfg.seed)
    fresh = t.build_torch() if framework == "torch" else t.build_mxnet()
    if framework == "torch":
        expected = {k: v.detach().numpy() for k, v in fresh.state_dict().items()}
    else:
        expected = {k: p.data().asnumpy() for k, p in fresh._collect_params_with_prefix().items()}
    got = t.backend.parameters_numpy()
    assert sorted(got) == sorted(expected)
    for name in got:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    opt = t.backend.state_dict()["optimizer"]
    if framework == "torch":
        assert opt["state"] == {}, "a fresh optimizer has no state before its first step"
    else:
        assert opt["num_update"] == 0 and not any(c for c in opt["index_update_count"].values())
        assert all(not np.any(a) for arrays in opt["states"].values() for a in arrays), "state starts at zero"


def test_resumed_optimizer_state_reaches_every_rank(framework, tmp_path_factory):
    # Rank 0 trains alone a little (as if it had loaded a checkpoint), then broadcast_state gives every rank its
    # weights and optimizer state (momentum buffers, Adam's moments and step counts) exactly. The other ranks' states
    # are made to differ from rank 0's first, in every leaf, so that only the broadcast can make them equal.
    t = tiny(framework, tmp_path_factory, optimizer="adam", max_steps=3)
    t.fit()
    state = t.backend.state_dict()
    if t.backend.rank == 0:
        state["model"] = {k: v + 1.0 for k, v in state["model"].items()}
    else:
        state = {k: _shifted(v, t.backend.rank + 1) for k, v in state.items()}
    t.backend.load_state_dict(state)
    flat = [float(np.asarray(v, dtype=np.float64).sum()) for v in _leaves(t.backend.state_dict()["optimizer"])]
    with pytest.raises(AssertionError, match="differs across ranks"):  # before the broadcast, they differ
        assert_same_on_every_rank(t.backend, np.array(flat), "optimizer state before broadcast_state")
    t.backend.broadcast_state()
    flat = []
    for tree in (t.backend.state_dict()["model"], t.backend.state_dict()["optimizer"]):
        flat += [float(np.asarray(v, dtype=np.float64).sum()) for v in _leaves(tree)]
    assert_same_on_every_rank(t.backend, np.array(flat), "weights and optimizer state after broadcast_state")


def _shifted(tree, delta):
    """Every array of a state (weights, moments, PyTorch's step counts) plus ``delta``; the rest (indices, settings)
    as it is."""
    if isinstance(tree, dict):
        return {k: _shifted(v, delta) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_shifted(v, delta) for v in tree)
    if isinstance(tree, np.ndarray) and np.issubdtype(tree.dtype, np.number):
        return tree + np.asarray(delta, dtype=tree.dtype)
    return tree


def _leaves(tree):
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k])
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif isinstance(tree, (np.ndarray, int, float)) and not isinstance(tree, bool):
        yield tree


def test_adasum_trains_alike_on_every_rank_without_scaling_the_rate(framework, tmp_path_factory):
    if framework != "torch":
        pytest.skip("horovod.mxnet has no Adasum (refused at start-up; see test_cli)")
    t = tiny(framework, tmp_path_factory, adasum=True, epochs=2, warmup_epochs=1.0, lr_mode="constant")
    import horovod.torch as hvd
    if not hvd.mpi_enabled():  # this suite also runs under horovodrun --gloo
        with pytest.raises(ConfigError, match="--adasum needs Horovod's MPI controller"):
            t.setup()
        return
    start, end = trained(t)
    assert_moved(start, end)
    assert_same_on_every_rank(t.backend, fingerprint(end), "weights after Adasum steps")
    # Horovod's guidance for Adasum: the learning rate is not scaled by the number of workers on the CPU.
    assert t.backend.get_lr() == pytest.approx(0.05)


def test_optimizer_options_train_alike_on_every_rank(framework, tmp_path_factory):
    # Options no other test runs: each trains, keeps the ranks equal, and does what it says.
    common = dict(max_steps=8, epochs=2)
    runs = {}
    for name, kw in (("base", {}), ("predivide", {"predivide": 2.0}), ("fp16_allreduce", {"fp16_allreduce": True}),
                     ("nesterov", {"nesterov": True}), ("per_gradient", {"allreduce_groups": 0}),
                     ("two_groups", {"allreduce_groups": 2})):
        t = tiny(framework, tmp_path_factory, **kw, **common)
        start, end = trained(t)
        assert_moved(start, end)
        assert_same_on_every_rank(t.backend, fingerprint(end), f"weights with {name}")
        runs[name] = end
    base = runs["base"]
    for name in base:
        # predivide only moves where the division by the world size happens: the same average
        np.testing.assert_allclose(runs["predivide"][name], base[name], rtol=1e-4, atol=1e-5, err_msg=name)
        # fp16 gradients on the wire: about 3 significant digits per step
        np.testing.assert_allclose(runs["fp16_allreduce"][name], base[name], rtol=2e-2, atol=2e-3, err_msg=name)
        # the allreduce per gradient (Horovod's default, a GPU's) and two groups sum the same numbers as one group
        for grouping in ("per_gradient", "two_groups"):
            np.testing.assert_allclose(runs[grouping][name], base[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert any(np.abs(runs["nesterov"][n] - base[n]).max() > 1e-4 for n in base), "--nesterov changes the update"


def test_eval_batch_size_and_log_every(framework, tmp_path_factory):
    from hvdtrain.callbacks import Callback

    class Logged(Callback):
        def __init__(self):
            self.steps = []

        def on_log(self, trainer, global_step, metrics):
            self.steps.append((global_step, sorted(metrics)))

    logged = Logged()
    a = tiny(framework, tmp_path_factory, epochs=1, eval_batch_size=5, log_every=2)
    a.extra_callbacks.append(logged)
    ra = a.fit()
    b = tiny(framework, tmp_path_factory, epochs=1)
    rb = b.fit()
    # 203 validation samples in batches of 5 (a last short one) or of 32: the same sums
    assert ra["val_loss"] == pytest.approx(rb["val_loss"], rel=1e-5) and ra["val_accuracy"] == rb["val_accuracy"]
    if a.backend.rank == 0:  # callbacks run on rank 0
        assert logged.steps == [(s, ["loss"]) for s in range(2, a.global_step + 1, 2)], logged.steps
