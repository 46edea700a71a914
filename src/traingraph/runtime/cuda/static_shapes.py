"""Shape computations folded into constants, for graphs whose input shapes are fixed.

A training graph with a dynamic batch computes shapes at run time: ``Shape`` and ``Size`` of
activations and parameters feed ``Reshape``, ``Expand`` and the element counts of the
normalizations' gradients (``Cast(Size(x))`` divides a sum). onnxruntime's CUDA provider
returns ``Shape`` and ``Size`` in host memory and runs what follows them on the CPU, so a count
that meets a float tensor on the GPU needs a host-to-device copy, and a graph with such a copy
cannot be captured into a CUDA graph. Once the inputs' shapes are fixed
(:func:`traingraph.runtime.cuda.with_static_inputs`), every such shape is known before the
first run: :func:`fold_static_shapes` replaces each ``Shape`` and ``Size`` whose input shape is
static by a ``Constant`` and evaluates what is computed from constants alone into constants too
(``Gather``, ``Concat``, ``Cast``, ``Range``, ...; small outputs only, with onnx's reference
evaluator), in rounds, as each round fixes more shapes.

onnxruntime's CUDA ``Concat`` also takes at most 32 inputs inside a capture:
:func:`split_wide_concats` concatenates more in groups first (the same result), and
:func:`for_capture` does both.

Example:
    >>> static = for_capture(with_static_inputs(model, {"x": (64, 3, 224, 224)}))
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

_ROUNDS = 8
_FOLD_ELEMENTS = 4096
"""The largest output a folded node may have: shapes and counts, never activations."""
_NONDETERMINISTIC = frozenset(
    {"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip


def _static_shape(value: onnx.ValueInfoProto | None) -> list[int] | None:
    if value is None or not value.type.HasField("tensor_type"):
        return None
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    if not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    return [int(d.dim_value) for d in tensor.shape.dim]


def _shape_slice(node: onnx.NodeProto, shape: list[int]) -> list[int]:
    """The dimensions a ``Shape`` node returns (its ``start`` and ``end``, opset 15)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    rank = len(shape)
    start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
    start, end = (s + rank if s < 0 else s for s in (start, end))
    return shape[max(0, min(start, rank)) : max(0, min(end, rank))]


def _fold_once(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    graph = inferred.graph
    infos = {v.name: v for v in (*graph.value_info, *graph.input, *graph.output)}
    for init in graph.initializer:
        infos[init.name] = helper.make_tensor_value_info(init.name, init.data_type, init.dims)
    folded = 0
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Shape", "Size"):
            continue
        shape = _static_shape(infos.get(node.input[0]))
        if shape is None:
            continue
        if node.op_type == "Shape":
            array = np.array(_shape_slice(node, shape), np.int64)
        else:
            array = np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
        constant = helper.make_node(
            "Constant", [], [node.output[0]], name=node.name or f"folded_{node.output[0]}",
            value=numpy_helper.from_array(array),
        )  # fmt: skip
        graph.node[index].CopyFrom(constant)
        folded += 1
    return inferred, folded


def _constant_value(attribute: onnx.AttributeProto) -> np.ndarray | None:
    """The value of a ``Constant`` node's attribute (None for sparse and string values)."""
    if attribute.name == "value":
        return numpy_helper.to_array(attribute.t)
    kinds = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
             "value_floats": np.float32}  # fmt: skip
    if attribute.name not in kinds:
        return None
    return np.array(helper.get_attribute_value(attribute), kinds[attribute.name])


def _evaluate(
    node: onnx.NodeProto, feeds: dict[str, np.ndarray], opsets: dict[str, int]
) -> list[np.ndarray] | None:
    """``node``'s outputs on ``feeds`` by onnx's reference evaluator; None where it fails (the
    node then stays in the graph, for onnxruntime to run)."""
    from onnx.reference import ReferenceEvaluator

    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in feeds.items()
    ]
    outputs = [helper.make_tensor_value_info(o, 0, None) for o in node.output if o]
    model = helper.make_model(
        helper.make_graph([node], "fold", inputs, outputs),
        opset_imports=[helper.make_opsetid("", opsets.get("", opsets.get("ai.onnx", 13)))],
    )
    try:
        return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, feeds)]
    except Exception:  # an op the reference evaluator gets wrong or lacks
        return None


