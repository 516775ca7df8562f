"""MXNet Gluon + horovod.mxnet backend.

horovod.mxnet has no backward_passes_per_step, broadcast_optimizer_state, join or metric averaging; this backend
provides the same behaviour as the PyTorch one itself:

- accumulation: ``grad_req='add'``, ``accumulate`` backward passes, one allreduce and step, gradients zeroed after;
- optimizer state (momentum, update counts) broadcast from rank 0 after a resume;
- equal steps on every rank: the Trainer's padded ShardSampler (shared with PyTorch);
- metrics: one Horovod allreduce of the sums, as on PyTorch.

Gluon's ``Trainer.step(batch_size)`` divides the summed per-sample gradients by ``batch_size``; passing the
micro-batch size times ``accumulate`` makes the update the mean over all samples of the global batch, exactly what
the PyTorch backend's mean loss gives, so one learning rate means the same thing on both frameworks.

Checkpoints hold parameters and optimizer states as numpy arrays by structural name ('0.weight'), never Gluon's
pickled ``save_states`` format.
"""
from __future__ import annotations

import functools
import itertools
import os
import random
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from ..basics import die_with_parent
from ..config import ConfigError
from ..data import ArrayDataset, Synthetic, array_batches, decodes_on_device, map_arrays, pixel_normalization
from ..loss_scale import DynamicLossScale
from ..threads import created_by
from .gluoncv_compat import import_mxnet
from .base import Backend, Task
from .resources import (estimated_threads, gpu_for_rank, horovod_environment, keep_freed_memory, launcher_local_size,
                        preload_image_codecs, user_threads)
from .mxnet_records import MXNetRecords
from .mxnet_sharded import (MXNetShardedUpdate, flatten_state as _flatten_state, join_master, master_position,
                            split_master)


GPU_STAND_IN = "HVDTRAIN_GPU_STAND_IN"
"""Environment variable for tests on a CPU: with ``1`` and no GPU, each rank runs on ``mx.cpu(local_rank + 1)``, a
context other than MXNet's default standing in for ``mx.gpu(local_rank)``, so that anything left on ``cpu(0)`` is
caught. With ``fp16`` the stand-in also takes a GPU's precision: ``--precision auto`` picks fp16, the network is cast
to float16 (BatchNorm stays float32) and the optimizer keeps float32 master weights, as on a GPU. MXNet has float16
kernels on the CPU for elementwise operators, reductions and BatchNorm but not for FullyConnected or Convolution, so
a model under ``fp16`` must be built from the former (the tests' TinyTrainer has one)."""


def rank_context(mx, local_rank: int, local_size: int = 1):
    """The rank's MXNet context: its GPU by local rank (:func:`gpu_for_rank`), else the CPU (or the CPU stand-in,
    see GPU_STAND_IN)."""
    gpus = mx.context.num_gpus()
    if gpus > 0:
        return mx.gpu(gpu_for_rank(local_rank, local_size, gpus, os.environ.get("CUDA_VISIBLE_DEVICES")))
    if os.environ.get(GPU_STAND_IN) in ("1", "fp16"):
        return mx.cpu(local_rank + 1)
    return mx.cpu()


def place_parameters(mx, params, ctx) -> None:
    """Every parameter on ``ctx``, keeping the initialiser the recipe chose.

    A recipe initialises its network without a context (it knows no device): parameters whose shape is known then
    land on MXNet's default context, cpu(0), and deferred ones are bound to it. They are moved (or re-bound, keeping
    their initialiser) to the rank's context. Parameters the recipe did not initialise get PyTorch's default,
    uniform(+-1/sqrt(fan_in)) weights (kaiming_uniform with a=sqrt(5)), so one recipe starts alike on both frameworks.
    A second ``initialize`` on the whole network would not do: Gluon ignores it for initialised parameters (which stay
    on cpu(0)) and replaces the initialiser of deferred ones.
    """
    default = mx.init.Xavier(rnd_type="uniform", factor_type="in", magnitude=1)
    for p in params.values():
        # Gluon has no public "is initialised" test: _data (initialised) or _deferred_init (waiting for a shape).
        if p._data is not None or p._deferred_init:
            p.reset_ctx(ctx)
        else:
            p.initialize(default_init=default, ctx=ctx)


