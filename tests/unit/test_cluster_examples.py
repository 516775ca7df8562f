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
    path = os.path.join(CLUSTER, "slurm_imagenet.sbatch")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    with open(path) as f:
        text = f.read()
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH --") and "=" in line)
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]  # one task per GPU
    srun = text[text.index("srun "):].replace("\\\n", " ").split()
    # Shell expansions stand for values the user's environment gives: a framework name, or a path.
    argv = [("mxnet" if prev == "--framework" else "/data/x") if "${" in a else a for prev, a in zip([""] + srun, srun)]
    cfg = _recipe_flags(argv)
    assert cfg.precision == "fp16" and cfg.num_workers > 0


def test_shell_examples_parse_and_hostfile_has_slots():
    for name in ("mpirun.sh", "doctor_all_hosts.sh"):
        assert subprocess.run(["bash", "-n", os.path.join(CLUSTER, name)]).returncode == 0, name
    with open(os.path.join(CLUSTER, "hostfile.example")) as f:
        hosts = [line.split() for line in f if line.strip() and not line.startswith("#")]
    assert hosts and all(len(h) == 2 and h[1].startswith("slots=") for h in hosts)
