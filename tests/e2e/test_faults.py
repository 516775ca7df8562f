"""Faults: a killed, failing or stalled rank ends the job quickly with the rank named; checkpoints survive.

Faults are injected by the tiny test recipe (tests/tiny_recipe.py: --fault raise|kill|stop|nan on --fault-rank at
--fault-step) on 2 ranks over loopback, every run under a hard timeout."""
import json
import os
import time

import numpy as np
import psutil
import pytest

from hvdtrain import checkpoint
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run

TINY = "tests.tiny_recipe:TinyTrainer"


def tiny(out, *args, np=2, timeout=120):
    start = time.monotonic()
    result = run(horovodrun(np, PY, "-m", "hvdtrain", "recipe", TINY, "--output-dir", str(out), *args),
                 timeout=timeout)
    return result, time.monotonic() - start


def leftovers(out) -> list:
    mine = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(out) in " ".join(p.info["cmdline"] or []):
                mine.append(p.pid)
        except psutil.Error:
            continue
    return mine


def test_killed_worker_ends_the_job_at_once_and_checkpoints_survive(tmp_path):
    # The stall timeout is 120 s: a job that ends within 60 s (start-up and 20 steps included; about 15 s on an idle
    # machine) was ended by the kill itself, not by a timeout.
    out = tmp_path / "run"
    result, seconds = tiny(out, "--epochs", "50", "--fault", "kill", "--fault-step", "20", "--resume", "never",
                           "--stall-timeout", "120")
    assert result.returncode != 0 and seconds < 60, describe(result)
    assert "Process 1 exit with status code 137" in result.output, describe(result)
    assert leftovers(out) == [], "no process of the job is left behind"
    newest = checkpoint.latest_valid(str(out / "checkpoints"))
    assert newest is not None and checkpoint.load(newest)["trainer"]["epoch"] >= 1


def test_failing_worker_is_reported_first_with_its_rank(tmp_path):
    out = tmp_path / "run"
    result, seconds = tiny(out, "--epochs", "50", "--fault", "raise", "--fault-step", "10", "--resume", "never")
    assert result.returncode != 0 and seconds < 60, describe(result)
    text = result.output
    # What the job guarantees: the failing rank names its own error; a rank stopped by the broken collectives names
    # it as the first failure, when it prints before the launcher ends it. The two processes' lines reach the
    # launcher's output in either order.
    assert "[rank 1] hvdtrain: error: ValueError: injected failure at batch 10" in text, describe(result)
    consequences = [line for line in text.splitlines() if "[rank 0] hvdtrain: error: " in line]
    assert all("stopped because" in line and "the first failure was on rank 1" in line for line in consequences), \
        describe(result)
    errors = out / "errors"
    rank1 = (errors / "rank-1.txt").read_text()
    assert json.loads(rank1.splitlines()[0])["error"] == "ValueError: injected failure at batch 10"
    assert "Traceback" in rank1 and (errors / "rank-0.txt").exists()


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_native_crash_ends_the_job_with_the_rank_and_its_python_stack(framework, tmp_path):
    out = tmp_path / "run"
    result, seconds = tiny(out, "--framework", framework, "--epochs", "50", "--fault", "segfault", "--fault-step", "10",
                           "--resume", "never")
    assert result.returncode != 0 and seconds < 60, describe(result)
    assert "Process 1 exit with status code 139" in result.output, describe(result)
    at = result.output.find("[1]<stderr>:Fatal Python error: Segmentation fault")
    assert at >= 0 and "tiny_recipe.py\", line" in result.output[at:] and " in __call__" in result.output[at:], \
        describe(result)
    assert leftovers(out) == []


@pytest.mark.parametrize("fault, named", [
    # a stopped process (SIGSTOP): its heartbeat goes stale, Gloo's timeout ends the collectives
    ("stop", ("stopped responding",)),
    # a live rank blocked in its own data loading for 300 s: its heartbeat stays fresh and it submits nothing; Horovod's
    # stall inspector shuts the job down (under Gloo since scripts/patch_horovod.py fix 7; before, this waited 300 s)
    ("sleep", ("fell behind: ", " in data at step ")),
])
def test_stalled_worker_is_named_instead_of_hanging(fault, named, tmp_path):
    out = tmp_path / "run"
    result, seconds = tiny(out, "--epochs", "500", "--fault", fault, "--fault-step", "30", "--fault-seconds", "300",
                           "--stall-timeout", "10", "--resume", "never")
    assert result.returncode != 0 and seconds < 60, describe(result)
    assert "rank 1" in result.output and all(n in result.output for n in named), describe(result)
    assert leftovers(out) == []


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    result, _ = tiny(out, "--epochs", "4", "--max-steps", "8", "--resume", "never")  # 4 steps an epoch: 2 epochs
    assert result.returncode == 0, describe(result)
    ck = out / "checkpoints"
    # what a SIGKILL in the middle of writing epoch 3 leaves: a temporary file, and an archive without its digest
    (ck / ".tmp-ckpt-e0003-s000000012.npz.999").write_bytes(b"partial")
    (ck / checkpoint.checkpoint_name(3, 12)).write_bytes(b"PK\x03\x04 torn")
    resumed, _ = tiny(out, "--epochs", "4")
    assert resumed.returncode == 0, describe(resumed)
    assert "removed 1 temporary file" in resumed.output
    assert "resuming from" in resumed.output and "e0002" in resumed.output
    assert [r["epoch"] for r in read_metrics(str(out))] == [1, 2, 3, 4]
    assert not any(n.startswith(".tmp-") for n in os.listdir(ck))


