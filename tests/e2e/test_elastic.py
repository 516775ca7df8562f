"""Elastic training on PyTorch: a worker is killed mid-epoch, training goes on with the survivor, a new worker joins.

In fp16 with dynamic loss scaling, the scale halved once early (a NaN batch on every rank): the worker that joins
must take that scale, not start from 65536 (each rank would then unscale the averaged gradients differently).
After every elastic sync each worker checks that all hold the same weights, optimizer state and loss scale: with
momentum SGD, and with LAMB (issue 48: its moments and step counts reach a joining worker).

Two "hosts" on this machine (localhost and 127.0.0.1, as Horovod's own elastic tests do) are reported by a discovery
script that reads a file; the test adds a third name of this machine (its hostname) once a worker has been lost.
"""
import os
import re
import socket
import subprocess
import time

import pytest

from tests.e2e.conftest import read_metrics
from tests.helpers import HOROVODRUN, PY, ROOT, env, kill_tree


@pytest.mark.parametrize("optimizer", ["sgd", "lamb"])
def test_kill_a_worker_continue_then_grow_back(optimizer, tmp_path):
    host = socket.gethostname()
    try:
        if not socket.gethostbyname(host).startswith("127."):
            pytest.skip("needs a third local host name: this machine's hostname must resolve to loopback")
    except OSError:
        pytest.skip("this machine's hostname does not resolve")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    out = tmp_path / "out"
    cmd = [HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
           PY, "-m", "hvdtrain", "recipe", "tests.tiny_recipe:TinyTrainer", "--elastic", "--epochs", "16",
           "--commit-every", "2", "--fault", "kill", "--fault-rank", "1", "--fault-step", "12",
           "--fault-once", str(tmp_path / "killed"), "--step-sleep", "0.2", "--output-dir", str(out),
           "--precision", "fp16", "--nan-step", "3", "--optimizer", optimizer]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "killed").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / "killed").exists(), "the fault never happened"
        time.sleep(6)  # a few epochs on the survivor alone
        hosts.write_text(f"localhost:1\n127.0.0.1:1\n{host}:1\n")
        output, _ = proc.communicate(timeout=150)
    except (subprocess.TimeoutExpired, AssertionError):
        kill_tree(proc)
        raise
    assert proc.returncode == 0, output[-6000:]
    assert "elastic reset: 1 worker(s) now" in output and "elastic reset: 2 worker(s) now" in output, output[-6000:]
    synced = re.findall(r"after the elastic sync: (\d) worker\(s\) hold the same weights, optimizer state and loss scale (\d+)",
                        output)
    assert ("2", "65536") in synced and ("1", "32768") in synced, synced  # the start, the survivor's halved scale
    assert synced[-1] == ("2", "32768"), synced  # the joiner took the survivors' scale
    records = read_metrics(str(out))
    sizes = [r["world_size"] for r in records]
    assert [r["epoch"] for r in records] == list(range(1, 17)), records
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    assert records[-1]["val_accuracy"] > 0.95
    assert all(r["lr"] == pytest.approx(0.01 * r["world_size"]) for r in records), "lr follows the world size"


def test_elastic_on_mxnet_is_refused_with_the_alternative(tmp_path):
    from tests.helpers import hvdtrain, run
    result = run(hvdtrain("recipe", "mnist", "--framework", "mxnet", "--elastic"), timeout=120)
    assert result.returncode == 2
    assert "--elastic is available on --framework torch only" in result.stderr and "--resume auto" in result.stderr
    assert not os.path.exists(tmp_path / "out")
