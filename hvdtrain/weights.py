"""A model's weights as named numpy arrays: read from the files users have, renamed between frameworks, fitted to a
model. Pure numpy; torch or mxnet is imported only to read a file of its own format.

Names. Both frameworks name a parameter by its path in the model (``layer1.0.conv1.weight``): PyTorch's state dicts,
and Gluon's structural names (``save_parameters``, GluonCV's model-zoo files, hvdtrain's MXNet checkpoints). They
differ only in BatchNorm: PyTorch calls its scale and shift ``weight`` and ``bias`` and keeps a
``num_batches_tracked`` counter; Gluon calls them ``gamma`` and ``beta`` and has no counter. Models built alike --
GluonCV's ``resnet*_v1b`` and ``recipes/resnet_torch.py``, convolutions (out, in, kh, kw) and dense layers (out, in)
in the same layout on both -- therefore move between the frameworks by renaming alone, exactly.

BatchNorm conventions, the same on both sides for these models: epsilon 1e-5; running statistics updated as
``r = 0.9 r + 0.1 batch`` (MXNet's momentum 0.9 is PyTorch's momentum 0.1). One training-time difference remains:
MXNet folds the biased batch variance into ``running_var``, PyTorch the unbiased one (n/(n-1) larger); a converted
model's inference is unaffected.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import checkpoint

TORCH, GLUON = "torch", "gluon"
NAMING = {"torch": TORCH, "mxnet": GLUON}
"""Each framework's naming."""
_TO_TORCH = {"gamma": "weight", "beta": "bias"}
_TO_GLUON = {"weight": "gamma", "bias": "beta"}
COUNTER = "num_batches_tracked"


class WeightsError(ValueError):
    """Weights that cannot be read, or do not fit the model; the message names the file or the parameter."""


def _split(name: str) -> Tuple[str, str]:
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def _norm_prefixes(arrays: Dict[str, Any]) -> set:
    """Module paths of the normalization layers (those with running statistics)."""
    return {_split(n)[0] for n in arrays if _split(n)[1] == "running_mean"}


def naming(arrays: Dict[str, Any]) -> Optional[str]:
    """TORCH or GLUON by the BatchNorm names; None for a model without BatchNorm, which both name alike."""
    leaves = {_split(n)[1] for n in arrays}
    if leaves & {"gamma", "beta"}:
        return GLUON
    if leaves & {"running_mean", COUNTER}:
        return TORCH
    return None


def rename(arrays: Dict[str, np.ndarray], to: str) -> Dict[str, np.ndarray]:
    """``arrays`` named as ``to`` (TORCH or GLUON) expects. A PyTorch counter is dropped for Gluon and set to 0 for
    PyTorch (it only matters to BatchNorm with momentum None)."""
    source = naming(arrays)
    if source is None or source == to:
        return dict(arrays)
    norms, out = _norm_prefixes(arrays), {}
    for name, value in arrays.items():
        prefix, leaf = _split(name)
        if prefix in norms:
            if leaf == COUNTER:
                continue
            leaf = (_TO_TORCH if to == TORCH else _TO_GLUON).get(leaf, leaf)
        out[f"{prefix}.{leaf}" if prefix else leaf] = value
    if to == TORCH:
        for prefix in sorted(norms):
            out[f"{prefix}.{COUNTER}"] = np.zeros((), np.int64)
    return out


def classifier(arrays: Dict[str, Any]) -> List[str]:
    """Names of the classifier's parameters: the module of the last 2-D weight, in the model's order."""
    last = [n for n, v in arrays.items() if len(np.shape(v)) == 2 and _split(n)[1] == "weight"]
    if not last:
        return []
    head = _split(last[-1])[0]
    return [n for n in arrays if _split(n)[0] == head]


def fit(model: Dict[str, np.ndarray], loaded: Dict[str, np.ndarray], source: str,
        to: Optional[str] = None) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """``loaded`` renamed for ``model`` (whose arrays give the names, shapes and dtypes) and checked against it.

    Every parameter must be present with its shape, except the classifier's, which keeps the model's (freshly
    initialised) values when its class count differs; returns (arrays, names of the classifier parameters kept).
    Raises :class:`WeightsError` naming the first parameter that does not fit.
    """
    target = to or naming(model) or naming(loaded) or TORCH
    renamed = rename(loaded, target)
    missing = [n for n in model if n not in renamed and _split(n)[1] != COUNTER]
    unexpected = [n for n in renamed if n not in model]
    if missing or unexpected:
        what = (f"the model's parameter {missing[0]} is not in {source}" if missing
                else f"{source} has parameter {unexpected[0]}, which the model does not")
        more = len(missing) + len(unexpected) - 1
        raise WeightsError(f"{what}" + (f" ({more} more differ)" if more else "")
                           + "; is it the same architecture (--model)?")
    head, kept, out = set(classifier(model)), [], {}
    for name, mine in model.items():
        value = renamed.get(name)
        if value is None:  # a PyTorch counter the file lacks
            out[name] = np.asarray(mine)
            continue
        value = np.asarray(value)
        if tuple(value.shape) != tuple(np.shape(mine)):
            if name in head:
                kept.append(name)
                out[name] = np.asarray(mine)
                continue
            raise WeightsError(f"parameter {name} has shape {tuple(value.shape)} in {source}, "
                               f"the model {tuple(np.shape(mine))}; is it the same architecture (--model)?")
        out[name] = value.astype(np.asarray(mine).dtype, copy=False)
    if kept and len(kept) != len(head):  # weight and bias of one head: both re-initialised or neither
        for name in head:
            if name not in kept:
                kept.append(name)
                out[name] = np.asarray(model[name])
    return out, sorted(kept)


