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


@pytest.mark.parametrize("device, seeds_cuda", [("cuda", True), ("cpu", False)])
def test_a_gpu_seed_seeds_every_device_and_a_cpu_seed_the_cpu_alone(monkeypatch, device, seeds_cuda):
    """On a GPU the backend keeps torch.manual_seed, which seeds the CUDA generators as well as the CPU's (lazily,
    where CUDA is not initialized, as on this machine): the branch a CPU run never takes, run here with the device
    named and CUDA's seed watched."""
    torch.manual_seed(77)
    state = torch.get_rng_state()
    torch.manual_seed(5)
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    backend = TorchBackend()
    backend.device = torch.device(device)
    backend.seed(77)
    assert torch.equal(torch.get_rng_state(), state)
    assert seeded == ([77] if seeds_cuda else [])
