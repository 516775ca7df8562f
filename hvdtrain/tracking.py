"""``--track mlflow``: rank 0 logs the run to MLflow as it trains, without ever making training wait for it.

What is logged (the names are the records' own, so a regression task shows ``val_mse``, a language model
``val_perplexity``):
- params: every option of the run's config (config.json), as MLflow strings;
- tags: recipe, framework, world size, precision, hvdtrain's, Horovod's and the framework's versions, the hosts;
- metrics: every number of every metrics.jsonl record at the record's global step (nested figures flattened with
  dots: ``phase_seconds.allreduce``, ``thread_cpu_per_step.horovod.0``), and the ``--log-every`` step figures as
  ``step/loss``. The record of an epoch cut short by ``--max-steps`` is not logged: metrics.jsonl replaces it with
  the whole epoch's when the job resumes, and that one is logged (MLflow cannot take a point back). An epoch trained
  twice (a kill between its record and its checkpoint, or ``--resume PATH`` from an older checkpoint) is logged
  twice, at the same step;
- artifacts at the end: config.json, metrics.jsonl and best/ (the best checkpoint, with --monitor).

The tracking URI is ``--track-uri``, else MLflow's own ``MLFLOW_TRACKING_URI``, else a SQLite store beside the
output directory: ``sqlite:///PARENT/mlflow.db`` with artifacts in ``PARENT/mlartifacts`` (``mlflow ui
--backend-store-uri sqlite:///PARENT/mlflow.db`` opens it). The run's id rides in every checkpoint, so a resumed job
continues its MLflow run; ``--resume never`` starts a new one.

The training thread only queues; one thread of rank 0 talks to MLflow, its start included (a checkpoint waits for
the run to be open, so that it names it). When the store cannot be reached (at the
start, or mid-run), one warning says so, training goes on, the records stay in metrics.jsonl, and the end of the run
says how many were not logged. MLflow's HTTP client would retry a dead server for minutes: its retries and timeout
are lowered here unless the user set them.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .callbacks import Callback

NOT_NUMBERS = ("epoch_seconds",)
PARAM_LIMIT = 6000  # MLflow's longest param value
BATCH = 100  # MLflow's most params (and a comfortable number of metrics) per log_batch call
JOIN_SECONDS = 60.0  # what the end of the run waits for the queue to drain
OPEN_SECONDS = 30.0  # what a checkpoint waits for the run to be open


def default_uri(output_dir: str) -> str:
    """MLflow's own ``MLFLOW_TRACKING_URI`` if set, else a SQLite store in the output directory's parent."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if env:
        return env
    parent = os.path.dirname(os.path.abspath(output_dir.rstrip("/")))
    return "sqlite:///" + os.path.join(parent, "mlflow.db")


def artifact_root(uri: str) -> Optional[str]:
    """Where a new experiment of a local SQLite store keeps its artifacts (beside the database, not in the current
    directory, MLflow's default); None for a server, which decides."""
    if uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(uri[len("sqlite:///"):]), "mlartifacts")
    return None


def flatten(record: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, float]]:
    """(name, value) for every number in a record, nested dicts joined with dots; booleans, strings, lists skipped."""
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, name + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, float(value)


def params_of(config: Dict[str, Any]) -> Dict[str, str]:
    out = {}
    for key, value in config.items():
        text = value if isinstance(value, str) else json.dumps(value)
        out[key] = text if len(text) <= PARAM_LIMIT else text[:PARAM_LIMIT - 3] + "..."
    return out


