import os
import subprocess
import sys

import numpy as np
import pytest

from hvdtrain.vision import ImageFolder, ImageTransform, RecordIODataset, recordio_num_classes, write_recordio
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    out = tmp_path_factory.mktemp("photos")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_photo_folder.py"), str(out), "--tile", "48",
                    "--train-per-class", "6", "--val-per-class", "2"], check=True, capture_output=True, timeout=120)
    rec = tmp_path_factory.mktemp("rec")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_recordio.py"), str(out), str(rec)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return str(out), str(rec)


def test_imagefolder_and_recordio_give_the_same_samples(photos):
    folder, rec = photos
    for train in (True, False):
        t = ImageTransform(train=train, size=32, resize=40)
        a = ImageFolder(os.path.join(folder, "train"), t, seed=3)
        b = RecordIODataset(os.path.join(rec, "train.rec"), os.path.join(rec, "train.idx"), t, seed=3)
        assert len(a) == len(b) == 12 and a.classes == ["china", "flower"]
        for i in range(len(a)):
            (xa, ya), (xb, yb) = a[i], b[i]
            assert ya == yb and xa.shape == xb.shape == (3, 32, 32)
            np.testing.assert_array_equal(xa, xb)


def test_the_imagenet_recipe_takes_its_classes_from_the_records(photos):
    # Not 1000 (the old default for RecordIO): MXNet trained a 1000-way classifier on a 10-class set that way.
    from recipes.imagenet import ImageNetTrainer
    folder, rec = photos
    assert recordio_num_classes(os.path.join(rec, "train.rec"), os.path.join(rec, "train.idx")) == 2
    assert ImageNetTrainer(data_dir=rec, data_format="recordio").num_classes == 2
    assert ImageNetTrainer(data_dir=folder).num_classes == 2
    assert ImageNetTrainer(data_dir=rec, num_classes=7).num_classes == 7


def test_recordio_files_are_readable_by_mxnet(photos):
    mx = pytest.importorskip("mxnet")
    _, rec = photos
    reader = mx.recordio.MXIndexedRecordIO(os.path.join(rec, "val.idx"), os.path.join(rec, "val.rec"), "r")
    header, img = mx.recordio.unpack_img(reader.read_idx(3))
    assert header.label == 1.0 and img.shape == (48, 48, 3)


def test_every_rank_of_mxnets_record_reader_sees_every_class(tmp_path):
    # ImageRecordIter gives rank r the r-th contiguous part of the file; records written in class order gave rank 0
    # of 2 only the first half of the classes (MXNet's RecordIO training reached 35% where the ImageFolder reached
    # 66% on the same images), so write_recordio shuffles the records as it writes them.
    mx = pytest.importorskip("mxnet")
    from PIL import Image
    classes = 4
    for c in range(classes):
        os.makedirs(tmp_path / "train" / f"class{c}")
        for i in range(16):
            Image.new("RGB", (8, 8), (c * 60, i * 15, 0)).save(tmp_path / "train" / f"class{c}" / f"{i:02d}.png")
    write_recordio(ImageFolder(str(tmp_path / "train")), str(tmp_path / "train"))
    for part in range(2):
        it = mx.io.ImageRecordIter(path_imgrec=str(tmp_path / "train.rec"), path_imgidx=str(tmp_path / "train.idx"),
                                   data_shape=(3, 8, 8), batch_size=32, num_parts=2, part_index=part)
        labels = np.concatenate([b.label[0].asnumpy() for b in it])
        assert len(labels) == 32 and sorted(set(labels.astype(int).tolist())) == list(range(classes)), (part, labels)


def test_augmentation_is_deterministic_per_epoch_and_index(photos):
    folder, _ = photos
    ds = ImageFolder(os.path.join(folder, "train"), ImageTransform(train=True, size=32, resize=40), seed=1)
    first = ds[0][0]
    np.testing.assert_array_equal(first, ds[0][0])
    ds.set_epoch(1)
    assert not np.array_equal(first, ds[0][0])
    val = ImageTransform(train=False, size=32, resize=40)
    x = val(__import__("PIL.Image", fromlist=["Image"]).new("RGB", (80, 60), (255, 0, 0)), None)
    assert x.shape == (3, 32, 32) and x[0].mean() > 2 and x[1].mean() < -1


def test_corrupt_images_are_named(photos, tmp_path):
    folder, _ = photos
    bad = tmp_path / "train" / "flower"
    bad.mkdir(parents=True)
    (bad / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    ds = ImageFolder(str(tmp_path / "train"), ImageTransform(train=False, size=32, resize=40))
    with pytest.raises(RuntimeError, match="broken.jpg"):
        ds[0]
    with pytest.raises(RuntimeError, match="broken.jpg"):
        write_recordio(ds, str(tmp_path / "out"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")], "no partial RecordIO file is left"


def test_color_jitter_and_lighting_are_off_unless_asked_and_change_training_images_only_when_asked():
    from PIL import Image
    img = Image.fromarray(np.full((32, 32, 3), 120, np.uint8))  # grey: contrast and saturation leave it alone
    plain = ImageTransform(train=True, size=32, resize=32, min_area=1.0, flip=False)
    jitter = ImageTransform(train=True, size=32, resize=32, min_area=1.0, flip=False, jitter=0.4)
    base = plain(img, np.random.default_rng(0))
    assert np.array_equal(base, ImageTransform(train=True, size=32, resize=32, min_area=1.0, flip=False, jitter=0.0,
                                               lighting=0.0)(img, np.random.default_rng(0)))
    mean, std = np.asarray(plain.mean).ravel(), np.asarray(plain.std).ravel()
    pixels = [(jitter(img, np.random.default_rng(seed))[0, 0, 0] * std[0] + mean[0]) * 255 for seed in range(200)]
    ratios = np.asarray(pixels) / 120  # brightness alone moves a grey image: by a factor in [0.6, 1.4]
    assert ratios.min() >= 0.6 - 1e-4 and ratios.max() <= 1.4 + 1e-4 and ratios.max() - ratios.min() > 0.5
    val = ImageTransform(train=False, size=32, resize=32, jitter=0.4, lighting=0.1)
    assert np.array_equal(val(img, None), ImageTransform(train=False, size=32, resize=32)(img, None))


def test_pca_lighting_adds_alexnets_noise_the_same_to_every_pixel():
    from hvdtrain.vision import PCA_EIGVAL, PCA_EIGVEC, pca_lighting
    arr = np.full((4, 4, 3), 100.0, np.float32)
    shifts = np.stack([pca_lighting(arr, 0.1, np.random.default_rng(s))[1, 2] - 100 for s in range(2000)])
    expected = 0.1 * np.sqrt(((PCA_EIGVEC * PCA_EIGVAL) ** 2).sum(axis=1))  # per channel, from the eigen-decomposition
    assert np.allclose(shifts.std(axis=0), expected, rtol=0.1) and np.allclose(shifts.mean(axis=0), 0, atol=0.5)
