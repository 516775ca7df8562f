"""--optimizer adamw, lars and lamb take the same step on both frameworks (issue 48): the same weights and gradients
for several steps, with the learning rate changing between them, give the same weights after, to rel 1e-5 in fp32
(the exempt 1-d bias included); and the updates are the published ones, checked against a plain numpy transcription."""
import numpy as np
import pytest

from hvdtrain.config import TrainConfig

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mxnet")

LRS = [0.1, 0.2, 0.05, 0.15, 0.1]  # a schedule's changing rate: LARS's momentum must not depend on the convention


def cfg(optimizer, **kw):
    return TrainConfig(optimizer=optimizer, weight_decay=kw.pop("weight_decay", 0.05), momentum=0.9, **kw)


def start():
    rng = np.random.default_rng(0)
    weights = {"weight": rng.standard_normal((4, 3)).astype(np.float32),
               "bias": rng.standard_normal(4).astype(np.float32)}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in weights.items()} for _ in LRS]
    grads[2]["weight"][:] = 0  # a zero gradient: the trust ratio falls back to 1
    return weights, grads


def torch_steps(c, weights, grads):
    from hvdtrain.backends.torch_optim import make_optimizer, parameter_groups
    layer = torch.nn.Linear(3, 4)
    with torch.no_grad():
        for name, value in weights.items():
            getattr(layer, name).copy_(torch.from_numpy(value))
    opt = make_optimizer(c, parameter_groups(c, list(layer.named_parameters())))
    for lr, g in zip(LRS, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        for name, value in g.items():
            getattr(layer, name).grad = torch.from_numpy(value.copy())
        opt.step()
    return {name: getattr(layer, name).detach().numpy() for name in weights}, opt


def mxnet_steps(c, weights, grads, dtype="float32"):
    from hvdtrain.backends.mxnet_optim import make_optimizer
    layer = mx.gluon.nn.Dense(4, in_units=3)
    layer.initialize()
    if dtype != "float32":
        layer.cast(dtype)
    for name, value in weights.items():
        layer.collect_params()[f"{layer.prefix}{name}"].set_data(mx.nd.array(value, dtype=dtype))
    params = layer.collect_params()
    for p in params.values():  # what the backend does (hvdtrain.backends.mxnet)
        if c.exempt(len(p.shape)):
            p.wd_mult = 0.0
    trainer = mx.gluon.Trainer(params, make_optimizer(c, multi_precision=dtype == "float16"), kvstore=None)
    for lr, g in zip(LRS, grads):
        trainer.set_learning_rate(lr)
        with mx.autograd.record():  # a loss whose gradients are g: sum of w * g
            loss = mx.nd.add_n(*[(params[f"{layer.prefix}{name}"].data() * mx.nd.array(value, dtype=dtype)).sum()
                                 for name, value in g.items()])
        loss.backward()
        trainer.step(1)
    return {name: params[f"{layer.prefix}{name}"].data().asnumpy().astype(np.float32) for name in weights}


def numpy_steps(c, weights, grads):
    """The published updates, transcribed (1-d parameters: exempt from weight decay and the trust ratio)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    state = {k: [np.zeros_like(v), np.zeros_like(v)] for k, v in w.items()}
    eps, b1, b2 = c.eps(), 0.9, 0.999
    for t, (lr, g) in enumerate(zip(LRS, grads), start=1):
        for k in w:
            grad, wd = g[k].astype(np.float64), (0.0 if c.exempt(w[k].ndim) else c.weight_decay)
            trust = w[k].ndim > 1 and c.optimizer in ("lars", "lamb")
            if c.optimizer in ("lars", "sgd"):
                d = grad + wd * w[k]
                wn, gn = np.linalg.norm(w[k]), np.linalg.norm(grad)
                if trust and wn > 0 and gn > 0:
                    d = d * c.trust_coefficient * wn / (gn + wd * wn + eps)
                state[k][0] = c.momentum * state[k][0] + d
                w[k] = w[k] - lr * state[k][0]
                continue
            m, v = state[k]
            m[:] = b1 * m + (1 - b1) * grad
            v[:] = b2 * v + (1 - b2) * grad * grad
            step = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
            if c.optimizer == "adamw":
                w[k] = w[k] * (1 - lr * wd) - lr * step
            else:
                step = step + wd * w[k]
                wn, sn = np.linalg.norm(w[k]), np.linalg.norm(step)
                ratio = wn / sn if trust and wn > 0 and sn > 0 else 1.0
                w[k] = w[k] - lr * ratio * step
    return w


@pytest.mark.parametrize("optimizer,extra", [("adamw", {}), ("adamw", {"no_wd": True}), ("lars", {}),
                                             ("lars", {"trust_coefficient": 0.02, "optimizer_eps": 1e-9}),
                                             ("lamb", {})])
def test_both_frameworks_take_the_published_step(optimizer, extra):
    c = cfg(optimizer, **extra)
    weights, grads = start()
    got_torch, _ = torch_steps(c, weights, grads)
    got_mxnet = mxnet_steps(c, weights, grads)
    want = numpy_steps(c, weights, grads)
    for name in weights:
        assert not np.allclose(want[name], weights[name], rtol=1e-3), f"{name} did not move"
        np.testing.assert_allclose(got_torch[name], want[name], rtol=1e-5, atol=1e-7, err_msg=f"torch {name}")
        np.testing.assert_allclose(got_mxnet[name], got_torch[name], rtol=1e-5, atol=1e-7, err_msg=f"mxnet {name}")


def test_the_exempt_bias_gets_neither_the_ratio_nor_weight_decay():
    """With a tiny trust coefficient LARS barely moves the weight matrix; the bias moves as plain momentum SGD (the
    weight decay's exemption is in the transcription above)."""
    c = cfg("lars", trust_coefficient=1e-6, weight_decay=0.0)
    weights, grads = start()
    got, _ = torch_steps(c, weights, grads)
    plain = numpy_steps(cfg("sgd", weight_decay=0.0), weights, grads)  # (the transcription's momentum SGD)
    np.testing.assert_allclose(got["bias"], plain["bias"], rtol=1e-5)
    assert np.abs(got["weight"] - weights["weight"]).max() < 1e-5


def test_mxnet_float16_weights_step_through_float32_master_copies():
    c = cfg("lamb")
    weights, grads = start()
    got = mxnet_steps(c, {k: v.astype(np.float16).astype(np.float32) for k, v in weights.items()}, grads,
                      dtype="float16")
    want, _ = torch_steps(c, {k: v.astype(np.float16).astype(np.float32) for k, v in weights.items()}, grads)
    for name in weights:  # float16's resolution, not more: the master copies carried the steps
        np.testing.assert_allclose(got[name], want[name], rtol=2e-3, atol=2e-3, err_msg=name)


def test_a_checkpointed_state_resumes_the_same_steps():
    """The torch state_dict of lars and lamb (momentum buffers; step, exp_avg, exp_avg_sq) restores exactly."""
    from hvdtrain.backends.torch_optim import make_optimizer, parameter_groups
    for optimizer in ("lars", "lamb"):
        c = cfg(optimizer)
        weights, grads = start()
        whole, _ = torch_steps(c, weights, grads)
        half, opt = torch_steps(c, weights, grads[:2])
        layer = torch.nn.Linear(3, 4)
        with torch.no_grad():
            for name, value in half.items():
                getattr(layer, name).copy_(torch.from_numpy(value))
        again = make_optimizer(c, parameter_groups(c, list(layer.named_parameters())))
        again.load_state_dict(opt.state_dict())
        for lr, g in zip(LRS[2:], grads[2:]):
            for group in again.param_groups:
                group["lr"] = lr
            for name, value in g.items():
                getattr(layer, name).grad = torch.from_numpy(value.copy())
            again.step()
        for name in weights:
            np.testing.assert_array_equal(getattr(layer, name).detach().numpy(), whole[name], err_msg=optimizer)
