"""Grouped gradient allreduces for horovod.torch that mean what the per-gradient allreduces mean.

``hvd.DistributedOptimizer(..., groups=N)`` (Horovod 0.28.1, horovod/torch/optimizer.py) differs from its own
per-gradient path in three ways that hvdtrain cannot accept, since groups are its CPU default:

- ``_grouped_allreduce_grad_async`` passes no prescale/postscale factor: ``gradient_predivide_factor`` (--predivide)
  is silently ignored, and fp16-compressed gradients that the predivide would keep in range overflow;
- ``_register_hooks`` orders the parameters by ``broadcast_object`` from rank 0: a cloudpickle collective, run
  whenever an optimizer is built, which a worker joining an elastic job runs and the survivors do not (a hang);
- a parameter that gets no gradient on one rank (a data-dependent branch) leaves its group incomplete there, and
  ``synchronize`` then allreduces it alone under another name than the ranks that completed the group: a stall.

The class built here is Horovod's ``_DistributedOptimizer`` with those three methods replaced: groups formed without
a collective (:func:`plan`), the grouped allreduce scaled like the per-gradient one, and every group submitted at
``synchronize`` with zeros for the gradients a rank did not compute (what DDP's ``find_unused_parameters`` does).
Everything else (hooks, accumulation, ``skip_synchronize``) is Horovod's.

The groups follow the backward pass, as DDP's buckets do: the parameters in reverse order of registration (the order
in which the backward pass produces their gradients, for a network that uses its layers in the order it declares
them), cut into runs. A group is sent as soon as its last gradient is ready, so a small first group leaves while the
rest of the backward pass runs. Horovod's own groups (and hvdtrain's before) cut the parameters in forward order or
by name, so every group held a gradient of the first layers, which come last, and nothing was sent before the
backward pass ended (measured at 2 shaped hosts: DDP's early first bucket was worth 8 of its 14 points over hvdtrain).
Registration order is the same on every rank that builds the model with the same code, which DDP assumes as well.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

from ..config import GROUPS_BUCKETS

BUCKETS = GROUPS_BUCKETS
"""``groups`` for DDP's buckets: the first closed at FIRST_BUCKET_BYTES, each of the others at BUCKET_BYTES (the
value of ``--allreduce-groups buckets``, which auto resolves to on PyTorch's CPU)."""
FIRST_BUCKET_BYTES = 1 << 20
"""DDP's first bucket (torch.distributed's default first-bucket size): small, so it leaves early in the backward
pass."""
BUCKET_BYTES = 25 << 20
"""DDP's default ``bucket_cap_mb``."""


def plan(params: Sequence[Any], groups: int) -> List[Tuple[Any, ...]]:
    """``params`` (tensors in registration order) as the groups their allreduces are sent in, in the order the
    backward pass completes them: the last registered first (:func:`plan_sizes`)."""
    return [tuple(params[i] for i in group)
            for group in plan_sizes([p.numel() * p.element_size() for p in params], groups)]


def plan_sizes(sizes: Sequence[int], groups: int) -> List[List[int]]:
    """The groups of :func:`plan` as indices into ``sizes`` (each parameter's bytes, in registration order), the
    last registered first. ``groups`` > 0: that many runs of about equal bytes (fewer when there are fewer
    parameters); :data:`BUCKETS`: DDP's buckets, each closed once it holds its cap or more. (The cost model plans a
    profiled network's groups with it: ``bench network --predict-from``.)"""
    order = list(reversed(range(len(sizes))))
    out: List[List[int]] = []
    current: List[int] = []
    filled = 0
    if groups == BUCKETS:
        for i in order:
            current.append(i)
            filled += sizes[i]
            if filled >= (FIRST_BUCKET_BYTES if not out else BUCKET_BYTES):
                out.append(current)
                current, filled = [], 0
        return out + [current] if current else out
    if groups < 1:
        raise ValueError(f"groups must be at least 1 or BUCKETS, got {groups}")
    total = sum(sizes)
    for k, i in enumerate(order):
        current.append(i)
        filled += sizes[i]
        after, still = len(order) - k - 1, groups - len(out) - 1  # parameters left; groups to open after this one
        if still > 0 and (filled * groups >= total * (len(out) + 1) or after == still):
            out.append(current)
            current = []
    return out + [current] if current else out


def _register_hooks(self) -> None:
    from horovod.torch.optimizer import _DistributedOptimizer
    # self._groups: plan()'s groups (distributed_optimizer), of the parameters this optimizer updates and trains
    mine = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
    ids = {id(p) for p in mine}
    groups = [tuple(p for p in group if id(p) in ids) for group in self._groups]
    grouped = {id(p) for group in groups for p in group}
    for group in [g for g in groups if g] + [(p,) for p in mine if id(p) not in grouped]:  # Horovod's rule: alone
        for p in group:
            self._p_to_group[p] = group
        self._group_counts[group] = 0
    # Horovod's own hook registration, which forms (and broadcasts) groups only while _groups is set.
    groups, self._groups = self._groups, None
    try:
        _DistributedOptimizer._register_hooks(self)
    finally:
        self._groups = groups


