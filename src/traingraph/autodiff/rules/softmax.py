"""Gradients of ``Softmax`` and ``LogSoftmax`` (opset 13 semantics: one ``axis``, default -1).

Both rules use only the forward output ``y`` and one sum over ``axis``:

* ``Softmax``: ``dx = y (g - sum(g y, axis))``.
* ``LogSoftmax``: ``dx = g - exp(y) sum(g, axis)``.

Before opset 13 these ops flattened the input to 2-D from ``axis`` on; those forms have no rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.fold import is_computed_zeros, remove_if_unused

Grads = Sequence[ir.Value | None]


def _sum_over_axis(ctx: GradContext, value: ir.Value) -> ir.Value:
    """``value`` summed over the node's ``axis`` (kept as a size-1 dimension)."""
    return ctx.b.sum(value, [ctx.attr("axis", -1)], keepdims=True)


@register_gradient("Softmax", since=13)
def softmax(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = exp(x) / sum(exp(x), axis)``: ``dx = y (g - sum(g y, axis))``.

    Attention exported from ``scaled_dot_product_attention`` with a boolean mask zeroes the
    rows a mask empties, ``z = Where(IsNaN(y), 0, y)``, and reads ``z`` on; ``g`` is then
    ``Where(IsNaN(y), 0, h)`` with ``h`` the gradient of ``z``. The rule reads ``z`` in ``y``'s
    place and ``Where(IsNaN(y), NaN, h)`` in ``g``'s, so that the gradient pass holds ``z``
    (which the next product's gradient reads anyway) and the mask, not ``y`` as well: one
    probability tensor fewer per attention layer. The values are the general form's: in a
    row without NaN, ``z`` is ``y`` and ``g`` is ``h``; in a row with one, both forms give
    NaN throughout (the sum over the row reads ``0 * NaN`` in the general form and
    ``NaN * z`` here).
    """
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    zeroed, unread = _nan_rows_zeroed(g, y), None
    if zeroed is not None:
        z, mask, h = zeroed
        unread, g, y = g, b.Where(mask, b.scalar(float("nan"), y), h), z
    dx = b.Mul(y, b.Sub(g, _sum_over_axis(ctx, b.Mul(g, y))))
    remove_if_unused(b.graph, unread)  # the Where's gradient, read by the general form only
    return [dx]


def _nan_rows_zeroed(g: ir.Value, y: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(z, mask, h)`` where ``g`` is ``Where(mask, c, h)`` with ``mask = IsNaN(y)``, read by
    nothing else, and the forward graph has ``z = Where(mask, c', y)``, where ``c`` and ``c'``
    are one value each (so that neither Where broadcasts beyond ``y``'s shape); else None."""
    node = g.producer()
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or g.uses():
        return None
    mask, c, h = node.inputs
    if mask is None or h is None:
        return None
    test = mask.producer()
    if test is None or test.op_type != "IsNaN" or test.inputs[0] is not y:
        return None
    if y.shape is None or not _one_value(c, len(y.shape)):
        return None
    for use in mask.uses():
        forward = use.node
        if forward is node or forward.op_type != "Where" or use.idx != 0:
            continue
        if forward.inputs[2] is y and _one_value(forward.inputs[1], len(y.shape)):
            return forward.outputs[0], mask, h
    return None


def _one_value(value: ir.Value | None, rank: int) -> bool:
    """Whether ``value`` holds one element and has at most ``rank`` dimensions."""
    if value is None or value.shape is None:
        return False
    return len(value.shape) <= rank and all(d == 1 for d in value.shape.dims)


@register_gradient("LogSoftmax", since=13)
def log_softmax(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = x - log(sum(exp(x), axis))``: ``dx = g - exp(y) sum(g, axis)``.

    Where ``g`` is a cross-entropy's: one value ``u`` per row added into zeros at the label's
    position along ``axis`` (the gradient of the ``GatherElements`` that picks the label's
    log-probability), ``sum(g, axis)`` is ``u`` itself, and ``dx`` is ``u`` added into
    ``exp(y) * -u`` at the same positions: one pass over the logits fewer for the sum, none for
    the zeros and the difference (a language model's logits are its largest tensor). The
    values are the general form's, up to the sign of zeros (rows whose ``u`` is 0).
    """
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    scatter = _label_scatter(g, y, int(ctx.attr("axis", -1)))
    if scatter is not None:
        index, u, axis = scatter
        minus_u = b.Neg(b.sum(u, [axis], keepdims=True))
        spread = b.Mul(b.Exp(y), minus_u)
        return [b.ScatterElements(spread, index, u, axis=axis, reduction="add")]
    return [b.Sub(g, b.Mul(b.Exp(y), _sum_over_axis(ctx, g)))]


def _label_scatter(g: ir.Value, y: ir.Value, axis: int) -> tuple[ir.Value, ir.Value, int] | None:
    """``(index, u, axis)`` where ``g`` is ``ScatterElements(zeros, index, u, axis,
    reduction="add")`` along ``y``'s ``axis`` with one element per row (``u``'s length 1 on
    ``axis``, its other dimensions ``y``'s) and no other reader; else None."""
    node = g.producer()
    if node is None or node.op_type != "ScatterElements" or node.domain not in ("", "ai.onnx"):
        return None
    if g.uses() or len(node.inputs) != 3 or y.shape is None:
        return None
    reduction = node.attributes.get("reduction")
    r = len(y.shape)
    if reduction is None or reduction.value != "add" or not -r <= axis < r:
        return None
    axis %= r
    if int(node.attributes["axis"].value if "axis" in node.attributes else 0) % r != axis:
        return None
    data, index, u = node.inputs
    if not is_computed_zeros(data) or index is None or u is None or u.shape is None:
        return None
    if len(u.shape) != r or u.shape.dims[axis] != 1:
        return None
    if any(not _same_length(u.shape.dims[k], y.shape.dims[k]) for k in range(r) if k != axis):
        return None
    return index, u, axis


def _same_length(a: int | ir.SymbolicDim, b: int | ir.SymbolicDim) -> bool:
    """Whether two dimensions are taken as one length: equal where both are numbers, else
    (symbolic: the batch named by two shape inferences, or not inferred) taken as equal. The
    loss gathers one label per row of the logits; a label block smaller than the logits would
    fail the broadcast at run time rather than leave zeros outside it."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return True
