"""PyTorch + horovod.torch backend."""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import sys
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .. import precision as precisions
from ..basics import die_with_parent
from ..config import ConfigError
from ..data import ArrayDataset, Synthetic, array_batches, decodes_on_device, map_arrays, pixel_normalization
from ..threads import created_by
from ..vision import EncodedImages, decode_rgb
from .base import Backend, Task
from .resources import (estimated_threads, gpu_for_rank, horovod_environment, keep_freed_memory, preload_image_codecs,
                        user_threads)
from .torch_groups import BUCKETS, distributed_optimizer
from .torch_optim import make_optimizer as make_torch_optimizer, parameter_groups
from .torch_sharded import ShardedOptimizer

_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _to_numpy(obj: Any) -> Any:
    """Tensors inside nested containers to numpy (bf16, which numpy lacks, as float32)."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_float32(obj: Any) -> Any:
    """Model outputs in float32 (autocast computes some in fp16/bf16)."""
    return map_arrays(lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t, obj)


def _to_torch(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


def bf16_slowdown(n: int = 256, repeats: int = 3) -> float:
    """How many times longer an n x n matmul takes in bfloat16 than in float32 on this CPU (best of ``repeats``)."""
    def best(dtype) -> float:
        a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
        a @ b  # first call: kernel selection, allocation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)
    return best(torch.bfloat16) / max(best(torch.float32), 1e-9)


def _elastic_state(backend):
    """A ``horovod.common.elastic.State`` of the backend's whole training state (its ``state_dict``: model,
    optimizer, loss scaler). ``sync`` is the start-up broadcast, then a check that every worker holds the same."""
    from horovod.common.elastic import State

    class TrainingState(State):
        def __init__(self):
            # Horovod: its host-update check broadcasts with this; hvdtrain's JSON broadcast pickles nothing.
            super().__init__(bcast_object=lambda obj: backend.broadcast_object(obj), get_rank=backend.hvd.rank)
            self.save()

        def save(self):
            self._saved = backend.state_dict()  # numpy copies

        def restore(self):
            backend.load_state_dict(self._saved)

        def sync(self):
            backend.broadcast_state()
            backend.check_replicas("after the elastic sync")

    return TrainingState()


WORKER_START_SECONDS = 10.0
"""How long a data loader worker may take from its fork to its ``worker_init_fn`` (a few milliseconds when it works)
before it counts as stuck at its start and the loader's workers are started again (:func:`_started`)."""
WORKER_STARTS = 3
"""Starts of a loader's workers before a worker stuck at its start fails the job."""


def _worker_starts(started, rank_pid: int, worker_id: int) -> None:
    """DataLoader's ``worker_init_fn``: the kernel kills the worker when its rank's process ends, and the worker
    marks itself started in ``started`` (shared memory, one byte per worker)."""
    die_with_parent(rank_pid)
    started[worker_id] = 1


def _end_workers(iterator) -> None:
    """Kill what is left of a multiprocess DataLoader iterator's workers (SIGKILL: a worker stuck in its start never
    ran the Python that would handle a SIGTERM, and has not asked the kernel to kill it with its rank), then shut the
    iterator down. Its workers' pids leave PyTorch's SIGCHLD check first, which would otherwise report the kill as a
    worker failure."""
    import signal
    from torch.utils.data import _utils
    if getattr(iterator, "_worker_pids_set", False):
        _utils.signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    for w in getattr(iterator, "_workers", []):
        if w.is_alive():
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    iterator._shutdown_workers()