def test_corrupt_newest_checkpoint_falls_back_on_every_rank(tmp_path):
    out = tmp_path / "run"
    assert tiny(out, "--epochs", "5", "--max-steps", "12", "--resume", "never")[0].returncode == 0
    newest = checkpoint.latest_valid(str(out / "checkpoints"))
    data = bytearray(open(newest, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(newest, "wb").write(bytes(data))
    resumed, seconds = tiny(out, "--epochs", "5")
    assert resumed.returncode == 0, describe(resumed)
    assert f"skipping checkpoint: {newest} is corrupt" in resumed.output
    assert "e0002" in resumed.output.split("resuming from")[1].splitlines()[0]
    assert [r["epoch"] for r in read_metrics(str(out))] == [1, 2, 3, 4, 5]


def test_non_finite_loss_stops_the_job_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    result, seconds = tiny(out, "--epochs", "50", "--fault", "nan", "--fault-step", "10", "--max-bad-steps", "3",
                           "--resume", "never")
    assert result.returncode != 0 and seconds < 60, describe(result)
    assert "NaN or infinite for at least 3 steps in a row" in result.output
    newest = checkpoint.latest_valid(str(out / "checkpoints"))
    state = checkpoint.load(newest)
    assert state["trainer"]["global_step"] <= 8
    assert all(map(lambda v: bool(abs(v).max() < 1e6), state["backend"]["model"].values()))


@pytest.mark.parametrize("framework, where", [("torch", "epoch-end"), ("mxnet", "mid-epoch")])
def test_a_nan_on_another_rank_never_reaches_a_checkpoint(framework, where, tmp_path):
    # 4 steps an epoch. Rank 1 alone sees NaN inputs from the step just before a checkpoint (the last step of epoch
    # 2, or step 6 with a checkpoint every 2 steps): its NaN gradient is averaged into every rank's weights while rank
    # 0's own loss was still finite. No rank may write those weights; the newest checkpoint stays the one before.
    out = tmp_path / "run"
    extra = ["--fault-step", "8"] if where == "epoch-end" else ["--fault-step", "6", "--checkpoint-every-steps", "2"]
    result, _ = tiny(out, "--framework", framework, "--epochs", "50", "--fault", "nan", "--max-bad-steps", "3",
                     "--resume", "never", *extra)
    assert result.returncode != 0, describe(result)
    assert "NaN or infinite for at least 3 steps in a row" in result.output, describe(result)
    assert "no checkpoint is written from these weights" in result.output, describe(result)
    for path in checkpoint.list_checkpoints(str(out / "checkpoints")):
        state = checkpoint.load(path)
        assert state["trainer"]["global_step"] < int(extra[1]), path
        assert all(np.isfinite(v).all() for v in state["backend"]["model"].values()), path


FIT_FROM_PYTHON = """
import sys
from tests.tiny_recipe import TinyConfig, TinyTrainer
TinyTrainer(TinyConfig(framework=sys.argv[1], output_dir=sys.argv[2], epochs=50, fault="raise", fault_step=6,
                       resume="never")).fit()
"""


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_trainer_fit_from_python_fails_loudly_like_the_command_line(framework, tmp_path):
    # The README's subclassing path: a script that calls fit(). The failing rank names its error; the other stops
    # at once with the rank that failed; every rank records its error and stops Horovod in order.
    script = tmp_path / "train.py"
    script.write_text(FIT_FROM_PYTHON)
    out = tmp_path / "run"
    start = time.monotonic()
    result = run(horovodrun(2, PY, str(script), framework, str(out)), timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60, describe(result)
    text = result.output
    assert "[rank 1] hvdtrain: error: ValueError: injected failure at batch 6" in text, describe(result)
    assert "[rank 0] hvdtrain: error: stopped because the job's collectives failed" in text, describe(result)
    assert "the first failure was on rank 1" in text and "JobFailed" in text, describe(result)
    rank1 = json.loads((out / "errors" / "rank-1.txt").read_text().splitlines()[0])
    assert rank1["error"] == "ValueError: injected failure at batch 6" and not rank1["collective"]
    assert json.loads((out / "errors" / "rank-0.txt").read_text().splitlines()[0])["collective"]
    assert leftovers(out) == []


def test_more_ranks_than_samples_is_a_one_line_error_on_every_rank(tmp_path):
    result, seconds = tiny(tmp_path / "run", "--samples", "1")
    assert result.returncode != 0, describe(result)
    # every rank takes the same decision at start-up; horovodrun may stop the second before it prints
    assert result.output.count("fewer than --batch-size") >= 1, describe(result)
    assert "] Traceback" not in result.output, "a bad input is one line, not a traceback, on every rank"
