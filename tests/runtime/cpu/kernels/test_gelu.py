"""GELU and its gradient computed natively between onnxruntime segments
(traingraph.runtime.cpu.kernels.gelu), exact and tanh-approximated: the kernel against PyTorch
in float64 and against the graph's nodes with non-finite inputs, the match of the exporters'
forms (elementwise ops, or opset 20's Gelu op whose gradient alone is taken) and of the gradient
nodes, and Module's train steps against the graph as written and PyTorch."""

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
from traingraph import from_torch
from traingraph.runtime.cpu import segments, verify
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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scale", [1.0, 4.0, 40.0])
def test_tanh_kernel_matches_torch(threads, scale):
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((3, 64, 341)) * scale).astype(np.float32)
    a.flat[:8] = [0.0, -0.0, 1e-30, -1e-8, 0.62, -0.63, 44.0, -95.0]  # the tanh's branches
    g = rng.standard_normal(a.shape).astype(np.float32)
    y, da = np.full_like(a, np.nan), np.full_like(a, np.nan)
    NATIVE.gelu(a, None, y, threads, None, True)
    NATIVE.gelu(a, g, da, threads, None, True)
    at = torch.from_numpy(a).double().requires_grad_()
    want = nn.functional.gelu(at, approximate="tanh")
    want.backward(torch.from_numpy(g).double())
    want_y, want_da = want.detach().numpy(), at.grad.numpy()
    # (a / 2)(1 + t) in float32 keeps |a| ulp(1) / 2 absolutely where t is near -1, as the
    # graph's nodes do; elsewhere a few units in the last place
    magnitude = np.abs(a) * (1 + np.abs(g))
    assert np.all(np.abs(y - want_y) <= 1.2e-7 * np.abs(a) + 4e-7 * np.abs(want_y) + 1e-30)
    assert np.all(np.abs(da - want_da) <= 4e-7 * magnitude + 1e-6 * np.abs(want_da) + 1e-30)


def test_tanh_kernel_is_the_graphs_with_non_finite_values(tmp_path):
    # the exporter's nodes of the tanh GELU and of its gradient, run by onnxruntime, against
    # the kernel on the values where products of zero and infinity decide
    model = onnx.load(
        _artifacts(tmp_path, seeded(FeedForward, approximate="tanh")) / "training_model.onnx"
    )
    found = gelu.split_gelus(model)
    (forward,), (backward,) = ([k for k, _ in found if (k.g is None) == f] for f in (1, 0))
    nodes = [model.graph.node[i] for i in sorted(set().union(*(n for _, n in found)))]
    special = [np.inf, -np.inf, np.nan, 1e20, -1e20, 3e13, -3e13, 0.0, -0.0, 9.0, -9.0]
    a = np.array(special * 2 + [0.5] * 10, np.float32).reshape(4, 8)
    g = np.ones_like(a)
    g[2] = [np.inf, -np.inf, np.nan, 0.0, 2.0, -2.0, 1e30, -0.0]
    want = verify.run_subgraph(model, nodes, {forward.a: a, backward.g: g},
                               [forward.out, backward.out])  # fmt: skip
    got: dict[str, np.ndarray] = {}
    forward.compute({forward.a: a}, got, 1)
    backward.compute({backward.a: a, backward.g: g}, got, 1)
    for name, expected in zip((forward.out, backward.out), want):
        assert verify.same_values(got[name], expected), (name, got[name], expected)


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


