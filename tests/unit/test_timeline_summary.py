"""timeline.summarize_transfers: transfers timed outside Horovod (bench network's DDP buckets) in the summary that
Horovod's timeline gets, the link's busy time the union of overlapping transfers."""
import pytest

from hvdtrain.timeline import describe_summary, summarize_transfers


def test_transfers_timed_elsewhere_are_summarized_as_horovods_timeline_is():
    runs = [("ddp bucket 0", 2, 10.0, 10.3), ("ddp bucket 1", 1, 10.2, 10.5), ("ddp bucket 0", 2, 11.0, 11.4)]
    summary = summarize_transfers(runs, steps=2)
    assert summary["window_seconds"] == pytest.approx(1.4)
    # 10.0-10.5 (the two buckets overlap) and 11.0-11.4: 0.9 s busy, 0.45 a step, of a window of 1.4 s
    assert summary["transfer_busy_seconds_per_step"] == pytest.approx(0.45)
    assert summary["transfer_busy_fraction"] == pytest.approx(0.9 / 1.4)
    first = summary["collectives"]["ddp bucket 0"]
    assert first["tensors"] == 2 and first["runs"] == 2 and first["transfer"] == pytest.approx(0.35)
    lines = describe_summary(summary, "its timed")
    assert lines[0] == "its timed 2 steps (1.40 s): the link carried transfers 450.0 ms a step, 64% of the window"
    assert lines[1] == "ddp bucket 0 (2 tensors): 2 run(s), medians: transfer 350.0 ms"
    empty = summarize_transfers([], steps=3)
    assert empty["window_seconds"] == 0 and empty["collectives"] == {} and empty["transfer_busy_fraction"] == 0
