"""The Backend contract: everything the Trainer needs from a framework plus Horovod, and nothing recipe-specific.

Both backends implement it with the same behaviour, so the Trainer loop reads the same on PyTorch and MXNet:

- ``init(cfg)``: hvd.init(); the device pinned by local rank (CPU threads = cores / ranks on the host otherwise).
- ``setup(model, cfg)``: optimizer, Horovod's distributed optimizer (compression, accumulation, predivide), and
  parameters plus optimizer state broadcast from rank 0.
- ``train_step(micro_batches)``: forward/backward over ``accumulate`` micro-batches, one allreduce, one optimizer
  step; returns backend-native scalars (summed by the Trainer without a device synchronisation). It marks the
  phases it enters on ``self.phases`` (forward, backward, allreduce, step); ``synchronize()`` waits for the device.
- ``start_timeline(path)`` / ``stop_timeline()``: Horovod's timeline for a window of steps.
- ``eval_step(batch, outputs)``: one validation batch as (the model's outputs as numpy, or None without
  ``outputs``; the target as numpy; the recipe's loss as (sum, weight) by :meth:`Task.loss_total`; the number of
  samples).
- ``allreduce_array_start`` (the one collective a backend implements for metrics: started, then waited for by the
  call it returns), and on it ``allreduce_array``, ``allreduce_sum`` / ``allreduce_sum_start`` / ``allreduce_mean``
  (metrics across ranks, returned as floats), ``allgather_array`` and ``allgather_floats``.
- ``broadcast_object``: a JSON-able value from rank 0 (JSON, never pickle: nothing received is unpickled);
  ``broadcast_tree``: a nested state with numpy arrays, in the checkpoint format.
- ``set_lr`` / ``get_lr``, ``seed``, ``state_dict`` / ``load_state_dict`` (numpy arrays and plain Python only), ``broadcast_state``.
- ``statistics`` / ``set_statistics``: the model's running statistics (BatchNorm's) as one vector, which
  ``average_statistics`` averages before an evaluation and a checkpoint inside an epoch keeps by rank.
- ``loader(dataset, sampler, batch_size, drop_last)``: batches on the device.
- ``settle()``: apply any update a step left to the next forward pass (PyTorch's ``--overlap-forward``); the
  backend's own readers of the model call it, and so does a callback that reads the weights between two steps.
"""
from __future__ import annotations

import abc
import json
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .. import precision as precisions
from ..config import GROUPS_AUTO
from ..phases import PhaseTimer
from .resources import (below_a_core, cgroup_cpu_quota, cgroup_key, decode_cores, encode_cores, host_key, own_cores,
                        slurm_cpus_per_task, thread_budget)


