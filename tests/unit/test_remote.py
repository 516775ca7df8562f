"""hvdtrain.remote on fsspec's in-memory filesystem (the same code path as s3://; tests/e2e/test_remote_outputs.py
runs it against an S3 server): what a push uploads and in which order, what a pull leaves in the staging directory,
and a push cut between a checkpoint's archive and its digest."""
import json
import os
import time

import pytest

fsspec = pytest.importorskip("fsspec")

from hvdtrain import checkpoint, remote  # noqa: E402
from hvdtrain.config import ConfigError  # noqa: E402


@pytest.fixture
def url(request):
    fs = fsspec.filesystem("memory")
    prefix = f"memory://bkt/{request.node.name}"
    yield prefix
    fs.rm(remote.filesystem(prefix)[1], recursive=True) if fs.exists(remote.filesystem(prefix)[1]) else None


def objects(url):
    fs, root = remote.filesystem(url)
    return sorted(remote._remote_files(fs, root))


class Recording:
    """Wraps a filesystem's put_file and rm_file to record the order of uploads and deletions."""

    def __init__(self, fs, fail_on=""):
        self.fs, self.log, self.fail_on = fs, [], fail_on
        self.put, self.rm = fs.put_file, fs.rm_file

    def put_file(self, lpath, rpath, **kw):
        if self.fail_on and rpath.endswith(self.fail_on):
            raise ConnectionError("the store went away")
        self.log.append(("put", os.path.basename(rpath)))
        return self.put(lpath, rpath, **kw)

    def rm_file(self, path):
        self.log.append(("rm", os.path.basename(path)))
        return self.rm(path)


def instrument(out, fail_on=""):
    rec = Recording(out.fs, fail_on)
    out.fs.put_file, out.fs.rm_file = rec.put_file, rec.rm_file
    return rec


