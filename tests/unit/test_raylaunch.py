"""hvdtrain ray's pure parts: its flags, and the ranks it gives the workers Ray placed (tests/e2e/test_ray.py runs
the whole on a Ray cluster)."""
import pytest

from hvdtrain.config import ConfigError
from hvdtrain.raylaunch import RayJob, assign_ranks, parse_args


def test_ranks_go_node_by_node_from_the_drivers_with_each_nodes_gpus_in_local_rank_order():
    places = [{"node_id": "b", "ip": "10.0.0.2", "gpus": ["3"]}, {"node_id": "a", "ip": "10.0.0.1", "gpus": ["0"]},
              {"node_id": "b", "ip": "10.0.0.2", "gpus": ["1"]}, {"node_id": "c", "ip": "10.0.0.3", "gpus": ["2"]},
              {"node_id": "a", "ip": "10.0.0.1", "gpus": ["5"]}]
    slots = assign_ranks(places, first_ip="10.0.0.1")
    by_worker = [(s["rank"], s["local_rank"], s["local_size"], s["cross_rank"], s["cross_size"], s["gpus"])
                 for s in slots]
    assert by_worker == [(2, 0, 2, 1, 3, "3,1"), (0, 0, 2, 0, 3, "0,5"), (3, 1, 2, 1, 2, "3,1"),
                         (4, 0, 1, 2, 3, "2"), (1, 1, 2, 0, 2, "0,5")]
    assert [s["hostname"] for s in slots] == ["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.1"]


def test_flags_and_what_they_refuse():
    job, command = parse_args(["--address", "h:6379", "--num-workers", "4", "--cpus-per-worker=2", "--env", "A=1",
                               "--placement", "spread", "recipe", "mnist", "--epochs", "1"])
    assert (job.address, job.num_workers, job.cpus_per_worker, job.placement, job.env) == \
        ("h:6379", 4, 2.0, "spread", {"A": "1"})
    assert command == ["recipe", "mnist", "--epochs", "1"] and job.bundle() == {"CPU": 2.0}
    for argv, says in [(["recipe", "mnist"], "--num-workers N is required"),
                       (["--num-workers", "2"], "no command"),
                       (["--num-workers"], "expects a value"),
                       (["--num-workers", "0", "recipe", "m"], "at least 1"),
                       (["--num-workers", "2", "--gpus-per-worker", "-1", "recipe", "m"], "must be 0 or more"),
                       (["--num-workers", "2", "--max-workers", "1", "recipe", "m"], "need 1 <= MIN <= N <= MAX"),
                       (["--nodes", "2", "recipe", "m"], "unknown option '--nodes'")]:
        with pytest.raises(ConfigError, match=None) as e:
            parse_args(argv)
        assert says in str(e.value), (argv, str(e.value))
    assert RayJob(num_workers=2, gpus_per_worker=1).bundle() == {"CPU": 1.0, "GPU": 1.0}
