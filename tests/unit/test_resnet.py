import os

import pytest

torch = pytest.importorskip("torch")

from recipes.resnet_torch import Bottleneck, resnet  # noqa: E402
from tests.helpers import ROOT  # noqa: E402


def recorded():
    path = os.path.join(ROOT, "tests", "data", "resnet50_torchvision_state_dict.txt")
    rows = [line.split() for line in open(path) if line.strip() and not line.startswith("#")]
    return [(name, () if shape == "scalar" else tuple(int(d) for d in shape.split("x"))) for name, shape in rows]


def test_resnet50_has_torchvisions_parameter_count_names_and_shapes():
    model = resnet("resnet50")
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert len(list(model.parameters())) == 161
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == recorded()


def test_forward_shape_and_last_gamma():
    model = resnet("resnet50", num_classes=7, last_gamma=True).eval()
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 16 and all(float(b.bn3.weight.detach().abs().sum()) == 0 for b in blocks)
    assert float(resnet("resnet50").layer1[0].bn3.weight.detach().sum()) > 0
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 64, 64)).shape == (2, 7)


def test_v1_strides_in_the_first_1x1_convolution():
    v1b, v1 = resnet("resnet50"), resnet("resnet50", stride_in_1x1=True)
    assert v1b.layer2[0].conv2.stride == (2, 2) and v1b.layer2[0].conv1.stride == (1, 1)
    assert v1.layer2[0].conv1.stride == (2, 2) and v1.layer2[0].conv2.stride == (1, 1)
