"""The non-finite-loss guard of a run: one collaborator the Trainer's loop calls, on every rank.

Two questions, each answered alike on every rank:

- Stop? A rank counts its consecutive non-finite training losses; every :attr:`Health.CHECK_EVERY` steps the ranks
  decide together (one tiny allreduce; one per step cost ~15%) and the job stops once any rank has seen
  ``--max-bad-steps`` in a row.
- May a checkpoint be written from these weights? Not when a non-finite loss reached the weights on any rank since
  the last decision (its gradients were averaged into every rank's weights). The vote rides on the epoch's metric
  allreduce (:meth:`Health.flag` / :meth:`Health.decide`), or takes one scalar allreduce of its own before a
  mid-epoch checkpoint (:meth:`Health.everywhere`). A step the loss scaler skipped left the weights clean: it bars
  nothing.
"""
from __future__ import annotations

import math
import sys
from typing import Any


class Health:
    CHECK_EVERY = 10
    """Steps between the collective decisions of the stop rule."""

    def __init__(self, backend, max_bad_steps: int, checkpoint_dir: str):
        self.backend, self.limit, self.checkpoint_dir = backend, max_bad_steps, checkpoint_dir
        self.seen = False
        """This rank saw a non-finite training loss that reached the weights since the last decision."""
        self.bad = 0
        """This rank's non-finite training losses in a row."""

    def observe(self, loss: Any, global_step: int) -> None:
        """After each step: count this rank's loss; every CHECK_EVERY steps, stop every rank together when the
        limit is reached somewhere (a FloatingPointError naming the fix)."""
        finite = math.isfinite(self.backend.scalar(loss))
        # Only what reached the weights bars checkpoints: a step the loss scaler skipped left them clean.
        self.seen = self.seen or (not finite and self.backend.last_step_applied())
        if not self.limit:
            return
        self.bad = 0 if finite else self.bad + 1
        if global_step % self.CHECK_EVERY == 0:
            # Horovod: the same decision on every rank, from the worst rank.
            over = self.backend.allreduce_sum({"over_limit": 1.0 if self.bad >= self.limit else 0.0})["over_limit"]
            if over > 0:
                raise FloatingPointError(
                    f"the training loss was NaN or infinite for at least {self.limit} steps in a row (up to step "
                    f"{global_step}); stopping. The newest checkpoint in {self.checkpoint_dir} was written "
                    f"before; lower --base-lr, use --precision fp32, or raise --max-bad-steps")

    def flag(self) -> float:
        """This rank's vote, to sum with the epoch's metrics in their allreduce (0: healthy)."""
        return float(self.seen)

    def decide(self, unhealthy_votes: float, global_step: int) -> bool:
        """The decision from the summed votes (the same sum on every rank); rank 0 says when it bars a checkpoint.
        Starts a new period."""
        healthy = unhealthy_votes == 0
        if not healthy and self.backend.rank == 0:
            print(f"hvdtrain: warning: a rank saw a non-finite training loss before step {global_step}: no "
                  f"checkpoint is written from these weights", file=sys.stderr, flush=True)
        self.seen = False
        return healthy

    def everywhere(self, global_step: int) -> bool:
        """Horovod: whether no rank has seen a non-finite loss since the last decision (one scalar allreduce, on
        every rank); the same answer everywhere."""
        votes = self.backend.allreduce_sum({"nonfinite": self.flag()})["nonfinite"]
        return self.decide(votes, global_step)
