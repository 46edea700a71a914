"""The Clip input gradient as one native pass: found in the graph the autodiff rule writes and
equal to it element for element, NaN, infinities and the bounds themselves included."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from traingraph.runtime.cpu import native
from traingraph.runtime.cpu.kernels import clip_grad

pytestmark = pytest.mark.skipif(
    native.NATIVE is None or not hasattr(native.NATIVE, "clip_grad"),
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

F = TensorProto.FLOAT


def _model(fill: float = 0.0) -> onnx.ModelProto:
    """``dx = Where(Or(Less(x, lo), Greater(x, hi)), fill, g)`` with lo = 0, hi = 6 as
    CastLike'd constants, as in a dynamo ReLU6's gradient."""
    nodes = [
        helper.make_node("CastLike", ["lo0", "x"], ["lo"]),
        helper.make_node("CastLike", ["hi0", "x"], ["hi"]),
        helper.make_node("Less", ["x", "lo"], ["below"]),
        helper.make_node("Greater", ["x", "hi"], ["above"]),
        helper.make_node("Or", ["below", "above"], ["outside"]),
        helper.make_node("Where", ["outside", "fill", "g"], ["dx"]),
    ]
    graph = helper.make_graph(
        nodes,
        "clip_grad",
        [helper.make_tensor_value_info(n, F, ["n", 3, 5, 7]) for n in ("x", "g")],
        [helper.make_tensor_value_info("dx", F, ["n", 3, 5, 7])],
        initializer=[
            numpy_helper.from_array(np.array(0.0, np.float32), "lo0"),
            numpy_helper.from_array(np.array(6.0, np.float32), "hi0"),
            numpy_helper.from_array(np.array(fill, np.float32), "fill"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 5, 7)) * 5).astype(np.float32)
    g = rng.standard_normal((4, 3, 5, 7)).astype(np.float32)
    x.reshape(-1)[:6] = [np.nan, np.inf, -np.inf, 0.0, 6.0, -0.0]
    g.reshape(-1)[6:9] = [np.nan, np.inf, -np.inf]
    return x, g


@pytest.mark.parametrize("fill", [0.0, 1.5])
def test_the_rules_form_is_found_and_computed_exactly(fill: float) -> None:
    model = _model(fill)
    found = clip_grad.split_clip_grads(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    assert sorted(model.graph.node[i].op_type for i in nodes) == ["Greater", "Less", "Or", "Where"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in range(3):
        x, g = _inputs(seed)
        want = session.run(None, {"x": x, "g": g})[0]
        assert kernel.fill == fill  # a constant, read at load
        values = {"x": x, "g": g, "lo": np.float32(0.0), "hi": np.float32(6.0)}
        out: dict[str, np.ndarray] = {}
        kernel.compute({k: np.asarray(v) for k, v in values.items()}, out, 2)
        got = out["dx"]
        assert np.array_equal(got, want, equal_nan=True)
        assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 where the graph has it


def test_a_negative_zero_fill_stays_in_the_graph() -> None:
    """onnxruntime's Where writes a -0.0 fill as 0.0; the kernel would write -0.0."""
    assert clip_grad.split_clip_grads(_model(-0.0)) == []


def test_masks_read_elsewhere_stay_in_the_graph() -> None:
    model = _model()
    model.graph.node.append(helper.make_node("Not", ["below"], ["inside"]))
    model.graph.output.append(helper.make_tensor_value_info("inside", TensorProto.BOOL, None))
    assert clip_grad.split_clip_grads(model) == []
