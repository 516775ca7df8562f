"""The command line's contract: bad input ends in one line naming the fix and exit status 2."""
import os

import pytest

from tests.helpers import describe, horovodrun, hvdtrain, run


def error_lines(result):
    return [line for line in result.stderr.splitlines() if "hvdtrain: error:" in line]


@pytest.mark.parametrize("args, fragment", [
    (["recipe", "nosuch"], "unknown recipe 'nosuch'; available: charlm, fashion-mnist, imagenet, mnist, regression"),
    (["recipe", "mnist", "--framework", "jax"], "--framework expects one of torch, mxnet, got 'jax'"),
    (["recipe", "mnist", "--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["recipe", "mnist", "--epochs", "two"], "--epochs expects an integer, got 'two'"),
    (["recipe", "mnist", "--bogus", "1"], "unknown option --bogus"),
    (["recipe", "mnist", "--data-dir", "/nonexistent/mnist"], "--data-dir /nonexistent/mnist does not exist"),
    (["recipe", "no.such.module:Trainer"], "cannot import recipe module 'no.such.module'"),
    (["recipe"], "recipe needs a NAME"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["export", "runs/x", "--output", "model.pt"], "--output names the directory the export writes its files into"),
    (["eval"], "eval needs a SOURCE"),
])
def test_bad_command_lines_exit_2_with_one_line(args, fragment, tmp_path):
    result = run(hvdtrain(*args, *(["--output-dir", str(tmp_path / "out")] if len(args) > 2 else [])), timeout=120)
    assert result.returncode == 2, describe(result)
    lines = error_lines(result)
    assert len(lines) == 1 and fragment in lines[0], describe(result)
    assert "Traceback" not in result.stderr
    assert not os.path.exists(tmp_path / "out"), "nothing is written for a bad command line"


def test_empty_data_dir_names_the_missing_files(tmp_path):
    result = run(hvdtrain("recipe", "mnist", "--data-dir", str(tmp_path)), timeout=120)
    assert result.returncode == 2
    (line,) = error_lines(result)
    assert "train-images-idx3-ubyte" in line and "t10k-labels-idx1-ubyte" in line


def test_missing_data_under_horovodrun_fails_fast_on_every_rank(tmp_path):
    result = run(horovodrun(2, *hvdtrain("recipe", "mnist", "--data-dir", str(tmp_path / "none"))), timeout=120)
    assert result.returncode != 0, describe(result)
    assert result.stderr.count("hvdtrain: error: --data-dir") + result.stdout.count("hvdtrain: error: --data-dir") >= 1


def test_list_and_help():
    listed = run(hvdtrain("list"), timeout=120)
    assert listed.returncode == 0 and "mnist" in listed.stdout
    helped = run(hvdtrain("recipe", "mnist", "--help"), timeout=120)
    assert helped.returncode == 0 and "--batch-size BATCH_SIZE" in helped.stdout and "--max-shift" in helped.stdout
    usage = run(hvdtrain("--help"), timeout=120)
    from hvdtrain.bench import BENCHMARKS
    assert usage.returncode == 0 and f"bench {'|'.join(BENCHMARKS)}" in usage.stdout, usage.stdout
    assert {"network", "convergence", "amp"} <= set(BENCHMARKS)
    for command in ("export", "eval"):  # help, not "needs a SOURCE"
        helped = run(hvdtrain(command, "--help"), timeout=120)
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: python -m hvdtrain {command} SOURCE"), \
            describe(helped)


def test_a_float16_run_is_evaluated_on_a_cpu(tmp_path):
    # Trained in fp16 (a GPU's auto; the CPU stand-in here), evaluated where there is no GPU: eval resolves the
    # precision for its own host instead of refusing the run's fp16.
    run_dir = str(tmp_path / "run")
    trained = run(horovodrun(2, *hvdtrain("recipe", "tests.tiny_recipe:TinyTrainer", "--framework", "mxnet",
                                          "--half-ops", "--epochs", "1", "--output-dir", run_dir)),
                  timeout=180, HVDTRAIN_GPU_STAND_IN="fp16")
    assert trained.returncode == 0 and " fp16 (auto: a GPU" in trained.stdout, describe(trained)
    result = run(horovodrun(2, *hvdtrain("eval", run_dir, "--recipe", "tests.tiny_recipe:TinyTrainer")), timeout=180)
    assert result.returncode == 0, describe(result)
    import json
    with open(os.path.join(run_dir, "eval", "eval.json")) as f:
        out = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = json.loads(f.read().splitlines()[-1])
    assert out["precision"] == "fp32" and out["count"] == 203, out
    # the trained model's figures, computed in fp32 instead of fp16
    assert abs(out["val_loss"] - last["val_loss"]) < 1e-2 and abs(out["val_accuracy"] - last["val_accuracy"]) < 0.02


def test_user_trainer_class_by_module_path(tmp_path):
    result = run(hvdtrain("recipe", "tests.tiny_recipe:TinyTrainer", "--epochs", "2", "--output-dir", str(tmp_path)),
                 timeout=180)
    assert result.returncode == 0, describe(result)
    assert "epoch 2/2" in result.stdout
    assert os.path.exists(tmp_path / "metrics.jsonl") and os.path.exists(tmp_path / "config.json")


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_crafted_checkpoint_is_refused_without_running_it(framework, tmp_path):
    import pickle
    target = tmp_path / "pwned"
    evil = tmp_path / "model.ckpt"
    evil.write_bytes(pickle.dumps(_Payload(str(target))))
    result = run(horovodrun(2, *hvdtrain("recipe", "tests.tiny_recipe:TinyTrainer", "--framework", framework,
                                         "--resume", str(evil), "--output-dir", str(tmp_path / "out"))), timeout=120)
    assert result.returncode != 0
    # horovodrun stops the other rank once one exits, sometimes before it prints: one line or two, never a traceback
    assert result.output.count("hvdtrain: error: cannot resume from") >= 1, describe(result)
    assert "] Traceback" not in result.output
    assert "was not completely written by hvdtrain" in result.output
    assert not target.exists()


def test_crafted_yaml_config_is_refused_without_running_it(tmp_path):
    target = tmp_path / "pwned"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"epochs: !!python/object/apply:os.system ['touch {target}']\n")
    result = run(hvdtrain("recipe", "mnist", "--config", str(cfg)), timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, describe(result)
    assert "is not plain YAML" in result.stderr and not target.exists()


def test_mxnet_fp16_without_gpu_is_refused_on_every_rank(tmp_path):
    result = run(horovodrun(2, *hvdtrain("recipe", "tests.tiny_recipe:TinyTrainer", "--framework", "mxnet",
                                         "--precision", "fp16", "--output-dir", str(tmp_path / "out"))), timeout=120)
    assert result.returncode != 0
    assert result.output.count("--precision fp16 needs a GPU on --framework mxnet") >= 1, describe(result)
    assert "] Traceback" not in result.output
