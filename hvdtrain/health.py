"""The non-finite-loss guard of a run: one collaborator the Trainer's loop calls, on every rank.

Two questions, each answered alike on every rank:

- Stop? A rank counts its consecutive non-finite training losses; every :attr:`Health.CHECK_EVERY` steps the ranks
  decide together (one tiny allreduce; one per step cost ~15%) and the job stops once any rank has seen
  ``--max-bad-steps`` in a row. The decision's allreduce is started at that step and read at the next (or at the
  end of the epoch, :meth:`Health.conclude`): it queues behind the step's gradients, and waiting for it at once held
  the next step back until they had all arrived, which with ``--overlap-forward`` is the second half's transfer that
  the next forward pass overlaps.
- May a checkpoint be written from these weights? Not when a non-finite loss reached the weights on any rank since
  the last decision (its gradients were averaged into every rank's weights). The vote rides on the epoch's metric
  allreduce (:meth:`Health.flag` / :meth:`Health.decide`), or takes one scalar allreduce of its own before a
  mid-epoch checkpoint (:meth:`Health.everywhere`). A step the loss scaler skipped left the weights clean: it bars
  nothing.

And one warning, on rank 0 from its own losses, with no collective: a finite training loss that climbs well above
where the run began (the mean of :attr:`Health.WINDOW` consecutive steps more than :attr:`Health.RISE` times the
loss of this process's first step) is what a rate too high for the optimizer does; it is said once, naming the
optimizer and the rate, long before the epoch's record would show it. (AdamW at SGD's rate on the MNIST recipe: the
loss went from 2.3 at the first step to a mean of 11 over the first 10, then sat at chance.) Only a run that starts
from fresh weights is watched: a resumed run's or an --init-from run's first step is one noisy sample of an already
low loss, no reference to measure a rise against.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple


class Health:
    CHECK_EVERY = 10
    """Steps between the collective decisions of the stop rule."""

    WINDOW = 10
    """Steps per mean of the rising-loss warning."""
    RISE = 1.5
    """The rising-loss warning: a window's mean above this multiple of the first step's loss."""

    def __init__(self, backend, max_bad_steps: int, checkpoint_dir: str, cfg=None):
        self.backend, self.limit, self.checkpoint_dir = backend, max_bad_steps, checkpoint_dir
        self.cfg = cfg
        self.first: Optional[float] = None
        """Rank 0: the training loss of this process's first finite step."""
        self.window: List[float] = []
        self.warned = cfg is None or backend.rank != 0
        self.seen = False
        """This rank saw a non-finite training loss that reached the weights since the last decision."""
        self.bad = 0
        """This rank's non-finite training losses in a row."""
        self.pending: Optional[Tuple[int, Callable[[], Dict[str, float]]]] = None
        """The stop rule's decision in flight: (its step, the wait for its sum)."""

    def observe(self, loss: Any, global_step: int, lr: float = 0.0) -> None:
        """After each step: count this rank's loss; every CHECK_EVERY steps, start the decision of every rank
        together, and at the next step stop them all when the limit was reached somewhere (a FloatingPointError
        naming the fix). Rank 0 warns once of a rising loss."""
        self.conclude()
        value = self.backend.scalar(loss)
        finite = math.isfinite(value)
        if finite and not self.warned:
            self._watch_rise(value, global_step, lr)
        # Only what reached the weights bars checkpoints: a step the loss scaler skipped left them clean.
        self.seen = self.seen or (not finite and self.backend.last_step_applied())
        if not self.limit:
            return
        self.bad = 0 if finite else self.bad + 1
        if global_step % self.CHECK_EVERY == 0:
            # Horovod: the same decision on every rank, from the worst rank; read at the next step (conclude).
            wait = self.backend.allreduce_sum_start({"over_limit": 1.0 if self.bad >= self.limit else 0.0},
                                                    "stoprule")
            self.pending = (global_step, wait)

    def conclude(self) -> None:
        """Wait for the stop rule's decision in flight, if any (every rank calls it at the same step: the next
        :meth:`observe`, the end of an epoch); raise when some rank was over the limit."""
        if self.pending is None:
            return
        (step, wait), self.pending = self.pending, None
        if wait()["over_limit"] > 0:
            raise FloatingPointError(
                f"the training loss was NaN or infinite for at least {self.limit} steps in a row (up to step "
                f"{step}); stopping. The newest checkpoint in {self.checkpoint_dir} was written "
                f"before; lower --base-lr, use --precision fp32, or raise --max-bad-steps")

    def _watch_rise(self, loss: float, global_step: int, lr: float) -> None:
        if self.first is None:
            if global_step != 1 or self.cfg.init_from:  # resumed, or trained weights: nothing to compare with
                self.warned = True
                return
            self.first = loss
        self.window.append(loss)
        if len(self.window) < self.WINDOW:
            return
        mean, self.window = sum(self.window) / len(self.window), []
        if self.first > 0 and mean > self.RISE * self.first:
            self.warned = True
            cfg = self.cfg
            own = cfg.optimizer_base_lr()
            hint = (f"lower --base-lr, or leave it out for this recipe's {cfg.optimizer} rate, {own:g}"
                    if cfg.base_lr != own else "lower --base-lr")
            print(f"hvdtrain: warning: the training loss rose from {self.first:.4g} (the first step's) to "
                  f"{mean:.4g} (the mean of steps {global_step - self.WINDOW + 1}-{global_step}) with --optimizer "
                  f"{cfg.optimizer} at lr {lr:g} (base {cfg.base_lr:g}, {cfg.base_lr_reason()}): the rate may be too "
                  f"high for this optimizer; {hint}", file=sys.stderr, flush=True)

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
