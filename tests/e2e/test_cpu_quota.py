"""A rank inside a container's CPU limit (a cgroup quota, which the affinity mask does not show) sizes its threads
to the limit and says why. Root only: the test makes the cgroup (v1 or v2) with the network benchmark's CpuQuota."""
import json
import os

import pytest

from tests.helpers import PY, describe, run


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_rank_in_a_one_core_quota_uses_one_thread_and_says_why(framework, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a machine of 2 cores or more: a 1-core quota must be fewer than the cores")
    from hvdtrain.bench.cluster import CpuQuota
    from hvdtrain.config import ConfigError
    try:
        quota = CpuQuota(f"hvdtrain-test-{os.getpid()}", 1, 1.0)
    except (ConfigError, OSError) as e:
        pytest.skip(f"no cgroup cpu controller here: {e}")
    out = str(tmp_path / "out")
    try:
        script = f'echo $$ > {quota.procs(0)} && exec "$@"'
        result = run(["sh", "-c", script, "sh", PY, "-m", "hvdtrain", "recipe", "tests.tiny_recipe:TinyTrainer",
                      "--framework", framework, "--epochs", "1", "--output-dir", out], timeout=180)
    finally:
        quota.remove()
    assert result.returncode == 0, describe(result)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["threads_per_rank"] == 1, cfg
    assert cfg["threads_reason"].startswith("the cgroup CPU quota of 1 core(s)"), cfg
    assert "1 thread(s) (the cgroup CPU quota of 1 core(s)" in result.stdout, describe(result)