def _scales(self) -> Tuple[float, float]:
    """As the per-gradient path: the average split into a division before the sum and the rest after it."""
    from horovod.torch.mpi_ops import Average
    return (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) if self.op == Average else (1.0, 1.0)


def _grouped_allreduce_grad_async(self, ps: Tuple[Any, ...]):
    from horovod.torch.mpi_ops import grouped_allreduce_async_
    late = self._late
    grads = [p.grad for p in ps]
    first = late is not None and any(p is late.param for p in ps)
    if first:  # the first group: the late parameter's first half only
        grads = [late.head() if p is late.param else g for p, g in zip(ps, grads)]
    tensors, ctxs = zip(*[self._compression.compress(g) for g in grads])
    if first:
        # Horovod writes the group's results into its gradients (p.grad.set_(result)); the half's result goes into
        # the half and the whole gradient is what the parameter keeps (_Halves.decompress).
        ctxs = tuple(_Half(ctx, g, late.param.grad) if p is late.param else ctx for p, g, ctx in zip(ps, grads, ctxs))
    pre, post = _scales(self)
    handle = grouped_allreduce_async_(tensors, name=self._parameter_names.get(ps[0]), op=self.op,
                                      prescale_factor=pre, postscale_factor=post, process_set=self.process_set)
    if late is not None and any(p is late.after for p in ps):
        late.send(self)  # the second half, queued behind this group
    return handle, ctxs


class _Half:
    """The compression context of the late parameter's first half: its own context, the half (a view of the whole
    gradient, where the result goes) and the whole gradient (what Horovod's synchronize sets the gradient to)."""

    def __init__(self, ctx, half, whole):
        self.ctx, self.half, self.whole = ctx, half, whole


class _Halves:
    """The optimizer's compression with :class:`_Half` contexts understood: the half's result written into the
    half, the whole gradient returned. Other contexts go to the compression as they are."""

    def __init__(self, compression):
        self.compression = compression

    def compress(self, tensor):
        return self.compression.compress(tensor)

    def decompress(self, tensor, ctx):
        if not isinstance(ctx, _Half):
            return self.compression.decompress(tensor, ctx)
        _into(ctx.half, self.compression.decompress(tensor, ctx.ctx))
        return ctx.whole


def _into(destination, result) -> None:
    """An allreduce's result into ``destination`` (a copy unless the allreduce ran in place)."""
    if result.data_ptr() != destination.data_ptr():
        destination.copy_(result)


class LateParameter:
    """--overlap-forward: the largest gradient of the group the backward pass completes first (``param``, of a layer
    near the output), sent in two halves: the first with its group, the second after the group the backward pass
    completes last (``after``, the first layers'; with one group, that group: the second half goes right behind
    it). synchronize() then waits for everything but the second half, and
    the step updates every other parameter; the parameter itself is updated by :meth:`settle`, which the module
    that owns it calls as the next forward pass reaches it (a forward pre-hook), and the backend before anything
    reads the model.

    On the wire the order is: the first group's gradients with the first half; the other groups; the second half. So
    the first layers' update and the next forward pass through them run while the second half is sent, where
    before the link stood idle from the end of the allreduce to the next step's backward pass reaching this layer.

    Every rank submits the same tensors under the same names, each once per step, in the order the backward pass
    makes them (as without the split): no rank waits for a collective another rank has not submitted. The second
    half is scaled by half before the sum and twice after it, which Horovod's fusion cannot join to the group
    before it (responses fuse only at equal scale factors) and which leaves every value as it was (a power of two);
    the update uses the rate of the step that computed the gradient."""

    def __init__(self, param, after: Tuple[Any, ...]):
        self.param, self.after = param, after[0]
        self.half = param.numel() // 2
        self.pending = None  # (handle, context, the second half) while it is on the wire
        self.grad = None  # the gradient while the step waits for it
        self.rates: Optional[List[float]] = None

    def head(self):
        return self.param.grad.view(-1)[:self.half]

    def send(self, optimizer) -> None:
        from horovod.torch.mpi_ops import grouped_allreduce_async_
        if self.pending is not None or self.grad is not None:
            raise RuntimeError(f"--overlap-forward: the update of {optimizer._parameter_names.get(self.param)} from "
                               f"the last step was not applied before the parameter was used again: the model uses "
                               f"it outside its module's forward pass, which is where the update is hooked; run "
                               f"without --overlap-forward")
        if self.param.grad is None:  # this rank did not use the layer: its gradient counts as zeros
            self.param.grad = self.param.data.new_zeros(self.param.size())
        tail = self.param.grad.view(-1)[self.half:]
        tensor, ctx = optimizer._compression.compress(tail)
        pre, post = _scales(optimizer)
        handle = grouped_allreduce_async_([tensor], name=f"{optimizer._parameter_names.get(self.param)}.second_half",
                                          op=optimizer.op, prescale_factor=pre * 0.5, postscale_factor=post * 2.0,
                                          process_set=optimizer.process_set)
        self.pending = (handle, ctx, tail)

    def hold(self, optimizer) -> None:
        """Before the optimizer's step, while the second half is on the wire: keep this parameter's gradient (and
        the step's rates) for :meth:`settle`, so that the step updates every other parameter."""
        if self.pending is None or self.grad is not None:
            return
        self.grad, self.param.grad = self.param.grad, None
        self.rates = [group["lr"] for group in optimizer.param_groups]

    def settle(self, optimizer) -> None:
        """Wait for the second half and update the parameter with it, at the rates of the step that computed it;
        nothing when no update waits."""
        if self.pending is None:
            return
        import torch
        from horovod.torch.mpi_ops import synchronize
        handle, ctx, tail = self.pending
        self.pending = None
        _into(tail, optimizer._compression.decompress(synchronize(handle)[0], ctx))
        if self.grad is None:  # step() never ran (the step was abandoned): the gradient is dropped
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        others = [(p, p.grad) for p in params if p is not self.param and p.grad is not None]
        rates = [group["lr"] for group in optimizer.param_groups]
        try:
            for p, _ in others:
                p.grad = None
            for group, rate in zip(optimizer.param_groups, self.rates):
                group["lr"] = rate
            self.param.grad, self.grad = self.grad, None
            # The hook runs inside the forward pass's autocast: the update runs as the step's did, outside it.
            with optimizer.skip_synchronize(), torch.autocast(self.param.device.type, enabled=False):
                optimizer.step()
        finally:
            self.param.grad = None
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
            for p, grad in others:
                p.grad = grad

    def hook(self, optimizer, model) -> None:
        """The forward pre-hook on the module that owns the parameter: the update lands before the layer runs."""
        owner = next((m for m in model.modules() if any(q is self.param for q in m._parameters.values())), None)
        if owner is None:
            raise ValueError("the parameter to update late belongs to no module of the model")
        owner.register_forward_pre_hook(lambda module, args: self.settle(optimizer))


