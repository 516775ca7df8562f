"""Allreduce timing workers for ``python -m hvdtrain bench allreduce`` (run under a launcher; rank 0 writes JSON).

    horovodrun -np 2 --gloo python -m hvdtrain.bench.allreduce_worker horovod sizes --result r.json
    mpirun -np 2 python -m hvdtrain.bench.allreduce_worker horovod sizes --result r.json
    torchrun --nproc_per_node 2 -m hvdtrain.bench.allreduce_worker torch sizes --result r.json
    horovodrun -np 2 --gloo python -m hvdtrain.bench.allreduce_worker horovod resnet50 --result r.json
    python -m hvdtrain.bench.allreduce_worker memcpy sizes --result r.json
    horovodrun -np 2 --gloo python -m hvdtrain.bench.allreduce_worker horovod shard --elements 1630000 \
        --framework mxnet --result r.json

``sizes``: one float32 tensor of each size, allreduced (sum) back to back; seconds per operation, algorithm bandwidth
(bytes / time) and bus bandwidth (algorithm bandwidth x 2 (n - 1) / n, the data each rank sends and receives in a ring,
as nccl-tests report it). ``resnet50``: the 161 gradient tensors of ResNet-50 (torchvision shapes) allreduced
asynchronously together, as DistributedOptimizer does after a backward pass; seconds per round under the
HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME of the environment. ``shard``: the collectives of a step with and
without ``--shard-optimizer`` on a flat vector of ``--elements`` float32 values: its allreduce, its reduce-scatter
and the allgather of one rank's 1/n of it, each timed on its own (seconds per operation, and rank 0's CPU seconds
per operation: all its threads, with the kernel's work for its sockets). ``paths``: the average of a step's gradients
(``--shapes``) three ways, interleaved in one job: Horovod's allreduce of each gradient (fused in its buffer, as
DistributedOptimizer sends them), Horovod's allreduce of one flat tensor holding them all (no fusion copy), and c10d's
Gloo allreduce of that flat tensor (DDP's bucket); seconds and each rank's CPU seconds by thread role per operation.
``memcpy``: one process copying the same sizes, the ceiling of what a reduction through memory can reach on this
machine.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List, Tuple

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20]


def iterations(nbytes: int) -> int:
    """The same count on every rank: enough repetitions to time small sizes, few for large ones."""
    return max(3, min(200, (256 << 20) // max(nbytes, 1)))


def resnet50_shapes() -> List[Tuple[int, ...]]:
    """The trainable parameter shapes of torchvision's ResNet-50 (161 tensors, 25,557,032 values)."""
    shapes: List[Tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def _sizes_rows(allreduce, rank: int, size: int, sizes: List[int], barrier) -> List[dict]:
    import torch
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        n = iterations(nbytes)
        for _ in range(2):  # warm-up: connections, buffers
            allreduce(t)
        barrier()
        start = time.perf_counter()
        for _ in range(n):
            allreduce(t)
        seconds = (time.perf_counter() - start) / n
        algbw = nbytes / seconds
        rows.append({"bytes": nbytes, "seconds": seconds, "iterations": n, "algbw_gbps": algbw / 1e9,
                     "busbw_gbps": algbw * 2 * (size - 1) / size / 1e9 if size > 1 else algbw / 1e9})
    return rows


def horovod(args) -> dict:
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    if args.what == "sizes":
        rows = _sizes_rows(lambda t: hvd.allreduce_(t, op=hvd.Sum, name="bench"), hvd.rank(), hvd.size(),
                           args.sizes, lambda: hvd.allreduce(torch.zeros(1), name="barrier"))
        return {"rank": hvd.rank(), "size": hvd.size(), "rows": rows,
                "controller": "mpi" if hvd.mpi_enabled() else "gloo"}
    tensors = [torch.ones(s) for s in resnet50_shapes()]
    rounds = args.rounds

    def one_round():
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"grad.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)

    for _ in range(2):
        one_round()
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    seconds = (time.perf_counter() - start) / rounds
    return {"rank": hvd.rank(), "size": hvd.size(), "tensors": len(tensors), "seconds": seconds,
            "bytes": sum(t.numel() for t in tensors) * 4, "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD"),
            "cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME")}


def shard_collectives(args) -> dict:
    """Seconds per allreduce of the whole vector, per reduce-scatter of it and per allgather of a 1/n shard, through
    ``--framework``'s Horovod frontend. The MXNet frontend waits for a result on MXNet's engine; horovod.torch 0.28.1
    waits by spinning (``WaitAndClear``: poll, yield, repeat), which takes CPU from Horovod's own thread wherever a
    rank has less than a core of its own (a CPU quota), so the two can time the same Gloo operation differently."""
    if args.framework == "mxnet":
        from ..backends.gluoncv_compat import import_mxnet
        mx = import_mxnet()
        import horovod.mxnet as hvd
        hvd.init()
        ones, done = (lambda k: mx.nd.ones((k,))), (lambda a: a.wait_to_read())
    else:
        import torch
        import horovod.torch as hvd
        hvd.init()
        torch.set_num_threads(1)
        ones, done = (lambda k: torch.ones(k)), (lambda a: a)
    n = hvd.size()
    whole, shard = ones(args.elements // n * n), ones(args.elements // n)
    ops = {"allreduce": lambda: done(hvd.allreduce(whole, op=hvd.Sum, name="bench.ar")),
           "reducescatter": lambda: done(hvd.reducescatter(whole, op=hvd.Sum, name="bench.rs")),
           "allgather": lambda: done(hvd.allgather(shard, name="bench.ag"))}
    out = {"rank": hvd.rank(), "size": n, "elements": args.elements, "framework": args.framework}
    for name, op in ops.items():
        for _ in range(2):  # warm-up: connections, buffers
            op()
        done(hvd.allreduce(ones(1), name="barrier"))
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.rounds):
            op()
        out[name] = (time.perf_counter() - start) / args.rounds
        out.setdefault("cpu_seconds", {})[name] = (time.process_time() - cpu) / args.rounds  # rank 0's process
    return out


