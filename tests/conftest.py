import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MACHINE_WIDE = {"test_multihost.py", "test_slurm.py", "test_cpu_quota.py"}
"""Test files that change the machine itself (network namespaces and shaped links, cgroups, a Slurm cluster) and
check it is left as they found it: under pytest-xdist (make test runs two workers) they run one after another in
one worker, never beside each other. A test elsewhere that does so is marked ``@pytest.mark.machine`` (the shaped
network benchmarks of test_bench.py): it joins them, and the rest of its file runs beside them."""


FIRST = ("machine", "test_imagenet.py", "test_bench.py", "test_resume.py", "test_mnist.py", "test_fashion_mnist.py",
         "test_dist_suites.py", "test_export.py")
"""The groups pytest-xdist hands out first, in this order; then the other end-to-end files, the unit tests last. The
machine-wide group is the longest (about 350 s here) but mostly waits (Slurm's timeouts, links shaped to 200 Mbit/s),
so the other worker starts on the groups that keep both cores busy (2-rank training); the short unit files fill the
end, when one worker would otherwise wait for the other. xdist's own order, by the number of tests in a group, had
the machine-wide group and the fault tests (which wait for stall timeouts) run beside each other: 150-170% of the
2 cores busy for 3 minutes."""


def pytest_configure(config):
    config.addinivalue_line("markers", "machine: changes the machine (namespaces, links, cgroups); run with the "
                                       "files of MACHINE_WIDE, one after another")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order pytest_collection_modifyitems sets
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # make test: pytest -n 2 --dist loadgroup. Each file is one group (its module fixtures, such as a trained model,
    # are computed once, in one worker); the machine-wide files and tests share one. tryfirst: pytest-xdist's own
    # hook reads the groups into the test ids, and as a plugin registered after this file it would run first.
    groups = {}
    for item in items:
        name = os.path.basename(str(item.fspath))
        machine = name in MACHINE_WIDE or item.get_closest_marker("machine") is not None
        groups[item.nodeid] = "machine" if machine else name
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))

    def rank(item):
        group = groups[item.nodeid]
        unit = os.sep + "unit" + os.sep in str(item.fspath)
        return (FIRST.index(group) if group in FIRST else len(FIRST)) + (1 if unit else 0)
    items.sort(key=rank)  # stable: a file keeps its own order
