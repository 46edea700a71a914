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

Grads = Sequence[ir.Value | None]


def _sum_over_axis(ctx: GradContext, value: ir.Value) -> ir.Value:
    """``value`` summed over the node's ``axis`` (kept as a size-1 dimension)."""
    return ctx.b.sum(value, [ctx.attr("axis", -1)], keepdims=True)


@register_gradient("Softmax", since=13)
def softmax(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = exp(x) / sum(exp(x), axis)``: ``dx = y (g - sum(g y, axis))``."""
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    return [b.Mul(y, b.Sub(g, _sum_over_axis(ctx, b.Mul(g, y))))]


@register_gradient("LogSoftmax", since=13)
def log_softmax(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = x - log(sum(exp(x), axis))``: ``dx = g - exp(y) sum(g, axis)``."""
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    return [b.Sub(g, b.Mul(b.Exp(y), _sum_over_axis(ctx, g)))]
