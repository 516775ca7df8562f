"""A model of repeated blocks for --compile's tests (tests/e2e/test_compile.py): 12 residual MLP blocks
and a head, on fixed random data. Every rank records, for each training step, when its parameters' gradients were
ready (hooks on their AccumulateGrad nodes, where horovod.torch hands each gradient to Horovod), as the fraction of
the backward pass (from the loss to the last gradient) elapsed at the first one, in OUTPUT_DIR/hooks-rankN.json (the
steps before the last one of the run)."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from hvdtrain import ArrayDataset, TrainConfig, Trainer

WIDTH = 256


@dataclass
class BlocksConfig(TrainConfig):
    epochs: int = 3
    batch_size: int = 64
    base_lr: float = 0.005
    precision: str = "fp32"


class BlocksTrainer(Trainer):
    name = "compile-blocks"
    config_class = BlocksConfig
    num_classes = 10

    def datasets(self):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1152, WIDTH)).astype(np.float32)
        y = (x[:, :10].argmax(axis=1)).astype(np.int64)
        return ArrayDataset(x[:1024], y[:1024]), ArrayDataset(x[1024:], y[1024:])

    def build_torch(self):
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)

            def forward(self, x):
                return x + torch.relu(self.fc(self.norm(x)))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.Sequential(*[Block() for _ in range(12)])
                self.head = nn.Linear(WIDTH, 10)

            def forward(self, x):
                return self.head(self.blocks(x))

        net = Net()
        self._record(net)
        return net

    def _record(self, net) -> None:
        ready, fractions, self._nodes = [], [], []
        self._loss_at = None
        for p in net.parameters():
            node = p.expand_as(p).grad_fn.next_functions[0][0]  # the node horovod.torch hooks
            node.register_hook(lambda *_: ready.append(time.perf_counter()))
            self._nodes.append(node)  # kept alive, as Horovod keeps its own

        out = os.path.join(self.cfg.output_dir, f"hooks-rank{os.environ.get('HOROVOD_RANK', '0')}.json")

        def close_step():
            if self._loss_at is not None and len(ready) > 1:
                first, last = min(ready), max(ready)
                fractions.append((first - self._loss_at) / max(last - self._loss_at, 1e-9))
                with open(out, "w") as f:  # every step: a rank may leave without running atexit handlers
                    json.dump(fractions, f)
            ready.clear()

        self._close_step = close_step

    def loss_torch(self):
        import torch.nn.functional as F

        def loss(logits, y):
            if logits.requires_grad:  # a training step: the backward pass starts right after this
                self._close_step()
                self._loss_at = time.perf_counter()
            return F.cross_entropy(logits, y)
        return loss
