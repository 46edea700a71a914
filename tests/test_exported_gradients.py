"""The op forms PyTorch's two exporters emit differentiate, with a dynamic batch.

Models are exported in training mode by the TorchScript exporter (opset 17,
``do_constant_folding=False``) and by the dynamo exporter (``optimize=False``, opset 18), built
into a training program with a mean squared error and run by onnxruntime; every parameter's
gradient must equal torch's in float64 to ``1e-3`` of its largest value, or to twice torch's own
float32 error where torch is further off (BatchNorm over few values).

The forms met on the way: Resize whose sizes are ``Concat(Shape(x)[:2], Shape(y)[2:])`` with a
dynamic batch (every segmentation head), ReduceMean axes from ``Constant(value_ints)`` through a
Reshape with -1 (the dynamo exporter's ``mean``), and ``chunk`` as SplitToSequence/SequenceAt
(the dynamo exporter's ``chunk``).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from traingraph.losses import MSELoss
from traingraph.program import build_program


class TinySegmenter(nn.Module):
    """Conv-BatchNorm-ReLU at half resolution, ``chunk`` into a value and a gate, a global mean,
    a 1x1 Conv and a bilinear upsampling back to the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = torch.relu(self.bn(self.conv(x))).chunk(2, dim=1)
        h = value * torch.sigmoid(gate.mean(dim=(2, 3), keepdim=True))
        return F.interpolate(self.head(h), size=x.shape[-2:], mode="bilinear", align_corners=False)


def export(
    model: nn.Module, example: torch.Tensor, exporter: str, output: str = "y"
) -> onnx.ModelProto:
    """``model`` exported by ``exporter`` as the exporter itself writes it (no
    :func:`traingraph.from_torch`): training mode, a dynamic batch axis, input ``x`` and output
    ``output``."""
    if exporter == "torchscript":
        buffer = io.BytesIO()
        torch.onnx.export(
            model, (example,), buffer, input_names=["x"], output_names=[output],
            dynamic_axes={"x": {0: "batch"}, output: {0: "batch"}}, opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False,
        )  # fmt: skip
        return onnx.load_from_string(buffer.getvalue())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), dynamo=True, optimize=False, verbose=False, input_names=["x"],
            output_names=[output], dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2)}},
        )  # fmt: skip
    assert program is not None
    return program.model_proto


def assert_gradients_match_torch(make: type[nn.Module] | object, exporter: str, shape) -> None:
    """Build ``make()``'s exported training program and compare its gradients with torch's."""
    torch.manual_seed(0)
    model = make().train()  # type: ignore[operator]
    for module in model.modules():  # dropout off, so that both sides compute the same
        if isinstance(module, nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    program = build_program(export(model, x, exporter), loss=MSELoss())
    model.load_state_dict(initial)  # tracing in training mode moved the running statistics
    with torch.no_grad():
        target = torch.randn(model(x).shape, generator=g)
    model.load_state_dict(initial)

    session = ort.InferenceSession(
        program.train_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    feeds = {i.name: program.parameters.get(i.name) for i in session.get_inputs()}
    feeds.update(zip(program.input_names, (x.numpy(), target.numpy())))
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))

    grads = {}
    for dtype in (torch.float64, torch.float32):
        reference = make().to(dtype).train()  # type: ignore[operator]
        reference.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                   for k, v in initial.items()})  # fmt: skip
        for module in reference.modules():
            if isinstance(module, nn.Dropout) or type(module).__name__ == "StochasticDepth":
                module.p = 0.0
        F.mse_loss(reference(x.to(dtype)), target.to(dtype)).backward()
        grads[dtype] = {n: p.grad.double().numpy() for n, p in reference.named_parameters()}
    largest = max(np.abs(g).max() for g in grads[torch.float64].values())

    def error(got: np.ndarray, expected: np.ndarray) -> float:
        """Off by this much of the parameter's largest gradient (at least 1e-4 of the
        model's: float32 sums carry the rounding of the largest gradients into the smallest)."""
        return float(np.abs(got - expected).max() / (np.abs(expected).max() + 1e-4 * largest))

    ours = {n: error(outputs[f"{n}_grad"], e) for n, e in grads[torch.float64].items()}
    torch32 = {n: error(grads[torch.float32][n], e) for n, e in grads[torch.float64].items()}
    worst = max(ours, key=ours.__getitem__)
    assert ours[worst] <= max(1e-3, 2 * max(torch32.values())), (
        f"{worst}: gradient off by {ours[worst]:.3g} of its scale; torch float32 is off by"
        f" {max(torch32.values()):.3g} at most"
    )


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tiny_segmenter_gradients_equal_torch(exporter):
    assert_gradients_match_torch(TinySegmenter, exporter, (3, 3, 8, 8))


def _torchvision(name: str) -> object:
    from zoo.torchvision_import import torchvision_models

    models = torchvision_models()
    if name in ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50"):
        build = getattr(models.segmentation, name)
        extra = {} if name.startswith("lraspp") else {"aux_loss": False}

        class Segmenter(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = build(weights=None, weights_backbone=None, num_classes=3, **extra)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.m(x)["out"]

        return Segmenter
    return lambda: getattr(models, name)(weights=None, num_classes=5)


TORCHVISION = [
    "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50", "resnet18",
    "mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf", "convnext_tiny",
    "shufflenet_v2_x0_5",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_gradients_equal_torch(name, exporter):
    """torchvision models at 64x64 (batch 4) train with both exporters' forms."""
    assert_gradients_match_torch(_torchvision(name), exporter, (4, 3, 64, 64))
