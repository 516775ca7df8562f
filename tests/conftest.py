import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MACHINE_WIDE = {"test_multihost.py", "test_slurm.py", "test_cpu_quota.py"}
"""Test files that change the machine itself (network namespaces and shaped links, cgroups, a Slurm cluster) and
check it is left as they found it: under pytest-xdist (make test runs three workers) they run one after another in
one worker, never beside each other. A test elsewhere that does so is marked ``@pytest.mark.machine`` (the shaped
network benchmarks of test_bench.py): it joins them, and the rest of its file runs beside them."""


def pytest_configure(config):
    config.addinivalue_line("markers", "machine: changes the machine (namespaces, links, cgroups); run with the "
                                       "files of MACHINE_WIDE, one after another")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # make test: pytest -n 3 --dist loadgroup. Each file is one group (its module fixtures, such as a trained model,
    # are computed once, in one worker); the machine-wide files and tests share one. tryfirst: pytest-xdist's own
    # hook reads the groups into the test ids, and as a plugin registered after this file it would run first.
    for item in items:
        name = os.path.basename(str(item.fspath))
        machine = name in MACHINE_WIDE or item.get_closest_marker("machine") is not None
        item.add_marker(pytest.mark.xdist_group("machine" if machine else name))
