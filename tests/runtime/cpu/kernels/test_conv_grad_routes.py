"""The first Conv's output gradient routed natively through a MaxPool (and a Relu): the
kernel against PyTorch, the split that finds it, and train steps against the graph as written
and against ``torch.autograd``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from gradcheck import assert_same_training
from torch_models import export, export_dynamo, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import batch_norm, conv_grads
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

_native = NATIVE


def _tied(rng: np.random.Generator, shape: tuple[int, ...], relu: bool) -> np.ndarray:
    """Values on a coarse grid (many ties in a window), clipped at 0 behind a Relu."""
    y = (np.round(rng.standard_normal(shape) * 2) / 2).astype(np.float32)
    return np.maximum(y, np.float32(0)) if relu else y


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "plain"])
@pytest.mark.parametrize(
    ("shape", "kernel"),
    [((3, 4, 8, 8), (2, 2)), ((2, 3, 9, 11), (2, 2)), ((2, 2, 10, 7), (3, 2))],
    ids=["even", "rows-past-the-windows", "3x2"],
)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("threads", [1, 3])
def test_route_kernel_matches_torch(shape, kernel, relu, with_bias, threads):
    rng = np.random.default_rng(0)
    y = _tied(rng, shape, relu)
    pooled = (shape[0], shape[1], shape[2] // kernel[0], shape[3] // kernel[1])
    dp = rng.standard_normal(pooled).astype(np.float32)
    dy = np.full(shape, 7.0, np.float32)  # every element is written
    bias = np.full(shape[1], 9.0, np.float32) if with_bias else None
    _native.route_max_pool(y, dp, dy, bias, kernel, relu, threads)

    yt = torch.from_numpy(y).requires_grad_()
    out = nn.functional.max_pool2d(yt, kernel)
    # behind a Relu: y = relu(z) and dL/dz = dL/dy * (y > 0); relu(max) masks the same places
    (torch.relu(out) if relu else out).backward(torch.from_numpy(dp))
    expected = yt.grad.numpy()
    if relu:
        expected = expected * (y > 0)
    np.testing.assert_array_equal(dy, expected)
    if with_bias:
        np.testing.assert_allclose(bias, expected.sum((0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_route_kernel_refuses_shapes_that_do_not_fit():
    y = np.zeros((2, 3, 8, 8), np.float32)
    dy = np.zeros_like(y)
    with pytest.raises(ValueError, match=r"do not fit windows of \(3, 3\)"):
        _native.route_max_pool(y, np.zeros((2, 3, 4, 4), np.float32), dy, None, (3, 3), True, 1)
    with pytest.raises(ValueError, match="with a bias of the channels"):
        _native.route_max_pool(
            y, np.zeros((2, 3, 4, 4), np.float32), dy, np.zeros(4, np.float32), (2, 2), True, 1
        )
    with pytest.raises(ValueError, match="dy is read-only"):
        dy.flags.writeable = False
        _native.route_max_pool(y, np.zeros((2, 3, 4, 4), np.float32), dy, None, (2, 2), True, 1)


class PoolNet(nn.Module):
    """LeNet's layout: Conv -> (Relu) -> MaxPool twice, then a Linear. Only the first Conv's
    output gradient is routed: the second's also feeds its input gradient."""

    def __init__(self, bias: bool = True, relu: bool = True, pool: int = 2) -> None:
        super().__init__()
        self.relu, self.pool = relu, pool
        self.conv1 = nn.Conv2d(2, 6, 3, padding=1, bias=bias)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        side = 12 // pool // 2
        self.fc = nn.Linear(8 * side * side, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x)
        h = nn.functional.max_pool2d(torch.relu(h) if self.relu else h, self.pool)
        h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def _directory(tmp_path, dynamo=False, frozen=(), **kwargs):
    model = seeded(PoolNet, **kwargs)
    example = torch.zeros(2, 2, 12, 12)
    onnx_model = export_dynamo(model, example) if dynamo else export(model, example)
    params = [name for name, _ in model.named_parameters()]
    artifacts.generate_artifacts(
        onnx_model,
        requires_grad=[name for name in params if name not in frozen],
        frozen_params=list(frozen),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1, momentum=0.9),
        artifact_directory=tmp_path,
    )
    return model, tmp_path


def _module(directory, native: bool):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx",
        state,
        session_config=SessionConfig(native_conv_grads=native, native_segments=native),
    )
    return state, module, Optimizer(directory / "optimizer_model.onnx", module)


@pytest.mark.parametrize(
    ("kwargs", "frozen", "relu", "bias"),
    [
        ({}, (), True, "conv1.bias"),
        ({"bias": False}, (), True, None),
        ({"relu": False, "pool": 3}, (), False, "conv1.bias"),
        ({}, ("conv1.bias",), True, None),
    ],
    ids=["relu-bias", "no-bias", "no-relu-3x3", "frozen-bias"],
)
def test_split_routes_the_first_conv_only(tmp_path, kwargs, frozen, relu, bias):
    _, directory = _directory(tmp_path, frozen=frozen, **kwargs)
    model = onnx.load(directory / "training_model.onnx")
    split, grads = conv_grads.split_weight_grads(model)
    by_param = {g.param: g for g in grads}
    assert by_param.keys() == {"conv1.weight", "conv2.weight"}
    route = by_param["conv1.weight"].route
    assert by_param["conv2.weight"].route is None
    assert route is not None
    assert (route.relu, route.bias, route.kernel) == (relu, bias, (kwargs.get("pool", 2),) * 2)
    outputs = {o.name for o in split.graph.output}
    assert {route.y, route.dp} <= outputs
    assert by_param["conv1.weight"].dy not in outputs
    assert "conv1.bias_grad" not in outputs
    assert ("conv1.bias" in conv_grads.native_params(grads)) == (bias is not None)
    onnx.checker.check_model(split, full_check=True)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_routed_steps_match_the_graph_and_torch(tmp_path, dynamo):
    torch_model, directory = _directory(tmp_path, dynamo=dynamo)
    rng = np.random.default_rng(0)
    batches = [
        (_tied(rng, (n, 2, 12, 12), relu=False), rng.integers(0, 5, n)) for n in (8, 8, 3)
    ]
    runs = {}
    for native in (True, False):
        state, module, opt = _module(directory, native)
        routes = [g.route for g in module.step.gradients.weight_grads if g.route is not None]
        assert len(routes) == int(native)
        # the second Conv's output gradient also feeds its input gradient: it is routed
        # between two onnxruntime segments
        kernels = getattr(module.step.runner, "_plan", segments.Plan([])).kernels
        routed = [k for ks in kernels for k in ks if isinstance(k, batch_norm.MaxPoolGrad)]
        assert [(k.route.relu, k.route.bias) for k in routed] == [(True, "conv2.bias")] * native
        losses, grads = [], []
        for x, y in batches:
            losses.append(float(module(x, y)))
            grads.append({n: p.grad.copy() for n, p in state.parameters.items()})
            opt.step()
            module.lazy_reset_grad()
        runs[native] = losses, grads, {n: p.data.copy() for n, p in state.parameters.items()}
    assert_same_training(runs[True], runs[False])
    losses, grads, _ = runs[True]

    # the first step's gradients against torch.autograd on the same weights and batch
    x, y = batches[0]
    loss = nn.functional.cross_entropy(torch_model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(losses[0], loss.item(), rtol=1e-5)
    for name, param in torch_model.named_parameters():
        np.testing.assert_allclose(grads[0][name], param.grad.numpy(), rtol=1e-4, atol=1e-6)
