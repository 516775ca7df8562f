"""The benchmarks' shared runner: interleaved rounds, the journal that keeps samples through a later failure, and
the machine a result was measured on; and how an arm of bench network is run."""
import json
import os

import pytest

from hvdtrain.bench.runner import compare, machine


def test_compare_interleaves_and_journals_every_sample_as_it_is_measured(tmp_path):
    order = []

    def variant(name, value):
        def run():
            order.append(name)
            return value
        return run

    journal = tmp_path / "out" / "samples.jsonl"
    res = compare({"a": variant("a", 10.0), "b": variant("b", {"images_per_sec": 20.0, "cpu": [0.1]})}, 2,
                  str(journal))
    assert order == ["a", "b", "b", "a"]  # the second round in reverse
    assert res["a"]["samples"] == [10.0, 10.0] and res["b"]["rounds"] == [{"images_per_sec": 20.0, "cpu": [0.1]}] * 2
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(r["round"], r["variant"]) for r in rows] == [(1, "a"), (1, "b"), (2, "b"), (2, "a")]
    assert rows[0]["sample"] == {"images_per_sec": 10.0} and rows[1]["sample"]["cpu"] == [0.1]


def test_a_failure_in_a_later_round_leaves_the_earlier_samples_in_the_journal(tmp_path):
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("bench: the collectives on 8 host(s) failed")
        return 5.0

    journal = tmp_path / "samples.jsonl"
    with pytest.raises(RuntimeError, match="8 host"):
        compare({"steady": lambda: 7.0, "flaky": flaky}, 2, str(journal))
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(r["variant"], r["sample"]["images_per_sec"]) for r in rows] == [("steady", 7.0), ("flaky", 5.0)]


def test_every_sample_says_how_fast_the_machine_ran_and_a_slowed_one_is_flagged(tmp_path, capsys):
    """A shared host slows down with others' load (to half its speed here within minutes, with no steal time):
    the probe timed around each sample says so in the journal, the result and a warning naming the sample."""
    times = iter([0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1])  # the reference, then before and after each sample
    journal = tmp_path / "samples.jsonl"
    res = compare({"a": lambda: 10.0, "b": lambda: 20.0}, 2, str(journal), probe=lambda: next(times))
    assert res["a"]["machine_speed"] == [1.0, 1.0]
    assert res["b"]["machine_speed"] == [pytest.approx(0.5), 1.0]
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [round(r["machine_speed"], 2) for r in rows] == [1.0, 0.5, 1.0, 1.0]
    err = capsys.readouterr().err
    assert "below 0.8 of its speed at the start during 1 sample(s): b round 1 (0.50)" in err
    from hvdtrain.bench.runner import speed_probe
    assert 0 < speed_probe(1) < 5


def test_machine_names_the_processor_and_its_cores():
    info = machine()
    assert info["cores"] == os.cpu_count() and info["cpu"]


def test_the_ddp_timed_arm_runs_ddps_default_with_the_timing_hook_without_a_timeline(monkeypatch):
    """``--frameworks ddp-timed``: DDP's default bucket with the comm hook that times its buckets, whether or not
    --timeline-steps is given (the hook's own cost, against the ddp arm, which runs it only with a timeline)."""
    from hvdtrain.bench import arms
    calls = []
    monkeypatch.setattr(arms, "_ddp", lambda *args, **kwargs: calls.append(kwargs) or {})
    assert arms.parse_arms("ddp,ddp-timed") == ("ddp", "ddp bucket 1mb", arms.DDP_TIMED_ARM)
    for name in ("ddp", arms.DDP_TIMED_ARM):
        arms._arm(name, None, 2, 3, 1, 32, [], 60.0)()
    assert calls == [{"bucket_times": False}, {"bucket_times": True}]


def test_every_hvdtrain_arm_passes_flags_its_recipe_accepts(monkeypatch):
    """The hvdtrain arms of ``bench network`` (torch-buckets: ``--allreduce-groups buckets``, DDP's buckets under a
    quota too) run the MNIST recipe with their own flags; each set of flags is one the recipe's config takes."""
    from hvdtrain.bench import arms
    from hvdtrain.config import GROUPS_BUCKETS, TrainConfig, parse_overrides
    calls = {}
    monkeypatch.setattr(arms, "_hvdtrain", lambda *args, **kwargs: calls.setdefault(name, (args, kwargs)) and {})
    names = [a for group in arms.ARM_GROUPS if group.startswith(("torch", "hvdtrain")) for a in arms.ARM_GROUPS[group]]
    for name in names:
        arms._arm(name, None, 2, 3, 1, 32, [], 60.0)()
    assert set(calls) == set(names)
    for args, kwargs in calls.values():
        extra = list(args[5]) if len(args) > 5 else []
        parse_overrides(TrainConfig, extra + ["--framework", kwargs.get("framework", "mxnet")]).validate()
    buckets = calls[f"{arms.TORCH_ARM} buckets"]
    assert parse_overrides(TrainConfig, list(buckets[0][5])).allreduce_groups == GROUPS_BUCKETS
    assert buckets[1]["framework"] == "torch"


def test_bench_ddp_runs_the_candidates_named_beside_hvdtrain_and_refuses_an_unknown_one_before_running(monkeypatch):
    from hvdtrain.bench import ddp
    from hvdtrain.config import ConfigError
    ran = []

    def fake_compare(variants, rounds):
        ran.append(list(variants))
        return {name: {"images_per_sec": 1.0} for name in variants}
    monkeypatch.setattr(ddp, "compare", fake_compare)
    name = "idle wait then a cycle, the default groups"
    result = ddp.ddp("mnist", 2, 1, 1, 8, candidates=[name])
    assert ran[-1] == ["horovod", "ddp", "hvdtrain", f"hvdtrain, {name}"] and list(result["candidates"]) == [name]
    assert result["candidates"][name]["env"] == {"HOROVOD_IDLE_WAIT": "1"}
    ddp.ddp("mnist", 2, 1, 1, 8, candidates=[])
    assert ran[-1][3:] == [f"hvdtrain, {n}" for n in ddp.CANDIDATES]
    ddp.ddp("mnist", 2, 1, 1, 8)
    assert ran[-1] == ["horovod", "ddp", "hvdtrain"]
    with pytest.raises(ConfigError, match="unknown candidate 'one group'"):
        ddp.ddp("mnist", 2, 1, 1, 8, candidates=["one group"])
    assert len(ran) == 3


def test_bench_ddp_reports_each_rounds_wait_for_the_allreduces_and_cpu_from_hvdtrains_records():
    from hvdtrain.bench.ddp import waits
    rounds = [{"images_per_sec": 10.0, "phase_seconds": {"allreduce": 0.0042, "step": 0.001},
               "worker_cpu_per_step": [0.031, 0.032]},
              {"images_per_sec": 11.0, "phase_seconds": {"allreduce": 0.0059}, "worker_cpu_per_step": []}]
    assert waits(rounds) == {"allreduce_wait_ms": [4.2, 5.9], "cpu_ms_per_step": [31.5]}
    assert waits([]) == {}
