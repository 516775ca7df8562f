"""--shard-optimizer: reduce-scatter, update 1/size of the weights, allgather -- the plain update, split.

The tiny MLP has 676 weights: on 2 ranks the shard boundary cuts its first layer's weight in two, and with --no-wd
one rank's shard holds no bias (an empty parameter group) while the other holds every bias. On 3 ranks (run by
tests/e2e/test_dist_suites.py too) 676 is no multiple of the world size: the last shard is padded.
"""
import numpy as np
import pytest

from tests.dist.conftest import assert_same_on_every_rank, fingerprint
from tests.dist.test_trainer import assert_moved, tiny, trained

# The optimizers update each element from that element alone, so the sharded update is the plain one; what differs
# is only how the reduction adds (a ring allreduce and a reduce-scatter may add the ranks in another order) and
# vectorised against scalar loops at a shard's edges: float32 rounding, 1e-7 relative per step, here over 12
# steps of momentum. 1e-5 is far below any real difference (a wrong weight decay or a dropped shard moves weights by
# 1e-3 or more).
BOUND = 1e-5

CASES = {
    "sgd-nesterov-wd-nowd": dict(momentum=0.9, nesterov=True, weight_decay=1e-3, no_wd=True),
    "accumulate-2": dict(momentum=0.9, weight_decay=1e-3, accumulate=2, batch_size=8),
    "loss-scale": dict(momentum=0.9, loss_scale="dynamic", nan_step=4),
    "adam-predivide": dict(optimizer="adam", base_lr=0.01, weight_decay=1e-3, predivide=2.0),
    "adamw-nowd": dict(optimizer="adamw", base_lr=0.01, weight_decay=0.05, no_wd=True),
}


def _run(framework, tmp_path_factory, **kw):
    t = tiny(framework, tmp_path_factory, epochs=2, max_steps=12, **kw)
    t.start, _ = trained(t)
    assert t.global_step == 12
    return t


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_update_equals_the_plain_one(framework, case, tmp_path_factory):
    kw = CASES[case]
    plain = _run(framework, tmp_path_factory, **kw)
    sharded = _run(framework, tmp_path_factory, shard_optimizer=True, **kw)
    a, b = plain.backend.parameters_numpy(), sharded.backend.parameters_numpy()
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=BOUND, atol=BOUND, err_msg=name)
    assert_moved(sharded.start, b)  # every parameter trained (a dropped shard would leave some where they were)
    assert_same_on_every_rank(sharded.backend, fingerprint(b), "weights after sharded steps")
    if kw.get("loss_scale"):  # the NaN step was skipped on every rank, and the scale halved alike
        assert sharded.backend.loss_scale() == plain.backend.loss_scale() < 2.0 ** 16


def _sharded(backend):
    """The sharded update of either backend."""
    return backend.sharded if backend.name == "mxnet" else backend.optimizer


def _optimizer_leaves(state):
    """The optimizer state's arrays, in a fixed order, for either framework's state_dict format."""
    opt = state["optimizer"]
    if "states" in opt:  # MXNet: arrays per structural name
        return [np.asarray(a) for name in sorted(opt["states"]) for a in opt["states"][name]]
    return [np.asarray(v) for i in sorted(opt["state"], key=int) for k, v in sorted(opt["state"][i].items())
            if np.asarray(v).ndim > 0]


def test_checkpoint_holds_the_whole_optimizer_state_and_resumes(framework, tmp_path_factory):
    kw = dict(momentum=0.9, weight_decay=1e-3, no_wd=True, optimizer="adam" if framework == "torch" else "sgd",
              base_lr=0.01)
    plain = _run(framework, tmp_path_factory, **kw)
    sharded = _run(framework, tmp_path_factory, shard_optimizer=True, **kw)
    want = _optimizer_leaves(plain.backend.state_dict())
    whole = sum(a.size for a in want)
    # Between checkpoints (fit() wrote one per epoch) each rank holds its shard of the state alone: 1/size of it.
    held = _sharded(sharded.backend).held_elements()
    assert held <= -(-whole // sharded.backend.size) + 8, (held, whole)
    sharded.backend.gather_state()  # every rank; the whole state then lies on rank 0 alone, for one state_dict()
    if sharded.backend.rank == 0:
        got = _optimizer_leaves(sharded.backend.state_dict())
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):  # the plain optimizer's format, every element: a checkpoint is not sharded
            np.testing.assert_allclose(g, w, rtol=BOUND, atol=BOUND)
    assert _sharded(sharded.backend).held_elements() == held, "state_dict() frees the gathered state"

    # Stopped after epoch 1 and resumed from its checkpoint, a sharded run ends where an uninterrupted one does.
    whole = tiny(framework, tmp_path_factory, epochs=2, shard_optimizer=True, **kw)
    whole.fit()
    first = tiny(framework, tmp_path_factory, epochs=1, shard_optimizer=True, **kw)
    first.fit()
    out = first.cfg.output_dir if first.backend.rank == 0 else None
    out = first.backend.broadcast_object(out)
    resumed = tiny(framework, tmp_path_factory, epochs=2, shard_optimizer=True, **kw)
    resumed.cfg.output_dir, resumed.cfg.resume = out, "auto"
    resumed.fit()
    assert resumed.global_step == whole.global_step
    a, b = whole.backend.parameters_numpy(), resumed.backend.parameters_numpy()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=BOUND, atol=BOUND, err_msg=name)
