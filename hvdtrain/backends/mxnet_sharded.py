"""``--shard-optimizer`` on MXNet: the optimizer update split across ranks (hvdtrain.shard explains the layout).

horovod.mxnet's DistributedTrainer allreduces every gradient and runs Gluon's whole update on every rank. Here the
gradients go as one reduce-scatter, each rank runs the recipe's MXNet optimizer (SGD, NAG, Adam, with each
parameter's lr_mult and wd_mult: --no-wd) on its shard of the weights, and one allgather brings every rank the
updated weights. The scaling is DistributedTrainer's on the CPU: a sum over ranks, divided by size x samples in
``rescale_grad``. Each rank keeps float32 weights and the optimizer state of its shard only (created at once, not
lazily); the Gluon parameters hold what the allgather brings, in their own type.

Float16 (a GPU's --precision auto): the shard's float32 weights are the master copies that MXNet's multi-precision
update keeps, so a float16 network updates as with ``multi_precision=True``; BatchNorm's parameters stay float32. The
gradients travel in the widest type of the parameters (float16 when all are, else float32) and the updated weights
likewise. A checkpoint holds the master copies where the plain optimizer keeps them (:func:`master_position`).

The optimizer is the Gluon Trainer's own (one learning rate, one update count); the shard's parameter groups use
indices after the Trainer's, so the two never meet. ``state_dict()`` is the plain backend's optimizer format (arrays
per structural parameter name), so a checkpoint does not depend on --shard-optimizer or the world size; after steps
it needs ``gather_state()`` on every rank first, which leaves the whole state on rank 0 for one ``state_dict()`` and
nowhere else: between checkpoints each rank holds 1/size of it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..shard import ShardLayout


def flatten_state(state) -> List[Any]:
    """An optimizer state (None, an NDArray, or nested tuples of them) as a list of NDArrays, in order."""
    if state is None:
        return []
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in flatten_state(s)]
    return [state]


def master_position(mx, optimizer) -> int:
    """Where MXNet's multi-precision state of a float16 weight keeps its float32 master copy, in
    :func:`flatten_state` order: last for SGD and NAG (momentum, master), first for the others, Adam included
    (master, (mean, variance)). Read from a probe state whose weight is 1 and whose other arrays start at 0."""
    saved = optimizer.multi_precision
    optimizer.multi_precision = True
    try:
        probe = flatten_state(optimizer.create_state_multi_precision(0, mx.nd.ones((1,), dtype="float16")))
    finally:
        optimizer.multi_precision = saved
    return next(i for i, a in enumerate(probe) if a.dtype == np.float32 and float(a.asnumpy()[0]) == 1.0)


def split_master(arrays: List[Any], n_state: int, position: int, name: str) -> Tuple[List[Any], Any]:
    """A parameter's saved optimizer arrays as (state without a master copy, the master copy or None): a checkpoint
    of a float16 run holds one array more per float16 parameter than a float32 run's, so either resumes the other."""
    arrays = list(arrays)
    if len(arrays) == n_state:
        return arrays, None
    if len(arrays) == n_state + 1:
        return arrays[:position] + arrays[position + 1:], arrays[position]
    raise ValueError(f"optimizer state of {name} has {len(arrays)} arrays, the optimizer {n_state} (or {n_state + 1} "
                     f"with float16 master weights)")


def join_master(state: List[Any], master: Any, position: int) -> List[Any]:
    """The inverse of :func:`split_master`: a parameter's arrays with its master copy where the optimizer keeps it."""
    return list(state[:position]) + [master] + list(state[position:])


