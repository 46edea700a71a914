"""Gradients of elementwise arithmetic, math functions, activations and selections.

Binary and variadic ops broadcast, so each input gradient is reduced back to that input's shape
with ``ctx.unbroadcast``. Rules reuse the forward output where that is cheaper and at least as
accurate as recomputing from the input (``Sqrt``: ``g / (2 y)``, ``Exp``: ``g y``, ``Elu``:
``g (y + alpha)`` on the negative side, ...).

At a kink (``Relu``, ``LeakyRelu``, ``PRelu``, ``Elu``, ``Selu``, ``Celu`` at ``x = 0``) the
slope of the negative side is used, as in PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import FLOAT_TYPES

Grads = Sequence[ir.Value | None]
InGrads = list[ir.Value | None]

# Default attribute values of Selu (the float32 values the ONNX spec gives).
_SELU_ALPHA = 1.67326319217681884765625
_SELU_GAMMA = 1.05070102214813232421875


def _where_positive(
    ctx: GradContext, grads: Grads, positive: ir.Value, negative: ir.Value
) -> ir.Value:
    """``g * (positive if x > 0 else negative)``, with ``x`` the node's first input and ``g``
    the gradient of its output."""
    b, x = ctx.b, ctx.x(0)
    mask = b.Greater(x, b.scalar(0.0, x))
    return b.Mul(ctx.grad_or_zeros(grads, 0), b.Where(mask, positive, negative))


# --------------------------------------------------------------------------- structural


@register_gradient("Identity")
def identity(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g``."""
    return [grads[0]]


