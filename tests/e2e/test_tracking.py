"""--track mlflow under horovodrun at np=2 (issue 49): rank 0 logs params, tags and every record of metrics.jsonl to
MLflow's SQLite store beside the output directory, read back through MlflowClient; a stopped and resumed job continues
its MLflow run, --resume never starts another; a tracking server (``mlflow server`` on the loopback) killed mid-run
leaves training running to the end, with one warning and the count of what was not logged."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import PY, answers, describe, free_port, horovodrun, run

pytest.importorskip("mlflow")
RECIPE = [PY, "-m", "hvdtrain", "recipe", "tests.tiny_recipe:TinyTrainer"]


def train(framework, out, *extra, timeout=240):
    result = run(horovodrun(2, *RECIPE, "--framework", framework, "--epochs", "3", "--track", "mlflow",
                            "--output-dir", str(out), *extra), timeout=timeout)
    assert result.returncode == 0, describe(result)
    return result


def runs_of(uri):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny")  # the recipe's name (beside MLflow's "Default")
    if experiment is None:  # (not yet: the tracker opens its run on a thread of its own)
        return client, []
    return client, client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


def assert_logged(client, run, out):
    """Every number of every record at the record's global step, and config.json as the params."""
    records = read_metrics(str(out))
    for key in ("train_loss", "val_loss", "val_accuracy", "samples_per_sec", "epoch"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == {r["global_step"]: pytest.approx(r[key]) for r in records}, key
    assert client.get_metric_history(run.info.run_id, "phase_seconds.allreduce")
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert run.data.params["optimizer"] == config["optimizer"] and run.data.params["world_size"] == "2"
    assert run.data.params["base_lr"] == json.dumps(config["base_lr"])


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_stopped_and_resumed_job_continues_its_mlflow_run(framework, tmp_path):
    out = tmp_path / "job"
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # the default: beside the output directory
    first = train(framework, out, "--max-steps", "6")  # 4 steps per epoch: stopped in epoch 2
    assert f"mlflow: run " in first.output and uri in first.output, describe(first)
    resumed = train(framework, out)
    assert "mlflow: continuing run" in resumed.output, describe(resumed)
    client, runs = runs_of(uri)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    (one,) = runs
    assert one.info.status == "FINISHED"
    assert one.data.tags["recipe"] == "tiny" and one.data.tags["framework"] == framework
    assert one.data.tags["world_size"] == "2" and one.data.tags["horovod_version"] == "0.28.1"
    assert_logged(client, one, out)
    artifacts = {a.path for a in client.list_artifacts(one.info.run_id)}
    assert {"config.json", "metrics.jsonl"} <= artifacts, artifacts
    assert os.path.isdir(tmp_path / "mlartifacts"), "artifacts beside the store, not in the current directory"
    if framework == "torch":  # --resume never: a new run; report lists both
        train(framework, out, "--resume", "never", "--epochs", "1")
        _, runs = runs_of(uri)
        assert len(runs) == 2
        listed = run([PY, "-m", "hvdtrain", "report", "--mlflow", uri], timeout=120)
        assert listed.returncode == 0 and listed.stdout.count("tiny on torch x2") == 2, describe(listed)



def _wait_for(predicate, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")



def _logged(uri) -> bool:
    client, runs = runs_of(uri)
    return bool(runs) and bool(client.get_metric_history(runs[0].info.run_id, "train_loss"))


def test_a_tracking_server_killed_mid_run_leaves_training_running(tmp_path):
    port, store = free_port(), f"sqlite:///{tmp_path}/server.db"
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    server = subprocess.Popen([mlflow, "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port",
                               str(port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    out = tmp_path / "job"
    try:
        _wait_for(lambda: answers(port), 120, "mlflow server")
        # 0.5 s per step, 4 steps per epoch: the server goes after the first record, with 2 epochs to go
        cmd = horovodrun(2, *RECIPE, "--framework", "torch", "--epochs", "3", "--track", "mlflow", "--track-uri",
                         f"http://127.0.0.1:{port}", "--step-sleep", "0.5", "--output-dir", str(out))
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(lambda: len(read_metrics(str(out))) >= 1 if (out / "metrics.jsonl").exists() else False, 180,
                  "the first record")
        _wait_for(lambda: _logged(f"http://127.0.0.1:{port}"), 60, "the first record on the server")
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        output, _ = job.communicate(timeout=240)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    assert job.returncode == 0, output[-3000:]
    assert len(read_metrics(str(out))) == 3, output[-3000:]
    assert output.count("hvdtrain: warning: mlflow:") == 1, output[-3000:]  # one warning, on rank 0
    assert "record(s) not logged" in output and "they are in" in output, output[-3000:]
    # what reached the server before it died is in its store
    client, (one,) = runs_of(store)
    history = client.get_metric_history(one.info.run_id, "train_loss")
    assert [m.step for m in history] == [read_metrics(str(out))[0]["global_step"]]