class Task:
    """The recipe's task as the backends run it: how a batch splits into the model's inputs and the target
    (``split``, :func:`hvdtrain.data.split_batch` by default), and optionally the recipe's own step (``step(model,
    batch)`` returning the loss, or ``(loss, outputs)``) for a loss that needs more than ``loss(outputs, target)``.

    Loss conventions, the same on both frameworks: a loss is a scalar (the batch's mean), one value per sample, or
    one per sample and position (a sequence); training minimises its mean, evaluation reports its mean per sample."""

    def __init__(self, split: Callable[[Any], Tuple[Tuple[Any, ...], Any]] = None, step: Optional[Callable] = None):
        from ..data import split_batch
        self.split = split or split_batch
        self.step = step

    @staticmethod
    def mixable(inputs: Tuple[Any, ...]) -> Any:
        """The one floating-point input --mixup blends; a ConfigError for any other batch."""
        from ..config import ConfigError
        if len(inputs) != 1 or "float" not in str(getattr(inputs[0], "dtype", "")):
            raise ConfigError(f"--mixup blends one floating-point input; this task's batches have {len(inputs)} "
                              f"input(s) of type {[str(getattr(x, 'dtype', type(x))) for x in inputs]}: "
                              f"drop --mixup")
        return inputs[0]

    @staticmethod
    def loss_and_outputs(result: Any) -> Tuple[Any, Any]:
        """A step's result as (loss, outputs or None)."""
        return tuple(result) if isinstance(result, (tuple, list)) and len(result) == 2 else (result, None)

    def loss_of(self, result: Any) -> Any:
        return self.loss_and_outputs(result)[0]

    @staticmethod
    def loss_total(loss: Any, target: Any, samples: int) -> Tuple[float, float]:
        """A validation batch's loss (as numpy) as (sum, weight), val_loss being the sums over the validation set
        divided by the weights: a scalar is the batch's mean (weight: ``samples``); one value per target position
        (per sample, or per token of a sequence) is summed over the positions whose integer target is not padding
        (:data:`hvdtrain.metrics.IGNORE_INDEX`), the weight being those positions (so a sequence's val_loss is the
        mean per token, and exp(val_loss) its perplexity); several values per sample otherwise are averaged per
        sample first."""
        from ..metrics import IGNORE_INDEX
        loss = np.asarray(loss, dtype=np.float64)
        elements = loss.size
        if elements == 1:
            return float(loss.sum()) * samples, float(samples)
        target = np.asarray(target) if target is not None else None
        if target is not None and target.size == elements and target.dtype.kind in "iu":
            keep = target.reshape(loss.shape) != IGNORE_INDEX
            return float(loss[keep].sum()), float(keep.sum())
        if elements % samples:
            raise ValueError(f"the loss has {elements} values for a batch of {samples} samples; return one value, "
                             f"one per sample, or the same number per sample")
        return float(loss.sum()) / (elements // samples), float(samples)


class Backend(abc.ABC):
    """Base class of the framework backends. Subclasses fill in the framework-specific methods below."""

    name: str = ""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    device: Any = None
    threads: int = 1
    threads_reason: str = ""
    """Which limit decided :attr:`threads` (the cores, Slurm's allotment, a cgroup quota, or the user)."""
    on_gpu: bool = False
    """True when the rank computes on a GPU."""
    asynchronous: bool = False
    """True when the host returns before the device has finished (MXNet's engine, CUDA): host clocks then measure
    launches, not work."""
    precision: str = "fp32"
    """The precision this run computes in: ``--precision`` with auto resolved (:meth:`resolve_precision`)."""
    precision_reason: str = ""
    """Why: the flag, or what auto read (a GPU; the CPU's bf16 flags)."""
    slower_bf16: str = ""
    """Why this framework's bf16 is slower than its fp32 on a CPU even with native bf16 (auto then keeps fp32)."""
    worker_timeout: float = 0.0
    """Seconds a loader waits for a batch from its worker processes (``--num-workers``) before failing the job:
    ``--stall-timeout``, set in :meth:`init`, so that a hung worker ends the run like a stalled collective. 0: no
    limit."""

    @property
    def phases(self) -> PhaseTimer:
        """This backend's per-phase timer of the current step (one per instance; the Trainer configures it):
        ``train_step`` marks its phases on it."""
        timer = self.__dict__.get("_phases")
        if timer is None:
            timer = self.__dict__["_phases"] = PhaseTimer(self.synchronize)
        return timer

    # --- lifecycle -------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def init(self, cfg) -> None:
        ...

    @abc.abstractmethod
    def setup(self, model: Any, cfg, loss_fn=None, sample_shape=None, task: Optional[Task] = None) -> None:
        """``loss_fn(outputs, target)`` (the recipe's; softmax cross-entropy by default) for training and evaluation,
        ``sample_shape`` the shape of one input (or a tuple of one sample's inputs, for frameworks that infer shapes),
        ``task`` the batch structure and an optional own step (:class:`Task`)."""
        ...

    def shutdown(self, failed: bool = False) -> None:
        """Stop Horovod in order (its background thread; MXNet's queued operations first); safe to call twice.
        ``failed``: after an error, when queued work may itself fail and must not stop the shutdown."""

    def synchronize(self) -> None:
        """Wait until the device has finished the work queued so far (for exact phase times)."""

    def start_timeline(self, path: str) -> None:
        """Horovod: start recording the timeline (rank 0 writes ``path``); needs HOROVOD_TIMELINE=DYNAMIC at init."""
        # The previous step's collectives finish outside the window: those queued on MXNet's engine, and PyTorch's
        # --overlap-forward second half, which otherwise lands in the window as one more step of its own.
        self.settle()
        self.synchronize()
        self.hvd.start_timeline(path, mark_cycles=False)

    def stop_timeline(self) -> None:
        self.settle()  # the window's collectives are finished and recorded before it closes
        self.synchronize()
        self.hvd.stop_timeline()

    def resolve_precision(self, cfg, on_gpu: bool) -> bool:
        """Set :attr:`precision` and :attr:`precision_reason` from ``--precision`` (auto: :mod:`hvdtrain.precision`)
        as this rank's hardware decides; returns whether bf16 would run natively here (on a GPU: True, the framework
        decides). ``cfg`` keeps the flag as given; the backend computes with ``self.precision`` (the Trainer replaces
        its config's after ``init``). The ranks then agree (:meth:`agree_precision`)."""
        native, self.bf16_missing = precisions.detect_cpu_bf16()
        self.precision, self.precision_reason = precisions.choose(cfg.precision, on_gpu, native, self.bf16_missing,
                                                                 cfg.adasum, self.slower_bf16,
                                                                 precisions.forced_auto())  # checked by validate
        return on_gpu or bool(native)

    def precision_refusal(self, native_bf16: bool) -> str:
        """Why this rank cannot compute in :attr:`precision` ("" when it can): a one-line ConfigError text."""
        return ""

    def agree_precision(self, cfg, native_bf16: bool) -> None:
        """Horovod: every rank computes in the same precision (ranks averaging gradients of different precisions
        would train a model none of them describes). One collective after hvd.init: every rank's choice and whether
        it can compute in it. A rank that cannot honour an explicit ``--precision`` stops the job on every rank with
        its reason and the ranks that lack it; ``--precision auto`` choices that differ (hosts of different CPU
        generations, a GPU host beside a CPU host) become fp32 on every rank, said in the reason. Elastic jobs skip
        it (a joining worker must run no collective the others do not): each rank keeps its own choice there."""
        from ..config import ConfigError
        refusal = self.precision_refusal(native_bf16)
        if cfg.elastic:
            if refusal:
                raise ConfigError(refusal)
            return
        rows = self.allgather_floats([float(precisions.PRECISIONS.index(self.precision)), float(bool(refusal))])
        refused = [r for r, row in enumerate(rows) if row[1]]
        if refused:
            # Horovod: the first refusing rank's reason, on every rank: all stop with the same line.
            reason = self.broadcast_object(refusal, root=refused[0])
            where = "this rank" if refused == [self.rank] else f"rank(s) {', '.join(map(str, refused))} of {self.size}"
            raise ConfigError(f"{reason} (on {where})")
        chosen = [precisions.PRECISIONS[int(row[0])] for row in rows]
        if len(set(chosen)) > 1:
            by_rank = ", ".join(f"rank {r} {p}" for r, p in enumerate(chosen))
            self.precision = "fp32"
            self.precision_reason = (f"auto: the ranks' hardware differs ({by_rank}): fp32 on every rank, the "
                                     f"precision all of them compute in")

    def check_horovod_fixes(self, cfg) -> None:
        """Refuse a run that this Horovod build would compute wrongly, and warn (rank 0) of the missing fixes that
        make it slower or less robust (:mod:`hvdtrain.horovod_fixes`); after ``init``, the same verdict on every
        rank."""
        from .. import horovod_fixes
        horovod_fixes.check(cfg, self.hvd, self.name, bool(self.hvd.gloo_enabled()), self.rank)

    def mpi_built(self) -> bool:
        """Whether this Horovod was built with MPI (without it, mpirun and srun cannot form its world)."""
        return bool(self.hvd.mpi_built())

    def threads_per_rank(self, requested: int = 0) -> Tuple[int, str]:
        """:func:`thread_budget` (threads, which limit decided) from every rank's cores and cgroup (one collective:
        every rank's host, cgroup quota and affinity)."""
        if requested > 0:
            return thread_budget(frozenset(), [], requested)
        mine, quota = own_cores(), cgroup_cpu_quota()
        group = cgroup_key(quota[1]) if quota else -1.0  # ranks under one quota (one cgroup) share it
        rows = self.allgather_floats([host_key(), group] + encode_cores(mine))
        host = [row for row in rows if row[0] == rows[self.rank][0]]
        here = [decode_cores(row[2:]) for row in host]
        in_quota = sum(1 for row in host if row[1] == group) if quota else 1
        return thread_budget(mine, here, 0, slurm_cpus_per_task(), quota, in_quota)

    malloc = ""
    """How glibc's malloc was set to keep freed memory (resources.keep_freed_memory), for config.json; "" if not."""

    cpu_allreduce_groups = 1
    """What ``--allreduce-groups`` auto means on the CPU: one group here (measured in ``bench ddp``); the PyTorch
    backend's groups follow the backward pass instead (torch_groups.BUCKETS)."""

    quota_allreduce_groups: Optional[int] = None
    """What auto means on the CPU when a rank of the job (any: they agree) has less than a core under a CPU quota
    (resources.below_a_core); None: :attr:`cpu_allreduce_groups` there too."""
    allreduce_groups_reason = ""
    """Why auto chose :attr:`quota_allreduce_groups` (for config.json); empty otherwise."""

    def allreduce_groups(self, cfg) -> int:
        """``--allreduce-groups`` with auto (-1) resolved (N, 0 and buckets stand as given):
        :attr:`cpu_allreduce_groups` on the CPU, or :attr:`quota_allreduce_groups` where a rank has less than a core
        under a quota (unless --overlap-forward asks for groups), none on a GPU (per-gradient allreduces overlap the
        backward pass there), none in elastic mode (see the config) and none with Adasum (Horovod's Adasum optimizer
        combines each parameter on its own). Called once, in setup, on every rank (the quota's answer is agreed in one
        allgather: groups must be the same on all)."""
        if cfg.allreduce_groups != GROUPS_AUTO:  # N, 0, or PyTorch's buckets (the config refuses them elsewhere)
            return cfg.allreduce_groups
        if self.auto_per_gradient(cfg, self.on_gpu):
            return 0
        if self.quota_allreduce_groups is not None and self.size > 1 and not cfg.overlap_forward:
            below = [row[0] for row in self.allgather_floats([1.0 if below_a_core() else 0.0])]
            if any(below):
                self.allreduce_groups_reason = (f"rank {below.index(1.0)} has less than a core under a CPU quota: "
                                                f"the gradients go in {self.quota_allreduce_groups} group(s) after "
                                                f"the backward pass")
            return self.cpu_groups(any(below))
        return self.cpu_groups(False)

    @staticmethod
    def auto_per_gradient(cfg, on_gpu: bool) -> bool:
        """Where ``--allreduce-groups`` auto means an allreduce per gradient: on a GPU, in elastic mode, with Adasum."""
        return on_gpu or cfg.elastic or cfg.adasum

    @classmethod
    def per_gradient(cls, cfg, on_gpu: bool) -> bool:
        """Whether Horovod gets the gradients one by one, as the backward pass makes them (``--allreduce-groups``
        0, or auto where :meth:`auto_per_gradient`), rather than each group, or --shard-optimizer's one
        reduce-scatter, queued whole. Known before hvd.init(), for the idle wait (resources.horovod_environment)."""
        if cfg.shard_optimizer:
            return False
        if cfg.allreduce_groups != GROUPS_AUTO:
            return cfg.allreduce_groups == 0
        return cls.auto_per_gradient(cfg, on_gpu)

    @classmethod
    def cpu_groups(cls, below_a_core: bool) -> int:
        """What auto means on the CPU: :attr:`quota_allreduce_groups` where a rank of the job has less than a core
        under a CPU quota and the backend has such a choice, :attr:`cpu_allreduce_groups` otherwise (the cost model
        asks this too)."""
        if below_a_core and cls.quota_allreduce_groups is not None:
            return cls.quota_allreduce_groups
        return cls.cpu_allreduce_groups

    def lr_workers(self, cfg) -> int:
        """The number of workers the learning rate is scaled by: the world size when gradients are averaged (the
        linear rule of Goyal et al.). With Adasum, Horovod's guidance: 1 on the CPU, where every rank's update is
        combined by Adasum, and the ranks per host on GPUs, where a host's GPUs average (NCCL) before Adasum combines
        the hosts."""
        if cfg.adasum:
            return self.local_size if self.on_gpu else 1
        return self.size

    # --- steps -----------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def train_step(self, micro_batches: List[Any], mix: Optional[float] = None) -> Dict[str, Any]:
        """One optimizer step over ``micro_batches``; ``mix`` is the mixup weight of this step (None: no mixup)."""
        ...

    def last_step_applied(self) -> bool:
        """Whether the last ``train_step``'s update reached the weights: False when the loss scaler skipped it (its
        gradients overflowed on some rank). Called only after a non-finite loss (it may synchronise the device)."""
        return True

    @abc.abstractmethod
    def eval_step(self, batch: Any, outputs: bool = True) -> Tuple[Any, Any, Tuple[float, float], int]:
        """One validation batch: (outputs as numpy or None, target as numpy, the loss as (sum, weight)
        (:meth:`Task.loss_total`), samples)."""
        ...

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        ...

    @abc.abstractmethod
    def scalar(self, value: Any) -> float:
        """A backend-native scalar (tensor, NDArray) or number as a Python float (synchronises the device)."""

    @abc.abstractmethod
    def get_lr(self) -> float:
        ...

    @abc.abstractmethod
    def seed(self, seed: int, framework: bool = True) -> None:
        """Seed Python's and numpy's generators, and with ``framework`` the framework's (dropout masks)."""

    # --- data ------------------------------------------------------------------------------------------------------
    def check_data(self, train_set: Any, cfg) -> None:
        """Refuse (ConfigError) settings this backend cannot honour with this training set."""

    @abc.abstractmethod
    def loader(self, dataset: Any, sampler: Iterable[int], batch_size: int, drop_last: bool,
               num_workers: int = 0) -> Iterator[Any]:
        ...

    # --- collectives -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_array_start(self, values: np.ndarray, tag: str) -> Callable[[], np.ndarray]:
        """Start the element-wise sum over ranks of a float64 vector; the call returned waits for it and returns it.
        ``tag`` names the collective (the same on every rank; one collective of a tag in flight at a time)."""
        ...

    def allreduce_array(self, values: np.ndarray, tag: str) -> np.ndarray:
        """The element-wise sum over ranks of a float64 vector (:meth:`allreduce_array_start`, waited for)."""
        return self.allreduce_array_start(values, tag)()

    def allreduce_sum_start(self, metrics: Dict[str, Any], tag: str = "metrics") -> Callable[[], Dict[str, float]]:
        """Start summing scalar metrics over ranks in one collective; the call returned waits for the sums."""
        keys = sorted(metrics)
        values = np.array([self.scalar(metrics[k]) for k in keys], dtype=np.float64)
        wait = self.allreduce_array_start(values, tag)
        return lambda: dict(zip(keys, wait().tolist()))

    def allreduce_sum(self, metrics: Dict[str, Any]) -> Dict[str, float]:
        """Scalar metrics (numbers or framework scalars) summed over ranks, in one collective."""
        return self.allreduce_sum_start(metrics)()

    def allgather_floats(self, values: List[float]) -> List[List[float]]:
        """Every rank's ``values`` (the same length on each), in rank order."""
        return self.allgather_array(np.asarray(values, dtype=np.float64), "gather").tolist()

    def allgather_array(self, values: np.ndarray, tag: str) -> np.ndarray:
        """Every rank's float64 vector ``values`` (the same length on each) as the rows of a (size, n) array, in rank
        order: one allreduce of a zero-padded vector, so every value arrives exactly."""
        n = values.size
        buf = np.zeros(self.size * n, dtype=np.float64)
        buf[self.rank * n:(self.rank + 1) * n] = values
        return self.allreduce_array(buf, tag).reshape(self.size, n)

    def allreduce_mean(self, metrics: Dict[str, Any]) -> Dict[str, float]:
        summed = self.allreduce_sum(metrics)
        return {k: v / self.size for k, v in summed.items()}

    @abc.abstractmethod
    def broadcast_bytes(self, data: Optional[bytes], root: int = 0) -> bytes:
        ...

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """A JSON-able value from ``root`` to every rank (other ranks pass anything, e.g. None)."""
        data = json.dumps(obj).encode() if self.rank == root else None
        return json.loads(self.broadcast_bytes(data, root).decode())

    def root_decides(self, decide: Callable[[], Any], collective: bool = True, everywhere: bool = False,
                     error: Optional[type] = None) -> Any:
        """Rank 0 decides, every rank learns the verdict and raises the same error. ``decide()`` runs on rank 0 (on
        every rank with ``everywhere``, each deciding alike by itself) and returns a JSON-able verdict; with
        ``collective`` rank 0's verdict is broadcast (a collective on every rank). A verdict ``{"error": text}``
        raises ``error(text)`` (ConfigError by default) on every rank that holds it. Returns the verdict (None on
        ranks that neither decided nor heard)."""
        verdict = decide() if self.rank == 0 or everywhere else None
        if collective:
            verdict = self.broadcast_object(verdict)  # Horovod: rank 0's verdict on every rank
        if isinstance(verdict, dict) and "error" in verdict:
            from ..config import ConfigError
            raise (error or ConfigError)(verdict["error"])
        return verdict

    def broadcast_tree(self, tree: Any, root: int = 0) -> Any:
        """A nested state (dicts, lists, numpy arrays, plain values) from ``root`` to every rank, in one broadcast of
        the checkpoint format: arrays plus a JSON skeleton, never a pickle."""
        from .. import checkpoint
        data = checkpoint.serialize(tree) if self.rank == root else None
        return checkpoint.deserialize(self.broadcast_bytes(data, root), source=f"the state broadcast by rank {root}")

    # --- state -----------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        ...

    @abc.abstractmethod
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ...

    @abc.abstractmethod
    def broadcast_state(self) -> None:
        """Make every rank's model and optimizer state equal to rank 0's."""
        ...

    def gather_state(self) -> None:
        """Collective, on every rank before rank 0 calls :meth:`state_dict` for a checkpoint: bring together state
        that the ranks hold in parts (--shard-optimizer's optimizer state). Nothing to do otherwise."""

    def statistics(self) -> np.ndarray:
        """This rank's running statistics (BatchNorm's mean and variance: state that no gradient updates) as one
        float64 vector, in the model's order (exact for float32, float16 and bfloat16 values); empty without any."""
        return np.zeros(0)

    def set_statistics(self, values: np.ndarray) -> None:
        """Set the running statistics from a vector of :meth:`statistics`' layout, each in its own dtype."""

    def settle(self) -> None:
        """Apply any parameter update that a step left for the next forward pass to make (PyTorch's
        ``--overlap-forward``); nothing where none waits."""

    def average_statistics(self) -> None:
        """Average the model's running statistics across ranks. Each rank gathers them from its own shard, so
        without this the validation set is scored with a different model on each rank, and the checkpoint holds
        rank 0's, which scores differently again."""
        own = self.statistics()
        if self.size > 1 and own.size:
            # Horovod: one allreduce of every running statistic: the model evaluated and saved is the same on each rank.
            self.set_statistics(self.allreduce_array(own, "statistics") / self.size)

    # --- a model's weights outside the loop: --init-from, eval, export ---------------------------------------------
    weight_naming: str = ""
    """How this framework names BatchNorm's parameters (``hvdtrain.weights.TORCH`` or ``GLUON``)."""
    exports_onnx: bool = False
    """Whether :meth:`export_onnx` writes ONNX on this framework."""

    def model_arrays(self, model: Any = None) -> Dict[str, np.ndarray]:
        """Every parameter and buffer of ``model`` (default: the one being trained) as numpy arrays by structural
        name (``layer1.0.conv1.weight``), in the model's order."""
        raise NotImplementedError

    def assign_model_arrays(self, arrays: Dict[str, np.ndarray], model: Any = None) -> None:
        """Set ``model``'s parameters and buffers from ``arrays`` (the names and shapes of :meth:`model_arrays`)."""
        raise NotImplementedError

    def prepare_model(self, model: Any, sample_shape) -> Any:
        """A freshly built model made ready for inference on the CPU outside training (shapes resolved); no
        Horovod."""
        raise NotImplementedError

    def predict(self, model: Any, x: np.ndarray) -> np.ndarray:
        """Logits of ``model`` in inference mode for the float32 batch ``x``."""
        raise NotImplementedError

    def export_native(self, model: Any, directory: str, sample_shape) -> Dict[str, str]:
        """Write ``model`` in this framework's own formats into ``directory``; returns {role: file name}, with
        role ``weights`` for the file :func:`hvdtrain.weights.read` reads back."""
        raise NotImplementedError

    def export_onnx(self, model: Any, path: str, sample_shape) -> None:
        """Write ``model`` as ONNX (input ``images`` N x C x H x W float32, output ``logits``; N free)."""
        raise NotImplementedError

    # --- elastic ---------------------------------------------------------------------------------------------------
    def run_elastic(self, trainer) -> Any:
        """Run ``trainer.run_epochs()`` under Horovod's elastic driver (backends that have one override this)."""
        from ..config import ConfigError
        raise ConfigError(f"--elastic is not available on --framework {self.name}: Horovod has no elastic mode for "
                          f"it; recover by checkpoint restart (--resume auto) instead")

    def commit(self, position: Dict[str, int]) -> None:
        """Elastic mode: save model, optimizer and ``position`` as the state to roll back to."""

    def check_membership(self) -> None:
        """Elastic mode, after :meth:`commit`: raise the framework's interrupt when workers were added, so that
        training restarts from the commit with the new world."""

    def loss_scale(self) -> Optional[float]:
        """The dynamic loss scale (None without loss scaling)."""
        return None

    def check_replicas(self, when: str) -> None:
        """Horovod: every worker must hold the same weights, optimizer state (momentum, Adam's moments and step
        counts) and loss scale (one allgather of a CRC-32 of them); raises naming the ranks that differ from rank 0,
        and rank 0 says in one line that they agree."""
        state = self.state_dict()
        crc = _crc_tree({"model": state["model"], "optimizer": state.get("optimizer")})
        scale = self.loss_scale()
        if scale is not None:
            crc = zlib.crc32(np.float64(scale).tobytes(), crc)
        rows = self.allgather_floats([float(crc)])
        differ = [rank for rank, row in enumerate(rows) if row[0] != rows[0][0]]
        if differ:
            raise RuntimeError(f"{when}, rank(s) {', '.join(map(str, differ))} hold other weights, optimizer "
                               f"state or another loss scale than rank 0")
        if self.rank == 0:
            print(f"hvdtrain: {when}: {len(rows)} worker(s) hold the same weights, optimizer state"
                  + (f" and loss scale {scale:g}" if scale is not None else "") + f" (crc32 {int(crc):08x})",
                  flush=True)

    def parameters_numpy(self) -> Dict[str, Any]:
        """Model parameters as numpy arrays by name (for checks and tests)."""
        return self.state_dict()["model"]


def _crc_tree(tree: Any, crc: int = 0) -> int:
    """CRC-32 of a nested state (dicts by sorted key, lists, arrays, numbers, strings): the same on every rank
    exactly when the states are equal."""
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            crc = _crc_tree(tree[key], zlib.crc32(str(key).encode(), crc))
        return crc
    if isinstance(tree, (list, tuple)):
        for item in tree:
            crc = _crc_tree(item, crc)
        return crc
    if isinstance(tree, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(tree).tobytes(), crc)
    return zlib.crc32(repr(tree).encode(), crc)
