"""The optimizers of ``--optimizer`` on PyTorch: sgd, adam and adamw are torch.optim's own; lars and lamb are here
(torch has neither). hvdtrain.backends.mxnet_optim writes the same updates for MXNet, and
tests/unit/test_optimizer_updates.py holds the two to the same weights.

LARS (You et al. 2017), on PyTorch's momentum convention (the learning rate outside the buffer)::

    d = g + wd w;  d *= eta ||w|| / (||g|| + wd ||w|| + eps)   (1 when ||w|| or ||g|| is 0)
    buf = momentum buf + d;  w -= lr buf

LAMB (You et al. 2019), with Adam's bias correction::

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
    w -= lr ||w|| / ||u|| u                                   (ratio 1 when ||w|| or ||u|| is 0)

A parameter group with ``trust=False`` (the backend puts biases and normalization weights there, with weight decay
0, as the MLPerf reference does) takes the update without the ratio: momentum SGD, or Adam's step. The norms are
taken per parameter with torch._foreach_norm, one call per group.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch


def _ratios(numerators: List[torch.Tensor], denominators: List[torch.Tensor], scale: float, extra: float,
            eps: float) -> List[torch.Tensor]:
    """scale ||w|| / (||d|| + extra ||w|| + eps) per parameter; 1 where a norm is 0."""
    out = []
    for w, d in zip(numerators, denominators):
        ok = (w > 0) & (d > 0)
        out.append(torch.where(ok, scale * w / (d + extra * w + eps), torch.ones_like(w)))
    return out


class _LayerwiseOptimizer(torch.optim.Optimizer):
    """step(): each group's parameters that have a gradient, to the subclass's ``_update(group, params)``."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group, params):
        raise NotImplementedError


class LARS(_LayerwiseOptimizer):
    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001,
                 eps: float = 0.0, trust: bool = True):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                                      trust=trust))

    def _update(self, group, params):
        grads = [p.grad for p in params]
        wd = group["weight_decay"]
        steps = torch._foreach_add(grads, params, alpha=wd) if wd else [g.clone() for g in grads]
        if group["trust"]:
            torch._foreach_mul_(steps, _ratios(torch._foreach_norm(params), torch._foreach_norm(grads),
                                               group["eta"], wd, group["eps"]))
        bufs = []
        for p, d in zip(params, steps):
            state = self.state[p]
            if "momentum_buffer" not in state:  # the first step: the buffer is the step (torch.optim.SGD's way)
                state["momentum_buffer"] = d
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(d)
            bufs.append(state["momentum_buffer"])
        torch._foreach_add_(params, bufs, alpha=-group["lr"])


class LAMB(_LayerwiseOptimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 trust: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust=trust))

    def _update(self, group, params):
        b1, b2 = group["betas"]
        means, variances = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            means.append(state["exp_avg"])
            variances.append(state["exp_avg_sq"])
        t = float(self.state[params[0]]["step"])  # every parameter of a group steps together
        grads = [p.grad for p in params]
        torch._foreach_lerp_(means, grads, 1 - b1)
        torch._foreach_mul_(variances, b2)
        torch._foreach_addcmul_(variances, grads, grads, value=1 - b2)
        denominators = torch._foreach_div(variances, 1 - b2 ** t)
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(means, 1 - b1 ** t)
        torch._foreach_div_(updates, denominators)
        if group["weight_decay"]:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if group["trust"]:
            torch._foreach_mul_(updates, _ratios(torch._foreach_norm(params), torch._foreach_norm(updates),
                                                 1.0, 0.0, 0.0))
        torch._foreach_add_(params, updates, alpha=-group["lr"])


def make_optimizer(cfg, groups: List[Dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer of --optimizer over ``groups`` (each a dict with "params", and "exempt": a group of biases and
    normalization weights, with no weight decay and, for lars and lamb, no trust ratio)."""
    def options(group):
        return {"params": group["params"], **({"weight_decay": 0.0} if group.get("exempt") else {}),
                **({"trust": not group.get("exempt")} if cfg.optimizer in ("lars", "lamb") else {})}
    groups = [options(g) for g in groups]
    lr, wd, eps = cfg.base_lr, cfg.weight_decay, cfg.eps()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=wd)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr, weight_decay=wd, eps=eps)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=wd, eps=eps)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=lr, momentum=cfg.momentum, weight_decay=wd, eta=cfg.trust_coefficient, eps=eps)
    if cfg.optimizer == "lamb":
        return LAMB(groups, lr=lr, weight_decay=wd, eps=eps)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def parameter_groups(cfg, named: List[Any]) -> List[Dict[str, Any]]:
    """The trainable parameters in one group, or two when some are exempt (cfg.exempt: biases and normalization
    weights under --no-wd, always under lars and lamb)."""
    params = [p for _, p in named]
    if not cfg.exempt(1):  # (two groups whenever exemption applies, even an empty one: checkpoints keep their shape)
        return [{"params": params}]
    return [{"params": [p for p in params if not cfg.exempt(p.ndim)]},
            {"params": [p for p in params if cfg.exempt(p.ndim)], "exempt": True}]