def resolve_shapes(mx, model, sample_shape, ctx) -> None:
    """Give every deferred parameter its shape and initial value, from the shape of one sample (or from one sample's
    inputs, a tuple of arrays without the batch axis).

    A HybridBlock infers shapes from its graph without running: a forward pass would change state (BatchNorm's
    running variance moves from 1 towards the batch's). A plain Block can only be run, in training mode: an
    inference-mode pass lets MKLDNN reorder the weights in place into its own layout, and a broadcast into such an
    array would write bytes in the wrong layout.
    """
    if all(isinstance(d, (int, np.integer)) for d in sample_shape):
        xs = [mx.nd.zeros((1,) + tuple(sample_shape), ctx=ctx)]
    else:  # one sample's inputs (several, integer token ids...): their own shapes and types
        xs = [mx.nd.array(np.asarray(a)[None], ctx=ctx, dtype="float32" if np.asarray(a).dtype.kind == "f" else
                          "int32") for a in sample_shape]
    if isinstance(model, mx.gluon.HybridBlock):
        model.infer_shape(*xs)
        for p in model.collect_params().values():
            if p._deferred_init:  # what Gluon does at the first forward pass, done now
                p._finish_deferred_init()
        return
    with mx.autograd.train_mode():
        out = model(*xs)
        for a in out if isinstance(out, (tuple, list)) else [out]:
            a.wait_to_read()


class _DiesWithRank:
    """``dataset`` as Gluon's loader workers read it: a worker process's first read has the kernel kill it when the
    rank's process ends (Gluon's DataLoader takes no worker initializer), so that one stuck in a read cannot outlive
    a killed rank and hold its output open."""

    def __init__(self, dataset: Any):
        self.dataset, self.rank_pid, self._pid = dataset, os.getpid(), os.getpid()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if self._pid != os.getpid():
            self._pid = os.getpid()
            die_with_parent(self.rank_pid)
        return self.dataset[index]


