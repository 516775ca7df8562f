"""Command line: ``python -m hvdtrain recipe NAME [--option value ...] | list | doctor | bench | report``.

Flags are parsed and checked, and the recipe's data checked, before Horovod starts: a bad command line ends every
rank at once with one line naming what to fix and exit status 2.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import sys
import traceback
from typing import List, Optional

import numpy as np

from .checkpoint import CheckpointError
from .config import ConfigError, help_text, parse_overrides
from .remote import is_url
from .faults import JobFailed, report_line

EXPORT_USAGE = """usage: python -m hvdtrain export SOURCE [--format native|onnx] [--framework torch|mxnet] [--output DIR]
                                [--recipe NAME] [--option value ...]

The weights in SOURCE (a run directory, a checkpoint, an export, a .pt or .params file) as the recipe's model: in a
framework's own formats (native) or as ONNX. DIR (default: beside the run, export-FORMAT[-FRAMEWORK][-best])
receives the model files, model.json (recipe, classes, input, preprocessing) and sample.npz (inputs and the
source's logits).
--recipe and the recipe's options are needed only for files that do not say which recipe trained them."""

EVAL_USAGE = """usage: python -m hvdtrain eval SOURCE [--output-dir DIR] [--recipe NAME] [--option value ...]

Evaluate the weights in SOURCE (a run directory, a checkpoint, an export, a .pt or .params file) on the recipe's
validation set, every sample once over all ranks; launch it like training (horovodrun, mpirun, srun). A run trained in
fp32 is evaluated in fp32; one trained in a reduced precision (a GPU's fp16, a CPU's bf16) in what --precision auto
picks on the host eval runs on (--precision overrides both). Rank 0 prints the figures and writes DIR/eval.json
(default: RUN_DIR/eval, RUN_DIR/eval-best for RUN_DIR/best)."""

USAGE = """usage: python -m hvdtrain COMMAND ...

commands:
  recipe NAME [--option value ...]   train a recipe (NAME from 'list', or package.module:TrainerClass)
  eval SOURCE [--option value ...]   evaluate a run's checkpoint (or an export, .pt, .params) on the recipe's
                                     validation set, under horovodrun like training: the recipe's loss and metrics
  export SOURCE [--format native|onnx] [--framework torch|mxnet] [--output DIR]
                                     the trained model in a framework's own format or ONNX, with model.json
  data pack SRC DEST | data index DEST
                                     an ImageFolder or RecordIO as tar shards at a directory or URL (s3://...)
  ray --num-workers N [--address ADDR] ... recipe NAME [--option value ...]
                                     train on a Ray cluster: a Ray actor per rank ('ray -h' lists the options)
  list                               the recipes installed
  doctor                             check the installation: versions, what Horovod was built with
  report OUTPUT_DIR [--png PATH]     a job's epochs, accuracy, img/s, step-time phases, stragglers (+ PNG)
  report --mlflow URI                the runs of an MLflow store (--track mlflow)
  bench {benchmarks} [options]
                                     side-by-side benchmarks (JSON + PNG); bench -h lists them

Launch with Horovod as usual, e.g.
  horovodrun -np 2 -H localhost:2 python -m hvdtrain recipe mnist --framework torch --data-dir data/digits
"""


def usage() -> str:
    from .bench import BENCHMARKS
    return USAGE.replace("{benchmarks}", "|".join(BENCHMARKS))


def _wants_help(argv: List[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def launcher_rank() -> Optional[str]:
    """This process's rank as the launcher set it (Horovod, Open MPI, MPICH/Slurm), before hvd.init()."""
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var) is not None:
            return os.environ[var]
    return None


def _error(msg: str) -> None:
    report_line(launcher_rank(), msg)


def cmd_recipe(argv: List[str]) -> int:
    from . import registry
    if not argv or argv[0].startswith("-"):
        raise ConfigError("recipe needs a NAME: python -m hvdtrain recipe NAME [--option value ...]; "
                          "'python -m hvdtrain list' shows the names")
    cls = registry.load(argv[0])
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(help_text(cls.config_class, argv[0]))
        return 0
    cfg = parse_overrides(cls.config_class, argv[1:])
    trainer = cls(cfg)
    record = trainer.fit()  # a failure is recorded, reported and Horovod stopped there; main() sets the exit status
    # An orderly stop of Horovod (and of MXNet's queued ops) before the interpreter tears libraries down.
    trainer.backend.shutdown()
    if trainer.backend.rank == 0:
        metrics = trainer.output_location.rstrip("/") + "/metrics.jsonl"
        figures = {k: v for k, v in (record or {}).items() if k.startswith("val_") and k != "val_loss"}
        if record is not None and record.get("val_accuracy") is not None:
            print(f"hvdtrain: done: val_accuracy {100 * record['val_accuracy']:.2f}% after epoch "
                  f"{record['epoch']}; metrics in {metrics}", flush=True)
        elif any(v is not None for v in figures.values()):
            from .callbacks import format_figures
            print(f"hvdtrain: done: {format_figures(figures)} after epoch {record['epoch']}; metrics in {metrics}",
                  flush=True)
        elif record is not None and record.get("val_loss") is not None:  # no metrics: the loss alone
            print(f"hvdtrain: done: val_loss {record['val_loss']:.6g} after epoch {record['epoch']}; metrics in "
                  f"{metrics}", flush=True)
        else:
            print(f"hvdtrain: done; metrics in {metrics}", flush=True)
    return 0


def _pop_option(argv: List[str], name: str, default: str = "") -> str:
    """Remove ``--name value`` (or ``--name=value``) from ``argv``; its value, or ``default``."""
    for i, arg in enumerate(argv):
        if arg == name or arg.startswith(name + "="):
            if "=" in arg:
                del argv[i]
                return arg.partition("=")[2]
            if i + 1 >= len(argv):
                raise ConfigError(f"{name} expects a value after it")
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
    return default


def _run_dir(info: dict) -> str:
    """The run directory a checkpoint lies in, in checkpoints/ or best/ ('' for files outside one)."""
    from .monitor import BEST_DIR
    parent = os.path.dirname(os.path.abspath(info.get("path", "")))
    return os.path.dirname(parent) if os.path.basename(parent) in ("checkpoints", BEST_DIR) else ""


def _from_best(info: dict) -> str:
    """"-best" for a checkpoint in a run's best/ (its eval and export go beside the run, named apart), else ""."""
    from .monitor import BEST_DIR
    return "-best" if os.path.basename(os.path.dirname(os.path.abspath(info.get("path", "")))) == BEST_DIR else ""


def _from_source(command: str, argv: List[str]):
    """For export and eval: the trainer class, the configuration the weights in SOURCE were trained with (overridden
    by the remaining flags), SOURCE and what is known of it."""
    from . import registry, weights
    from .config import from_saved
    if not argv or argv[0].startswith("-"):
        raise ConfigError(f"{command} needs a SOURCE: a run directory, a checkpoint, an export, a .pt or .params file")
    source, rest = argv[0], list(argv[1:])
    recipe = _pop_option(rest, "--recipe")
    try:
        arrays, info = weights.read(source)
    except weights.WeightsError as e:
        raise ConfigError(str(e)) from None
    recipe = recipe or info.get("recipe")
    if not recipe:
        raise ConfigError(f"{source} does not say which recipe trained it: pass --recipe NAME and the options its "
                          f"model needs (e.g. --model resnet50_v1b)")
    cls = registry.load(recipe)
    base = from_saved(cls.config_class, info.get("config") or {})
    if getattr(base, "num_classes", None) == 0:  # "from the data": the weights say it without the data
        head = [np.shape(arrays[n])[0] for n in weights.classifier(arrays) if len(np.shape(arrays[n])) == 2]
        if head:
            base = dataclasses.replace(base, num_classes=int(head[0]))
    if info.get("framework") in ("torch", "mxnet"):  # the framework that wrote it, unless --framework says
        base = dataclasses.replace(base, framework=info["framework"])
    return cls, base, rest, source, info


MODEL_FILE_SUFFIXES = (".pt", ".pth", ".params", ".onnx", ".json", ".npz")


def cmd_export(argv: List[str]) -> int:
    if _wants_help(argv):
        print(EXPORT_USAGE)
        return 0
    argv = list(argv)
    fmt = _pop_option(argv, "--format", "native")
    output = _pop_option(argv, "--output")
    if fmt not in ("native", "onnx"):
        raise ConfigError(f"--format must be native or onnx, got {fmt!r}")
    if output and output.lower().endswith(MODEL_FILE_SUFFIXES) and not os.path.isdir(output):
        raise ConfigError(f"--output names the directory the export writes its files into (the model, model.json, "
                          f"sample.npz), and {output} looks like a file name: pass a directory, e.g. --output "
                          f"{os.path.splitext(output)[0]}")
    cls, base, rest, source, info = _from_source("export", argv)
    cfg = parse_overrides(cls.config_class, rest, base=base)
    cfg = dataclasses.replace(cfg, resume="never", init_from="", elastic=False)
    if not output:
        # beside the run or checkpoint; a URL's export goes under runs/ here (its fetched copy is a cache)
        stem = (os.path.join("runs", cls.name) if is_url(source) else
                _run_dir(info) or os.path.splitext(os.path.abspath(info.get("path", source)))[0])
        output = os.path.join(stem, (f"export-{fmt}-{cfg.framework}" if fmt == "native" else "export-onnx")
                              + _from_best(info))
    from .weights import WeightsError
    try:
        meta = cls(cfg).export(source, fmt, output)
    except WeightsError as e:
        raise ConfigError(str(e)) from None
    files = ", ".join(v for k, v in meta.items() if k in ("weights", "symbol", "symbol_params", "onnx"))
    print(f"hvdtrain: exported {meta['recipe']} ({meta.get('model') or 'model'}, {meta['num_classes']} classes) "
          f"as {'ONNX' if fmt == 'onnx' else meta['framework'] + ' native'} to {output}: {files}, model.json, sample.npz; largest logit difference "
          f"from the {meta['sample']['logits_from']} model on {meta['sample']['inputs']}: {meta['max_abs_diff']:.3g} "
          f"(logits up to {meta['logit_scale']:.3g})", flush=True)
    return 0


def cmd_eval(argv: List[str]) -> int:
    if _wants_help(argv):
        print(EVAL_USAGE)
        return 0
    argv = list(argv)
    output = _pop_option(argv, "--output-dir")
    cls, base, rest, source, info = _from_source("eval", argv)
    # A reduced precision (a GPU's fp16, a CPU's bf16) is resolved again for the host eval runs on, so that a GPU's
    # run is evaluated on a CPU too; fp32 stays fp32 (every host computes it, and the figures stay the run's).
    precision = base.precision if base.precision == "fp32" else "auto"
    cfg = parse_overrides(cls.config_class, rest, base=dataclasses.replace(base, precision=precision))
    if not output:
        output = (os.path.join(_run_dir(info), "eval" + _from_best(info)) if _run_dir(info) and not is_url(source)
                  else os.path.join("runs", f"eval-{cls.name}-{cfg.framework}"))
    cfg = dataclasses.replace(cfg, init_from=source, output_dir=output, elastic=False, resume="never")
    trainer = cls(cfg)
    trainer.run_eval()
    trainer.backend.shutdown()
    return 0


def cmd_list(argv: List[str]) -> int:
    from . import registry
    for name, target in registry.available().items():
        try:
            cls = registry.load(name)
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        except ConfigError as e:
            doc = f"(unavailable: {e})"
        print(f"{name:12s} {target:40s} {doc}")
    return 0


def cmd_doctor(argv: List[str]) -> int:
    from .doctor import main as doctor_main
    return doctor_main(argv)


def cmd_report(argv: List[str]) -> int:
    from .report import main as report_main
    return report_main(argv)


def cmd_data(argv: List[str]) -> int:
    from .shards import main as data_main
    return data_main(argv)


def cmd_ray(argv: List[str]) -> int:
    from .raylaunch import main as ray_main
    return ray_main(argv)


def cmd_bench(argv: List[str]) -> int:
    from .bench import main as bench_main
    try:
        return bench_main(argv)
    except RuntimeError as e:  # a benchmark run failed: its own output says why
        _error(str(e))
        return 1


COMMANDS = {"recipe": cmd_recipe, "eval": cmd_eval, "export": cmd_export, "data": cmd_data, "list": cmd_list,
            "doctor": cmd_doctor, "bench": cmd_bench, "report": cmd_report, "ray": cmd_ray}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A crash in native code (a segfault in a framework or in Horovod) prints every Python thread's stack, under the
    # launcher's rank prefix, before the process dies by the signal. Enabled before MXNet is imported: MXNet installs
    # its own SIGSEGV handler only where none is set, and that one prints no Python stack and exits through
    # std::terminate, which hides the signal ("terminate called without an active exception").
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        _error(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
        return 2
    try:
        return command(argv[1:])
    except (ConfigError, CheckpointError) as e:
        _error(str(e))
        return 2
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except JobFailed:  # stopped because another rank failed: Trainer.fit() named that rank in one line
        return 1
    except Exception as e:  # noqa: BLE001 - the real error, with its rank, instead of a hang or a bare exit
        rank = launcher_rank()
        prefix = f"[rank {rank}] " if rank is not None else ""
        if not getattr(e, "brief", False):  # an error whose message says it all: its traceback is in errors/ only
            tb = traceback.format_exc().rstrip().splitlines()
            print("\n".join(prefix + line for line in tb), file=sys.stderr, flush=True)
        if not getattr(e, "hvdtrain_reported", False):  # Trainer.fit() has already printed its one line
            _error(f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
