"""The cluster launch examples in scripts/cluster are files a user copies: they must parse and agree with the CLI."""
import os
import subprocess

import yaml

from hvdtrain.config import parse_overrides
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
