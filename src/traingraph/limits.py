"""Limits on the sizes that models, checkpoints and data files may declare.

A file states its tensors' shapes before it holds their data, so a corrupt or hostile file can
declare a tensor of 2**40 elements in a few bytes. Every declared size is checked against
:func:`max_tensor_elements` before anything is allocated or inferred from it. A genuinely larger
model raises the limit with the environment variable ``TRAINGRAPH_MAX_TENSOR_ELEMENTS``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import onnx
import onnx_ir as ir

from traingraph.errors import ModelError, SizeLimitError

__all__ = [
    "DEFAULT_MAX_TENSOR_ELEMENTS",
    "MAX_ELEMENTS_VARIABLE",
    "check_elements",
    "check_ir_model",
    "check_model_proto",
    "data_propagation_allowed",
    "max_tensor_elements",
]

MAX_ELEMENTS_VARIABLE = "TRAINGRAPH_MAX_TENSOR_ELEMENTS"
DEFAULT_MAX_TENSOR_ELEMENTS = 2**32  # 16 GiB of float32
# ONNX shape inference's data propagation holds a shape-valued tensor (a Range, a
# ConstantOfShape's shape) as one entry per element: over a dimension of 2**24 it runs for
# minutes and takes gigabytes. Models with a larger static dimension are inferred without it.
DATA_PROPAGATION_MAX_DIMENSION = 2**20


def max_tensor_elements() -> int:
    """The most elements one declared tensor may have (``TRAINGRAPH_MAX_TENSOR_ELEMENTS``).

    Raises:
        ModelError: The environment variable is set but is not a positive integer.
    """
    text = os.environ.get(MAX_ELEMENTS_VARIABLE)
    if text is None:
        return DEFAULT_MAX_TENSOR_ELEMENTS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ModelError(
            f"{MAX_ELEMENTS_VARIABLE}={text!r} is not a positive integer; set it to the most"
            f" elements one tensor may have (default {DEFAULT_MAX_TENSOR_ELEMENTS}) or unset it"
        )
    return value


def check_elements(source: str, what: str, dims: Iterable[object]) -> int:
    """Checks the static dimensions of one declared tensor; symbolic ones count as 1.

    Args:
        source: The file or object that declares the tensor, for the message.
        what: The tensor, for the message (e.g. ``"initializer 'fc.weight'"``).
        dims: The declared dimensions: ints, or anything else for a symbolic dimension.

    Returns:
        The number of elements of the static dimensions.

    Raises:
        ModelError: A dimension is negative.
        SizeLimitError: The element count is over :func:`max_tensor_elements`.
    """
    static = [d for d in dims if isinstance(d, int) and not isinstance(d, bool)]
    negative = [d for d in static if d < 0]
    if negative:
        raise ModelError(
            f"{source}: {what} declares a negative dimension {negative[0]} (shape"
            f" {list(dims)}); expected sizes >= 0. The file is corrupt: export it again"
        )
    count = math.prod(static)
    limit = max_tensor_elements()
    if count > limit:
        raise SizeLimitError(
            f"{source}: {what} declares {count} elements (shape {list(dims)}); the limit is"
            f" {limit}. If the file is corrupt, export it again; for a genuinely larger tensor"
            f" raise the limit with the environment variable {MAX_ELEMENTS_VARIABLE}"
        )
    return count


def _proto_dims(value: onnx.ValueInfoProto) -> list[object]:
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return []
    return [
        d.dim_value if d.HasField("dim_value") else d.dim_param
        for d in value.type.tensor_type.shape.dim
    ]


def _check_tensor_proto(source: str, what: str, tensor: onnx.TensorProto) -> None:
    count = check_elements(source, what, list(tensor.dims))
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
        return
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize \
        if tensor.data_type in onnx.helper.get_all_tensor_dtypes() else 0  # fmt: skip
    if tensor.data_type == onnx.TensorProto.STRING or itemsize == 0:
        return
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return
    if len(tensor.raw_data) != count * itemsize:
        raise ModelError(
            f"{source}: {what} declares shape {list(tensor.dims)} ({count * itemsize} bytes)"
            f" but holds {len(tensor.raw_data)} bytes of data. The file is corrupt: export it"
            " again"
        )


def _check_graph_proto(source: str, graph: onnx.GraphProto) -> None:
    for kind, values in (
        ("input", graph.input),
        ("output", graph.output),
        ("value", graph.value_info),
    ):
        for value in values:
            check_elements(source, f"{kind} {value.name!r}", _proto_dims(value))
    for tensor in graph.initializer:
        _check_tensor_proto(source, f"initializer {tensor.name!r}", tensor)
    for node in graph.node:
        for attr in node.attribute:
            where = f"attribute {attr.name!r} of node {node.name!r}"
            if attr.HasField("t"):
                _check_tensor_proto(source, where, attr.t)
            if attr.HasField("g"):
                _check_graph_proto(source, attr.g)
            for sub in attr.graphs:
                _check_graph_proto(source, sub)


def check_model_proto(model: onnx.ModelProto, source: str) -> None:
    """Checks every size ``model`` declares (values, initializers, constants, subgraphs).

    Raises:
        ModelError: A tensor's data does not fit its declared shape, or a dimension is negative.
        SizeLimitError: A declared tensor is over :func:`max_tensor_elements`.
    """
    _check_graph_proto(source, model.graph)


def _ir_dims(shape: ir.ShapeProtocol | None) -> list[object]:
    return [] if shape is None else [d if isinstance(d, int) else str(d) for d in shape.dims]


def _check_ir_tensor(source: str, what: str, tensor: object) -> None:
    if isinstance(tensor, ir.TensorProtoTensor):
        _check_tensor_proto(source, what, tensor.raw)
    elif isinstance(tensor, ir.TensorProtocol):
        check_elements(source, what, _ir_dims(tensor.shape))


def _check_ir_graph(source: str, graph: ir.Graph) -> None:
    for value in (*graph.inputs, *graph.outputs):
        check_elements(source, f"value {value.name!r}", _ir_dims(value.shape))
    for name, value in graph.initializers.items():
        _check_ir_tensor(source, f"initializer {name!r}", value.const_value)
    for node in graph:
        for output in node.outputs:
            check_elements(source, f"value {output.name!r}", _ir_dims(output.shape))
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.TENSOR:
                where = f"attribute {attr.name!r} of node {node.name!r}"
                _check_ir_tensor(source, where, attr.value)
            elif attr.type == ir.AttributeType.GRAPH:
                _check_ir_graph(source, attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    _check_ir_graph(source, sub)


def check_ir_model(model: ir.Model, source: str = "the model") -> None:
    """Checks every size an ``onnx_ir`` model declares, as :func:`check_model_proto` does."""
    _check_ir_graph(source, model.graph)


def data_propagation_allowed(model: ir.Model | onnx.ModelProto) -> bool:
    """Whether ONNX shape inference may propagate values through ``model``'s shape
    computations: no static dimension of its values is over ``DATA_PROPAGATION_MAX_DIMENSION``."""
    if isinstance(model, onnx.ModelProto):
        g = model.graph
        return all(
            d.dim_value <= DATA_PROPAGATION_MAX_DIMENSION
            for v in (*g.input, *g.output, *g.value_info)
            for d in v.type.tensor_type.shape.dim
        )
    graph = model.graph
    values = [*graph.inputs, *graph.outputs, *(o for node in graph for o in node.outputs)]
    for value in values:
        for d in _ir_dims(value.shape):
            if isinstance(d, int) and d > DATA_PROPAGATION_MAX_DIMENSION:
                return False
    return True
