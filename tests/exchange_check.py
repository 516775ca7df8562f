"""Negotiation rounds whose bit vectors are combined in one exchange (scripts/patch_horovod.py fix 12), checked through
what they decide: run under horovodrun with 3 or more ranks (an odd count, so no exchange pairs every rank with one
peer), Gloo.

    horovodrun -np 3 python tests/exchange_check.py ROUNDS [--ring-on-rank0] [--peer-exits]

Each round, on the global set and on a process set of ranks 0 and 2 (its own controller and Gloo context, where the
ranks' numbers in the context are not their global ones):
- the same named tensors again (cache hits: the AND of every rank's bits), every rank submitting them in an order of
  its own and some ranks later than the others (rounds in which only some ranks have a tensor);
- one name whose shape changes every round (its cached response invalid on every rank: the OR round);
- a name new every round (not cached: the full negotiation).
Every value is compared exactly against the sum computed here. The last line of each rank: "rank R: N rounds right".
--ring-on-rank0: HOROVOD_GLOO_RING_NEGOTIATION=1 on rank 0 alone, which the ranks must agree on (all of them in
Gloo's ring) instead of splitting into ranks that wait in the ring and ranks that wait in the exchange.
--peer-exits: after the rounds, the other ranks submit an allreduce that rank 1 never does; rank 1 exits 0.5 s later
without a shutdown, while the others' background threads go on negotiating (a round each cycle, waiting for its
bits). Each of them prints how its allreduce failed: "rank R: failed after S s: ERROR". No process set is registered
then (the rounds run on the global set, as in hvdtrain, which registers none): with one, stock Horovod's shutdown
negotiates the set's removal over the lost connection, outside any handler, and the process aborts instead.
"""
import os
import sys
import time

import numpy as np
import torch

import horovod.torch as hvd


def mine(rank: int, n: int, salt: int) -> torch.Tensor:
    return torch.tensor(np.arange(n, dtype=np.float64) * (rank + 1) + salt, dtype=torch.float64)


def expected(ranks, n: int, salt: int) -> torch.Tensor:
    return sum(mine(r, n, salt) for r in ranks)


def round_on(process_set, members, rank: int, i: int) -> None:
    sizes = [5, 17, 1000, 3]
    names = [f"t{k}" for k in range(len(sizes))]
    order = list(range(len(sizes)))
    order = order[rank % len(order):] + order[:rank % len(order)]  # every rank its own order
    tag = "g" if process_set is None else "s"
    where = {} if process_set is None else {"process_set": process_set}
    handles = {}
    for k in order:
        if rank == i % len(members) and k == order[len(order) // 2]:
            time.sleep(0.02)  # a rank late with part of its tensors: rounds where only some ranks have them
        handles[k] = hvd.allreduce_async(mine(rank, sizes[k], i), name=f"{tag}.{names[k]}", op=hvd.Sum, **where)
    shape_changes = 4 + i % 3  # the cached response is invalid at each change
    handles["shape"] = hvd.allreduce_async(mine(rank, shape_changes, i), name=f"{tag}.changing", op=hvd.Sum, **where)
    handles["new"] = hvd.allreduce_async(mine(rank, 7, i), name=f"{tag}.new{i}", op=hvd.Sum, **where)
    for key, handle in handles.items():
        n = {"shape": shape_changes, "new": 7}[key] if isinstance(key, str) else sizes[key]
        got = hvd.synchronize(handle)
        want = expected(members, n, i)
        if not torch.equal(got, want):
            raise SystemExit(f"rank {rank}: round {i} {tag} {key}: {got.tolist()[:5]} != {want.tolist()[:5]}")


def peer_exits(rank: int) -> None:
    if rank == 1:
        time.sleep(0.5)
        os._exit(0)  # status 0: the launcher waits for the others, which must end on their own
    start = time.monotonic()
    handle = hvd.allreduce_async(torch.ones(3), name="never.by.rank1", op=hvd.Sum)
    try:
        hvd.synchronize(handle)
        print(f"rank {rank}: completed without rank 1", flush=True)
        os._exit(1)
    except Exception as e:  # noqa: BLE001 - what the rank would raise
        print(f"rank {rank}: failed after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
        os._exit(0)


def main() -> None:
    rounds = int(sys.argv[1])
    if "--ring-on-rank0" in sys.argv[2:] and os.environ.get("HOROVOD_RANK") == "0":
        os.environ["HOROVOD_GLOO_RING_NEGOTIATION"] = "1"
    exits = "--peer-exits" in sys.argv[2:]
    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[] if exits else [pair])
    rank, size = hvd.rank(), hvd.size()
    if size < 3:
        raise SystemExit("run with 3 ranks or more")
    for i in range(rounds):
        round_on(None, list(range(size)), rank, i)
        if not exits and pair.included():
            round_on(pair, [0, 2], rank, i)
    if exits:
        peer_exits(rank)
        return
    # a shutdown is collective: ranks outside the pair must not end it while the pair still negotiates
    hvd.allreduce(torch.zeros(1), name="done")
    print(f"rank {rank}: {rounds} rounds right", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
