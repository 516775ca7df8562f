"""The step's cost model (hvdtrain.bench.costmodel) and `bench project`'s input checks."""
import json
import random

import pytest

from hvdtrain.bench import costmodel as cm
from hvdtrain.bench.project import parse_hosts, project
from hvdtrain.config import ConfigError
from tests.helpers import describe, hvdtrain, run

LINK = cm.Link(alpha=30e-6, beta=8 / 1e9, gamma=0.4e-9)  # 1 Gbit/s, 30 us per message, 0.4 ns per byte reduced


def test_the_fit_recovers_known_alpha_beta_gamma_from_noisy_timings():
    rng = random.Random(1)
    samples = []
    for p in (2, 3, 4):
        for nbytes in (64e3, 1e6, 8e6):
            for op, cost in cm.COLLECTIVES.items():
                samples.append((op, nbytes, p, cost(nbytes, p, LINK) * rng.uniform(0.98, 1.02)))  # 2% noise
    fit = cm.fit_link(samples)
    assert fit["alpha"] == pytest.approx(LINK.alpha, rel=0.15)
    assert fit["beta"] == pytest.approx(LINK.beta, rel=0.05)
    assert fit["gamma"] == pytest.approx(LINK.gamma, rel=0.25)
    assert fit["max_relative_error"] < 0.05


def test_two_hosts_and_two_sizes_suffice_and_nothing_comes_out_negative():
    # The smallest calibration (bench network --collectives-only on 2 hosts): three operations at two sizes.
    samples = [(op, n, 2, cost(n, 2, LINK)) for n in (0.26e6, 2.1e6) for op, cost in cm.COLLECTIVES.items()]
    fit = cm.fit_link(samples)
    assert fit["beta"] == pytest.approx(LINK.beta, rel=1e-6) and fit["alpha"] == pytest.approx(LINK.alpha, rel=1e-4)
    # Timings with no visible reduction cost: gamma is 0, not negative, and the others still fit.
    flat = [(op, n, 2, cm.COLLECTIVES[op](n, 2, cm.Link(LINK.alpha, LINK.beta))) for op, n, *_ in samples]
    assert cm.fit_link(flat)["gamma"] == 0.0
    with pytest.raises(ValueError):
        cm.fit_link(samples[:2])


def test_a_large_tensor_after_the_backward_pays_the_closed_form_ring_cost():
    # One tensor, ready at the end of the backward pass: the step is the compute plus the ring's closed form
    # 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma, on the network link whatever the ranks per host.
    n, hosts, per_host = 100e6, 4, 2
    compute = cm.Compute(forward=0.1, backward=0.2, update=0.01, gradients=[(n, 1.0)])
    got = cm.horovod_step(compute, hosts, per_host, LINK, cycle_time=1e-3)
    p = hosts * per_host
    closed = 2 * (p - 1) * LINK.alpha + 2 * (p - 1) / p * n * LINK.beta + (p - 1) / p * n * LINK.gamma
    assert got["seconds"] == pytest.approx(compute.seconds + closed, rel=1e-9)
    assert got["messages"] == 1


def test_fusion_overlap_and_the_threshold():
    # Ten 1 MB gradients ready evenly through a 100 ms backward: with overlap only the last ones are exposed.
    compute = cm.Compute(0.05, 0.1, 0.0, [(1e6, (i + 1) / 10) for i in range(10)])
    overlapped = cm.horovod_step(compute, 2, 1, LINK, cycle_time=1e-3)
    serial = cm.horovod_step(compute, 2, 1, LINK, cycle_time=1e-3, overlap=False)
    one = cm.ring_allreduce(1e6, 2, LINK)
    assert overlapped["seconds"] < serial["seconds"]
    assert serial["seconds"] == pytest.approx(compute.seconds + cm.ring_allreduce(10e6, 2, LINK), rel=1e-9)
    assert overlapped["exposed_communication"] == pytest.approx(one, rel=0.1)  # the last gradient's message
    # A fusion threshold below two tensors sends each on its own even when they are ready together.
    together = cm.Compute(0.0, 0.1, 0.0, [(1e6, 1.0)] * 4)
    assert cm.horovod_step(together, 2, 1, LINK, threshold=1.5e6)["messages"] == 4
    assert cm.horovod_step(together, 2, 1, LINK, threshold=8e6)["messages"] == 1


