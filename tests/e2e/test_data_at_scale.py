"""Issue 56: ImageNet-like JPEGs packed as WebDataset tar shards, at a local directory and at s3:// on an S3 server on
the loopback (moto's server mode, behind a TCP relay this test can cut), and the ImageNet recipe trained from them at
np=2 on both frameworks with the turbo decoder: the records from the URL equal those from the directory; a run
stopped mid-epoch resumes to the uninterrupted run's records; the store cut for seconds mid-epoch costs retries and
nothing else; cut for longer than --data-timeout it ends the job naming the shard and the store; a corrupt shard
ends it naming the shard; a missing bucket, index or credentials is one line and exit 2 before Horovod starts."""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import read_metrics
from tests.e2e.test_remote_outputs import start_server
from tests.helpers import PY, ROOT, answers, describe, free_port, horovodrun, kill_tree, run

pytest.importorskip("s3fs", reason="s3fs is not installed (make install installs the 'remote' extra)")
pytest.importorskip("moto.server", reason="moto[server] is not installed (make install installs the 'test' extra)")
pytest.importorskip("simplejpeg", reason="simplejpeg is not installed (make install installs the 'vision' extra)")

# ResNet-18 at 32 px on 100 ImageNet-sized JPEGs (two classes): 6 steps of 8 per rank and epoch at np=2.
TRAIN = ["-m", "hvdtrain", "recipe", "imagenet", "--model", "resnet18_v1b", "--image-size", "32", "--val-resize",
         "36", "--batch-size", "8", "--warmup-epochs", "0", "--num-workers", "1", "--decoder", "turbo",
         "--precision", "fp32"]
FIGURES = ("epoch", "train_loss", "val_loss", "val_accuracy")

# A TCP relay from a port of its own to the S3 server: killing it is the store going away for every client.
RELAY = """import socket, sys, threading
listen, target = int(sys.argv[1]), int(sys.argv[2])
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", listen)); server.listen(64)
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
while True:
    client, _ = server.accept()
    upstream = socket.create_connection(("127.0.0.1", target))
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


class Relay:
    def __init__(self, target: int):
        self.port, self.target, self.proc = free_port(), target, None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([PY, "-c", RELAY, str(self.port), str(self.target)], start_new_session=True)
        deadline = time.time() + 30
        while not answers(self.port):
            assert self.proc.poll() is None and time.time() < deadline, "the relay did not start"
            time.sleep(0.1)

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture(scope="module")
def store():
    server = start_server(s3_port := free_port())
    relay = Relay(s3_port)
    creds = {"AWS_ACCESS_KEY_ID": "hvdtrain", "AWS_SECRET_ACCESS_KEY": "hvdtrain", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}"}
    saved = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("shards")
    try:
        yield fs, relay
    finally:
        relay.stop()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def packed(store, tmp_path_factory):
    """The same photos packed to a directory and to s3://shards/photos, in shards of about 0.5 MB (5 images)."""
    fs, _ = store
    base = tmp_path_factory.mktemp("photos")
    photos, local = str(base / "folder"), str(base / "shards")
    made = run([PY, os.path.join(ROOT, "scripts", "make_photo_folder.py"), photos, "--imagenet-like",
                "--train-per-class", "50", "--val-per-class", "8"], timeout=120)
    assert made.returncode == 0, describe(made)
    for dest in (local, "s3://shards/photos"):
        packed = run([PY, "-m", "hvdtrain", "data", "pack", photos, dest, "--shard-mb", "0.5"], timeout=120)
        assert packed.returncode == 0, describe(packed)
        assert "train 100 samples in" in packed.output and "val 16 samples in 3 shards" in packed.output, \
            describe(packed)
    with open(os.path.join(local, "index.json")) as f:
        index = json.load(f)
    assert json.loads(fs.cat_file("shards/photos/index.json")) == index, "the same bytes at both destinations"
    assert len(index["splits"]["train"]["shards"]) >= 8
    return local, "s3://shards/photos", index


def train(framework, data_dir, out, *extra, timeout=240, cache=None, expect=0):
    cmd = [PY, *TRAIN, "--framework", framework, "--data-dir", data_dir, "--output-dir", str(out), *extra]
    if cache is not None:
        cmd += ["--data-cache", str(cache)]
    result = run(horovodrun(2, *cmd), timeout=timeout)
    if expect == 0:
        assert result.returncode == 0, describe(result)
    return result


