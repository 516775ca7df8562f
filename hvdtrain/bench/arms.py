"""The arms of ``bench network``: what each runs on the emulated cluster (Horovod's own loops, hvdtrain on either
framework, DDP under torchrun, MXNet's parameter server) and the names ``--frameworks`` chooses them by."""
from __future__ import annotations

import functools
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .. import timeline
from ..config import ConfigError
from .cluster import Cluster, _launch, run_records
from .ps import run_ps
from .runner import free_port, run_worker

def _rank_cpu(result: str) -> Dict:
    """The workers' CPU seconds per timed step, by rank, in all and by thread role, and their wall seconds per step
    by phase where the loop times them (hvdtrain.bench.loops writes RESULT.rankN)."""
    rows = []
    for path in sorted(glob.glob(result + ".rank*")):
        with open(path) as f:
            row = json.load(f)
        rows.append((row["rank"], row["cpu_seconds_per_step"], row.get("thread_cpu_per_step") or {},
                     row.get("phase_seconds_per_step") or {}, row.get("thread_wakeups_per_step") or {}))
    rows.sort(key=lambda r: r[0])
    roles = rows[0][2] if rows else {}
    phases = rows[0][3] if rows else {}
    return {"worker_cpu_per_step": [r[1] for r in rows],
            "thread_cpu_per_step": {role: [r[2].get(role, 0.0) for r in rows] for role in roles},
            "phase_seconds_per_step": {phase: [r[3].get(phase, 0.0) for r in rows] for phase in phases},
            "thread_wakeups_per_step": {role: [r[4].get(role, 0.0) for r in rows] for role in roles if role != "ended"}}


def _single(cluster: Cluster, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
            timeout: float) -> Dict:
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        cmd = [*cluster.prefix(0), sys.executable, "-m", "hvdtrain.bench.loops", "single-mxnet", "--recipe", "mnist",
               "--steps", str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads", "1",
               "--result", result, "--", *recipe_args]
        ips = run_worker(cmd, result, timeout, "the single worker", {"OMP_NUM_THREADS": "1"})["images_per_sec"]
        return {"images_per_sec": float(ips), **_rank_cpu(result)}


STOCK_HOROVOD = {"OMP_NUM_THREADS": "1", "HOROVOD_IDLE_WAIT": "0", "HOROVOD_SPIN_WAIT": "1"}
"""Stock Horovod 0.28.1's behaviour in hvdtrain's build (scripts/patch_horovod.py): its background loop negotiates
every cycle (fixes 3 off) and horovod.torch waits for a collective by spinning (fix 5 off)."""


