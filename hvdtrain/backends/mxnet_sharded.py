"""``--shard-optimizer`` on MXNet: the optimizer update split across ranks (hvdtrain.shard explains the layout).

horovod.mxnet's DistributedTrainer allreduces every gradient and runs Gluon's whole update on every rank. Here the
gradients go as one reduce-scatter, each rank runs the recipe's MXNet optimizer (SGD, NAG, Adam, with each
parameter's lr_mult and wd_mult: --no-wd) on its shard of the weights, and one allgather brings every rank the
updated weights. The scaling is DistributedTrainer's on the CPU: a sum over ranks, divided by size x samples in
``rescale_grad``. The Gluon parameters stay the record of the weights; each rank keeps the optimizer state of its
shard only (created at once, not lazily).

The optimizer is the Gluon Trainer's own (one learning rate, one update count); the shard's parameter groups use
indices after the Trainer's, so the two never meet. ``state_dict()`` is the plain backend's optimizer format (arrays
per structural parameter name), so a checkpoint does not depend on --shard-optimizer or the world size; after steps
it needs ``gather_state()`` on every rank first.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ..shard import ShardLayout


def flatten_state(state) -> List[Any]:
    """An optimizer state (None, an NDArray, or nested tuples of them) as a list of NDArrays, in order."""
    if state is None:
        return []
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in flatten_state(s)]
    return [state]


class MXNetShardedUpdate:
    def __init__(self, mx, hvd, named_params: List[Tuple[str, Any]], optimizer, first_index: int, ctx,
                 compression, predivide: float, name: Callable[[str], str]):
        self.mx, self.hvd, self.opt, self.ctx = mx, hvd, optimizer, ctx
        self.compression, self.predivide, self.name = compression, predivide, name
        # One group per (lr_mult, wd_mult), in order of first appearance; the layout wants each group contiguous.
        keys: List[Tuple[float, float]] = []
        for _, p in named_params:
            if (p.lr_mult, p.wd_mult) not in keys:
                keys.append((p.lr_mult, p.wd_mult))
        ordered = [(k, n, p) for k in keys for n, p in named_params if (p.lr_mult, p.wd_mult) == k]
        self.names = [n for _, n, _ in ordered]
        self.params = [p for _, _, p in ordered]
        dtypes = {np.dtype(p.dtype) for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"--shard-optimizer needs parameters of one type, the model has {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.shapes = [tuple(p.shape) for p in self.params]
        owner = [keys.index(k) for k, _, _ in ordered]
        self.layout = ShardLayout([int(np.prod(s)) for s in self.shapes], owner, hvd.size(), hvd.rank())
        self.segments = self.layout.segments()
        nd = mx.nd
        # The shard's groups that are not empty here: (optimizer index, range in the shard, weights, state).
        self.groups = []
        for g, (a, b) in enumerate(self.layout.group_ranges(len(keys))):
            index = first_index + g
            # The optimizer reads lr_mult and wd_mult from param_dict: any parameter of the group carries them.
            optimizer.param_dict[index] = next(p for k, _, p in ordered if k == keys[g])
            if a < b:
                weights = nd.zeros((b - a,), ctx=ctx, dtype=self.dtype)
                self.groups.append((index, a, b, weights, optimizer.create_state_multi_precision(index, weights)))
        probe = optimizer.create_state_multi_precision(first_index, nd.zeros((1,), ctx=ctx, dtype=self.dtype))
        self.n_state = len(flatten_state(probe))  # arrays per parameter in the optimizer state
        self.grads: List[Any] = []
        self._whole: Dict[str, List[np.ndarray]] = {}  # the whole state by name, valid while self._is_whole
        self._is_whole = True

    def states(self) -> List[Any]:
        """This rank's optimizer states (one per non-empty group): what momentum correction rescales."""
        return [state for *_, state in self.groups]

    def reduce(self) -> None:
        """Reduce-scatter the gradients: afterwards ``self.grads`` hold this shard's gradients summed over ranks."""
        nd, layout = self.mx.nd, self.layout
        parts = [p.grad(self.ctx).reshape((-1,)) for p in self.params]
        if layout.padded > layout.total:
            parts.append(nd.zeros((layout.padded - layout.total,), ctx=self.ctx, dtype=self.dtype))
        flat = nd.concat(*parts, dim=0)
        compressed, ctx = self.compression.compress(flat)
        # Horovod: one reduce-scatter of every gradient (the first half of a ring allreduce): each rank receives its
        # shard, summed; the average is taken in rescale_grad, as DistributedTrainer does on the CPU.
        shard = self.hvd.reducescatter(compressed, op=self.hvd.Sum, name=self.name("shard.grad"),
                                       prescale_factor=1.0 / self.predivide)
        shard = self.compression.decompress(shard, ctx)
        self.grads = [shard[a:b] for _, a, b, _, _ in self.groups]

    def finite_here(self) -> bool:
        nd = self.mx.nd
        if not self.grads:
            return True
        return bool(nd.multi_all_finite(*self.grads, num_arrays=len(self.grads), init_output=True).asscalar() > 0)

    def update(self, rescale_grad: float) -> None:
        """Update this rank's shard with the reduced gradients, then allgather the weights into the parameters."""
        nd, layout, opt = self.mx.nd, self.layout, self.opt
        if self.segments:
            shard = nd.concat(*[self.params[s.param].data(self.ctx).reshape((-1,))[s.start:s.stop]
                                for s in self.segments], dim=0)
            for (index, a, b, weights, state), grad in zip(self.groups, self.grads):
                weights[:] = shard[a:b]
        opt.rescale_grad = rescale_grad
        for (index, a, b, weights, state), grad in zip(self.groups, self.grads):
            opt.update_multi_precision(index, weights, grad, state)
        self._is_whole = False
        parts = [weights for _, _, _, weights, _ in self.groups]
        if layout.shard > layout.hi - layout.lo:
            parts.append(nd.zeros((layout.shard - (layout.hi - layout.lo),), ctx=self.ctx, dtype=self.dtype))
        mine = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0].copy()
        # Horovod: allgather the updated shards: every rank holds every updated weight again.
        whole = self.hvd.allgather(mine, name=self.name("shard.weights"))
        for p, shape, (i, a, b) in zip(self.params, self.shapes, layout.param_slices()):
            p.data(self.ctx)[:] = whole[a:b].reshape(shape)

    # --- state: the plain backend's format --------------------------------------------------------------------
    def gather_state(self) -> None:
        """Collective: every rank's shard of the optimizer state to every rank, by parameter name."""
        if self._is_whole:
            return
        nd, layout = self.mx.nd, self.layout
        whole: Dict[str, List[np.ndarray]] = {n: [] for n in self.names}
        for j in range(self.n_state):
            shard = nd.zeros((layout.shard,), ctx=self.ctx, dtype="float32")
            for _, a, b, _, state in self.groups:
                shard[a:b] = flatten_state(state)[j].astype("float32")
            # Horovod: the state shards to every rank (a checkpoint holds the whole state).
            full = self.hvd.allgather(shard, name=self.name(f"shard.state.{j}")).asnumpy()
            for name, shape, (i, a, b) in zip(self.names, self.shapes, layout.param_slices()):
                whole[name].append(full[a:b].reshape(shape).copy())
        self._whole = whole
        self._is_whole = True

    def state_arrays(self) -> Dict[str, List[np.ndarray]]:
        """The whole state by structural name ({} before the first step: as created)."""
        if not self._is_whole:
            raise RuntimeError("the sharded optimizer's state is spread over the ranks: every rank must call "
                               "gather_state() before state_dict()")
        return dict(self._whole)

    def load_state_arrays(self, arrays: Dict[str, List[np.ndarray]]) -> None:
        """Take this rank's shard of a whole state by structural name (the plain backend's format)."""
        nd = self.mx.nd
        arrays = {n: v for n, v in arrays.items() if n in set(self.names)}
        if arrays:
            missing = sorted(set(self.names) - set(arrays))
            if missing:
                raise ValueError(f"optimizer state lacks parameter(s) {missing[:5]}")
            for name in self.names:
                if len(arrays[name]) != self.n_state:
                    raise ValueError(f"optimizer state of {name} has {len(arrays[name])} arrays, the optimizer "
                                     f"{self.n_state}")
            for j in range(self.n_state):
                shard = np.zeros(self.layout.shard, dtype=np.float32)
                for s in self.segments:
                    flat = np.asarray(arrays[self.names[s.param]][j]).reshape(-1)
                    shard[s.at:s.at + s.stop - s.start] = flat[s.start:s.stop]
                for _, a, b, _, state in self.groups:
                    target = flatten_state(state)[j]
                    target[:] = nd.array(shard[a:b], ctx=self.ctx, dtype=target.dtype)
        self._whole = {n: [np.array(a, copy=True) for a in v] for n, v in arrays.items()}
        self._is_whole = True
