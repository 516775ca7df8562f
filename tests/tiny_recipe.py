"""A tiny recipe for tests: a two-layer MLP on separable Gaussian blobs, on both frameworks, no files needed.

Also shows the smallest user Trainer: ``python -m hvdtrain recipe tests.tiny_recipe:TinyTrainer``.
"""
import os
from dataclasses import dataclass

import numpy as np

from hvdtrain import ArrayDataset, TrainConfig, Trainer


@dataclass
class TinyConfig(TrainConfig):
    samples: int = 515
    """Training samples (odd on purpose: shards of unequal size before padding)."""
    features: int = 16
    """Input features."""
    classes: int = 4
    """Number of blobs."""
    perturb_by_rank: bool = False
    """Add rank-dependent noise to the initial weights (tests that the broadcast makes them equal)."""
    fault: str = ""
    """Fault injection for tests: raise, kill (SIGKILL), stop (SIGSTOP), segfault (a crash in native code), nan, or
    sleep (--fault-seconds, once), on --fault-rank at --fault-step."""
    fault_rank: int = 1
    """Rank that suffers the fault."""
    fault_step: int = 5
    """Training batch (counted from 1 in this process) at which the fault happens."""
    fault_once: str = ""
    """A marker file: the fault happens only while it does not exist (it is created then), e.g. across resets."""
    fault_seconds: float = 10.0
    """How long --fault sleep sleeps."""
    nan_step: int = 0
    """Training batch (counted from 1 in each process) whose inputs are NaN on every rank: the loss scaler skips that
    step and halves its scale (0: never)."""
    step_sleep: float = 0.0
    """Seconds to sleep per training batch (slows the run down so that a test can act mid-epoch)."""
    sleep_while: str = ""
    """A file: --step-sleep applies only while it exists (a test removes it to let the run finish quickly)."""
    half_ops: bool = False
    """MXNet: build the MLP from operators MXNet runs in float16 on the CPU (a broadcast multiply and a sum in place
    of FullyConnected), with a BatchNorm after the hidden layer, so that the float16 path runs under the stand-in
    HVDTRAIN_GPU_STAND_IN=fp16 (MXNet's FullyConnected has no float16 kernel on the CPU)."""


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class _Faults:
    """Runs on every training batch this process loads: sleeps, and injects the configured fault."""

    def __init__(self, cfg):
        self.cfg, self.batches = cfg, 0

    def __call__(self, x, y):
        import signal
        import time
        cfg = self.cfg
        if x.ndim < 2:  # one sample (the Trainer reads one to learn the input shape): not a training batch
            return x, y
        self.batches += 1
        if cfg.step_sleep and (not cfg.sleep_while or os.path.exists(cfg.sleep_while)):
            time.sleep(cfg.step_sleep)
        if cfg.nan_step and self.batches == cfg.nan_step:
            x = np.full_like(x, np.nan)
        once = cfg.fault_once
        if cfg.fault and _rank() == cfg.fault_rank and self.batches >= cfg.fault_step \
                and not (once and os.path.exists(once)):
            if once:
                open(once, "w").close()
            if cfg.fault == "sleep" and self.batches == cfg.fault_step:
                time.sleep(cfg.fault_seconds)
            if cfg.fault == "raise" and self.batches == cfg.fault_step:
                raise ValueError(f"injected failure at batch {self.batches}")
            if cfg.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if cfg.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if cfg.fault == "segfault":
                import ctypes
                ctypes.string_at(0)  # reads address 0: SIGSEGV
            if cfg.fault == "nan":
                x = np.full_like(x, np.nan)
        return x, y


class TinyTrainer(Trainer):
    """Two-layer MLP on Gaussian blobs (tests)."""

    name = "tiny"
    config_class = TinyConfig

    def datasets(self):
        cfg = self.cfg
        rng = np.random.default_rng(1234)
        centers = rng.normal(0, 3, size=(cfg.classes, cfg.features)).astype(np.float32)

        def make(n):
            y = rng.integers(0, cfg.classes, size=n)
            x = centers[y] + rng.normal(0, 1.5, size=(n, cfg.features)).astype(np.float32)
            return ArrayDataset(x.astype(np.float32), y.astype(np.int64))
        train = make(cfg.samples)
        train.transform = _Faults(cfg)
        return train, make(203)

    def build_torch(self):
        import torch
        from torch import nn
        net = nn.Sequential(nn.Linear(self.cfg.features, 32), nn.Tanh(), nn.Linear(32, self.cfg.classes))
        if self.cfg.perturb_by_rank:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.1 * (_rank() + 1))
        return net

    def build_mxnet(self):
        import mxnet as mx
        from mxnet.gluon import nn
        net = nn.HybridSequential()
        if self.cfg.half_ops:
            net.add(_half_dense(32, self.cfg.features), nn.Activation("tanh"), nn.BatchNorm(in_channels=32),
                    _half_dense(self.cfg.classes, 32))
        else:
            net.add(nn.Dense(32, activation="tanh", in_units=self.cfg.features),
                    nn.Dense(self.cfg.classes, in_units=32))
        net.initialize(mx.init.Xavier())
        if self.cfg.perturb_by_rank:
            for p in net.collect_params().values():
                p.set_data(p.data() + 0.1 * (_rank() + 1))
        return net


def _half_dense(units: int, in_units: int):
    """A dense layer (Gluon Dense's parameters and result) from operators with float16 kernels on MXNet's CPU."""
    from mxnet.gluon import HybridBlock

    class HalfDense(HybridBlock):
        def __init__(self):
            super().__init__()
            self.weight = self.params.get("weight", shape=(units, in_units))
            self.bias = self.params.get("bias", shape=(units,), init="zeros")

        def hybrid_forward(self, F, x, weight, bias):
            products = F.broadcast_mul(F.expand_dims(x, axis=1), F.expand_dims(weight, axis=0))
            return F.broadcast_add(F.sum(products, axis=2), F.expand_dims(bias, axis=0))
    return HalfDense()