def figures(out):
    return [{k: r[k] for k in FIGURES} for r in read_metrics(str(out))]


def same(records, reference):
    """Record for record: the epochs and accuracies exactly, the losses to float32 rounding (a fresh process's
    oneDNN may sum a convolution in another order)."""
    assert [{k: r[k] for k in ("epoch", "val_accuracy")} for r in records] == \
        [{k: r[k] for k in ("epoch", "val_accuracy")} for r in reference]
    for r, ref in zip(records, reference):
        for k in ("train_loss", "val_loss"):
            assert r[k] == pytest.approx(ref[k], rel=2e-6), (r, ref)
    return True


@pytest.fixture(scope="module")
def uninterrupted(packed, tmp_path_factory):
    """Per framework, 3 epochs from the local shards (read in place)."""
    local = packed[0]
    runs = {}
    for framework in ("torch", "mxnet"):
        out = tmp_path_factory.mktemp(f"local-{framework}")
        train(framework, local, out, "--epochs", "3", "--resume", "never")
        runs[framework] = figures(out)
    return runs


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_training_from_the_url_equals_training_from_the_directory(packed, uninterrupted, framework, tmp_path):
    cache = tmp_path / "cache"
    # A cache of 1.5 MB (three shards): each rank's finished shards are evicted as its epoch reads the next.
    done = train(framework, packed[1], tmp_path / "out", "--epochs", "3", "--resume", "never",
                 "--data-cache-gb", "0.0015", cache=cache)
    assert same(figures(tmp_path / "out"), uninterrupted[framework]), describe(done)
    held = [n for _, _, files in os.walk(cache) for n in files if n.endswith(".tar")]
    assert 0 < len(held) < len(packed[2]["splits"]["train"]["shards"]), held


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_stopped_mid_epoch_and_resumed_from_the_url_equals_uninterrupted(packed, uninterrupted, framework, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    # 6 steps per epoch: step 9 is inside epoch 2; the stop writes a checkpoint there and the resume starts from it.
    train(framework, packed[1], out, "--epochs", "3", "--resume", "never", "--max-steps", "9", cache=cache)
    assert [r["epoch"] for r in read_metrics(str(out))] == [1, 2]  # epoch 2 as far as it went
    resumed = train(framework, packed[1], out, "--epochs", "3", cache=tmp_path / "empty-cache")
    assert "(epoch 1, step 9)" in resumed.output, describe(resumed)
    assert same(figures(out), uninterrupted[framework]), describe(resumed)


def test_killed_mid_epoch_and_resumed_from_the_url_equals_uninterrupted(packed, uninterrupted, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    cmd = [PY, *TRAIN, "--framework", "torch", "--data-dir", packed[1], "--output-dir", str(out), "--epochs", "3",
           "--resume", "never", "--checkpoint-every-steps", "2", "--data-cache", str(cache)]
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen(horovodrun(2, *cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    try:  # killed (every process, SIGKILL) once the checkpoint of step 8, inside epoch 2, is written (its digest last)
        deadline = time.time() + 180
        def checkpointed():
            return (out / "checkpoints" / "ckpt-e0001-s000000008.npz.sha256").exists()
        while not checkpointed():
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "log").read()
            time.sleep(0.02)
    finally:
        kill_tree(proc)  # horovodrun and every rank, at once
        proc.wait(30)
    resumed = train("torch", packed[1], out, "--epochs", "3", "--checkpoint-every-steps", "2", cache=cache)
    # From step 8 or later (the kill may land after the next checkpoint), inside epoch 2: never an epoch's start.
    assert re.search(r"resuming from .*\(epoch 1, step (8|10)\)", resumed.output), describe(resumed)
    assert same(figures(out), uninterrupted["torch"]), describe(resumed)


def test_decoding_on_the_device_trains_from_the_url_and_mxnet_refuses_it(packed, tmp_path):
    """--decoder device on PyTorch: the loader hands over encoded images and crop boxes, the backend decodes on its
    device (here the CPU stand-in of the GPU's nvJPEG); MXNet refuses it in one line before Horovod starts."""
    done = train("torch", packed[1], tmp_path / "out", "--epochs", "1", "--resume", "never", "--decoder", "device",
                 cache=tmp_path / "cache")
    record = read_metrics(str(tmp_path / "out"))[0]
    assert record["epoch"] == 1 and record["train_loss"] > 0 and record["val_accuracy"] >= 0, describe(done)
    refused = run([PY, *TRAIN, "--framework", "mxnet", "--data-dir", packed[1], "--decoder", "device",
                   "--output-dir", str(tmp_path / "mx")], timeout=120)
    assert refused.returncode == 2 and "--decoder device decodes with torchvision's nvJPEG" in refused.stderr, \
        describe(refused)
    assert len(refused.stderr.strip().splitlines()) == 1, describe(refused)


def start_job(packed, out, cache, *extra):
    cmd = [PY, *TRAIN, "--framework", "torch", "--data-dir", packed[1], "--output-dir", str(out), "--resume", "never",
           "--data-cache-gb", "0.0015", "--data-cache", str(cache), *extra]
    log = open(str(out) + ".log", "w+")
    proc = subprocess.Popen(horovodrun(2, *cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    deadline = time.time() + 120
    while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and read_metrics(str(out))):  # epoch 1 done: epoch 2 fetches its shards as it goes (3 fit the cache)
        assert proc.poll() is None and time.time() < deadline, open(str(out) + ".log").read()
        time.sleep(0.05)
    return proc, lambda: open(str(out) + ".log").read()


def test_the_store_away_for_seconds_mid_epoch_costs_retries_only(store, packed, uninterrupted, tmp_path):
    _, relay = store
    proc, output = start_job(packed, tmp_path / "out", tmp_path / "cache", "--epochs", "3")
    try:
        relay.stop()
        time.sleep(6)
        relay.start()
        assert proc.wait(240) == 0, output()
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        if relay.proc.poll() is not None:
            relay.start()
    # The outage fell in epoch 2, which waited for its data (s3fs's own retries, or hvdtrain's past them) ...
    records = read_metrics(str(tmp_path / "out"))
    assert records[1]["epoch_seconds"] > 5 and records[1]["phase_seconds"]["data"] > records[0]["phase_seconds"][
        "data"], output()
    # ... and cost nothing else.
    assert same(figures(tmp_path / "out"), uninterrupted["torch"]), output()


def test_the_store_away_past_the_timeout_ends_the_job_naming_shard_and_store(store, packed, tmp_path):
    _, relay = store
    proc, output = start_job(packed, tmp_path / "out", tmp_path / "cache", "--epochs", "3", "--data-timeout", "5")
    try:
        relay.stop()
        assert proc.wait(180) != 0, output()
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        relay.start()
    assert "the store s3://shards/photos did not answer for 5 s (--data-timeout" in output(), output()
    assert "shard train-0000" in output() or "shard val-0000" in output(), output()
    errors = [line for line in output().splitlines() if "hvdtrain: error:" in line]
    assert errors and "StoreError: shard " in errors[0] and "<stderr>:[rank 0] Traceback" not in output(), output()


def test_a_shard_gone_bad_mid_job_ends_it_naming_the_shard(store, packed, tmp_path):
    fs, _ = store
    bad = packed[2]["splits"]["train"]["shards"][3]["name"]
    good = fs.cat_file(f"shards/photos/{bad}")
    fs.pipe_file(f"shards/photos/{bad}", good[:2000] + bytes(10) + good[2010:])
    try:
        failed = train("torch", packed[1], tmp_path / "out", "--epochs", "1", "--resume", "never",
                       cache=tmp_path / "cache", expect=1)
    finally:
        fs.pipe_file(f"shards/photos/{bad}", good)
    assert failed.returncode != 0
    errors = [line for line in failed.output.splitlines() if "hvdtrain: error:" in line]
    assert errors and f"shard {bad} at s3://shards/photos does not match index.json" in errors[0], describe(failed)


@pytest.mark.parametrize("case", ["bucket", "index", "credentials", "unreachable"])
def test_a_missing_bucket_index_or_credentials_is_one_line_before_horovod(store, packed, case, tmp_path):
    url = {"bucket": "s3://no-such-bucket/photos", "index": "s3://shards/nothing-here"}.get(case, packed[1])
    extra = ({"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""} if case == "credentials" else
             {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"} if case == "unreachable" else {})
    cmd = [PY, *TRAIN, "--framework", "torch", "--data-dir", url, "--output-dir", str(tmp_path / "out")]
    result = run(cmd, timeout=120, **extra)
    want = {"bucket": "bucket no-such-bucket does not exist", "index": "has no index.json",
            "credentials": "no credentials", "unreachable": "cannot reach the object store"}[case]
    assert result.returncode == 2 and want in result.stderr, describe(result)
    assert len(result.stderr.strip().splitlines()) == 1, describe(result)
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")
