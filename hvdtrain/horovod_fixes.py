"""Which of hvdtrain's fixes to Horovod 0.28.1 (scripts/patch_horovod.py) the Horovod in use was built with, and what
each missing one affects.

``make install`` builds Horovod with every fix; a Horovod that came otherwise (an NGC container's, one built from the
sdist or from upstream's master) has none of them. A library built by scripts/patch_horovod.py names its fixes through
a C function, ``horovod_hvdtrain_fixes()``, beside ``horovod_gloo_built()``; one without that function is taken to
have none. At start-up, a run that would compute wrong results without a fix is refused in one line naming the fix
(:func:`check`); one that would only be slower or less robust is warned about once. ``python -m hvdtrain doctor``
lists every missing fix (:func:`describe`).
"""
from __future__ import annotations

import ctypes
import importlib
import sys
from dataclasses import dataclass
from typing import FrozenSet, List

REMEDY = ("make horovod, or in another environment bash scripts/build_horovod.sh \"$(which python)\" (Horovod 0.28.1 "
          "built with them: docs/getting-started.md)")


@dataclass(frozen=True)
class Fix:
    number: int
    what: str
    """What goes wrong without it."""
    applies: str = ""
    """When it matters: "mxnet", "torch", "gloo", "sharded" (--shard-optimizer under Gloo), "timeline", or ""
    (always)."""
    refuses: str = ""
    """The runs whose results would be wrong without it, refused where it applies; '' for a fix whose absence only
    makes a run slower or less robust (warned about)."""
    refusal: str = ""
    """The one-line refusal of such a run."""


FIXES = (
    Fix(2, "MXNet: a broadcast's trace line reads freed memory; about 1 small job in 20 segfaulted", "mxnet"),
    Fix(3, "every rank negotiates every 1 ms with nothing queued (HOROVOD_IDLE_WAIT), taking CPU from the compute"),
    Fix(5, "PyTorch: a rank waiting for a collective spins on a core (HOROVOD_SPIN_WAIT=0 has no effect), which a "
           "CPU quota takes from Horovod's own thread", "torch"),
    Fix(6, "horovodrun imports PyTorch to learn what was built (about 4 s of CPU per launch)"),
    Fix(7, "Gloo: a stalled rank is never reported, so --stall-timeout cannot end a stalled job", "gloo"),
    Fix(8, "Gloo: hvd.reducescatter can return wrong values (one round in 30 under load), which --shard-optimizer "
           "uses", "sharded", refuses="--shard-optimizer under Gloo",
        refusal="--shard-optimizer under Gloo needs hvdtrain's Horovod fix 8 (Gloo's reduce-scatter can return wrong "
                f"values without it), which this Horovod lacks: build it with {REMEDY}, or launch with MPI (mpirun, "
                f"or horovodrun --mpi)"),
    Fix(9, "Gloo: the TCP reader wakes for every packet of a slow link (CPU per step)", "gloo"),
    Fix(10, "the timeline writer spins for the whole job once --timeline-steps arms it", "timeline"),
    Fix(11, "Gloo: a small allreduce waits for a large one on the wire to end (HOROVOD_GLOO_ASYNC_BYTES has no "
            "effect), which holds the next step back by its negotiation and transfer", "gloo"),
    Fix(12, "Gloo: every negotiation round passes its bit vector around the ring (2 (ranks - 1) hops in a row), "
            "which a loaded or CPU-limited host makes a wake-up each", "gloo"),
)
"""Fixes 1 and 4 only let the sdist compile (C++17; a CPU build beside a CUDA wheel of torch): every Horovod that
imports has what they give."""


def library_fixes(hvd) -> FrozenSet[int]:
    """The fixes the Horovod library behind ``hvd`` (horovod.torch or horovod.mxnet, imported) was built with; empty
    for a library without hvdtrain's marker (a stock or other build)."""
    lib = importlib.import_module(hvd.__name__ + ".mpi_ops")._basics.MPI_LIB_CTYPES
    try:
        marker = lib.horovod_hvdtrain_fixes
    except AttributeError:
        return frozenset()
    marker.restype = ctypes.c_char_p
    return frozenset(int(n) for n in marker().decode().split(",") if n.strip())


def missing(have: FrozenSet[int]) -> List[Fix]:
    return [f for f in FIXES if f.number not in have]


def describe(have: FrozenSet[int]) -> str:
    """One line for doctor: what this Horovod carries."""
    if not missing(have):
        return f"hvdtrain's fixes {', '.join(map(str, sorted(have)))} (scripts/patch_horovod.py)"
    which = "no hvdtrain fixes: a stock or other build" if not have else \
        f"hvdtrain's fixes {', '.join(map(str, sorted(have)))} only"
    return f"{which}; missing: " + "; ".join(f"fix {f.number}: {f.what}" for f in missing(have))


def refusals(have: FrozenSet[int]) -> str:
    """What is refused for want of the fixes ``have`` lacks ("" when nothing is), for doctor."""
    return "; ".join(f"without fix {f.number}, {f.refuses} is refused" for f in missing(have) if f.refuses)


def relevant(fix: Fix, cfg, framework: str, gloo: bool) -> bool:
    return (not fix.applies or fix.applies == framework or (fix.applies == "gloo" and gloo)
            or (fix.applies == "sharded" and gloo and cfg.shard_optimizer)
            or (fix.applies == "timeline" and bool(cfg.timeline_steps or cfg.timeline_file)))


def check(cfg, hvd, framework: str, gloo: bool, rank: int) -> None:
    """At start-up, on every rank (the same answer everywhere: the ranks run one Horovod build): a ConfigError naming
    the fix when this run's results would be wrong without it; a warning on rank 0 naming the missing fixes that make
    this run slower or less robust."""
    from .config import ConfigError
    lacking = [f for f in missing(library_fixes(hvd)) if relevant(f, cfg, framework, gloo)]
    refused = [f for f in lacking if f.refusal]
    if refused:
        raise ConfigError(refused[0].refusal)
    if lacking and rank == 0:
        print(f"hvdtrain: warning: this Horovod lacks hvdtrain's fix(es) {', '.join(str(f.number) for f in lacking)}"
              f" ({'; '.join(f.what for f in lacking)}); python -m hvdtrain doctor lists them; to get them: {REMEDY}",
              file=sys.stderr, flush=True)


__all__ = ["FIXES", "Fix", "library_fixes", "missing", "describe", "refusals", "check", "REMEDY"]
