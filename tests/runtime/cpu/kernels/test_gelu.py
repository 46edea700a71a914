"""GELU and its gradient computed natively between onnxruntime segments
(traingraph.runtime.cpu.kernels.gelu): the kernel against PyTorch, the match of both exporters'
forms and
of the gradient nodes, and Module's train steps against the graph as written and PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
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
from traingraph.runtime.cpu.kernels import conv_grads, gelu
from traingraph.runtime.cpu.kernels.masks import DropoutMask
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

NO_GELUS = "gelu"


def _torch_gelu(a: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    at = torch.from_numpy(a).double().requires_grad_()
    y = nn.functional.gelu(at)
    y.backward(torch.from_numpy(g).double())
    return y.detach().numpy(), at.grad.numpy()


@pytest.mark.parametrize("shape", [(5,), (3, 17), (4, 64, 300)], ids=["tail", "rows", "threads"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_torch(shape, threads):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 3).astype(np.float32)
    a.flat[:4] = [0.0, -0.0, -12.0, 95.0][: a.size]  # zero, far tails, exp's lower limit
    g = rng.standard_normal(shape).astype(np.float32)
    y, da = np.full_like(a, np.nan), np.full_like(a, np.nan)
    NATIVE.gelu(a, None, y, threads)
    NATIVE.gelu(a, g, da, threads)
    want_y, want_da = _torch_gelu(a, g)
    np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=5e-7)
    np.testing.assert_allclose(da, want_da, rtol=2e-6, atol=5e-7)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_with_a_mask_matches_torch(threads):
    # GELU's output times a Dropout's mask, and the gradient for the product's gradient
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((4, 64, 301)) * 3).astype(np.float32)
    mask = ((rng.random(a.shape) > 0.3) / 0.7).astype(np.float32)
    g = rng.standard_normal(a.shape).astype(np.float32)
    at = torch.from_numpy(a).double().requires_grad_()
    product = nn.functional.gelu(at) * torch.from_numpy(mask).double()
    product.backward(torch.from_numpy(g).double())
    y, da = np.full_like(a, np.nan), np.full_like(a, np.nan)
    NATIVE.gelu(a, None, y, threads, mask)
    NATIVE.gelu(a, g, da, threads, mask)
    np.testing.assert_allclose(y, product.detach().numpy(), rtol=2e-6, atol=5e-7)
    np.testing.assert_allclose(da, at.grad.numpy(), rtol=2e-6, atol=5e-7)
    with pytest.raises(ValueError, match="mask has 7 elements"):
        NATIVE.gelu(a[0, 0, :8], None, y[0, 0, :8], 1, mask[0, 0, :7])
    # a factor that broadcasts is multiplied after the kernel
    row = mask[:1, :1]
    kernel = gelu.Gelu("a", "g", "out", "mask")
    out: dict[str, np.ndarray] = {}
    kernel.compute({"a": a, "g": g, "mask": row}, out, threads)
    plain = np.empty_like(a)
    NATIVE.gelu(a, g, plain, threads)
    np.testing.assert_allclose(out["out"], plain * row, rtol=1e-6)


def test_kernel_is_within_the_erf_bound_everywhere():
    a = np.linspace(-100, 100, 200_001, dtype=np.float32)
    y = np.empty_like(a)
    NATIVE.gelu(a, None, y, 2)
    want = nn.functional.gelu(torch.from_numpy(a).double()).numpy()
    # |a| 1.5e-7 / 2 from erf, and the float32 rounding of the steps
    assert np.all(np.abs(y - want) <= np.abs(a) * 1e-7 + np.abs(want) * 3e-7 + 1e-30)


def test_kernel_refuses_arrays_it_cannot_take():
    a = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="out has 7 elements, a has 8"):
        NATIVE.gelu(a, None, np.zeros(7, np.float32), 1)
    with pytest.raises(ValueError, match="float32"):
        NATIVE.gelu(a.astype(np.float64), None, np.zeros(8, np.float32), 1)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        NATIVE.gelu(a, None, frozen, 1)
    kernel = gelu.Gelu("a", "g", "out")
    with pytest.raises(ValueError, match="must have the input's shape"):
        kernel.compute({"a": np.zeros((2, 3), np.float32), "g": np.zeros(6, np.float32)}, {}, 1)


class FeedForward(nn.Module):
    """Linear, GELU, Dropout-free Linear: the feed-forward block of a Transformer."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)
        self.act = nn.GELU(approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class HalfFirst(nn.Module):
    """GELU written with the half taken before the product: ``(0.5 a) (1 + erf(a / sqrt 2))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.up(x)
        return self.down((0.5 * a) * (1 + torch.erf(a * 0.7071067811865476)))


def _artifacts(tmp_path, net: nn.Module):
    return adamw_artifacts(tmp_path, export(net, torch.zeros(2, 6)))


@pytest.mark.parametrize("net", [FeedForward, HalfFirst], ids=["exporter", "half-first"])
def test_forward_and_gradient_are_matched(tmp_path, net):
    model = onnx.load(_artifacts(tmp_path, seeded(net)) / "training_model.onnx")
    found = gelu.split_gelus(model)
    forward = [k for k, _ in found if k.g is None]
    backward = [k for k, _ in found if k.g is not None]
    assert len(forward) == len(backward) == 1
    assert forward[0].a == backward[0].a
    replaced = {model.graph.node[i].op_type for _, nodes in found for i in nodes}
    assert {"Erf", "Exp", "Neg"} <= replaced  # erf and its derivative
    left = [n.op_type for i, n in enumerate(model.graph.node)
            if i not in set().union(*(nodes for _, nodes in found))]  # fmt: skip
    assert "Erf" not in left
    # the kernels' nodes are taken once: another kernel leaves them to none
    taken = set().union(*(nodes for _, nodes in found))
    assert gelu.split_gelus(model, taken) == []


def test_tanh_approximation_and_shared_values_are_left(tmp_path):
    model = onnx.load(
        _artifacts(tmp_path, seeded(FeedForward, approximate="tanh")) / "training_model.onnx"
    )
    assert gelu.split_gelus(model) == []  # no Erf: the tanh form stays in the graph
    # a GELU whose erf another node reads too stays whole
    exact = onnx.load(_artifacts(tmp_path, seeded(FeedForward)) / "training_model.onnx")
    erf = next(n for n in exact.graph.node if n.op_type == "Erf")
    exact.graph.node.append(onnx.helper.make_node("Identity", [erf.output[0]], ["erf_copy"]))
    exact.graph.output.append(onnx.helper.make_tensor_value_info("erf_copy", 1, None))
    assert gelu.split_gelus(exact) == []


@pytest.mark.parametrize("net", [FeedForward, HalfFirst], ids=["exporter", "half-first"])
def test_module_trains_as_the_graph_and_torch_do(tmp_path, net):
    directory = _artifacts(tmp_path, seeded(net))
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32) * 2, rng.integers(0, 3, n))
        for n in (5, 5, 3)  # the batch changes: the kernels' outputs follow it
    ]
    got = artifact_steps(directory, batches, gelu.Gelu)
    expected = artifact_steps(directory, batches, gelu.Gelu, without=NO_GELUS)
    assert_same_training(got, expected)
    # and PyTorch's steps from the same weights
    assert_trains_as_torch_adamw(got, seeded(net), batches, lr=0.01)


class DroppedFeedForward(FeedForward):
    """Linear, GELU, Dropout, Linear: a Transformer's feed-forward block in training."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(self.act(self.up(x))))


def test_the_dropout_after_gelu_is_taken_into_its_kernels(tmp_path):
    net = seeded(DroppedFeedForward)
    directory = adamw_artifacts(tmp_path, export(net, torch.zeros(2, 6), training=True))
    model = onnx.load(directory / "training_model.onnx")
    _, found = segments.find_kernels(model, [])
    masks = [k for k, _ in found if isinstance(k, DropoutMask)]
    gelus = [(k, nodes) for k, nodes in found if isinstance(k, gelu.Gelu)]
    assert len(masks) == 1 and len(gelus) == 2
    for kernel, nodes in gelus:  # the mask's Mul (or its gradient's) is the kernel's
        assert kernel.mask == masks[0].mask
        muls = [i for i in nodes if model.graph.node[i].op_type == "Mul"
                and masks[0].mask in model.graph.node[i].input]  # fmt: skip
        assert len(muls) == 1
    # the steps are the graph's (the same seeds draw the same masks)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32) * 2, rng.integers(0, 3, n))
        for n in (5, 5, 3)
    ]
    ort.set_seed(0)
    got = artifact_steps(directory, batches, gelu.Gelu)
    ort.set_seed(0)
    expected = artifact_steps(directory, batches, gelu.Gelu, without=NO_GELUS)
    assert_same_training(got, expected)


def test_segments_place_the_gradient_after_its_input(tmp_path):
    model = onnx.load(_artifacts(tmp_path, seeded(FeedForward)) / "training_model.onnx")
    model, grads = conv_grads.split_weight_grads(model)
    model, kernels = segments.find_kernels(model, grads)
    plan = segments.plan_segments(model, kernels)
    order = [k for k in plan.all_kernels if isinstance(k, gelu.Gelu)]
    assert [k.g is None for k in order] == [True, False]


def test_gradient_is_checked_with_its_forward_when_checks_are_split(tmp_path, monkeypatch):
    # The gradient's nodes read the forward's intermediates: checked in a session without the
    # forward's nodes they would read random values, disagree and drop a right kernel.
    from traingraph.runtime.cpu import verify

    monkeypatch.setattr(verify, "CHECK_BYTES", 1)  # every group in a session of its own
    model = onnx.load(_artifacts(tmp_path, seeded(FeedForward)) / "training_model.onnx")
    found = gelu.split_gelus(model)
    assert sorted(k.g is None for k, _ in found) == [False, True]
