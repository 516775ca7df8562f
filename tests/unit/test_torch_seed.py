"""The PyTorch backend's per-step seed on the CPU (every step reseeds, so that a resumed run draws what an
uninterrupted one drew): the CPU generator torch.manual_seed would leave, without its walk of the caller's stack."""
import traceback

import pytest
import torch

from hvdtrain.backends.torch import TorchBackend


def test_a_cpu_seed_leaves_the_generator_manual_seed_leaves_without_formatting_the_stack(monkeypatch):
    torch.manual_seed(1234)
    state, draws = torch.get_rng_state(), torch.rand(4)
    backend = TorchBackend()
    backend.device = torch.device("cpu")

    def walked(*args, **kwargs):
        raise AssertionError("the seed formatted a trace of the caller's stack")
    monkeypatch.setattr(traceback, "format_stack", walked)
    backend.seed(1234)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(torch.rand(4), draws)
    # torch.manual_seed queues a seed, with a formatted stack, for each accelerator runtime not initialized (0.1-0.4
    # ms a step at a trainer's depth): what the backend's seed leaves out on the CPU
    with pytest.raises(AssertionError, match="formatted a trace"):
        torch.manual_seed(1234)
