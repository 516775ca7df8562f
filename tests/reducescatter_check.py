"""Every rank's part of Horovod's reduce-scatter against the sum of the gathered inputs (tests/e2e/test_gloo_fixes.py).

    horovodrun -np N python tests/reducescatter_check.py [ELEMENTS] [ROUNDS]

Each round reduce-scatters ELEMENTS random float32 values per rank and compares this rank's part, element by element,
with the average of every rank's input (gathered with an allgather). Prints one line per rank; exit status 1 when
any element differs, naming the round, the count and where they are.
"""
import sys

import torch
import horovod.torch as hvd


def main() -> int:
    hvd.init()
    elements = int(sys.argv[1]) if len(sys.argv) > 1 else 8_000_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    size, rank = hvd.size(), hvd.rank()
    elements -= elements % size
    part = elements // size
    wrong = []
    for r in range(rounds):
        x = torch.randn(elements, generator=torch.Generator().manual_seed(1000 * r + rank))
        everyone = hvd.allgather(x.reshape(1, -1), name=f"check.inputs.{r}")
        want = everyone.sum(0)[rank * part:(rank + 1) * part] / size
        got = hvd.reducescatter(x, name=f"check.rs.{r}", op=hvd.Average)
        bad = ((got - want).abs() > 1e-5 * (1 + want.abs())).nonzero().flatten()
        if len(bad):
            wrong.append(f"round {r}: {len(bad)} of {part} elements wrong, at {int(bad[0])}..{int(bad[-1])}")
    print(f"rank {rank}: " + ("; ".join(wrong) if wrong else f"{rounds} rounds of {part} elements right"), flush=True)
    hvd.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
