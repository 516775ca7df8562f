"""``--shard-optimizer`` on PyTorch: the optimizer update split across ranks (hvdtrain.shard explains the layout).

Horovod's DistributedOptimizer allreduces every gradient and then runs the whole update on every rank. Here the
gradients go as one reduce-scatter, each rank runs the recipe's own optimizer (torch.optim.SGD/Adam, the same
parameter groups and hyper-parameters) on its shard of the weights only, and one allgather brings every rank the
updated weights. The model's parameters stay the record of the weights (exactly what every rank holds after the
allgather); each rank keeps the optimizer state of its shard only.

``state_dict()`` is the plain optimizer's format (``torch.optim.SGD(...).state_dict()`` of the whole model), so a
checkpoint does not depend on --shard-optimizer or on the world size. After steps it needs ``gather_state()`` first:
a collective every rank runs (the Trainer does, before rank 0 writes a checkpoint), which leaves the whole state on
rank 0 for one ``state_dict()`` and nowhere else: between checkpoints each rank holds 1/size of it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional

import torch

from ..shard import ShardLayout


class ShardedOptimizer:
    def __init__(self, hvd, param_groups: List[Dict[str, Any]], make_optimizer: Callable[[List[Dict[str, Any]]], Any],
                 compression, predivide: float = 1.0):
        self.hvd, self.compression, self.predivide = hvd, compression, predivide
        self.params = [p for group in param_groups for p in group["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"--shard-optimizer needs parameters of one type, the model has {sorted(map(str, dtypes))}")
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        owner = [g for g, group in enumerate(param_groups) for _ in group["params"]]
        self.layout = ShardLayout([p.numel() for p in self.params], owner, hvd.size(), hvd.rank())
        self.segments = self.layout.segments()
        self.ranges = self.layout.group_ranges(len(param_groups))
        # One tensor per parameter group: the group's part of this rank's shard (possibly empty).
        self.pieces = [torch.zeros(b - a, dtype=self.dtype, device=self.device) for a, b in self.ranges]
        self.inner = make_optimizer([{**{k: v for k, v in group.items() if k != "params"}, "params": [piece]}
                                     for group, piece in zip(param_groups, self.pieces)])
        self._group_members = []
        index = 0
        for group in param_groups:
            self._group_members.append(list(range(index, index + len(group["params"]))))
            index += len(group["params"])
        self.rank = hvd.rank()
        self._state: Optional[Dict[int, Dict[str, Any]]] = None  # rank 0: the whole state, for one state_dict()
        self._stepped = False  # the shard's state changed since it was created

    # --- what callers of a torch optimizer use ------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for piece in self.pieces:
            piece.grad = None

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Reduce-scatter the gradients: afterwards this rank's pieces hold the average over ranks of their
        gradients. A gradient this rank did not compute counts as zeros."""
        layout = self.layout
        flat = torch.zeros(layout.padded, dtype=self.dtype, device=self.device)
        for p, offset in zip(self.params, layout.offsets):
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        compressed, ctx = self.compression.compress(flat)
        # Horovod: one reduce-scatter of every gradient (the first half of a ring allreduce): each rank receives the
        # average of its shard only; --predivide splits the average as the allreduce path does.
        shard = self.hvd.reducescatter(compressed, name="hvdtrain.shard.grad", op=self.hvd.Average,
                                       prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        shard = self.compression.decompress(shard, ctx)
        for piece, (a, b) in zip(self.pieces, self.ranges):
            piece.grad = shard[a:b]

    def agree_found_inf(self, found: List[torch.Tensor]) -> None:
        """Loss scaling: each rank unscaled only its shard's gradients; every rank takes (or skips) the step when
        any rank found an inf/NaN."""
        for t in found:
            # Horovod: the ranks' overflow flags summed, so the step is skipped everywhere or nowhere.
            t.copy_(self.hvd.allreduce(t.detach().float().cpu().reshape(1), op=self.hvd.Sum,
                                       name="hvdtrain.shard.found_inf").reshape(t.shape).to(t))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("--shard-optimizer takes no closure")
        self._load_pieces()
        self.inner.step()
        self._stepped = True
        self._publish()

    @torch.no_grad()
    def _load_pieces(self) -> None:
        """This rank's shard from the model (the weights every rank holds)."""
        if not self.segments:
            return
        shard = torch.cat([self.params[s.param].detach().reshape(-1)[s.start:s.stop] for s in self.segments])
        for piece, (a, b) in zip(self.pieces, self.ranges):
            piece.copy_(shard[a:b])

    @torch.no_grad()
    def _publish(self) -> None:
        layout = self.layout
        shard = torch.zeros(layout.shard, dtype=self.dtype, device=self.device)
        shard[:layout.hi - layout.lo] = torch.cat([piece.reshape(-1) for piece in self.pieces])
        # Horovod: allgather the updated shards: every rank holds every updated weight again.
        whole = self.hvd.allgather(shard, name="hvdtrain.shard.weights")
        for p, (i, a, b) in zip(self.params, layout.param_slices()):
            p.copy_(whole[a:b].view_as(p))

    # --- state: the plain optimizer's format ------------------------------------------------------------------
    def held_elements(self) -> int:
        """Elements of optimizer state this rank holds now: its shard's, plus the whole state while rank 0 holds it
        for a checkpoint."""
        def count(states) -> int:
            return sum(v.numel() for s in states for v in s.values() if torch.is_tensor(v))
        return count(self.inner.state.values()) + count((self._state or {}).values())

    def gather_state(self) -> None:
        """Collective: every rank's shard of the optimizer state to rank 0, as the plain optimizer's state, for one
        :meth:`state_dict`; the other ranks keep none of it."""
        layout = self.layout
        state: Dict[int, Dict[str, Any]] = {i: {} for i in range(len(self.params))}
        first = self.inner.state.get(self.pieces[0], {})
        for key in sorted(first):  # the same keys on every rank: the pieces step together
            value = first[key]
            if torch.is_tensor(value) and value.dim() == 1:  # per element (momentum_buffer, exp_avg, ...)
                shard = torch.zeros(layout.shard, dtype=value.dtype, device=self.device)
                for piece, (a, b) in zip(self.pieces, self.ranges):
                    shard[a:b] = self.inner.state[piece][key]
                # Horovod: the state shards to every rank (Horovod has no gather); only rank 0 keeps them.
                whole = self.hvd.allgather(shard, name=f"hvdtrain.shard.state.{key}")
                if self.rank == 0:
                    for i, a, b in layout.param_slices():
                        state[i][key] = whole[a:b].view_as(self.params[i]).clone()
                del whole
            elif self.rank == 0:  # per parameter and equal on every piece (Adam's step count)
                for i in state:
                    state[i][key] = value.clone() if torch.is_tensor(value) else value
        self._state = {i: s for i, s in state.items() if s} if self.rank == 0 else None

    def state_dict(self) -> Dict[str, Any]:
        """The whole state in the plain optimizer's format, once: rank 0 after :meth:`gather_state` (or a load),
        which then frees it; the state as created while nothing has stepped."""
        if self._state is not None:
            state, self._state = self._state, None
        elif not self._stepped:
            state = {}
        else:
            raise RuntimeError("the sharded optimizer's state is spread over the ranks: every rank must call "
                               "gather_state() before rank 0 calls state_dict()")
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": members}
                  for group, members in zip(self.inner.param_groups, self._group_members)]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(m) for m in self._group_members]:
            raise ValueError(f"optimizer state for groups of {[len(g['params']) for g in groups]} parameters, the "
                             f"model has {[len(m) for m in self._group_members]}")
        for inner, saved in zip(self.inner.param_groups, groups):
            inner.update({k: v for k, v in saved.items() if k != "params"})
        order = [i for g in groups for i in g["params"]]  # saved index of each parameter, in our order
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        state = {mine: saved_state[theirs] for mine, theirs in enumerate(order) if theirs in saved_state}
        self.inner.state.clear()
        if state:
            first = state[min(state)]
            for key, value in first.items():
                if torch.is_tensor(value) and value.dim() >= 1:
                    shard = torch.zeros(self.layout.shard, dtype=value.dtype, device=self.device)
                    for s in self.segments:
                        shard[s.at:s.at + s.stop - s.start] = state[s.param][key].reshape(-1)[s.start:s.stop]
                    for piece, (a, b) in zip(self.pieces, self.ranges):
                        self.inner.state[piece][key] = shard[a:b].clone()
                else:
                    for piece in self.pieces:
                        self.inner.state[piece][key] = value.clone() if torch.is_tensor(value) else value
        # Rank 0 keeps the whole state for the broadcast that follows a checkpoint's load (state_dict() frees it).
        self._state = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                       for i, s in state.items()} if self.rank == 0 and state else None
        self._stepped = bool(state)
