import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MACHINE_WIDE = {"test_multihost.py", "test_slurm.py", "test_cpu_quota.py", "test_ray.py"}
"""Test files that change the machine itself (network namespaces and shaped links, cgroups, a Slurm cluster) and
check it is left as they found it: under pytest-xdist (make test runs three workers) they run one after another in
one worker, never beside each other. A test elsewhere that does so is marked ``@pytest.mark.machine`` (the shaped
network benchmarks of test_bench.py): it joins them, and the rest of its file runs beside them."""


AUTO_OUTCOMES = ("fp32", "bf16")
"""What ``--precision auto`` decides on a CPU without and with native bf16 (HVDTRAIN_AUTO_PRECISION forces either)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "machine: changes the machine (namespaces, links, cgroups); run with the "
                                       "files of MACHINE_WIDE, one after another")


@pytest.fixture(scope="module", params=AUTO_OUTCOMES, ids=[f"auto={o}" for o in AUTO_OUTCOMES])
def auto_precision(request):
    """For tests that compare figures of runs under ``--precision auto``: the module runs once as on a processor
    without native bf16 and once as on one with it (HVDTRAIN_AUTO_PRECISION, inherited by every command the tests
    run), whatever this machine has, so no processor kind turns the suite red. Yields the outcome."""
    from hvdtrain.precision import AUTO_VARIABLE
    before = os.environ.get(AUTO_VARIABLE)
    os.environ[AUTO_VARIABLE] = request.param
    yield request.param
    if before is None:
        os.environ.pop(AUTO_VARIABLE, None)
    else:
        os.environ[AUTO_VARIABLE] = before


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # make test: pytest -n 3 --dist loadgroup. Each file is one group (its module fixtures, such as a trained model,
    # are computed once, in one worker); the machine-wide files and tests share one. tryfirst: pytest-xdist's own
    # hook reads the groups into the test ids, and as a plugin registered after this file it would run first.
    for item in items:
        name = os.path.basename(str(item.fspath))
        machine = name in MACHINE_WIDE or item.get_closest_marker("machine") is not None
        item.add_marker(pytest.mark.xdist_group("machine" if machine else name))
