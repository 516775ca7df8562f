"""Sharded image datasets: WebDataset tar shards with an index, in a directory or at any fsspec URL (``s3://``),
streamed into a per-host cache; no framework inside.

A dataset is a directory (or URL prefix) holding ``index.json`` and tar shards ``train-000000.tar``, ...,
``val-000000.tar``, .... A shard is a plain tar in WebDataset's layout: the files of one sample share a key and
follow one another (``00001234.jpg`` then ``00001234.cls``, the class index as text), so WebDataset and ``tar`` read
and write them. ``index.json`` lists each split's shards with their sample count, size and sha256; ``python -m
hvdtrain data pack`` writes both, ``python -m hvdtrain data index`` indexes shards made by other tools.

Reading (:class:`ShardedImages`): a local or shared directory is read in place. A URL's shards are fetched whole
into a per-host cache (``--data-cache``), each renamed into place after its digest matched, under a file lock so
that the ranks of one host fetch a shard once. A thread of each rank fetches its next shards ahead of use and
evicts the shards its epoch has finished with while the cache is over ``--data-cache-gb``. An unreachable store is
retried with backoff for up to ``--data-timeout`` seconds, then the job ends naming the shard and the store.

Order (:class:`ShardStreamSampler`): by the seed, the shards are shuffled and dealt to the ranks, each shard to the
rank with the fewest samples so far, so that each rank (and each host) reads shards of its own, the same ones every
epoch; per (seed, epoch) each rank's stream is its shards in a new order, their samples shuffled within each shard,
padded to the longest stream by repeating its start. Rank r's
i-th sample is position ``i * size + r`` of the epoch's order, as with :class:`hvdtrain.data.ShardSampler`, so a
resume at ``offset`` continues every stream where it stopped.
"""
from __future__ import annotations

import bisect
import fcntl
import hashlib
import io
import json
import os
import posixpath
import sys
import tarfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .basics import ConfigError, is_url
from .data import ShardSampler
from .vision import EXTENSIONS, AugmentedImages

INDEX = "index.json"
FORMAT = "webdataset"
IMAGE_EXTENSIONS = tuple(e.lstrip(".") for e in EXTENSIONS)
"""The members that hold a sample's image: an ImageFolder's extensions (hvdtrain.vision.EXTENSIONS)."""
DEAL = 0x5EED
"""A constant in the seeds of the dealing and of the within-shard order, apart from other uses of (seed, epoch)."""
SHARD_BYTES = 256 << 20
"""Default shard size of ``data pack``: 256 MB (object stores and parallel file systems favour 100 MB - 1 GB)."""


class StoreError(RuntimeError):
    """A shard that could not be had: the store away past --data-timeout, or a digest that does not match. Its
    message says all a user needs (the traceback goes to the run's errors/ only)."""

    brief = True


# --- writing ---------------------------------------------------------------------------------------------------------
def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: the same input packs to the same bytes
    tar.addfile(info, io.BytesIO(data))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Samples (key, extension, image bytes, label) into ``PREFIX-NNNNNN.tar`` files of about ``shard_bytes`` each in
    ``directory``; ``done`` is called with each finished shard's entry of the index."""

    def __init__(self, directory: str, prefix: str, shard_bytes: int, done: Callable[[str, Dict[str, Any]], None]):
        self.directory, self.prefix, self.shard_bytes, self.done = directory, prefix, shard_bytes, done
        self.shards: List[Dict[str, Any]] = []
        self._tar: Optional[tarfile.TarFile] = None

    def add(self, key: str, ext: str, image: bytes, label: int) -> None:
        if self._tar is None:
            self._name = f"{self.prefix}-{len(self.shards):06d}.tar"
            self._path = os.path.join(self.directory, self._name)
            self._tar, self._samples = tarfile.open(self._path, "w", format=tarfile.USTAR_FORMAT), 0
        _tar_member(self._tar, f"{key}.{ext}", image)
        _tar_member(self._tar, f"{key}.cls", str(int(label)).encode())
        self._samples += 1
        if self._tar.fileobj.tell() >= self.shard_bytes:
            self.close()

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None
        entry = {"name": self._name, "samples": self._samples, "bytes": os.path.getsize(self._path),
                 "sha256": sha256_file(self._path)}
        self.shards.append(entry)
        self.done(self._path, entry)


