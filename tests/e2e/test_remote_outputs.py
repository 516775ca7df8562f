"""--output-dir s3://... under horovodrun at np=2, against an S3 server on the loopback (moto's server mode, as
s3fs's own tests use) (issue 49, items 2-3): a job killed between a checkpoint's upload and its digest's resumes from
the URL on a host with an empty staging directory and ends as an uninterrupted local run, record for record; eval
and export read the URL; a bad URL, missing credentials, a missing bucket and a URL held by a live job on another
host are refused in one line before Horovod starts; the store going away mid-run leaves training running."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import read_metrics
from tests.e2e.test_best_checkpoint import FIGURES, same
from tests.helpers import PY, answers, describe, free_port, horovodrun, run

pytest.importorskip("s3fs", reason="s3fs is not installed (make install installs the 'remote' extra)")
pytest.importorskip("moto.server", reason="moto[server] is not installed (make install installs the 'test' extra)")

RECIPE = ["-m", "hvdtrain", "recipe", "regression", "--epochs", "3"]
# Rank 0 dies (SIGKILL) as its pusher thread is about to upload the digest of epoch 2's checkpoint: the URL holds
# that archive without its digest, and epoch 2's record.
KILLER = """import os, signal, sys
import s3fs
put = s3fs.S3FileSystem._put_file
async def cut(self, lpath, rpath, *args, **kwargs):
    if "ckpt-e0002" in rpath and rpath.endswith(".sha256"):
        os.kill(os.getpid(), signal.SIGKILL)
    return await put(self, lpath, rpath, *args, **kwargs)