class NewGelu(nn.Module):
    """Transformers' GPT-2 GELU written out: ``0.5 a (1 + tanh(sqrt(2 / pi) (a + 0.044715
    a^3)))``, with a ``Pow`` for the cube and the half taken first."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.up(x)
        inner = 0.7978845608028654 * (a + 0.044715 * torch.pow(a, 3.0))
        return self.down(0.5 * a * (1.0 + torch.tanh(inner)))


def _tanh_feed_forward() -> nn.Module:
    return FeedForward(approximate="tanh")


def _artifacts(tmp_path, net: nn.Module):
    return adamw_artifacts(tmp_path, export(net, torch.zeros(2, 6)))


NETS = [FeedForward, HalfFirst, _tanh_feed_forward, NewGelu]
NET_IDS = ["exporter", "half-first", "tanh-exporter", "tanh-written-out"]


@pytest.mark.parametrize("net", NETS, ids=NET_IDS)
def test_forward_and_gradient_are_matched(tmp_path, net):
    model = onnx.load(_artifacts(tmp_path, seeded(net)) / "training_model.onnx")
    found = gelu.split_gelus(model)
    forward = [k for k, _ in found if k.g is None]
    backward = [k for k, _ in found if k.g is not None]
    assert len(forward) == len(backward) == 1
    assert forward[0].a == backward[0].a
    assert forward[0].tanh == backward[0].tanh == (net in (_tanh_feed_forward, NewGelu))
    replaced = {model.graph.node[i].op_type for _, nodes in found for i in nodes}
    nonlinearity = "Tanh" if forward[0].tanh else "Erf"
    assert replaced >= ({"Tanh", "Sub"} if forward[0].tanh else {"Erf", "Exp", "Neg"})
    left = [n.op_type for i, n in enumerate(model.graph.node)
            if i not in set().union(*(nodes for _, nodes in found))]  # fmt: skip
    assert nonlinearity not in left
    # the kernels' nodes are taken once: another kernel leaves them to none
    taken = set().union(*(nodes for _, nodes in found))
    assert gelu.split_gelus(model, taken) == []


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_gelu_ops_gradient_is_matched(tmp_path, approximate):
    # traingraph.from_torch exports nn.GELU as opset 20's Gelu op: onnxruntime computes the
    # forward in one kernel, the gradient rule's nodes become one kernel
    net = seeded(FeedForward, approximate=approximate)
    directory = adamw_artifacts(tmp_path, from_torch(net, torch.zeros(2, 6)))
    model = onnx.load(directory / "training_model.onnx")
    found = gelu.split_gelus(model)
    assert len(found) == 1
    ((kernel, nodes),) = found
    assert kernel.g is not None and kernel.tanh == (approximate == "tanh")
    assert "Gelu" not in {model.graph.node[i].op_type for i in nodes}
    assert [n.op_type for n in model.graph.node].count("Gelu") == 1
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32) * 2, rng.integers(0, 3, n))
        for n in (5, 5, 3)
    ]
    got = artifact_steps(directory, batches, gelu.Gelu)
    assert_same_training(got, artifact_steps(directory, batches, gelu.Gelu, without=NO_GELUS))
    assert_trains_as_torch_adamw(got, seeded(FeedForward, approximate=approximate), batches, 0.01)


def test_shared_values_are_left(tmp_path):
    # a GELU whose erf another node reads too stays whole
    exact = onnx.load(_artifacts(tmp_path, seeded(FeedForward)) / "training_model.onnx")
    erf = next(n for n in exact.graph.node if n.op_type == "Erf")
    exact.graph.node.append(onnx.helper.make_node("Identity", [erf.output[0]], ["erf_copy"]))
    exact.graph.output.append(onnx.helper.make_tensor_value_info("erf_copy", 1, None))
    assert gelu.split_gelus(exact) == []
    # so does a tanh GELU whose tanh is a model output
    approximated = onnx.load(
        _artifacts(tmp_path / "tanh", seeded(FeedForward, approximate="tanh"))
        / "training_model.onnx"
    )
    tanh = next(n for n in approximated.graph.node if n.op_type == "Tanh")
    approximated.graph.output.append(onnx.helper.make_tensor_value_info(tanh.output[0], 1, None))
    assert gelu.split_gelus(approximated) == []


@pytest.mark.parametrize("net", NETS, ids=NET_IDS)
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
