"""One rank's step of a model, measured on this machine: forward, backward and update seconds, and when each gradient
is ready during the backward pass. What the cost model's projections (``bench project``) and its predictions of the
measured network runs (``bench network --predict-from``) start from; below both, importing neither."""
from __future__ import annotations

import statistics
import time
from typing import Dict

from .costmodel import Compute

MODELS = {"mnist": ("mnist recipe (--hidden 512)", (1, 28, 28), 10),
          "resnet50": ("imagenet recipe, resnet50_v1b", (3, 224, 224), 1000),
          "resnet101": ("imagenet recipe, resnet101_v1b", (3, 224, 224), 1000),
          "vgg16": ("VGG-16 (Simonyan and Zisserman, configuration D)", (3, 224, 224), 1000)}
"""--model: (what it is, input shape, classes)."""


def build(model: str, hidden: int = 512):
    """The model's PyTorch definition: the recipes' own where hvdtrain has one (``hidden``: the MNIST recipe's)."""
    from torch import nn
    if model == "mnist":
        from .loops import _recipe
        return _recipe("mnist", "torch", 32, 1, ["--hidden", str(hidden)]).build_torch()
    if model in ("resnet50", "resnet101"):
        from recipes.resnet_torch import resnet
        return resnet(model)
    layers, cin = [], 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
            cin = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True),
                         nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 1000))


def measure(model: str, batch_size: int = 2, repeats: int = 3, grad_bytes: int = 4, hidden: int = 512) -> Compute:
    """One rank's step on this machine's CPU (median of ``repeats`` after a warm-up): forward, backward and SGD
    update seconds, and each parameter's gradient: its bytes and when it was ready, as a fraction of the backward."""
    import torch
    import torch.nn.functional as F
    _, shape, classes = MODELS[model]
    net = build(model, hidden).train()
    params = [p for p in net.parameters() if p.requires_grad]
    ready: Dict[int, float] = {}
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: ready.__setitem__(i, time.perf_counter()))
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    x, y = torch.randn(batch_size, *shape), torch.randint(0, classes, (batch_size,))
    rows = []
    for r in range(repeats + 1):
        ready.clear()
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if r:  # the first is the warm-up
            rows.append((t1 - t0, t2 - t1, t3 - t2, [(ready[i] - t1) / (t2 - t1) for i in range(len(params))]))
    med = lambda k: statistics.median(row[k] for row in rows)  # noqa: E731
    fractions = [statistics.median(row[3][i] for row in rows) for i in range(len(params))]
    return Compute(med(0), med(1), med(2), [(p.numel() * grad_bytes, min(1.0, max(0.0, f)))
                                            for p, f in zip(params, fractions)])
