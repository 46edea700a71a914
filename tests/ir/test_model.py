"""Loading models for differentiation (traingraph.ir.model)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from traingraph.ir.model import load_ir


def _constant(name: str, value: object, dtype: type) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype))
    )


def _alibi_slopes_model() -> onnx.ModelProto:
    """BLOOM's ALiBi bias as the dynamo exporter writes it: slopes ``0.25 ** [1..4]`` as
    ``[4, 1, 1]`` times the positions ``[0..7]`` as floats, then added to ``x [4, 1, 8]``.
    onnx's data propagation takes the ``Mul`` for a shape computation of mismatched lengths
    and fails the strict inference of the whole model."""
    nodes = [
        _constant("quarter", 0.25, np.float32),
        _constant("scalar_shape", [], np.int64),
        helper.make_node("Expand", ["quarter", "scalar_shape"], ["full"]),
        _constant("one", 1, np.int32),
        _constant("five", 5, np.int32),
        helper.make_node("Range", ["one", "five", "one"], ["powers"]),
        helper.make_node("Cast", ["powers"], ["powers_f"], to=TensorProto.FLOAT),
        helper.make_node("Pow", ["full", "powers_f"], ["slopes"]),
        _constant("axes_12", [1, 2], np.int64),
        helper.make_node("Unsqueeze", ["slopes", "axes_12"], ["slopes_3d"]),
        _constant("zero_i", 0, np.int64),
        _constant("eight", 8, np.int64),
        _constant("one_i", 1, np.int64),
        helper.make_node("Range", ["zero_i", "eight", "one_i"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["slopes_3d", "positions_f"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "alibi",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_shapes_are_inferred_where_data_propagation_rejects_the_model():
    proto = _alibi_slopes_model()
    try:  # the premise: onnx's strict inference with data propagation fails on it
        onnx.shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
        rejected = False
    except onnx.shape_inference.InferenceError:
        rejected = True
    m = load_ir(proto)
    values = {v.name: v for node in m.graph for v in node.outputs}
    assert values["bias"].shape is not None and list(values["bias"].shape) == [4, 1, 8]
    assert list(m.graph.outputs[0].shape) == [4, 1, 8]
    if not rejected:  # a newer onnx that accepts it: the fallback is not exercised
        assert values["slopes_3d"].shape is not None
