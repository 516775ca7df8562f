import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The embedded MNIST-format digits, written once per test session."""
    out = tmp_path_factory.mktemp("digits")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_digits_mnist.py"), str(out)],
                   check=True, capture_output=True, timeout=120)
    return str(out)


def read_metrics(output_dir: str) -> list:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
