"""Reverse-mode autodiff over an ONNX graph, emitting default-domain ONNX ops.

The engine walks the nodes between the parameters and the loss in reverse, asks each node's
rule (see :mod:`traingraph.autodiff.registry`) for its input gradients, accumulates fan-out with
``Sum`` and leaves integer, bool and shape paths alone. Where the contributions are the zero-padded
gradients of slices that tile one axis (the pieces of a ``chunk`` or ``split`` written as
Slices), they are joined with one ``Concat`` instead of padded and summed.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from traingraph.autodiff import grid_sample
from traingraph.autodiff.context import GradContext
from traingraph.autodiff.lowering import replace_value, split_sequences
from traingraph.autodiff.registry import get_rule, supported_ops
from traingraph.errors import GradientNotImplementedError, ModelError
from traingraph.ir.builder import OpBuilder, is_float
from traingraph.ir.fold import constant_value
from traingraph.ir.model import (
    ModelLike,
    default_opset,
    infer_shapes_in_place,
    load_ir,
    max_ir_version,
    to_proto,
)

# Ops whose outputs never carry a gradient, whatever their dtype.
NON_DIFFERENTIABLE = frozenset(
    {
        "Shape", "Size", "Constant", "ConstantOfShape", "Range", "EyeLike", "RandomNormal",
        "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
        "ArgMax", "ArgMin", "NonZero", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf",
        "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Not",
        "BitShift", "OneHot",
    }
)  # fmt: skip


@dataclass
class GradientResult:
    """What :func:`differentiate` added to a graph.

    Attributes:
        grads: The gradient of each requested tensor (None where no gradient reaches it).
        user_grad_inputs: The graph inputs added for user-supplied gradients, by tensor name.
        seed: The value that seeds the loss gradient (None without a loss).
    """

    grads: dict[str, ir.Value | None]
    user_grad_inputs: dict[str, ir.Value] = field(default_factory=dict)
    seed: ir.Value | None = None


def differentiate(
    graph: ir.Graph,
    opset: int,
    wrt: Sequence[ir.Value],
    *,
    loss: ir.Value | None,
    stop_gradients: Iterable[ir.Value] = (),
    user_gradients: Iterable[ir.Value] = (),
    loss_seed: ir.Value | None = None,
    prefix: str = "grad",
) -> GradientResult:
    """Append the gradient of ``loss`` with respect to ``wrt`` to ``graph``.

    ``SplitToSequence`` nodes read only by ``SequenceAt`` become ``Split`` first
    (:func:`~traingraph.autodiff.lowering.split_sequences`).

    Args:
        graph: The forward graph; gradient nodes are appended to it.
        opset: The default-domain opset of the graph.
        wrt: The tensors whose gradients are wanted.
        loss: The tensor differentiated (its gradient is seeded with ones), or None when only
            user gradients drive the backward pass.
        stop_gradients: Tensors treated as constants.
        user_gradients: Tensors that receive a gradient from outside code, as a new graph input
            ``<name>_user_grad`` of the same type.
        loss_seed: A value to use as the loss's gradient instead of ones.
        prefix: Prefix of generated names.

    Returns:
        The gradients, keyed by the names of ``wrt``.
    """
    split_sequences(graph, opset)
    b = OpBuilder(graph, opset, prefix=prefix)
    stop = set(stop_gradients)
    user_targets = list(user_gradients)
    nodes = list(graph)

    reads = {node: _reads(node) for node in nodes}
    live = _live(nodes, reads, wrt, stop)
    samplers = [n for n in nodes if grid_sample.lowerable(n) and any(v in live for v in n.inputs)]
    if samplers:
        for node in samplers:
            b.scope = f"{node.name or node.op_type}/"
            replace_value(node.outputs[0], grid_sample.lower_grid_sample(b, node))
            graph.remove(node, safe=True)
        b.scope = ""
        graph.sort()
        # the gradient rules read the shapes of the new values (static ones give them static
        # reductions, which a CUDA graph can capture)
        infer_shapes_in_place(ir.Model(graph, ir_version=max_ir_version()))
        nodes = list(graph)
        reads = {node: _reads(node) for node in nodes}
        live = _live(nodes, reads, wrt, stop)

    # Backward: which values the loss or a user-gradient target depends on.
    sinks = ([loss] if loss is not None else []) + user_targets
    relevant: set[ir.Value] = set(sinks)
    for node in reversed(nodes):
        if any(o in relevant for o in node.outputs):
            relevant.update(reads[node])

    contributions: dict[ir.Value, list[ir.Value]] = {}
    result = GradientResult(grads={})
    if loss is not None and loss in live:
        seed = loss_seed if loss_seed is not None else _ones_seed(b, loss)
        contributions[loss] = [seed]
        result.seed = seed
    for target in user_targets:
        if target.type is None:
            raise ModelError(
                f"user_gradients tensor {target.name!r} has no known type, so its gradient input"
                f" {target.name}_user_grad cannot be declared; give the model value_info for it"
                " (onnx.shape_inference.infer_shapes) or pick a tensor of known type"
            )
        grad_input = ir.Value(
            name=f"{target.name}_user_grad", shape=target.shape, type=target.type
        )
        graph.inputs.append(grad_input)
        result.user_grad_inputs[target.name or ""] = grad_input
        if target in live:
            contributions.setdefault(target, []).append(grad_input)

    totals: dict[ir.Value, ir.Value | None] = {}

    def total(value: ir.Value) -> ir.Value | None:
        if value not in totals:
            parts = contributions.get(value, [])
            if not parts:
                totals[value] = None
            else:
                g = parts[0] if len(parts) == 1 else _accumulate(b, parts, value)
                if g.shape is None and value.shape is not None:
                    g.shape = value.shape
                if g.type is None and value.type is not None:
                    g.type = value.type
                totals[value] = g
        return totals[value]

    for node in reversed(nodes):
        if not any(o in live and o in relevant for o in node.outputs):
            continue
        needs = tuple(v is not None and v in live for v in node.inputs)
        if not any(v in live for v in reads[node]):
            continue
        out_grads = [total(o) if o in live else None for o in node.outputs]
        if all(g is None for g in out_grads):
            continue
        rule = get_rule(node.domain, node.op_type, opset)
        if rule is None:
            raise _no_rule(node, opset)
        b.scope = f"{node.name or node.op_type}/"
        inputs = tuple(node.inputs)  # a rule may replace its node (recurrent.py's LSTM)
        try:
            in_grads = rule(GradContext(b, node, needs), out_grads)
        except (GradientNotImplementedError, ModelError) as exc:
            blocker = _unsupported_before(nodes, node, reads, live, relevant, opset)
            if blocker is None:
                raise
            raise _no_rule(blocker, opset) from exc
        b.scope = ""
        if len(in_grads) > len(inputs):
            raise AssertionError(
                f"gradient rule of {node.op_type} returned {len(in_grads)} gradients for"
                f" {len(inputs)} inputs"
            )
        for value, g in zip(inputs, in_grads):
            if g is None or value is None or value not in live:
                continue
            contributions.setdefault(value, []).append(g)

    for v in wrt:
        result.grads[v.name or ""] = total(v)
    return result


def _live(
    nodes: Sequence[ir.Node],
    reads: dict[ir.Node, list[ir.Value]],
    wrt: Iterable[ir.Value],
    stop: set[ir.Value],
) -> set[ir.Value]:
    """The values that depend on a ``wrt`` tensor through float edges (or edges of unknown
    dtype, which may be float: a missing rule then raises instead of dropping a gradient)."""
    live: set[ir.Value] = {v for v in wrt if v not in stop}
    for node in nodes:
        if node.op_type in NON_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        if any(v in live for v in _value_reads(node, reads[node])):
            live.update(
                o for o in node.outputs if (o.dtype is None or is_float(o)) and o not in stop
            )
    return live


def _no_rule(node: ir.Node, opset: int) -> GradientNotImplementedError:
    """The error for ``node``, whose op has no gradient rule."""
    return GradientNotImplementedError(
        node.op_type, node.name or "<unnamed>", opset, domain=node.domain,
        supported=supported_ops(),
    )  # fmt: skip


def _unsupported_before(
    nodes: Sequence[ir.Node],
    failed: ir.Node,
    reads: dict[ir.Node, list[ir.Value]],
    live: set[ir.Value],
    relevant: set[ir.Value],
    opset: int,
) -> ir.Node | None:
    """The first node on the gradient path upstream of ``failed`` that has no gradient rule.

    A rule that fails for want of a shape or type (``failed``) often fails because such a node
    upstream (a ``Loop`` or a sequence op) left its output's shape unknown: that node is the
    blocker to name, as the backward pass would have reached it next."""
    ancestors: set[ir.Value] = set(reads[failed])
    upstream: list[ir.Node] = []
    for node in reversed(nodes[: nodes.index(failed)]):
        if any(o in ancestors for o in node.outputs):
            ancestors.update(reads[node])
            upstream.append(node)
    for node in reversed(upstream):
        if node.op_type in NON_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        on_path = any(o in live and o in relevant for o in node.outputs)
        unsupported = get_rule(node.domain, node.op_type, opset) is None
        if on_path and unsupported and any(v in live for v in reads[node]):
            return node
    return None


def _accumulate(b: OpBuilder, parts: Sequence[ir.Value], value: ir.Value) -> ir.Value:
    """The sum of the gradient ``parts`` of ``value``: one ``Concat`` where they are padded
    pieces that tile an axis (see :func:`_tiling_pads`), else ``Sum``."""
    pieces = _tiling_pads(parts, value)
    if pieces is None:
        return b.Sum(*_unexpanded(b, parts))
    axis, ordered = pieces
    joined = b.Concat(*(pad.inputs[0] for pad in ordered), axis=axis)
    for pad in ordered:
        pads = pad.inputs[1]
        b.graph.remove(pad, safe=True)
        source = pads.producer() if pads is not None and not pads.uses() else None
        if source is not None and source.op_type == "Constant":
            b.graph.remove(source, safe=True)
    return joined


def _unexpanded(b: OpBuilder, parts: Sequence[ir.Value]) -> list[ir.Value]:
    """``parts`` with each part that an ``Expand`` writes for this sum alone replaced by the
    Expand's input, as long as one part keeps the value's shape.

    Every part is a gradient of one value, so each has its shape; ``Sum`` broadcasts its
    inputs, so an expanded part adds the same numbers to each element unexpanded (a
    ReduceMean's or a global pool's gradient beside the other uses of its input, as in a
    squeeze-and-excitation block), and no full-size copy of it is written and read again."""
    expands = [_expand_for_sum(part, parts) for part in parts]
    if None not in expands:
        expands[0] = None  # the first keeps the shape
    kept = []
    for part, node in zip(parts, expands):
        if node is None:
            kept.append(part)
            continue
        source, shape = node.inputs[0], node.inputs[1]
        assert source is not None
        kept.append(source)
        b.graph.remove(node, safe=True)
        shape_node = shape.producer() if shape is not None and not shape.uses() else None
        if shape_node is not None and shape_node.op_type in ("Shape", "Constant"):
            b.graph.remove(shape_node, safe=True)
    return kept


def _expand_for_sum(part: ir.Value, parts: Sequence[ir.Value]) -> ir.Node | None:
    """The default-domain ``Expand`` that writes ``part``, where nothing else reads it."""
    node = part.producer()
    if (
        node is None
        or node.op_type != "Expand"
        or node.domain not in ("", "ai.onnx")
        or part.uses()
        or part.is_graph_output()
        or parts.count(part) != 1
    ):
        return None
    return node


def _tiling_pads(parts: Sequence[ir.Value], value: ir.Value) -> tuple[int, list[ir.Node]] | None:
    """``(axis, Pad nodes in order)`` when each part is a constant-mode, zero-valued Pad along
    the same single axis, with constant pads, and the pieces fill that (static) axis of
    ``value`` end to end without overlap; None otherwise.

    Such parts are the Slice gradients of a tensor cut into consecutive pieces; their sum is
    the pieces concatenated, written once instead of padded to full size and summed.
    """
    if len(set(parts)) != len(parts) or value.shape is None:
        return None
    found: list[tuple[int, int, int, ir.Node]] = []
    for part in parts:
        node = part.producer()
        if (
            node is None
            or node.op_type != "Pad"
            or node.domain not in ("", "ai.onnx")
            or len(node.inputs) != 2
            or part.uses()
            or part.is_graph_output()
            or node.attributes.get_string("mode", "constant") != "constant"
        ):
            return None
        pads = constant_value(node.inputs[1])
        rank = len(value.shape)
        if pads is None or pads.shape != (2 * rank,) or (pads < 0).any():
            return None
        axes = [a for a in range(rank) if pads[a] or pads[rank + a]]
        if len(axes) != 1:
            return None
        found.append((axes[0], int(pads[axes[0]]), int(pads[rank + axes[0]]), node))
    axis = found[0][0]
    total = value.shape[axis]
    if not isinstance(total, int) or any(a != axis for a, *_ in found):
        return None
    found.sort(key=lambda item: item[1])
    position = 0
    for _, begin, end, _ in found:
        if begin != position or end >= total - begin:
            return None
        position = total - end
    if position != total:
        return None
    return axis, [node for *_, node in found]


TYPE_ONLY_INPUTS = {"CastLike": 1}
"""Default-domain ops with an input that gives only the output's type, never its values: a
value that reaches the op only there does not make its output depend on a ``wrt`` tensor."""


def _value_reads(node: ir.Node, reads: list[ir.Value]) -> list[ir.Value]:
    """``reads`` without the input of ``node`` that only gives a type (:data:`TYPE_ONLY_INPUTS`),
    unless ``node`` also reads that value as data."""
    index = TYPE_ONLY_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if index is None or index >= len(node.inputs) or node.inputs[index] is None:
        return reads
    typing = node.inputs[index]
    if any(v is typing for i, v in enumerate(node.inputs) if i != index):
        return reads
    return [v for v in reads if v is not typing]


def _reads(node: ir.Node) -> list[ir.Value]:
    """The values ``node`` reads: its inputs and the outer values its subgraphs capture."""
    values = [v for v in node.inputs if v is not None]
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            subgraphs = [attr.as_graph()]
        elif attr.type == ir.AttributeType.GRAPHS:
            subgraphs = list(attr.as_graphs())
        else:
            continue
        for sub in subgraphs:
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                values.extend(
                    v for v in inner.inputs if v is not None and v.graph is not None
                    and v.graph is node.graph
                )
    return values


def _ones_seed(b: OpBuilder, loss: ir.Value) -> ir.Value:
    if loss.shape is not None and len(loss.shape) == 0:
        return b.const(1.0, like=loss, name="loss_seed")
    return b.ones_like(loss)


def build_gradient_graph(
    model: ModelLike,
    wrt: Sequence[str] | None = None,
    *,
    loss: str | None = None,
    stop_gradients: Sequence[str] = (),
    user_gradients: Sequence[str] = (),
) -> onnx.ModelProto:
    """Differentiate ``model`` and return a model that also outputs the gradients.

    Args:
        model: A path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; it is not modified.
        wrt: Names of the tensors whose gradients are wanted: initializers, graph inputs or
            intermediate tensors. Default: every floating-point initializer.
        loss: Name of the output differentiated. Default: the first output.
        stop_gradients: Names of tensors treated as constants.
        user_gradients: Names of tensors that receive a gradient from outside code, as a new
            graph input ``<name>_user_grad``.

    Returns:
        An ``onnx.ModelProto`` whose outputs are the model's outputs followed by ``<x>_grad``
        for each ``x`` in ``wrt``.

    Example:
        >>> grad_model = build_gradient_graph("mlp.onnx", loss="loss")
        >>> [o.name for o in grad_model.graph.output]
        ['loss', 'fc1.weight_grad', 'fc1.bias_grad', ...]
    """
    m = load_ir(model, copy=True)
    graph = m.graph
    opset = default_opset(m)
    values = values_by_name(graph)

    def lookup(name: str, what: str) -> ir.Value:
        if name not in values:
            close = difflib.get_close_matches(name, list(values), n=5)
            hint = f"did you mean one of {close}?" if close else f"e.g. {sorted(values)[:8]}."
            raise ModelError(
                f"{what} {name!r} is not a tensor of the model. Expected one of its inputs,"
                f" initializers or node outputs; {hint}"
            )
        return values[name]

    if loss is None:
        if not graph.outputs:
            raise ModelError("the model has no outputs; pass loss=<name of a scalar tensor>")
        loss_value = graph.outputs[0]
    else:
        loss_value = lookup(loss, "loss")
    if wrt is None:
        wrt_values = [v for v in graph.initializers.values() if is_float(v)]
    else:
        wrt_values = [lookup(name, "wrt tensor") for name in wrt]
    seen: set[str] = set()
    for v in wrt_values:
        if v.dtype is not None and not is_float(v):
            raise ModelError(
                f"wrt tensor {v.name!r} has dtype {v.dtype}; only floating-point tensors carry"
                " gradients. Remove it from wrt."
            )
        if v.name in seen:
            raise ModelError(f"wrt names {v.name!r} twice; name each tensor once")
        seen.add(v.name or "")
        if f"{v.name}_grad" in values:
            raise ModelError(
                f"the model already has a tensor named {v.name}_grad, the name of the gradient"
                f" output of wrt tensor {v.name!r}; rename that tensor first"
            )
    result = differentiate(
        graph,
        opset,
        wrt_values,
        loss=loss_value,
        stop_gradients=[lookup(n, "stop_gradients tensor") for n in stop_gradients],
        user_gradients=[lookup(n, "user_gradients tensor") for n in user_gradients],
    )
    b = OpBuilder(graph, opset, prefix="grad")
    for v in wrt_values:
        g = result.grads[v.name or ""]
        g = g if g is not None else b.zeros_like(v)
        graph.outputs.append(name_output(b, g, f"{v.name}_grad", v))
    return to_proto(m)


_NAMED = "traingraph.named_output"


def name_output(
    b: OpBuilder, value: ir.Value, name: str, like: ir.Value, *, rename: bool = False
) -> ir.Value:
    """Expose ``value`` as a graph output called ``name`` typed like ``like``, through an
    Identity.

    With ``rename``, a value computed by a node of this graph is renamed instead, so that
    node writes the output itself (a runtime that binds the output to a buffer then copies
    nothing); graph inputs, initializers, outputs and values already exposed under another
    name still go through an Identity. Only for graphs that nothing refers to by the old
    names.
    """
    renamable = (
        rename
        and value.producer() is not None
        and value.graph is b.graph
        and not value.is_graph_input()
        and not value.is_graph_output()
        and not value.is_initializer()
        and not value.meta.get(_NAMED)
        and value.dtype in (None, like.dtype)
    )
    if renamable:
        value.name = name
        value.meta[_NAMED] = True
        value.shape = like.shape
        value.type = like.type
        return value
    out = b.Identity(value)
    out.name = name
    out.shape = like.shape
    out.type = like.type
    return out


def values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """Every named value of ``graph``'s main level: inputs, initializers and node outputs."""
    values: dict[str, ir.Value] = {}
    for v in graph.inputs:
        values[v.name or ""] = v
    for name, v in graph.initializers.items():
        values[name] = v
    for node in graph:
        for o in node.outputs:
            if o.name:
                values[o.name] = o
    return values

