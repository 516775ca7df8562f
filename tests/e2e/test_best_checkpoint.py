"""The best checkpoint (best/) and --early-stop through the interruptions a real run meets: a kill between writing a
checkpoint and copying it to best/, a --max-steps stop inside an epoch and its resume, a --resume PATH that branches
from an older checkpoint, and an export of a checkpoint written inside an epoch. Every record is compared with an
uninterrupted run, not only the last (issue 47, items 1-4).

The regression recipe (scikit-learn's diabetes data, 21 steps per epoch at np=1) with --monitor val_mse
--early-stop 3 stops early after epoch 7 on this data; its best epoch is 4. The best figure itself depends on what
--precision auto picks (2959.51 in fp32, 2958.9 in bf16): it is read from the uninterrupted run's records, and the
module runs under both outcomes (the auto_precision fixture).
"""
import json
import os

import pytest

from hvdtrain import checkpoint
from tests.e2e.conftest import read_metrics
from tests.helpers import PY, describe, horovodrun, run

RECIPE = ["-m", "hvdtrain", "recipe", "regression", "--epochs", "8", "--monitor", "val_mse", "--early-stop", "3"]
FIGURES = ("epoch", "global_step", "train_loss", "val_loss", "val_mse", "val_mae", "lr")


def train(out, *extra, np_=1, expect=0):
    cmd = [PY, *RECIPE, "--output-dir", str(out), *extra]
    result = run(horovodrun(np_, *cmd) if np_ > 1 else cmd, timeout=240)
    assert result.returncode == expect, describe(result)
    return result


def figures(out):
    return [{k: r[k] for k in FIGURES} for r in read_metrics(str(out))]


def same(got, want):
    """Every record's figures equal; train_loss to float32 rounding (a resumed epoch adds the sums of its steps before
    the checkpoint, kept in float64, to those after it)."""
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert g["train_loss"] == pytest.approx(w["train_loss"], rel=1e-6), (g, w)
        assert {**g, "train_loss": 0} == {**w, "train_loss": 0}, (g, w)
    return True


def best_held(out):
    return [checkpoint.position_of(p) for p in checkpoint.list_checkpoints(os.path.join(out, "best"))]


def stopped_early(result, best):
    """The run's closing words: the early stop after epoch 7, and epoch 4's val_mse as the best."""
    return "early stop after epoch 7" in result.output and f"best {best:.6g} at epoch 4" in result.output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, auto_precision):
    """The uninterrupted run: its directory, its records' figures and its best val_mse (epoch 4's)."""
    out = tmp_path_factory.mktemp("best") / "whole"
    result = train(out, "--keep-checkpoints", "8")
    records = figures(out)
    best = min(records, key=lambda r: r["val_mse"])
    assert best["epoch"] == 4 and stopped_early(result, best["val_mse"]), describe(result)
    assert json.loads((out / "config.json").read_text())["precision"] == auto_precision
    return out, records, best["val_mse"]


