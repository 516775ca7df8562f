import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from recipes.mnist import FILES, MNISTConfig, MNISTTrainer, read_idx, write_idx
from hvdtrain import ConfigError
from tests.helpers import ROOT


def test_idx_round_trip_plain_and_gzip(tmp_path):
    a = np.random.default_rng(0).integers(0, 255, size=(5, 28, 28), dtype=np.uint8)
    write_idx(str(tmp_path / "x"), a)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "x")), a)
    with gzip.open(tmp_path / "x.gz", "wb") as f:
        f.write((tmp_path / "x").read_bytes())
    np.testing.assert_array_equal(read_idx(str(tmp_path / "x.gz")), a)


def test_truncated_or_foreign_files_are_named(tmp_path):
    write_idx(str(tmp_path / "x"), np.zeros((4, 2), np.uint8))
    data = (tmp_path / "x").read_bytes()
    (tmp_path / "x").write_bytes(data[:-1])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(str(tmp_path / "x"))
    (tmp_path / "y").write_bytes(b"\x89PNG....")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(str(tmp_path / "y"))


def test_embedded_digits_are_written_as_mnist(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_digits_mnist.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    xtr, ytr = read_idx(str(tmp_path / FILES["train_images"])), read_idx(str(tmp_path / FILES["train_labels"]))
    xte, yte = read_idx(str(tmp_path / FILES["test_images"])), read_idx(str(tmp_path / FILES["test_labels"]))
    assert xtr.shape[1:] == (28, 28) and xtr.dtype == np.uint8
    assert len(xtr) + len(xte) == 1797 and len(xtr) == len(ytr) and len(xte) == len(yte)
    assert set(np.unique(yte).tolist()) == set(range(10)), "the split is stratified"
    assert xtr[:, :4].max() == 0 and xtr[:, 4:24, 4:24].max() > 200, "digits sit in the central 20x20 box"


def test_missing_files_error_names_them_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        MNISTTrainer(MNISTConfig(data_dir=str(tmp_path))).check()
    msg = str(e.value)
    for stem in FILES.values():
        assert stem in msg
    assert "make_digits_mnist.py" in msg and "\n" not in msg
