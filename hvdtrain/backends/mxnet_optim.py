"""adamw, lars and lamb on MXNet: the updates of hvdtrain.backends.torch_optim (and of torch.optim.AdamW), written
with NDArray operations so that both frameworks take the same step (tests/unit/test_optimizer_updates.py).

MXNet 1.9.1 ships LARS and LAMB, but their definitions are not these under Gluon:
- mx.optimizer.LARS exempts parameters by name (a name ending in gamma, beta or bias), and Gluon's Trainer gives the
  optimizer no names: every parameter gets the trust ratio. It also keeps the learning rate inside the momentum.
- mx.optimizer.LAMB applies the trust ratio to every parameter, normalization weights and biases included.
- AdamW exists only as the operators mx.nd.contrib.adamw_update / mp_adamw_update (GluonNLP's), which scale the
  decay by a separate eta instead of by the learning rate.
So these are written here, one parameter at a time (Gluon's Updater calls update() per parameter), with the float32
master copy of a float16 weight kept by MXNet's own multi-precision wrapper. The momentum of lars is PyTorch's (the
learning rate outside the buffer), so a changing rate needs no momentum correction.
"""
from __future__ import annotations

import mxnet as mx
from mxnet import nd


def _trust(w_norm, d_norm, scale: float, extra: float, eps: float):
    """scale ||w|| / (||d|| + extra ||w|| + eps), or 1 where either norm is 0 (as a (1,) array, no host sync)."""
    ok = (w_norm > 0) * (d_norm > 0)
    one = nd.ones_like(w_norm)
    return nd.where(ok, scale * w_norm / nd.where(ok, d_norm + extra * w_norm + eps, one), one)


def _scaled(array, ratio):
    return nd.broadcast_mul(array, ratio.reshape((1,) * array.ndim))


class _Optimizer(mx.optimizer.Optimizer):
    lr_in_momentum = False  # hvdtrain's MXNet backend corrects the momentum of SGD and NAG only

    def _gradient(self, index, grad):
        self._update_count(index)
        g = grad * self.rescale_grad
        if self.clip_gradient is not None:
            g = nd.clip(g, -self.clip_gradient, self.clip_gradient)
        return g, self._get_lr(index), self._get_wd(index), self._index_update_count[index]


class _Adam(_Optimizer):
    """The moments and Adam's bias-corrected step, m_hat / (sqrt(v_hat) + eps), that AdamW and LAMB share."""

    def __init__(self, beta1=0.9, beta2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(**kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index, weight):
        return (nd.zeros(weight.shape, weight.context, dtype=weight.dtype),
                nd.zeros(weight.shape, weight.context, dtype=weight.dtype))

    def _adam_step(self, index, grad, state):
        g, lr, wd, t = self._gradient(index, grad)
        mean, var = state
        b1, b2 = self.beta1, self.beta2
        mean[:] = b1 * mean + (1 - b1) * g
        var[:] = b2 * var + (1 - b2) * g * g
        return (mean / (1 - b1 ** t)) / (nd.sqrt(var / (1 - b2 ** t)) + self.epsilon), lr, wd


class AdamW(_Adam):
    """torch.optim.AdamW: w = w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)."""

    def update(self, index, weight, grad, state):
        step, lr, wd = self._adam_step(index, grad, state)
        weight[:] = weight * (1 - lr * wd) - lr * step


class LARS(_Optimizer):
    """Momentum SGD with the layer-wise trust ratio (torch_optim.LARS); 1-d parameters take plain momentum SGD."""

    def __init__(self, momentum=0.9, eta=0.001, epsilon=0.0, **kwargs):
        super().__init__(**kwargs)
        self.lars_momentum, self.eta, self.epsilon = momentum, eta, epsilon

    def create_state(self, index, weight):
        return nd.zeros(weight.shape, weight.context, dtype=weight.dtype)

    def update(self, index, weight, grad, state):
        g, lr, wd, _ = self._gradient(index, grad)
        d = g + wd * weight if wd else g
        if weight.ndim > 1:
            d = _scaled(d, _trust(nd.norm(weight).reshape((1,)), nd.norm(g).reshape((1,)), self.eta, wd,
                                  self.epsilon))
        state[:] = self.lars_momentum * state + d
        weight[:] = weight - lr * state


class LAMB(_Adam):
    """Adam's bias-corrected step plus decoupled decay, times ||w|| / ||step|| (torch_optim.LAMB); 1-d parameters take
    Adam's step alone."""

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(epsilon=epsilon, **kwargs)

    def update(self, index, weight, grad, state):
        step, lr, wd = self._adam_step(index, grad, state)
        if wd:
            step = step + wd * weight
        if weight.ndim > 1:
            step = _scaled(step, _trust(nd.norm(weight).reshape((1,)), nd.norm(step).reshape((1,)), 1.0, 0.0, 0.0))
        weight[:] = weight - lr * step


def make_optimizer(cfg, multi_precision: bool):
    """The MXNet optimizer of --optimizer (weight decay exemptions are the parameters' wd_mult, set by the backend
    from cfg.exempt)."""
    lr, wd = cfg.base_lr, cfg.weight_decay
    common = dict(learning_rate=lr, wd=wd, multi_precision=multi_precision)
    if cfg.optimizer == "sgd":
        kind = mx.optimizer.NAG if cfg.nesterov else mx.optimizer.SGD
        return kind(momentum=cfg.momentum, **common)
    if cfg.optimizer == "adam":
        return mx.optimizer.Adam(epsilon=cfg.eps(), **common)
    if cfg.optimizer == "adamw":
        return AdamW(epsilon=cfg.eps(), **common)
    if cfg.optimizer == "lars":
        return LARS(momentum=cfg.momentum, eta=cfg.trust_coefficient, epsilon=cfg.eps(), **common)
    if cfg.optimizer == "lamb":
        return LAMB(epsilon=cfg.eps(), **common)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")
