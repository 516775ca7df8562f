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

from typing import Any, Iterable, List, Sequence, Tuple

BUCKETS = -1
"""``groups`` for DDP's buckets: the first closed at FIRST_BUCKET_BYTES, each of the others at BUCKET_BYTES."""
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


def _grouped_allreduce_grad_async(self, ps: Tuple[Any, ...]):
    from horovod.torch.mpi_ops import Average, grouped_allreduce_async_
    name = self._parameter_names.get(ps[0])
    tensors, ctxs = zip(*[self._compression.compress(p.grad) for p in ps])
    # As the per-gradient path: the average split into a division before the sum and the rest after it.
    pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor) if self.op == Average \
        else (1.0, 1.0)
    handle = grouped_allreduce_async_(tensors, name=name, op=self.op, prescale_factor=pre, postscale_factor=post,
                                      process_set=self.process_set)
    return handle, ctxs


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


def distributed_optimizer(optimizer, named_parameters: Iterable, compression, backward_passes_per_step: int,
                          predivide: float, groups: int):
    """``hvd.DistributedOptimizer(optimizer, ..., op=Average, groups=groups)`` with the grouped path fixed (see the
    module docstring); ``groups`` > 0, or :data:`BUCKETS`; ``named_parameters`` in the model's registration order."""
    named_parameters = list(named_parameters)
    from horovod.torch.mpi_ops import Average
    from horovod.torch.optimizer import _DistributedOptimizer
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update(_register_hooks=_register_hooks, _grouped_allreduce_grad_async=_grouped_allreduce_grad_async,
                   synchronize=_make_synchronize(_DistributedOptimizer.synchronize))
    # One class level above the user's optimizer, as Horovod builds it: its __init__ calls super(self.__class__).
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    # The groups as Horovod's list form (which its own _register_hooks would broadcast; ours takes them as they are).
    planned = [list(group) for group in plan([p for _, p in named_parameters], groups)]
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, Average, predivide,
               planned)