def test_the_parameter_server_layouts():
    n, hosts = 50e6, 8
    compute = cm.Compute(0.0, 1e-9, 0.0, [(n, 1.0)])  # no compute: the step is the communication
    link = cm.Link(0.0, LINK.beta)
    one = cm.ps_step(compute, hosts, 1, 1, link)["seconds"]
    per_host = cm.ps_step(compute, hosts, 1, hosts, link)["seconds"]
    # host0's link receives every push, then sends every pull: one array, nothing to overlap (issue 47, item 9: it
    # was charged (h-1) n beta, push and pull together)
    assert one == pytest.approx(2 * (hosts - 1) * n * link.beta, rel=1e-6)
    # many arrays: each array's pull overlaps the next one's push; only the last pull is left over
    many = cm.Compute(0.0, 1e-9, 0.0, [(n / 10, 1.0)] * 10)
    assert cm.ps_step(many, hosts, 1, 1, link)["seconds"] == pytest.approx((hosts - 1) * n * 1.1 * link.beta,
                                                                           rel=1e-6)
    # a server per host: each host's link carries what the ring's does, 2(n-1)/n of the gradients
    assert per_host == pytest.approx(2 * (hosts - 1) / hosts * n * link.beta, rel=1e-6)
    assert per_host == pytest.approx(cm.ring_allreduce(n, hosts, link), rel=1e-6)


def test_hierarchical_allreduce_moves_n_bytes_per_host_link():
    local = cm.Link(5e-6, 8 / 800e9)
    n = 100e6
    flat = cm.flat_allreduce(n, 16, 8, LINK, local)
    hier = cm.hierarchical_allreduce(n, 16, 8, LINK, local)
    assert hier < flat  # 2(h-1) messages on the network instead of 2(hr-1)
    bandwidth = 2 * 15 / 16 * n * LINK.beta
    assert bandwidth < hier < bandwidth + 2 * 15 * LINK.alpha + 0.01


def test_projection_rows():
    compute = cm.Compute(0.05, 0.1, 0.01, [(4e6, f / 20) for f in range(1, 21)])
    net, local = cm.Link.from_rate(25e9, 25e-6), cm.Link.from_rate(800e9, 5e-6)
    rows = project(compute, 64, 1000.0, [1, 2, 8], 4, net, local, 1e-3, 128 * 2 ** 20, False)
    assert [r["ranks"] for r in rows] == [4, 8, 32]
    for row in rows:
        for arm in ("horovod", "ps 1 server", "ps server per host"):
            assert 0 < row[arm]["efficiency"] <= 1.0 + 1e-9
            assert row[arm]["images_per_sec"] == pytest.approx(row["ranks"] * 64 / row[arm]["step_seconds"])
    assert rows[-1]["ps 1 server"]["efficiency"] < rows[-1]["ps server per host"]["efficiency"]
    # the global batch grows with the ranks: fewer steps per epoch, and hours to 90 epochs from the rate
    assert [r["global_batch"] for r in rows] == [256, 512, 2048]
    assert [r["steps_per_epoch"] for r in rows] == [5005, 2503, 626]
    for row in rows:
        assert row["horovod"]["hours_to_epochs"] == pytest.approx(90 * 1281167 / row["horovod"]["images_per_sec"]
                                                                  / 3600)
    assert all(r["accuracy_past_published_limit"] == "" for r in rows)
    big = project(compute, 256, 1000.0, [4, 8], 8, net, local, 1e-3, 128 * 2 ** 20, False)
    assert [r["accuracy_past_published_limit"] for r in big] == ["", "lars"]  # 8K, then 16K: within LARS's 32K only
    assert project(compute, 512, 1000.0, [16], 8, net, local, 1e-3, 128 * 2 ** 20,
                   False)[0]["accuracy_past_published_limit"] == "none"  # 64K
    with pytest.raises(ConfigError, match="--hosts"):
        parse_hosts("0,2")


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet50", "--img-per-sec-per-gpu", "1400"], "--link: give the network link's rate"),
    (["--model", "resnet50", "--img-per-sec-per-gpu", "1400", "--link", "25gbit", "--hosts", "0"], "--hosts '0'"),
    (["--model", "alexnet", "--img-per-sec-per-gpu", "1400", "--link", "25gbit"], "--model 'alexnet': choose"),
    (["--model", "resnet50", "--link", "25gbit"], "--img-per-sec-per-gpu: give one GPU's"),
    (["--model", "resnet50", "--img-per-sec-per-gpu", "1400", "--link", "fast"], "--link 'fast': give a rate"),
])
def test_project_refuses_bad_input_in_one_line(args, message, tmp_path):
    result = run(hvdtrain("bench", "project", *args, "--output-dir", str(tmp_path)), timeout=120)
    assert result.returncode != 0 and message in result.stderr, describe(result)
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1, describe(result)


