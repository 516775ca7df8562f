"""MXNet's operators compute with the thread count hvdtrain reports (config.json's threads_per_rank).

MXNet's engine and operator threads take their OpenMP count from OMP_NUM_THREADS when MXNet is loaded; setting it for
the main thread afterwards (MXSetNumOMPThreads) reaches no other thread. The probe reads omp_get_max_threads() inside
a custom operator, in MXNet's operator thread, on each of 2 ranks.
"""
import json
import os

import pytest

from tests.helpers import PY, describe, horovodrun, run

PROBE = """
import ctypes, json, sys
from tests.tiny_recipe import TinyConfig, TinyTrainer
t = TinyTrainer(TinyConfig(framework="mxnet", output_dir=sys.argv[1], resume="never", epochs=1, max_steps=1))
t.setup()
import mxnet as mx
gomp = ctypes.CDLL("libgomp.so.1")

class Probe(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        self.assign(out_data[0], req[0], mx.nd.array([gomp.omp_get_max_threads()]))

@mx.operator.register("omp_probe")
class ProbeProp(mx.operator.CustomOpProp):
    def list_outputs(self):
        return ["output"]
    def infer_shape(self, in_shape):
        return in_shape, [(1,)], []
    def create_operator(self, ctx, shapes, dtypes):
        return Probe()

seen = mx.nd.Custom(mx.nd.zeros((1,)), op_type="omp_probe").asnumpy()[0]
print("PROBE " + json.dumps({"rank": t.backend.rank, "reported": t.backend.threads, "operator": int(seen)}))
t.backend.shutdown()
"""


@pytest.mark.parametrize("omp", ["", "2"])
def test_operators_use_the_reported_thread_count(omp, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = {"OMP_NUM_THREADS": omp} if omp else {}
    env_before = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        result = run(horovodrun(2, PY, str(script), str(tmp_path / "out")), timeout=180, **extra)
    finally:
        if env_before is not None:
            os.environ["OMP_NUM_THREADS"] = env_before
    assert result.returncode == 0, describe(result)
    rows = [json.loads(line.split("PROBE ", 1)[1]) for line in result.stdout.splitlines() if "PROBE " in line]
    assert sorted(r["rank"] for r in rows) == [0, 1], describe(result)
    cores = len(os.sched_getaffinity(0))
    for r in rows:
        assert r["operator"] == r["reported"], rows
        assert r["reported"] == (int(omp) if omp else max(1, cores // 2)), rows  # a user's count wins
