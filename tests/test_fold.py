"""Constant values derived from static shapes (traingraph.ir.fold)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from traingraph.ir.fold import constant_value


def _graph(shape):
    """``x[shape]`` -> Shape -> Gather(-1) -> Div(3) -> Mul(2), as torch's ``chunk`` exports."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "last"], ["d"], axis=0),
        helper.make_node("Div", ["d", "three"], ["q"]),
        helper.make_node("Mul", ["q", "two"], ["m"]),
        helper.make_node("Unsqueeze", ["m", "zero"], ["u"]),
        helper.make_node("Concat", ["u", "u"], ["c"], axis=0),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Shape", ["x"], ["tail"], start=-2),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("last", -1), ("three", 3), ("two", 2), ("zero", [0]))
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in "mcn"]
    outputs.append(helper.make_tensor_value_info("tail", TensorProto.INT64, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs, inits
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return {v.name: v for v in model.graph.outputs}


def test_shape_arithmetic_on_static_dims_folds():
    values = _graph([4, 6, 9])
    assert constant_value(values["m"]).tolist() == 6
    assert constant_value(values["c"]).tolist() == [6, 6]
    assert constant_value(values["n"]).tolist() == 216
    assert constant_value(values["tail"]).tolist() == [6, 9]


def test_dynamic_dims_stay_unknown_unless_not_used():
    values = _graph(["batch", 6, 9])
    assert constant_value(values["m"]).tolist() == 6  # only the static last dim is read
    assert constant_value(values["n"]) is None
    assert constant_value(values["tail"]).tolist() == [6, 9]
    values = _graph([4, 6, "features"])
    assert constant_value(values["m"]) is None
    assert constant_value(values["c"]) is None
