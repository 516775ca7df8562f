"""Dynamic loss scaling, framework-free: the rule of NVIDIA's AMP and torch.amp.GradScaler, for backends whose
framework has no scaler of its own that works with Horovod (MXNet's Gluon trainer).

The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not flush to zero. After the
allreduce (so that every rank looks at the same averaged gradients and takes the same decision) the backend asks
:meth:`DynamicLossScale.update` whether all gradients were finite: if not, the step is skipped and the scale halved;
after ``growth_interval`` finite steps in a row the scale doubles.
"""
from __future__ import annotations

from typing import Dict


class DynamicLossScale:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0
        """Steps skipped since the start (for logs and tests)."""

    def update(self, finite: bool) -> bool:
        """Record one step whose gradients were (all) ``finite``; True when the optimizer should apply it."""
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
