"""The floor of hvdtrain: what the configuration, the output guard and the remote outputs all use, with nothing of
hvdtrain imported here, so that no module has to import another of its users (config, guard and remote imported
each other before; tests/unit/test_imports.py fails on any import circle in hvdtrain/)."""
from __future__ import annotations

import os
from typing import Mapping

__version__ = "0.1.0"


class ConfigError(ValueError):
    """A user error in flags, config or data paths: printed as one line, exit status 2."""


def is_url(path: str) -> bool:
    """True for ``proto://...`` other than ``file://`` (a local path in URL form)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def job_label(environ: Mapping[str, str] = os.environ) -> str:
    """The batch system's job of this process ("Slurm 1234"), '' outside one: named in locks and leases."""
    return next((f"{name} {environ[var]}" for var, name in (("SLURM_JOB_ID", "Slurm"), ("PBS_JOBID", "PBS"),
                                                           ("LSB_JOBID", "LSF"), ("JOB_ID", "SGE"))
                 if environ.get(var)), "")


def die_with_parent(parent: int = 0) -> None:
    """Have the kernel kill this process (SIGKILL) when the thread that started it exits (Linux's PR_SET_PDEATHSIG;
    elsewhere nothing). ``parent``: only where that pid is this process's parent (one started through another
    process, a forkserver say, is left as it is: that process's end is not the parent's)."""
    import ctypes
    import signal
    if parent and os.getppid() != parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


__all__ = ["__version__", "ConfigError", "die_with_parent", "is_url", "job_label"]