def test_a_kill_between_the_checkpoint_and_its_best_copy_is_repaired_on_resume(uninterrupted, tmp_path):
    """Killed (SIGKILL) right after the checkpoint of a best epoch was written and before its copy to best/: the
    checkpoint's monitor state already names that epoch the best. The resume copies it to best/ from checkpoints/,
    and the run ends as the uninterrupted one, record for record."""
    whole, records, best = uninterrupted
    out = tmp_path / "kill"
    killer = ("import os, signal, sys\n"
              "import hvdtrain.checkpoint_policy as c\n"
              "def kill(self, path):\n"
              "    if 'ckpt-e0004' in path: os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return keep(self, path)\n"
              "keep, c.Checkpointer._keep_as_best = c.Checkpointer._keep_as_best, kill\n"
              "from hvdtrain.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    cmd = [PY, "-c", killer, *RECIPE[2:], "--output-dir", str(out)]
    killed = run(cmd, timeout=240)
    assert killed.returncode == -9, describe(killed)
    assert [r["epoch"] for r in read_metrics(str(out))] == [1, 2, 3, 4]  # the record comes before the checkpoint
    assert best_held(out) == [(2, 42)]  # an older best: the copy of epoch 4 never happened
    resumed = train(out)
    assert "did not hold the best epoch's checkpoint" in resumed.output, describe(resumed)
    assert stopped_early(resumed, best), describe(resumed)
    assert best_held(out) == [(4, 84)] == best_held(whole)
    assert same(figures(out), records)  # every record
    evaluated = run([PY, "-m", "hvdtrain", "eval", str(out / "best")], timeout=120)
    assert evaluated.returncode == 0 and f"val_mse {best:.1f}" in evaluated.output, describe(evaluated)
    # issue 47, item 7: eval and export of RUN/best go beside the run (not ./runs/eval-RECIPE-FRAMEWORK, shared by
    # every run, nor inside best/), and a regression's export says what its output is
    assert (out / "eval-best" / "eval.json").exists()
    exported = run([PY, "-m", "hvdtrain", "export", str(out / "best")], timeout=120)
    assert exported.returncode == 0, describe(exported)
    meta = json.loads((out / "export-native-torch-best" / "model.json").read_text())
    assert "disease progression" in meta["output"] and "logits" not in meta["output"], meta["output"]
    assert meta["metrics"]["val_mse"] == pytest.approx(best, abs=0.01)
    assert sorted(os.listdir(out / "best")) == [checkpoint.checkpoint_name(4, 84),
                                                checkpoint.checkpoint_name(4, 84) + ".sha256"]


def test_a_mid_epoch_stop_and_resume_stops_where_the_uninterrupted_run_stops(uninterrupted, tmp_path):
    """--max-steps 115 stops inside epoch 6, after the best epoch (4) and one miss (5): the partial epoch must not
    count as a second miss when the resumed run judges epoch 6 whole (before the fix: "early stop after epoch 6").
    The resumed run ends as the uninterrupted one: the same early stop, best/ and every record's figures, the resumed
    epoch's train_loss over the whole epoch."""
    whole, records, best = uninterrupted
    out = tmp_path / "stopped"
    train(out, "--max-steps", "115")
    assert [r["global_step"] for r in read_metrics(str(out))] == [21, 42, 63, 84, 105, 115]
    resumed = train(out)
    assert "(epoch 5, step 115)" in resumed.output, describe(resumed)
    assert stopped_early(resumed, best), describe(resumed)
    assert same(figures(out), records)
    assert best_held(out) == best_held(whole) == [(4, 84)]


def test_a_resume_from_an_older_checkpoint_branches_and_sets_the_abandoned_future_aside(uninterrupted, tmp_path):
    """--resume PATH at epoch 2 of a run that reached epoch 7 (the same flags, stopped after epoch 3): its later
    checkpoints and best/ (epoch 4) move to abandoned-*/, best/ holds the branch's own best (epoch 2, copied back from
    checkpoints/; epoch 3 is no better), and --resume auto, eval and --init-from then see the branch only."""
    import shutil
    whole, records, _ = uninterrupted
    out = tmp_path / "branch"
    shutil.copytree(whole, out)
    older = os.path.join(out, "checkpoints", checkpoint.checkpoint_name(2, 42))
    assert os.path.exists(older)
    branched = train(out, "--resume", older, "--max-steps", "63", "--keep-checkpoints", "8")
    assert "branches at step 42" in branched.output, describe(branched)
    (aside,) = [d for d in os.listdir(out) if d.startswith("abandoned-")]
    moved = [checkpoint.position_of(p) for p in checkpoint.list_checkpoints(os.path.join(out, aside, "checkpoints"))]
    assert moved and all(step > 42 for _, step in moved), moved
    assert best_held(os.path.join(out, aside)) == [(4, 84)]
    steps = [checkpoint.position_of(p)[1] for p in checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))]
    assert max(steps) == 63, steps  # the branch's epoch 3 is the newest
    assert best_held(out) == [(2, 42)]  # epoch 3 (3054 in fp32) is no better than epoch 2 (2974)
    assert figures(out) == records[:3]
    # what --resume auto, eval RUN and --init-from RUN take: the branch's newest
    assert checkpoint.position_of(checkpoint.latest_valid(os.path.join(out, "checkpoints"))) == (3, 63)


def test_an_export_of_a_checkpoint_inside_an_epoch_carries_its_own_records_figures(uninterrupted, tmp_path):
    """A --max-steps stop at step 30 writes a checkpoint inside epoch 2 and its record at global step 30: the
    export labels the weights with that record's figures, which eval of the same weights reproduces; never epoch 1's."""
    out = tmp_path / "step"
    train(out, "--max-steps", "30")
    record = read_metrics(str(out))[-1]
    assert record["global_step"] == 30
    path = os.path.join(out, "checkpoints", checkpoint.checkpoint_name(1, 30))
    exported = run([PY, "-m", "hvdtrain", "export", path, "--output", str(tmp_path / "export")], timeout=180)
    assert exported.returncode == 0, describe(exported)
    meta = json.loads((tmp_path / "export" / "model.json").read_text())
    assert meta["global_step"] == 30 and meta["metrics"]["val_mse"] == record["val_mse"], meta
    evaluated = run([PY, "-m", "hvdtrain", "eval", path], timeout=120)
    assert evaluated.returncode == 0 and f"val_mse {record['val_mse']:.1f}" in evaluated.output, describe(evaluated)
