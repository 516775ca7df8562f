"""The README's Trainer subclass and the guides' examples are real: extracted from the page and launched with
horovodrun as shown there."""
import json
import os
import re

import pytest

from tests.helpers import PY, ROOT, describe, horovodrun, run


def readme_example(name: str = "my_trainer.py", page: str = "README.md") -> str:
    text = open(os.path.join(ROOT, page)).read()
    m = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert m, f"{page} lost its example {name}"
    return m.group(1)


def test_example_is_under_30_lines():
    assert len(readme_example().strip().splitlines()) < 30


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_readme_subclass_trains_under_horovodrun(framework, tmp_path):
    (tmp_path / "my_trainer.py").write_text(readme_example())
    cmd = horovodrun(2, PY, "-m", "hvdtrain", "recipe", "my_trainer:RingsTrainer", "--framework", framework,
                     "--width", "32", "--epochs", "5", "--output-dir", str(tmp_path / "out"))
    result = run(cmd, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, describe(result)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    assert last["epoch"] == 5 and last["val_accuracy"] > 0.95, last


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_guide_regression_reports_its_own_loss_and_metrics(framework, tmp_path):
    (tmp_path / "my_regression.py").write_text(readme_example("my_regression.py", "docs/own-model.md"))
    cmd = horovodrun(2, PY, "-m", "hvdtrain", "recipe", "my_regression:SineTrainer", "--framework", framework,
                     "--optimizer", "adam", "--base-lr", "0.01", "--epochs", "20", "--precision", "fp32",
                     "--output-dir", str(tmp_path / "out"))
    result = run(cmd, timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, describe(result)
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    # The guide says about 0.004; sin(3x) over [-1, 1] has a variance of 0.46.
    assert last["val_mse"] < 0.02 and last["val_mae"] < 0.15, last
    assert last["val_loss"] == pytest.approx(last["val_mse"], rel=1e-5)  # its loss is the squared error
    assert "val_accuracy" not in last
