"""``--timeline-steps A:B``: Horovod's timeline recorded for a window of global steps, on every rank."""
from __future__ import annotations

import os


class TimelineWindow:
    """Starts Horovod's timeline before global step A and stops it after step B (or at the end of training)."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend = cfg, backend
        self.state = "off"  # then the file being written, then "done"

    def before_step(self, step: int) -> None:
        """Before global step ``step`` (counted from 1)."""
        window = self.cfg.timeline_window()
        if window is None or self.state != "off" or not window[0] <= step <= window[1]:
            return
        path = self.cfg.timeline_file or os.path.join(self.cfg.output_dir, "timeline.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.backend.start_timeline(path)
        self.state = path

    def after_step(self, step: int, end: bool = False) -> None:
        """After global step ``step``; ``end``: training is over."""
        window = self.cfg.timeline_window()
        if window is None or self.state in ("off", "done") or not (step >= window[1] or end):
            return
        self.backend.stop_timeline()
        if self.backend.rank == 0:
            print(f"hvdtrain: Horovod timeline of steps {window[0]}..{min(window[1], step)} written to "
                  f"{self.state} (open it in chrome://tracing or ui.perfetto.dev)", flush=True)
        self.state = "done"