def _fold_small_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Evaluate each deterministic node whose inputs are all constants and whose outputs are
    static and small (at most :data:`_FOLD_ELEMENTS` elements each), as ``Constant`` nodes."""
    inferred = shape_inference.infer_shapes(model, data_prop=True)
    graph = inferred.graph
    infos = {v.name: v for v in (*graph.value_info, *graph.output)}
    overridable = {i.name for i in graph.input}
    constants = {
        i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name not in overridable
    }
    opsets = {o.domain: o.version for o in inferred.opset_import}
    nodes: list[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            value = _constant_value(node.attribute[0])
            if value is not None:
                constants[node.output[0]] = value
            nodes.append(node)
            continue
        shapes = [_static_shape(infos.get(o)) for o in node.output]
        foldable = (
            node.domain in ("", "ai.onnx")
            and node.op_type not in _NONDETERMINISTIC
            and any(node.input)
            and all(not i or i in constants for i in node.input)
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                        for a in node.attribute)
            and all(s is not None and int(np.prod(s)) <= _FOLD_ELEMENTS for s in shapes)
        )  # fmt: skip
        if not foldable:
            nodes.append(node)
            continue

        values = _evaluate(node, {i: constants[i] for i in node.input if i}, opsets)
        if values is None:
            nodes.append(node)
            continue
        for name, value in zip([o for o in node.output if o], values):
            array = np.asarray(value)
            constants[name] = array
            nodes.append(
                helper.make_node(
                    "Constant", [], [name], name=f"folded_{name}",
                    value=numpy_helper.from_array(array),
                )  # fmt: skip
            )
        folded += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return inferred, folded


def fold_static_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose ``Shape`` and ``Size`` nodes with static inputs are constants.

    The graph's recorded intermediate shapes (``value_info``) and the dimensions of its outputs
    are dropped first and inferred again from the inputs (with data propagation, so that a
    ``Reshape`` to a computed shape gets static dimensions once that shape is a constant);
    shapes recorded by an exporter with a symbolic batch would otherwise hide the fixed one.
    Each round folds the ``Shape`` and ``Size`` nodes with static inputs, then the
    deterministic nodes whose inputs are all constants and whose outputs are small (shape
    arithmetic); rounds repeat while they find more.

    Args:
        model: A model whose inputs have fixed shapes.

    Returns:
        The folded model; ``model`` is left as it is.
    """
    folded_model = onnx.ModelProto()
    folded_model.CopyFrom(model)
    graph = folded_model.graph
    del graph.value_info[:]
    for output in graph.output:
        if output.type.HasField("tensor_type"):
            output.type.tensor_type.ClearField("shape")
    for _ in range(_ROUNDS):
        folded_model, shapes = _fold_once(folded_model)
        folded_model, others = _fold_small_constants(folded_model)
        if shapes + others == 0:
            break
    return folded_model



CAPTURE_CONCAT_INPUTS = 32
"""The most inputs onnxruntime's CUDA ``Concat`` takes while a CUDA graph is captured."""


def split_wide_concats(
    model: onnx.ModelProto, most: int = CAPTURE_CONCAT_INPUTS
) -> onnx.ModelProto:
    """``model`` with each ``Concat`` of more than ``most`` inputs made of ``Concat`` s of at
    most ``most`` inputs each (groups of consecutive inputs, then the groups' results, along
    the same axis: the same tensor). ``model`` is changed in place and returned."""
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        wide = node.op_type == "Concat" and len(node.input) > most
        if not wide or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        axis = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "axis")
        pieces = list(node.input)
        level = 0
        while len(pieces) > most:
            grouped = []
            for start in range(0, len(pieces), most):
                group = pieces[start : start + most]
                if len(group) == 1:
                    grouped.append(group[0])
                    continue
                name = f"{node.output[0]}_part{level}_{start // most}"
                nodes.append(helper.make_node("Concat", group, [name], name=name, axis=axis))
                grouped.append(name)
            pieces = grouped
            level += 1
        nodes.append(
            helper.make_node("Concat", pieces, list(node.output), name=node.name, axis=axis)
        )
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def for_capture(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the static ``model`` that onnxruntime can capture into a CUDA graph:
    :func:`fold_static_shapes`, then :func:`split_wide_concats`."""
    return split_wide_concats(fold_static_shapes(model))