def _quiet_http() -> None:
    """A dead server answers at once (refused) or never: a few seconds, not MLflow's minutes of retries."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class MlflowTracker(Callback):
    """Rank 0's callback for ``--track mlflow`` (module docstring). ``resumed`` is the checkpoint's tracking state
    ({"mlflow_run_id": ...}) when the job resumed; :meth:`state` is what the next checkpoint keeps."""

    def __init__(self, uri: str, experiment: str, tags: Dict[str, str], output_dir: str,
                 resumed: Optional[Dict[str, Any]] = None,
                 started: Optional[Callable[[Optional[Dict[str, Any]]], None]] = None):
        self.uri, self.experiment, self.tags = uri, experiment, tags
        self.output_dir, self.resumed, self.started = output_dir, resumed or {}, started
        self.config: Dict[str, Any] = {}
        self.run_id: Optional[str] = None
        self.client = None
        self.failed: Optional[str] = None  # the first error; nothing is sent after it
        self.unlogged = 0  # records (and step figures) that did not reach MLflow
        self._opened = threading.Event()  # the run is open (or its opening failed)
        self._queue: "queue.Queue[Optional[Tuple[str, Any]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def state(self) -> Optional[Dict[str, Any]]:
        return {"mlflow_run_id": self.run_id, "uri": self.uri} if self.run_id else None

    # --- the training thread only queues; even the start (importing MLflow, creating a SQLite store's tables: 3-5 s
    # here) runs on the tracker's thread, since every other rank would wait for rank 0 at the first allreduce ------
    def on_train_start(self, trainer, start_epoch):
        _quiet_http()
        path = os.path.join(self.output_dir, "config.json")  # the resolved configuration (report.announce)
        if os.path.exists(path):
            with open(path) as f:
                self.config = json.load(f)
        self._queue.put(("open", start_epoch))
        self._thread = threading.Thread(target=self._drain, name="hvdtrain-mlflow", daemon=True)
        self._thread.start()

    def wait_opened(self, seconds: float = OPEN_SECONDS) -> None:
        """Before a checkpoint: the run's id must be in it (a job stopped within its first seconds would otherwise
        resume into a new run). Waits at most ``seconds``, then goes on without it."""
        if self._thread is not None and not self._opened.wait(seconds):
            print(f"hvdtrain: warning: mlflow: the run is not open after {seconds:.0f} s; this checkpoint does not "
                  f"name it", file=sys.stderr, flush=True)

    def on_log(self, trainer, global_step, metrics):
        self._put("metrics", ({f"step/{k}": float(v) for k, v in metrics.items()}, global_step))

    def on_epoch_end(self, trainer, record):
        if trainer.position.offset:  # an epoch cut short (--max-steps): the run that resumes it logs it whole
            return
        self._put("metrics", (dict(flatten({k: v for k, v in record.items() if k not in ("global_step",)})),
                              int(record.get("global_step", 0))))

    def on_train_end(self, trainer, last):
        self._put("end", "FINISHED")  # (a failed job never gets here: its run stays RUNNING, and a resume continues it)
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(JOIN_SECONDS)
            if self._thread.is_alive():
                self._fail(TimeoutError(f"MLflow took over {JOIN_SECONDS:.0f} s for the run's last records"), "")
        self._summary()

    def _put(self, kind: str, payload: Any) -> None:
        if self._thread is None or self.failed:
            self.unlogged += kind == "metrics"
            return
        self._queue.put((kind, payload))

    # --- MLflow ---------------------------------------------------------------------------------------------------
    def _open(self, start_epoch: int) -> None:
        from mlflow.tracking import MlflowClient
        self.client = client = MlflowClient(tracking_uri=self.uri)
        run_id = self.resumed.get("mlflow_run_id") if start_epoch > 0 or self.resumed else None
        if run_id:
            try:
                client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
                print(f"hvdtrain: mlflow: continuing run {run_id} in {self.uri}", file=sys.stderr, flush=True)
                return
            except Exception as e:  # noqa: BLE001 - another store, or a deleted run: a new run, said so
                print(f"hvdtrain: warning: mlflow: the checkpoint's run {run_id} is not in {self.uri} ({_short(e)}); "
                      f"starting a new run", file=sys.stderr, flush=True)
        experiment = client.get_experiment_by_name(self.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None else
                         client.create_experiment(self.experiment, artifact_location=_as_uri(artifact_root(self.uri))))
        run = client.create_run(experiment_id, tags={"mlflow.runName": os.path.basename(
            os.path.abspath(self.output_dir.rstrip("/"))), **self.tags})
        self.run_id = run.info.run_id
        from mlflow.entities import Param
        params = [Param(k, v) for k, v in params_of(self.config).items()]
        for i in range(0, len(params), BATCH):
            client.log_batch(self.run_id, params=params[i:i + BATCH])
        print(f"hvdtrain: mlflow: run {self.run_id} in {self.uri} (experiment {self.experiment})", file=sys.stderr,
              flush=True)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload = item
            if self.failed:
                self.unlogged += kind == "metrics"
                continue
            try:
                if kind == "open":
                    try:
                        self._open(payload)
                    finally:  # the run's id (or None) into the checkpoints from now on
                        if self.started is not None:
                            self.started(self.state())
                        self._opened.set()
                elif kind == "metrics":
                    from mlflow.entities import Metric
                    values, step = payload
                    stamp = int(time.time() * 1000)
                    metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
                    for i in range(0, len(metrics), BATCH):
                        self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH])
                elif kind == "end":
                    for name in ("config.json", "metrics.jsonl"):
                        path = os.path.join(self.output_dir, name)
                        if os.path.exists(path):
                            self.client.log_artifact(self.run_id, path)
                    best = os.path.join(self.output_dir, "best")
                    if os.path.isdir(best) and os.listdir(best):
                        self.client.log_artifacts(self.run_id, best, artifact_path="best")
                    self.client.set_terminated(self.run_id, status=payload)
            except Exception as e:  # noqa: BLE001 - the store went away: say it once, keep training
                self.unlogged += kind == "metrics"
                self._fail(e, "at the start" if kind == "open" else "mid-run")

    def _fail(self, error: BaseException, when: str) -> None:
        if self.failed:
            return
        self.failed = _short(error)
        print(f"hvdtrain: warning: mlflow: {self.uri} failed{' ' + when if when else ''} ({self.failed}); training "
              f"goes on, the records stay in metrics.jsonl", file=sys.stderr, flush=True)

    def _summary(self) -> None:
        if self.failed:
            print(f"hvdtrain: mlflow: {self.unlogged} record(s) not logged to {self.uri} after: {self.failed}; they are "
                  f"in {os.path.join(self.output_dir, 'metrics.jsonl')}", file=sys.stderr, flush=True)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _as_uri(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    return "file://" + path


def list_runs(uri: str) -> List[str]:
    """``report --mlflow URI``: one line per run of the store, newest first: experiment, run id, status, recipe,
    framework, world size, last val_* figures."""
    _quiet_http()
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    lines = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"]):
            tags, metrics = run.data.tags, run.data.metrics
            figures = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("val_"))
            lines.append(f"{experiment.name}  {run.info.run_id}  {run.info.status:<8}  "
                         f"{tags.get('recipe', '?')} on {tags.get('framework', '?')} x{tags.get('world_size', '?')}  "
                         f"{tags.get('mlflow.runName', '')}  {figures}")
    return lines