# --- files ------------------------------------------------------------------------------------------------------------

def _torch_file(path: str) -> Dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise WeightsError(f"{path} is a PyTorch file; reading it needs torch installed") from None
    try:
        # weights_only: torch's restricted loader, which builds tensors and plain containers and nothing else.
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise WeightsError(f"{path} is not a PyTorch state dict torch.load(weights_only=True) can read "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for key in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    prefix = "module."  # saved from a DistributedDataParallel / DataParallel wrapper
    if data and all(k.startswith(prefix) for k in data):
        data = {k[len(prefix):]: v for k, v in data.items()}
    return {k: v.detach().cpu().numpy() for k, v in data.items()}


def _mxnet_file(path: str) -> Dict[str, np.ndarray]:
    try:
        import mxnet as mx
    except ImportError:
        raise WeightsError(f"{path} is an MXNet .params file; reading it needs mxnet installed") from None
    try:
        data = mx.nd.load(path)  # MXNet's own binary NDArray format: no pickle
    except Exception as e:  # noqa: BLE001
        raise WeightsError(f"{path} is not an MXNet parameter file ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path} holds unnamed arrays, not a model's parameters")
    if any(k.startswith(("arg:", "aux:")) for k in data):
        raise WeightsError(f"{path} is the parameter half of a symbol export (for gluon.SymbolBlock.imports); "
                           f"pass the save_parameters file (model.params of 'hvdtrain export') instead")
    return {k: v.asnumpy() for k, v in data.items()}


def find_checkpoint(run_dir: str) -> str:
    found = checkpoint.latest_valid(os.path.join(run_dir, "checkpoints"), warn=lambda m: None)
    if found is None:
        raise WeightsError(f"{run_dir} holds no valid checkpoint (checkpoints/ckpt-*.npz with its .sha256)")
    return found


def read(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """The named arrays in ``path`` and what is known of where they came from (``framework``, ``recipe``,
    ``config``, ``epoch``, ``path``).

    Reads an hvdtrain run directory (its newest valid checkpoint), an hvdtrain checkpoint (``.npz``), an
    ``hvdtrain export`` directory or its ``model.json``, a PyTorch state dict (``.pt``/``.pth``/``.bin``, torch's
    weights-only loader) and a Gluon ``save_parameters`` / GluonCV model-zoo file (``.params``). Nothing is unpickled
    beyond torch's weights-only loader. A URL (s3://...) is fetched first (:func:`hvdtrain.remote.localize`).
    """
    from . import remote
    from .config import ConfigError
    try:
        path = remote.localize(path)
    except ConfigError as e:
        raise WeightsError(str(e)) from None
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model.json")):
            path = os.path.join(path, "model.json")
        elif os.path.isdir(os.path.join(path, "checkpoints")):
            path = find_checkpoint(path)
        elif checkpoint.list_checkpoints(path):  # a directory of checkpoints: checkpoints/, best/
            path = checkpoint.latest_valid(path, warn=lambda m: None) or checkpoint.list_checkpoints(path)[-1]
        else:
            raise WeightsError(f"{path} is neither a run directory (checkpoints/), a directory of checkpoints nor an "
                               f"export (model.json)")
    if not os.path.isfile(path):
        raise WeightsError(f"{path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npz":
        try:
            meta, arrays = checkpoint.read_model(path)
        except checkpoint.CheckpointError as e:
            raise WeightsError(str(e)) from None
        except (KeyError, TypeError):
            raise WeightsError(f"{path} is an hvdtrain archive without a model") from None
        return dict(arrays), {"framework": meta.get("framework"), "recipe": meta.get("recipe"),
                              "config": meta.get("config", {}), "epoch": meta.get("epoch"),
                              "global_step": meta.get("global_step"), "offset": meta.get("offset", 0), "path": path}
    if ext == ".json":
        import json
        try:
            with open(path) as f:
                meta = json.load(f)
            kind, weights = meta.get("kind"), os.path.join(os.path.dirname(path), meta.get("weights") or "")
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise WeightsError(f"{path} is not an hvdtrain export's model.json ({e})") from None
        if kind == "onnx":
            raise WeightsError(f"{path} describes an ONNX export, which onnxruntime runs; hvdtrain reads the "
                               f"native export or the checkpoint it came from ({meta.get('source')})")
        if not meta.get("weights"):
            raise WeightsError(f"{path} is not an hvdtrain export's model.json (it names no weights file)")
        arrays, _ = read(weights)
        return arrays, {**meta, "path": weights}
    if ext in (".pt", ".pth", ".bin"):
        return _torch_file(path), {"framework": "torch", "path": path}
    if ext == ".params":
        return _mxnet_file(path), {"framework": "mxnet", "path": path}
    raise WeightsError(f"{path}: unknown weights format {ext or '(no extension)'}; hvdtrain reads a run directory, "
                       f"ckpt-*.npz, an export's model.json, a PyTorch .pt/.pth state dict or a Gluon .params file")