class MXNetShardedUpdate:
    def __init__(self, mx, hvd, named_params: List[Tuple[str, Any]], optimizer, first_index: int, ctx,
                 compression, predivide: float, name: Callable[[str], str]):
        self.mx, self.hvd, self.opt, self.ctx = mx, hvd, optimizer, ctx
        self.compression, self.predivide, self.name = compression, predivide, name
        self.rank = hvd.rank()
        # One group per (lr_mult, wd_mult), in order of first appearance; the layout wants each group contiguous.
        keys: List[Tuple[float, float]] = []
        for _, p in named_params:
            if (p.lr_mult, p.wd_mult) not in keys:
                keys.append((p.lr_mult, p.wd_mult))
        ordered = [(k, n, p) for k in keys for n, p in named_params if (p.lr_mult, p.wd_mult) == k]
        self.names = [n for _, n, _ in ordered]
        self.params = [p for _, _, p in ordered]
        self.dtypes = [np.dtype(p.dtype) for p in self.params]
        self.wire = np.result_type(*self.dtypes)  # float16 only when every parameter is
        # The parameters whose plain multi-precision state holds a float32 master copy, and where it holds it.
        self.masters = [bool(optimizer.multi_precision) and d == np.float16 for d in self.dtypes]
        self.master_at = master_position(mx, optimizer)
        self.shapes = [tuple(p.shape) for p in self.params]
        owner = [keys.index(k) for k, _, _ in ordered]
        self.layout = ShardLayout([int(np.prod(s)) for s in self.shapes], owner, hvd.size(), self.rank)
        self.segments = self.layout.segments()
        nd = mx.nd
        # The shard's groups that are not empty here: (optimizer index, range in the shard, float32 weights, state).
        self.groups = []
        for g, (a, b) in enumerate(self.layout.group_ranges(len(keys))):
            index = first_index + g
            # The optimizer reads lr_mult and wd_mult from param_dict: any parameter of the group carries them.
            optimizer.param_dict[index] = next(p for k, _, p in ordered if k == keys[g])
            if a < b:
                weights = nd.zeros((b - a,), ctx=ctx, dtype="float32")
                self.groups.append((index, a, b, weights, optimizer.create_state(index, weights)))
        probe = optimizer.create_state(first_index, nd.zeros((1,), ctx=ctx, dtype="float32"))
        self.n_state = len(flatten_state(probe))  # arrays per parameter in the optimizer state, besides a master
        self.grads: List[Any] = []
        self._whole: Optional[Dict[str, List[np.ndarray]]] = None  # rank 0, after gather_state or a load
        self._stepped = False  # the shard's state changed since it was created
        self.take_weights()

    def states(self) -> List[Any]:
        """This rank's optimizer states (one per non-empty group): what momentum correction rescales."""
        return [state for *_, state in self.groups]

    def held_elements(self) -> int:
        """Elements of optimizer state this rank holds now (float16's master weights included, as the plain
        optimizer keeps them): its shard's, plus the whole state while rank 0 holds it for a checkpoint."""
        mine = sum(int(a.size) for *_, weights, state in self.groups
                   for a in flatten_state(state) + ([weights] if any(self.masters) else []))
        whole = sum(int(np.size(a)) for arrays in (self._whole or {}).values() for a in arrays)
        return mine + whole

    def take_weights(self) -> None:
        """The shard's float32 weights from the parameters, after these were set from outside the update (the
        start-up broadcast, --init-from, a checkpoint)."""
        if not self.segments:
            return
        shard = self.mx.nd.concat(*[self.params[s.param].data(self.ctx).reshape((-1,))[s.start:s.stop]
                                    .astype("float32") for s in self.segments], dim=0)
        for _, a, b, weights, _ in self.groups:
            weights[:] = shard[a:b]

    def reduce(self) -> None:
        """Reduce-scatter the gradients: afterwards ``self.grads`` hold this shard's gradients summed over ranks."""
        nd, layout = self.mx.nd, self.layout
        parts = [p.grad(self.ctx).reshape((-1,)) for p in self.params]
        parts = [g if g.dtype == self.wire else g.astype(self.wire) for g in parts]
        if layout.padded > layout.total:
            parts.append(nd.zeros((layout.padded - layout.total,), ctx=self.ctx, dtype=self.wire))
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
        """Update this rank's float32 shard with the reduced gradients, then allgather the weights into the
        parameters."""
        nd, layout, opt = self.mx.nd, self.layout, self.opt
        opt.rescale_grad = rescale_grad
        for (index, a, b, weights, state), grad in zip(self.groups, self.grads):
            opt.update(index, weights, grad if grad.dtype == np.float32 else grad.astype("float32"), state)
        self._stepped = True
        parts = [weights for _, _, _, weights, _ in self.groups]
        if layout.shard > layout.hi - layout.lo:
            parts.append(nd.zeros((layout.shard - (layout.hi - layout.lo),), ctx=self.ctx, dtype="float32"))
        mine = nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0].copy()
        if self.wire != np.float32:
            mine = mine.astype(self.wire)
        # Horovod: allgather the updated shards: every rank holds every updated weight again.
        whole = self.hvd.allgather(mine, name=self.name("shard.weights"))
        for p, dtype, shape, (i, a, b) in zip(self.params, self.dtypes, self.shapes, layout.param_slices()):
            value = whole[a:b].reshape(shape)
            p.data(self.ctx)[:] = value if value.dtype == dtype else value.astype(dtype)

    # --- state: the plain backend's format --------------------------------------------------------------------
    def gather_state(self) -> None:
        """Collective: every rank's shard of the optimizer state (and of the master weights) to rank 0, by
        parameter name in the plain optimizer's format, for one :meth:`state_arrays`; the other ranks keep none."""
        nd, layout = self.mx.nd, self.layout
        columns = self.n_state + (1 if any(self.masters) else 0)  # the last: the float32 weights (master copies)
        whole: Dict[str, List[np.ndarray]] = {n: [] for n in self.names}
        for j in range(columns):
            shard = nd.zeros((layout.shard,), ctx=self.ctx, dtype="float32")
            for _, a, b, weights, state in self.groups:
                shard[a:b] = flatten_state(state)[j] if j < self.n_state else weights
            # Horovod: the state shards to every rank (Horovod has no gather); only rank 0 keeps them.
            full = self.hvd.allgather(shard, name=self.name(f"shard.state.{j}"))
            if self.rank == 0:
                full = full.asnumpy()
                for name, shape, (i, a, b) in zip(self.names, self.shapes, layout.param_slices()):
                    whole[name].append(full[a:b].reshape(shape).copy())
            del full
        if self.rank == 0:
            for name, master in zip(self.names, self.masters):
                weights = whole[name].pop() if columns > self.n_state else None
                if master:
                    whole[name] = join_master(whole[name], weights, self.master_at)
        self._whole = whole if self.rank == 0 else None

    def state_arrays(self) -> Dict[str, List[np.ndarray]]:
        """The whole state by structural name, once: rank 0 after :meth:`gather_state` (or a load), which then frees
        it; {} while the state is as created."""
        if self._whole is not None:
            whole, self._whole = self._whole, None
            return whole
        if not self._stepped:
            return {}
        raise RuntimeError("the sharded optimizer's state is spread over the ranks: every rank must call "
                           "gather_state() before rank 0 calls state_dict()")

    def load_state_arrays(self, arrays: Dict[str, List[np.ndarray]], keep_whole: bool = False) -> None:
        """Take this rank's shard of a whole state by structural name (the plain backend's format, of a float16 or
        a float32 run); the parameters must hold the checkpoint's weights already. With ``keep_whole`` rank 0 keeps
        the whole state for the broadcast that follows a checkpoint's load (:meth:`state_arrays` frees it)."""
        nd = self.mx.nd
        arrays = {n: v for n, v in arrays.items() if n in set(self.names)}
        self.take_weights()
        if arrays:
            missing = sorted(set(self.names) - set(arrays))
            if missing:
                raise ValueError(f"optimizer state lacks parameter(s) {missing[:5]}")
            columns: Dict[str, List[np.ndarray]] = {}
            for i, name in enumerate(self.names):
                state, master = split_master(arrays[name], self.n_state, self.master_at, name)
                weights = master if master is not None else self.params[i].data(self.ctx).asnumpy()
                columns[name] = [np.asarray(a, np.float32) for a in state] + [np.asarray(weights, np.float32)]
            for j in range(self.n_state + 1):
                shard = np.zeros(self.layout.shard, dtype=np.float32)
                for s in self.segments:
                    flat = columns[self.names[s.param]][j].reshape(-1)
                    shard[s.at:s.at + s.stop - s.start] = flat[s.start:s.stop]
                for _, a, b, weights, state in self.groups:
                    target = flatten_state(state)[j] if j < self.n_state else weights
                    target[:] = nd.array(shard[a:b], ctx=self.ctx, dtype=target.dtype)
            if self.rank == 0 and keep_whole:
                self._whole = {n: join_master(c[:-1], c[-1], self.master_at) if master else c[:-1]
                               for (n, c), master in zip(columns.items(), self.masters)}
        self._stepped = bool(arrays)
