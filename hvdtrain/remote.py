"""Outputs and inputs at a URL: ``--output-dir s3://bucket/prefix`` (or any protocol fsspec has installed), and
``--resume``, ``--init-from``, ``eval`` and ``export`` reading from one.

A job whose output directory is a URL works in a local staging directory (:func:`staging_dir`: per host, under
``HVDTRAIN_STAGING`` or ``~/.cache/hvdtrain/outputs``) exactly as in a local one, and :class:`RemoteOutput` keeps the
URL a copy of it:

- at the start (rank 0, before anything is read or written) it takes the URL's lease and pulls what the URL holds
  (checkpoints, best/, metrics.jsonl, config.json, TensorBoard events...) into the staging directory, which then
  holds the URL's files and no others: the URL, not the host's disk, is the run;
- after every checkpoint write and at the start it pushes, on a thread of its own while training goes on (an
  upload slower than ``--stall-timeout`` must not stop the job), and at the end once more, waited for: new and
  changed files first, each checkpoint's archive before its ``.sha256`` digest, then the deletions (pruned
  checkpoints, each digest before its archive). Object stores have no rename, but one object's PUT is atomic: a job
  killed at any point leaves every checkpoint at the URL either whole with its digest, or without a digest (and a
  reader trusts only checkpoints whose digest matches, :func:`hvdtrain.checkpoint.read_verified`).
- TensorBoard's event files are written locally and uploaded at those pushes (epoch ends), not streamed.
- Heartbeats, error records, the compile cache and the local lock stay on the host.

The job-ownership guard of a local directory (``guard.lock_output_dir``) becomes a lease: an object
``.hvdtrain.lease`` naming the job (host, pid, a random token), renewed every :data:`RENEW_SECONDS` by rank 0 and
marked done at the end. A second job aimed at the URL while a lease younger than :data:`LEASE_SECONDS` is not done is
refused with its holder; a job killed without ending holds the URL until its lease ages, unless the next job runs
on the host the killed one ran on, which sees that its process is gone. Two jobs that start within
the same second can both pass the check: each writes its token and reads it back after a pause, and the one that
reads another's token refuses itself. Clocks of the hosts are compared (the lease's own time): keep them in sync.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import secrets
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .basics import ConfigError, is_url, job_label

LEASE_NAME = ".hvdtrain.lease"
LEASE_SECONDS = 60.0
"""A lease renewed less than this long ago (and not done) marks a job that still runs."""
RENEW_SECONDS = 10.0
LOCAL_ONLY = ("heartbeats", "errors", "compile-cache", ".hvdtrain.lock", LEASE_NAME)
"""Top-level entries of an output directory that stay on the host (never pulled, pushed or deleted)."""
_TMP = ".tmp-"


def _cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "hvdtrain")


def _local_name(url: str) -> str:
    proto, _, rest = url.partition("://")
    safe = [p for p in rest.strip("/").split("/") if p not in ("", ".", "..")]
    return os.path.join(proto, *safe)


def staging_dir(url: str) -> str:
    """The local directory a job with ``--output-dir url`` works in on this host."""
    root = os.environ.get("HVDTRAIN_STAGING") or os.path.join(_cache_root(), "outputs")
    return os.path.abspath(os.path.join(root, _local_name(url)))


def filesystem(url: str):
    """(fsspec filesystem, path inside it) of ``url``; ConfigError naming what to install or fix."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(f"{url} is a URL, and reading or writing URLs needs fsspec: pip install 'hvdtrain[remote]' "
                          f"(or make install)") from None
    proto = url.partition("://")[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ConfigError(f"{url}: the {proto}:// protocol's fsspec package is not installed ({e}); for s3:// "
                          f"pip install s3fs (make install does)") from None
    except ValueError as e:
        raise ConfigError(f"{url} is not a URL fsspec knows ({e}): use s3://bucket/prefix or another installed "
                          f"protocol") from None
    return fs, path.rstrip("/")


def describe_error(url: str, e: BaseException) -> str:
    """One line for an error of the store at ``url``: missing credentials, a missing bucket, refused access."""
    name = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else name
    if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
        return (f"{url}: no credentials for the object store ({text}): set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for a store other than AWS")
    if isinstance(e, FileNotFoundError) or "NoSuchBucket" in text or "does not exist" in text:
        bucket = url.partition("://")[2].split("/")[0]
        return f"{url}: bucket {bucket} does not exist ({text}): create it, or correct the URL"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return f"{url}: access denied ({text}): the credentials may not read or write there"
    if "Could not connect" in text or "Connect" in name or "EndpointConnection" in name:
        return f"{url}: cannot reach the object store ({text}): check AWS_ENDPOINT_URL and the network"
    return f"{url}: {name}: {text}"


def check(url: str, what: str = "--output-dir", exists: bool = False) -> None:
    """Before Horovod starts: the URL's store answers, the credentials work and the bucket exists (and, with
    ``exists``, the object or prefix itself); ConfigError in one line otherwise."""
    fs, path = filesystem(url)
    bucket = path.split("/")[0]
    try:
        fs.invalidate_cache()
        fs.ls(bucket, detail=False)  # raises for missing credentials, a missing bucket, refused access
        if exists and not fs.exists(path):
            raise ConfigError(f"{what} {url} does not exist")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's own error, named in one line
        raise ConfigError(f"{what} " + describe_error(url, e)) from None


def _rel(path: str, root: str) -> str:
    return posixpath.relpath(path, root) if path != root else ""


def _local_only(rel: str) -> bool:
    top = rel.split("/")[0]
    return top in LOCAL_ONLY or posixpath.basename(rel).startswith(_TMP)


def _remote_files(fs, root: str) -> Dict[str, int]:
    """Relative path -> size of every object under ``root`` (none when it does not exist yet)."""
    fs.invalidate_cache()
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {_rel(p, root): int(info.get("size") or 0) for p, info in found.items()
            if info.get("type", "file") == "file" and _rel(p, root)}


def _local_files(local: str) -> Dict[str, Tuple[int, int]]:
    out = {}
    for directory, dirs, files in os.walk(local):
        rel_dir = os.path.relpath(directory, local).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if rel_dir and _local_only(rel_dir):
            dirs[:] = []
            continue
        for name in files:
            rel = posixpath.join(rel_dir, name) if rel_dir else name
            if not _local_only(rel):
                st = os.stat(os.path.join(directory, name))
                out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def _download(fs, remote: str, target: str) -> None:
    """Copy one object to ``target`` whole (a temporary file renamed: ranks of one host may fetch the same file)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = os.path.join(os.path.dirname(target), f"{_TMP}{os.path.basename(target)}.{os.getpid()}")
    try:
        fs.get_file(remote, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _digest_last(rel: str) -> Tuple[int, str]:
    """Upload order: a checkpoint's digest after every archive (and so after its own)."""
    return (1 if rel.endswith(".sha256") else 0, rel)


def _same_digest(fs, remote: str, local: str) -> bool:
    """True when the local checkpoint ``local`` has the digest the store's ``remote.sha256`` names."""
    try:
        expected = fs.cat_file(remote + ".sha256").split()[0].decode()
        with open(local, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest() == expected and os.path.isfile(local + ".sha256")
    except (OSError, IndexError, UnicodeDecodeError):
        return False


def pull(fs, root: str, local: str) -> int:
    """Make directory ``local`` hold what ``root`` in ``fs`` holds (the host-only entries aside): files missing
    or of another size are fetched, small ones (under 1 MiB) always, a checkpoint whose digest differs too; local
    files the store does not hold are removed. Returns the files fetched."""
    remote = _remote_files(fs, root)
    present = _local_files(local)
    fetched = 0
    for rel in sorted(remote, key=_digest_last):
        if _local_only(rel):
            continue
        target = os.path.join(local, *rel.split("/"))
        same = rel in present and present[rel][0] == remote[rel]
        if same and rel.endswith(".npz") and rel + ".sha256" in remote:
            same = _same_digest(fs, posixpath.join(root, rel), target)
        if not same or remote[rel] < (1 << 20):
            _download(fs, posixpath.join(root, rel), target)
            fetched += 1
    for rel in present:
        if rel not in remote:
            os.unlink(os.path.join(local, *rel.split("/")))
    return fetched


def _dead_here(lease: Dict[str, Any]) -> bool:
    """True when the lease's holder ran on this host and its process is gone (a kill): no need to wait."""
    if lease.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(lease.get("pid", 0)), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, TypeError):
        return False
    return int(lease.get("pid", 0)) <= 0


class RemoteOutput:
    """The URL of a job's output directory and its local staging copy (see the module docstring). Rank 0 only."""

    def __init__(self, url: str, local: Optional[str] = None):
        self.url = url.rstrip("/")
        self.local = local or staging_dir(self.url)
        self.fs, self.root = filesystem(self.url)
        self.pushed: Dict[str, Tuple[int, int]] = {}
        """Local files as they were when last pushed (or pulled): size and modification time."""
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None
        self.push_seconds = 0.0
        self.uploaded = 0
        self._lock = threading.Lock()  # one push at a time: the pusher's, or the final one
        self._dirty = threading.Event()
        self._pusher: Optional[threading.Thread] = None
        self._closing = False
        self._wanted = False

    def _remote(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    # --- the lease -------------------------------------------------------------------------------------------------
    def _read_lease(self) -> Dict[str, Any]:
        try:
            return json.loads(self.fs.cat_file(self._remote(LEASE_NAME)).decode())
        except (FileNotFoundError, ValueError, UnicodeDecodeError):  # none, or not one of hvdtrain's
            return {}

    def _write_lease(self, done: bool = False) -> None:
        self.fs.pipe_file(self._remote(LEASE_NAME), json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "job": job_label(), "token": self.token,
             "since": self._since, "renewed": time.time(), "done": done}).encode())

    @staticmethod
    def _describe(lease: Dict[str, Any]) -> str:
        age = time.time() - float(lease.get("renewed", 0))
        return (f"host {lease.get('host', '?')}, pid {lease.get('pid', '?')}"
                + (f", job {lease['job']}" if lease.get("job") else "")
                + f", lease renewed {age:.0f}s ago")

    def take(self, pause: float = 1.0) -> None:
        """Take the URL's lease for this job, or raise ConfigError naming the job that holds it."""
        self._since = time.strftime("%Y-%m-%d %H:%M:%S")
        lease = self._read_lease()
        refusal = (f"--output-dir {self.url} is in use by a running job ({{}}): wait for it, stop it, or choose "
                   f"another --output-dir (a job killed without ending holds it for {LEASE_SECONDS:.0f}s)")
        if (lease and not lease.get("done") and time.time() - float(lease.get("renewed", 0)) < LEASE_SECONDS
                and not _dead_here(lease)):
            raise ConfigError(refusal.format(self._describe(lease)))
        self._write_lease()
        time.sleep(pause)  # another job that read no lease when this one did has written its own by now
        lease = self._read_lease()
        if lease.get("token") != self.token:
            raise ConfigError(refusal.format(self._describe(lease)))
        self._renewer = threading.Thread(target=self._renew, name="hvdtrain-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                self._write_lease()
            except Exception as e:  # noqa: BLE001 - the next renewal tries again; training goes on
                print(f"hvdtrain: warning: renewing the lease of {self.url} failed ({describe_error(self.url, e)})",
                      file=sys.stderr, flush=True)

    def release(self) -> None:
        """The job is over (however it ended): its lease says done, and the URL is free at once."""
        if self._renewer is None:
            return
        self._stop.set()
        self._renewer.join(timeout=5)
        self._renewer = None
        try:
            self._write_lease(done=True)
        except Exception as e:  # noqa: BLE001
            print(f"hvdtrain: warning: could not release the lease of {self.url} ({describe_error(self.url, e)}); it "
                  f"ages out in {LEASE_SECONDS:.0f}s", file=sys.stderr, flush=True)

    # --- copies ----------------------------------------------------------------------------------------------------
    def pull(self) -> int:
        """Make the staging directory hold what the URL holds (the host-only entries aside); returns the files
        fetched."""
        fetched = pull(self.fs, self.root, self.local)
        self.pushed = _local_files(self.local)
        return fetched

    # --- pushing in the background ------------------------------------------------------------------------------
    def request(self, warn) -> None:
        """A push is due (a checkpoint was written): the pusher thread makes it while training goes on, so that an
        upload slower than the job's stall timeout never stops the other ranks; requests that come while it uploads
        make one push after. ``warn(exception)`` hears a failed push (the next one tries again)."""
        if self._pusher is None:
            self._pusher = threading.Thread(target=self._push_loop, args=(warn,), name="hvdtrain-push", daemon=True)
            self._pusher.start()
        self._wanted = True
        self._dirty.set()

    def _push_loop(self, warn) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            if self._wanted:  # a request made before stop_pushing() is pushed before the thread ends
                self._wanted = False
                try:
                    self.push()
                except Exception as e:  # noqa: BLE001 - said by the caller's warning; the next push tries again
                    warn(e)
            if self._closing:
                return

    def stop_pushing(self) -> None:
        """Let the push under way finish and stop the pusher (the final push is the caller's, made after)."""
        if self._pusher is not None:
            self._closing = True
            self._dirty.set()
            self._pusher.join()
            self._pusher = None

    def push(self) -> int:
        """Make the URL hold what the staging directory holds: uploads first (each checkpoint's digest after the
        archives), then deletions (digests before their archives); returns the files uploaded. A file the job
        rewrites while it is read goes up again at the next push; an archive that then no longer matches the digest
        that follows it is one a reader refuses, never one it trusts."""
        with self._lock:
            return self._push()

    def _push(self) -> int:
        start = time.perf_counter()
        local = _local_files(self.local)
        changed = [rel for rel, stamp in local.items() if self.pushed.get(rel) != stamp]
        remote = _remote_files(self.fs, self.root)
        for rel in changed:  # an archive replaced under the same name: its old digest goes first
            if rel.endswith(".npz") and rel + ".sha256" in remote:
                self.fs.rm_file(self._remote(rel + ".sha256"))
        for rel in sorted(changed, key=_digest_last):
            path = os.path.join(self.local, *rel.split("/"))
            try:
                self.fs.put_file(path, self._remote(rel))
            except FileNotFoundError:  # removed locally since it was listed (a prune): the deletions below
                local.pop(rel, None)
                continue
            self.pushed[rel] = local[rel]
        gone = sorted((rel for rel in remote if rel not in local and not _local_only(rel)),
                      key=lambda r: (0 if r.endswith(".sha256") else 1, r))
        for rel in gone:
            self.fs.rm_file(self._remote(rel))
            self.pushed.pop(rel, None)
        self.push_seconds += time.perf_counter() - start
        self.uploaded += len(changed)
        return len(changed)


def localize(source: str, what: str = "SOURCE") -> str:
    """A local path holding what ``source`` names (itself where it is not a URL): a checkpoint with its digest, a
    file, or a directory (a run, best/, an export) without its host-only entries, fetched into
    ``~/.cache/hvdtrain/inputs`` (or ``HVDTRAIN_STAGING``'s sibling ``inputs``). Every rank may call it: each
    file is renamed into place whole. ConfigError names a URL that cannot be read or does not exist."""
    if not is_url(source):
        return source
    check(source, what, exists=True)
    fs, path = filesystem(source)
    root = os.environ.get("HVDTRAIN_STAGING")
    base = os.path.join(os.path.dirname(os.path.abspath(root)), "inputs") if root else os.path.join(_cache_root(),
                                                                                                   "inputs")
    target = os.path.join(base, _local_name(source))
    try:
        fs.invalidate_cache()
        if fs.isdir(path):
            if not _remote_files(fs, path):
                raise ConfigError(f"{what} {source} is an empty prefix: nothing to read there")
            pull(fs, path, target)
            return target
        _download(fs, path, target)
        if fs.exists(path + ".sha256"):
            _download(fs, path + ".sha256", target + ".sha256")
        return target
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{what} " + describe_error(source, e)) from None
