"""Typed configuration: dataclasses whose fields become ``--kebab-case`` flags.

Each field carries its help text as a docstring written under it; :func:`field_docs` reads those from the source.
Values given on the command line are checked against the field's type, and :meth:`TrainConfig.validate` checks
ranges, so a bad flag ends in one line that names the flag to fix (:class:`ConfigError`, exit status 2).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import textwrap
import typing
from dataclasses import dataclass
from typing import Literal, Optional, Tuple


from .basics import ConfigError, is_url


BASE_LRS = {"sgd": 0.01, "adam": 0.001, "adamw": 0.001, "lars": 4.0, "lamb": 0.01}
"""The base rate of each --optimizer (per worker and micro-batch, before the linear rule scales it) where a recipe
declares none of its own: SGD's common 0.01; Adam's and AdamW's 0.001 (Kingma and Ba; PyTorch's, Keras's and
MXNet's defaults); LAMB's 0.01 and LARS's 4 (its step is rate x eta x ||w||, eta 0.001) as measured on the MNIST
recipe (docs/running.md#the-learning-rate-of-each-optimizer)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_monitor_spec(spec: str) -> Tuple[str, str]:
    """``--monitor KEY[:min|max]`` as (key, direction or ""); a ConfigError naming the flag for anything else
    (``val_loss:min:max``, ``val_loss:up``, an empty key)."""
    key, sep, direction = spec.partition(":")
    if not key or (sep and direction not in ("min", "max")):
        raise ConfigError(f"--monitor {spec!r}: give a record key, optionally followed by :min or :max "
                          f"(e.g. val_loss or val_accuracy:max)")
    return key, direction


GROUPS_AUTO, GROUPS_BUCKETS = -1, -2
"""--allreduce-groups auto and buckets (their names on the command line and in a config file)."""
NAMED_VALUES = {"allreduce_groups": {"auto": GROUPS_AUTO, "buckets": GROUPS_BUCKETS}}
"""Integer options that also take a name: the name's value."""


@dataclass
class TrainConfig:
    """Settings shared by every recipe. Batch size and learning rate are per worker; see ``effective_lr``."""

    framework: Literal["torch", "mxnet"] = "torch"
    """Deep learning framework of the backend: torch or mxnet."""
    epochs: int = 5
    """Number of passes over the training set."""
    batch_size: int = 64
    """Samples per worker per step; the global batch is batch_size x world size x accumulate."""
    eval_batch_size: int = 0
    """Samples per worker per evaluation step (0: twice --batch-size)."""
    base_lr: float = 0.0
    """Learning rate for one worker and one micro-batch; scaled by world size x accumulate after warmup (0: the
    recipe's rate for --optimizer, listed at the end of --help)."""
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "step"
    """Decay after warmup: step (x --lr-decay at each milestone), cosine, poly or constant."""
    lr_milestones: Tuple[int, ...] = ()
    """Epochs at which step decay multiplies the learning rate by --lr-decay, e.g. 30,60,80."""
    lr_decay: float = 0.1
    """Factor applied at each step-decay milestone."""
    lr_power: float = 2.0
    """Exponent of poly decay."""
    lr_end: float = 0.0
    """The rate cosine and poly decay reach at the last step (MLPerf's ResNet-50 references: poly, power 2, 1e-4)."""
    warmup_epochs: float = 0.0
    """Epochs of gradual linear warmup from base_lr to the scaled rate (Goyal et al. 2017), updated every step."""
    optimizer: Literal["sgd", "adam", "adamw", "lars", "lamb"] = "sgd"
    """Optimizer: sgd (with --momentum, --nesterov), adam (L2 weight decay added to the gradient), adamw (decoupled
    weight decay), lars (momentum SGD with a layer-wise trust ratio) or lamb (adamw's step with a layer-wise trust
    ratio). lars and lamb exempt biases and normalization parameters (1-d) from the ratio and the weight decay."""
    momentum: float = 0.9
    """SGD and LARS momentum."""
    trust_coefficient: float = 0.001
    """LARS's eta: the trust ratio is eta x ||w|| / (||g|| + wd x ||w|| + eps)."""
    optimizer_eps: Optional[float] = None
    """The optimizer's epsilon (default: 1e-8 for adam and adamw, 1e-6 for lamb, 0 for lars)."""
    nesterov: bool = False
    """Use Nesterov momentum with SGD."""
    weight_decay: float = 0.0
    """L2 weight decay."""
    no_wd: bool = False
    """Exempt biases and normalization parameters (1-d tensors) from weight decay."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss: (1 - e) x cross-entropy + e x mean over classes of -log p."""
    mixup: float = 0.0
    """Mixup alpha: blend each batch with its reverse by lambda ~ Beta(alpha, alpha) (0: off)."""
    mixup_off_epoch: int = 0
    """Stop mixup for the last N epochs."""
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    """Numerical precision of the forward and backward pass. auto: fp16 (with dynamic loss scaling) on a GPU, bf16 on
    a CPU with native bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo), fp32 on any other CPU; config.json and the
    start-up line say what was chosen and why."""
    loss_scale: Literal["auto", "dynamic", "none"] = "auto"
    """Loss scaling: dynamic (scale the loss, skip steps whose gradients overflow on any rank, adapt the scale),
    none, or auto: dynamic with --precision fp16, none otherwise."""
    fp16_allreduce: bool = False
    """Compress gradients to fp16 for the allreduce (Horovod's Compression.fp16)."""
    accumulate: int = 1
    """Micro-batches whose gradients are summed locally before one allreduce and one optimizer step."""
    adasum: bool = False
    """Combine gradients with Horovod's Adasum instead of averaging (PyTorch only)."""
    predivide: float = 1.0
    """Gradient predivide factor: divide by this before the allreduce and by size/this after."""
    reseed: Literal["step", "checkpoint"] = "step"
    """When the framework's generator (dropout masks) is reseeded from (seed, epoch, position, rank): before every
    step, so that a run stopped after any step and resumed there draws what it would have drawn; or only where a run
    can resume from a checkpoint (an epoch's start, a resumed position, after each --checkpoint-every-steps
    checkpoint or elastic commit), which saves MXNet's reseed of its parallel generators (about 1 ms a step on the
    CPU) while a --max-steps stop or a kill resumed mid-epoch then draws other masks."""
    allreduce_groups: int = GROUPS_AUTO
    """Gradients go to Horovod as this many grouped allreduces (one negotiation each); 0: one allreduce per gradient,
    queued as its backward finishes (Horovod's default, overlapping the backward pass); auto (-1): on the CPU,
    PyTorch's gradients in DDP's buckets (the first of 1 MiB, then 25 MiB each; one group after the backward pass
    where a CPU quota leaves any rank less than a core, unless --overlap-forward) and MXNet's in one group; 0 on a
    GPU, with --elastic and with --adasum; buckets (-2): PyTorch's gradients in DDP's buckets wherever it runs,
    a quota or a GPU included. On PyTorch the groups follow the backward pass (the parameters last
    registered first; N cuts them into N runs of about equal bytes), so the first is sent while the pass runs; they
    honour --predivide, run no pickled collective, and count a gradient a rank did not compute as zeros (Horovod's
    own grouped path does none of these)."""
    overlap_forward: bool = False
    """PyTorch, grouped allreduces: the largest gradient of the first group is sent in two halves with the other
    groups between them, and its parameter is updated when the next step's forward pass reaches its layer, so that
    the forward pass through the layers before it runs while its second half is on the wire (the update is the same,
    to the bit). For networks whose gradients are mostly one late layer (a large fully connected head) on links slow
    enough that the allreduce outlasts the compute."""
    shard_optimizer: bool = False
    """Shard the optimizer update across ranks (ZeRO stage 1, PyTorch's ZeroRedundancyOptimizer, here on both
    frameworks): the gradients go as one reduce-scatter, each rank updates 1/size of the weights and keeps 1/size of
    the optimizer state, one allgather returns the updated weights. The same bytes on the wire as the allreduce and
    the same update; checkpoints hold the whole optimizer state in the plain format."""
    compile: bool = False
    """PyTorch: torch.compile the model block by block (the repeated blocks of its sequential containers, or those
    --compile-blocks names), so that Horovod still gets each gradient as the backward pass makes it; the whole model
    as one region where no blocks are found (with a warning: no allreduce then overlaps the backward pass). MXNet's
    models are hybridized (compiled) already."""
    compile_blocks: str = ""
    """With --compile: the submodules to compile, comma-separated state-dict prefixes (e.g. layer1.0,layer1.1), or
    "model" for the whole model; empty: found (or the recipe's own compile_blocks())."""
    compile_mode: str = "default"
    """With --compile: torch.compile's mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs."""
    compile_backend: str = "inductor"
    """With --compile: torch.compile's backend (inductor; aot_eager traces without generating code)."""
    data_dir: str = ""
    """Directory of the dataset (the recipe says which files it needs)."""
    synthetic: bool = False
    """Train on random tensors generated on the device, to measure the training step alone."""
    num_workers: int = 0
    """Data loader worker processes per rank (0: load in the training process)."""
    output_dir: str = ""
    """Where rank 0 writes config.json, metrics.jsonl, checkpoints/ and tensorboard/ (default runs/RECIPE-FRAMEWORK):
    a directory, or a URL (s3://bucket/prefix, any fsspec protocol installed) that a local staging copy is pushed to
    after every checkpoint (HVDTRAIN_STAGING, default ~/.cache/hvdtrain/outputs)."""
    track: Literal["none", "mlflow"] = "none"
    """Track the run in MLflow (rank 0 logs params, tags, every record's metrics, and config.json, metrics.jsonl
    and best/ as artifacts; a resume continues the run; an unreachable store never stops training)."""
    track_uri: str = ""
    """MLflow tracking URI for --track mlflow (default: MLFLOW_TRACKING_URI, else sqlite:///PARENT/mlflow.db beside
    --output-dir)."""
    track_experiment: str = ""
    """MLflow experiment for --track mlflow (default: the recipe's name)."""
    resume: str = "auto"
    """auto: continue from the newest valid checkpoint in --output-dir; never: start fresh; or a checkpoint path
    or URL."""
    init_from: str = ""
    """Start from these weights instead of random ones (a fresh run only: a checkpoint to resume from wins): an
    hvdtrain run directory, checkpoint or export of either framework, a PyTorch state dict (.pt/.pth) or a Gluon
    .params file (GluonCV's model zoo), at a path or a URL. A classifier of another class count starts fresh;
    optimizer state starts fresh."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    checkpoint_every_steps: int = 0
    """Also checkpoint every N optimizer steps inside an epoch (0: at epoch ends only); resume is exact mid-epoch."""
    monitor: str = ""
    """Keep the checkpoint of the best epoch by this record key in OUTPUT_DIR/best/ (e.g. val_loss, val_accuracy,
    val_mse; ':min' or ':max' after it overrides the metric's own direction); '' keeps none."""
    early_stop: int = 0
    """Stop when --monitor has not improved for this many epochs in a row (0: never); needs --monitor."""
    max_bad_steps: int = 20
    """Stop the job when the training loss is non-finite on any rank for this many steps in a row (0: never);
    the ranks decide together every 10 steps (and stop at the step after)."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit); for smoke tests and benchmarks."""
    seed: int = 42
    """Random seed; each rank derives its own from it, the epoch and its rank."""
    log_every: int = 0
    """Also log train loss every N steps (0: once per epoch)."""
    threads: int = 0
    """CPU threads per rank (0: the cores available divided by the ranks on this host)."""
    elastic: bool = False
    """Elastic training (PyTorch): workers may leave and join; launch with horovodrun --min-np/--max-np and
    --host-discovery-script."""
    commit_every: int = 10
    """Elastic mode: commit model, optimizer and position every N steps (what a reset rolls back to)."""
    stall_timeout: int = 60
    """Seconds a rank may wait for the others before the job is stopped (Horovod's default: wait forever); after
    half of it, rank 0 prints a table of every rank's last step and phase."""
    profile_steps: int = 0
    """Synchronise the device between the phases of every N-th step and take the per-phase times from those steps
    (0: host clocks on every step, no synchronisation added; exact on CPU PyTorch)."""
    timeline_file: str = ""
    """Horovod timeline file (Chrome trace JSON, written by rank 0), recorded for --timeline-steps only
    (default OUTPUT_DIR/timeline.json when --timeline-steps is given). Not --timeline: horovodrun takes that prefix
    of its own --timeline-filename even after the command."""
    timeline_steps: str = ""
    """A:B: record the Horovod timeline from global step A to step B inclusive (counted from 1), e.g. 100:110
    (default with --timeline-file: 1:20)."""
    autotune: bool = False
    """Let Horovod's autotuner choose the fusion threshold and cycle time; its log goes to OUTPUT_DIR/autotune.csv
    and the best values found are printed at the end."""

    base_lrs = BASE_LRS
    # The base rate of each optimizer in this recipe (a plain class attribute: not a flag); a recipe replaces the
    # entries it has measured, e.g. ``base_lrs = {**BASE_LRS, "sgd": 0.03}``.

    def __post_init__(self):
        if not self.base_lr:  # --base-lr not given: the optimizer's own rate, never another optimizer's
            self.base_lr = self.optimizer_base_lr()

    def optimizer_base_lr(self) -> float:
        """This recipe's base rate for --optimizer (what --base-lr 0 means)."""
        return self.base_lrs[self.optimizer]

    def base_lr_reason(self) -> str:
        """Where --base-lr's value comes from, for the start-up line."""
        if self.base_lr == self.optimizer_base_lr():
            return f"{self.optimizer}'s base rate in this recipe"
        return "--base-lr"

    @property
    def grouped_explicitly(self) -> bool:
        """--allreduce-groups asks for groups (N, or buckets) rather than auto or one allreduce per gradient."""
        return self.allreduce_groups > 0 or self.allreduce_groups == GROUPS_BUCKETS

    def validate(self) -> None:
        """Range checks that types cannot express; raise ConfigError naming the flag."""
        positive = ("epochs", "batch_size", "accumulate", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.stall_timeout < 5:
            raise ConfigError(f"--stall-timeout must be at least 5 seconds, got {self.stall_timeout}")
        if self.early_stop and self.elastic:
            raise ConfigError("--early-stop cannot be combined with --elastic: a worker that joins does not know how "
                              "long the job has waited for an improvement")
        if self.early_stop and not self.monitor:
            raise ConfigError("--early-stop needs --monitor METRIC (e.g. --monitor val_loss): what must improve")
        if self.monitor:
            parse_monitor_spec(self.monitor)
        for name in ("eval_batch_size", "max_steps", "num_workers", "log_every", "threads", "checkpoint_every_steps",
                     "max_bad_steps", "commit_every", "early_stop"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} must be 0 or more, got {getattr(self, name)}")
        if self.base_lr <= 0:
            raise ConfigError(f"--base-lr must be positive, got {self.base_lr}")
        if self.warmup_epochs < 0 or self.warmup_epochs > self.epochs:
            raise ConfigError(f"--warmup-epochs must be between 0 and --epochs ({self.epochs}), got {self.warmup_epochs}")
        if self.allreduce_groups < GROUPS_BUCKETS:
            raise ConfigError(f"--allreduce-groups must be auto (-1), buckets (-2), 0 or a number of groups, got "
                              f"{self.allreduce_groups}")
        if self.allreduce_groups == GROUPS_BUCKETS and self.framework != "torch":
            raise ConfigError(f"--allreduce-groups buckets is PyTorch's (its groups follow the backward pass, as "
                              f"DDP's buckets); --framework {self.framework} sends one group, or N: give a number")
        if self.grouped_explicitly and self.elastic:
            raise ConfigError("--allreduce-groups cannot be combined with --elastic: a worker that joins a running "
                              "job hangs in its setup when gradients go as grouped allreduces (Horovod 0.28.1); "
                              "leave it at auto or 0")
        if self.grouped_explicitly and self.adasum:
            raise ConfigError("--allreduce-groups cannot be combined with --adasum: Horovod's Adasum optimizer combines "
                              "each parameter on its own (it would drop the groups); leave it at auto or 0")
        if self.shard_optimizer and (self.adasum or self.elastic or self.grouped_explicitly):
            which = "--adasum" if self.adasum else "--elastic" if self.elastic else "--allreduce-groups"
            raise ConfigError(f"--shard-optimizer cannot be combined with {which}: the sharded update sends every "
                              f"gradient as one reduce-scatter and keeps each rank's part of the optimizer state "
                              f"(an elastic reset or Adasum's per-parameter combination would need all of it)")
        if self.optimizer in ("lars", "lamb") and (self.adasum or self.shard_optimizer):
            which = "--adasum" if self.adasum else "--shard-optimizer"
            raise ConfigError(f"--optimizer {self.optimizer} cannot be combined with {which}: its trust ratio needs the "
                              f"norms of each whole parameter's averaged gradient"
                              + (" (Adasum combines the ranks' updates instead)" if self.adasum else
                                 " (a rank's shard splits parameters)") + "; use --optimizer "
                              + ("sgd or adamw" if self.optimizer == "lars" else "adamw"))
        if self.optimizer == "lars" and self.nesterov:
            raise ConfigError("--nesterov is for --optimizer sgd: LARS scales plain momentum")
        if (self.track_uri or self.track_experiment) and self.track != "mlflow":
            raise ConfigError("--track-uri and --track-experiment need --track mlflow")
        if self.track == "mlflow":
            import importlib.util
            if importlib.util.find_spec("mlflow") is None:
                raise ConfigError("--track mlflow needs MLflow in this environment: pip install 'hvdtrain[track]' "
                                  "(make install does)")
        if self.lr_end < 0 or (self.lr_end and self.lr_mode not in ("cosine", "poly")):
            raise ConfigError(f"--lr-end is the rate --lr-mode cosine or poly decays to (0 or more); got {self.lr_end} "
                              f"with --lr-mode {self.lr_mode}")
        if self.trust_coefficient <= 0:
            raise ConfigError(f"--trust-coefficient must be positive, got {self.trust_coefficient}")
        if self.optimizer_eps is not None and self.optimizer_eps < 0:
            raise ConfigError(f"--optimizer-eps must be 0 or more, got {self.optimizer_eps}")
        if self.predivide <= 0:
            raise ConfigError(f"--predivide must be positive, got {self.predivide}")
        if not 0 < self.lr_decay <= 1:
            raise ConfigError(f"--lr-decay must be in (0, 1], got {self.lr_decay}")
        if list(self.lr_milestones) != sorted(self.lr_milestones):
            raise ConfigError(f"--lr-milestones must be increasing, got {','.join(map(str, self.lr_milestones))}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.mixup < 0 or self.mixup_off_epoch < 0:
            raise ConfigError("--mixup and --mixup-off-epoch must be 0 or more")
        if self.overlap_forward:
            clash = [f for f, on in (("--framework mxnet", self.framework != "torch"), ("--elastic", self.elastic),
                                     ("--adasum", self.adasum), ("--shard-optimizer", self.shard_optimizer),
                                     ("--allreduce-groups 0", self.allreduce_groups == 0),
                                     ("--compile", self.compile), ("--precision fp16", self.precision == "fp16"),
                                     ("--loss-scale dynamic", self.loss_scale == "dynamic")) if on]
            if clash:
                raise ConfigError(f"--overlap-forward cannot be combined with {clash[0]}: it needs PyTorch's grouped "
                                  f"allreduces (--allreduce-groups auto, buckets or N), eager modules whose forward "
                                  f"pass it can "
                                  f"hook, and an update that does not need every gradient at once (a loss scale's "
                                  f"overflow check does)")
        if self.elastic and self.framework != "torch":
            raise ConfigError(f"--elastic is available on --framework torch only: Horovod has no elastic mode for "
                              f"{self.framework}; recover by checkpoint restart (--resume auto) instead")
        if self.compile and self.framework != "torch":
            raise ConfigError("--compile is for --framework torch: MXNet's models are hybridized already (Gluon "
                              "compiles each HybridBlock to a static graph), which hvdtrain does for every model")
        if self.compile_mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise ConfigError(f"--compile-mode {self.compile_mode!r}: choose default, reduce-overhead, max-autotune or "
                              f"max-autotune-no-cudagraphs (torch.compile's modes)")
        if (self.compile_blocks or self.compile_mode != "default" or self.compile_backend != "inductor") \
                and not self.compile:
            raise ConfigError("--compile-blocks, --compile-mode and --compile-backend need --compile")
        self.timeline_window()  # raises on a malformed --timeline-steps
        if self.profile_steps < 0:
            raise ConfigError(f"--profile-steps must be 0 or more, got {self.profile_steps}")
        if self.precision == "auto":
            from .precision import forced_auto
            try:
                forced_auto()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.adasum and self.predivide != 1.0:
            raise ConfigError("--predivide cannot be combined with --adasum")
        if self.adasum and self.dynamic_loss_scale():
            # Adasum combines each rank's own update inside the optimizer step; a rank whose local gradients
            # overflowed would skip that step (and its collectives) while the others run it: a hang.
            raise ConfigError("--adasum cannot be combined with loss scaling (--precision fp16 or --loss-scale "
                              "dynamic): use --precision bf16 or fp32 with --adasum")
        if self.elastic and is_url(self.output_dir):
            raise ConfigError("--elastic cannot write to a URL --output-dir yet (after a reset the new rank 0 would "
                              "hold neither the lease nor the staging copy): use a shared directory")
        # A URL (s3://...) is checked against its store before Horovod starts (Trainer.setup), not here.
        if self.init_from and not is_url(self.init_from) and not os.path.exists(self.init_from):
            raise ConfigError(f"--init-from {self.init_from} does not exist")
        if self.resume not in ("auto", "never") and not is_url(self.resume) and not os.path.isfile(self.resume):
            raise ConfigError(f"--resume must be auto, never or an existing checkpoint file; {self.resume!r} is none of these")

    def eps(self) -> float:
        """The optimizer's epsilon: --optimizer-eps, or the optimizer's usual one."""
        if self.optimizer_eps is not None:
            return self.optimizer_eps
        return {"lamb": 1e-6, "lars": 0.0}.get(self.optimizer, 1e-8)

    def exempt(self, ndim: int) -> bool:
        """Whether a parameter of ``ndim`` dimensions (a bias, a normalization weight: 1) gets no weight decay (and,
        for lars and lamb, no trust ratio): always for lars and lamb, with --no-wd for the others."""
        return ndim <= 1 and (self.no_wd or self.optimizer in ("lars", "lamb"))

    def dynamic_loss_scale(self, precision: str = "") -> bool:
        """Whether the backend scales the loss dynamically (--loss-scale, resolved against --precision, or against
        ``precision``: what --precision auto resolved to)."""
        return self.loss_scale == "dynamic" or (self.loss_scale == "auto" and (precision or self.precision) == "fp16")

    def timeline_window(self) -> Optional[Tuple[int, int]]:
        """(A, B) of --timeline-steps (or its default when only --timeline is set); None: no timeline."""
        if not self.timeline_file and not self.timeline_steps:
            return None
        from .timeline import DEFAULT_WINDOW, parse_window
        return parse_window(self.timeline_steps or DEFAULT_WINDOW)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


# --- parsing ------------------------------------------------------------------------------------------------------

def field_docs(cls: type) -> dict:
    """Docstrings written under dataclass fields, for this class and its bases."""
    docs: dict = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (tuple, Tuple):
        return "comma-separated " + _describe(typing.get_args(tp)[0]) + "s"
    if origin is typing.Union:
        return _describe(next(a for a in typing.get_args(tp) if a is not type(None)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _names(name: str) -> str:
    """' or auto or buckets': the names an integer option also takes (NAMED_VALUES), for its help and errors."""
    return "".join(f" or {n}" for n in NAMED_VALUES.get(name, {}))


def convert(name: str, tp, raw: str):
    """Convert a command-line string to the field type ``tp``; ConfigError names the flag on failure."""
    origin = typing.get_origin(tp)
    try:
        if origin is typing.Union:  # Optional[X]
            inner = next(a for a in typing.get_args(tp) if a is not type(None))
            return None if raw.lower() in ("", "none") else convert(name, inner, raw)
        if origin is Literal:
            choices = typing.get_args(tp)
            if raw not in choices:
                raise ValueError
            return raw
        if origin in (tuple, Tuple):
            inner = typing.get_args(tp)[0]
            return tuple(convert(name, inner, p.strip()) for p in raw.split(",") if p.strip())
        if tp is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            named = NAMED_VALUES.get(name, {})
            return named[raw.lower()] if raw.lower() in named else int(raw)
        if tp is float:
            return float(raw)
        return str(raw)
    except ConfigError:
        raise
    except (ValueError, TypeError, StopIteration):
        raise ConfigError(f"{flag(name)} expects {_describe(tp)}{_names(name)}, got {raw!r}") from None


def load_config_file(cls: type, path: str) -> dict:
    """Values from a YAML (or JSON) mapping of option names, checked like command-line values.

    Read with ``yaml.safe_load``: tags that construct Python objects (``!!python/object/apply``, ...) are refused."""
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--config {path} is not plain YAML (only plain values are allowed; {first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path} must hold a mapping of option names to values")
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in hints:
            raise ConfigError(f"--config {path}: unknown option {key!r}")
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        elif isinstance(value, bool):
            value = "true" if value else "false"
        elif not isinstance(value, (str, int, float)) and value is not None:
            raise ConfigError(f"--config {path}: {key} must be a plain value, got {type(value).__name__}")
        values[name] = convert(name, hints[name], "" if value is None else str(value))
    return values


def from_saved(cls: type, saved: dict):
    """A ``cls`` from a saved configuration (config.json, a checkpoint's): keys it does not know are ignored, fields
    the saved one lacks keep their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names})


def parse_overrides(cls: type, argv: list, base=None):
    """Build ``cls`` from ``--key value`` / ``--flag`` / ``--no-flag`` arguments, checked against field types.
    ``--config FILE`` (YAML) supplies values first; the other flags override it, wherever they stand."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dataclasses.asdict(base) if base is not None else {}
    argv = list(argv)
    for j, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else (argv[j + 1] if j + 1 < len(argv) else "")
            if not path:
                raise ConfigError("--config expects a YAML file after it")
            values.update(load_config_file(cls, path))
            del argv[j:j + (1 if "=" in arg else 2)]
            break
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: options are written --name value")
        key, _, inline = arg[2:].partition("=")
        name = key.replace("-", "_")
        negated = False
        if name not in fields and name.startswith("no_") and name[3:] in fields and hints[name[3:]] is bool:
            name, negated = name[3:], True
        if name not in fields:
            close = [flag(n) for n in fields if n.startswith(name[:4])][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown option {flag(key)}{hint}; 'python -m hvdtrain recipe NAME --help' lists them")
        tp = hints[name]
        if tp is bool and not inline:
            value = not negated
            i += 1
        else:
            if inline:
                raw = inline
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{flag(name)} expects {_describe(tp)} after it")
                raw = argv[i + 1]
                i += 2
            value = convert(name, tp, raw)
        values[name] = value
    try:
        return cls(**values)
    except TypeError as e:  # a required field without default
        raise ConfigError(str(e)) from None


def help_text(cls: type, recipe: str) -> str:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    lines = [f"usage: python -m hvdtrain recipe {recipe} [--config FILE.yaml] [--option value ...]", "",
             "--config FILE.yaml: a mapping of these options (plain YAML); flags override it.", "", "options:"]
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if tp is bool:
            name = f"{flag(f.name)} / --no-{f.name.replace('_', '-')}"
        else:
            name = f"{flag(f.name)} {f.name.upper()}"
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        lines.append(f"  {name}")
        lines.append(f"      {docs.get(f.name, '')} [{_describe(tp)}{_names(f.name)}; default: {shown!r}]")
    rates = ", ".join(f"{name} {rate:g}" for name, rate in optimizer_rates(cls).items())
    lines += ["", f"base rate of each --optimizer when --base-lr is not given: {rates}"]
    return "\n".join(lines)


def optimizer_rates(cls: type) -> dict:
    """``cls``'s base rate of each optimizer, with its other defaults (what --optimizer X alone trains at)."""
    hints = typing.get_type_hints(cls)
    return {name: dataclasses.replace(cls(), optimizer=name, base_lr=0.0).base_lr
            for name in typing.get_args(hints["optimizer"])}


__all__ = ["ConfigError", "TrainConfig", "GROUPS_AUTO", "GROUPS_BUCKETS", "parse_overrides", "help_text", "field_docs",
           "flag", "BASE_LRS", "optimizer_rates"]
