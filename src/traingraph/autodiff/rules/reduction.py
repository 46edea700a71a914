"""Gradients of the Reduce* family.

Each rule writes the local derivative ``dy/dx`` as an input-shaped tensor and multiplies it by
the output gradient brought back to a shape that broadcasts against the input: the reduced axes
are re-inserted (with ``Unsqueeze``, when ``keepdims=0``), then broadcast.

``noop_with_empty_axes=1`` with empty axes reduces over no axis at all: the output is the
elementwise part of the reduction (``x`` for ReduceSum, ``x**2`` for ReduceSumSquare, ``|x|``
for ReduceL1 and ReduceL2, ``log(x)`` for ReduceLogSum), and the same formulas below hold with
every reduction over no axis being the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import static_shape

Grads = Sequence[ir.Value | None]


def reduced_axes(ctx: GradContext) -> list[int] | None:
    """The reduced axes as ints: None for all axes, ``[]`` for none (``noop_with_empty_axes``).

    They come from the ``axes`` attribute (before opset 18, except ReduceSum) or the constant
    ``axes`` input.
    """
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


def keep_reduced_dims(ctx: GradContext, value: ir.Value) -> ir.Value:
    """``value``, shaped like the node's output, reshaped to broadcast against the input.

    With ``keepdims=0`` the reduced axes are re-inserted as size-1 axes; a full reduction gives
    a scalar, which broadcasts as it is.
    """
    axes = reduced_axes(ctx)
    if ctx.attr("keepdims", 1) or not axes:
        return value
    return ctx.b.unsqueeze(value, axes)


def expand_reduced(ctx: GradContext, g: ir.Value) -> ir.Value:
    """Broadcast ``g``, shaped like the reduced output, to the input's shape."""
    if reduced_axes(ctx) == []:
        return g
    return ctx.b.Expand(keep_reduced_dims(ctx, g), ctx.b.shape(ctx.x(0)))


def _output_grad(ctx: GradContext, grads: Grads) -> ir.Value:
    """The output gradient, shaped to broadcast against the input."""
    return keep_reduced_dims(ctx, ctx.grad_or_zeros(grads, 0))


def reduce_like_node(ctx: GradContext, op_type: str, value: ir.Value) -> ir.Value:
    """``op_type`` over the node's reduced axes, keeping them as size-1 axes."""
    axes = reduced_axes(ctx)
    if axes == []:
        return value
    return ctx.b.reduce(op_type, value, axes, keepdims=True)


def _reduced_count(ctx: GradContext) -> ir.Value:
    """How many input elements each output element reduces, as a scalar of the input's dtype."""
    b, x = ctx.b, ctx.x(0)
    axes = reduced_axes(ctx)
    dims = static_shape(x)
    if axes == []:
        return b.scalar(1.0, like=x)
    if dims is not None:
        count = 1
        for axis in range(len(dims)) if axes is None else axes:
            count *= dims[axis]
        return b.scalar(float(count), like=x)
    ratio = b.Div(b.op("Size", x), b.op("Size", ctx.outputs[0]))
    return b.cast_like(ratio, x)


@register_gradient("ReduceSum")
def reduce_sum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``dx = g`` broadcast over the reduced axes."""
    return [expand_reduced(ctx, ctx.grad_or_zeros(grads, 0))]


@register_gradient("ReduceMean")
def reduce_mean(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``dx = g / n`` broadcast, with ``n`` the number of elements per reduced slice."""
    g = ctx.grad_or_zeros(grads, 0)
    return [expand_reduced(ctx, ctx.b.Div(g, _reduced_count(ctx)))]


def _extremum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """ReduceMax / ReduceMin: the gradient is shared evenly by the elements equal to the result.

    ``dx = g * [x == y] / #{x == y}``, like ``torch.amax`` / ``torch.amin``.
    """
    b, x = ctx.b, ctx.x(0)
    is_extremum = b.cast_like(b.Equal(x, keep_reduced_dims(ctx, ctx.outputs[0])), x)
    ties = reduce_like_node(ctx, "ReduceSum", is_extremum)
    return [b.Mul(is_extremum, b.Div(_output_grad(ctx, grads), ties))]


register_gradient("ReduceMax")(_extremum)
register_gradient("ReduceMin")(_extremum)


@register_gradient("ReduceSumSquare")
def reduce_sum_square(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = sum x^2``: ``dx = 2 x g``."""
    b, x = ctx.b, ctx.x(0)
    return [b.Mul(_output_grad(ctx, grads), b.Mul(x, b.scalar(2.0, like=x)))]


@register_gradient("ReduceL1")
def reduce_l1(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = sum |x|``: ``dx = sign(x) g`` (0 where ``x = 0``)."""
    b, x = ctx.b, ctx.x(0)
    return [b.Mul(_output_grad(ctx, grads), b.Sign(x))]


@register_gradient("ReduceL2")
def reduce_l2(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = sqrt(sum x^2)``: ``dx = x g / y``, and 0 for a slice whose norm is 0.

    Where ``y = 0`` every ``x`` of the slice is 0, so dividing by 1 there gives the 0 gradient.
    """
    b, x = ctx.b, ctx.x(0)
    y = keep_reduced_dims(ctx, ctx.outputs[0])
    safe_y = b.Where(b.Equal(y, b.scalar(0.0, like=x)), b.scalar(1.0, like=x), y)
    return [b.Mul(x, b.Div(_output_grad(ctx, grads), safe_y))]


@register_gradient("ReduceLogSumExp")
def reduce_log_sum_exp(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = log sum exp x``: ``dx = g softmax(x) = g exp(x - y)``, where ``x - y <= 0``."""
    b, x = ctx.b, ctx.x(0)
    softmax = b.Exp(b.Sub(x, keep_reduced_dims(ctx, ctx.outputs[0])))
    return [b.Mul(_output_grad(ctx, grads), softmax)]


@register_gradient("ReduceLogSum")
def reduce_log_sum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = log sum x``: ``dx = g / sum x = g / exp(y)`` broadcast."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    return [expand_reduced(ctx, b.Div(g, b.Exp(ctx.outputs[0])))]


@register_gradient("ReduceProd")
def reduce_prod(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y = prod x``: ``dx_i = g prod_{j != i} x_j``, exact also where the slice holds zeros.

    With ``p`` the product of the slice's nonzero elements and ``z`` its number of zeros:
    ``prod_{j != i} x_j = p / x_i`` when ``z = 0``; ``p`` at the zero and 0 elsewhere when
    ``z = 1``; 0 everywhere when ``z >= 2``.
    """
    b, x = ctx.b, ctx.x(0)
    zero, one = b.scalar(0.0, like=x), b.scalar(1.0, like=x)
    is_zero = b.Equal(x, zero)
    nonzero_x = b.Where(is_zero, one, x)
    p = reduce_like_node(ctx, "ReduceProd", nonzero_x)
    zeros = reduce_like_node(ctx, "ReduceSum", b.cast_like(is_zero, x))
    others = b.Where(
        b.Equal(zeros, zero),
        b.Div(p, nonzero_x),
        b.Where(b.And(is_zero, b.Equal(zeros, one)), p, zero),
    )
    return [b.Mul(_output_grad(ctx, grads), others)]