def _started(loader, started) -> Any:
    """``iter(loader)`` once each of its workers has run its ``worker_init_fn``. A child forked while another
    thread of the rank held CPython's list of threads (CPython issue gh-112275; Python 3.11.7 has it) waits for that
    lock forever and never runs a line of the worker: it would deliver no batch (the loader's timeout then fails the
    job) and outlive its rank (it never asked to die with it), holding the rank's output open, so that the launcher
    never ends the job. Such a start is killed and repeated, with the random state it began with (the same seeds,
    the same batches), up to WORKER_STARTS times."""
    state = torch.get_rng_state()
    for attempt in range(1, WORKER_STARTS + 1):
        started[:] = [0] * len(started)
        torch.set_rng_state(state)  # the iterator draws its workers' base seed from it
        iterator = iter(loader)
        deadline = time.monotonic() + WORKER_START_SECONDS
        while not all(started) and time.monotonic() < deadline:
            time.sleep(0.005)
        if all(started):
            return iterator
        stuck = [w.pid for w, ran in zip(iterator._workers, started) if not ran]
        _end_workers(iterator)
        print(f"hvdtrain: warning: data loader worker(s) {', '.join(map(str, stuck))} did not start within "
              f"{WORKER_START_SECONDS:g} s of their fork (start {attempt} of {WORKER_STARTS}): killed"
              + (", starting the loader's workers again" if attempt < WORKER_STARTS else ""),
              file=sys.stderr, flush=True)
    raise RuntimeError(f"data loader workers (--num-workers) did not start {WORKER_STARTS} times in a row: a worker "
                       f"forked by this rank never ran (CPython issue gh-112275 makes a fork next to a starting or "
                       f"ending thread hang; a newer Python fixes it), or this host is too loaded to start one within "
                       f"{WORKER_START_SECONDS:g} s; try --num-workers 0")


def _within_timeout(loader, started, seconds: float) -> Iterator[Any]:
    """``loader``'s batches, its workers started (:func:`_started`); its timeout names what it means and what to
    change, and kills the workers left, so that none outlives the rank."""
    iterator = _started(loader, started)
    try:
        yield from iterator
    except RuntimeError as e:
        if "timed out" not in str(e):
            raise
        _end_workers(iterator)
        raise RuntimeError(f"{e}: a data loader worker (--num-workers) delivered no batch within --stall-timeout "
                           f"({seconds:g} s): it hung, or reads far too slowly (raise --stall-timeout for slow "
                           f"storage)") from e


