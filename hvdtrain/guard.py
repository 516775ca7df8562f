"""Refusals that keep a job's outputs its own, checked after Horovod starts and before anything is written.

- The world size a launcher declared against the one Horovod formed. A Horovod built without MPI, started by ``srun``
  or ``mpirun`` with no Gloo rendezvous, logs "no rendezvous server provided, assuming single process execution":
  every task becomes rank 0 of a world of 1, and N separate jobs would write one output directory.
- The output directory of a live job. Rank 0 holds an exclusive ``flock`` on ``OUTPUT_DIR/.hvdtrain.lock`` for the
  whole run, the file naming its host, pid and job; a second job aimed there is refused with those. The kernel
  drops the lock when the process ends, however it ends (a SIGKILL too), so a lock is never left stale.
  On a shared filesystem a flock reaches other hosts only where the filesystem makes it so: NFS mounted with
  ``local_lock=flock`` (or ``local_lock=all``) and Lustre's ``localflock`` keep it per node, and NFS without a lock
  service refuses it (ENOLCK). So the job's rank 0 heartbeat (``heartbeats/rank-0.json``, rewritten every second)
  is read too: when the lock's last holder ran on another host, or the filesystem has no locks, a heartbeat younger
  than :data:`LEASE_SECONDS` that does not say "done" refuses the directory as well. A job that died less than that
  long ago is taken for live until its heartbeat ages. An elastic job's lock is rank 0's of its first world: a rank
  0 after a reset takes none.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import socket
import time
from typing import IO, Callable, Mapping, Optional, Tuple

from .basics import ConfigError, job_label

LOCK_NAME = ".hvdtrain.lock"
LEASE_SECONDS = 10.0
"""A rank 0 heartbeat younger than this (it is rewritten every second) marks a job that still runs."""
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
"""flock's errors that mean another process holds the lock; any other means this filesystem has no locks."""

# What each launcher tells its processes about the size of the job, innermost launcher first: mpirun inside a Slurm
# allocation starts its daemons with srun, so its processes see the step's task count (one per node) as well.
_SIZE_VARIABLES = (("HOROVOD_SIZE", "horovodrun"), ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
                   ("PMI_SIZE", "a PMI launcher (MPICH, Intel MPI, srun --mpi=pmi2)"),
                   ("SLURM_STEP_NUM_TASKS", "srun"))


def declared_world_size(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[str, int, str]]:
    """(variable, task count, launcher) that a launcher declared to this process, or None when none did."""
    for var, launcher in _SIZE_VARIABLES:
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return var, int(value), launcher
    return None


def check_world_size(size: int, mpi_built: bool, environ: Mapping[str, str] = os.environ) -> None:
    """Raise ConfigError when the launcher started more (or fewer) processes than Horovod has ranks."""
    declared = declared_world_size(environ)
    if declared is None or declared[1] == size:
        return
    var, tasks, launcher = declared
    why = ("this Horovod was built without MPI, so under a launcher without a Gloo rendezvous each process is a job "
           "of its own: rebuild it where MPI is found (mpicxx on PATH, e.g. after 'module load openmpi', then make "
           "install) or launch with horovodrun" if not mpi_built else
           "Horovod's MPI is not the launcher's (another MPI's mpirun, or srun without --mpi=pmix): launch with the "
           "mpirun of the MPI Horovod was built with, srun --mpi=pmix, or horovodrun")
    raise ConfigError(f"{launcher} started {tasks} processes ({var}={tasks}) but Horovod formed a world of {size}: "
                      f"{why}; nothing was written")


def describe_holder(path: str) -> str:
    try:
        with open(path) as f:
            holder = json.load(f)
        return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
                + (f", job {holder['job']}" if holder.get("job") else "")
                + f", since {holder.get('since', '?')}")
    except (OSError, ValueError):
        return "a process whose details could not be read"


def live_heartbeat(output_dir: str, now: Optional[float] = None) -> Optional[str]:
    """The job whose rank 0 heartbeat in ``output_dir`` is fresh (younger than LEASE_SECONDS by its file's time)
    and not "done", described for a message; None when there is none."""
    path = os.path.join(output_dir, "heartbeats", "rank-0.json")
    try:
        with open(path) as f:
            beat = json.load(f)
        age = (time.time() if now is None else now) - os.stat(path).st_mtime
    except (OSError, ValueError):
        return None
    if beat.get("phase") == "done" or age > LEASE_SECONDS:
        return None
    return f"host {beat.get('host', '?')}, pid {beat.get('pid', '?')}, its rank 0 heartbeat {max(age, 0):.0f} s old"


def _holder(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def lock_output_dir(output_dir: str, environ: Mapping[str, str] = os.environ) -> IO:
    """Take the output directory for this job (see the module docstring); returns the open lock file, which the
    caller keeps open for the whole run. Raises ConfigError naming the holder when a live job has it."""
    import fcntl
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK_NAME)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except OSError as e:
        if e.errno in _HELD:
            handle.close()
            raise ConfigError(f"--output-dir {output_dir} is in use by a running job ({describe_holder(path)}): "
                              f"wait for it, stop it, or choose another --output-dir") from None
        locked = False  # ENOLCK, ENOSYS, EOPNOTSUPP...: the filesystem has no locks
        print(f"hvdtrain: warning: {output_dir} is on a filesystem without file locks ({os.strerror(e.errno)}): "
              f"another job aimed at it is recognised by its heartbeat alone", file=sys.stderr, flush=True)
    # A lock taken proves the last holder gone only where that holder shared this host's locks.
    if not locked or _holder(path).get("host", socket.gethostname()) != socket.gethostname():
        live = live_heartbeat(output_dir)
        if live:
            handle.close()
            raise ConfigError(f"--output-dir {output_dir} is in use by a running job ({live}; this filesystem's "
                              f"locks do not reach that host): wait for it, stop it, or choose another "
                              f"--output-dir")
    job = job_label(environ)
    handle.seek(0)
    handle.truncate()
    json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job": job,
               "since": time.strftime("%Y-%m-%d %H:%M:%S")}, handle)
    handle.flush()
    return handle


__all__ = ["declared_world_size", "check_world_size", "lock_output_dir", "live_heartbeat", "LOCK_NAME", "LEASE_SECONDS"]


def take_output_dir(backend, output_dir: str, collective: bool = True,
                    taken: Optional[Callable[[], None]] = None) -> Optional[IO]:
    """Rank 0 locks ``output_dir`` for this job (:func:`lock_output_dir`) and every rank stops on a refusal with the
    same one-line error (``backend.root_decides``); with ``collective`` False (elastic mode) rank 0 alone decides
    and raises: a worker joining the job must run no collective the others do not. With ``taken`` (a URL's job,
    ``output_dir`` its staging copy) rank 0 then calls it to take the URL's lease and pull it; its ConfigError is the
    refusal. The lock on rank 0, else None."""
    held = []

    def take():
        try:
            held.append(lock_output_dir(output_dir))
            if taken is not None:
                taken()
        except ConfigError as e:
            for handle in held:
                handle.close()
            held.clear()
            return {"error": str(e)}
    backend.root_decides(take, collective=collective)
    return held[0] if held else None