def test_a_network_run_is_predicted_from_a_calibration_of_other_host_counts(tmp_path):
    from hvdtrain.bench.prediction import predict, read_calibration
    cal = {"alpha": 1e-3, "beta": 8 / 200e6, "gamma": 1e-9}
    path = tmp_path / "collectives.json"
    path.write_text(json.dumps({"rate": "200mbit", "cpu_quota_cores": 0.4, "calibration": cal,
                                "collectives_seconds": {"2": {}, "3": {}, "4": {}}}))
    calibration = read_calibration(str(path), "200mbit", 0.4)
    assert calibration["hosts"] == [2, 3, 4]
    arms = ("horovod", "hvdtrain", "ps 1 server", "ps server per host", "hvdtrain torch")
    result = {"batch_size": 32, "hidden": 64,
              "rows": [{"hosts": 1, **{a: {"images_per_sec": 500.0, "efficiency": 1.0} for a in arms}},
                       {"hosts": 6, **{a: {"images_per_sec": 900.0, "efficiency": 0.3} for a in arms}}],
              "variants": {f"{a} n=6": {"images_per_sec": 900.0} for a in arms}}
    rows = predict(result, calibration)
    assert [(r["hosts"], r["arm"]) for r in rows] == [(6, "hvdtrain"), (6, "ps 1 server"), (6, "ps server per host"),
                                                      (6, "hvdtrain torch")]
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_images_per_sec"] / 900.0 - 1)
        assert 0 < r["predicted_efficiency"] <= 1 and r["calibrated_on_hosts"] == [2, 3, 4]
    by = {r["arm"]: r["predicted_images_per_sec"] for r in rows}
    assert by["ps 1 server"] < by["ps server per host"]
    with pytest.raises(ConfigError, match="calibrate at the same --rate"):
        read_calibration(str(path), "500mbit", 0.4)
    # Hosts that own their cores are another emulation: a quota's calibration does not predict them.
    with pytest.raises(ConfigError, match="0 cores of its own per host, not 200mbit, 0.4 and 1"):
        read_calibration(str(path), "200mbit", 0.4, cores_per_host=1)
    path.write_text(json.dumps({**json.loads(path.read_text()), "cores_per_host": 1}))
    assert read_calibration(str(path), "200mbit", 0.4, cores_per_host=1)["hosts"] == [2, 3, 4]
    with pytest.raises(ConfigError, match="--cores-per-host"):
        read_calibration(str(path), "200mbit", 0.4)
    # so is a quota in other periods (a file without the period had the default's, 10 ms)
    with pytest.raises(ConfigError, match="under a quota in 10 ms periods, not 2; calibrate at the same --quota-p"):
        read_calibration(str(path), "200mbit", 0.4, cores_per_host=1, quota_period_us=2000)
    path.write_text(json.dumps({**json.loads(path.read_text()), "cpu_quota_period_us": 2000}))
    assert read_calibration(str(path), "200mbit", 0.4, cores_per_host=1, quota_period_us=2000)["hosts"] == [2, 3, 4]