class TorchBackend(Backend):
    name = "torch"
    # --allreduce-groups auto on the CPU: DDP's buckets in the backward pass's order (torch_groups): the first, small,
    # is sent while the rest of the backward pass runs, where one group waits for all of it.
    cpu_allreduce_groups = BUCKETS
    # Under a quota of less than a core per rank, the first bucket sent while the backward pass runs slows both on
    # a host that must share its quota between them, and the ring runs at its slowest host's pace: one group after
    # the backward pass (8 shaped hosts of a quarter core: 325.8 against 295.5 img/s; 4 of half a core, with the group
    # negotiated at once: 249.2 against 238.6; docs/bench/pytorch-at-scale.md).
    quota_allreduce_groups = 1

    def __init__(self):
        self.hvd = None
        self.model = None
        self.optimizer = None
        self.scaler = None
        self.loss_fn = None
        self.amp_dtype = None
        self.sharded = False
        self.late = None  # --overlap-forward's parameter (torch_groups.LateParameter)

    # --- lifecycle -------------------------------------------------------------------------------------------------
    def init(self, cfg) -> None:
        native_bf16 = self.resolve_precision(cfg, torch.cuda.is_available())
        self.malloc = keep_freed_memory()  # before the model and the first step allocate
        preload_image_codecs()  # before Horovod's RTLD_GLOBAL library: see its docstring
        horovod_environment(cfg, self.per_gradient(cfg, torch.cuda.is_available()))
        self.worker_timeout = float(cfg.stall_timeout)
        import horovod.torch as hvd
        self.hvd = hvd
        # Horovod: start the background thread and join the job (rank, size, local rank from the launcher).
        with created_by("horovod", "transport"):  # its threads, for the per-thread CPU of each epoch
            hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.agree_precision(cfg, native_bf16)  # one collective: every rank computes in the same precision
        if cfg.adasum and self.size > 1 and not hvd.mpi_enabled():
            # Horovod implements Adasum on MPI only; on Gloo the first step fails ("No Adasum operation enabled").
            raise ConfigError("--adasum needs Horovod's MPI controller: launch with mpirun (or horovodrun --mpi); "
                              "Gloo has no Adasum")
        if torch.cuda.is_available():
            # Horovod: one GPU per process, chosen by local rank, before anything is created on a GPU.
            gpu = gpu_for_rank(self.local_rank, self.local_size, torch.cuda.device_count(),
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
            self.on_gpu = self.asynchronous = True
        else:
            self.device = torch.device("cpu")
        # Horovod: ranks on one host that share cores split them; all-cores-each oversubscribes them (horovod#2804).
        # A cgroup CPU quota (a container's limit) caps them too; --threads, or the user's OMP_NUM_THREADS, wins.
        self.cfg_threads = cfg.threads or user_threads()
        if cfg.elastic:  # a joining worker runs no extra collective
            self.threads, self.threads_reason = estimated_threads(self.local_size, self.cfg_threads)
        else:
            self.threads, self.threads_reason = self.threads_per_rank(self.cfg_threads)
        torch.set_num_threads(self.threads)
        self.amp_dtype = _AMP_DTYPES.get(self.precision)
        if self.precision == "bf16" and not native_bf16 and self.rank == 0:
            # PyTorch trains in emulated bf16 (not refused as on MXNet, where it fails), but the user is told once.
            forced = cfg.precision == "auto"  # HVDTRAIN_AUTO_PRECISION=bf16 decided it
            asked = f"{precisions.AUTO_VARIABLE}=bf16" if forced else "--precision bf16"
            better = f"unset {precisions.AUTO_VARIABLE} (auto is fp32 here)" if forced else \
                "--precision auto (fp32 here)"
            print(f"hvdtrain: warning: {asked} is emulated here ({self.bf16_missing}): a bf16 matmul took "
                  f"{bf16_slowdown():.0f}x the fp32 time on this CPU; {better} trains faster",
                  file=sys.stderr, flush=True)

    def setup(self, model: Any, cfg, loss_fn=None, sample_shape=None, task=None) -> None:
        hvd = self.hvd
        self.model = model.to(self.device)
        self.compiling = None
        if cfg.compile:
            self._compile(cfg)
        smoothing = cfg.label_smoothing
        self.loss_fn = loss_fn or (lambda logits, y: F.cross_entropy(logits, y, label_smoothing=smoothing))
        self.eval_loss_fn = loss_fn or (lambda logits, y: F.cross_entropy(logits, y, reduction="none"))
        self.task = task or Task()
        self.accumulate = cfg.accumulate
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        params = parameter_groups(cfg, named)

        def make_optimizer(groups):
            return make_torch_optimizer(cfg, groups)

        compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
        self.sharded = cfg.shard_optimizer
        groups = 0 if self.sharded else self.allreduce_groups(cfg)
        if self.sharded:
            # Horovod: reduce-scatter, update this rank's shard, allgather (torch_sharded); accumulation sums the
            # `accumulate` backward passes locally before the one reduce-scatter.
            self.optimizer = ShardedOptimizer(hvd, params, make_optimizer, compression, cfg.predivide)
        elif groups:  # grouped allreduces in the backward pass's order, --predivide honoured, no pickled collective,
            # unused gradients as 0 (torch_groups)
            self.optimizer = distributed_optimizer(make_optimizer(params), named, compression, cfg.accumulate,
                                                   cfg.predivide, groups, cfg.overlap_forward)
        else:
            # Horovod: average gradients across ranks in the backward pass (fused allreduce in the background
            # thread); accumulation sums `accumulate` backward passes locally before one allreduce.
            self.optimizer = hvd.DistributedOptimizer(
                make_optimizer(params), named_parameters=named, compression=compression,
                backward_passes_per_step=cfg.accumulate, op=hvd.Adasum if cfg.adasum else hvd.Average,
                gradient_predivide_factor=cfg.predivide)
        # Horovod: with Adasum on several ranks, step() allreduces the parameter deltas itself (no synchronize()).
        self.adasum_step = cfg.adasum and self.size > 1
        if cfg.dynamic_loss_scale(self.precision):
            self.scaler = torch.amp.GradScaler(self.device.type)
        if cfg.overlap_forward:
            self._overlap_forward(groups)
        if not cfg.elastic:  # elastic: state.sync() broadcasts, and a late joiner must not run extra collectives
            self.broadcast_state()

    def _overlap_forward(self, groups: int) -> None:
        """--overlap-forward: the first group's largest parameter updated as the next forward pass reaches its layer
        (torch_groups.LateParameter)."""
        if not groups:
            raise ConfigError("--overlap-forward needs grouped allreduces, which this run does not use (they are off "
                              "on a GPU by default): add --allreduce-groups N, or drop --overlap-forward")
        if self.scaler is not None:
            raise ConfigError(f"--overlap-forward cannot be combined with a dynamic loss scale (--precision "
                              f"{self.precision} chose one): its overflow check needs every gradient before any "
                              f"update; choose --precision bf16 or fp32, or --loss-scale none")
        self.late = self.optimizer._late
        if self.late is None:  # no parameter to train
            return
        self.late.hook(self.optimizer, self.model)
        if self.rank == 0:
            name = self.optimizer._parameter_names.get(self.late.param)
            print(f"hvdtrain: --overlap-forward: {name} ({self.late.param.numel() * self.late.param.element_size()} "
                  f"bytes of gradient) is sent in two halves and updated as the next forward pass reaches its layer",
                  flush=True)

    def settle(self) -> None:
        # --overlap-forward: the update that waits for its layer's next forward pass, before the model is read.
        if self.late is not None:
            self.late.settle(self.optimizer)

    def _compile(self, cfg) -> None:
        """--compile: the model's blocks compiled in place (torch_compile), before Horovod's hooks are registered on
        its parameters (which the regions keep); compiled at the first step, which says how long it took."""
        from .torch_compile import cache_directory, compile_regions, graphs_compiled
        cache = cache_directory(cfg.output_dir)
        regions, fallback = compile_regions(self.model, [n for n in cfg.compile_blocks.split(",") if n],
                                            cfg.compile_mode, cfg.compile_backend)
        self.compiling = {"regions": regions, "graphs": graphs_compiled(), "step": 0, "warned": 0}
        if self.rank == 0:
            shown = ", ".join(regions[:4]) + (f", ... ({len(regions)} in all)" if len(regions) > 4 else "")
            print(f"hvdtrain: --compile: {len(regions)} region(s) ({shown}), backend {cfg.compile_backend}, mode "
                  f"{cfg.compile_mode}; compiled at the first step; inductor's cache in {cache}", flush=True)
            if fallback:
                print("hvdtrain: warning: --compile found no repeated blocks in the model and compiles it as one "
                      "region: every gradient then reaches Horovod at the end of the backward pass, so no allreduce "
                      "overlaps it; name the blocks with --compile-blocks (or the recipe's compile_blocks())",
                      file=sys.stderr, flush=True)

    def _compile_step(self, seconds: float, before: int) -> None:
        """After a training step with --compile: the first says what compiling cost; a later one that compiled
        again (a changing input shape) is reported, once per new count of graphs."""
        from .torch_compile import graphs_compiled
        state, now = self.compiling, graphs_compiled()
        state["step"] += 1
        if self.rank != 0:
            return
        if state["step"] == 1:
            print(f"hvdtrain: --compile: compiling {len(state['regions'])} region(s) ({now - state['graphs']} "
                  f"graph(s)) took the first step {seconds:.1f} s", flush=True)
        elif now > before:
            state["warned"] += 1
            print(f"hvdtrain: warning: --compile recompiled at training step {state['step']} ({now - before} more "
                  f"graph(s), {state['warned']} time(s) so far): an input of another shape or dtype; the training "
                  f"loader drops the last partial batch, so look for a varying sequence length or image size "
                  f"(dynamo stops recompiling after torch._dynamo.config.cache_size_limit and runs eager)",
                  file=sys.stderr, flush=True)

    def last_step_applied(self) -> bool:
        if self.scaler is None:
            return True
        return not any(float(v.item()) for v in getattr(self, "_found_inf", []))

    def broadcast_state(self) -> None:
        self.settle()
        # Horovod: every rank starts from rank 0's weights and buffers.
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        # Horovod: and from its optimizer state (momentum, step counts) and loss scale, as arrays plus JSON.
        # hvd.broadcast_optimizer_state is not used: it pickles its scalars, and on a fresh optimizer it takes a step
        # with zero gradients to create the state (weight decay then moves every weight before training starts).
        ours = {"optimizer": _to_numpy(self.optimizer.state_dict()),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None} if self.rank == 0 else None
        received = self.broadcast_tree(ours)
        if self.rank != 0:
            self.optimizer.load_state_dict(_to_torch(received["optimizer"]))
            if self.scaler is not None:
                self.scaler.load_state_dict(received["scaler"])

    # --- elastic ---------------------------------------------------------------------------------------------------
    def run_elastic(self, trainer) -> Any:
        """The epochs under ``hvd.elastic.run``: when a worker fails or hosts change, every survivor rolls back to
        the last commit, Horovod re-forms the ring with the workers there are, rank 0's state is broadcast, and
        training continues from the committed position (sample offset in the epoch), re-sharded for the new size."""
        hvd = self.hvd
        # Horovod: model, optimizer and loss scaler are saved on commit, restored on failure and broadcast from rank 0
        # on reset (the start-up broadcast: arrays and JSON; not TorchState, which pickles, leaves the scaler out and
        # takes a step on a fresh optimizer).
        state = _elastic_state(self)
        self._elastic_state = state
        self._committed = trainer.position.as_dict()

        def on_reset():
            self.rank, self.size = hvd.rank(), hvd.size()
            self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
            self.threads, self.threads_reason = estimated_threads(self.local_size, self.cfg_threads)
            torch.set_num_threads(self.threads)
            print(f"hvdtrain: [rank {self.rank}] elastic reset: {self.size} worker(s) now", flush=True)

        state.register_reset_callbacks([on_reset])

        @hvd.elastic.run
        def run(state):
            # Horovod: every rank continues from rank 0's last committed position (JSON, not pickle).
            position = self.broadcast_object(self._committed if self.rank == 0 else None)
            self._committed = position
            trainer.restore_position(position)
            return trainer.run_epochs()

        return run(state)

    def commit(self, position: Dict[str, int]) -> None:
        self._committed = dict(position)
        # Horovod: State.commit() is save() then check_host_updates(); they are split so that the trainer can record
        # a finished epoch between the two (an interrupt raised here would otherwise drop that epoch's record).
        self._elastic_state.save()

    def check_membership(self) -> None:
        # Horovod: raises HostsUpdatedInterrupt when workers were added; the run restarts from the commit.
        self._elastic_state.check_host_updates()

    def shutdown(self, failed: bool = False) -> None:
        if not failed:
            self.settle()
        if self.hvd is not None and self.hvd.is_initialized():
            self.hvd.shutdown()

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- steps -----------------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def train_step(self, micro_batches: List[Any], mix: Optional[float] = None) -> Dict[str, Any]:
        if self.compiling is not None:
            from .torch_compile import graphs_compiled
            before, start = graphs_compiled(), time.perf_counter()
            out = self._train_step(micro_batches, mix)
            self._compile_step(time.perf_counter() - start, before)
            return out
        return self._train_step(micro_batches, mix)

    def _train_step(self, micro_batches: List[Any], mix: Optional[float] = None) -> Dict[str, Any]:
        self.model.train()
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        phases = self.phases
        for batch in micro_batches:
            phases.enter("forward")
            with self._autocast():
                if self.task.step is not None:  # the recipe's own step: several heads, an auxiliary loss
                    loss = self.task.loss_of(self.task.step(self.model, batch))
                else:
                    inputs, y = self.task.split(batch)
                    if mix is not None:  # mixup with the batch in reverse order
                        x = self.task.mixable(inputs)
                        inputs = (mix * x + (1.0 - mix) * x.flip(0),)
                    outputs = self.model(*inputs)
                    loss = self.loss_fn(outputs, y)
                    if mix is not None:
                        loss = mix * loss + (1.0 - mix) * self.loss_fn(outputs, y.flip(0))
                # The mean over n micro-batches: accumulation equals one batch n times larger.
                loss = loss.mean() / n
            phases.enter("backward")
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            total += loss.detach().float()
        # Horovod: the allreduces started in backward's hooks; synchronize() waits for them (the allreduce phase),
        # then the optimizer steps without a second synchronize. With fp16, unscaling comes between the two
        # (horovod#1089, #3160); gradients are identical on every rank after the allreduce, so an inf/NaN makes every
        # rank skip the step together.
        phases.enter("allreduce")
        self.optimizer.synchronize()
        phases.enter("step")
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            # Whether step() will skip: read only after a non-finite loss (last_step_applied), so no sync here.
            self._found_inf = list(self.scaler._found_inf_per_device(self.optimizer).values())
            if self.sharded:  # each rank looked at its shard only
                self.optimizer.agree_found_inf(self._found_inf)
        with contextlib.nullcontext() if self.adasum_step else self.optimizer.skip_synchronize():
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad()
        return {"loss": total}

    @torch.no_grad()
    def eval_step(self, batch: Any, outputs: bool = True) -> Tuple[Any, Any, float, int]:
        self.settle()
        self.model.eval()
        inputs, y = self.task.split(batch)
        with self._autocast():
            if self.task.step is not None:
                loss, out = self.task.loss_and_outputs(self.task.step(self.model, batch))
                if out is None and outputs:
                    out = self.model(*inputs)
            else:
                out = self.model(*inputs)
                loss = None
            out = _to_float32(out)
            if loss is None:
                loss = self.eval_loss_fn(out, y)
        n, target = int(y.shape[0]), _to_numpy(y)
        return (_to_numpy(out) if outputs else None), target, self.task.loss_total(_to_numpy(loss.float()), target,
                                                                                  n), n
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def scalar(self, value: Any) -> float:
        return float(value.item()) if torch.is_tensor(value) else float(value)

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def seed(self, seed: int, framework: bool = True) -> None:
        random.seed(seed)
        np.random.seed(seed % 2 ** 32)
        if framework and self.device.type == "cpu":
            # The CPU generator alone: torch.manual_seed would queue a seed for each accelerator runtime that is not
            # initialized (CUDA, XPU, MTIA), each with a formatted trace of the caller's stack: 0.1-0.4 ms a step.
            torch.default_generator.manual_seed(seed)
        elif framework:
            torch.manual_seed(seed)

    # --- data ------------------------------------------------------------------------------------------------------
    def _to_device(self, batch):
        """Every array of the batch on the device, whatever its structure: floating point as float32 (autocast
        computes in fp16/bf16), integers as int64 (class and token ids), anything else as it is."""
        def move(a):
            t = torch.as_tensor(a)
            if t.is_floating_point():
                t = t.float()
            elif t.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32):
                t = t.long()
            return t.to(self.device, non_blocking=True)
        return map_arrays(move, batch)

    def _pixels_to_device(self, spec, batch):
        """A batch whose first array is uint8 pixels, or images still encoded (``--decoder device``): those moved as
        bytes, decoded there if encoded, then scaled and normalized on the device
        (:func:`hvdtrain.data.pixel_normalization`); the rest as :meth:`_to_device` moves it."""
        mean, std = (torch.tensor(v, device=self.device).view(1, -1, 1, 1) for v in spec)
        if isinstance(batch[0], EncodedImages):
            x = self._decode_images(batch[0])
        else:
            x = torch.as_tensor(batch[0]).to(self.device, non_blocking=True).float()
        return type(batch)([x.div_(255).sub_(mean).div_(std), *self._to_device(list(batch[1:]))])

    def _decode_images(self, images: EncodedImages):
        """N x 3 x S x S float pixels (0-255) on the device: each image decoded (:meth:`_decode_jpegs`), cropped to
        its box and resized to S, or resized to its shorter side and centre-cropped (validation), both bilinear and
        antialiased, and flipped, there."""
        side = images.size
        out = torch.empty((len(images), 3, side, side), device=self.device)
        for i, img in enumerate(self._decode_jpegs(images.data, images.names)):
            img = img[None].float()
            if images.resize:
                h, w = img.shape[2:]
                scale = images.resize / min(w, h)
                img = F.interpolate(img, size=(max(side, round(h * scale)), max(side, round(w * scale))),
                                    mode="bilinear", align_corners=False, antialias=True)
                y, x = (img.shape[2] - side) // 2, (img.shape[3] - side) // 2
                crop = img[0, :, y:y + side, x:x + side]
            else:
                x, y, w, h = images.boxes[i].tolist()
                crop = F.interpolate(img[:, :, y:y + h, x:x + w], size=(side, side), mode="bilinear",
                                     align_corners=False, antialias=True)[0]
            out[i] = crop.flip(-1) if images.flips[i] else crop
        return out.clamp_(0, 255)

    def _decode_jpegs(self, data: List[bytes], names: List[str]) -> List[Any]:
        """3 x H x W uint8 tensors on the device: on a GPU the JPEGs by nvJPEG in one call (torchvision), others on
        the CPU; on the CPU every image by libjpeg-turbo (hvdtrain.vision.decode_rgb): the GPU path's stand-in."""
        out: List[Any] = [None] * len(data)
        gpu = [i for i, d in enumerate(data) if d[:2] == b"\xff\xd8"] if self.device.type == "cuda" else []
        if gpu:
            from torchvision.io import ImageReadMode, decode_jpeg
            encoded = [torch.frombuffer(bytearray(data[i]), dtype=torch.uint8) for i in gpu]
            for i, img in zip(gpu, decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)):
                out[i] = img
        for i, d in enumerate(data):
            if out[i] is None:
                arr = decode_rgb(d, names[i])
                out[i] = torch.from_numpy(arr if arr.flags.writeable else arr.copy()).permute(2, 0, 1).to(self.device)
        return out

    def check_data(self, train_set: Any, cfg) -> None:
        if decodes_on_device(train_set) and self.device.type == "cuda":
            try:
                import torchvision.io  # noqa: F401
            except ImportError:
                raise ConfigError("--decoder device decodes JPEGs on the GPU with torchvision's nvJPEG, and "
                                  "torchvision is not installed: pip install torchvision (the build that matches "
                                  "this torch), or use --decoder turbo") from None

    def loader(self, dataset: Any, sampler: Iterable[int], batch_size: int, drop_last: bool,
               num_workers: int = 0) -> Iterator[Any]:
        if isinstance(dataset, Synthetic):
            x = torch.randn((batch_size,) + dataset.shape, device=self.device)
            y = torch.randint(0, dataset.num_classes, (batch_size,), device=self.device)
            return ((x, y) for _ in range(len(sampler) // batch_size))
        if isinstance(dataset, ArrayDataset):
            return map(self._to_device, array_batches(dataset, list(sampler), batch_size, drop_last))
        # A worker that delivers no batch within --stall-timeout fails the job (RuntimeError "DataLoader timed out
        # after N seconds"), as a stalled collective does: a hung worker would otherwise leave every rank waiting.
        limit = self.worker_timeout if num_workers > 0 else 0  # (PyTorch refuses a timeout without workers)
        # Each worker dies with its rank: one stuck in a read would otherwise outlive a rank that was killed (by
        # horovodrun after another rank failed, or the OOM killer), holding the rank's output pipes open, and the
        # launcher would wait for them. And each says it started (_started).
        started = multiprocessing.Array("b", num_workers, lock=False) if num_workers > 0 else None
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=list(sampler),
                                             collate_fn=getattr(dataset, "collate", None),
                                             num_workers=num_workers, drop_last=drop_last,
                                             pin_memory=self.device.type == "cuda",
                                             persistent_workers=False, timeout=limit,
                                             worker_init_fn=functools.partial(_worker_starts, started, os.getpid()))
        spec = pixel_normalization(dataset)
        to_device = self._to_device if spec is None else functools.partial(self._pixels_to_device, spec)
        return map(to_device, _within_timeout(loader, started, limit) if limit else loader)

    # --- collectives -----------------------------------------------------------------------------------------------
    def allreduce_array_start(self, values: np.ndarray, tag: str) -> Callable[[], np.ndarray]:
        # Horovod: one collective for the whole vector, so every rank gets the same numbers.
        hvd = self.hvd
        handle = hvd.allreduce_async(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)),
                                     op=hvd.Sum, name=f"hvdtrain.{tag}")
        return lambda: hvd.synchronize(handle).numpy()

    def broadcast_bytes(self, data: Optional[bytes], root: int = 0) -> bytes:
        hvd = self.hvd
        # Horovod: size first, then the payload, as a uint8 tensor (JSON text; nothing is unpickled).
        length = torch.tensor([len(data) if self.rank == root else 0], dtype=torch.int64)
        length = int(hvd.broadcast(length, root_rank=root, name="hvdtrain.bcast.len").item())
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root
               else torch.zeros(length, dtype=torch.uint8))
        return bytes(hvd.broadcast(buf, root_rank=root, name="hvdtrain.bcast.data").numpy().tobytes())

    # --- state -----------------------------------------------------------------------------------------------------
    def loss_scale(self) -> Optional[float]:
        return self.scaler.get_scale() if self.scaler is not None else None

    def state_dict(self) -> Dict[str, Any]:
        self.settle()
        optimizer = self.optimizer.state_dict()
        # In the parameters' order, as a step creates it: --overlap-forward's late parameter gets its state last.
        optimizer["state"] = dict(sorted(optimizer["state"].items()))
        state = {"model": _to_numpy(self.model.state_dict()), "optimizer": _to_numpy(optimizer)}
        if self.scaler is not None:
            state["scaler"] = _to_numpy(self.scaler.state_dict())
        return state

    def gather_state(self) -> None:
        if self.sharded:
            self.optimizer.gather_state()

    def parameters_numpy(self) -> Dict[str, Any]:
        self.settle()
        return _to_numpy(self.model.state_dict())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.settle()
        self.assign_model_arrays(state["model"])
        self.optimizer.load_state_dict(_to_torch(state["optimizer"]))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def _statistics_buffers(self) -> List[Any]:
        return [b for b in self.model.buffers() if b.is_floating_point()]  # running mean and var, not the counts

    def statistics(self) -> np.ndarray:
        buffers = self._statistics_buffers()
        return (torch.cat([b.detach().reshape(-1).double() for b in buffers]).numpy() if buffers else np.zeros(0))

    def set_statistics(self, values: np.ndarray) -> None:
        offset = 0
        for b in self._statistics_buffers():
            b.copy_(torch.from_numpy(values[offset:offset + b.numel()]).view_as(b))  # in b's dtype
            offset += b.numel()

    # --- a model's weights outside the loop ------------------------------------------------------------------------
    weight_naming = "torch"
    exports_onnx = True

    def model_arrays(self, model: Any = None) -> Dict[str, np.ndarray]:
        self.settle()
        return _to_numpy((model or self.model).state_dict())

    def assign_model_arrays(self, arrays: Dict[str, np.ndarray], model: Any = None) -> None:
        self.settle()
        (model or self.model).load_state_dict(_to_torch(dict(arrays)), strict=True)

    def prepare_model(self, model: Any, sample_shape) -> Any:
        return model.eval()

    def predict(self, model: Any, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model.eval()(torch.from_numpy(np.ascontiguousarray(x, np.float32))).float().numpy()

    def export_native(self, model: Any, directory: str, sample_shape) -> Dict[str, str]:
        # A plain state dict of tensors: torch.load(path, weights_only=True) reads it, load_state_dict(strict=True)
        # takes it.
        torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                   os.path.join(directory, "model.pt"))
        return {"weights": "model.pt"}

    def export_onnx(self, model: Any, path: str, sample_shape) -> None:
        try:
            import onnx  # noqa: F401 - the exporter needs it; say so here rather than deep inside torch.onnx
            import onnxscript  # noqa: F401
        except ImportError:
            raise ConfigError("--format onnx needs the onnx extra: pip install 'hvdtrain[onnx]' "
                              "(onnx, onnxscript, onnxruntime)") from None
        x = torch.zeros((2,) + tuple(sample_shape))
        batch = torch.export.Dim("batch", min=1)
        with contextlib.redirect_stdout(sys.stderr):  # the exporter's progress lines are not this command's output
            torch.onnx.export(model.eval(), (x,), path, input_names=["images"], output_names=["logits"],
                              dynamic_shapes=({0: batch},), dynamo=True, external_data=False, verbose=False)
