"""hvdtrain.tracking's pure parts: the default store, what a record becomes as MLflow metrics and params."""
import json
import os

from hvdtrain.tracking import artifact_root, default_uri, flatten, params_of


def test_the_default_store_is_beside_the_output_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = default_uri(str(tmp_path / "runs" / "job") + "/")
    assert uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert artifact_root(uri) == os.path.join(str(tmp_path), "runs", "mlartifacts")
    assert artifact_root("http://127.0.0.1:5000") is None  # a server decides
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert default_uri("runs/job") == "http://tracking:5000"  # MLflow's own variable comes first


def test_a_record_becomes_metrics_by_its_own_names():
    record = {"epoch": 2, "train_loss": 0.5, "val_mse": 0.1, "framework": "torch", "healthy": True,
              "phase_seconds": {"allreduce": 0.2, "forward": 0.1}, "thread_cpu_per_step": {"horovod": {"0": 0.01}},
              "ranks": [1, 2]}
    assert dict(flatten(record)) == {"epoch": 2.0, "train_loss": 0.5, "val_mse": 0.1,
                                     "phase_seconds.allreduce": 0.2, "phase_seconds.forward": 0.1,
                                     "thread_cpu_per_step.horovod.0": 0.01}


def test_params_are_strings_within_mlflows_limit():
    params = params_of({"optimizer": "lamb", "base_lr": 0.1, "lr_milestones": [30, 60], "note": "x" * 7000})
    assert params["optimizer"] == "lamb" and params["base_lr"] == "0.1"
    assert json.loads(params["lr_milestones"]) == [30, 60]
    assert len(params["note"]) == 6000 and params["note"].endswith("...")