def test_a_network_run_under_a_quota_is_predicted_with_the_hosts_cpu_shared(tmp_path):
    """The calibration's CPU per allreduce (at 2-4 hosts) and the one worker's CPU per step bound the predicted step
    at 6 hosts of 0.25 cores; the links-only prediction is kept beside it, and the parameter server keeps the links."""
    from hvdtrain.bench.prediction import predict, read_calibration
    cal = {"alpha": 1e-3, "beta": 8 / 200e6, "gamma": 1e-9}
    path = tmp_path / "collectives.json"
    cpu = {"2": {"allreduce": 0.06}, "3": {"allreduce": 0.09}, "4": {"allreduce": 0.11}}
    path.write_text(json.dumps({"rate": "200mbit", "cpu_quota_cores": 0.25, "calibration": cal,
                                "collectives_seconds": {n: {} for n in cpu}, "collectives_cpu_seconds": cpu}))
    calibration = read_calibration(str(path), "200mbit", 0.25)
    assert calibration["allreduce_cpu_seconds"] == {2: 0.06, 3: 0.09, 4: 0.11}
    arms = ("hvdtrain", "ps 1 server", "hvdtrain torch")
    worker = {"single worker": 0.033, "hvdtrain torch n=1": 0.040}
    result = {"batch_size": 32, "hidden": 64, "cpu_quota_cores": 0.25,
              "rows": [{"hosts": 1, **{a: {"images_per_sec": 240.0, "efficiency": 1.0} for a in arms}},
                       {"hosts": 6, **{a: {"images_per_sec": 300.0, "efficiency": 0.2} for a in arms}}],
              "variants": {**{f"{a} n=6": {"images_per_sec": 300.0} for a in arms},
                           **{k: {"rounds": [{"worker_cpu_per_step": [v]}]} for k, v in worker.items()}}}
    rows = {r["arm"]: r for r in predict(result, calibration)}
    for arm, alone in (("hvdtrain", 0.033), ("hvdtrain torch", 0.040)):
        r = rows[arm]
        assert r["cpu_bound"], r
        step = (alone + 0.013442 * 5 + 0.093557 * 5 / 6) / 0.25  # the fitted allreduce CPU at 6, over the quota
        assert r["predicted_images_per_sec"] == pytest.approx(6 * 32 / step, rel=0.01)
        assert r["predicted_images_per_sec"] < r["links_only_images_per_sec"]
        assert r["links_only_error"] == pytest.approx(r["links_only_images_per_sec"] / 300.0 - 1)
    ps = rows["ps 1 server"]
    assert not ps["cpu_bound"] and ps["predicted_images_per_sec"] == ps["links_only_images_per_sec"]


def test_project_writes_its_table_json_and_chart(tmp_path):
    # The whole command on the MNIST recipe's network: its gradients measured here, projected to 1 and 4 hosts.
    result = run(hvdtrain("bench", "project", "--model", "mnist", "--img-per-sec-per-gpu", "2000", "--batch-size",
                          "32", "--link", "1gbit", "--ranks-per-host", "2", "--hosts", "1,4", "--output-dir",
                          str(tmp_path)), timeout=180)
    assert result.returncode == 0, describe(result)
    data = json.loads((tmp_path / "project.json").read_text())
    assert [r["ranks"] for r in data["rows"]] == [2, 8] and data["tensors"] == 8
    assert data["gradient_mb"] == pytest.approx(4 * 1630090 / 1e6, rel=0.01)  # the recipe's 1.63 M parameters
    one, four = data["rows"]
    assert one["horovod"]["efficiency"] > four["horovod"]["efficiency"] > 0
    assert four["ps 1 server"]["efficiency"] < four["ps server per host"]["efficiency"]
    assert (tmp_path / "project.png").read_bytes()[:4] == b"\x89PNG"
    assert "hosts  ranks     batch" in result.stdout and "90 epochs" in result.stdout, describe(result)
    assert [r["global_batch"] for r in data["rows"]] == [64, 256] and data["epochs"] == 90
    # this project's own large-batch study, beside the papers' limits (issue 48, item 5)
    assert data["measured_here"]["points_lost"]["lars"] < data["measured_here"]["points_lost"]["sgd"]
    assert "measured here (docs/convergence.md" in result.stdout and "with LARS" in result.stdout, describe(result)


