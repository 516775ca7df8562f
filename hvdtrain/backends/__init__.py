"""Framework backends, imported only when chosen: ``import hvdtrain`` needs neither torch nor mxnet."""
from __future__ import annotations

import gc
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
    backend = getattr(importlib.import_module(module), cls)
    # The framework's modules live as long as the process: frozen out of the garbage collector's way, its full
    # collections no longer walk them (PyTorch's import leaves about 290,000 objects, and each full collection over
    # them took 0.2 s here; torch._dynamo, which a PyTorch optimizer's first step imports, triggered 0.5 s of them).
    gc.freeze()
    return backend


def make_backend(name: str):
    """A new, uninitialised backend for framework ``name`` (torch or mxnet)."""
    return backend_class(name)()