PATHS = ("horovod gradients", "horovod flat", "c10d flat")
"""The ways ``paths`` averages the same gradients (see the module's docstring)."""


def allreduce_paths(args) -> dict:
    """``paths``: under horovodrun (Horovod's ranks), with c10d's Gloo group joined at ``--master`` as well."""
    import statistics
    import torch
    import torch.distributed as dist
    import horovod.torch as hvd
    from ..threads import ThreadCpu, created_by
    with created_by("horovod", "transport"):
        hvd.init()
    rank, n = hvd.rank(), hvd.size()
    with created_by(None, "transport"):  # c10d's threads; idle while Horovod's work, and Horovod's while c10d's
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=n)
    torch.set_num_threads(1)
    grads = [torch.ones(s) for s in args.shapes]
    flat = torch.ones(sum(g.numel() for g in grads))

    def gradients():
        handles = [hvd.allreduce_async_(g, op=hvd.Average, name=f"grad.{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    def c10d():  # DDP's default hook: divide the bucket by the group's size, then allreduce it
        flat.div_(n)
        dist.all_reduce(flat)

    ops = {"horovod gradients": gradients,
           "horovod flat": lambda: hvd.allreduce_(flat, op=hvd.Average, name="flat"), "c10d flat": c10d}
    seconds = {p: [] for p in PATHS}
    cpu = {p: [] for p in PATHS}
    wakeups = {p: [] for p in PATHS}
    census = ThreadCpu()
    for _ in range(args.repeats):  # the paths interleaved: each sees the same machine
        for path in PATHS:
            ops[path]()  # warm-up
            hvd.allreduce(torch.zeros(1), name="barrier")
            dist.barrier()
            census.start()
            start = time.perf_counter()
            for _ in range(args.rounds):
                ops[path]()
            seconds[path].append((time.perf_counter() - start) / args.rounds)
            cpu[path].append({role: s / args.rounds for role, s in census.stop().items()})
            wakeups[path].append({role: n / args.rounds for role, n in census.wakeups.items()})
    mine = {p: {role: statistics.median(c[role] for c in cpu[p]) for role in cpu[p][0]} for p in PATHS}
    every = hvd.allgather_object(mine)  # each rank's CPU by role, for the range over ranks
    woken = hvd.allgather_object({p: {role: statistics.median(w[role] for w in wakeups[p]) for role in wakeups[p][0]}
                                  for p in PATHS})
    dist.barrier()
    dist.destroy_process_group()
    # every path averages ones into ones: a path that summed, or dropped a part, shows here
    error = max(float((t - 1).abs().max()) for t in [*grads, flat])
    return {"rank": rank, "size": n, "bytes": flat.numel() * 4, "tensors": len(grads), "max_error": error,
            "seconds": {p: statistics.median(v) for p, v in seconds.items()}, "samples": seconds,
            "thread_cpu_per_op": every, "thread_wakeups_per_op": woken}


def torch_distributed(args) -> dict:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = _sizes_rows(lambda t: dist.all_reduce(t), dist.get_rank(), dist.get_world_size(), args.sizes, dist.barrier)
    out = {"rank": dist.get_rank(), "size": dist.get_world_size(), "rows": rows}
    dist.destroy_process_group()
    return out


def memcpy(args) -> dict:
    import numpy as np
    rows = []
    for nbytes in args.sizes:
        src, dst = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
        n = iterations(nbytes)
        np.copyto(dst, src)
        start = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        seconds = (time.perf_counter() - start) / n
        rows.append({"bytes": nbytes, "seconds": seconds, "iterations": n, "algbw_gbps": nbytes / seconds / 1e9,
                     "busbw_gbps": nbytes / seconds / 1e9})
    return {"rank": 0, "size": 1, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.allreduce_worker")
    parser.add_argument("library", choices=["horovod", "torch", "memcpy"])
    parser.add_argument("what", choices=["sizes", "resnet50", "shard", "paths"])
    parser.add_argument("--elements", type=int, default=1 << 20, help="shard: values in the flat vector")
    parser.add_argument("--framework", choices=["mxnet", "torch"], default="mxnet", help="shard: Horovod's frontend")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_SIZES)
    parser.add_argument("--rounds", type=int, default=10)
    # no default string: argparse would pass it through ``type`` for every mode
    parser.add_argument("--shapes", default=None, help="paths: the gradients' shapes, e.g. 784x512,512",
                        type=lambda s: [tuple(int(d) for d in t.split("x")) for t in s.split(",")])
    parser.add_argument("--master", default="", help="paths: c10d's rendezvous, HOST:PORT")
    parser.add_argument("--repeats", type=int, default=3, help="paths: interleaved repetitions (medians kept)")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    if args.what in ("shard", "paths") and args.library != "horovod":
        parser.error(f"{args.what}: with the horovod library only")
    if args.what == "paths" and not (args.shapes and args.master):
        parser.error("paths: give --shapes and --master")
    run = {"shard": shard_collectives, "paths": allreduce_paths}.get(args.what) or \
        {"horovod": horovod, "torch": torch_distributed, "memcpy": memcpy}[args.library]
    out = run(args)
    if out["rank"] == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
