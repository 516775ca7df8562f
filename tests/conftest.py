import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MACHINE_WIDE = {"test_bench.py", "test_multihost.py", "test_slurm.py", "test_cpu_quota.py"}
"""Test files that change the machine itself (network namespaces and shaped links, cgroups, a Slurm cluster) and
check it is left as they found it: under pytest-xdist (make test runs two workers) they run one after another in
one worker, never beside each other."""


def pytest_collection_modifyitems(config, items):
    # make test: pytest -n 2 --dist loadgroup. Each file is one group (its module fixtures, such as a trained model,
    # are computed once, in one worker); the machine-wide files share one.
    for item in items:
        name = os.path.basename(str(item.fspath))
        item.add_marker(pytest.mark.xdist_group("machine" if name in MACHINE_WIDE else name))
