"""The README's Trainer subclass is real: extracted from README.md and launched with horovodrun as shown there."""
import json
import os
import re

import pytest

from tests.helpers import PY, ROOT, describe, horovodrun, run


def readme_example() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- example: my_trainer.py -->\n```python\n(.*?)```", text, re.S)
    assert m, "README lost its subclassing example"
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