def test_a_push_uploads_each_archive_before_its_digest_and_deletes_digests_first(url, tmp_path):
    stage = tmp_path / "stage"
    out = remote.RemoteOutput(url, str(stage))
    ckpts = stage / "checkpoints"
    for step in (1, 2):
        checkpoint.save(str(ckpts), step, step, {"w": [step]})
    (stage / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (stage / "heartbeats").mkdir()
    (stage / "heartbeats" / "rank-0.json").write_text("{}")  # host-only: never pushed
    rec = instrument(out)
    assert out.push() == 5
    puts = [name for op, name in rec.log if op == "put"]
    assert puts.index("ckpt-e0001-s000000001.npz") < puts.index("ckpt-e0001-s000000001.npz.sha256")
    assert all(not p.endswith(".sha256") for p in puts[:3]) and all(p.endswith(".sha256") for p in puts[3:])
    assert "heartbeats/rank-0.json" not in objects(url)
    # nothing changed: nothing uploaded
    rec.log.clear()
    assert out.push() == 0 and rec.log == []
    # a prune and a new checkpoint: the new one goes up whole first, then the pruned one goes, its digest first
    checkpoint.save(str(ckpts), 3, 3, {"w": [3]})
    checkpoint.prune(str(ckpts), 2)
    out.push()
    assert rec.log == [("put", "ckpt-e0003-s000000003.npz"), ("put", "ckpt-e0003-s000000003.npz.sha256"),
                       ("rm", "ckpt-e0001-s000000001.npz.sha256"), ("rm", "ckpt-e0001-s000000001.npz")]
    assert [n for n in objects(url) if n.startswith("checkpoints/")] == [
        "checkpoints/ckpt-e0002-s000000002.npz", "checkpoints/ckpt-e0002-s000000002.npz.sha256",
        "checkpoints/ckpt-e0003-s000000003.npz", "checkpoints/ckpt-e0003-s000000003.npz.sha256"]


def test_an_archive_rewritten_under_its_name_loses_its_old_digest_before_the_upload(url, tmp_path):
    stage = tmp_path / "stage"
    out = remote.RemoteOutput(url, str(stage))
    checkpoint.save(str(stage / "checkpoints"), 1, 4, {"w": [1.0]})
    out.push()
    time.sleep(0.01)
    checkpoint.save(str(stage / "checkpoints"), 1, 4, {"w": [2.0]})
    rec = instrument(out)
    out.push()
    assert rec.log[:2] == [("rm", "ckpt-e0001-s000000004.npz.sha256"), ("put", "ckpt-e0001-s000000004.npz")]


def test_a_push_cut_between_archive_and_digest_leaves_no_checkpoint_a_reader_trusts(url, tmp_path):
    """The store fails after the archive of the newest checkpoint went up and before its digest: a pull on another
    host (a resume) holds the archive without a digest, and the newest valid checkpoint is the one before; the next
    push completes it."""
    stage = tmp_path / "stage"
    out = remote.RemoteOutput(url, str(stage))
    ckpts = stage / "checkpoints"
    checkpoint.save(str(ckpts), 1, 4, {"w": [1.0]})
    out.push()
    checkpoint.save(str(ckpts), 2, 8, {"w": [2.0]})
    instrument(out, fail_on="ckpt-e0002-s000000008.npz.sha256")
    with pytest.raises(ConnectionError):
        out.push()
    assert "checkpoints/ckpt-e0002-s000000008.npz" in objects(url)
    assert "checkpoints/ckpt-e0002-s000000008.npz.sha256" not in objects(url)
    other = remote.RemoteOutput(url, str(tmp_path / "other-host"))
    other.pull()
    skipped = []
    newest = checkpoint.latest_valid(os.path.join(other.local, "checkpoints"), warn=skipped.append)
    assert os.path.basename(newest) == "ckpt-e0001-s000000004.npz" and "has no" in skipped[0]
    out.fs.put_file = out.fs.__class__.put_file.__get__(out.fs)  # the store is back
    out.push()
    other.pull()
    assert os.path.basename(checkpoint.latest_valid(os.path.join(other.local, "checkpoints"))) == \
        "ckpt-e0002-s000000008.npz"


def test_a_pull_makes_the_staging_directory_the_url_and_keeps_host_only_files(url, tmp_path):
    first = remote.RemoteOutput(url, str(tmp_path / "a"))
    os.makedirs(first.local)
    with open(os.path.join(first.local, "metrics.jsonl"), "w") as f:
        f.write('{"epoch": 1}\n')
    checkpoint.save(os.path.join(first.local, "checkpoints"), 1, 4, {"w": [1.0]})
    first.push()
    stage = tmp_path / "b"
    (stage / "checkpoints").mkdir(parents=True)
    (stage / "checkpoints" / "ckpt-e0009-s000000099.npz").write_bytes(b"a stale file of an earlier job")
    (stage / "heartbeats").mkdir()
    (stage / "heartbeats" / "rank-1.json").write_text("{}")
    second = remote.RemoteOutput(url, str(stage))
    assert second.pull() == 3
    assert sorted(os.listdir(stage / "checkpoints")) == ["ckpt-e0001-s000000004.npz", "ckpt-e0001-s000000004.npz.sha256"]
    assert (stage / "heartbeats" / "rank-1.json").exists()
    assert checkpoint.load(str(stage / "checkpoints" / "ckpt-e0001-s000000004.npz")) == {"w": [1.0]}
    assert second.push() == 0  # what was pulled is not uploaded again


def test_the_lease_refuses_a_second_job_until_the_first_ends_or_its_lease_ages(url, tmp_path):
    first = remote.RemoteOutput(url, str(tmp_path / "a"))
    first.take(pause=0)
    second = remote.RemoteOutput(url, str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"in use by a running job \(host .*, pid %d" % os.getpid()):
        second.take(pause=0)
    first.release()
    second.take(pause=0)
    second._stop.set()  # killed without ending: its lease stays fresh for LEASE_SECONDS, then ages
    fs, root = remote.filesystem(url)
    lease = json.loads(fs.cat_file(root + "/" + remote.LEASE_NAME))
    assert lease["done"] is False
    third = remote.RemoteOutput(url, str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="in use"):
        third.take(pause=0)
    fs.pipe_file(root + "/" + remote.LEASE_NAME, json.dumps({**lease, "renewed": time.time() - 61}).encode())
    third.take(pause=0)
    third.release()
    # a fresh lease of a process gone from this host (a kill) is free at once; of another host, it is not
    import subprocess
    import sys
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe_file(root + "/" + remote.LEASE_NAME, json.dumps({**lease, "pid": int(gone.stdout), "done": False,
                                                             "renewed": time.time()}).encode())
    third.take(pause=0)
    third.release()
    fs.pipe_file(root + "/" + remote.LEASE_NAME, json.dumps({**lease, "host": "elsewhere", "pid": int(gone.stdout),
                                                             "done": False, "renewed": time.time()}).encode())
    with pytest.raises(ConfigError, match="host elsewhere"):
        third.take(pause=0)


def test_a_job_that_loses_the_race_for_the_lease_refuses_itself(url, tmp_path):
    """Two jobs read no lease at once; each writes its own and reads it back after a pause: the one that reads the
    other's token refuses itself."""
    first = remote.RemoteOutput(url, str(tmp_path / "a"))
    second = remote.RemoteOutput(url, str(tmp_path / "b"))
    write = first._write_lease

    def overtaken(done=False):
        write(done)
        second._since = "now"
        second._write_lease()  # the other job's write lands during this job's pause
    first._write_lease = overtaken
    with pytest.raises(ConfigError, match="in use by a running job"):
        first.take(pause=0)


def test_urls_are_told_apart_from_paths_and_localized(url, tmp_path, monkeypatch):
    assert remote.is_url("s3://b/p") and remote.is_url("memory://b") and not remote.is_url("file:///tmp/x")
    assert not remote.is_url("runs/x")
    monkeypatch.setenv("HVDTRAIN_STAGING", str(tmp_path / "staging"))
    assert remote.staging_dir("s3://bkt/a/../b") == str(tmp_path / "staging" / "s3" / "bkt" / "a" / "b")
    first = remote.RemoteOutput(url, str(tmp_path / "a"))
    checkpoint.save(os.path.join(first.local, "checkpoints"), 1, 4, {"w": [1.0]})
    first.push()
    name = "checkpoints/ckpt-e0001-s000000004.npz"
    local = remote.localize(f"{url}/{name}")
    assert local.startswith(str(tmp_path / "inputs")) and checkpoint.load(local) == {"w": [1.0]}
    run_dir = remote.localize(url)
    assert os.path.isfile(os.path.join(run_dir, *name.split("/")))
    with pytest.raises(ConfigError, match="does not exist"):
        remote.localize(f"{url}/nothing.npz", "--init-from")
    with pytest.raises(ConfigError, match="not a URL fsspec knows"):
        remote.filesystem("nosuchprotocol://x/y")


def test_a_file_url_is_a_local_output_directory(tmp_path):
    from tests.tiny_recipe import TinyTrainer
    trainer = TinyTrainer(output_dir=f"file://{tmp_path}/job")
    assert trainer.cfg.output_dir == f"{tmp_path}/job" and trainer.output_url == ""
    assert TinyTrainer(output_dir="s3://bkt/job/").output_url == "s3://bkt/job"


def test_pushes_run_on_the_pusher_thread_and_the_last_is_waited_for(url, tmp_path):
    """A checkpoint's upload must not hold rank 0 (a slow store would stall the other ranks into --stall-timeout):
    request() returns at once, the upload runs on the pusher thread, and stop_pushing() waits for it."""
    import threading
    out = remote.RemoteOutput(url, str(tmp_path / "stage"))
    checkpoint.save(os.path.join(out.local, "checkpoints"), 1, 4, {"w": [1.0]})
    release, threads = threading.Event(), []
    put = out.fs.put_file

    def slow_put(lpath, rpath, **kw):
        threads.append(threading.current_thread().name)
        release.wait(10)
        return put(lpath, rpath, **kw)
    out.fs.put_file = slow_put
    failures = []
    started = time.perf_counter()
    out.request(failures.append)
    assert time.perf_counter() - started < 0.5  # not waiting for the upload
    assert "checkpoints/ckpt-e0001-s000000004.npz.sha256" not in objects(url)
    release.set()
    out.stop_pushing()
    assert set(threads) == {"hvdtrain-push"} and not failures
    assert "checkpoints/ckpt-e0001-s000000004.npz.sha256" in objects(url)
    out.fs.put_file = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("gone"))
    checkpoint.save(os.path.join(out.local, "checkpoints"), 2, 8, {"w": [2.0]})
    out.request(failures.append)
    out.stop_pushing()
    assert [type(e) for e in failures] == [ConnectionError]  # a failed push is heard, not raised on the thread
