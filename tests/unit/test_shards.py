"""Sharded datasets without a store or a framework (hvdtrain.shards): packing and reading back, the order of an epoch
over ranks, a resume's offset, the cache's bound; and the turbo decoder against PIL's (hvdtrain.vision)."""
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from hvdtrain.basics import ConfigError
from hvdtrain.shards import ShardStore, ShardStreamSampler, ShardedImages, pack
from hvdtrain.vision import ImageFolder, ImageTransform, image_transform
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    out = tmp_path_factory.mktemp("photos")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_photo_folder.py"), str(out), "--tile", "48",
                    "--train-per-class", "23", "--val-per-class", "4"], check=True, capture_output=True, timeout=120)
    return str(out)


@pytest.fixture(scope="module")
def shards(photos, tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("shards"))
    pack(photos, dest, shard_bytes=8 * 1024, log=lambda line: None)  # a few images a shard
    return dest


def test_pack_writes_webdataset_tars_that_hold_every_sample_once(photos, shards):
    with open(os.path.join(shards, "index.json")) as f:
        index = json.load(f)
    train = index["splits"]["train"]
    assert train["samples"] == 46 and len(train["shards"]) >= 6 and index["classes"] == ["china", "flower"]
    folder = ImageFolder(os.path.join(photos, "train"))
    seen = []
    for entry in train["shards"]:
        with tarfile.open(os.path.join(shards, entry["name"])) as tar:  # plain tar: what WebDataset reads
            names = tar.getnames()
            assert len(names) == 2 * entry["samples"] and all(n.endswith((".jpg", ".cls")) for n in names)
            for name in names[::2]:
                key = int(name.split(".")[0])
                image = tar.extractfile(name).read()
                label = int(tar.extractfile(name.replace(".jpg", ".cls")).read())
                path, want = folder.samples[key]
                assert label == want and image == open(path, "rb").read()
                seen.append(key)
    assert sorted(seen) == list(range(46)) and seen != sorted(seen), "every sample once, in a shuffled order"


def test_a_sharded_dataset_gives_the_folders_samples(photos, shards):
    t = ImageTransform(train=True, size=32, resize=40)
    ds = ShardedImages(ShardStore(shards), "train", t, seed=3)
    folder = ImageFolder(os.path.join(photos, "train"), t, seed=3)
    assert len(ds) == 46 and ds.num_classes == 2
    for i in (0, 7, 45):
        data, label, name = ds.read(i)
        key = int(name.rpartition(":")[2])
        assert label == folder.samples[key][1] and data == open(folder.samples[key][0], "rb").read()


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_each_epoch_deals_every_sample_to_one_rank_and_each_shard_to_one(shards, size):
    ds = ShardedImages(ShardStore(shards), "train", None)
    kept = []
    for epoch in (0, 1):
        samplers = [ShardStreamSampler(ds, r, size, seed=4) for r in range(size)]
        streams = []
        for s in samplers:
            s.set_epoch(epoch)
            streams.append(s.indices())
        assert len({len(s) for s in streams}) == 1, "every rank runs the same steps"
        assert set(np.concatenate(streams).tolist()) == set(range(46))
        owners = [{ds.locate(int(i))[0] for i in s} for s in streams]
        kept.append(owners)
        if size <= len(ds.shards) // 2:
            for a in range(size):
                for b in range(a + 1, size):
                    assert not owners[a] & owners[b], "each rank reads shards of its own"
    assert kept[0] == kept[1], "each rank keeps its shards from epoch to epoch (its host's cache stays warm)"
    again = ShardStreamSampler(ds, 0, size, seed=4)
    again.set_epoch(1)
    np.testing.assert_array_equal(again.indices(), streams[0])
    other = ShardStreamSampler(ds, 0, size, seed=4)
    other.set_epoch(0)
    assert not np.array_equal(other.indices(), streams[0]) or size == 1 and len(ds.shards) == 1


def test_an_offset_continues_every_rank_where_it_stopped(shards):
    ds = ShardedImages(ShardStore(shards), "train", None)
    whole = []
    for r in range(2):
        s = ShardStreamSampler(ds, r, 2, seed=1)
        s.set_epoch(2)
        whole.append(s.indices())
    for r in range(2):
        s = ShardStreamSampler(ds, r, 2, seed=1)
        s.set_epoch(2, offset=3 * 4 * 2)  # 3 steps of 4 on 2 ranks
        np.testing.assert_array_equal(s.indices(), whole[r][12:])
        assert len(s) == len(whole[r]) - 12


def test_the_cache_keeps_its_bound_and_what_is_in_use(tmp_path):
    store = ShardStore("s3://bucket/prefix", cache=str(tmp_path), cache_bytes=250)
    os.makedirs(store.cache)
    for i, n in enumerate(("a.tar", "b.tar", "c.tar")):
        with open(os.path.join(store.cache, n), "wb") as f:
            f.write(bytes(100))
        os.utime(os.path.join(store.cache, n), (i, i))
    assert store.evict(keep=["a.tar"], room=100) == 200  # the oldest not kept go first; the one in use stays
    assert sorted(store.cached()) == ["a.tar"]


def test_a_directory_without_an_index_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no index.json: pack a dataset there with 'python -m hvdtrain data"):
        ShardStore(str(tmp_path)).read_index()


