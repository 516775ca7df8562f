"""--overlap-forward's optimizer against the plain grouped one, under horovodrun (tests/e2e/test_overlap_forward.py).

    horovodrun -np N python tests/overlap_check.py OPTIMIZER [OPTIMIZER ...]

Two copies of one small network (convolutions, then a large fully connected layer and a small one), trained side by
side on each rank's own batches for STEPS steps with each OPTIMIZER in turn (sgd with momentum and weight decay, adam
with amsgrad, adamw, or lamb), the learning rate changed before every step as a warmup does: one through hvdtrain's
grouped allreduces, one with ``overlap_forward``, in DDP's buckets and again in one group. Every weight must be equal
to the bit after every step (the late parameter, which the next step's forward pass updates at that step's rate, after
the last), the late parameter must be the large layer's weight, and after the last step the optimizers' states
(momentum, moments, step counts) must be equal too. Then a network that uses that weight outside its module's forward
pass must be refused at its second step, in one line. Prints one line per rank; exit status 1 when anything differs.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import horovod.torch as hvd

from hvdtrain.backends.torch_groups import BUCKETS, distributed_optimizer
from hvdtrain.backends.torch_optim import LAMB

STEPS = 6
GROUPINGS = ((BUCKETS, "DDP's buckets"), (1, "one group"))
"""The groups checked: DDP's buckets (the second half after the first layers' group) and one group (the second half
right behind it)."""


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 512),
                         nn.ReLU(), nn.Linear(512, 10))


class Functional(nn.Module):
    """The large layer's weight used by its parent, not through the layer's own forward pass."""

    def __init__(self):
        super().__init__()
        self.body = network()

    def forward(self, x):
        conv, fc, out = self.body[0], self.body[3], self.body[5]
        return out(F.relu(F.linear(torch.flatten(F.relu(conv(x)), 1), fc.weight, fc.bias)))


def optimizer_for(model: nn.Module, kind: str, overlap: bool, groups: int = BUCKETS):
    named = list(model.named_parameters())
    params = [p for _, p in named]
    inner = {"sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3),
             "adam": lambda: torch.optim.Adam(params, lr=0.01, weight_decay=1e-3, amsgrad=True),
             "adamw": lambda: torch.optim.AdamW(params, lr=0.01, weight_decay=1e-2),
             "lamb": lambda: LAMB(params, lr=0.01, weight_decay=1e-3)}[kind]()
    return distributed_optimizer(inner, named, hvd.Compression.none, 1, 1.0, groups, overlap)


def train_step(model, optimizer, x, y, rate: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = rate
    F.cross_entropy(model(x), y).backward()
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()
    optimizer.zero_grad()


def check(kind: str, rank: int, groups: int) -> list:
    """What differs with ``kind`` and ``groups`` (empty when nothing does)."""
    plain, late = network(), network()
    p_opt, l_opt = optimizer_for(plain, kind, False, groups), optimizer_for(late, kind, True, groups)
    l_opt._late.hook(l_opt, late)
    wrong = []
    if l_opt._late.param is not late[3].weight:
        wrong.append("the late parameter is not the large layer's weight")
    batches = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(16, 1, 16, 16, generator=batches), torch.randint(0, 10, (16,), generator=batches)
        rate = 0.1 * (step + 1) / STEPS  # a new rate every step: the late update must use its own step's
        train_step(plain, p_opt, x, y, rate)
        train_step(late, l_opt, x, y, rate)
        if l_opt._late.pending is None:
            wrong.append(f"step {step}: no second half on the wire after the step")
        settled = step == STEPS - 1
        if settled:  # what a checkpoint does; before, the next step's forward pass updates it (at another rate)
            l_opt.settle()
        for (name, a), b in zip(plain.named_parameters(), late.parameters()):
            if (settled or b is not l_opt._late.param) and not torch.equal(a, b):
                wrong.append(f"step {step}: {name} differs by {float((a - b).abs().max()):.3g}")
        if settled:  # the optimizer's state too: momentum, moments, Adam's step counts
            ours, theirs = l_opt.state_dict()["state"], p_opt.state_dict()["state"]
            for index, values in theirs.items():
                for key, value in values.items():
                    if not torch.equal(torch.as_tensor(value), torch.as_tensor(ours[index][key])):
                        wrong.append(f"step {step}: the optimizer's {key} of parameter {index} differs")
    refused = ""
    functional = Functional()
    f_opt = optimizer_for(functional, kind, True)
    f_opt._late.hook(f_opt, functional)
    try:
        for step in range(2):
            x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))
            train_step(functional, f_opt, x, y, 0.1)
    except RuntimeError as e:
        refused = str(e)
    hvd.allreduce(torch.zeros(1), name="check.refused")  # every rank past its refusal before any shuts down
    if "outside its module's forward pass" not in refused:
        wrong.append(f"a weight used outside its module was not refused: {refused!r}")
    return wrong


def main() -> int:
    hvd.init()
    rank, failed = hvd.rank(), False
    for kind in sys.argv[1:]:
        wrong = [f"{label}: {what}" for groups, label in GROUPINGS for what in check(kind, rank, groups)]
        failed = failed or bool(wrong)
        print(f"rank {rank}: " + ("; ".join(wrong[:5]) if wrong else
                                  f"{STEPS} steps of {kind} equal to the bit in DDP's buckets and in one group; the "
                                  f"functional use refused"), flush=True)
    hvd.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
