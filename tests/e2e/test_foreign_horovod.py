"""hvdtrain in an environment a user already has (issue 58, items 3 and 4): a fresh virtualenv holding torch and a
stock Horovod (0.28.1 built with only what it needs to compile against the pinned torch: C++17, fix 1, and the CPU
build, fix 4; no hvdtrain fixes), into which ``pip install '.[torch]'`` puts hvdtrain without make. There the MNIST
recipe trains under horovodrun (warning once of the missing fixes), ``doctor`` names the Horovod as stock with each
missing fix, and ``--shard-optimizer`` under Gloo is refused in one line naming fix 8.

The stock wheel is built by scripts/build_horovod.sh with HVDTRAIN_HOROVOD_FIXES=1,4 and cached as the patched one
is (about 4 minutes the first time on 2 cores, Gloo only; seconds after). Nothing from the repository is on the
path of the commands that run there: they run from another directory with PYTHONPATH empty.
"""
import os
import sys

import pytest

from tests.helpers import ROOT, describe, run

BUILD = os.path.join(ROOT, "scripts", "build_horovod.sh")
STOCK = {"HVDTRAIN_HOROVOD_FIXES": "1,4", "HVDTRAIN_FRAMEWORKS": "torch", "HVDTRAIN_NO_MPI": "1"}


def _venv_env(venv: str) -> dict:
    return {"PYTHONPATH": "", "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": venv}


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory):
    """A fresh venv: torch, then a stock Horovod with its own dependencies, then ``pip install '.[torch]'``."""
    venv = str(tmp_path_factory.mktemp("user") / "venv")
    py = os.path.join(venv, "bin", "python")
    cwd = str(tmp_path_factory.mktemp("elsewhere"))

    def step(cmd, timeout, **env):
        result = run(cmd, timeout=timeout, cwd=cwd, **_venv_env(venv), **env)
        assert result.returncode == 0, describe(result)
        return result

    step([sys.executable, "-m", "venv", venv], 120)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    step([*pip, "torch==2.13.0", "cmake>=3.13,<4", "wheel", "setuptools>=61"], 600)
    # built with fixes 1 and 4 only (or taken from the wheel cache) and installed with Horovod's own dependencies
    step(["bash", BUILD, py], 900, **STOCK)
    step([*pip, f"{ROOT}[torch]"], 600)  # not editable: the package as a user gets it
    return venv, cwd


def test_pip_install_into_a_venv_with_torch_and_a_stock_horovod_trains_mnist(user_venv, digits, tmp_path):
    venv, cwd = user_venv
    py = os.path.join(venv, "bin", "python")
    where = run([py, "-c", "import hvdtrain, horovod; print(hvdtrain.__file__, horovod.__version__)"], timeout=120,
                cwd=cwd, **_venv_env(venv))
    assert where.returncode == 0 and "site-packages/hvdtrain" in where.stdout and "0.28.1" in where.stdout, \
        describe(where)
    out = str(tmp_path / "mnist")
    cmd = [os.path.join(venv, "bin", "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", py, "-m", "hvdtrain",
           "recipe", "mnist", "--data-dir", digits, "--epochs", "1", "--output-dir", out]
    result = run(cmd, timeout=300, cwd=cwd, **_venv_env(venv))
    assert result.returncode == 0, describe(result)
    assert result.output.count("this Horovod lacks hvdtrain's fix(es) 3, 5, 6, 7, 9, 11, 12") == 1, describe(result)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert f.read().count('"val_accuracy"') == 1


def test_doctor_names_the_stock_horovod_and_each_missing_fix(user_venv):
    venv, cwd = user_venv
    result = run([os.path.join(venv, "bin", "python"), "-m", "hvdtrain", "doctor"], timeout=180, cwd=cwd,
                 **_venv_env(venv))
    assert "horovod fixes" in result.stdout, describe(result)
    line = next(line for line in result.stdout.splitlines() if "horovod fixes" in line)
    assert line.split()[0] == "warn" and "no hvdtrain fixes: a stock or other build; missing: fix 2:" in line, line
    assert all(f"fix {n}:" in line for n in (2, 3, 5, 6, 7, 8, 9, 10, 11, 12)), line
    assert "fix: make horovod" in result.stdout and "--shard-optimizer under Gloo is refused" in result.stdout


def test_shard_optimizer_under_gloo_is_refused_without_fix_8(user_venv, digits, tmp_path):
    venv, cwd = user_venv
    out = tmp_path / "sharded"
    cmd = [os.path.join(venv, "bin", "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
           os.path.join(venv, "bin", "python"), "-m", "hvdtrain", "recipe", "mnist", "--data-dir", digits,
           "--epochs", "1", "--shard-optimizer", "--output-dir", str(out)]
    result = run(cmd, timeout=300, cwd=cwd, **_venv_env(venv))
    assert result.returncode != 0, describe(result)
    assert "hvdtrain: error: --shard-optimizer under Gloo needs hvdtrain's Horovod fix 8 (Gloo's reduce-scatter can " \
           "return wrong values without it), which this Horovod lacks: build it with make horovod" in result.output, \
        describe(result)
    assert "] Traceback" not in result.output and not out.exists()
