"""Gradients of elementwise arithmetic, math functions and activations.

Binary ops broadcast, so each input gradient is reduced back to that input's shape with
``ctx.unbroadcast``.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient

Grads = Sequence[ir.Value | None]


@register_gradient("Identity")
def identity(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [grads[0]]


@register_gradient("Cast")
def cast(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [ctx.b.cast_like(grads[0], ctx.x(0))]


@register_gradient("Add")
def add(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    g = grads[0]
    return [
        ctx.unbroadcast(g, ctx.x(0)) if ctx.need(0) else None,
        ctx.unbroadcast(g, ctx.x(1)) if ctx.need(1) else None,
    ]


@register_gradient("Sub")
def sub(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    g = grads[0]
    return [
        ctx.unbroadcast(g, ctx.x(0)) if ctx.need(0) else None,
        ctx.unbroadcast(ctx.b.Neg(g), ctx.x(1)) if ctx.need(1) else None,
    ]


@register_gradient("Mul")
def mul(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    b, g = ctx.b, grads[0]
    a, c = ctx.x(0), ctx.x(1)
    return [
        ctx.unbroadcast(b.Mul(g, c), a) if ctx.need(0) else None,
        ctx.unbroadcast(b.Mul(g, a), c) if ctx.need(1) else None,
    ]


@register_gradient("Div")
def div(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    b, g = ctx.b, grads[0]
    a, c = ctx.x(0), ctx.x(1)
    ga = b.Div(g, c)
    out = [ctx.unbroadcast(ga, a) if ctx.need(0) else None]
    # d(a/c)/dc = -(a/c)/c = -y/c
    out.append(ctx.unbroadcast(b.Neg(b.Mul(ga, ctx.outputs[0])), c) if ctx.need(1) else None)
    return out


@register_gradient("Neg")
def neg(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [ctx.b.Neg(grads[0])]


@register_gradient("Relu")
def relu(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    b = ctx.b
    y = ctx.outputs[0]
    mask = b.Greater(y, b.scalar(0.0, y))
    return [b.Where(mask, grads[0], b.scalar(0.0, y))]


@register_gradient("Exp")
def exp(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [ctx.b.Mul(grads[0], ctx.outputs[0])]


@register_gradient("Log")
def log(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [ctx.b.Div(grads[0], ctx.x(0))]


@register_gradient("Tanh")
def tanh(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    b, y = ctx.b, ctx.outputs[0]
    return [b.Mul(grads[0], b.Sub(b.scalar(1.0, y), b.Mul(y, y)))]


@register_gradient("Sigmoid")
def sigmoid(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    b, y = ctx.b, ctx.outputs[0]
    return [b.Mul(grads[0], b.Mul(y, b.Sub(b.scalar(1.0, y), y)))]


@register_gradient("Sum")
def sum_(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    return [
        ctx.unbroadcast(grads[0], x) if ctx.need(i) and x is not None else None
        for i, x in enumerate(ctx.inputs)
    ]