def test_the_turbo_decoder_crops_as_pil_does_and_hands_out_pixels(photos):
    pytest.importorskip("simplejpeg")
    pytest.importorskip("cv2")
    for train in (True, False):
        kwargs = dict(train=train, size=32, resize=40)
        pil = ImageFolder(os.path.join(photos, "train"), image_transform("pil", **kwargs), seed=5)
        turbo = ImageFolder(os.path.join(photos, "train"), image_transform("turbo", **kwargs), seed=5)
        mean, std = (np.asarray(v, np.float32).reshape(3, 1, 1) for v in turbo.normalize_on_device)
        assert pil.normalize_on_device is None
        for i in range(0, 46, 5):
            (x, y), (u, v) = pil[i], turbo[i]
            assert u.dtype == np.uint8 and u.shape == x.shape == (3, 32, 32) and y == v
            # the same crop and flip, decoded and resized by other code: a few grey levels apart on average
            diff = np.abs((u / np.float32(255) - mean) / std - x).mean() * 0.226 * 255
            assert diff < 6, (train, i, diff)


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_both_backends_normalize_pixels_on_the_device_as_the_cpu_would(framework):
    pixels = np.random.default_rng(0).integers(0, 256, (4, 3, 8, 8), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3], np.int64)
    t = image_transform("turbo", train=False, size=8, resize=8) if _has_turbo() else None
    spec = t.normalize_on_device if t is not None else ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    mean, std = (np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in spec)
    want = (pixels.astype(np.float32) / 255 - mean) / std
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from hvdtrain.backends.torch import TorchBackend
        backend = object.__new__(TorchBackend)
        backend.device = torch.device("cpu")
        x, y = backend._pixels_to_device(spec, (torch.from_numpy(pixels), torch.from_numpy(labels)))
        got, got_y = x.numpy(), y.numpy()
    else:
        pytest.importorskip("mxnet")
        from hvdtrain.backends.gluoncv_compat import import_mxnet
        from hvdtrain.backends.mxnet import MXNetBackend
        mx = import_mxnet()
        backend = object.__new__(MXNetBackend)
        backend.mx, backend.ctx = mx, mx.cpu()
        x, y = backend._pixels_to_device(spec, [mx.nd.array(pixels, dtype="uint8"), labels])
        got, got_y = x.asnumpy(), y.asnumpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got_y, labels)


def _has_turbo() -> bool:
    try:
        import cv2  # noqa: F401
        import simplejpeg  # noqa: F401
        return True
    except ImportError:
        return False


def test_the_device_decoder_draws_the_same_boxes_and_finishes_on_the_device(photos):
    """--decoder device: the loader hands over the encoded image and its crop box (the same draws as the other
    decoders); the PyTorch backend decodes, crops, resizes, flips and normalizes on its device, here the CPU (the
    GPU path's stand-in); a few grey levels from the turbo decoder's images."""
    pytest.importorskip("simplejpeg")
    torch = pytest.importorskip("torch")
    from hvdtrain.backends.torch import TorchBackend
    from hvdtrain.vision import EncodedImages
    backend = object.__new__(TorchBackend)
    backend.device = torch.device("cpu")
    for train in (True, False):
        kwargs = dict(train=train, size=32, resize=40)
        device = ImageFolder(os.path.join(photos, "train"), image_transform("device", **kwargs), seed=5)
        turbo = ImageFolder(os.path.join(photos, "train"), image_transform("turbo", **kwargs), seed=5)
        picks = list(range(0, 46, 5))
        batch = device.collate([device[i] for i in picks])
        assert isinstance(batch[0], EncodedImages) and len(batch[0]) == len(picks)
        assert batch[0].shape == (3, 32, 32) and batch[1].tolist() == [turbo[i][1] for i in picks]
        x, y = backend._pixels_to_device(device.normalize_on_device, batch)
        mean, std = (np.asarray(v, np.float32).reshape(3, 1, 1) for v in turbo.normalize_on_device)
        for k, i in enumerate(picks):
            want = (turbo[i][0] / np.float32(255) - mean) / std
            diff = np.abs(x[k].numpy() - want).mean() * 0.226 * 255
            assert diff < 8, (train, i, diff)
        assert y.dtype == torch.int64


def test_data_index_indexes_shards_made_elsewhere_as_pack_did(shards, tmp_path):
    """``data index``: tar shards without an index (as WebDataset's ShardWriter or tar leave them) get the index that
    pack wrote for the same shards: samples, sizes, digests and the number of classes."""
    import shutil
    from hvdtrain.shards import index_shards
    with open(os.path.join(shards, "index.json")) as f:
        packed = json.load(f)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(shards):
        if name.endswith(".tar"):
            shutil.copy(os.path.join(shards, name), bare / name)
    index = index_shards(str(bare), log=lambda line: None)
    assert json.loads((bare / "index.json").read_text()) == index
    assert index["num_classes"] == packed["num_classes"] == 2
    for split in ("train", "val"):
        assert index["splits"][split]["shards"] == packed["splits"][split]["shards"]
        assert index["splits"][split]["samples"] == packed["splits"][split]["samples"]
    ds = ShardedImages(ShardStore(str(bare)), "train", None)
    assert len(ds) == 46