@register_gradient("Cast")
def cast(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = Cast(g, dtype of x)`` between floating-point types; none through an integer cast."""
    if not ctx.need(0) or ir.DataType(ctx.attr("to")) not in FLOAT_TYPES:
        return [None]
    return [ctx.b.cast_like(ctx.grad_or_zeros(grads, 0), ctx.x(0))]


@register_gradient("CastLike")
def cast_like(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = Cast(g, dtype of x)``; the ``target_type`` input only gives a dtype."""
    return [ctx.b.cast_like(ctx.grad_or_zeros(grads, 0), ctx.x(0)) if ctx.need(0) else None, None]


# --------------------------------------------------------------------------- arithmetic


@register_gradient("Add")
def add(ctx: GradContext, grads: Grads) -> InGrads:
    """``da = g``, ``db = g``, each summed over its broadcast axes."""
    g = ctx.grad_or_zeros(grads, 0)
    return [
        ctx.unbroadcast(g, ctx.x(0)) if ctx.need(0) else None,
        ctx.unbroadcast(g, ctx.x(1)) if ctx.need(1) else None,
    ]


@register_gradient("Sub")
def sub(ctx: GradContext, grads: Grads) -> InGrads:
    """``da = g``, ``db = -g``, each summed over its broadcast axes."""
    g = ctx.grad_or_zeros(grads, 0)
    return [
        ctx.unbroadcast(g, ctx.x(0)) if ctx.need(0) else None,
        ctx.unbroadcast(ctx.b.Neg(g), ctx.x(1)) if ctx.need(1) else None,
    ]


@register_gradient("Mul")
def mul(ctx: GradContext, grads: Grads) -> InGrads:
    """``da = g b``, ``db = g a``, each summed over its broadcast axes."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    a, c = ctx.x(0), ctx.x(1)
    return [
        ctx.unbroadcast(b.Mul(g, c), a) if ctx.need(0) else None,
        ctx.unbroadcast(b.Mul(g, a), c) if ctx.need(1) else None,
    ]


@register_gradient("Div")
def div(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = a / c``: ``da = g / c``, ``dc = -(g / c) y``, each summed over its broadcast axes."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    a, c = ctx.x(0), ctx.x(1)
    ga = b.Div(g, c)
    return [
        ctx.unbroadcast(ga, a) if ctx.need(0) else None,
        ctx.unbroadcast(b.Neg(b.Mul(ga, ctx.outputs[0])), c) if ctx.need(1) else None,
    ]


@register_gradient("Pow")
def pow_(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = a ** p``: ``da = g p a ** (p - 1)``, ``dp = g y log(a)``.

    As in PyTorch, ``da`` is 0 where ``p = 0`` (``a ** (p - 1)`` is replaced by ``a ** 0``, so
    ``a = 0`` gives 0 rather than ``0 * inf``) and ``dp`` is 0 where ``a = 0`` and ``p >= 0``.
    The exponent may have another dtype than the base (integer or float); its gradient is cast
    back to it.
    """
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    base, exponent, y = ctx.x(0), ctx.x(1), ctx.outputs[0]
    out: InGrads = [None, None]
    if ctx.need(0):
        constant = ctx.const_input(1)
        if constant is not None:
            lowered = b.const(np.where(constant == 0, 0, constant - 1).astype(constant.dtype))
            coefficient = b.cast_like(b.const(constant), base)
        else:
            zero = b.scalar(0, exponent)
            lowered = b.Where(
                b.Equal(exponent, zero), zero, b.Sub(exponent, b.scalar(1, exponent))
            )
            coefficient = b.cast_like(exponent, base)
        slope = b.Mul(coefficient, b.Pow(base, lowered))
        out[0] = ctx.unbroadcast(b.Mul(g, slope), base)
    if ctx.need(1):
        zero = b.scalar(0.0, base)
        undefined_log = b.And(
            b.Equal(base, zero), b.Not(b.Less(exponent, b.scalar(0, exponent)))
        )
        slope = b.Where(undefined_log, zero, b.Mul(y, b.Log(base)))
        out[1] = ctx.unbroadcast(b.cast_like(b.Mul(g, slope), exponent), exponent)
    return out


@register_gradient("Neg")
def neg(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = -g``."""
    return [ctx.b.Neg(ctx.grad_or_zeros(grads, 0))]


@register_gradient("Abs")
def abs_(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g sign(x)`` (0 at ``x = 0``)."""
    return [ctx.b.Mul(ctx.grad_or_zeros(grads, 0), ctx.b.Sign(ctx.x(0)))]


@register_gradient("Sqrt")
def sqrt(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g / (2 y)``."""
    y = ctx.outputs[0]
    return [ctx.b.Div(ctx.grad_or_zeros(grads, 0), ctx.b.Add(y, y))]


@register_gradient("Reciprocal")
def reciprocal(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = 1 / x``: ``dx = -g y^2``."""
    b, y = ctx.b, ctx.outputs[0]
    return [b.Neg(b.Mul(ctx.grad_or_zeros(grads, 0), b.Mul(y, y)))]


# --------------------------------------------------------------------------- math functions


@register_gradient("Exp")
def exp(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g y``."""
    return [ctx.b.Mul(ctx.grad_or_zeros(grads, 0), ctx.outputs[0])]


@register_gradient("Log")
def log(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g / x``."""
    return [ctx.b.Div(ctx.grad_or_zeros(grads, 0), ctx.x(0))]


@register_gradient("Erf")
def erf(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g (2 / sqrt(pi)) exp(-x^2)``."""
    b, x = ctx.b, ctx.x(0)
    density = b.Mul(b.Exp(b.Neg(b.Mul(x, x))), b.scalar(2.0 / math.sqrt(math.pi), x))
    return [b.Mul(ctx.grad_or_zeros(grads, 0), density)]


@register_gradient("Sin")
def sin(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g cos(x)``."""
    return [ctx.b.Mul(ctx.grad_or_zeros(grads, 0), ctx.b.Cos(ctx.x(0)))]


@register_gradient("Cos")
def cos(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = -g sin(x)``."""
    return [ctx.b.Neg(ctx.b.Mul(ctx.grad_or_zeros(grads, 0), ctx.b.Sin(ctx.x(0))))]


@register_gradient("Tanh")
def tanh(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g (1 - y^2)``."""
    b, y = ctx.b, ctx.outputs[0]
    return [b.Mul(ctx.grad_or_zeros(grads, 0), b.Sub(b.scalar(1.0, y), b.Mul(y, y)))]


@register_gradient("Sigmoid")
def sigmoid(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g y (1 - y)``."""
    b, y = ctx.b, ctx.outputs[0]
    return [b.Mul(ctx.grad_or_zeros(grads, 0), b.Mul(y, b.Sub(b.scalar(1.0, y), y)))]


# --------------------------------------------------------------------------- activations


@register_gradient("Relu")
def relu(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g * (y > 0)``, with ``y`` the output (0 where ``y`` is 0 or NaN).

    A multiplication by the cast mask rather than ``Where(y > 0, g, 0)``, which onnxruntime
    runs at less than half the speed. The two differ only where ``y`` is 0 and ``g`` is not
    finite (NaN instead of 0) or negative (-0.0 instead of 0.0).
    """
    b, y = ctx.b, ctx.outputs[0]
    active = b.cast_like(b.Greater(y, b.scalar(0.0, y)), y)
    return [b.Mul(ctx.grad_or_zeros(grads, 0), active)]


@register_gradient("LeakyRelu")
def leaky_relu(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx = g`` where ``x > 0``, else ``alpha g``."""
    x = ctx.x(0)
    alpha = ctx.attr("alpha", 0.01)
    return [_where_positive(ctx, grads, ctx.b.scalar(1.0, x), ctx.b.scalar(alpha, x))]


@register_gradient("PRelu")
def prelu(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = x if x > 0 else s x``: ``dx = g`` or ``g s``; ``ds = g x`` where ``x <= 0``.

    The slope ``s`` broadcasts to ``x``; its gradient is summed back to its shape.
    """
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    x, slope = ctx.x(0), ctx.x(1)
    out: InGrads = [None, None]
    if ctx.need(0):
        out[0] = _where_positive(ctx, grads, b.scalar(1.0, x), slope)
    if ctx.need(1):
        zero = b.scalar(0.0, x)
        slope_grad = b.Where(b.Greater(x, zero), zero, b.Mul(g, x))
        out[1] = ctx.unbroadcast(slope_grad, slope)
    return out


@register_gradient("Elu")
def elu(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = alpha (exp(x) - 1)`` for ``x <= 0``: ``dx = g (y + alpha)`` there, ``g`` elsewhere."""
    b, y = ctx.b, ctx.outputs[0]
    alpha = ctx.attr("alpha", 1.0)
    return [_where_positive(ctx, grads, b.scalar(1.0, y), b.Add(y, b.scalar(alpha, y)))]


@register_gradient("Selu")
def selu(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = gamma alpha (exp(x) - 1)`` for ``x <= 0``: ``dx = g (y + gamma alpha)`` there,
    ``g gamma`` elsewhere."""
    b, y = ctx.b, ctx.outputs[0]
    alpha = ctx.attr("alpha", _SELU_ALPHA)
    gamma = ctx.attr("gamma", _SELU_GAMMA)
    negative = b.Add(y, b.scalar(alpha * gamma, y))
    return [_where_positive(ctx, grads, b.scalar(gamma, y), negative)]


@register_gradient("Celu")
def celu(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = alpha (exp(x / alpha) - 1)`` for ``x <= 0``: ``dx = g (y / alpha + 1)`` there,
    ``g`` elsewhere."""
    b, y = ctx.b, ctx.outputs[0]
    alpha = ctx.attr("alpha", 1.0)
    one = b.scalar(1.0, y)
    negative = b.Add(b.Div(y, b.scalar(alpha, y)), one)
    return [_where_positive(ctx, grads, one, negative)]


@register_gradient("Softplus")
def softplus(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = log(1 + exp(x))``: ``dx = g sigmoid(x)``."""
    return [ctx.b.Mul(ctx.grad_or_zeros(grads, 0), ctx.b.Sigmoid(ctx.x(0)))]


@register_gradient("Softsign")
def softsign(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = x / (1 + |x|)``: ``dx = g / (1 + |x|)^2``."""
    b, x = ctx.b, ctx.x(0)
    d = b.Add(b.scalar(1.0, x), b.Abs(x))
    return [b.Div(ctx.grad_or_zeros(grads, 0), b.Mul(d, d))]


@register_gradient("HardSigmoid")
def hard_sigmoid(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = clip(alpha x + beta, 0, 1)``: ``dx = alpha g`` where ``0 < y < 1``, else 0."""
    b, y = ctx.b, ctx.outputs[0]
    alpha = ctx.attr("alpha", 0.2)
    zero = b.scalar(0.0, y)
    inside = b.And(b.Greater(y, zero), b.Less(y, b.scalar(1.0, y)))
    return [b.Where(inside, b.Mul(ctx.grad_or_zeros(grads, 0), b.scalar(alpha, y)), zero)]


@register_gradient("HardSwish")
def hard_swish(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = x clip(x / 6 + 1/2, 0, 1)``: ``dx = g`` times 0 for ``x < -3``, ``x / 3 + 1/2`` for
    ``-3 <= x <= 3`` and 1 for ``x > 3``."""
    b, x = ctx.b, ctx.x(0)
    middle = b.Add(b.Div(x, b.scalar(3.0, x)), b.scalar(0.5, x))
    upper = b.Where(b.Greater(x, b.scalar(3.0, x)), b.scalar(1.0, x), middle)
    slope = b.Where(b.Less(x, b.scalar(-3.0, x)), b.scalar(0.0, x), upper)
    return [b.Mul(ctx.grad_or_zeros(grads, 0), slope)]


@register_gradient("Mish")
def mish(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = x t``, ``t = tanh(softplus(x))``: ``dx = g (t + x s (1 - t^2))``, ``s = sigmoid(x)``.

    ``t`` is computed as ``s (2 - s) / (1 + (1 - s)^2)``, which equals ``tanh(log(1 + e^x))``,
    never overflows and needs only ops that onnxruntime runs in every float type.
    """
    b, x = ctx.b, ctx.x(0)
    one = b.scalar(1.0, x)
    s = b.Sigmoid(x)
    q = b.Sub(one, s)
    t = b.Div(b.Mul(s, b.Add(one, q)), b.Add(one, b.Mul(q, q)))
    slope = b.Add(t, b.Mul(b.Mul(x, s), b.Sub(one, b.Mul(t, t))))
    return [b.Mul(ctx.grad_or_zeros(grads, 0), slope)]


@register_gradient("Gelu", since=20)
def gelu(ctx: GradContext, grads: Grads) -> InGrads:
    """Gradient of ``Gelu`` for ``approximate="none"`` and ``"tanh"``.

    ``none``: ``y = x Phi(x)``, ``dx = g (Phi(x) + x phi(x))`` with
    ``Phi(x) = (1 + erf(x / sqrt(2))) / 2`` and ``phi(x) = exp(-x^2 / 2) / sqrt(2 pi)``.

    ``tanh``: ``y = x (1 + t) / 2`` with ``t = tanh(k (x + c x^3))``, ``k = sqrt(2/pi)``,
    ``c = 0.044715``: ``dx = g ((1 + t)/2 + x (1 - t^2) k (1 + 3 c x^2) / 2)``.
    """
    b, x = ctx.b, ctx.x(0)
    approximate = ctx.attr("approximate", "none")
    half = b.scalar(0.5, x)
    one = b.scalar(1.0, x)
    x2 = b.Mul(x, x)
    if approximate == "none":
        cdf = b.Mul(half, b.Add(one, b.Erf(b.Mul(x, b.scalar(1.0 / math.sqrt(2.0), x)))))
        pdf = b.Mul(b.Exp(b.Mul(x2, b.scalar(-0.5, x))), b.scalar(1.0 / math.sqrt(2 * math.pi), x))
        slope = b.Add(cdf, b.Mul(x, pdf))
    elif approximate == "tanh":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        inner = b.Mul(b.scalar(k, x), b.Add(x, b.Mul(b.scalar(c, x), b.Mul(x2, x))))
        t = b.Tanh(inner)
        d_inner = b.Mul(b.scalar(k, x), b.Add(one, b.Mul(b.scalar(3 * c, x), x2)))
        tail = b.Mul(b.Mul(half, x), b.Mul(b.Sub(one, b.Mul(t, t)), d_inner))
        slope = b.Add(b.Mul(half, b.Add(one, t)), tail)
    else:
        ctx.unsupported(
            f'approximate={approximate!r} is not a Gelu mode; expected "none" or "tanh"'
        )
    return [b.Mul(ctx.grad_or_zeros(grads, 0), slope)]


# --------------------------------------------------------------------------- selections


@register_gradient("Clip", since=11)
def clip(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = Min(Max(x, lo), hi)`` with optional scalar inputs ``lo`` and ``hi``.

    The gradient follows that composition: ``x`` receives ``g`` where ``lo <= x <= hi`` (both
    bounds inclusive, as ``torch.clamp``), ``lo`` receives the sum of ``g`` where
    ``x < lo <= hi`` and ``hi`` the sum where ``Max(x, lo) > hi``. Every element's gradient goes
    to exactly one of the three, also when ``lo > hi`` (the output is then ``hi`` everywhere).
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    zero = b.scalar(0.0, x)
    lo = ctx.x(1) if ctx.has_input(1) else None
    hi = ctx.x(2) if ctx.has_input(2) else None
    below = b.Less(x, lo) if lo is not None else None
    above = b.Greater(x, hi) if hi is not None else None
    out: InGrads = [None] * len(ctx.inputs)
    if ctx.need(0):
        outside = [m for m in (below, above) if m is not None]
        if not outside:
            out[0] = g
        else:
            mask = outside[0] if len(outside) == 1 else b.Or(*outside)
            out[0] = b.Where(mask, zero, g)
    if lo is not None and below is not None and ctx.need(1):
        takes_lo = below if hi is None else b.And(below, b.Not(b.Greater(lo, hi)))
        out[1] = ctx.unbroadcast(b.Where(takes_lo, g, zero), lo)
    if hi is not None and ctx.need(2):
        raised = x if lo is None else b.Max(x, lo)
        out[2] = ctx.unbroadcast(b.Where(b.Greater(raised, hi), g, zero), hi)
    return out


def _extremum(ctx: GradContext, grads: Grads) -> InGrads:
    """Gradient of variadic ``Max`` / ``Min``: ``g`` goes to the inputs equal to the output.

    Tie rule: where ``k`` inputs share the extreme value, each receives ``g / k``. For two
    inputs this is ``torch.maximum`` / ``torch.minimum``'s rule (each gets ``g / 2``).
    """
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    inputs = [ctx.x(i) for i in range(len(ctx.inputs))]
    hits = [b.Equal(x, y) for x in inputs]
    count = b.Sum(*(b.cast_like(hit, y) for hit in hits))
    share = b.Div(g, count)
    zero = b.scalar(0.0, y)
    return [
        ctx.unbroadcast(b.Where(hit, share, zero), x) if ctx.need(i) else None
        for i, (x, hit) in enumerate(zip(inputs, hits))
    ]


register_gradient("Max")(_extremum)
register_gradient("Min")(_extremum)


@register_gradient("Where")
def where(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = cond ? a : c``: ``da = g`` where ``cond``, ``dc = g`` elsewhere; none for ``cond``."""
    b, g, y = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.outputs[0]
    cond = ctx.x(0)
    zero = b.scalar(0.0, y)
    return [
        None,
        ctx.unbroadcast(b.Where(cond, g, zero), ctx.x(1)) if ctx.need(1) else None,
        ctx.unbroadcast(b.Where(cond, zero, g), ctx.x(2)) if ctx.need(2) else None,
    ]


# --------------------------------------------------------------------------- variadic sums


@register_gradient("Sum")
def sum_(ctx: GradContext, grads: Grads) -> InGrads:
    """``dx_i = g``, summed over the broadcast axes of ``x_i``."""
    return [
        ctx.unbroadcast(ctx.grad_or_zeros(grads, 0), x) if ctx.need(i) and x is not None else None
        for i, x in enumerate(ctx.inputs)
    ]


@register_gradient("Mean")
def mean(ctx: GradContext, grads: Grads) -> InGrads:
    """``y = (x_1 + ... + x_n) / n``: ``dx_i = g / n``, summed over ``x_i``'s broadcast axes."""
    b, y = ctx.b, ctx.outputs[0]
    share = b.Mul(ctx.grad_or_zeros(grads, 0), b.scalar(1.0 / len(ctx.inputs), y))
    return [
        ctx.unbroadcast(share, x) if ctx.need(i) and x is not None else None
        for i, x in enumerate(ctx.inputs)
    ]
