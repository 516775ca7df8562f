"""Finding recipes: the ``hvdtrain.recipes`` entry points, or ``module:Class`` for a user's own Trainer."""
from __future__ import annotations

import importlib
import importlib.metadata
from typing import Dict

from .config import ConfigError

GROUP = "hvdtrain.recipes"
# The recipes shipped in this repository, for runs from a checkout that was not pip-installed.
BUILTIN = {"mnist": "recipes.mnist:MNISTTrainer", "fashion-mnist": "recipes.fashion_mnist:FashionMNISTTrainer",
           "imagenet": "recipes.imagenet:ImageNetTrainer", "regression": "recipes.regression:RegressionTrainer",
           "charlm": "recipes.charlm:CharLMTrainer"}


def available() -> Dict[str, str]:
    """Recipe name -> "module:Class", entry points overriding the built-in table."""
    found = {}
    for name, target in BUILTIN.items():
        module = target.split(":")[0]
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            try:
                if importlib.util.find_spec(module) is not None:
                    found[name] = target
            except ModuleNotFoundError:
                pass
    for ep in importlib.metadata.entry_points(group=GROUP):
        found[ep.name] = ep.value
    return dict(sorted(found.items()))


def load(name: str):
    """The Trainer subclass for a recipe name or a ``package.module:Class`` path."""
    from .trainer import Trainer
    target = name if ":" in name else available().get(name)
    if target is None:
        names = ", ".join(available()) or "none installed"
        raise ConfigError(f"unknown recipe {name!r}; available: {names} (or give package.module:TrainerClass)")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import recipe module {module_name!r}: {e}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ConfigError(f"{target} is not a hvdtrain.Trainer subclass")
    return cls
