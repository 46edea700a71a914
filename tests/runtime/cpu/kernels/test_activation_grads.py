"""The HardSwish and SiLU input gradients as one native pass each: found in the graphs the
autodiff rules write and equal to them (HardSwish's element for element, the SiLU's but for the
rounding of its own Sigmoid; NaN, infinities and the bounds where the graph has them), and
Module's train steps equal with the kernels and without."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from gradcheck import adamw_artifacts, artifact_steps, assert_same_training
from torch_models import export, seeded
from traingraph.runtime.cpu import native
from traingraph.runtime.cpu.kernels import activation_grads

pytestmark = pytest.mark.skipif(
    native.NATIVE is None or not hasattr(native.NATIVE, "silu_grad"),
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


class Net(nn.Module):
    """Linear, an activation, Linear."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 3)
        self.act = nn.Hardswish() if act == "hardswish" else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


KINDS = {"hardswish": activation_grads.HardSwishGrad, "silu": activation_grads.SiluGrad}
SPLIT = {
    "hardswish": activation_grads.split_hardswish_grads,
    "silu": activation_grads.split_silu_grads,
}


def _training_model(tmp_path, act: str) -> onnx.ModelProto:
    directory = adamw_artifacts(tmp_path, export(seeded(Net, act=act), torch.zeros(2, 6)))
    return onnx.load(directory / "training_model.onnx")


def _replaced(model: onnx.ModelProto, nodes: set[int], kernel) -> onnx.ModelProto:
    """The model of the nodes a match replaces, reading the kernel's inputs."""
    graph = model.graph
    chosen = [graph.node[i] for i in sorted(nodes)]
    read = {v for n in chosen for v in n.input}
    made = {v for n in chosen for v in n.output}
    constants = [t for t in graph.initializer if t.name in read]
    constants += [n for n in graph.node if n.op_type == "Constant" and n.output[0] in read - made]
    nodes_out = [n for n in constants if isinstance(n, onnx.NodeProto)] + chosen
    initializers = [t for t in constants if isinstance(t, onnx.TensorProto)]
    f = onnx.TensorProto.FLOAT
    inputs = [onnx.helper.make_tensor_value_info(v, f, None) for v in kernel.inputs]
    outputs = [onnx.helper.make_tensor_value_info(kernel.out, f, None)]
    sub = onnx.helper.make_graph(nodes_out, "match", inputs, outputs, initializer=initializers)
    return onnx.helper.make_model(sub, opset_imports=model.opset_import)


def _batches(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Three batches for the 6-feature models, the last smaller: the kernels' outputs follow
    the batch."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((n, 6)).astype(np.float32) * 3, rng.integers(0, 3, n))
        for n in (5, 5, 3)
    ]


