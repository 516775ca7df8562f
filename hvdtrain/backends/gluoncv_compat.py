"""Import MXNet without scikit-learn, and GluonCV beside PyTorch >= 2.0.

MXNet 1.9.1's ``import mxnet`` imports scikit-learn (and with it most of SciPy) whenever it is installed, only to give
the legacy ``mx.model.FeedForward`` (not Gluon, which hvdtrain uses) scikit-learn's ``BaseEstimator`` as a base
class: 0.4-0.8 s of CPU in every MXNet process here, about a fifth of MXNet's import. :func:`import_mxnet` hides
scikit-learn for the duration of that import (``FeedForward`` then derives from ``object``, as where scikit-learn is
not installed) and leaves it importable afterwards: the regression recipe and the data scripts still use it.

gluoncv 0.10.5's ``__init__`` raises RuntimeError whenever torch >= 2.0 is importable (gluoncv/check.py:
_require_pytorch_version), even though its MXNet model zoo never uses torch. Hiding torch from that one check —
``sys.modules['torch'] = None`` for the duration of the import, so ``import torch`` raises ImportError there — lets
the MXNet side load; torch is restored untouched afterwards.
"""
from __future__ import annotations

import importlib
import sys
import warnings

_ABSENT = object()


def _import_hiding(name: str, hidden: str):
    """Module ``name``, imported while ``import hidden`` raises ImportError; ``hidden`` is restored untouched."""
    if sys.modules.get(name) is not None:
        return sys.modules[name]
    saved = sys.modules.get(hidden, _ABSENT)
    sys.modules[hidden] = None  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module(name)
    finally:
        if saved is _ABSENT:
            del sys.modules[hidden]
        else:
            sys.modules[hidden] = saved


def import_mxnet():
    """The ``mxnet`` module, imported with scikit-learn hidden from ``mx.model`` (see the module's docstring)."""
    if sys.modules.get("sklearn") is not None:  # imported already: nothing to save
        import mxnet
        return mxnet
    return _import_hiding("mxnet", "sklearn")


def import_gluoncv():
    """The ``gluoncv`` module, imported with torch hidden from its version check (and MXNet without scikit-learn)."""
    import_mxnet()
    return _import_hiding("gluoncv", "torch")
