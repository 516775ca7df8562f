"""Where a run's results go: one collaborator the Trainer holds, as it holds the checkpoint policy.

- the output directory's guard (:mod:`hvdtrain.guard`: the flock that makes the directory this job's, taken by rank
  0 with every rank learning the verdict);
- an ``--output-dir`` at a URL (:mod:`hvdtrain.remote`): the local staging copy, the URL's lease and pull when the
  directory is taken, and the pusher that mirrors the staging copy to the URL after every checkpoint and at the end;
- the tracker (``--track mlflow``, :mod:`hvdtrain.tracking`), a callback whose run id rides in the checkpoints.

Its interface, in the order a run calls it: :meth:`take` (set-up, once the world is known), :meth:`push` (the run's
start and each checkpoint), :meth:`tracker` (rank 0's callbacks), :meth:`finish` and :meth:`unlock` (at the end,
failed or not). A store that fails while training is named in a warning, never a stop.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from . import guard, remote
from .basics import ConfigError, __version__, is_url


class Outputs:
    def __init__(self, output_dir: str):
        self.url = ""
        """--output-dir when it is a URL (:attr:`directory` is then its local staging copy)."""
        if output_dir.startswith("file://"):  # a local path in URL form
            output_dir = output_dir[len("file://"):]
        if is_url(output_dir):
            self.url = output_dir.rstrip("/")
            output_dir = remote.staging_dir(self.url)
        self.directory = output_dir
        """Where rank 0 writes: --output-dir, or the URL's staging copy."""
        self.remote: Optional[remote.RemoteOutput] = None
        """Rank 0 of a job with a URL --output-dir: the URL and its staging copy."""
        self._lock = None

    @property
    def location(self) -> str:
        """Where the run's outputs are for a user: the URL, else the directory."""
        return self.url or self.directory

    def check_urls(self, cfg) -> None:
        """Before Horovod starts: every URL the run reads or writes (--output-dir, --init-from, --resume) answers,
        with credentials, and what it reads exists (:func:`hvdtrain.remote.check`); one-line errors otherwise."""
        for what, url in (("--output-dir", self.url), ("--init-from", cfg.init_from), ("--resume", cfg.resume)):
            if is_url(url):
                remote.check(url, what, exists=what != "--output-dir")

    def take(self, backend, collective: bool) -> None:
        """Make the directory (and the URL's lease) this job's, or stop every rank with a ConfigError naming the
        holder (:func:`hvdtrain.guard.take_output_dir`); ``collective``: every rank learns rank 0's verdict."""
        self._lock = guard.take_output_dir(backend, self.directory, collective=collective,
                                           taken=self._took_url if self.url else None)

    def _took_url(self) -> None:
        """Rank 0, once the staging directory is locked: take the URL's lease and pull what it holds."""
        self.remote = remote.RemoteOutput(self.url, self.directory)
        try:
            self.remote.take()
            fetched = self.remote.pull()
        except ConfigError:
            self.remote = None
            raise
        except Exception as e:  # noqa: BLE001 - the store's error, as the one-line refusal of every rank
            self.remote.release()
            self.remote = None
            raise ConfigError(f"--output-dir {remote.describe_error(self.url, e)}") from None
        print(f"hvdtrain: --output-dir {self.url}: staged in {self.directory} ({fetched} file(s) fetched); pushed "
              f"after every checkpoint", flush=True)

    def push(self, final: bool = False) -> None:
        """Rank 0 of a job with a URL --output-dir: the URL gets the staging directory's new files (and loses the
        pruned ones), on the pusher thread while training goes on; ``final`` waits for it and pushes once more. A
        store that fails is named in a warning and tried again at the next push: the files stay in the staging
        directory and nothing stops training."""
        if self.remote is None:
            return
        if not final:
            self.remote.request(lambda e: self._push_failed(e, final=False))
            return
        self.remote.stop_pushing()
        try:
            self.remote.push()
            print(f"hvdtrain: {self.url} holds the run ({self.remote.uploaded} upload(s), "
                  f"{self.remote.push_seconds:.1f}s on the pusher thread and at the end)", flush=True)
        except Exception as e:  # noqa: BLE001 - the store's error in one line
            self._push_failed(e, final=True)

    def _push_failed(self, e: BaseException, final: bool) -> None:
        print(f"hvdtrain: warning: pushing to {self.url} failed ({remote.describe_error(self.url, e)})"
              + ("; the run's files are in " + self.directory if final else "; tried again at the next "
                 "checkpoint"), file=sys.stderr, flush=True)

    def tracker(self, cfg, recipe: str, backend, checkpointer) -> Any:
        """--track mlflow (rank 0): the tracking callback; its run id rides in the checkpoints, so a resume
        continues the run."""
        from .tracking import MlflowTracker, default_uri
        uri = cfg.track_uri or default_uri(self.directory)
        tags = {"recipe": recipe, "framework": backend.name, "world_size": str(backend.size),
                "precision": cfg.precision, "hvdtrain_version": __version__, "horovod_version": _version("horovod"),
                "framework_version": _version("torch" if backend.name == "torch" else "mxnet"),
                "device": str(backend.device)}

        def started(state):
            if state:  # every later checkpoint keeps the run's id (a failed open keeps the resumed one)
                checkpointer.tracking = state

        tracker = MlflowTracker(uri, cfg.track_experiment or recipe, tags, self.directory,
                                resumed=checkpointer.resumed_tracking, started=started)
        checkpointer.tracking_ready = tracker.wait_opened
        return tracker

    def finish(self) -> None:
        """The end of a run, failed or not: the last push, and the URL's lease released at once."""
        if self.remote is not None:
            self.push(final=True)
            self.remote.release()

    def unlock(self) -> None:
        """Release the directory's flock: the directory is free for the next job."""
        if self._lock is not None:
            self._lock.close()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


__all__ = ["Outputs"]
