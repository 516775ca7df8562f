"""``--compile``: torch.compile per repeated block, so that Horovod still gets each gradient as the backward pass makes
it.

horovod.torch hands a gradient to its background thread from a hook on the parameter's AccumulateGrad node. A model
compiled as one graph has one backward node that produces every gradient at its end: the hooks then all fire there
and no allreduce overlaps the backward pass (measured on a 12-block MLP: the first hook at 0.99 of the backward,
against 0.01 eager). Compiled block by block, each block's backward is its own node and the gradients come out as
eagerly (the first at 0.01, the median at 0.5): what torchtitan does (one compiled region per transformer block) and
Accelerate calls regional compilation.

Each region is compiled in place: the block's ``forward`` becomes the compiled forward of a shim that calls the
block's class ``forward``. The block keeps its parameters, buffers and names, so state dicts, checkpoints, exports and
``--init-from`` never see torch.compile's ``_orig_mod.`` prefix, and a checkpoint of a compiled run resumes without
``--compile`` and the other way round. (``nn.Module.compile()`` would also keep the names, but dynamo does not trace
a torch.nn container such as ``nn.Sequential`` compiled that way: it ran eager.)
"""
from __future__ import annotations

import os
import socket
from typing import Any, List, Sequence, Tuple

from ..config import ConfigError

WHOLE = "model"
"""``--compile-blocks model``: the whole model as one region (no overlap; the fallback where no blocks are found)."""


def _shim_class():
    import torch

    class Region(torch.nn.Module):
        """Calls the block's own class forward: what torch.compile traces (not registered as a submodule)."""

        def __init__(self, block):
            super().__init__()
            object.__setattr__(self, "block", block)

        def forward(self, *args, **kwargs):
            return type(self.block).forward(self.block, *args, **kwargs)

    return Region


def find_blocks(model: Any) -> List[str]:
    """The names of the model's repeated blocks: the children of its ``nn.Sequential`` / ``nn.ModuleList``
    containers that have submodules of their own and whose type appears at least twice in that container (ResNet's
    Bottlenecks in layer1-4, a transformer's layers); the outermost such containers only. [] where there are none."""
    import torch.nn as nn
    found: List[str] = []

    def visit(prefix: str, module: Any) -> None:
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            children = list(module.named_children())
            kinds = [type(c) for _, c in children]
            blocks = [(n, c) for n, c in children if any(True for _ in c.children()) and kinds.count(type(c)) > 1]
            if blocks:
                found.extend(f"{prefix}{n}" for n, _ in blocks)
                for n, c in children:
                    if (n, c) not in blocks:
                        visit(f"{prefix}{n}.", c)
                return
        for n, c in module.named_children():
            visit(f"{prefix}{n}.", c)

    visit("", model)
    return found


def check_blocks(model: Any, names: Sequence[str]) -> None:
    """A ConfigError naming the first of ``names`` that is not a submodule of ``model`` (``model``: the whole)."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n != WHOLE and n not in modules]
    if missing:
        some = ", ".join(n for n in list(modules)[1:8] if n)
        raise ConfigError(f"--compile-blocks {missing[0]!r}: the model has no such submodule (it has {some}, ...); "
                          f"name submodules by their state-dict prefix, or pass {WHOLE!r} for the whole model")


def compile_regions(model: Any, names: Sequence[str], mode: str, backend: str) -> Tuple[List[str], bool]:
    """Compile ``names`` (or the blocks :func:`find_blocks` finds) in place; (the regions, whether it fell back to
    the whole model because no block was named or found)."""
    import torch
    names = list(names) or find_blocks(model)
    fallback = not names
    if fallback:
        names = [WHOLE]
    check_blocks(model, names)
    Region = _shim_class()
    modules = dict(model.named_modules())
    options = {"backend": backend} if mode == "default" else {"backend": backend, "mode": mode}
    for name in names:
        block = model if name == WHOLE else modules[name]
        object.__setattr__(block, "forward", torch.compile(Region(block), **options))
    return names, fallback


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation adds one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cache_directory(output_dir: str) -> str:
    """Inductor's cache for this host under the output directory (compiled kernels are reused on resume); a user's
    TORCHINDUCTOR_CACHE_DIR wins. Per host: ranks on one host share it, hosts on a shared file system do not race."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        chosen = os.path.abspath(os.path.join(output_dir, "compile-cache", socket.gethostname()))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return chosen