def _image_ext(data: bytes) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "bmp" if data[:2] == b"BM" else "ppm"


def source_samples(src: str, split: str) -> Tuple[List[str], Callable[[int], Tuple[bytes, int]], int]:
    """(class names, or [] for RecordIO; a reader of sample i -> (image bytes, label); count) of one split of an
    ImageFolder (``src/split/CLASS/*``) or a RecordIO directory (``src/split.rec`` + ``.idx``)."""
    from .vision import ImageFolder, RecordIODataset
    folder = os.path.join(src, split)
    if os.path.isdir(folder):
        images = ImageFolder(folder)

        def read_file(i: int) -> Tuple[bytes, int]:
            path, label = images.samples[i]
            with open(path, "rb") as f:
                return f.read(), label
        return images.classes, read_file, len(images)
    rec, idx = os.path.join(src, split + ".rec"), os.path.join(src, split + ".idx")
    if os.path.isfile(rec) and os.path.isfile(idx):
        records = RecordIODataset(rec, idx)

        def read_record(i: int) -> Tuple[bytes, int]:
            label, body = records.read(i)
            return body, int(label)
        return [], read_record, len(records)
    raise ConfigError(f"{src} has neither {split}/ (ImageFolder: {split}/CLASS/*.jpg) nor {split}.rec and "
                      f"{split}.idx (RecordIO)")