def _make_synchronize(horovod_synchronize):
    def synchronize(self) -> None:
        if self.process_set.included() and self._group_counts:
            submitted = {key for key in self._handles if isinstance(key, tuple)}
            for group in self._group_counts:
                if group in submitted:
                    continue
                # Horovod: every rank submits every group under the same name; a gradient this rank did not compute
                # counts as zeros (the others may have computed it).
                for p in group:
                    if p.grad is None:
                        p.grad = p.data.new_zeros(p.size())
                    self._handles.pop(p, None)
                self._handles[group] = self._grouped_allreduce_grad_async(group)
                self._group_counts[group] = 0
        horovod_synchronize(self)
    return synchronize


def _step(self, closure=None):
    """Horovod's step; with --overlap-forward's second half on the wire, for every parameter but the late one."""
    from horovod.torch.optimizer import _DistributedOptimizer
    if self._late is not None:
        self._late.hold(self)
    return _DistributedOptimizer.step(self, closure)


def _settle(self) -> None:
    """--overlap-forward: the late parameter's update, if one waits (:meth:`LateParameter.settle`)."""
    if self._late is not None:
        self._late.settle(self)


def distributed_optimizer(optimizer, named_parameters: Iterable, compression, backward_passes_per_step: int,
                          predivide: float, groups: int, overlap_forward: bool = False):
    """``hvd.DistributedOptimizer(optimizer, ..., op=Average, groups=groups)`` with the grouped path fixed (see the
    module docstring); ``groups`` > 0, or :data:`BUCKETS`; ``named_parameters`` in the model's registration order.
    ``overlap_forward``: the first group's largest gradient as a :class:`LateParameter` (``optimizer._late``; with
    one group, the second half follows that group)."""
    named_parameters = list(named_parameters)
    from horovod.torch.mpi_ops import Average
    from horovod.torch.optimizer import _DistributedOptimizer
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update(_register_hooks=_register_hooks, _grouped_allreduce_grad_async=_grouped_allreduce_grad_async,
                   synchronize=_make_synchronize(_DistributedOptimizer.synchronize), _late=None, settle=_settle,
                   step=_step)
    # One class level above the user's optimizer, as Horovod builds it: its __init__ calls super(self.__class__).
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    # The groups as Horovod's list form (which its own _register_hooks would broadcast; ours takes them as they are).
    planned = [list(group) for group in plan([p for _, p in named_parameters], groups)]
    late = None
    if overlap_forward and planned:  # one group: the second half right behind it
        late = LateParameter(max(planned[0], key=lambda p: p.numel()), tuple(planned[-1]))
        compression = _Halves(compression)
    built = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, Average, predivide,
                planned)
    built._late = late
    return built
