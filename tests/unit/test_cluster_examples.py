"""The cluster launch examples in scripts/cluster are files a user copies: they must parse and agree with the CLI."""
import os
import re
import shlex
import subprocess

import pytest
import yaml

from hvdtrain.config import parse_overrides
from hvdtrain.raylaunch import parse_args
from recipes.imagenet import ImageNetTrainer

CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                       "cluster")


def _recipe_flags(argv):
    """The flags after 'recipe imagenet', checked by the recipe's own parser."""
    i = argv.index("recipe")
    assert argv[i + 1] == "imagenet"
    return parse_overrides(ImageNetTrainer.config_class, argv[i + 2:])


def test_mpijob_manifest():
    with open(os.path.join(CLUSTER, "mpijob_imagenet.yaml")) as f:
        job = yaml.safe_load(f)
    assert job["kind"] == "MPIJob" and job["apiVersion"] == "kubeflow.org/v2beta1"
    specs = job["spec"]["mpiReplicaSpecs"]
    command = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    np = int(command[command.index("-np") + 1])
    assert np == job["spec"]["slotsPerWorker"] * specs["Worker"]["replicas"]
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == job["spec"]["slotsPerWorker"]
    cfg = _recipe_flags(command)
    assert cfg.framework == "mxnet" and cfg.precision == "fp16"


# What KubeRay's ray.io/v1 CRD requires (ray-operator/apis/ray/v1: the fields its Go types declare without omitempty),
# beside Kubernetes' own: every container a name and an image.
RAYJOB_REQUIRED = {"rayClusterSpec": ("headGroupSpec",), "headGroupSpec": ("rayStartParams", "template"),
                   "workerGroupSpec": ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template")}


def _containers(template):
    containers = template["spec"]["containers"]
    assert containers and all(c.get("name") and c.get("image") for c in containers), containers
    return containers


def test_rayjob_manifest():
    """The KubeRay RayJob: the CRD's required fields, an entrypoint that hvdtrain ray and the recipe accept, ranks
    that the worker pods can hold, and the Ray version make install pins."""
    with open(os.path.join(CLUSTER, "rayjob_imagenet.yaml")) as f:
        job = yaml.safe_load(f)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    head, groups = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    for key, part in [("rayClusterSpec", cluster), ("headGroupSpec", head)] + [("workerGroupSpec", g) for g in groups]:
        assert all(field in part for field in RAYJOB_REQUIRED[key]), (key, part.keys())
    _containers(head["template"])
    _containers(spec["submitterPodTemplate"])
    entry = shlex.split(spec["entrypoint"])
    assert entry[:4] == ["python", "-m", "hvdtrain", "ray"], entry
    ray_job, command = parse_args(entry[4:])
    cfg = _recipe_flags(command)
    assert cfg.data_dir.startswith("s3://") and cfg.output_dir.startswith("s3://"), "results must outlive the cluster"
    # each pod holds whole ranks, the pods hold them all, and a pod's limits are what it tells Ray it has
    held = 0
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g
        cpus, gpus = float(g["rayStartParams"]["num-cpus"]), float(g["rayStartParams"]["num-gpus"])
        held += g["replicas"] * int(min(cpus / ray_job.cpus_per_worker, gpus / ray_job.gpus_per_worker))
        (worker,) = _containers(g["template"])
        assert float(worker["resources"]["limits"]["cpu"]) == cpus
        assert float(worker["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert held >= ray_job.num_workers and float(head["rayStartParams"]["num-cpus"]) == 0, "no rank on the head"
    with open(os.path.join(os.path.dirname(os.path.dirname(CLUSTER)), "setup.cfg")) as f:
        pinned = re.search(r"ray\[default\]==([\d.]+)", f.read()).group(1)
    assert cluster["rayVersion"] == pinned


def test_slurm_script():
    path = os.path.join(CLUSTER, "slurm_train.sbatch")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    with open(path) as f:
        text = f.read()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives
    assert not [d for d in directives if "gpu" in d], "GPUs are asked for on the command line: the script runs on CPU nodes"
    srun = text[text.index("\nsrun ") + 1:].replace("\\\n", " ").split()
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in srun, "Slurm >= 22.05 srun does not inherit it"
    # tests/e2e/test_slurm.py submits this script, unchanged, to a real Slurm cluster


def test_shell_examples_parse_and_hostfile_has_slots():
    for name in ("mpirun.sh", "doctor_all_hosts.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(CLUSTER, name)]).returncode == 0, name
    with open(os.path.join(CLUSTER, "hostfile.example")) as f:
        hosts = [line.split() for line in f if line.strip() and not line.startswith("#")]
    assert hosts and all(len(h) == 2 and h[1].startswith("slots=") for h in hosts)


@pytest.mark.parametrize("case, expected", [("local", "ens5"), ("routed", "ib0"), ("loopback", "")])
def test_slurm_script_finds_the_interface_to_the_first_node(case, expected, tmp_path):
    # The script's route_iface, run with stand-ins for scontrol, getent and ip that describe a node whose interfaces
    # are not eth0 (the e2e test's namespace hosts use eth0, which a hard-coded default would also give).
    fake = {
        "scontrol": 'echo node-a; echo node-b',
        "getent": {"local": 'echo "10.1.0.5 STREAM node-a"', "routed": 'echo "10.9.0.7 STREAM node-a"',
                   "loopback": 'echo "127.0.1.1 STREAM node-a"'}[case],
        "ip": 'case "$*" in\n'
              '  "-o -4 addr show") echo "1: lo    inet 127.0.0.1/8 scope host lo"; '
              'echo "2: ens5    inet 10.1.0.5/24 brd 10.1.0.255 scope global ens5";;\n'
              '  "-o route get 10.9.0.7") echo "10.9.0.7 via 10.1.0.1 dev ib0 src 10.1.0.5 uid 0";;\n'
              'esac',
    }
    for name, body in fake.items():
        path = tmp_path / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    with open(os.path.join(CLUSTER, "slurm_train.sbatch")) as f:
        text = f.read()
    function = text[text.index("route_iface() {"):text.index("\n}\n", text.index("route_iface() {")) + 3]
    result = subprocess.run(["bash", "-c", function + "route_iface | head -n1"], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                                 "SLURM_JOB_NODELIST": "node-[a-b]"}, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == expected, result
