"""``python -m hvdtrain doctor``: what is installed, what Horovod was built with, and known-bad combinations.

Exit status 0 when every framework installed (PyTorch, MXNet, or both) is usable through Horovod, 1 otherwise; an
environment may hold one framework only (a GPU host's, ``make install FRAMEWORKS=torch``). Each problem comes with a
one-line fix.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import List, Optional, Tuple

Row = Tuple[str, str, str, str]  # status, what, value, fix


def _version(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _major_minor(v: str) -> Tuple[int, int]:
    parts = (v.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def _packages() -> List[Row]:
    rows: List[Row] = [("ok", "python", platform.python_version(), "")]
    fixes = {"torch": "make install (or pip install torch==2.13.0)",
             "mxnet": "make install (or pip install mxnet==1.9.1)",
             "numpy": "pip install numpy==1.23.5",
             "gluoncv": "pip install gluoncv==0.10.5.post0",
             "horovod": "make install (builds Horovod against the installed frameworks)"}
    frameworks = installed_frameworks()
    for dist in ("torch", "mxnet", "numpy", "gluoncv", "horovod"):
        v = _version(dist) or (_version("mxnet-cu112") if dist == "mxnet" else None)
        optional = (dist in ("torch", "mxnet") and frameworks and dist not in frameworks) or \
            (dist == "gluoncv" and "mxnet" not in frameworks)
        if v:
            rows.append(("ok", dist, v, ""))
        elif optional:
            rows.append(("warn", dist, f"not installed (this environment is for {', '.join(frameworks)})",
                         "make install FRAMEWORKS=\"torch mxnet\" for both"))
        else:
            rows.append(("FAIL", dist, "not installed", fixes[dist]))
    numpy_v, mxnet_v = _version("numpy"), _version("mxnet")
    if numpy_v and mxnet_v and mxnet_v.startswith("1.") and _major_minor(numpy_v) >= (1, 24):
        rows.append(("FAIL", "numpy+mxnet", f"numpy {numpy_v} breaks mxnet {mxnet_v} (np.bool was removed)",
                     "pip install numpy==1.23.5"))
    return rows


def installed_frameworks() -> List[str]:
    """The frameworks installed here: torch, mxnet (any build), or both."""
    return [fw for fw, dists in (("torch", ("torch",)), ("mxnet", ("mxnet", "mxnet-cu112", "mxnet-cu110")))
            if any(_version(d) for d in dists)]


def _horovod() -> Tuple[List[Row], bool]:
    rows: List[Row] = []
    frameworks = {}
    wanted = installed_frameworks() or ["torch", "mxnet"]
    for fw, module in (("PyTorch", "horovod.torch"), ("MXNet", "horovod.mxnet")):
        if ("torch" if fw == "PyTorch" else "mxnet") not in wanted:
            continue
        try:
            if fw == "MXNet":
                __import__("mxnet")
            frameworks[fw] = __import__(module, fromlist=["_"])
            rows.append(("ok", f"horovod {fw}", "built", ""))
        except Exception as e:  # noqa: BLE001 - any import failure means the framework is unusable
            rows.append(("FAIL", f"horovod {fw}", f"unusable ({type(e).__name__}: {str(e).splitlines()[0][:80]})",
                         "make install (rebuilds Horovod with HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MXNET=1)"))
    if frameworks:
        hvd = next(iter(frameworks.values()))
        controllers = [n for n, f in (("MPI", hvd.mpi_built), ("Gloo", hvd.gloo_built)) if f()]
        ops = [n for n, f in (("NCCL", hvd.nccl_built), ("DDL", hvd.ddl_built), ("CCL", hvd.ccl_built),
                              ("MPI", hvd.mpi_built), ("Gloo", hvd.gloo_built)) if f()]
        rows.append(("ok" if "Gloo" in controllers else "FAIL", "horovod controllers", ", ".join(controllers) or "none",
                     "" if "Gloo" in controllers else "make install"))
        rows.append(("ok", "horovod tensor ops", ", ".join(ops), ""))
        if "MPI" not in controllers:
            rows.append(("warn", "horovod MPI", "not built: under mpirun or srun each process would be a one-rank job "
                         "of its own (hvdtrain refuses to start so); launch with horovodrun",
                         "make MPI's compiler visible (apt-get install openmpi-bin libopenmpi-dev, or 'module load "
                         "openmpi': mpicxx on PATH), then make install"))
        gpu = "CUDA" if hvd.cuda_built() else ("ROCm" if hvd.rocm_built() else "none")
        rows.append(("ok", "horovod GPU support", gpu, ""))
        from . import horovod_fixes
        have = horovod_fixes.library_fixes(hvd)
        rows.append(("warn" if horovod_fixes.missing(have) else "ok", "horovod fixes", horovod_fixes.describe(have),
                     "; ".join(filter(None, (horovod_fixes.REMEDY, horovod_fixes.refusals(have))))
                     if horovod_fixes.missing(have) else ""))
    return rows, len(frameworks) == len(wanted)


def _system() -> List[Row]:
    rows: List[Row] = []
    mpirun = shutil.which("mpirun")
    if mpirun:
        try:
            out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20).stdout
            rows.append(("ok", "mpi", out.strip().splitlines()[0] if out.strip() else "unknown", ""))
        except (OSError, subprocess.TimeoutExpired) as e:
            rows.append(("warn", "mpi", f"mpirun --version failed: {e}", ""))
    else:
        rows.append(("warn", "mpi", "mpirun not found", "apt-get install openmpi-bin libopenmpi-dev"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    rows.append(("ok", "cpu cores", str(cores), ""))
    from .backends.resources import cgroup_cpu_quota
    quota = cgroup_cpu_quota()
    if quota is None:
        rows.append(("ok", "cpu quota", "none (no cgroup CPU limit)", ""))
    else:
        level = "warn" if quota[0] < cores else "ok"
        rows.append((level, "cpu quota", f"{quota[0]:g} core(s) ({quota[1]}), fewer than the {cores} cores this "
                     f"process may run on" if level == "warn" else f"{quota[0]:g} core(s) ({quota[1]})",
                     "hvdtrain sizes each rank's threads to the quota (config.json: threads_reason)"
                     if level == "warn" else ""))
    gpus = []
    try:
        import torch
        if torch.cuda.is_available():
            gpus.append(f"torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    except Exception:  # noqa: BLE001
        pass
    try:
        import mxnet as mx
        n = mx.context.num_gpus()
        if n:
            gpus.append(f"mxnet sees {n} GPU(s)")
    except Exception:  # noqa: BLE001
        pass
    rows.append(("ok", "gpus", "; ".join(gpus) or "none (training runs on the CPU)", ""))
    rows.append(_precisions(bool(gpus)))
    rows.append(bytecode_row())
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "unresolvable"
    if addr.startswith("127.") or addr == "unresolvable":
        rows.append(("warn", "hostname", f"{host} resolves to {addr}",
                     "multi-host Gloo jobs need the hostname to resolve to a reachable address "
                     "(Horovod 0.28.1 ignores HOROVOD_GLOO_IFACE for process sets): fix /etc/hosts"))
    else:
        rows.append(("ok", "hostname", f"{host} -> {addr}", ""))
    return rows


def bytecode_row(modules=("torch", "torch._dynamo", "mxnet"), dont_write: Optional[bool] = None) -> Row:
    """Whether the frameworks import from compiled bytecode. Where none is written (PYTHONDONTWRITEBYTECODE) and none
    was compiled at install, every process compiles them from source at each start: about 8 s of CPU per PyTorch
    rank here (torch, and torch._dynamo, which the optimizer's first step imports), 3 s per MXNet rank."""
    import importlib.util
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    missing = []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py") and \
                not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            missing.append(name)
    if not missing:
        return ("ok", "bytecode", "the frameworks import from compiled bytecode", "")
    if not dont_write:
        return ("ok", "bytecode", f"{', '.join(missing)}: compiled at the first import", "")
    return ("warn", "bytecode", f"{', '.join(missing)} not compiled and PYTHONDONTWRITEBYTECODE is set: every rank "
            f"compiles them at each start (seconds of CPU per rank)",
            "python -m compileall -q -j 0 \"$(python -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))')\" "
            "(make install does)")


def _precisions(gpus: bool) -> Row:
    """What this host computes in natively, and what --precision auto picks here."""
    from . import precision
    native, missing = precision.detect_cpu_bf16()
    cpu = (f"CPU: fp32, bf16 native ({', '.join(native)})" if native else f"CPU: fp32 native, bf16 emulated ({missing})")
    if not native:
        cpu += ": MXNet refuses --precision bf16 here, PyTorch runs it slowly"
    from .backends import backend_class
    try:
        forced = precision.forced_auto()
    except ValueError as e:
        return ("FAIL", "precisions", str(e), f"unset {precision.AUTO_VARIABLE} or set bf16 or fp32")
    if forced:
        cpu += f"; {precision.AUTO_VARIABLE}={forced} decides auto here"
    picks = []
    for fw in installed_frameworks() or ["torch", "mxnet"]:
        picked, _ = precision.choose("auto", gpus, native, slower_bf16=backend_class(fw).slower_bf16, forced=forced)
        picks.append(f"{picked} on {fw}")
    return ("ok", "precisions", f"{cpu}{'; GPU: fp16' if gpus else ''}; --precision auto picks {', '.join(picks)}",
            "")


def main(argv: Optional[List[str]] = None) -> int:
    rows = _packages()
    hvd_rows, both_usable = _horovod()
    rows += hvd_rows + _system()
    width = max(len(r[1]) for r in rows)
    print("hvdtrain doctor")
    for status, what, value, fix in rows:
        print(f"  {status:4s}  {what:{width}s}  {value}")
        if fix:
            print(f"  {'':4s}  {'':{width}s}  fix: {fix}")
    failed = [r for r in rows if r[0] == "FAIL"]
    if both_usable and not failed:
        names = {"torch": "PyTorch", "mxnet": "MXNet"}
        print(f"doctor: {' and '.join(names[f] for f in installed_frameworks())} usable through Horovod")
        return 0
    print(f"doctor: {len(failed)} problem(s); see the fixes above", file=sys.stderr)
    return 1
