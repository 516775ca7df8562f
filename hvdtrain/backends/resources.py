"""What a rank may compute on, and the environment Horovod reads when it starts: the cores this process may use and
how the ranks of a host share them (horovod#2804: all-cores-each oversubscribes them), the GPU of a rank, a name for
its host, and Horovod's settings that must be in the environment before hvd.init(). No framework is imported here.
"""
from __future__ import annotations

import os
import socket
import zlib
from typing import FrozenSet, List, Optional, Sequence, Tuple


def own_cores() -> FrozenSet[int]:
    """The CPU cores this process may run on (its affinity: what a launcher's binding or cgroup allows)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def bound(cores: FrozenSet[int], machine: int = 0) -> bool:
    """Whether a process that may run on ``cores`` is bound to cores of its own: fewer than the ``machine``'s (0: this
    machine's count), as a cpuset, a launcher's binding or a container's cores leave it."""
    return len(cores) < (machine or os.cpu_count() or len(cores))


REQUESTED = "--threads or OMP_NUM_THREADS"
"""The reason :func:`thread_budget` gives for a count the user set."""


def thread_budget(mine: FrozenSet[int], host_ranks: Sequence[FrozenSet[int]], requested: int = 0,
                  slurm_cpus: int = 0, quota: Optional[Tuple[float, str]] = None,
                  quota_ranks: int = 1) -> Tuple[int, str]:
    """CPU threads for one rank, and which limit decided: the cores it may use, divided among the ranks of its host
    that may use them too, within what Slurm allotted and within the cgroup CPU quota.

    ``mine``: this rank's cores; ``host_ranks``: the cores of every rank on the host (this one included). Ranks that
    share their cores (a launcher that binds nothing: every rank may use every core) split them, since each using
    all of them oversubscribes the CPU (horovod#2804: 3x slower). Ranks bound to cores of their own (``mpirun
    --bind-to core``, ``srun --cpu-bind=cores --cpus-per-task=8``) each use all of theirs. ``slurm_cpus``
    (SLURM_CPUS_PER_TASK) caps the count at what Slurm allotted the task. ``quota`` (:func:`cgroup_cpu_quota`:
    cores, where) caps it at the container's CPU limit, split among the ``quota_ranks`` ranks inside it (at least one
    thread each). ``requested`` (--threads, or a user's OMP_NUM_THREADS) wins.
    """
    if requested > 0:
        return requested, REQUESTED
    sharing = sum(1 for cores in host_ranks if cores & mine) or 1
    threads = max(1, len(mine) // sharing)
    why = f"{len(mine)} core(s) this rank may use" + (f" shared by {sharing} ranks" if sharing > 1 else "")
    if 0 < slurm_cpus < threads:
        threads, why = slurm_cpus, f"SLURM_CPUS_PER_TASK={slurm_cpus}"
    if quota is not None:
        share = max(1, int(quota[0] / max(quota_ranks, 1)))
        if share < threads:
            threads, why = share, (f"the cgroup CPU quota of {quota[0]:g} core(s) ({quota[1]})"
                                   + (f" shared by {quota_ranks} ranks" if quota_ranks > 1 else ""))
    return threads, why


def cpu_threads_per_rank(mine: FrozenSet[int], host_ranks: Sequence[FrozenSet[int]], requested: int = 0,
                         slurm_cpus: int = 0) -> int:
    """:func:`thread_budget`'s count without a quota."""
    return thread_budget(mine, host_ranks, requested, slurm_cpus)[0]


CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> Optional[Tuple[float, str]]:
    """The CPU quota of this process's cgroup in cores, and where it was read, or None without one.

    A container runtime's CPU limit (Kubernetes ``limits.cpu``, ``docker run --cpus``, Slurm's cgroup) is a quota
    the affinity mask and os.cpu_count() do not show. cgroup v2: ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD"); v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none) of the cpu controller. A quota set on a parent cgroup
    limits its children too: the smallest along the path from the process's cgroup up to the root counts. Inside a
    container whose cgroup namespace hides the path, the root seen there is the process's own cgroup."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    best: Optional[Tuple[float, str]] = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 unified hierarchy
            base, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            base = next((os.path.join(root, d) for d in (controllers, "cpu,cpuacct", "cpu")
                         if os.path.isdir(os.path.join(root, d))), None)
            if base is None:
                continue
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        here = os.path.join(base, path.lstrip("/"))
        if not os.path.isdir(here):  # a cgroup namespace: the root seen here is the process's cgroup
            here = base
        while True:
            cores = _quota_at(here, files)
            if cores is not None and (best is None or cores < best[0]):
                best = (cores, os.path.join(here, files[0]))
            if os.path.normpath(here) == os.path.normpath(base):
                break
            here = os.path.dirname(here)
    return best


def _quota_at(directory: str, files: Sequence[str]) -> Optional[float]:
    if len(files) == 1:  # v2
        value = _read(os.path.join(directory, files[0]))
        fields = value.split() if value else []
        if len(fields) == 2 and fields[0] != "max" and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]):
            return int(fields[0]) / int(fields[1])
        return None
    quota, period = (_read(os.path.join(directory, f)) for f in files)
    try:
        q, p = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def slurm_cpus_per_task() -> int:
    value = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() else 0


def estimated_threads(local_size: int, requested: int = 0) -> Tuple[int, str]:
    """:func:`thread_budget` before the ranks can talk (MXNet reads its thread count when imported): ranks whose
    affinity is the whole machine are taken to share it; a rank bound to fewer cores to own them; a cgroup quota to
    be shared by every rank of the host."""
    mine = own_cores()
    return thread_budget(mine, [mine] * (1 if bound(mine) else local_size), requested, slurm_cpus_per_task(),
                         cgroup_cpu_quota(), local_size)


def user_threads() -> int:
    """OMP_NUM_THREADS as the user set it (0: not set)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 0


def gpu_for_rank(local_rank: int, local_size: int, gpus: int, visible: Optional[str]) -> int:
    """The GPU (index among those this process sees) for a rank: its local rank, one rank per GPU as NCCL requires.

    A launcher may give each rank a single GPU of its own (CUDA_VISIBLE_DEVICES per rank: Slurm's --gpus-per-task=1,
    Kubernetes): the rank then sees one GPU and takes it. More ranks on a host than GPUs it sees is refused before
    anything is placed (NCCL fails later with "Duplicate GPU detected", or two ranks share one GPU's memory).
    ``visible``: the CUDA_VISIBLE_DEVICES value (None when unset).
    """
    from ..config import ConfigError
    if local_rank < gpus:
        return local_rank
    if gpus == 1 and visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1:
        return 0
    raise ConfigError(f"{local_size} ranks on this host but {gpus} GPU(s) visible to rank {local_rank}: Horovod's NCCL "
                      f"operations need one rank per GPU; start at most {gpus} rank(s) per host (horovodrun -H "
                      f"host:{gpus}, srun --ntasks-per-node={gpus}), or give each rank its own GPU "
                      f"(CUDA_VISIBLE_DEVICES)")


MAX_CORES_COMPARED = 1024
"""Cores beyond this index are not compared between ranks (they still count for the rank's own threads)."""


def cgroup_key(where: str) -> float:
    """A number naming the cgroup whose quota was read at ``where`` (its file), exact in a float64: the CRC-32 of
    the path, the file system and the cgroup directory's inode. Ranks in separate containers on one host read the same
    path (each its own /sys/fs/cgroup/cpu.max) of different cgroups: the inode tells them apart."""
    try:
        st = os.stat(os.path.dirname(where))
        ident = f"{where}:{st.st_dev}:{st.st_ino}"
    except OSError:
        ident = where
    return float(zlib.crc32(ident.encode()))


def host_key() -> float:
    """A number naming this host, exact in a float64: the CRC-32 of its hostname and IPv4 addresses. The addresses
    tell apart hosts that share a hostname (containers, network namespaces standing in for hosts)."""
    try:
        import psutil
        addresses = sorted(a.address for nic in psutil.net_if_addrs().values() for a in nic
                           if a.family == socket.AF_INET and not a.address.startswith("127."))
    except Exception:  # noqa: BLE001 - the hostname alone then
        addresses = []
    return float(zlib.crc32(" ".join([socket.gethostname(), *addresses]).encode()))


def encode_cores(cores: FrozenSet[int]) -> List[float]:
    """A core set as MAX_CORES_COMPARED / 32 floats of 32 bits each (exact in float64), for an allgather."""
    words = [0] * (MAX_CORES_COMPARED // 32)
    for c in cores:
        if c < MAX_CORES_COMPARED:
            words[c // 32] |= 1 << (c % 32)
    return [float(w) for w in words]


def decode_cores(words: Sequence[float]) -> FrozenSet[int]:
    return frozenset(i * 32 + b for i, w in enumerate(words) for b in range(32) if int(w) >> b & 1)


def horovod_environment(cfg, per_gradient: bool) -> None:
    """Horovod settings that must be in the environment before hvd.init(); a user's own values win.
    ``per_gradient``: the gradients go to Horovod one by one (Backend.per_gradient), not in groups queued whole.

    Horovod never shuts a stalled job down by default (the stall inspector only warns) and Gloo waits 30 s per
    operation: both are bounded by ``--stall-timeout`` so that a stopped rank ends the job instead of hanging it.
    """
    timeout = str(cfg.stall_timeout)
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, cfg.stall_timeout // 2)))
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", timeout)
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", timeout)
    # hvdtrain's Horovod (scripts/patch_horovod.py, fix 3): an idle background thread waits for a tensor instead of
    # negotiating every cycle. Gradients queued one by one: it then lets one cycle time pass, so that the rest of the
    # backward pass's gradients join the same negotiation (1). Gradients in groups: each group is queued whole, and
    # the cycle would only hold it back: it negotiates at once (2). Measured at np=2 (docs/bench/ddp.md): the
    # groups' wait for the allreduce 1.3 ms a step shorter with 2; per gradient, 1 the faster.
    os.environ.setdefault("HOROVOD_IDLE_WAIT", "1" if per_gradient else "2")
    os.environ.setdefault("HOROVOD_SPIN_WAIT", spin_wait())
    # hvdtrain's Horovod (fix 11): an allreduce of at least GLOO_BESIDE_BYTES runs on a thread of its own, so that a
    # group queued while it is on the wire (the convolutions' behind a fully connected head) is reduced beside it,
    # as c10d reduces DDP's buckets, rather than after it.
    os.environ.setdefault("HOROVOD_GLOO_ASYNC_BYTES", str(GLOO_BESIDE_BYTES))
    lowat = gloo_rcvlowat()
    if lowat:
        os.environ.setdefault("HOROVOD_GLOO_RCVLOWAT", lowat)
    if cfg.timeline_window() is not None:  # hvd.start_timeline() refuses to run without it
        os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
    if cfg.autotune:
        os.makedirs(cfg.output_dir, exist_ok=True)  # rank 0 opens the log in hvd.init()
        os.environ["HOROVOD_AUTOTUNE"] = "1"
        os.environ.setdefault("HOROVOD_AUTOTUNE_LOG", os.path.abspath(os.path.join(cfg.output_dir, "autotune.csv")))


def spin_wait(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT, ranks: int = 0,
              cores: Optional[FrozenSet[int]] = None, machine: int = 0) -> str:
    """How horovod.torch waits for a collective (hvdtrain's Horovod, scripts/patch_horovod.py fix 5), as
    ``HOROVOD_SPIN_WAIT``: "0" (block until the op completes, as DDP's c10d waits) or "1" (0.28.1's spinning wait).

    - Under a cgroup CPU quota of less than a core per rank on the host (``ranks``; 0: as the launcher declared
      them): "0". Every cycle the waiting thread spins is taken from the quota Horovod's own thread needs to move
      the bytes (an allreduce 1.6x slower at 0.4 cores per host; the whole step 2x slower at 0.25).
    - A rank bound to cores of its own (its affinity, ``cores``, narrower than the ``machine``'s cores: a cpuset, a
      launcher's binding, a container's cores): "0". Measured on hosts that own one core each (docs/bench/network.md,
      dedicated cores): a tie where the link limits the step (183.9 against 183.1 img/s at 200 Mbit/s) for a third
      of the CPU (0.08-0.11 s per step against 0.34, DDP's 0.14), and faster where the compute does (1,047 against
      954 img/s at 10 Gbit/s): the spin competes for the core with the thread that moves the bytes.
    - Ranks free to run on every core of the machine, no quota below a core each: "1", where the spin measured
      faster (2 ranks on 2 cores, MNIST: 1,347 against 1,172 img/s, medians of 6 runs, at the same CPU per step).

    Ranks in separate containers on one host each count against their own quota alone, which this cannot tell
    apart before Horovod starts: they are taken to share it (the blocking wait, the cautious side). A user's
    HOROVOD_SPIN_WAIT wins."""
    if below_a_core(proc_cgroup, root, ranks):
        return "0"
    return "0" if bound(own_cores() if cores is None else cores, machine) else "1"


def below_a_core(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT, ranks: int = 0) -> bool:
    """Whether a cgroup CPU quota leaves each rank on the host (``ranks``; 0: as the launcher declared them) less
    than a core."""
    quota = cgroup_cpu_quota(proc_cgroup, root)
    return quota is not None and quota[0] / max(1, ranks or launcher_local_size()) < 1.0


GLOO_BESIDE_BYTES = 1 << 20
"""The size from which a Gloo allreduce runs beside Horovod's background thread (``HOROVOD_GLOO_ASYNC_BYTES``,
hvdtrain's Horovod, scripts/patch_horovod.py fix 11): DDP's first bucket. A smaller one is short on the wire, and
the next would wait little for it."""


# The most bytes a paused read of Gloo's transport waits for (hvdtrain's Horovod, scripts/patch_horovod.py fix 9),
# under a quota of less than a core per rank.
QUOTA_RCVLOWAT = 4096


MALLOC_TRIM_THRESHOLD = 1 << 30
"""Free memory glibc's malloc keeps at the top of its heap instead of returning it to the system (M_TRIM_THRESHOLD)."""
MALLOC_MMAP_THRESHOLD = 32 << 20
"""Allocations of this size or more get pages of their own (M_MMAP_THRESHOLD): the most glibc's own adjustment
reaches, fixed there from the start."""
MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's environment variables for those settings: a user who sets one keeps glibc's behaviour as set."""


def keep_freed_memory(environ=None) -> str:
    """glibc's malloc made to keep what a training step frees for the next one; what was set, for config.json, or ""
    where nothing was (the user set malloc's own variables or tunables, preloads another allocator, or the C library
    is not glibc).

    By default glibc returns the free top of its heap to the system once it exceeds twice its mmap threshold, which
    it raises to the size of the largest block freed (up to 32 MiB). A step that frees a few gradients or activations
    of some MB at the top of the heap (PyTorch frees the gradients at zero_grad) then gives the memory back, and the
    next step takes it again page by page: a page fault, and a page the kernel zeroes, per 4 KiB, in whatever kernel
    first writes it. Measured at 2 shaped hosts (docs/bench/pytorch-at-scale.md): one rank's backward pass 20-45 ms
    where the other's took 13-16, its training thread 10-25 ms more CPU a step, the heap shrunk and grown (brk) every
    step; with these settings the two ranks level. mallopt fixes both thresholds (which also ends glibc's
    adjustment): blocks under 32 MiB come from the heap, and up to 1 GiB of free heap stays with the process."""
    import ctypes
    import platform
    env = os.environ if environ is None else environ
    if any(name in env for name in MALLOC_SETTINGS) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return ""
    if any(name in env.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return ""
    if platform.libc_ver()[0] != "glibc":
        return ""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ""
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(-1, MALLOC_TRIM_THRESHOLD) != 1 or mallopt(-3, MALLOC_MMAP_THRESHOLD) != 1:  # M_TRIM_, M_MMAP_THRESHOLD
        return ""
    return f"trim threshold {MALLOC_TRIM_THRESHOLD >> 20} MiB, mmap threshold {MALLOC_MMAP_THRESHOLD >> 20} MiB"


def gloo_rcvlowat(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT, ranks: int = 0) -> str:
    """``HOROVOD_GLOO_RCVLOWAT`` for this rank, or "" for the library's default (32 KiB).

    Under a cgroup CPU quota of less than a core per rank: ``QUOTA_RCVLOWAT``. A reader that sleeps until 32 KiB
    have arrived wakes late on a host whose share of a core is spent or lent, and the ring waits for it: the
    step's gradients (6.5 MB at 200 Mbit/s) averaged 12-15% slower than c10d's at 4 hosts two to a core (500
    against 437 ms) and at 8 hosts four to a core (693 and 632 against 601 and 563 ms); with 4 KiB it took 448 ms
    at 4 hosts and 620 and 601 ms at 8 (c10d 600 and 572), at less CPU than c10d's (docs/bench/pytorch-at-scale.md).
    Elsewhere the default: on a core of its own the same allreduce took the same time at a third to a half of the
    CPU. A user's HOROVOD_GLOO_RCVLOWAT wins."""
    return str(QUOTA_RCVLOWAT) if below_a_core(proc_cgroup, root, ranks) else ""


def preload_image_codecs() -> None:
    """Load Pillow's JPEG/PNG codecs before Horovod's framework library.

    Horovod loads its extension with RTLD_GLOBAL, and libmxnet.so (which it links) exports its own libjpeg symbols:
    when Pillow is imported after that, its decoder binds to MXNet's libjpeg and decodes JPEGs as zeros or fails with
    "broken data stream". Importing PIL.Image first binds Pillow to its own libraries (extension modules are loaded
    with RTLD_NOW). The turbo decoder's libjpeg-turbo (simplejpeg) and OpenCV are loaded first for the same reason.
    """
    import importlib
    for module in ("PIL.Image", "simplejpeg", "cv2"):
        try:
            importlib.import_module(module)
        except ImportError:  # not installed: nothing to protect
            pass


def launcher_local_size() -> int:
    """The ranks on this host as the launcher declared them, before hvd.init() (1 when none did)."""
    for var in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1