def test_a_hosts_cpu_bounds_the_step_when_compute_and_collectives_share_it():
    """Issue 45's CPU term: with 0.25 cores per host, a step cannot take less than the compute's CPU plus the
    allreduce's CPU at the quota's rate; with whole cores it changes nothing."""
    per_message, per_pass = cm.fit_cpu({2: 0.060, 3: 0.090, 4: 0.110})
    assert per_message >= 0 and per_pass >= 0
    for p, cpu in ((2, 0.060), (3, 0.090), (4, 0.110)):  # the fit reproduces what it saw
        assert cm.HostCpu(1, 0, per_message, per_pass).allreduce(p) == pytest.approx(cpu, rel=0.05)
    assert cm.HostCpu(1, 0, per_message, per_pass).allreduce(1) == 0.0
    compute = cm.Compute(0.04, 0.08, 0.01, [(6.5e6, 0.5)])
    quota = cm.HostCpu(0.25, 0.033, per_message, per_pass)
    links = cm.horovod_step(compute, 8, 1, LINK)
    shared = cm.horovod_step(compute, 8, 1, LINK, cpu=quota)
    assert shared["cpu_bound"] and shared["seconds"] == pytest.approx(quota.step(8))
    assert quota.step(8) > links["seconds"]
    assert shared["links_seconds"] == pytest.approx(links["seconds"])
    roomy = cm.horovod_step(compute, 8, 1, LINK, cpu=cm.HostCpu(64, 0.033, per_message, per_pass))
    assert not roomy["cpu_bound"] and roomy["seconds"] == pytest.approx(links["seconds"])
    # two ranks on one host share its cores
    assert quota.step(8, per_host=2) == pytest.approx(2 * quota.step(8))
    # one rank count alone still fits (all of it per message or per pass: the same at that count)
    one = cm.HostCpu(1, 0, *cm.fit_cpu({"2": 0.06}))
    assert one.allreduce(2) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        cm.fit_cpu({1: 0.0})


