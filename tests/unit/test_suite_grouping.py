"""make test's scheduling (tests/conftest.py): under pytest-xdist's --dist loadgroup each file runs whole in one worker,
and the files and tests that change the machine run one after another in one. With pytest 9 and xdist 3.8.0 no group
took effect: the two shaped-network benchmarks ran at once and each found the other's namespaces."""
import re
import subprocess
import sys

from tests.helpers import ROOT


def test_files_and_the_machine_wide_tests_each_run_in_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_collection_modifyitems\n")
    body = "import pytest\n" + "".join(f"def test_{i}(): pass\n" for i in range(6))
    (tmp_path / "test_plain.py").write_text(body)
    (tmp_path / "test_multihost.py").write_text(body)  # a machine-wide file (MACHINE_WIDE)
    (tmp_path / "test_mixed.py").write_text(body + "@pytest.mark.machine\ndef test_marked(): pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
                             "loadgroup", "-v", str(tmp_path)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r"\[(gw\d)\].*PASSED \S*?(test_\w+)\.py::(test_\w+)@(\S+)", result.stdout)
    assert len(ran) == 19, result.stdout
    workers = {}
    for worker, _file, _test, group in ran:
        workers.setdefault(group, set()).add(worker)
    assert set(workers) == {"test_plain.py", "test_mixed.py", "machine"}, workers
    assert all(len(w) == 1 for w in workers.values()), workers
    machine = {(f, t) for _, f, t, g in ran if g == "machine"}
    assert ("test_mixed", "test_marked") in machine and len(machine) == 7, machine


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their basename (the directories are not packages): a second test_x.py in another
    directory fails the whole run at collection ("import file mismatch"), as tests/e2e/test_optimizers.py did."""
    import collections
    import os
    seen = collections.defaultdict(list)
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                seen[name].append(os.path.relpath(folder, ROOT))
    assert not {name: where for name, where in seen.items() if len(where) > 1}
