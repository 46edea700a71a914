"""Helpers over the ``onnx.ModelProto`` that onnxblock blocks edit by tensor name.

Blocks refer to tensors by name, as onnxruntime's onnxblock does. Blocks whose arithmetic
lives in traingraph (the losses, the optimizers, gradient clipping) build it with
:class:`~traingraph.ir.builder.OpBuilder` on a small ``onnx_ir`` graph whose inputs stand for
the named tensors (:func:`splice`); its nodes are then appended to the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import MIN_OPSET, max_supported_opset


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor and node name used in ``model``'s main graph."""
    graph = model.graph
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names.update(t.name for t in graph.initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    names.discard("")
    return names


def fresh_name(model: onnx.ModelProto, hint: str) -> str:
    """A name that nothing in ``model`` uses yet, ``hint`` itself when it is free."""
    taken = all_names(model)
    name, i = hint, 0
    while name in taken:
        i += 1
        name = f"{hint}_{i}"
    return name


def node_arg_exists(model: onnx.ModelProto, name: str) -> bool:
    """Whether ``name`` is a graph input, output, initializer or node output of ``model``."""
    graph = model.graph
    if any(v.name == name for v in (*graph.input, *graph.output)):
        return True
    if any(t.name == name for t in graph.initializer):
        return True
    return any(name in node.output for node in graph.node)


def find_value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    """The typed description of tensor ``name``: from the graph's inputs, outputs, value
    infos or initializers; None where the model does not record it."""
    graph = model.graph
    for info in (*graph.output, *graph.input, *graph.value_info):
        if info.name == name and info.type.WhichOneof("value") is not None:
            return info
    for tensor in graph.initializer:
        if tensor.name == name:
            return onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims))
    return None


def typed_value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    """:func:`find_value_info`, running onnx shape inference when the model lacks it."""
    info = find_value_info(model, name)
    if info is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # an incomplete graph: the value stays untyped
            return None
        info = find_value_info(inferred, name)
    return info


def default_opset(model: onnx.ModelProto) -> int:
    """The default-domain opset of ``model``; one is added where the model has none."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return int(opset.version)
    version = newest_opset()
    model.opset_import.append(onnx.helper.make_opsetid("", version))
    return version


def newest_opset() -> int:
    """The newest default-domain opset that both onnx and the installed onnxruntime know."""
    return max(MIN_OPSET, min(onnx.defs.onnx_opset_version(), max_supported_opset()))


def register_graph_outputs(model: onnx.ModelProto, names: str | Iterable[str]) -> None:
    """Make ``names`` the graph's outputs, typed from what the model records of them."""
    wanted = [names] if isinstance(names, str) else list(names)
    infos = []
    for name in wanted:
        info = find_value_info(model, name)
        if info is None and not node_arg_exists(model, name):
            raise LookupError(
                f"{name!r} is not a tensor of the model, so it cannot be a graph output; a"
                " block's build() must return names of tensors it created or received"
            )
        copy = onnx.ValueInfoProto()
        if info is not None:
            copy.CopyFrom(info)
        copy.name = name
        infos.append(copy)
    del model.graph.output[:]
    model.graph.output.extend(infos)


def _ir_type(info: onnx.ValueInfoProto | None) -> tuple[ir.TypeProtocol | None, ir.Shape | None]:
    if info is None:
        return None, None
    kind = info.type.WhichOneof("value")
    if kind == "tensor_type":
        tensor = info.type.tensor_type
        shape = None
        if tensor.HasField("shape"):
            dims: list[int | str | None] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tensor.shape.dim
            ]
            shape = ir.Shape(dims)
        return ir.TensorType(ir.DataType(tensor.elem_type)), shape
    if kind == "sequence_type":
        element = info.type.sequence_type.elem_type.tensor_type.elem_type
        return ir.SequenceType(ir.TensorType(ir.DataType(element or onnx.TensorProto.FLOAT))), None
    return None, None


def splice(
    model: onnx.ModelProto,
    input_names: Sequence[str],
    build: Callable[[OpBuilder, list[ir.Value]], Any],
    prefix: str,
) -> Any:
    """Append to ``model`` the nodes that ``build(b, inputs)`` makes with the builder ``b``.

    ``inputs`` are values standing for the model's tensors ``input_names`` (typed as the model
    records them). Returns what ``build`` returns, its values now naming tensors of ``model``.
    """
    values = []
    for name in input_names:
        type_, shape = _ir_type(typed_value_info(model, name))
        values.append(ir.Value(name=name, type=type_, shape=shape))
    opset = default_opset(model)
    graph = ir.Graph(values, [], nodes=[], opset_imports={"": opset})
    b = OpBuilder(graph, opset, prefix=prefix, names=all_names(model))
    result = build(b, values)
    model.graph.node.extend(ir.serde.serialize_node(node) for node in graph)
    return result