s3fs.S3FileSystem._put_file = cut
from hvdtrain.cli import main
sys.exit(main(sys.argv[1:]))
"""




def start_server(port):
    server = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while not answers(port):
        assert server.poll() is None and time.time() < deadline, "moto's S3 server did not start"
        time.sleep(0.2)
    return server


@pytest.fixture(scope="module")
def store():
    port = free_port()
    server = start_server(port)
    creds = {"AWS_ACCESS_KEY_ID": "hvdtrain", "AWS_SECRET_ACCESS_KEY": "hvdtrain", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)  # this process's s3fs (the checks below) and every command's
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("hvdtrain-test")
    try:
        yield fs
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def figures(records):
    return [{k: r[k] for k in FIGURES} for r in records]


def url_records(fs, url):
    return [json.loads(line) for line in fs.cat_file(url + "/metrics.jsonl").decode().splitlines() if line.strip()]


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_job_killed_between_a_checkpoint_and_its_digest_resumes_from_the_url(store, framework, tmp_path):
    whole = tmp_path / "whole"
    done = run(horovodrun(2, PY, *RECIPE, "--framework", framework, "--output-dir", str(whole)), timeout=240)
    assert done.returncode == 0, describe(done)
    url = f"s3://hvdtrain-test/{framework}/job"
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    killed = run(horovodrun(2, PY, str(killer), *RECIPE[2:], "--framework", framework, "--output-dir", url),
                 timeout=240, HVDTRAIN_STAGING=str(tmp_path / "host-a"))
    assert killed.returncode != 0, describe(killed)
    held = sorted(p.rsplit("/", 1)[1] for p in store.find(f"hvdtrain-test/{framework}/job/checkpoints"))
    assert [p for p in held if "e0002" in p] == [p for p in held if "e0002" in p and p.endswith(".npz")] != [], held
    # (uploads run beside training: epoch 3's record may have gone up before the kill too)
    assert [r["epoch"] for r in url_records(store, url)] in ([1, 2], [1, 2, 3])
    # another host (an empty staging directory) resumes from the URL: epoch 2's archive has no digest, so epoch 1's
    # checkpoint is the newest whole one
    resumed = run(horovodrun(2, PY, *RECIPE, "--framework", framework, "--output-dir", url), timeout=240,
                  HVDTRAIN_STAGING=str(tmp_path / "host-b"))
    assert resumed.returncode == 0, describe(resumed)
    assert "skipping checkpoint" in resumed.output and "has no" in resumed.output, describe(resumed)
    assert "resuming from" in resumed.output and "ckpt-e0001" in resumed.output, describe(resumed)
    assert f"{url} holds the run" in resumed.output, describe(resumed)
    assert same(figures(url_records(store, url)), figures(read_metrics(str(whole))))
    held = sorted(p.rsplit("/", 1)[1] for p in store.find(f"hvdtrain-test/{framework}/job/checkpoints"))
    assert held == sorted(os.listdir(whole / "checkpoints")), held  # the same names, each with its digest
    lease = json.loads(store.cat_file(f"hvdtrain-test/{framework}/job/.hvdtrain.lease"))
    assert lease["done"] is True
    assert store.find(f"hvdtrain-test/{framework}/job/tensorboard")  # the event files went up too
    assert json.loads(store.cat_file(url + "/config.json"))["output_url"] == url
    if framework == "torch":  # eval and export read the URL (its files are fetched to a cache)
        evaluated = run([PY, "-m", "hvdtrain", "eval", url, "--output-dir", str(tmp_path / "eval")], timeout=120,
                        HVDTRAIN_STAGING=str(tmp_path / "host-c"))
        assert evaluated.returncode == 0, describe(evaluated)
        want = read_metrics(str(whole))[-1]["val_mse"]
        assert json.loads((tmp_path / "eval" / "eval.json").read_text())["val_mse"] == pytest.approx(want, rel=1e-4)
        exported = run([PY, "-m", "hvdtrain", "export", f"{url}/checkpoints/{held[-2]}", "--output",
                        str(tmp_path / "export")], timeout=120, HVDTRAIN_STAGING=str(tmp_path / "host-c"))
        assert exported.returncode == 0, describe(exported)
        assert json.loads((tmp_path / "export" / "model.json").read_text())["epoch"] == 3
        # --resume URL: a local run continues from the URL's epoch-2 checkpoint and ends as the uninterrupted one
        second = [p for p in held if p.startswith("ckpt-e0002") and p.endswith(".npz")][0]
        branch = tmp_path / "branch"
        resumed = run(horovodrun(2, PY, *RECIPE, "--framework", framework, "--output-dir", str(branch), "--resume",
                                 f"{url}/checkpoints/{second}"), timeout=240, HVDTRAIN_STAGING=str(tmp_path / "host-c"))
        assert resumed.returncode == 0 and "(epoch 2," in resumed.output, describe(resumed)
        assert same(figures(read_metrics(str(branch))), figures(read_metrics(str(whole)))[2:])
        reported = run([PY, "-m", "hvdtrain", "report", url], timeout=120, cwd=str(tmp_path),
                       HVDTRAIN_STAGING=str(tmp_path / "host-c"))
        assert reported.returncode == 0 and f"hvdtrain report: {url}" in reported.stdout, describe(reported)
        assert (tmp_path / "report.png").exists(), describe(reported)


def test_bad_urls_missing_credentials_and_buckets_and_a_held_url_are_refused_before_horovod(store, tmp_path):
    cmd = [PY, *RECIPE, "--max-steps", "1"]
    cases = [("zz://bucket/job", {}, "zz://bucket/job is not a URL fsspec knows"),
             ("s3://no-such-bucket/job", {}, "bucket no-such-bucket does not exist"),
             ("s3://hvdtrain-test/job", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}, "no credentials")]
    for url, extra, message in cases:
        result = run(cmd + ["--output-dir", url], timeout=120, HVDTRAIN_STAGING=str(tmp_path / "s"), **extra)
        assert result.returncode == 2 and message in result.stderr, (url, describe(result))
        assert len(result.stderr.strip().splitlines()) == 1, describe(result)
    elastic = run(cmd + ["--elastic", "--output-dir", "s3://hvdtrain-test/job"], timeout=120)
    assert elastic.returncode == 2 and "--elastic cannot write to a URL --output-dir" in elastic.stderr, \
        describe(elastic)
    resume = run(cmd + ["--output-dir", str(tmp_path / "x"), "--resume", "s3://hvdtrain-test/none/ckpt.npz"],
                 timeout=120)
    assert resume.returncode == 2 and "--resume s3://hvdtrain-test/none/ckpt.npz does not exist" in resume.stderr, \
        describe(resume)
    store.pipe_file("hvdtrain-test/held/.hvdtrain.lease", json.dumps(
        {"host": "node17", "pid": 4242, "job": "Slurm 99", "token": "x", "renewed": time.time(), "done": False}).encode())
    held = run(cmd + ["--output-dir", "s3://hvdtrain-test/held"], timeout=120, HVDTRAIN_STAGING=str(tmp_path / "s"))
    assert held.returncode == 2 and "in use by a running job (host node17, pid 4242, job Slurm 99" in held.stderr, \
        describe(held)


def test_the_store_going_away_mid_run_leaves_training_running(tmp_path):
    """The S3 server is killed after the first epoch's push: the job trains to the end, warns at each failed push,
    and says at the end that the run's files are in the staging directory."""
    port = free_port()
    server = start_server(port)
    env = {"AWS_ACCESS_KEY_ID": "hvdtrain", "AWS_SECRET_ACCESS_KEY": "hvdtrain", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "2",
           "HVDTRAIN_STAGING": str(tmp_path / "stage")}
    try:
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, key="hvdtrain", secret="hvdtrain",
                               endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir("gone")
        marker = tmp_path / "slow"
        marker.write_text("")
        cmd = horovodrun(2, PY, "-m", "hvdtrain", "recipe", "tests.tiny_recipe:TinyTrainer", "--epochs", "3",
                         "--step-sleep", "0.5", "--sleep-while", str(marker), "--output-dir", "s3://gone/job")
        from tests.helpers import env as with_env
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=with_env(**env), cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        deadline = time.time() + 180
        while not fs.exists("gone/job/metrics.jsonl"):
            assert job.poll() is None and time.time() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.5)
            fs.invalidate_cache()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        marker.unlink()
        output, _ = job.communicate(timeout=240)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "warning: pushing to s3://gone/job failed" in output and "the run's files are in" in output, output[-3000:]
    stage = tmp_path / "stage" / "s3" / "gone" / "job"
    assert [r["epoch"] for r in read_metrics(str(stage))] == [1, 2, 3]
