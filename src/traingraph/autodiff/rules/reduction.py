"""Gradients of the Reduce* family.

The gradient of a reduction is broadcast back over the reduced axes: re-insert them (when
``keepdims=0``) with ``Unsqueeze``, then ``Expand`` to the input's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient

Grads = Sequence[ir.Value | None]


def reduced_axes(ctx: GradContext) -> list[int] | None:
    """The reduced axes as ints (None: all axes), from the attribute or the constant input."""
    if ctx.has_input(1):
        axes = ctx.const_input(1)
        if axes is None:
            ctx.unsupported("the axes input is computed at run time; make it a constant")
        axes = [int(a) for a in axes.reshape(-1)]
    else:
        axes = ctx.attr("axes")
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return []
        return None
    return list(axes)


def expand_reduced(ctx: GradContext, g: ir.Value) -> ir.Value:
    """Broadcast ``g``, the gradient of the reduced output, to the input's shape."""
    b, x = ctx.b, ctx.x(0)
    axes = reduced_axes(ctx)
    if axes == []:
        return g
    if not ctx.attr("keepdims", 1):
        if axes is None:
            return b.Expand(g, b.shape(x))
        g = b.unsqueeze(g, axes)
    return b.Expand(g, b.shape(x))


@register_gradient("ReduceSum")
def reduce_sum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [expand_reduced(ctx, grads[0])]
