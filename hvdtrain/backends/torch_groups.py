"""Grouped gradient allreduces for horovod.torch that mean what the per-gradient allreduces mean.

``hvd.DistributedOptimizer(..., groups=N)`` (Horovod 0.28.1, horovod/torch/optimizer.py) differs from its own
per-gradient path in three ways that hvdtrain cannot accept, since groups are its CPU default:

- ``_grouped_allreduce_grad_async`` passes no prescale/postscale factor: ``gradient_predivide_factor`` (--predivide)
  is silently ignored, and fp16-compressed gradients that the predivide would keep in range overflow;
- ``_register_hooks`` orders the parameters by ``broadcast_object`` from rank 0: a cloudpickle collective, run
  whenever an optimizer is built, which a worker joining an elastic job runs and the survivors do not (a hang);
- a parameter that gets no gradient on one rank (a data-dependent branch) leaves its group incomplete there, and
  ``synchronize`` then allreduces it alone under another name than the ranks that completed the group: a stall.

The class built here is Horovod's ``_DistributedOptimizer`` with those three methods replaced: groups formed from the
parameters sorted by name (the same on every rank, no collective), the grouped allreduce scaled like the per-gradient
one, and every group submitted at ``synchronize`` with zeros for the gradients a rank did not compute (what DDP's
``find_unused_parameters`` does). Everything else (hooks, accumulation, ``skip_synchronize``) is Horovod's.
"""
from __future__ import annotations

from typing import Any, Iterable, Tuple


def _register_hooks(self) -> None:
    from horovod.common.util import split_list
    from horovod.torch.optimizer import _DistributedOptimizer
    # The same order on every rank without a collective: the parameters' names.
    named = sorted((self._parameter_names[p], p) for group in self.param_groups for p in group["params"]
                   if p.requires_grad)
    for group in split_list([p for _, p in named], self._groups):
        group = tuple(group)
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
    module docstring); ``groups`` > 0."""
    from horovod.torch.mpi_ops import Average
    from horovod.torch.optimizer import _DistributedOptimizer
    methods = dict(_DistributedOptimizer.__dict__)
    methods.update(_register_hooks=_register_hooks, _grouped_allreduce_grad_async=_grouped_allreduce_grad_async,
                   synchronize=_make_synchronize(_DistributedOptimizer.synchronize))
    # One class level above the user's optimizer, as Horovod builds it: its __init__ calls super(self.__class__).
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, list(named_parameters), compression, backward_passes_per_step, Average,
               predivide, groups)