def _inputs(kernel, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = {v: rng.standard_normal((7, 16)).astype(np.float32) * 4 for v in kernel.inputs}
    x = values[kernel.x].reshape(-1)
    x[:9] = [np.nan, np.inf, -np.inf, 3.0, -3.0, 0.0, -0.0, 2.9999998, -3.0000002]
    x[12:20] = [-18.0, -17.5, 18.0, 17.5, -100.0, 100.0, -30.0, 30.0]  # the Sigmoid's ends
    g = values[kernel.g].reshape(-1)
    g[9:12] = [np.nan, np.inf, -np.inf]
    g[16:20] = [np.inf, -np.inf, np.inf, np.inf]  # with the Sigmoid's 0 and 1
    return values


@pytest.mark.parametrize("act", ["hardswish", "silu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_rules_form_is_found_and_computed_exactly(tmp_path, act, threads):
    model = _training_model(tmp_path, act)
    found = SPLIT[act](model)
    assert len(found) == 1
    kernel, nodes = found[0]
    assert isinstance(kernel, KINDS[act])
    assert len(nodes) == 7  # a SiLU's six with its Sigmoid
    session = ort.InferenceSession(
        _replaced(model, nodes, kernel).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for seed in range(3):
        values = _inputs(kernel, seed)
        want = session.run(None, values)[0]
        out: dict[str, np.ndarray] = {}
        kernel.compute(values, out, threads)
        got = out[kernel.out]
        assert np.array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        if act == "hardswish":  # bit for bit, infinities and signed zeros included
            assert np.array_equal(got[finite], want[finite])
            assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
        else:  # the Sigmoid's rounding (onnxruntime's is within about 1e-7 absolute)
            assert np.array_equal(np.isinf(got), np.isinf(want))
            ok = np.isfinite(want)
            np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-5)


def test_kernels_write_in_place_and_reject_mismatched_shapes():
    x = np.linspace(-5, 5, 40, dtype=np.float32).reshape(4, 10)
    g = np.ones_like(x)
    kernel = activation_grads.HardSwishGrad("x", "g", "dx", -3.0, 3.0, 0.0, 1.0, 3.0, 0.5)
    target = np.full_like(x, np.nan)
    out = {"dx": target}
    kernel.compute({"x": x, "g": g}, out, 2)
    assert out["dx"] is target
    at = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    nn.functional.hardswish(at).backward(torch.ones_like(at))
    np.testing.assert_allclose(target, at.grad.numpy(), rtol=1e-6, atol=1e-7)
    silu = activation_grads.SiluGrad("x", "g", "dx")
    with pytest.raises(ValueError, match=r"g \[4, 5\]"):
        silu.compute({"x": x, "g": g[:, :5].copy()}, {}, 1)
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    nn.functional.silu(xt).backward(torch.ones_like(xt))
    silu.compute({"x": x, "g": g}, out, 2)
    np.testing.assert_allclose(out["dx"], xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_intermediate_values_read_elsewhere_stay_in_the_graph(tmp_path):
    model = _training_model(tmp_path, "hardswish")
    _, nodes = activation_grads.split_hardswish_grads(model)[0]
    where = next(model.graph.node[i] for i in nodes if model.graph.node[i].op_type == "Where")
    model.graph.node.append(onnx.helper.make_node("Identity", [where.output[0]], ["copy"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("copy", 1, None))
    assert activation_grads.split_hardswish_grads(model) == []


@pytest.mark.parametrize("act", ["hardswish", "silu"])
def test_module_trains_as_the_graph_does(tmp_path, act):
    directory = adamw_artifacts(tmp_path, export(seeded(Net, act=act), torch.zeros(2, 6)))
    batches = _batches(0)
    name = f"{act}_grad"
    got = artifact_steps(directory, batches, KINDS[act])
    expected = artifact_steps(directory, batches, KINDS[act], without=name)
    assert_same_training(got, expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_hardswish_is_onnxruntimes_bit_for_bit(tmp_path, threads):
    """onnxruntime's CPU provider runs HardSwish as its definition's HardSigmoid and Mul; the
    kernel's one pass gives every bit of theirs: NaN payloads (a signaling one quieted, as
    their product does), infinities, signed zeros and the bends at -3 and 3."""
    model = _training_model(tmp_path, "hardswish")
    (kernel, nodes), = activation_grads.split_hardswishes(model)
    assert isinstance(kernel, activation_grads.HardSwish)
    assert [model.graph.node[i].op_type for i in nodes] == ["HardSwish"]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("HardSwish", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None])],
    )  # fmt: skip
    session = ort.InferenceSession(
        onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        .SerializeToString(), providers=["CPUExecutionProvider"],
    )  # fmt: skip
    rng = np.random.default_rng(threads)
    special = np.array(
        [np.nan, np.inf, -np.inf, 0.0, -0.0, 3.0, -3.0, 2.9999998, -2.9999998, 1e-45, 1e30],
        np.float32,
    )
    payloads = np.array([0x7FC00001, 0xFFC00002, 0x7F800001], np.uint32).view(np.float32)
    x = np.concatenate([rng.standard_normal(70_001).astype(np.float32) * 4, special, payloads])
    (want,) = session.run(None, {"x": x})
    out: dict[str, np.ndarray] = {}
    activation_grads.HardSwish("x", "y").compute({"x": x}, out, threads)
    assert np.array_equal(out["y"].view(np.uint32), want.view(np.uint32))


def test_module_trains_with_the_hardswish_kernel_as_without(tmp_path):
    directory = adamw_artifacts(tmp_path, export(seeded(Net, act="hardswish"), torch.zeros(2, 6)))
    batches = _batches(1)
    got = artifact_steps(directory, batches, activation_grads.HardSwish)
    expected = artifact_steps(directory, batches, activation_grads.HardSwish, without="hardswish")
    assert_same_training(got, expected)


class Residual(nn.Module):
    """Linear layers in a residual block (its output's Relu reads the branch and the skip, so
    its gradient is a Sum of two parts) and a plain Relu between two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.branch, self.mid, self.out = (
            nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.branch(h) + h)  # the residual block's output
        return self.out(torch.relu(self.mid(h)))


def _residual_artifacts(tmp_path):
    return adamw_artifacts(tmp_path, export(seeded(Residual), torch.zeros(2, 6)))


def test_small_relus_keep_their_gradients_in_the_graph(tmp_path):
    # 16 values a sample: the cut around a kernel would cost more than the passes it saves
    model = onnx.load(_residual_artifacts(tmp_path) / "training_model.onnx")
    assert activation_grads.split_relu_grads(model) == []


@pytest.mark.parametrize("threads", [1, 2])
def test_relu_gradients_with_their_sums_are_found_and_computed_exactly(
    tmp_path, threads, monkeypatch
):
    monkeypatch.setattr(activation_grads, "RELU_GRAD_MIN_VALUES", 16)
    model = onnx.load(_residual_artifacts(tmp_path) / "training_model.onnx")
    found = activation_grads.split_relu_grads(model)
    parts = sorted(len(kernel.parts) for kernel, _ in found)
    # the block's output: a Sum of the skip's gradient and the branch's; the others one part
    assert parts == [1, 1, 2], parts
    rng = np.random.default_rng(0)
    for kernel, nodes in found:
        assert len(nodes) == 3 + (len(kernel.parts) > 1)  # Greater, Cast, Mul (and the Sum)
        session = ort.InferenceSession(
            _replaced(model, nodes, kernel).SerializeToString(),
            providers=["CPUExecutionProvider"],
        )
        values = {v: rng.standard_normal((7, 16)).astype(np.float32) for v in kernel.inputs}
        y = values[kernel.y].reshape(-1)
        y[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0]
        first = values[kernel.parts[0]].reshape(-1)
        first[:12] = [np.inf, -np.inf, np.nan, -1.0, 2.0, -3.0] * 2  # with the mask 0 and 1
        want = session.run(None, values)[0]
        out: dict[str, np.ndarray] = {}
        kernel.compute(values, out, threads)
        got = out[kernel.out]
        assert np.array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)  # every other bit: infinities and signed zeros too
        assert np.array_equal(got[finite], want[finite])
        assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


def test_relu_gradient_kernel_rejects_what_it_cannot_take():
    a = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="expected 1 to 8"):
        native.NATIVE.relu_grad([a] * 9, a, np.empty_like(a), 1)
    with pytest.raises(ValueError, match="one size"):
        native.NATIVE.relu_grad([a, a[:2].copy()], a, np.empty_like(a), 1)
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.empty_like(a)
        frozen.flags.writeable = False
        native.NATIVE.relu_grad([a], a, frozen, 1)


def test_module_trains_with_the_relu_gradient_kernel_as_without(tmp_path, monkeypatch):
    monkeypatch.setattr(activation_grads, "RELU_GRAD_MIN_VALUES", 16)
    directory = _residual_artifacts(tmp_path)
    batches = _batches(0)
    got = artifact_steps(directory, batches, activation_grads.ReluGrad)
    expected = artifact_steps(directory, batches, activation_grads.ReluGrad, without="relu_grad")
    assert_same_training(got, expected)
