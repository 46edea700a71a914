"""Slices moved above the products and elementwise ops that commute with them."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from traingraph.ir.model import load_ir
from traingraph.ir.slices import hoist_slices

BIG = np.iinfo(np.int64).max


def _model(bias_shape, axis, keep_product=False):
    """``Slice(Add(MatMul(h, W), b), 0:-1 along axis)``; with ``keep_product`` the product is
    also a graph output."""
    nodes = [
        helper.make_node("MatMul", ["h", "w"], ["p"], name="project"),
        helper.make_node("Add", ["p", "b"], ["logits"], name="bias"),
        helper.make_node("Slice", ["logits", "s", "e", "a"], ["kept"], name="cut"),
        helper.make_node("Relu", ["kept"], ["y"], name="after"),
    ]
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([0], np.int64), "s"),
        numpy_helper.from_array(np.array([-1], np.int64), "e"),
        numpy_helper.from_array(np.array([axis], np.int64), "a"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if keep_product:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 5, 4])],
        outputs, inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, h):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"h": h})


def test_rows_are_taken_before_the_product_and_the_bias():
    proto = _model((6,), axis=1)
    m = load_ir(proto)
    assert hoist_slices(m.graph) == 2
    order = [n.op_type for n in m.graph if n.op_type in ("Slice", "MatMul", "Add", "Relu")]
    assert order == ["Slice", "MatMul", "Add", "Relu"]
    (cut,) = [n for n in m.graph if n.op_type == "Slice"]
    assert cut.inputs[0].name == "h"
    relu = next(n for n in m.graph if n.op_type == "Relu")
    assert relu.inputs[0].name == "kept"  # the value after the cut keeps its name
    h = np.random.default_rng(1).standard_normal((3, 5, 4)).astype(np.float32)
    h[0, 0, 0] = np.nan
    (expected,), (got,) = _run(proto, h), _run(ir.to_proto(m), h)
    np.testing.assert_array_equal(got, expected)


def test_slices_that_do_not_commute_stay():
    # the last axis comes from W; a bias varying along the sliced axis; a product read by name
    for proto, keep in (
        (_model((6,), axis=2), ()),
        (_model((5, 6), axis=1), ()),
        (_model((6,), axis=1, keep_product=True), ()),
        (_model((6,), axis=1), ("logits",)),
    ):
        m = load_ir(proto)
        moved = hoist_slices(m.graph, keep=keep)
        producer = next(n for n in m.graph if n.op_type == "Slice").inputs[0].producer()
        assert producer is not None and producer.op_type in ("Add", "MatMul"), moved
