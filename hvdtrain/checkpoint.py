"""The checkpoint file format: files that survive crashes and never execute code (when they are written, resumed
from, kept as best/: ``checkpoint_policy.py``).

One format for both frameworks: a nested state (dicts, lists, tuples, numbers, strings, numpy arrays) is stored as an
``.npz`` archive of plain arrays plus a JSON skeleton, loaded with ``allow_pickle=False`` — nothing in a checkpoint is
ever unpickled. Next to each archive a ``.sha256`` file in ``sha256sum`` format is written after it; a checkpoint is
valid only when both exist and the digest matches, so a torn, truncated or flipped file is detected.

Writes are atomic: a temporary file in the same directory, flushed and fsynced, then ``os.replace``; the directory is
fsynced after. Leftover temporaries from a crash are removed by :func:`clean_temporaries`.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

FORMAT = "hvdtrain-checkpoint"
VERSION = 1
_NAME = re.compile(r"^ckpt-e(\d+)-s(\d+)\.npz$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or not written by hvdtrain."""


def checkpoint_name(epoch: int, step: int) -> str:
    return f"ckpt-e{epoch:04d}-s{step:09d}.npz"


# --- encoding -----------------------------------------------------------------------------------------------------

def _encode(obj: Any, arrays: List[np.ndarray]) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError("object arrays cannot be stored in a checkpoint")
        arrays.append(obj)
        return {"__array__": len(arrays) - 1}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _encode(v, arrays) for k, v in obj.items()}}
        return {"__items__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, arrays) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, arrays) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint; convert it to numpy or plain Python")


def _decode(obj: Any, arrays) -> Any:
    if isinstance(obj, list):
        return [_decode(v, arrays) for v in obj]
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[f"a{obj['__array__']}"]
        if "__dict__" in obj:
            return {k: _decode(v, arrays) for k, v in obj["__dict__"].items()}
        if "__items__" in obj:
            return {_decode(k, arrays): _decode(v, arrays) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, arrays) for v in obj["__tuple__"])
        raise CheckpointError("unknown node in checkpoint skeleton")
    return obj


def serialize(state: Any) -> bytes:
    """The bytes of a checkpoint archive holding ``state``."""
    arrays: List[np.ndarray] = []
    skeleton = _encode(state, arrays)
    meta = json.dumps({"format": FORMAT, "version": VERSION, "tree": skeleton}).encode()
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(meta, dtype=np.uint8), **{f"a{i}": a for i, a in enumerate(arrays)})
    return buf.getvalue()


def deserialize(data: bytes, source: str = "checkpoint") -> Any:
    """Inverse of :func:`serialize`; refuses anything that is not an hvdtrain archive, without unpickling."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            meta = json.loads(archive["__meta__"].tobytes().decode())
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{source} is not an hvdtrain checkpoint")
            if meta.get("version") != VERSION:
                raise CheckpointError(f"{source} has checkpoint format version {meta.get('version')}, "
                                      f"this hvdtrain reads version {VERSION}")
            arrays = {k: archive[k] for k in archive.files if k != "__meta__"}
    except CheckpointError:
        raise
    except (ValueError, OSError, KeyError, zipfile.BadZipFile, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{source} is not an hvdtrain checkpoint ({type(e).__name__}: {e})") from None
    return _decode(meta["tree"], arrays)


# --- files --------------------------------------------------------------------------------------------------------

def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(directory)


def save(directory: str, epoch: int, step: int, state: Any,
         serialize_fn: Callable[[Any], bytes] = serialize) -> str:
    """Write ``state`` as the checkpoint for (epoch, step) in ``directory``; the digest file is written last."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, checkpoint_name(epoch, step))
    data = serialize_fn(state)
    digest = hashlib.sha256(data).hexdigest()
    if os.path.exists(path + ".sha256"):  # an older checkpoint of the same name: invalidate it before replacing
        os.unlink(path + ".sha256")
    atomic_write(path, data)
    atomic_write(path + ".sha256", f"{digest}  {os.path.basename(path)}\n".encode())
    return path


def read_verified(path: str) -> bytes:
    """The bytes of checkpoint ``path`` after its sha256 was checked; CheckpointError says what is wrong."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    sidecar = path + ".sha256"
    if not os.path.isfile(sidecar):
        raise CheckpointError(f"{path} has no {os.path.basename(sidecar)}: it was not completely written by hvdtrain")
    try:
        expected = open(sidecar).read().split()[0]
    except (IndexError, OSError, UnicodeDecodeError):
        raise CheckpointError(f"{sidecar} is unreadable") from None
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path} is corrupt: its sha256 does not match {os.path.basename(sidecar)} "
                              f"({len(data)} bytes)")
    return data


def load(path: str) -> Any:
    return deserialize(read_verified(path), source=path)


def read_model(path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the trainer's metadata, the model's arrays by structural name) of the checkpoint at ``path``."""
    state = load(path)
    return state["trainer"], state["backend"]["model"]


def list_checkpoints(directory: str) -> List[str]:
    """Checkpoint archives in ``directory``, oldest first (by epoch, then step)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2))), os.path.join(directory, name)))
    return [p for _, p in sorted(found)]


def position_of(path: str) -> Optional[Tuple[int, int]]:
    """(epoch, global step) from a checkpoint's file name; None for another name."""
    m = _NAME.match(os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


def latest_valid(directory: str, warn: Callable[[str], None] = print) -> Optional[str]:
    """The newest checkpoint whose digest matches; each newer invalid one is reported through ``warn``."""
    for path in reversed(list_checkpoints(directory)):
        try:
            read_verified(path)
            return path
        except CheckpointError as e:
            warn(f"skipping checkpoint: {e}")
    return None


def clean_temporaries(directory: str) -> List[str]:
    """Remove temporary files left by a write that crashed; returns what was removed."""
    removed = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(_TMP_PREFIX):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def remove(path: str) -> None:
    """Delete checkpoint ``path`` (its digest first, so that a crash in between leaves no checkpoint that looks
    whole)."""
    for p in (path + ".sha256", path):
        if os.path.exists(p):
            os.unlink(p)


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (with their digests)."""
    for path in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        remove(path)
