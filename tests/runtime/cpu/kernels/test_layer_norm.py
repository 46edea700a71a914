"""LayerNormalization gradients computed natively between onnxruntime segments
(traingraph.runtime.cpu.kernels.layer_norm): the kernel against PyTorch, the match, and Module's
train steps
against the graph as written and PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from gradcheck import (
    adamw_artifacts,
    artifact_steps,
    assert_same_training,
    assert_trains_as_torch_adamw,
)
from torch_models import export, seeded
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import layer_norm
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

NO_LAYER_NORMS = "layer_norm_grad"


def _torch_grads(x, dy, scale, bias, eps):
    leaves = [torch.from_numpy(v).double().requires_grad_() for v in (x, scale, bias)]
    out = nn.functional.layer_norm(leaves[0], x.shape[-1:], leaves[1], leaves[2], eps)
    out.backward(torch.from_numpy(dy).double())
    return [leaf.grad.numpy() for leaf in leaves]


@pytest.mark.parametrize(
    "shape", [(5, 37), (16, 64, 128), (3, 2, 300), (200, 16)],
    ids=["tails", "rows", "long-rows", "many-rows"],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_torch(shape, threads):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2 + 30).astype(np.float32)  # rows far from a mean of 0
    dy = rng.standard_normal(shape).astype(np.float32)
    scale, bias = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
    dx, dscale, dbias = np.full_like(x, np.nan), np.full_like(scale, np.nan), np.empty_like(bias)
    NATIVE.layer_norm_grad(x, dy, scale, dx, dscale, dbias, 1e-5, threads)
    for got, want in zip((dx, dscale, dbias), _torch_grads(x, dy, scale, bias, 1e-5)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


def test_kernel_skips_the_gradients_not_asked_for():
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((6, 20)).astype(np.float32) for _ in range(2))
    scale = rng.standard_normal(20).astype(np.float32)
    full = [np.empty_like(x), np.empty_like(scale), np.empty_like(scale)]
    NATIVE.layer_norm_grad(x, dy, scale, *full, 1e-5, 2)
    dbias = np.empty_like(scale)
    NATIVE.layer_norm_grad(x, dy, scale, None, None, dbias, 1e-5, 2)
    np.testing.assert_array_equal(dbias, full[2])


def test_kernel_refuses_arrays_it_cannot_take():
    x = np.zeros((2, 3, 4), np.float32)
    c = np.zeros(4, np.float32)
    kernel = NATIVE.layer_norm_grad
    with pytest.raises(ValueError, match="one size"):
        kernel(x, np.zeros((2, 3, 5), np.float32), c, np.empty_like(x), c, c, 1e-5, 1)
    with pytest.raises(ValueError, match="last axis"):
        kernel(x, x, np.zeros(3, np.float32), np.empty_like(x), c, c, 1e-5, 1)
    with pytest.raises(ValueError, match="dx is not float32"):
        kernel(x, x, c, np.empty(x.shape), c, c, 1e-5, 1)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kernel(x, x, c, np.empty_like(x), c, frozen, 1e-5, 1)


class Normed(nn.Module):
    """Linear, LayerNorm (over ``normalized`` trailing axes), Relu, Linear."""

    def __init__(self, normalized: tuple[int, ...] = (8,), affine: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(normalized, elementwise_affine=affine)
        self.down = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, 6] -> [N, 2, 8]: rows of a second axis, as a Transformer's tokens
        h = self.up(torch.stack([x, -x], dim=1))
        return self.down(torch.relu(self.norm(h))).mean(dim=1)


def _artifacts(tmp_path, net: nn.Module):
    return adamw_artifacts(tmp_path, export(net, torch.zeros(2, 6)))


def test_the_gradient_is_matched(tmp_path):
    model = onnx.load(_artifacts(tmp_path, seeded(Normed)) / "training_model.onnx")
    found = layer_norm.split_layer_norm_grads(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    (ln,) = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert (kernel.x, kernel.scale) == tuple(ln.input[:2])
    assert kernel.dscale == "norm.weight_grad" and kernel.dbias == "norm.bias_grad"
    assert kernel.dx is not None
    replaced = {model.graph.node[i].op_type for i in nodes}
    assert {"ReduceMean", "Reciprocal", "ReduceSum"} <= replaced
    assert "LayerNormalization" not in replaced  # onnxruntime's forward stays
    # the nodes are taken once: another kernel leaves them to none
    assert layer_norm.split_layer_norm_grads(model, nodes) == []


def test_layer_norms_the_kernel_does_not_compute_are_left(tmp_path):
    # over two axes, and without a bias (whose gradient finds the output's)
    net = seeded(Normed, normalized=(2, 8))
    two = onnx.load(_artifacts(tmp_path / "two", net) / "training_model.onnx")
    assert layer_norm.split_layer_norm_grads(two) == []
    plain = onnx.load(
        _artifacts(tmp_path / "plain", seeded(Normed, affine=False)) / "training_model.onnx"
    )
    assert layer_norm.split_layer_norm_grads(plain) == []


def test_module_trains_as_the_graph_and_torch_do(tmp_path):
    directory = _artifacts(tmp_path, seeded(Normed))
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32) * 2, rng.integers(0, 3, n))
        for n in (5, 5, 3)  # the batch changes: the kernel's outputs follow it
    ]
    got = artifact_steps(directory, batches, layer_norm.LayerNormGrad)
    expected = artifact_steps(directory, batches, layer_norm.LayerNormGrad, without=NO_LAYER_NORMS)
    assert_same_training(got, expected)
    # and PyTorch's steps from the same weights
    assert_trains_as_torch_adamw(got, seeded(Normed), batches, lr=0.01)


class InputNormed(nn.Module):
    """LayerNorm of the model's input itself, then Linear: no gradient of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.down = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(x))


def test_a_layer_norm_of_the_input_trains_with_the_kernel(tmp_path):
    """Without ``dx`` the kernel reads no scale: the match is checked, kept and trains as the
    graph and PyTorch do."""
    directory = _artifacts(tmp_path, seeded(InputNormed))
    ((kernel, _),) = layer_norm.split_layer_norm_grads(
        onnx.load(directory / "training_model.onnx")
    )
    assert kernel.dx is None and kernel.scale not in kernel.inputs
    rng = np.random.default_rng(2)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)) for n in (4, 4)
    ]
    got = artifact_steps(directory, batches, layer_norm.LayerNormGrad)
    expected = artifact_steps(directory, batches, layer_norm.LayerNormGrad, without=NO_LAYER_NORMS)
    assert_same_training(got, expected)
    assert_trains_as_torch_adamw(got, seeded(InputNormed), batches, lr=0.01)


def test_the_plan_runs_the_gradient_between_segments(tmp_path):
    model = onnx.load(_artifacts(tmp_path, seeded(Normed)) / "training_model.onnx")
    model, kernels = segments.find_kernels(model, [])
    plan = segments.plan_segments(model, kernels)
    assert any(isinstance(k, layer_norm.LayerNormGrad) for k in plan.all_kernels)
    assert not any(n.op_type == "Reciprocal" for s in plan.segments for n in s.model.graph.node)
