"""The ConvTranspose-as-Col2Im rules (traingraph.runtime.rewrites.conv_transpose) on their own:
which ConvTransposes they take, the nodes they write, and their outputs against onnxruntime on
the original model."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from traingraph.runtime import rewrites
from traingraph.runtime.rewrites import conv_transpose


def _model(
    x_shape: list,
    w_shape: list,
    opset: int = 18,
    bias: bool = False,
    dtype: int = TensorProto.FLOAT,
    **attrs: object,
) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("g", dtype, x_shape),
        helper.make_tensor_value_info("w", dtype, w_shape),
    ]
    if bias:
        channels = w_shape[1] * int(attrs.get("group", 1))  # type: ignore[call-overload]
        inputs.append(helper.make_tensor_value_info("b", dtype, [channels]))
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", [i.name for i in inputs], ["y"], **attrs)],
        "conv_transpose",
        inputs,
        [helper.make_tensor_value_info("y", dtype, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _rewritten(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with the rules applied to its inferred shapes, or None where none applied."""
    ir_model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(model))
    if not rewrites.rules_pass(conv_transpose.RULES)(ir_model).modified:
        return None
    return ir.serde.serialize_model(ir_model)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        v.name: rng.standard_normal(
            [d.dim_value or 3 for d in v.type.tensor_type.shape.dim]
        ).astype(helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
        for v in model.graph.input
    }


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        # a stride-2 3x3 Conv's input gradient with pads 1 (ResNet's downsampling)
        (["n", 4, 5, 5], [4, 3, 3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1],
                                        "output_padding": [1, 1]}),
        (["n", 2, 4, 5], [2, 3, 3, 2], {"strides": [3, 2], "pads": [0, 1, 2, 0],
                                        "output_padding": [2, 1], "kernel_shape": [3, 2]}),
        (["n", 2, 6, 5], [2, 2, 3, 3], {"dilations": [2, 1], "pads": [2, 1, 1, 0]}),
        (["n", 3, 7], [3, 2, 4], {"strides": [2], "pads": [1, 2]}),
        (["n", 2, 3, 4, 3], [2, 2, 2, 3, 2], {"strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]}),
    ],
    ids=["resnet-downsampling", "uneven", "dilated", "1d", "3d"],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose_becomes_columns_and_col2im(
    x_shape: list, w_shape: list, attrs: dict, bias: bool
) -> None:
    model = _model(x_shape, w_shape, bias=bias, **attrs)
    rewritten = _rewritten(model)
    assert rewritten is not None
    ops = [n.op_type for n in rewritten.graph.node]
    tail = ["Reshape", "Add"] if bias else []
    assert ops == ["Reshape", "Reshape", "Transpose", "Reshape", "MatMul", "Col2Im", *tail]
    col2im = next(n for n in rewritten.graph.node if n.op_type == "Col2Im")
    spatial = len(x_shape) - 2
    got = {a.name: list(a.ints) for a in col2im.attribute}
    assert got["strides"] == attrs.get("strides", [1] * spatial)
    assert got["dilations"] == attrs.get("dilations", [1] * spatial)
    assert got["pads"] == attrs.get("pads", [0] * 2 * spatial)
    feeds = _feeds(model)
    expected = _run(model, feeds)
    np.testing.assert_allclose(_run(rewritten, feeds), expected, rtol=1e-5, atol=1e-5)
    # and where the input holds a NaN and an infinity
    feeds["g"].reshape(-1)[[3, 17]] = np.nan, np.inf
    expected, got_values = _run(model, feeds), _run(rewritten, feeds)
    np.testing.assert_array_equal(np.isnan(got_values), np.isnan(expected))
    np.testing.assert_allclose(got_values, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "attrs", "opset", "dtype"),
    [
        (["n", 4, 5, 5], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 18, TensorProto.FLOAT),
        (["n", 4, 5, 5], {"output_shape": [10, 10], "strides": [2, 2]}, 18, TensorProto.FLOAT),
        (["n", 4, "h", 5], {"strides": [2, 2]}, 18, TensorProto.FLOAT),
        (["n", 4, 5, 5], {"strides": [2, 2], "output_padding": [2, 0]}, 18, TensorProto.FLOAT),
        (["n", 4, 5, 5], {"strides": [2, 2], "group": 2}, 18, TensorProto.FLOAT),
        (["n", 4, 5, 5], {"strides": [2, 2]}, 18, TensorProto.DOUBLE),
        (["n", 4, 5, 5], {"strides": [2, 2]}, 17, TensorProto.FLOAT),
    ],
    ids=["auto-pad", "output-shape", "dynamic-size", "output-padding", "grouped", "float64",
         "opset-17"],
)  # fmt: skip
def test_conv_transposes_col2im_cannot_take_stay(
    x_shape: list, attrs: dict, opset: int, dtype: int
) -> None:
    weight = [4, 3 // int(attrs.get("group", 1)) or 1, 3, 3]
    assert _rewritten(_model(x_shape, weight, opset, dtype=dtype, **attrs)) is None


def test_geometry_is_the_image_the_kernel_and_the_filters() -> None:
    attributes = {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}
    # (5 - 1) * 2 + 1 + 3 - 2 = 10 positions per side
    assert conv_transpose.geometry(attributes, [None, 4, 5, 5], [4, 3, 3, 3]) == (
        [10, 10], [3, 3], 4,
    )  # fmt: skip
    assert conv_transpose.geometry(attributes, [None, 4, None, 5], [4, 3, 3, 3]) is None
