"""scripts/gpu_check.sh, the GPU host's prepared check, as far as a CPU takes it: its argument checks, and the whole
script with --cpu-smoke (no build: the installed Horovod; doctor; bench amp at a tiny size on the CPU; the JSON)."""
import json
import os

from tests.helpers import PY, ROOT, describe, run

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def test_bad_arguments_and_a_missing_sdist_are_one_line_errors(tmp_path):
    usage = run(["bash", SCRIPT], timeout=60)
    assert usage.returncode == 2 and "usage: scripts/gpu_check.sh OUT_DIR" in usage.stderr
    bad = run(["bash", SCRIPT, str(tmp_path), "--fast"], timeout=60)
    assert bad.returncode == 2 and "unknown option --fast" in bad.stderr
    missing = run(["bash", SCRIPT, str(tmp_path)], timeout=60, HVDTRAIN_HOROVOD_SDIST=str(tmp_path / "none.tar.gz"))
    assert missing.returncode == 2 and "no Horovod sdist at" in missing.stderr and "none.tar.gz" in missing.stderr


def test_the_full_check_works_in_a_venv_of_its_own_on_top_of_the_hosts_python(tmp_path):
    # On this CPU it stops at the GPU check, which it makes from that venv: the host's PyTorch seen through it.
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    sdist.write_bytes(b"not read before the GPU check")
    venv = tmp_path / "venv"
    result = run(["bash", SCRIPT, str(tmp_path / "out")], timeout=180, HVDTRAIN_HOROVOD_SDIST=str(sdist),
                 GPU_VENV=str(venv), PYTHON=PY)
    assert result.returncode == 2 and "PyTorch sees no GPU" in result.stderr, describe(result)
    assert f"virtual environment {venv} on top of {PY}" in result.stderr
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()


def test_cpu_smoke_runs_the_whole_check_and_writes_one_json(tmp_path):
    result = run(["bash", SCRIPT, str(tmp_path), "--cpu-smoke"], timeout=600)
    assert result.returncode == 0, describe(result)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["build"]["exit"] == 0 and report["doctor"]["exit"] == 0
    assert any("usable through Horovod" in line for line in report["doctor"]["report"])
    amp = report["amp"]
    assert amp["benchmark"] == "amp" and amp["target"] == 0.97 and amp["environment"]["gpus"] == 0
    row = amp["precisions"]["fp32"]
    assert row["variants"]["hvdtrain"]["images_per_sec"] > 0 and row["variants"]["bare"]["images_per_sec"] > 0
    assert row["hvdtrain_over_bare"] > 0 and isinstance(row["within_target"], bool)
    assert (tmp_path / "amp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gpu_check: fp32: hvdtrain" in result.stdout