def test_horovods_arms_are_predicted_from_the_allreduces_alone(monkeypatch):
    """Issue 45: the link fitted to every collective carried Gloo's reduce-scatter through Horovod, which on the
    shaped hosts took nearly an allreduce's time, into the allreduce's cost (43% off at 200 Mbit/s). Horovod's arms
    now use the allreduces' own fit, which recovers them exactly; the parameter server keeps every collective's."""
    from hvdtrain.bench.prediction import allreduce_link, predict
    ring = cm.Link(alpha=4e-3, beta=20e-9, gamma=0.0)
    timings = []
    for p in (2, 3, 4):
        for nbytes in (0.8e6, 6.5e6):
            timings.append(["allreduce", nbytes, p, cm.ring_allreduce(nbytes, p, ring)])
            timings.append(["allgather", nbytes, p, cm.allgather(nbytes, p, ring)])
            # a reduce-scatter as slow as the allreduce, as Horovod's Gloo one was on these hosts
            timings.append(["reducescatter", nbytes, p, cm.ring_allreduce(nbytes, p, ring)])
    every = cm.fit_link([tuple(t) for t in timings])
    fitted = allreduce_link({"timings": timings})
    assert fitted["max_relative_error"] < 1e-6 and every["max_relative_error"] > 0.1
    for p in (6, 8):
        alone = cm.ring_allreduce(6.5e6, p, cm.Link(fitted["alpha"], fitted["beta"], fitted["gamma"]))
        assert alone == pytest.approx(cm.ring_allreduce(6.5e6, p, ring), rel=1e-6)
    assert allreduce_link({"timings": timings[:6]}) is None  # two allreduces: too few to fit three coefficients
    profile = _profile()  # the network's profile, measured once: every prediction below sees the same
    monkeypatch.setattr("hvdtrain.bench.profile.measure", lambda *a, **k: profile)
    arms = ("hvdtrain", "ps 1 server", "hvdtrain torch")
    result = {"batch_size": 32, "hidden": 512,  # 6.5 MB of gradients, the fully connected layers' 6.4 MB first
              "rows": [{"hosts": 1, **{a: {"images_per_sec": 500.0, "efficiency": 1.0} for a in arms}},
                       {"hosts": 8, **{a: {"images_per_sec": 900.0, "efficiency": 0.3} for a in arms}}],
              "variants": {f"{a} n=8": {"images_per_sec": 900.0} for a in arms}}
    calibration = {**every, "hosts": [2, 3, 4], "allreduce_link": fitted}
    rows = {r["arm"]: r for r in predict(result, calibration)}
    without = {r["arm"]: r for r in predict(result, {**calibration, "allreduce_link": None})}
    assert rows["hvdtrain"]["link_fitted_to"] == "allreduce" and rows["ps 1 server"]["link_fitted_to"] != "allreduce"
    assert rows["hvdtrain"]["predicted_images_per_sec"] != pytest.approx(without["hvdtrain"]["predicted_images_per_sec"])
    assert rows["ps 1 server"]["predicted_images_per_sec"] == without["ps 1 server"]["predicted_images_per_sec"]
    # hvdtrain on MXNet sends one group after the backward pass: the step is the compute plus one ring allreduce
    total = profile.gradient_bytes
    step = 32 / 500.0 + cm.ring_allreduce(total, 8, ring)
    assert rows["hvdtrain"]["predicted_images_per_sec"] == pytest.approx(8 * 32 / step, rel=0.02)
    # PyTorch's first bucket (the fully connected layers) leaves during the backward pass: on a link without a
    # per-message cost (which its second group pays again) a shorter step than MXNet's one group after it
    free = {r["arm"]: r["predicted_images_per_sec"]
            for r in predict(result, {**calibration, "allreduce_link": {**fitted, "alpha": 0.0}})}
    assert free["hvdtrain torch"] > 1.01 * free["hvdtrain"]
    # the run's own allreduce alone at 8 hosts: the step again with the link scaled to it, beside the prediction
    slow = {**result, "collectives_seconds": {"8": {"allreduce": 2 * cm.ring_allreduce(total, 8, ring)}}}
    again = {r["arm"]: r for r in predict(slow, calibration)}["hvdtrain"]
    assert again["allreduce_alone_seconds"]["measured"] == pytest.approx(2 * again["allreduce_alone_seconds"]
                                                                          ["extrapolated"], rel=1e-6)
    assert again["error_with_the_measured_allreduce"] < again["error"]


def _profile():
    from hvdtrain.bench.profile import measure
    return measure("mnist", batch_size=32, hidden=512)


def test_the_model_sends_a_profile_in_hvdtrains_groups():
    """Compute.in_groups and torch_groups.plan_sizes: a group is one tensor of its bytes, ready with its last
    gradient; DDP's buckets take the last registered parameters first and close the first at 1 MiB."""
    from hvdtrain.backends.torch_groups import BUCKETS, plan_sizes
    compute = cm.Compute(0.1, 0.2, 0.0, [(100.0, 1.0), (200.0, 0.9), (2e6, 0.3), (4.0, 0.25)])
    assert plan_sizes([100, 200, 2_000_000, 4], BUCKETS) == [[3, 2], [1, 0]]
    assert plan_sizes([100, 200, 2_000_000, 4], 1) == [[3, 2, 1, 0]]
    grouped = compute.in_groups(plan_sizes([100, 200, 2_000_000, 4], BUCKETS))
    assert grouped.gradients == [(2e6 + 4.0, 0.3), (300.0, 1.0)] and grouped.seconds == compute.seconds