class MXNetBackend(Backend):
    name = "mxnet"
    asynchronous = True  # MXNet's engine queues every operation, also on CPU
    # Measured on a 2-core Xeon with AMX (np=1, synthetic): ResNet-18 64 px 105 img/s bf16 against 127 fp32, ResNet-50
    # 112 px 20.4 against 24.8; the Fashion-MNIST recipe at np=2 1,877 against 2,604.
    slower_bf16 = "MXNet 1.9.1's bf16 (AMP) trained at 0.7-0.85x its fp32 speed on such a CPU"

    def __init__(self):
        # A fresh name for every collective hvdtrain issues: horovod.mxnet runs them asynchronously on MXNet's
        # engine, and re-using a name while Horovod still holds the previous tensor of that name aborts the process
        # ("terminate called without an active exception", seen under mpirun).
        self._op = itertools.count().__next__
        self.hvd = self.mx = None
        self.model = self.trainer = self.loss_fn = None
        self.ctx = None
        self.scaler: Optional[DynamicLossScale] = None
        self.dtype = "float32"
        self.sharded: Optional[MXNetShardedUpdate] = None
        self.records: Optional[MXNetRecords] = None  # the RecordIO path (_records)

    # --- lifecycle -------------------------------------------------------------------------------------------------
    def init(self, cfg) -> None:
        if cfg.adasum:
            raise ConfigError("--adasum is supported on --framework torch only (horovod.mxnet has no Adasum trainer)")
        # Horovod: ranks on one host share its cores (horovod#2804). MXNet's engine and operator threads take their
        # OpenMP count from OMP_NUM_THREADS when it is loaded, and keep it (MXSetNumOMPThreads changes the calling
        # thread's only): the count is fixed here, before mxnet is imported and before the ranks can compare their
        # cores, from the launcher's local size and this rank's affinity; --threads, or an OMP_NUM_THREADS the user
        # set, wins. That is the count every MXNet thread uses and config.json reports; after hvd.init the ranks
        # compare their cores and say when it oversubscribes them.
        requested = cfg.threads or user_threads()
        self.threads, self.threads_reason = estimated_threads(launcher_local_size(), requested)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        self.malloc = keep_freed_memory()  # before the model and the first step allocate
        preload_image_codecs()  # before Horovod's RTLD_GLOBAL library: see its docstring
        self.worker_timeout = float(cfg.stall_timeout)
        mx = import_mxnet()  # without scikit-learn's import (gluoncv_compat)
        horovod_environment(cfg, self.per_gradient(cfg, mx.context.num_gpus() > 0))  # GPUs as rank_context counts them
        import horovod.mxnet as hvd
        self.mx, self.hvd = mx, hvd
        # A GPU, or the CPU standing in for one in precision too (GPU_STAND_IN=fp16): fp16 with fp32 master weights.
        self.gpu_like = mx.context.num_gpus() > 0 or os.environ.get(GPU_STAND_IN) == "fp16"
        native_bf16 = self.resolve_precision(cfg, self.gpu_like)
        # Horovod: start the background thread and join the job.
        with created_by("horovod", "transport"):  # its threads, for the per-thread CPU of each epoch
            hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        shared, _ = self.threads_per_rank(0)  # one collective on every rank: what the cores allow, compared
        if shared < self.threads and not requested and self.local_rank == 0:
            print(f"hvdtrain: warning: MXNet's threads were fixed at {self.threads} per rank when it started (before "
                  f"the ranks could compare their cores), but the ranks on this host share cores so that "
                  f"{shared} each would not oversubscribe them: pass --threads {shared}", file=sys.stderr,
                  flush=True)
        import ctypes
        mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(self.threads))  # the calling thread too
        self.agree_precision(cfg, native_bf16)  # one collective: every rank computes in the same precision
        # Horovod: one GPU per process, chosen by local rank.
        self.ctx = self.device = rank_context(mx, self.local_rank, self.local_size)
        self.on_gpu = self.ctx.device_type == "gpu"
        # Every batch is cast to the network's type (float16 networks take float16 data).
        self.dtype = "float16" if self.precision == "fp16" else "float32"
        self.scaler = DynamicLossScale() if cfg.dynamic_loss_scale(self.precision) else None
        if self.precision == "bf16":
            from mxnet.contrib import amp
            # AMP rewrites operators as they are created: before the network is built.
            amp.init(target_dtype="bfloat16")

    def precision_refusal(self, native_bf16: bool) -> str:
        if self.precision == "fp16" and not self.gpu_like:
            return ("--precision fp16 needs a GPU on --framework mxnet (MXNet has no fp16 GEMM on the CPU); use "
                    "--precision auto or fp32 on the CPU")
        if self.precision == "bf16" and self.gpu_like:
            return ("--precision bf16 runs on the CPU only on --framework mxnet (MXNet 1.9.1's AMP has no bf16 GPU "
                    "kernels); use --precision auto (fp16 on a GPU) or fp16")
        if self.precision == "bf16" and not native_bf16:
            # MXNet's oneDNN fails at the first convolution without AVX-512 ("could not create a primitive
            # descriptor iterator") and emulates bf16 slowly without AVX512-BF16/AMX.
            return (f"--precision bf16 needs native bf16 on --framework mxnet, and {self.bf16_missing}; use "
                    f"--precision auto (fp32 here) or fp32")
        return ""

    def setup(self, model: Any, cfg, loss_fn=None, sample_shape=None, task=None) -> None:
        mx, hvd = self.mx, self.hvd
        self.model = model
        self.loss_fn = loss_fn or self._cross_entropy(cfg.label_smoothing)
        self.eval_loss_fn = loss_fn or self._cross_entropy(0.0)
        self.task = task or Task()
        self.accumulate = cfg.accumulate
        params = model.collect_params()
        place_parameters(mx, params, self.ctx)
        if sample_shape is not None:  # resolve deferred shapes before the broadcast
            resolve_shapes(mx, model, sample_shape, self.ctx)
        if self.precision == "fp16":  # float16 network, float32 master weights in the optimizer
            model.cast("float16")
        model.hybridize(static_alloc=True)
        if cfg.accumulate > 1:
            params.setattr("grad_req", "add")
        for p in params.values():  # biases and normalization parameters (1-d) without weight decay (cfg.exempt)
            if cfg.exempt(len(p.shape)):
                p.wd_mult = 0.0
        from .mxnet_optim import make_optimizer
        opt = make_optimizer(cfg, multi_precision=self.precision == "fp16")
        self._master_at = master_position(mx, opt)  # where a float16 weight's state keeps its float32 copy
        compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
        self.predivide = cfg.predivide
        if cfg.shard_optimizer:
            # Gluon's own Trainer keeps the learning rate and update counts; the update itself is sharded
            # (mxnet_sharded): reduce-scatter, this rank's shard, allgather.
            self.trainer = mx.gluon.Trainer(params, opt, kvstore=None)
            named = [(n, p) for n, p in self._structural_params().items() if p.grad_req != "null"]
            self.sharded = MXNetShardedUpdate(mx, hvd, named, opt, len(self.trainer._params), self.ctx, compression,
                                              cfg.predivide, lambda what: f"hvdtrain.{what}.{self._op()}")
        else:
            # Horovod: allreduce the gradients inside trainer.step (sum, then / size: the average across ranks).
            self.trainer = hvd.DistributedTrainer(params, opt, compression=compression,
                                                  gradient_predivide_factor=cfg.predivide,
                                                  num_groups=self.allreduce_groups(cfg))
        self.broadcast_state()

    def _structural_params(self) -> Dict[str, Any]:
        """Parameters by structural name ('0.weight'), stable across processes unlike Gluon's global prefixes."""
        return self.model._collect_params_with_prefix()

    def _updater(self):
        return self.trainer._updaters[0]

    def _ensure_optimizer_states(self) -> None:
        """Create missing optimizer states (Gluon makes them lazily at the first update) so every rank has them."""
        if self.sharded is not None:  # created with the shard
            return
        updater, opt = self._updater(), self.trainer._optimizer
        for i, p in enumerate(self.trainer._params):
            if i not in updater.states:
                updater.states[i] = opt.create_state_multi_precision(i, p.data(self.ctx))
                updater.states_synced[i] = True

    def broadcast_state(self) -> None:
        hvd = self.hvd
        # Horovod: every rank starts from rank 0's parameters.
        hvd.broadcast_parameters(self._structural_params(), root_rank=0, prefix=f"hvdtrain.param.{self._op()}.")
        # Horovod: and from rank 0's optimizer state — horovod.mxnet has no broadcast_optimizer_state.
        self._ensure_optimizer_states()
        updater, opt = self._updater(), self.trainer._optimizer
        if self.sharded is not None:
            # Horovod: rank 0's whole state (as created, or as loaded from a checkpoint); each rank keeps its shard,
            # and its float32 weights from the parameters just broadcast (or from the checkpoint's master copies).
            whole = self.broadcast_tree(self.sharded.state_arrays() if self.rank == 0 else None)
            self.sharded.load_state_arrays(whole)
        for i in sorted(updater.states):
            for j, arr in enumerate(_flatten_state(updater.states[i])):
                hvd.broadcast_(arr, root_rank=0, name=f"hvdtrain.opt.{i}.{j}.{self._op()}")
        # horovod.mxnet broadcasts run later on MXNet's engine: finish them now, not during interpreter exit, where
        # an op still pending when Horovod shuts down aborts the process (seen under mpirun).
        self.mx.nd.waitall()
        counts = self.broadcast_object({"num_update": opt.num_update, "lr": float(self.trainer.learning_rate),
                                        "index": {str(k): v for k, v in opt._index_update_count.items()},
                                        "scaler": self.scaler.state_dict() if self.scaler else None}
                                       if self.rank == 0 else None)
        self._set_update_counts(counts["num_update"], {int(k): v for k, v in counts["index"].items()})
        self.trainer.set_learning_rate(counts["lr"])  # the rate rank 0's momentum is scaled for
        if self.scaler is not None:
            # Horovod: the loss scale too, so every rank scales and skips alike.
            self.scaler.load_state_dict(counts["scaler"])

    def _set_update_counts(self, num_update: int, per_index: Dict[int, int]) -> None:
        """Restore the optimizer's update counts (Adam's bias correction and schedulers read them).

        The Updater re-points ``_index_update_count`` at ``_all_index_update_counts[device]`` before every update,
        so the counts are written there, for every device entry, not into a new dict.
        """
        opt = self.trainer._optimizer
        opt.num_update = int(num_update)
        device = self.ctx.device_id
        for d in set(opt._all_index_update_counts) | {device}:
            table = opt._all_index_update_counts.setdefault(d, {})
            table.clear()
            table.update(per_index)
        opt._set_current_context(device)

    def last_step_applied(self) -> bool:
        return getattr(self, "_applied", True)

    def synchronize(self) -> None:
        self.mx.nd.waitall()

    def shutdown(self, failed: bool = False) -> None:
        if self.hvd is not None and self.hvd.is_initialized():
            try:
                self.mx.nd.waitall()  # no Horovod op may still be queued on MXNet's engine when Horovod stops
            except Exception:  # noqa: BLE001 - after a failure, a queued op rethrows it here: already reported
                if not failed:
                    raise
            self.hvd.shutdown()

    # --- steps -----------------------------------------------------------------------------------------------------
    def _cross_entropy(self, smoothing: float):
        """Per-sample softmax cross-entropy in float32, with label smoothing defined as in PyTorch."""
        nd = self.mx.nd

        def loss(logits, y):
            if logits.dtype != np.float32:  # astype copies even when the type is already right
                logits = logits.astype("float32")
            logp = nd.log_softmax(logits, axis=1)
            nll = -nd.pick(logp, y, axis=1)
            return nll if smoothing == 0 else (1 - smoothing) * nll - smoothing * logp.mean(axis=1)
        return loss

    def train_step(self, micro_batches: List[Any], mix: Optional[float] = None) -> Dict[str, Any]:
        autograd = self.mx.autograd
        total, samples, phases = None, 0, self.phases
        scale = self.scaler.scale if self.scaler is not None else 1.0
        for batch in micro_batches:
            phases.enter("forward")
            inputs, y = self.task.split(batch)
            inputs = self._compute_dtype(inputs)
            with autograd.record():
                if self.task.step is not None:  # the recipe's own step: several heads, an auxiliary loss
                    loss = self.task.loss_of(self.task.step(self.model, self._compute_dtype(batch)))
                else:
                    if mix is not None:  # mixup with the batch in reverse order
                        x = self.task.mixable(inputs)
                        inputs = (mix * x + (1.0 - mix) * x.flip(axis=0),)
                    outputs = self.model(*inputs)
                    loss = self.loss_fn(outputs, y)  # per-sample losses; backward sums their gradients
                    if mix is not None:
                        loss = mix * loss + (1.0 - mix) * self.loss_fn(outputs, y.flip(axis=0))
                n = y.shape[0]
                if loss.size == 1 and n > 1:  # a batch mean: as per-sample losses, which Gluon's update divides
                    loss = loss * n
                elif loss.size != n:  # per sample and position: each sample's mean
                    loss = loss.reshape((n, -1)).mean(axis=1)
                scaled = loss * scale if scale != 1.0 else loss
            phases.enter("backward")
            scaled.backward()
            mean = loss.mean() / len(micro_batches)
            total = mean if total is None else total + mean
            samples += n
        # Gluon's step() split in its two halves, so that each is a phase. Horovod: allreduce_grads() queues the
        # allreduce of every gradient on MXNet's engine.
        phases.enter("allreduce")
        if self.sharded is not None:
            self.sharded.reduce()
        else:
            self.trainer.allreduce_grads()
        phases.enter("step")
        # Loss scaling: the gradients are looked at after the allreduce, so every rank sees the same ones and skips
        # (or takes) the step together; a skipped step halves the scale.
        self._applied = self.scaler is None or self.scaler.update(self._gradients_finite())
        if self._applied and self.sharded is not None:
            # DistributedTrainer's scaling on the CPU: the sum over ranks / (size x samples x loss scale).
            self.sharded.update(self.predivide / (self.size * samples * scale))
        elif self._applied:
            # Gluon divides the summed gradients by `samples` (and by the loss scale): the mean over the whole
            # (accumulated) batch.
            self.trainer.update(samples * scale)
        if self.accumulate > 1:
            for p in self.trainer._params:
                p.zero_grad()
        return {"loss": total}

    def _gradients_finite(self) -> bool:
        if self.sharded is not None:
            # Horovod: each rank looked at its shard only; the step is taken everywhere or nowhere.
            return self.allreduce_array(np.array([0.0 if self.sharded.finite_here() else 1.0]), "finite")[0] == 0
        grads = [p.grad(self.ctx) for p in self.trainer._params if p.grad_req != "null"]
        nd = self.mx.nd
        # multi_all_finite takes arrays of one type: a float16 network's BatchNorm gradients are float32.
        by_type: Dict[Any, List[Any]] = {}
        for g in grads:
            by_type.setdefault(np.dtype(g.dtype), []).append(g)
        return all(bool(nd.multi_all_finite(*same, num_arrays=len(same), init_output=True).asscalar() > 0)
                   for same in by_type.values())

    def eval_step(self, batch: Any, outputs: bool = True) -> Tuple[Any, Any, float, int]:
        inputs, y = self.task.split(batch)
        loss, out = None, None
        if self.task.step is not None:
            loss, out = self.task.loss_and_outputs(self.task.step(self.model, self._compute_dtype(batch)))
        if out is None and (outputs or loss is None):
            out = self.model(*self._compute_dtype(inputs))
        out = map_arrays(lambda a: a.astype("float32") if self._floating(a) and a.dtype != np.float32 else a, out)
        if loss is None:
            loss = self.eval_loss_fn(out, y)
        n, target = int(y.shape[0]), y.asnumpy()
        return (self._numpy(out) if outputs else None), target, self.task.loss_total(
            loss.astype("float64").asnumpy(), target, n), n

    def _floating(self, a: Any) -> bool:
        """A floating-point NDArray: float16/32/64, and bfloat16 (which numpy sees as a 2-byte record, not a float)."""
        return isinstance(a, self.mx.nd.NDArray) and (np.dtype(a.dtype).kind == "f" or "bfloat16" in str(a.dtype))

    def _compute_dtype(self, batch: Any) -> Any:
        """The batch's floating-point arrays in the network's dtype (float16 under fp16); integers as they are."""
        if self.dtype == "float32":
            return batch
        return map_arrays(lambda a: a.astype(self.dtype) if self._floating(a) else a, batch)

    def _numpy(self, out: Any) -> Any:
        return map_arrays(lambda a: a.asnumpy() if isinstance(a, self.mx.nd.NDArray) else a, out)

    def set_lr(self, lr: float) -> None:
        old = float(self.trainer.learning_rate)
        opt = self.trainer._optimizer
        if lr != old and old > 0 and getattr(opt, "lr_in_momentum", True) and getattr(opt, "momentum", 0):
            self._correct_momentum(lr / old)
        self.trainer.set_learning_rate(lr)

    def _correct_momentum(self, ratio: float) -> None:
        """Momentum correction (Goyal et al. 2017, section 2.1). MXNet's SGD and NAG keep the learning rate inside
        the momentum (``mom = m mom - lr g``, the weight moves by ``mom``), PyTorch outside it (``buf = m buf + g``,
        the weight moves by ``lr buf``): the same update while the rate is constant, not when it changes (under
        warmup and cosine decay, every step). Scaling the momentum by new rate / old rate at each change makes
        MXNet's update PyTorch's exactly: ``mom = -lr buf`` holds at every step."""
        states = self.sharded.states() if self.sharded is not None else self._updater().states.values()
        for state in states:
            # The momentum: the state itself, or the first of (momentum, float32 master weights) with fp16.
            mom = state[0] if isinstance(state, (tuple, list)) else state
            if mom is not None:
                mom *= ratio

    def scalar(self, value: Any) -> float:
        return float(value.asnumpy().sum()) if isinstance(value, self.mx.nd.NDArray) else float(value)

    def get_lr(self) -> float:
        return float(self.trainer.learning_rate)

    def seed(self, seed: int, framework: bool = True) -> None:
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        if framework:  # reseeds MXNet's parallel generators too: about 1 ms on the CPU
            self.mx.random.seed(seed % 2 ** 31, ctx="all")

    # --- data ------------------------------------------------------------------------------------------------------
    def _to_device(self, batch):
        """Every array of the batch on the rank's context, whatever its structure: floating point as float32 (the
        step casts inputs to the network's dtype), integers as int32 (class and token ids, exact), anything else
        as it is."""
        nd = self.mx.nd

        def move(a):
            if not isinstance(a, nd.NDArray):
                a = np.asarray(a)
                kind = a.dtype.kind
                return nd.array(a, ctx=self.ctx, dtype="float32" if kind == "f" else "int32" if kind in "iub" else
                                a.dtype)
            a = a.as_in_context(self.ctx)
            kind = np.dtype(a.dtype).kind
            if kind == "f" and a.dtype != np.float32:
                return a.astype("float32")
            if kind in "iu" and a.dtype != np.int32:
                return a.astype("int32")
            return a
        return map_arrays(move, batch)

    def _pixels_to_device(self, spec, batch):
        """A batch whose first array is uint8 pixels: those moved as bytes, then scaled and normalized on the
        context (:func:`hvdtrain.data.pixel_normalization`); the rest as :meth:`_to_device` moves it."""
        nd = self.mx.nd
        mean, std = (nd.array(v, ctx=self.ctx).reshape((1, -1, 1, 1)) for v in spec)
        x = batch[0]
        x = x.as_in_context(self.ctx) if isinstance(x, nd.NDArray) else nd.array(np.asarray(x), ctx=self.ctx,
                                                                                   dtype="uint8")
        x = nd.broadcast_div(nd.broadcast_sub(x.astype("float32") / 255, mean), std)
        return type(batch)([x, *self._to_device(list(batch[1:]))])

    def check_data(self, train_set: Any, cfg) -> None:
        if decodes_on_device(train_set):
            raise ConfigError("--decoder device decodes on the device with torchvision's nvJPEG, which MXNet "
                              "cannot use (DALI after 1.39 has no MXNet plugin either); on MXNet use --decoder turbo")
        self._records().check(train_set, cfg)

    def _records(self) -> MXNetRecords:
        if self.records is None:
            self.records = MXNetRecords(self.mx, self.rank, self.size, self._to_device)
        return self.records

    def loader(self, dataset: Any, sampler: Iterable[int], batch_size: int, drop_last: bool,
               num_workers: int = 0) -> Iterator[Any]:
        nd = self.mx.nd
        if isinstance(dataset, Synthetic):
            x = nd.random.normal(shape=(batch_size,) + dataset.shape, ctx=self.ctx, dtype=self.dtype)
            y = nd.random.randint(0, dataset.num_classes, shape=(batch_size,), ctx=self.ctx).astype("float32")
            return ((x, y) for _ in range(len(sampler) // batch_size))
        if isinstance(dataset, ArrayDataset):
            return map(self._to_device, array_batches(dataset, list(sampler), batch_size, drop_last))
        if self._records().reads(dataset):
            return self.records.batches(dataset, sampler, batch_size, self.decode_threads(num_workers))
        # Its workers' batches wait --stall-timeout at most (MXNet's own default: 120 s), and its workers die with
        # the rank, as in the PyTorch backend.
        loader = self.mx.gluon.data.DataLoader(_DiesWithRank(dataset) if num_workers > 0 else dataset,
                                               batch_size=batch_size, sampler=list(sampler),
                                               last_batch="discard" if drop_last else "keep",
                                               num_workers=num_workers,
                                               timeout=max(1, int(self.worker_timeout or 120)))
        spec = pixel_normalization(dataset)
        return map(self._to_device if spec is None else functools.partial(self._pixels_to_device, spec), loader)

    def decode_threads(self, num_workers: int) -> int:
        """ImageRecordIter's decode threads: ``--num-workers`` when given; on a GPU the rank's CPU threads (none of
        them computes); on the CPU one, because every core of the rank already computes and a second decode thread
        only takes time from it (one thread decodes small images far faster than a CPU trains on them:
        docs/bench/input.md)."""
        if num_workers > 0:
            return num_workers
        return self.threads if self.on_gpu else 1

    # --- collectives -----------------------------------------------------------------------------------------------
    def allreduce_array_start(self, values: np.ndarray, tag: str) -> Callable[[], np.ndarray]:
        nd = self.mx.nd
        # Horovod: one collective for the whole vector, so every rank gets the same numbers; a fresh name per call
        # (MXNet's engine may hold several in flight). The engine runs it; reading the result waits for it.
        summed = self.hvd.allreduce(nd.array(values, dtype="float64"), op=self.hvd.Sum,
                                    name=f"hvdtrain.{tag}.{self._op()}")
        return summed.asnumpy

    def broadcast_bytes(self, data: Optional[bytes], root: int = 0) -> bytes:
        nd, hvd = self.mx.nd, self.hvd
        # Horovod: size first, then the payload, as a uint8 array (JSON text; nothing is unpickled).
        length = nd.array([len(data) if self.rank == root else 0], dtype="int64")
        length = int(hvd.broadcast(length, root_rank=root, name=f"hvdtrain.bcast.len.{self._op()}").asnumpy()[0])
        buf = (nd.array(np.frombuffer(data, dtype=np.uint8), dtype="uint8") if self.rank == root
               else nd.zeros((length,), dtype="uint8"))
        return hvd.broadcast(buf, root_rank=root, name=f"hvdtrain.bcast.data.{self._op()}").asnumpy().tobytes()

    # --- state -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        params = self._structural_params()
        by_id = {id(p): name for name, p in params.items()}
        updater, opt = self._updater(), self.trainer._optimizer
        states = {}
        for i, p in enumerate(self.trainer._params):
            if i in updater.states:
                states[by_id[id(p)]] = [a.asnumpy() for a in _flatten_state(updater.states[i])]
        counts = {by_id[id(p)]: opt._index_update_count[i] for i, p in enumerate(self.trainer._params)
                  if i in opt._index_update_count}
        if self.sharded is not None:  # the whole state, gathered (every parameter updated num_update times)
            states = self.sharded.state_arrays()
            counts = {name: int(opt.num_update) for name in states}
        state = {"model": {name: p.data(self.ctx).asnumpy() for name, p in params.items()},
                 "optimizer": {"states": states, "num_update": int(opt.num_update), "index_update_count": counts,
                               "lr": float(self.trainer.learning_rate)}}  # the rate the momentum is scaled for
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def loss_scale(self) -> Optional[float]:
        return self.scaler.scale if self.scaler is not None else None

    def gather_state(self) -> None:
        if self.sharded is not None:
            self.sharded.gather_state()

    def parameters_numpy(self) -> Dict[str, Any]:
        return {name: p.data(self.ctx).asnumpy() for name, p in self._structural_params().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        nd = self.mx.nd
        params = self._structural_params()
        missing = sorted(set(params) - set(state["model"]))
        unexpected = sorted(set(state["model"]) - set(params))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.assign_model_arrays(state["model"])
        self._ensure_optimizer_states()
        updater = self._updater()
        index = {id(p): i for i, p in enumerate(self.trainer._params)}
        for name, arrays in ({} if self.sharded is not None else state["optimizer"]["states"]).items():
            p = params[name]
            targets = _flatten_state(updater.states[index[id(p)]])
            keeps = self._keeps_master(p)
            # A float16 run's checkpoint holds master copies a float32 run's lacks: either resumes the other.
            values, master = split_master(arrays, len(targets) - keeps, self._master_at, name)
            if keeps:
                values = join_master(values, master if master is not None else p.data(self.ctx).asnumpy(),
                                     self._master_at)
            for target, value in zip(targets, values):
                target[:] = nd.array(value, ctx=self.ctx, dtype=target.dtype)
        if self.sharded is not None:
            self.sharded.load_state_arrays(state["optimizer"]["states"], keep_whole=True)
            num_update = int(state["optimizer"]["num_update"])
            self._set_update_counts(num_update, {index: num_update for index, *_ in self.sharded.groups})
        else:
            self._set_update_counts(state["optimizer"]["num_update"],
                                    {index[id(params[n])]: int(c)
                                     for n, c in state["optimizer"]["index_update_count"].items()})
        if "lr" in state["optimizer"]:  # without momentum correction: the saved momentum is already at this rate
            self.trainer.set_learning_rate(float(state["optimizer"]["lr"]))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def _statistics_params(self) -> List[Any]:
        return [p for p in self._structural_params().values() if not p._differentiable]  # running mean and var

    def statistics(self) -> np.ndarray:
        stats = self._statistics_params()
        # (through float32, which every floating dtype of MXNet's converts to exactly, bfloat16 included)
        return (np.concatenate([p.data(self.ctx).astype("float32").asnumpy().reshape(-1) for p in stats])
                .astype(np.float64) if stats else np.zeros(0))

    def set_statistics(self, values: np.ndarray) -> None:
        offset = 0
        for p in self._statistics_params():
            n = int(np.prod(p.shape))
            value = self.mx.nd.array(values[offset:offset + n].reshape(p.shape), ctx=self.ctx, dtype="float32")
            p.set_data(value.astype(p.dtype))
            offset += n

    # --- a model's weights outside the loop ------------------------------------------------------------------------
    weight_naming = "gluon"

    def model_arrays(self, model: Any = None) -> Dict[str, np.ndarray]:
        params = (model or self.model)._collect_params_with_prefix()
        return {name: p.data(p.list_ctx()[0]).asnumpy() for name, p in params.items()}

    def assign_model_arrays(self, arrays: Dict[str, np.ndarray], model: Any = None) -> None:
        import mxnet as mx
        for name, p in (model or self.model)._collect_params_with_prefix().items():
            value = arrays[name]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"parameter {name} has shape {value.shape}, the model {p.shape}")
            p.set_data(mx.nd.array(value, ctx=p.list_ctx()[0], dtype=p.dtype))  # every context of p
        if model is None and self.trainer is not None:
            self._weights_changed()

    def _keeps_master(self, p) -> bool:
        """Whether the optimizer keeps float32 master weights for parameter ``p`` (float16, multi-precision)."""
        return bool(self.trainer._optimizer.multi_precision) and np.dtype(p.dtype) == np.float16

    def _weights_changed(self) -> None:
        """The trained model's weights were set from outside the update (--init-from, a checkpoint): the float32
        copies the next update starts from -- fp16's master weights, the sharded update's shard -- follow them.
        Without this a float16 run would go on from the weights it had before (its master copies)."""
        if self.sharded is not None:
            self.sharded.take_weights()
            return
        updater = self._updater()
        for i, p in enumerate(self.trainer._params):
            if i in updater.states and self._keeps_master(p):
                _flatten_state(updater.states[i])[self._master_at][:] = p.data(self.ctx).astype("float32")

    def prepare_model(self, model: Any, sample_shape) -> Any:
        import mxnet as mx
        place_parameters(mx, model.collect_params(), mx.cpu())
        resolve_shapes(mx, model, sample_shape, mx.cpu())
        return model

    def predict(self, model: Any, x: np.ndarray) -> np.ndarray:
        import mxnet as mx
        return model(mx.nd.array(x, dtype="float32")).asnumpy()  # outside autograd.record: inference mode

    def export_native(self, model: Any, directory: str, sample_shape) -> Dict[str, str]:
        import mxnet as mx
        # Gluon's save_parameters (structural names: what gluoncv.model_zoo.get_model(...).load_parameters reads),
        # then the hybridized graph and its parameters (what gluon.SymbolBlock.imports reads, without hvdtrain).
        model.save_parameters(os.path.join(directory, "model.params"))
        if not isinstance(model, mx.gluon.HybridBlock):
            return {"weights": "model.params"}
        model.hybridize()
        model(mx.nd.zeros((1,) + tuple(sample_shape))).wait_to_read()
        model.export(os.path.join(directory, "model"), epoch=0)
        return {"weights": "model.params", "symbol": "model-symbol.json", "symbol_params": "model-0000.params"}