def _horovod(cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
             timeout: float, loop: str = "horovod-mxnet") -> Dict:
    """Horovod's own example loop (``horovod-mxnet`` or ``horovod-torch``), as stock Horovod runs it."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        cmd = _launch(cluster, n, ["-m", "hvdtrain.bench.loops", loop, "--recipe", "mnist", "--steps",
                                   str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size), "--threads",
                                   "1", "--result", result, "--", *recipe_args])
        ips = run_worker(cmd, result, timeout, f"{loop} on {n} host(s)", STOCK_HOROVOD)["images_per_sec"]
        return {"images_per_sec": float(ips), **_rank_cpu(result)}


def _ddp(cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
         timeout: float, bucket_cap_mb: Optional[float] = None, bucket_times: bool = False) -> Dict:
    """PyTorch DDP as its documentation runs it on several machines: ``torchrun --nnodes n --node-rank i
    --master-addr host0`` on every host (inside its namespace and quota), c10d's Gloo backend on the hosts' eth0,
    the same model, batch and loop as Horovod's (``hvdtrain.bench.loops ddp-torch``); ``bucket_cap_mb``: DDP's
    gradient bucket size (None: its default, 25 MB); ``bucket_times``: each bucket's allreduce timed in a comm hook
    (``--bucket-times``), summarized as the hvdtrain arms' timelines are (``timeline`` in the result)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        result = os.path.join(out, "result.json")
        loop = ["-m", "hvdtrain.bench.loops", "ddp-torch", "--recipe", "mnist", "--steps", str(steps), "--warmup",
                str(warmup), "--batch-size", str(batch_size), "--threads", "1", "--result", result]
        if bucket_cap_mb is not None:
            loop += ["--bucket-cap-mb", f"{bucket_cap_mb:g}"]
        if bucket_times:
            loop += ["--bucket-times"]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
        procs = []
        try:
            for i in range(n):
                cmd = [*cluster.prefix(i), torchrun, "--nnodes", str(n), "--nproc-per-node", "1", "--node-rank",
                       str(i), "--master-addr", cluster.addresses[0], "--master-port", port, *loop, "--",
                       *recipe_args]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True, env=env))
            deadline = time.monotonic() + timeout
            outputs = []
            for i, proc in enumerate(procs):
                try:
                    outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"bench: ddp on {n} host(s) did not finish within {timeout:.0f}s") from None
                if proc.returncode != 0:
                    lines = outputs[-1].strip().splitlines()
                    raise RuntimeError(f"bench: ddp on {n} host(s) failed on host{i} (exit {proc.returncode}): "
                                       + " | ".join(lines[-3:]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        with open(result) as f:
            written = json.load(f)
        timed = {"timeline": written["timeline"]} if "timeline" in written else {}
        return {"images_per_sec": float(written["images_per_sec"]), **_rank_cpu(result), **timed}


def _hvdtrain(cluster: Cluster, n: int, batch_size: int, recipe_args: Sequence[str], timeout: float,
              extra: Sequence[str] = (), framework: str = "mxnet", env: Optional[Dict[str, str]] = None,
              timeline_steps: str = "") -> Dict:
    """hvdtrain itself (``recipe mnist --synthetic`` on ``framework``, its own Horovod settings unless ``env`` sets
    them): 2 epochs of 64 steps, the first the warm-up, the img/s of the second; with ``timeline_steps`` (A:B),
    the summary of rank 0's Horovod timeline of those steps (:func:`hvdtrain.timeline.summarize`)."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as out:
        window = ["--timeline-steps", timeline_steps] if timeline_steps else []
        cmd = _launch(cluster, n, ["-m", "hvdtrain", "recipe", "mnist", "--framework", framework, "--synthetic",
                                   "--epochs", "2", "--warmup-epochs", "0", "--batch-size", str(batch_size),
                                   "--threads", "1", "--precision", "fp32", "--resume", "never", "--output-dir", out,
                                   *window, *recipe_args, *extra])
        last = run_records(cmd, out, timeout, {"OMP_NUM_THREADS": "1", **(env or {})},
                           f"hvdtrain on {n} host(s)")[-1]
        result = {"images_per_sec": float(last["images_per_sec"]), "worker_cpu_per_step": last["cpu_seconds_per_step"],
                  "thread_cpu_per_step": last.get("thread_cpu_per_step", {}),
                  "phase_seconds": last.get("phase_seconds"), "phase_slowest": last.get("phase_slowest")}
        path = os.path.join(out, "timeline.json")
        if timeline_steps and os.path.exists(path):
            first, end = timeline.recorded_steps(timeline_steps, int(last["global_step"]))
            result["timeline"] = timeline.summarize(path, end - first + 1)
        elif timeline_steps:
            result["timeline"] = {"error": f"no timeline: the run had {last['global_step']} steps"}
        return result



def _ps(cluster: Cluster, n: int, servers: int, steps: int, warmup: int, batch_size: int,
        recipe_args: Sequence[str], timeout: float) -> Dict:
    def place(role: str, index: int):
        host = 0 if role == "scheduler" else index  # server j on host j, worker i on host i
        return cluster.prefix(host), cluster.addresses[host], "eth0"
    return run_ps("mnist", n, servers, 1, steps, batch_size, timeout, place, recipe_args, warmup=warmup, details=True)



ARMS = ("horovod", "hvdtrain", "hvdtrain sharded", "ps 1 server", "ps server per host")
"""The MXNet arms: horovod: Horovod's example loop, stock settings; hvdtrain: the recipe under hvdtrain; hvdtrain
sharded: with --shard-optimizer; ps: MXNet's parameter server (kvstore dist_sync) with one server on host0 or one on
every host. Their scaling efficiency is taken against one baseline, the Gluon loop alone on one host."""
TORCH_ARM = "hvdtrain torch"
DDP_TUNED_BUCKET_MB = 1.0
"""The tuned DDP arm's bucket size. The 6.5 MB of gradients fit one default 25 MB bucket, which DDP sends only when
the whole backward pass is done; 1 MB buckets start sending while it runs."""
DDP_TIMED_ARM = "ddp bucket hook"
"""DDP's default with the comm hook that times its buckets in every run (``--frameworks ddp-timed``)."""
ARM_GROUPS = {
    "mxnet": ARMS,
    "hvdtrain-mxnet": ("hvdtrain",),
    "torch": (TORCH_ARM,),
    "torch-spin": (f"{TORCH_ARM} spin",),
    "torch-block": (f"{TORCH_ARM} block",),
    "torch-32k": (f"{TORCH_ARM} rcvlowat 32k",),
    "torch-overlap": (f"{TORCH_ARM} overlap forward",),
    "torch-1group": (f"{TORCH_ARM} one group",),
    "torch-buckets": (f"{TORCH_ARM} buckets",),
    "torch-1group-overlap": (f"{TORCH_ARM} one group overlap forward",),
    "torch-serial": (f"{TORCH_ARM} one at a time",),
    "torch-ring": (f"{TORCH_ARM} ring negotiation",),
    "ddp": ("ddp", f"ddp bucket {DDP_TUNED_BUCKET_MB:g}mb"),
    "ddp-timed": (DDP_TIMED_ARM,),
    "horovod-torch": ("horovod torch",),
}
"""What ``--frameworks`` names: every MXNet arm, hvdtrain on MXNet alone, hvdtrain on PyTorch (as it chooses its wait
for a collective, and with each wait forced: horovod.torch's spinning wait, what every rank of this benchmark used
before its hosts showed their quota, and hvdtrain's blocking wait; and with Gloo's reads waking at the library's
32 KiB, which hvdtrain lowers to 4 KiB under a quota of less than a core per rank; with --overlap-forward; and with
every gradient in one group, sent after the backward pass, ``--allreduce-groups 1``, and that with
--overlap-forward; and in DDP's buckets wherever it runs, ``--allreduce-groups buckets``, which auto replaces by one
group under a quota of less than a core per rank; and with Horovod running one collective at a time,
``HOROVOD_GLOO_ASYNC_BYTES=0``, where hvdtrain runs a large allreduce beside the others; and with Horovod's
negotiation rounds in Gloo's ring, ``HOROVOD_GLOO_RING_NEGOTIATION=1``, where hvdtrain's Horovod combines them in one
exchange), PyTorch DDP under
torchrun (its default bucket and a tuned one; ``ddp-timed``: its default with the comm hook that times its buckets
under ``--timeline-steps`` in every run, so that the hook's own cost is measured against DDP's C++ default), and
Horovod's own PyTorch example loop with stock settings. The
PyTorch arms' efficiency is each against its own run on one host."""


def parse_arms(text: str) -> Tuple[str, ...]:
    """The arms ``--frameworks`` names (comma-separated groups of :data:`ARM_GROUPS`), in order, each once; a
    ConfigError naming the bad group otherwise."""
    groups = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in groups if g not in ARM_GROUPS]
    if bad or not groups:
        raise ConfigError(f"--frameworks {text!r}: {'unknown ' + ', '.join(bad) if bad else 'none given'}; choose "
                          f"from {', '.join(ARM_GROUPS)} (comma-separated)")
    arms: List[str] = []
    for g in groups:
        arms += [a for a in ARM_GROUPS[g] if a not in arms]
    return tuple(arms)


def _arm(name: str, cluster: Cluster, n: int, steps: int, warmup: int, batch_size: int, recipe_args: Sequence[str],
         timeout: float, timeline_steps: str = ""):
    """A zero-argument run of arm ``name`` on ``n`` hosts; ``timeline_steps``: the hvdtrain arms record Horovod's
    timeline of those steps (``--timeline-steps``) and return its summary, and the DDP arms time their buckets'
    allreduces over their timed steps and return the same summary of them."""
    common = (cluster, n, steps, warmup, batch_size, recipe_args, timeout)
    hv = functools.partial(_hvdtrain, timeline_steps=timeline_steps)
    ddp = functools.partial(_ddp, *common, bucket_times=bool(timeline_steps))
    runs = {
        "horovod": lambda: _horovod(*common),
        "hvdtrain": lambda: hv(cluster, n, batch_size, recipe_args, timeout),
        "hvdtrain sharded": lambda: hv(cluster, n, batch_size, recipe_args, timeout, ["--shard-optimizer"]),
        "ps 1 server": lambda: _ps(cluster, n, 1, steps, warmup, batch_size, recipe_args, timeout),
        "ps server per host": lambda: _ps(cluster, n, n, steps, warmup, batch_size, recipe_args, timeout),
        TORCH_ARM: lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch"),
        f"{TORCH_ARM} spin": lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                        env={"HOROVOD_SPIN_WAIT": "1"}),
        f"{TORCH_ARM} block": lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                         env={"HOROVOD_SPIN_WAIT": "0"}),
        f"{TORCH_ARM} rcvlowat 32k": lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                                env={"HOROVOD_GLOO_RCVLOWAT": "32768"}),
        f"{TORCH_ARM} overlap forward": lambda: hv(cluster, n, batch_size, recipe_args, timeout,
                                                   ["--overlap-forward"], framework="torch"),
        f"{TORCH_ARM} buckets": lambda: hv(cluster, n, batch_size, recipe_args, timeout,
                                           ["--allreduce-groups", "buckets"], framework="torch"),
        f"{TORCH_ARM} one group": lambda: hv(cluster, n, batch_size, recipe_args, timeout, ["--allreduce-groups", "1"],
                                             framework="torch"),
        f"{TORCH_ARM} one group overlap forward": lambda: hv(cluster, n, batch_size, recipe_args, timeout,
                                                             ["--allreduce-groups", "1", "--overlap-forward"],
                                                             framework="torch"),
        f"{TORCH_ARM} one at a time": lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                                 env={"HOROVOD_GLOO_ASYNC_BYTES": "0"}),
        f"{TORCH_ARM} ring negotiation": lambda: hv(cluster, n, batch_size, recipe_args, timeout, framework="torch",
                                                    env={"HOROVOD_GLOO_RING_NEGOTIATION": "1"}),
        "ddp": ddp,
        f"ddp bucket {DDP_TUNED_BUCKET_MB:g}mb": lambda: ddp(bucket_cap_mb=DDP_TUNED_BUCKET_MB),
        DDP_TIMED_ARM: lambda: ddp(bucket_times=True),
        "horovod torch": lambda: _horovod(*common, loop="horovod-torch"),
    }
    return runs[name]
