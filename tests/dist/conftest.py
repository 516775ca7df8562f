"""Distributed tests: run by a launcher, one process per rank, e.g.

    horovodrun -np 2 -H localhost:2 --gloo python -m pytest tests/dist --framework torch
    mpirun -np 2 python -m pytest tests/dist --framework mxnet

One framework per process: horovod.torch and horovod.mxnet each keep their own Horovod state.
tests/e2e/test_dist_suites.py launches these under a hard timeout as part of `make test`.
"""
import os

import numpy as np
import pytest


def pytest_addoption(parser):
    parser.addoption("--framework", default="torch", choices=["torch", "mxnet"], help="framework under test")


def pytest_collection_modifyitems(config, items):
    if not any(v in os.environ for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        skip = pytest.mark.skip(reason="distributed test: run under horovodrun or mpirun")
        for item in items:
            item.add_marker(skip)


class Ops:
    """The raw Horovod API of one framework, behind three helpers, so tests read the same for both."""

    def __init__(self, framework):
        self.framework = framework
        if framework == "torch":
            import horovod.torch as hvd
            import torch
            self.tensor = lambda values: torch.tensor(values, dtype=torch.float64)
            self.to_numpy = lambda t: t.numpy()
        else:
            import horovod.mxnet as hvd
            import mxnet as mx
            self.tensor = lambda values: mx.nd.array(values, dtype="float64")
            self.to_numpy = lambda t: t.asnumpy()
        hvd.init()
        self.hvd = hvd


@pytest.fixture(scope="session")
def framework(request):
    return request.config.getoption("--framework")


@pytest.fixture(scope="session")
def ops(framework):
    return Ops(framework)


def fingerprint(params: dict) -> np.ndarray:
    """One float64 per parameter, sensitive to every element (a fixed random projection)."""
    out = []
    for name in sorted(params):
        flat = np.asarray(params[name], dtype=np.float64).ravel()
        weights = np.random.default_rng(len(flat)).normal(size=flat.size)
        out.append(float(flat @ weights))
    return np.array(out)


def assert_same_on_every_rank(backend, values: np.ndarray, what: str):
    """Equal everywhere iff mean(v) == v and mean(v**2) == v**2 across ranks (element-wise)."""
    keys = {f"v{i}": float(v) for i, v in enumerate(values)}
    keys.update({f"s{i}": float(v) ** 2 for i, v in enumerate(values)})
    mean = backend.allreduce_mean(keys)
    for i, v in enumerate(values):
        assert mean[f"v{i}"] == pytest.approx(v, rel=1e-12, abs=1e-12), f"{what} differs across ranks"
        assert mean[f"s{i}"] == pytest.approx(float(v) ** 2, rel=1e-12, abs=1e-12), f"{what} differs across ranks"


def pytest_sessionfinish(session, exitstatus):
    """Stop Horovod in order (after MXNet's queued ops) rather than during interpreter exit."""
    import sys
    if "horovod.mxnet" in sys.modules:
        import mxnet as mx
        mx.nd.waitall()
        sys.modules["horovod.mxnet"].shutdown()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per rank, in one write: "dist suite rank R: N passed, M failed". Under mpirun the ranks' outputs
    reach the launcher's in chunks that interleave anywhere (pytest writes its summary in pieces: "10 p" of one rank
    was once followed by the other's line), so tests/e2e/test_dist_suites.py reads this line instead; a write this
    short to a pipe is never split."""
    import os
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    stats = terminalreporter.stats  # by outcome, as pytest's own summary line counts them
    passed = len(stats.get("passed", []))
    failed = len(stats.get("failed", [])) + len(stats.get("error", []))
    os.write(1, f"\ndist suite rank {rank}: {passed} passed, {failed} failed\n".encode())
