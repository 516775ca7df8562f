"""Import GluonCV beside PyTorch >= 2.0.

gluoncv 0.10.5's ``__init__`` raises RuntimeError whenever torch >= 2.0 is importable (gluoncv/check.py:
_require_pytorch_version), even though its MXNet model zoo never uses torch. Hiding torch from that one check —
``sys.modules['torch'] = None`` for the duration of the import, so ``import torch`` raises ImportError there — lets
the MXNet side load; torch is restored untouched afterwards.
"""
from __future__ import annotations

import sys
import warnings

_ABSENT = object()


def import_gluoncv():
    """The ``gluoncv`` module, imported with torch hidden from its version check."""
    if sys.modules.get("gluoncv") is not None:
        return sys.modules["gluoncv"]
    saved = sys.modules.get("torch", _ABSENT)
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import gluoncv
    finally:
        if saved is _ABSENT:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved
    return gluoncv