def pack(src: str, dest: str, shard_bytes: int = SHARD_BYTES, seed: int = 0, splits: Sequence[str] = ("train", "val"),
         log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Pack an ImageFolder or RecordIO directory ``src`` into tar shards and ``index.json`` at ``dest`` (a
    directory or a URL), samples in a shuffled order fixed by ``seed`` (as im2rec shuffles: a shard then holds
    every class). Each shard is written locally, uploaded when ``dest`` is a URL, and the index goes last: a pack
    cut short leaves no index, and readers refuse a prefix without one."""
    import tempfile
    remote = is_url(dest)
    if remote:
        from .remote import check, filesystem
        check(dest, "DEST")
        fs, root = filesystem(dest)
    else:
        os.makedirs(dest, exist_ok=True)
    index: Dict[str, Any] = {"format": FORMAT, "version": 1, "splits": {}}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-pack-") as tmp:
        work = tmp if remote else dest
        started = time.monotonic()
        for split in splits:
            classes, read, n = source_samples(src, split)
            if n == 0:
                raise ConfigError(f"{src}: the {split} split holds no samples")
            index["classes"] = index.get("classes") or classes
            total = [0, 0]

            def finished(path: str, entry: Dict[str, Any]) -> None:
                total[0] += entry["samples"]
                total[1] += entry["bytes"]
                if remote:
                    fs.put_file(path, posixpath.join(root, entry["name"]))
                    os.unlink(path)
                rate = total[1] / max(time.monotonic() - started, 1e-9) / 1e6
                log(f"hvdtrain: data pack: {split} {entry['name']}: {entry['samples']} samples, "
                    f"{entry['bytes'] / 1e6:.1f} MB ({total[0]}/{n} samples, {rate:.1f} MB/s)")
            writer = ShardWriter(work, split, shard_bytes, finished)
            labels = []
            for key in np.random.default_rng(seed).permutation(n).tolist():
                data, label = read(key)
                writer.add(f"{key:08d}", _image_ext(data), data, label)
                labels.append(label)
            writer.close()
            index["splits"][split] = {"samples": n, "shards": writer.shards, "num_classes": 1 + max(labels)}
        index["num_classes"] = max(s["num_classes"] for s in index["splits"].values())
    write_index(dest, index)
    return index


def write_index(dest: str, index: Dict[str, Any]) -> None:
    """``index.json`` at ``dest``: one PUT at a URL (an object store's write is whole or absent), a renamed
    temporary file in a directory."""
    body = json.dumps(index, indent=1).encode()
    if is_url(dest):
        from .remote import filesystem
        fs, root = filesystem(dest)
        with fs.open(posixpath.join(root, INDEX), "wb") as f:
            f.write(body)
        return
    with open(os.path.join(dest, INDEX + ".tmp"), "wb") as f:
        f.write(body)
    os.replace(os.path.join(dest, INDEX + ".tmp"), os.path.join(dest, INDEX))


# --- reading a shard -------------------------------------------------------------------------------------------------
class ShardFile:
    """Random access to the samples of one local tar shard: (byte offset, size) of each sample's image and
    label, from one pass over the tar headers."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        entries: Dict[str, Dict[str, Tuple[int, int]]] = {}
        order: List[str] = []
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, _, ext = m.name.rpartition(".")
                if key not in entries:
                    entries[key] = {}
                    order.append(key)
                entries[key][ext.lower()] = (m.offset_data, m.size)
        self.samples: List[Tuple[str, Tuple[int, int], Optional[Tuple[int, int]]]] = []
        for key in order:
            parts = entries[key]
            image = next((parts[e] for e in IMAGE_EXTENSIONS if e in parts), None)
            if image is None:
                raise StoreError(f"shard {name}: sample {key} has no image ({', '.join(sorted(parts))})")
            self.samples.append((key, image, parts.get("cls")))
        self._file = open(path, "rb")

    def read(self, j: int) -> Tuple[str, bytes, int]:
        """(key, image bytes, label) of the shard's ``j``-th sample."""
        key, (offset, size), cls = self.samples[j]
        self._file.seek(offset)
        data = self._file.read(size)
        label = -1
        if cls is not None:
            self._file.seek(cls[0])
            label = int(self._file.read(cls[1]).decode().strip())
        return key, data, label

    def close(self) -> None:
        self._file.close()


# --- the store and its cache -----------------------------------------------------------------------------------------
def cache_root() -> str:
    from .remote import _cache_root
    return os.path.join(_cache_root(), "shards")


class ShardStore:
    """Where the shards of ``url`` are read: in place for a local or shared directory, else fetched into ``cache``
    (a directory of its own per URL), at most ``cache_bytes`` of them kept while none is in use."""

    def __init__(self, url: str, cache: str = "", cache_bytes: float = 0, timeout: float = 300.0):
        self.url, self.remote = url.rstrip("/"), is_url(url)
        self.timeout, self.cache_bytes = timeout, cache_bytes
        if self.remote:
            from .remote import _local_name
            self.cache = os.path.join(cache or cache_root(), _local_name(self.url))
        else:
            self.cache = self.url
        self._fs, self._pid = None, None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fs"] = state["_pid"] = None  # a filesystem's connections and loop are not the child's
        return state

    def _filesystem(self):
        if self._fs is None or self._pid != os.getpid():
            from .remote import filesystem
            self._fs, self._root = filesystem(self.url)
            self._fs = type(self._fs)(**{**self._fs.storage_options, "skip_instance_cache": True})
            self._pid = os.getpid()
        return self._fs

    def read_index(self) -> Dict[str, Any]:
        """``index.json``; ConfigError (one line) for a missing store, bucket, credentials, prefix or index."""
        missing = ConfigError(f"--data-dir {self.url} has no {INDEX}: pack a dataset there with 'python -m hvdtrain "
                              f"data pack SRC {self.url}', or index tar shards with 'python -m hvdtrain data index "
                              f"{self.url}'")
        if not self.remote:
            path = os.path.join(self.url, INDEX)
            if not os.path.isfile(path):
                raise missing
            with open(path) as f:
                return check_index(json.load(f), self.url)
        from .remote import check, describe_error
        check(self.url, "--data-dir")
        fs = self._filesystem()
        try:
            with fs.open(posixpath.join(self._root, INDEX), "rb") as f:
                return check_index(json.loads(f.read()), self.url)
        except FileNotFoundError:
            raise missing from None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's own error, in one line
            raise ConfigError("--data-dir " + describe_error(self.url, e)) from None

    def local(self, entry: Dict[str, Any]) -> str:
        """The local path of a shard, fetched first where it is not in the cache."""
        path = os.path.join(self.cache, entry["name"])
        if not self.remote:
            if not os.path.isfile(path):
                raise StoreError(f"shard {entry['name']} is listed in {self.url}/{INDEX} but missing")
            return path
        if os.path.isfile(path):
            return path
        os.makedirs(self.cache, exist_ok=True)
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per host; the others wait for it and find the file
            try:
                if not os.path.isfile(path):
                    self._fetch(entry, path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return path

    def _fetch(self, entry: Dict[str, Any], path: str) -> None:
        name, tmp = entry["name"], f"{path}.part{os.getpid()}"
        deadline, attempt = time.monotonic() + self.timeout, 0
        try:
            while True:
                try:
                    self._filesystem().get_file(posixpath.join(self._root, name), tmp)
                    break
                except (FileNotFoundError, PermissionError) as e:
                    raise StoreError(f"shard {name} at {self.url}: {type(e).__name__}: {e}") from None
                except Exception as e:  # noqa: BLE001 - the store away: retried with backoff until --data-timeout
                    if time.monotonic() >= deadline:
                        last = str(e).splitlines()[0] if str(e) else ""
                        raise StoreError(f"shard {name}: the store {self.url} did not answer for {self.timeout:g} s "
                                         f"(--data-timeout; last error {type(e).__name__}: {last})") from None
                    if attempt == 0:
                        print(f"hvdtrain: shard {name}: the store {self.url} failed ({type(e).__name__}); retrying "
                              f"with backoff for up to {self.timeout:g} s (--data-timeout)", file=sys.stderr,
                              flush=True)
                    self._fs = None  # a fresh connection pool for the store when it is back
                    time.sleep(min(0.5 * 2 ** attempt, 8.0, max(deadline - time.monotonic(), 0.1)))
                    attempt += 1
            digest, size = sha256_file(tmp), os.path.getsize(tmp)
            if digest != entry["sha256"] or size != entry["bytes"]:
                raise StoreError(f"shard {name} at {self.url} does not match {INDEX} (sha256 {digest[:12]}..., "
                                 f"{size} bytes; the index says {entry['sha256'][:12]}..., {entry['bytes']} bytes): "
                                 f"it is corrupt or was rewritten; pack it again, or reindex with 'python -m hvdtrain "
                                 f"data index {self.url}'")
            os.replace(tmp, path)
            if attempt:
                print(f"hvdtrain: shard {name}: fetched from {self.url} after {attempt} retries", file=sys.stderr,
                      flush=True)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def cached(self) -> Dict[str, int]:
        """Shard name -> bytes of the shards in the cache now."""
        try:
            names = os.listdir(self.cache)
        except FileNotFoundError:
            return {}
        out = {}
        for n in names:
            if n.endswith(".tar"):
                try:
                    out[n] = os.path.getsize(os.path.join(self.cache, n))
                except FileNotFoundError:
                    pass
        return out

    def evict(self, keep: Sequence[str], room: int = 0) -> int:
        """Delete cached shards not in ``keep``, the longest-held first, while the cache holds more than
        ``--data-cache-gb`` less ``room``; returns the bytes freed. A reader that still has one open keeps
        reading it (POSIX), and a reader that needs one again fetches it again."""
        if not self.remote or not self.cache_bytes:
            return 0
        held = self.cached()
        total, freed = sum(held.values()), 0

        def fetched_at(n: str) -> float:
            try:
                return os.path.getmtime(os.path.join(self.cache, n))
            except FileNotFoundError:
                return 0.0
        for n in sorted(set(held) - set(keep), key=fetched_at):
            if total - freed + room <= self.cache_bytes:
                break
            try:
                os.unlink(os.path.join(self.cache, n))
                freed += held[n]
            except FileNotFoundError:
                pass
        return freed


def check_index(index: Any, url: str) -> Dict[str, Any]:
    if not isinstance(index, dict) or index.get("format") != FORMAT or "splits" not in index:
        raise ConfigError(f"{url}/{INDEX} is not a hvdtrain shard index (format {FORMAT})")
    return index


# --- the dataset and its order ---------------------------------------------------------------------------------------
class Prefetcher:
    """A thread that fetches a rank's shards in the order its stream reads them, ``ahead`` past the one its loader
    reads now (the last shard a loader process opened: a mark in the cache), and evicts the stream's finished
    shards while the cache is over its size."""

    def __init__(self, store: ShardStore, plan: List[Dict[str, Any]], marks: str, ahead: int = 2):
        self.store, self.plan, self.marks, self.ahead = store, plan, marks, ahead
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hvdtrain-prefetch", daemon=True)
        self.thread.start()

    def _reading(self) -> int:
        """The position in the plan of the last shard a loader opened (-1: none yet)."""
        at = -1
        for i, entry in enumerate(self.plan):
            if os.path.exists(os.path.join(self.marks, entry["name"])):
                at = i
        return at

    def _run(self) -> None:
        try:
            fetched = 0
            while not self._stop.is_set() and fetched < len(self.plan):
                reading = self._reading()
                if fetched > reading + self.ahead:
                    self._stop.wait(0.05)
                    continue
                window = [e["name"] for e in self.plan[max(reading - 1, 0):fetched + 1]]
                self.store.evict(window, room=self.plan[fetched]["bytes"])
                self.store.local(self.plan[fetched])
                fetched += 1
        except BaseException:  # noqa: BLE001 - a loader that needs the shard fetches it and raises itself
            pass

    def stop(self) -> None:
        self._stop.set()


class ShardedImages(AugmentedImages):
    """One split (``train`` or ``val``) of a sharded image dataset at ``url`` (a directory or fsspec URL): a
    sample is ``transform(image, rng)`` and its label, the generator seeded by (seed, epoch, sample index) as in
    :mod:`hvdtrain.vision`. Works as the dataset of both backends' loaders and of a user's own Trainer::

        def datasets(self):
            store = ShardStore("s3://bucket/imagenet-shards", cache_bytes=100e9)
            return (ShardedImages(store, "train", ImageTransform(train=True), seed=self.cfg.seed),
                    ShardedImages(store, "val", ImageTransform(train=False)))
    """

    def __init__(self, store: ShardStore, split: str, transform: Optional[Callable] = None, seed: int = 0,
                 index: Optional[Dict[str, Any]] = None, open_shards: int = 4):
        self.store, self.split, self.transform, self.seed = store, split, transform, seed
        self.index = index if index is not None else store.read_index()
        if split not in self.index["splits"]:
            raise ConfigError(f"{store.url}/{INDEX} has no {split} split (it has {', '.join(self.index['splits'])})")
        info = self.index["splits"][split]
        self.shards: List[Dict[str, Any]] = info["shards"]
        self.starts = np.cumsum([0] + [s["samples"] for s in self.shards]).tolist()
        self.classes: List[str] = self.index.get("classes") or []
        self.num_classes = int(self.index.get("num_classes") or info.get("num_classes") or 0)
        self.epoch, self.open_shards = 0, open_shards
        self._open: Dict[int, ShardFile] = {}
        self._pid = os.getpid()
        self._marked: set = set()
        self.prefetcher: Optional[Prefetcher] = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"], state["prefetcher"] = {}, None
        return state

    def locate(self, index: int) -> Tuple[int, int]:
        """(shard, sample within it) of a sample index."""
        k = bisect.bisect_right(self.starts, index) - 1
        return k, index - self.starts[k]

    def _shard(self, k: int) -> ShardFile:
        if self._pid != os.getpid():  # a forked loader process: its own file handles, not its parent's offsets
            self._open, self._pid, self._marked = {}, os.getpid(), set()
        f = self._open.get(k)
        if f is None:
            entry = self.shards[k]
            path = self.store.local(entry)
            try:
                f = ShardFile(path, entry["name"])
            except FileNotFoundError:  # evicted between the check and the open: fetched again
                f = ShardFile(self.store.local(entry), entry["name"])
            if len(f.samples) != entry["samples"]:
                raise StoreError(f"shard {entry['name']} holds {len(f.samples)} samples; {INDEX} says "
                                 f"{entry['samples']}")
            if len(self._open) >= self.open_shards:
                self._open.pop(next(iter(self._open))).close()
            self._open[k] = f
            self._mark(entry["name"])
        return f

    def _mark(self, name: str) -> None:
        if self.prefetch_marks and name not in self._marked:
            os.makedirs(self.prefetch_marks, exist_ok=True)
            open(os.path.join(self.prefetch_marks, name), "w").close()
            self._marked.add(name)

    prefetch_marks: str = ""

    def read(self, index: int) -> Tuple[bytes, int, str]:
        """(image bytes, label, a name for errors) of sample ``index``."""
        k, j = self.locate(index)
        key, data, label = self._shard(k).read(j)
        return data, label, f"{self.store.url}/{self.shards[k]['name']}:{key}"

    def __getitem__(self, index: int):
        data, label, name = self.read(index)
        return self._finish(data, name, label, index)

    def training_sampler(self, rank: int, size: int, seed: int) -> "ShardStreamSampler":
        return ShardStreamSampler(self, rank, size, seed)

    def plan(self, shards: List[int], rank: int) -> None:
        """This rank reads ``shards`` (in that order) next: fetch them ahead of its loader (a URL only)."""
        if self.prefetcher is not None:
            self.prefetcher.stop()
            self.prefetcher = None
        if not self.store.remote:
            return
        marks = os.path.join(self.store.cache, ".reading", f"{os.getpid()}-{rank}")
        if not self.prefetch_marks:
            import atexit
            import shutil
            atexit.register(shutil.rmtree, marks, True)
        os.makedirs(marks, exist_ok=True)
        for n in os.listdir(marks):
            os.unlink(os.path.join(marks, n))
        self.prefetch_marks, self._marked = marks, set()
        self.prefetcher = Prefetcher(self.store, [self.shards[k] for k in shards], marks)


class ShardStreamSampler(ShardSampler):
    """The training order of a :class:`ShardedImages`: shards dealt to ranks by the seed, each rank reading its
    own every epoch (module docstring). ``offset`` positions of the epoch's order already consumed skip
    ``offset // size`` samples of every rank's stream: exact when the world size is the one that consumed them."""

    def __init__(self, dataset: ShardedImages, rank: int, size: int, seed: int = 0):
        super().__init__(len(dataset), rank, size, shuffle=True, seed=seed, pad=True)
        self.dataset = dataset

    def streams(self) -> List[Tuple[List[int], np.ndarray]]:
        """Per rank: (its shards in this epoch's reading order, its sample indices) before padding. The shards are
        dealt by the seed alone, so each rank keeps its shards from epoch to epoch (its host's cache needs only its
        ranks' share of the dataset, and every epoch after the first reads from the cache); their order and the
        order of the samples within each are drawn from (seed, epoch)."""
        ds = self.dataset
        counts, dealt = [0] * self.size, [[] for _ in range(self.size)]
        for k in np.random.default_rng([self.seed, DEAL]).permutation(len(ds.shards)).tolist():
            r = min(range(self.size), key=lambda i: (counts[i], i))
            dealt[r].append(k)
            counts[r] += ds.shards[k]["samples"]
        out = []
        for r, shards in enumerate(dealt):
            shards = [shards[i] for i in np.random.default_rng([self.seed, self.epoch, r]).permutation(len(shards))]
            parts = [ds.starts[k] + np.random.default_rng([self.seed, self.epoch, DEAL, k]).permutation(
                ds.shards[k]["samples"]) for k in shards]
            out.append((shards, np.concatenate(parts) if parts else np.zeros(0, np.int64)))
        return out

    def _stream(self) -> Tuple[List[int], np.ndarray]:
        streams = self.streams()
        longest = max(len(s) for _, s in streams)
        if longest == 0:
            raise ConfigError(f"{self.dataset.store.url}: fewer {self.dataset.split} shards than ranks leave a rank "
                              f"without samples")
        shards, mine = streams[self.rank]
        if len(mine) == 0:  # more ranks than shards: this rank reads the stream of another
            shards, mine = streams[self.rank % sum(1 for _, s in streams if len(s))]
        if len(mine) < longest:  # padded by repeating its own start, so every rank runs the same steps
            mine = np.resize(mine, longest)
        return shards, mine

    def indices(self) -> np.ndarray:
        shards, mine = self._stream()
        rest = mine[self.offset // self.size:]
        first = self.dataset.locate(int(rest[0]))[0] if len(rest) else None
        if first is not None and first in shards:
            self.dataset.plan(shards[shards.index(first):], self.rank)
        return rest

    def __len__(self) -> int:
        return len(self._stream()[1]) - self.offset // self.size


# --- indexing shards made elsewhere ----------------------------------------------------------------------------------
def index_shards(url: str, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Write ``index.json`` for the tar shards at ``url`` named ``SPLIT-*.tar`` (WebDataset's ShardWriter, tar):
    each shard is read once for its samples, size and digest, and its labels (``.cls``) for the classes."""
    import tempfile
    store = ShardStore(url)
    if store.remote:
        from .remote import check, filesystem
        check(url, "URL", exists=True)
        fs, root = filesystem(url)
        names = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False) if p.endswith(".tar"))
    else:
        if not os.path.isdir(url):
            raise ConfigError(f"{url} is not a directory of tar shards")
        names = sorted(n for n in os.listdir(url) if n.endswith(".tar"))
    if not names:
        raise ConfigError(f"{url} holds no .tar shards")
    index: Dict[str, Any] = {"format": FORMAT, "version": 1, "classes": [], "splits": {}}
    top = -1
    with tempfile.TemporaryDirectory(prefix="hvdtrain-index-") as tmp:
        for name in names:
            split = name.split("-")[0].split(".")[0]
            if store.remote:
                path = os.path.join(tmp, name)
                fs.get_file(posixpath.join(root, name), path)
            else:
                path = os.path.join(url, name)
            shard = ShardFile(path, name)
            labels = [shard.read(j)[2] for j in range(len(shard.samples))]
            shard.close()
            top = max([top] + labels)
            entry = {"name": name, "samples": len(labels), "bytes": os.path.getsize(path), "sha256": sha256_file(path)}
            info = index["splits"].setdefault(split, {"samples": 0, "shards": []})
            info["samples"] += entry["samples"]
            info["shards"].append(entry)
            log(f"hvdtrain: data index: {split} {name}: {entry['samples']} samples, {entry['bytes'] / 1e6:.1f} MB")
            if store.remote:
                os.unlink(path)
    index["num_classes"] = top + 1
    write_index(url, index)
    return index


DATA_USAGE = """usage: python -m hvdtrain data pack SRC DEST [--shard-mb 256] [--seed 0]
       python -m hvdtrain data index DEST

pack   an ImageFolder (SRC/train/CLASS/*.jpg, SRC/val/...) or RecordIO directory (SRC/train.rec + .idx, SRC/val.rec +
       .idx) into WebDataset tar shards of about --shard-mb MB (train-000000.tar, ..., val-000000.tar, ...) and
       index.json (each shard's samples, size and sha256) at DEST: a directory, or a URL (s3://bucket/prefix, any
       fsspec protocol). Samples go in a shuffled order fixed by --seed, so that every shard holds every class.
index  index.json for tar shards made by other tools (WebDataset's ShardWriter, tar) at DEST, named SPLIT-*.tar,
       each sample a KEY.jpg (.png, ...) and a KEY.cls holding its class index.
Train from it with: python -m hvdtrain recipe imagenet --data-dir DEST"""


def main(argv: List[str]) -> int:
    """``python -m hvdtrain data pack|index``."""
    import argparse
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("pack", "index"):
        print(DATA_USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    parser = argparse.ArgumentParser(prog=f"python -m hvdtrain data {argv[0]}", usage=DATA_USAGE)
    if argv[0] == "pack":
        parser.add_argument("src")
    parser.add_argument("dest")
    parser.add_argument("--shard-mb", type=float, default=SHARD_BYTES / (1 << 20))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv[1:])
    if args.shard_mb <= 0:
        raise ConfigError(f"--shard-mb must be above 0, got {args.shard_mb:g}")
    started = time.monotonic()
    if argv[0] == "index":
        index = index_shards(args.dest)
    else:
        if is_url(args.src) or not os.path.isdir(args.src):
            raise ConfigError(f"SRC {args.src} is not a local directory (an ImageFolder or RecordIO directory)")
        index = pack(args.src, args.dest, int(args.shard_mb * (1 << 20)), args.seed)
    splits = ", ".join(f"{split} {info['samples']} samples in {len(info['shards'])} shards"
                       for split, info in index["splits"].items())
    print(f"hvdtrain: data {argv[0]}: {args.dest}: {splits}, {index['num_classes']} classes "
          f"({time.monotonic() - started:.1f} s)", flush=True)
    return 0
