"""Lowering of ``ai.onnx.preview.training::Gradient`` nodes to default-domain ONNX ops.

A ``Gradient`` node with attributes ``xs`` (tensors differentiated), ``y`` (the tensor whose
sum is differentiated) and optionally ``zs`` (further inputs held constant) outputs
``d sum(y) / d x`` for each ``x`` in ``xs``. :func:`lower_gradient_ops` replaces each such node
with the gradient nodes that :func:`traingraph.autodiff.differentiate` writes, so the model runs
on any ONNX runtime.

Example:
    >>> lowered = lower_gradient_ops(onnx.load("model_with_gradient.onnx"))
    >>> {n.domain for n in lowered.graph.node}
    {''}
"""

from __future__ import annotations

import os

import onnx
import onnx_ir as ir
from onnx import version_converter

from traingraph.autodiff.engine import differentiate, values_by_name
from traingraph.errors import ModelError
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import MIN_OPSET, ModelLike, default_opset, load_ir, to_proto

GRADIENT_DOMAIN = "ai.onnx.preview.training"


def lower_gradient_ops(model: ModelLike) -> onnx.ModelProto:
    """Replace every ``Gradient`` node of ``model``'s main graph with standard ops.

    Models below opset 13 are first converted to opset 13 with
    ``onnx.version_converter`` (the gradient rules are written for opsets 13 and later).

    Args:
        model: A path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; it is not modified.

    Returns:
        The lowered model, with the ``ai.onnx.preview.training`` import removed.

    Raises:
        ModelError: A ``Gradient`` node names a tensor the graph lacks, is fed with tensors
            other than the ones its ``xs`` and ``zs`` name, or sits inside a subgraph.
        GradientNotImplementedError: A node between ``xs`` and ``y`` has no gradient rule.
    """
    m = load_ir(_at_least_min_opset(model), copy=True)
    graph = m.graph
    opset = default_opset(m)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if _is_gradient(node) and node.graph is not graph:
            raise ModelError(
                f"Gradient node {node.name!r} sits inside a subgraph; only Gradient nodes of the"
                " main graph are lowered. Move it to the main graph."
            )
    for node in [n for n in graph if _is_gradient(n)]:
        _lower_one(graph, opset, node)
    graph.sort()
    m.opset_imports.pop(GRADIENT_DOMAIN, None)
    return to_proto(m)


def _is_gradient(node: ir.Node) -> bool:
    return node.domain == GRADIENT_DOMAIN and node.op_type == "Gradient"


def _at_least_min_opset(model: ModelLike) -> ModelLike:
    """``model``, converted to opset 13 when its default-domain opset is older."""
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            return model
        proto = onnx.load(os.fspath(model))
    elif isinstance(model, ir.Model):
        proto = ir.to_proto(model)
    else:
        proto = model
    opset = next(
        (o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET
    )
    return version_converter.convert_version(proto, MIN_OPSET) if opset < MIN_OPSET else proto


def _lower_one(graph: ir.Graph, opset: int, node: ir.Node) -> None:
    """Replace one ``Gradient`` node with its gradient subgraph."""
    where = f"Gradient node {node.name!r}"
    xs = [str(s) for s in node.attributes.get_strings("xs", [])]
    zs = [str(s) for s in node.attributes.get_strings("zs", [])]
    y_name = node.attributes.get_string("y", "")
    if not xs or not y_name:
        raise ModelError(f"{where} needs the attributes 'xs' and 'y'; got xs={xs}, y={y_name!r}")
    if len(node.inputs) != len(xs) + len(zs) or len(node.outputs) != len(xs):
        raise ModelError(
            f"{where} has {len(node.inputs)} inputs and {len(node.outputs)} outputs; expected"
            f" {len(xs) + len(zs)} inputs (xs then zs) and {len(xs)} outputs (one per x)."
        )
    values = values_by_name(graph)
    for name in [*xs, *zs, y_name]:
        if name not in values:
            raise ModelError(f"{where} names tensor {name!r}, which the graph does not hold")
    for i, (name, fed) in enumerate(zip([*xs, *zs], node.inputs)):
        if fed is not values[name]:
            raise ModelError(
                f"{where} feeds input {i} from {fed.name if fed else None!r}, not from"
                f" {name!r} as its xs/zs name; traingraph lowers Gradient nodes whose inputs"
                " are the tensors that xs and zs name."
            )
    x_values = [values[n] for n in xs]
    result = differentiate(
        graph,
        opset,
        x_values,
        loss=values[y_name],
        stop_gradients=[values[n] for n in zs],
        prefix=node.name or "Gradient",
    )
    b = OpBuilder(graph, opset, prefix=node.name or "Gradient")
    for old, x in zip(node.outputs, x_values):
        g = result.grads[x.name or ""]
        new = b.Identity(g if g is not None else b.zeros_like(x))
        new.shape, new.type = x.shape, x.type
        out_name = old.name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name = None
        new.name = out_name
    graph.remove(node, safe=True)
