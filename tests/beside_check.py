"""Allreduces beside a large one (scripts/patch_horovod.py fix 11), their results and their order
(tests/e2e/test_gloo_beside.py).

    horovodrun --gloo -np 2 python tests/beside_check.py ROUNDS [--only-rank0] [--leave-one-in-flight] [--peer-exits]

Each round submits a large allreduce (8 M float32, 32 MB: at or above HOROVOD_GLOO_ASYNC_BYTES, so it runs beside
Horovod's background thread), three small ones (one summed, two averaged), waits for the small ones, then submits a
second large one as a group of three tensors (the fused path, averaged: a postscale; it starts once the first has
ended). Run with HOROVOD_IDLE_WAIT=2 (hvdtrain's setting for groups), so that the first is negotiated alone. Every
value is an integer sum (or half of one) that float32 holds exactly, so any wrong element is reported. A small one
that completes while the first large one is still in flight is counted: with the fix and the variable set, the small
ones are reduced beside it; without (or with the variable 0) the background thread runs one collective at a time and
a small one queued after the large one never completes first.

--only-rank0: HOROVOD_GLOO_ASYNC_BYTES is set on rank 0 alone (the ranks must agree to run nothing beside).
--leave-one-in-flight: after the rounds, a last large allreduce is submitted and hvd.shutdown() called as soon as
every rank has submitted it (a file each in the directory BESIDE_CHECK_DIR names).
--peer-exits: after the rounds, a 256 MB allreduce, and rank 1 exits 0.3 s into it: rank 0 prints how it failed.

Prints one line per rank: "rank R: N rounds right, K small completed beside"; exit status 1 when any value is wrong.
"""
import os
import sys
import time


def submitted_everywhere(rank: int, size: int) -> None:
    """Wait until every rank has submitted its last allreduce (a file each in BESIDE_CHECK_DIR), outside Horovod:
    a shutdown is not a barrier, and one that reached a rank still checking its last round would refuse that rank's
    submission ("Horovod has been shut down") instead of leaving the allreduce in flight."""
    where = os.environ["BESIDE_CHECK_DIR"]
    open(os.path.join(where, f"submitted-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while sum(os.path.exists(os.path.join(where, f"submitted-{r}")) for r in range(size)) < size:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks never submitted their last allreduce")
        time.sleep(0.002)


def main() -> int:
    rounds = int(sys.argv[1])
    flags = set(sys.argv[2:])
    rank_env = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if "--only-rank0" in flags and rank_env != 0:
        os.environ.pop("HOROVOD_GLOO_ASYNC_BYTES", None)
    import torch
    import horovod.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = sum(range(1, size + 1))  # each rank contributes rank + 1
    n_big = 8 << 20
    wrong, beside = [], 0
    index = torch.arange(n_big, dtype=torch.float32) % 1000
    for r in range(rounds):
        big = index + (rank + 1)  # sum over ranks: size * index + total
        group = [torch.full((n,), float(2 * (rank + 1) + r)) for n in (3 << 20, 5, 1 << 20)]
        small = [torch.full((7,), float(rank + 1 + r)), torch.full((1000,), float(2 * (rank + r))),
                 torch.full((3,), float(rank))]
        h_big = hvd.allreduce_async(big, name=f"big.{r}", op=hvd.Sum)
        time.sleep(0.005)  # negotiated alone (HOROVOD_IDLE_WAIT=2), not fused with what follows
        h_small = [hvd.allreduce_async(small[0], name=f"small.sum.{r}", op=hvd.Sum)] + \
            [hvd.allreduce_async(t, name=f"small.avg.{r}.{i}", op=hvd.Average) for i, t in enumerate(small[1:])]
        while not all(hvd.poll(h) for h in h_small):
            time.sleep(0.0005)
        beside += 0 if hvd.poll(h_big) else 1
        h_group = hvd.grouped_allreduce_async(group, name=f"group.{r}", op=hvd.Average)  # after the first
        got_small = [hvd.synchronize(h) for h in h_small]
        got_big = hvd.synchronize(h_big)
        got_group = hvd.synchronize(h_group)
        want = {
            "big": index * size + total,
            "small.sum": torch.full((7,), float(total + size * r)),
            "small.avg.0": torch.full((1000,), 2.0 * (sum(range(size)) / size + r)),
            "small.avg.1": torch.full((3,), sum(range(size)) / size),
            "group": [torch.full((n,), 2.0 * total / size + r) for n in (3 << 20, 5, 1 << 20)],
        }
        checks = [("big", got_big, want["big"]), ("small.sum", got_small[0], want["small.sum"]),
                  ("small.avg.0", got_small[1], want["small.avg.0"]),
                  ("small.avg.1", got_small[2], want["small.avg.1"])]
        checks += [(f"group[{i}]", g, w) for i, (g, w) in enumerate(zip(got_group, want["group"]))]
        for name, got, expected in checks:
            bad = (got != expected).nonzero().flatten()
            if len(bad):
                wrong.append(f"round {r} {name}: {len(bad)} of {got.numel()} wrong, first at {int(bad[0])}: "
                             f"{float(got[bad[0]])} for {float(expected[bad[0]])}")
    if "--leave-one-in-flight" in flags:
        hvd.allreduce_async(index.clone(), name="left.in.flight", op=hvd.Sum)
        submitted_everywhere(rank, size)
    if "--peer-exits" in flags:
        handle = hvd.allreduce_async(torch.ones(64 << 20), name="peer.exits", op=hvd.Sum)  # 256 MB
        if rank == 1:
            time.sleep(0.3)
            os._exit(0)  # gone in the middle of it (status 0: the launcher waits for rank 0)
        start = time.monotonic()
        try:
            hvd.synchronize(handle)
            print("rank 0: the large allreduce completed without its peer", flush=True)
            return 1
        except Exception as e:  # noqa: BLE001 - what the rank would raise
            print(f"rank 0: the large allreduce failed after {time.monotonic() - start:.1f} s: "
                  f"{type(e).__name__}: {e}", flush=True)
            return 0
    print(f"rank {rank}: " + ("; ".join(wrong[:5]) if wrong else f"{rounds} rounds right") +
          f", {beside} small completed beside", flush=True)
    hvd.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
