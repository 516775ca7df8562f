"""MNIST-format digits on 2 workers: accuracy, the same job under both launchers, and PyTorch/MXNet parity."""
import json
import os

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, have_mpirun, horovodrun, mpirun, run

RESULTS = {}
"""framework -> (output directory, stdout, records) of the 20-epoch horovodrun run, trained once per session by
whichever test needs it first (pytest-xdist does not keep a file's order)."""


def train(launcher, framework, digits, out, *extra):
    cmd = [PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", framework, "--data-dir", digits,
           "--output-dir", out, "--resume", "never", *extra]
    wrap = {"horovodrun": lambda c: horovodrun(2, *c), "mpirun": lambda c: mpirun(2, *c)}[launcher]
    result = run(wrap(cmd), timeout=300)
    assert result.returncode == 0, describe(result)
    return result


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_mnist_reaches_97_percent_on_2_workers(framework, digits, tmp_path_factory):
    out, stdout, records = horovodrun_run(framework, digits, tmp_path_factory)
    last = records[-1]
    assert [r["epoch"] for r in records] == list(range(1, 21))
    assert last["world_size"] == 2 and last["framework"] == framework
    assert last["val_accuracy"] >= 0.97, f"{framework}: {last}"
    for key in ("train_loss", "val_loss", "val_accuracy", "images_per_sec", "epoch_seconds", "lr"):
        assert isinstance(last[key], float), key
    cpu = last["cpu_seconds_per_step"]  # each rank's process CPU time per training step, by rank
    assert len(cpu) == 2 and all(0 < c <= os.cpu_count() * last["epoch_seconds"] / 22 for c in cpu), cpu
    # and by thread: the compute (PyTorch's training thread, MXNet's engine threads) does most of it; Horovod's
    # background thread and Gloo's exist and work
    threads = last["thread_cpu_per_step"]
    assert list(threads) == ["main", "horovod", "transport", "framework", "python", "ended"], threads
    for rank in range(2):
        assert sum(t[rank] for t in threads.values()) == pytest.approx(cpu[rank], abs=0.02), (rank, threads, cpu)
        compute = threads["main"][rank] + threads["framework"][rank]
        assert compute > threads["horovod"][rank] > 0 and threads["transport"][rank] > 0, threads
    check_config(out, framework, digits, records)
    scalars = tensorboard_scalars(os.path.join(out, "tensorboard"))
    assert [step for step, _ in scalars["epoch/val_accuracy"]] == list(range(1, 21))
    assert scalars["epoch/val_accuracy"][-1][1] == pytest.approx(last["val_accuracy"], rel=1e-6)
    assert scalars["epoch/lr"][-1][1] == pytest.approx(last["lr"], rel=1e-6)
    assert "metrics.jsonl" in stdout, "the run ends by saying where the metrics are"


def check_config(out, framework, digits, records):
    with open(os.path.join(out, "config.json")) as f:
        resolved = json.load(f)
    assert resolved["world_size"] == 2 and resolved["framework"] == framework and resolved["recipe"] == "mnist"
    assert resolved["global_batch"] == 2 * resolved["batch_size"] == 64 and resolved["threads_per_rank"] == 1
    assert resolved["steps_per_epoch"] == records[0]["global_step"] == 22 and resolved["data_dir"] == digits
    # the gradients in groups (the CPU's default), each queued whole: Horovod negotiates it at once
    assert resolved["horovod_idle_wait"] == "2", resolved
    # glibc's malloc keeps what a step frees (no page faults to take it again)
    assert resolved["malloc"].startswith("trim threshold"), resolved


def horovodrun_run(framework, digits, tmp_path_factory):
    """The recipe's 20-epoch run under horovodrun: (output directory, stdout, records)."""
    if framework not in RESULTS:
        out = str(tmp_path_factory.mktemp(f"horovodrun-{framework}") / "run")
        result = train("horovodrun", framework, digits, out)
        RESULTS[framework] = out, result.stdout, read_metrics(out)
    return RESULTS[framework]


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_mpirun_trains_the_same_job_as_horovodrun(framework, digits, tmp_path, tmp_path_factory):
    """Under mpirun (Horovod's MPI controller and MPI's allreduce) the same job computes the same numbers as under
    horovodrun --gloo: the first 3 of the 20 epochs (--max-steps keeps the 20-epoch schedule) give the same losses and
    accuracy. With 2 ranks every sum is a + b, whichever library adds."""
    if not have_mpirun():
        pytest.skip("mpirun not installed")
    out = str(tmp_path / "run")
    train("mpirun", framework, digits, out, "--max-steps", str(3 * 22))
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2, 3] and records[-1]["world_size"] == 2
    check_config(out, framework, digits, records)
    reference = horovodrun_run(framework, digits, tmp_path_factory)[2][:3]
    for got, want in zip(records, reference):
        for key in ("train_loss", "val_loss", "val_accuracy", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (got["epoch"], key, got, want)


def tensorboard_scalars(logdir: str) -> dict:
    """Every scalar in the event files of ``logdir``: tag -> [(step, value)] in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray
    out = {}
    for name in sorted(os.listdir(logdir)):
        for event in EventFileLoader(os.path.join(logdir, name)).Load():  # scalars arrive as tensors (migrated)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, float(make_ndarray(value.tensor))))
    return out


def test_frameworks_agree_within_one_and_a_half_points(digits, tmp_path_factory):
    acc = {fw: horovodrun_run(fw, digits, tmp_path_factory)[2][-1]["val_accuracy"] for fw in ("torch", "mxnet")}
    assert abs(acc["torch"] - acc["mxnet"]) <= 0.015, acc


def test_the_mnist_models_cross_frameworks_and_export_to_onnx(digits, tmp_path):
    # The two frameworks' models name their parameters alike: a PyTorch run exports to MXNet, an MXNet run to ONNX
    # (through its PyTorch twin), each computing the trained logits.
    for framework, fmt, target in (("torch", "native", "mxnet"), ("mxnet", "onnx", "torch")):
        out = str(tmp_path / framework)
        result = run([PY, "-m", "hvdtrain", "recipe", "mnist", "--framework", framework, "--data-dir", digits,
                      "--output-dir", out, "--epochs", "1", "--max-steps", "10"], timeout=300)
        assert result.returncode == 0, describe(result)
        exported = run([PY, "-m", "hvdtrain", "export", out, "--format", fmt, "--framework", target,
                        "--data-dir", digits], timeout=300)
        assert exported.returncode == 0, describe(exported)
        meta_dir = os.path.join(out, "export-onnx" if fmt == "onnx" else f"export-native-{target}")
        with open(os.path.join(meta_dir, "model.json")) as f:
            meta = json.load(f)
        assert meta["max_abs_diff"] < 1e-4 * max(1.0, meta["logit_scale"]), meta
