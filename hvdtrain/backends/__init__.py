"""Framework backends, imported only when chosen: ``import hvdtrain`` needs neither torch nor mxnet."""
from __future__ import annotations

import importlib

BACKENDS = {
    "torch": "hvdtrain.backends.torch:TorchBackend",
    "mxnet": "hvdtrain.backends.mxnet:MXNetBackend",
}


def backend_class(name: str):
    """The backend class for framework ``name`` (torch or mxnet); importing it imports that framework's module."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        from ..config import ConfigError
        raise ConfigError(f"--framework must be one of {', '.join(BACKENDS)}, got {name!r}") from None
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str):
    """A new, uninitialised backend for framework ``name`` (torch or mxnet)."""
    return backend_class(name)()
