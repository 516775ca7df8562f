"""Command line: ``python -m hvdtrain recipe NAME [--option value ...] | list | doctor | bench | report``.

Flags are parsed and checked, and the recipe's data checked, before Horovod starts: a bad command line ends every
rank at once with one line naming what to fix and exit status 2.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from typing import List, Optional

from .checkpoint import CheckpointError
from .config import ConfigError, help_text, parse_overrides
from .faults import JobFailed, report_line

USAGE = """usage: python -m hvdtrain COMMAND ...

commands:
  recipe NAME [--option value ...]   train a recipe (NAME from 'list', or package.module:TrainerClass)
  list                               the recipes installed
  doctor                             check the installation: versions, what Horovod was built with
  report OUTPUT_DIR [--png PATH]     a job's epochs, accuracy, img/s, step-time phases, stragglers (+ PNG)
  bench scaling|overhead|ddp|ps|allreduce|input [options]
                                     side-by-side benchmarks (JSON + PNG); bench -h lists them
  
Launch with Horovod as usual, e.g.
  horovodrun -np 2 -H localhost:2 python -m hvdtrain recipe mnist --framework torch --data-dir data/digits
"""


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
        metrics = os.path.join(trainer.cfg.output_dir, "metrics.jsonl")
        if record is not None and record.get("val_accuracy") is not None:
            print(f"hvdtrain: done: val_accuracy {100 * record['val_accuracy']:.2f}% after epoch "
                  f"{record['epoch']}; metrics in {metrics}", flush=True)
        else:
            print(f"hvdtrain: done; metrics in {metrics}", flush=True)
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


def cmd_bench(argv: List[str]) -> int:
    from .bench import main as bench_main
    try:
        return bench_main(argv)
    except RuntimeError as e:  # a benchmark run failed: its own output says why
        _error(str(e))
        return 1


COMMANDS = {"recipe": cmd_recipe, "list": cmd_list, "doctor": cmd_doctor, "bench": cmd_bench, "report": cmd_report}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A crash in native code (a segfault in a framework or in Horovod) prints every Python thread's stack, under the
    # launcher's rank prefix, before the process dies by the signal. Enabled before MXNet is imported: MXNet installs
    # its own SIGSEGV handler only where none is set, and that one prints no Python stack and exits through
    # std::terminate, which hides the signal ("terminate called without an active exception").
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
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
        tb = traceback.format_exc().rstrip().splitlines()
        print("\n".join(prefix + line for line in tb), file=sys.stderr, flush=True)
        if not getattr(e, "hvdtrain_reported", False):  # Trainer.fit() has already printed its one line
            _error(f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
