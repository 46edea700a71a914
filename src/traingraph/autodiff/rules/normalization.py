"""Gradients of the normalization layers and of Dropout.

Every normalization standardizes ``x`` over some axes and then applies a scale and a shift:

    xhat = (x - mean(x)) * rstd,   rstd = 1 / sqrt(var(x) + eps),   y = scale * xhat + bias

with the biased variance. When the statistics come from ``x`` itself (BatchNormalization in
training mode, LayerNormalization, InstanceNormalization, GroupNormalization), the gradient of
``x`` given ``gh = dL/dxhat = g * scale`` is

    dL/dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))

with the means over the normalized axes; ``dL/dscale = sum(g * xhat)`` and ``dL/dbias = sum(g)``
over the axes the parameters are broadcast along. The statistics are recomputed from ``x`` in
the gradient graph, so no optional forward output is needed. BatchNormalization's statistics
come from :func:`batch_statistics`, which the training-mode lowering
(:mod:`traingraph.autodiff.lowering`) shares, so a runtime that merges common subexpressions
computes them once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import OpBuilder, rank, static_shape
from traingraph.ir.tags import tagging, tags

INSTANCE_NORM_GRAD = "instance_norm_grad"
"""The tag of the nodes of an InstanceNormalization's input gradient."""

Grads = Sequence[ir.Value | None]

_LOW_PRECISION = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def standardize(
    b: OpBuilder, x: ir.Value, axes: Sequence[int], eps: float
) -> tuple[ir.Value, ir.Value]:
    """``(xhat, rstd)``: ``x`` standardized over ``axes``, and ``1/sqrt(var + eps)`` (kept dims)."""
    centered = b.Sub(x, b.mean(x, axes))
    var = b.mean(b.Mul(centered, centered), axes)
    rstd = b.Reciprocal(b.Sqrt(b.Add(var, b.scalar(eps, x))))
    return b.Mul(centered, rstd), rstd


def batch_statistics(
    b: OpBuilder, x: ir.Value, axes: Sequence[int]
) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(mean, x - mean, var)`` over ``axes`` (kept dims), with the biased variance.

    The variance is the mean of the squared centered values (two passes), not
    ``mean(x^2) - mean^2``, which loses the digits of a variance small against the mean.
    """
    mean = b.mean(x, axes)
    centered = b.Sub(x, mean)
    return mean, centered, b.mean(b.Mul(centered, centered), axes)


def statistics_input(b: OpBuilder, x: ir.Value) -> ir.Value:
    """``x`` as the batch statistics read it: float32 where ``x`` is float16 or bfloat16 (the
    sums of many low-precision values overflow or lose their digits in that type)."""
    return b.cast(x, ir.DataType.FLOAT) if x.dtype in _LOW_PRECISION else x


def inverse_channel_count(b: OpBuilder, x: ir.Value, channels: ir.Value) -> ir.Value:
    """``1 / M``, ``M`` the elements of ``x`` per entry of the per-channel ``channels``."""
    dims, c_dims = static_shape(x), static_shape(channels)
    if dims is not None and c_dims is not None:
        return b.scalar(math.prod(c_dims) / math.prod(dims), x)
    return b.Div(b.cast_like(b.op("Size", channels), x), b.cast_like(b.op("Size", x), x))


def standardize_grad(
    b: OpBuilder, gh: ir.Value, xhat: ir.Value, rstd: ir.Value, axes: Sequence[int]
) -> ir.Value:
    """The gradient of ``x`` through ``xhat = standardize(x)`` given ``gh = dL/dxhat``.

    ``dL/dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat))``, means over ``axes``.
    """
    centered = b.Sub(gh, b.mean(gh, axes))
    projected = b.Mul(xhat, b.mean(b.Mul(gh, xhat), axes))
    return b.Mul(b.Sub(centered, projected), rstd)  # the broadcast operand on the right


def _known_rank(ctx: GradContext, x: ir.Value, minimum: int) -> int:
    r = rank(x)
    if r is None:
        ctx.unsupported(f"the rank of input {x.name!r} is unknown; run shape inference first")
    if r < minimum:
        ctx.unsupported(f"input {x.name!r} has rank {r}; expected at least {minimum}")
    return r


def _per_channel(b: OpBuilder, v: ir.Value, r: int) -> ir.Value:
    """Reshape a ``(C,)`` tensor so that it broadcasts along axis 1 of a rank-``r`` tensor."""
    return b.unsqueeze(v, list(range(1, r - 1))) if r > 2 else v


def _as(b: OpBuilder, v: ir.Value, dtype: ir.DataType | None) -> ir.Value:
    """``v`` cast to ``dtype`` (unchanged when it already has it or ``dtype`` is None)."""
    if dtype is None or v.dtype == dtype:
        return v
    return b.cast(v, dtype)


def _compute_dtype(ctx: GradContext, x: ir.Value) -> ir.DataType | None:
    """The dtype the statistics are computed in: ``stash_type`` when it is wider than ``x``."""
    stash = ir.DataType(ctx.attr("stash_type", ir.DataType.FLOAT))
    if x.dtype in _LOW_PRECISION and stash not in _LOW_PRECISION:
        return stash
    return x.dtype


def _channel_axes(r: int) -> list[int]:
    """Every axis but the channel axis 1."""
    return [0, *range(2, r)]


@register_gradient("BatchNormalization")
@tags("batch_norm_grad")
def batch_normalization(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """BatchNormalization in training mode (batch statistics) or inference mode (given stats).

    Training mode (``training_mode=1``, opset 14+) normalizes with the batch statistics; its
    ``running_mean`` / ``running_var`` outputs are state updates and carry no gradient, and the
    ``input_mean`` / ``input_var`` inputs only feed them. With ``M`` elements per channel,
    ``xc = x - mean``, ``rstd = 1 / sqrt(var + eps)`` and the per-channel sums
    ``S = sum(g)``, ``T = sum(g * xc)``:

        dL/dscale = rstd * T,   dL/dbias = S,
        dL/dx = (scale * rstd / M) * (M g - S - xhat * rstd * T) = a g - (k xc + c),
        a = scale * rstd,   k = a * rstd^2 * T / M,   c = a * S / M,

    so the full-size tensors are read for the statistics, the two sums and one affine map
    (and the mean of ``xc``, which corrects for the rounding of the mean: see
    :func:`_batch_norm_training_grads`). Inference mode uses ``input_mean`` and ``input_var``
    as given: with ``s = scale * rstd``,

        dL/dx = g * s,   dL/dmean = -sum(g) * s,   dL/dvar = -sum(g * (x - mean)) * s * rstd^2 / 2.
    """
    if any(g is not None for g in grads[1:]):
        ctx.unsupported(
            "a gradient flows into the running_mean / running_var outputs, which are state"
            " updates; put stop_gradients on them"
        )
    if ctx.opset < 14 and len(ctx.outputs) > 1:
        ctx.unsupported(
            f"BatchNormalization-9 with {len(ctx.outputs)} outputs (training mode) is not"
            " supported; export the model at opset 14 or later (training_mode attribute)"
        )
    b, x, scale = ctx.b, ctx.x(0), ctx.x(1)
    g = ctx.grad_or_zeros(grads, 0)
    r = _known_rank(ctx, x, 2)
    axes = _channel_axes(r)
    eps = float(ctx.attr("epsilon", 1e-5))
    training = bool(ctx.attr("training_mode", 0))
    for i in (1, 2) if training else (1, 2, 3, 4):
        # a training-mode node of float16 activations may keep float32 parameters
        wide = training and x.dtype in _LOW_PRECISION and ctx.x(i).dtype == ir.DataType.FLOAT
        if ctx.x(i).dtype != x.dtype and not wide:
            ctx.unsupported(
                f"input {i} has dtype {ctx.x(i).dtype} but X has {x.dtype}; expected one dtype"
            )
    if training:
        return _batch_norm_training_grads(ctx, g, axes, eps)
    out: list[ir.Value | None] = [None] * 5
    mean_b = _per_channel(b, ctx.x(3), r)
    rstd = b.Reciprocal(b.Sqrt(b.Add(ctx.x(4), b.scalar(eps, x))))
    centered = b.Sub(x, mean_b)
    s = b.Mul(scale, rstd)
    if ctx.need(0):
        out[0] = b.Mul(g, _per_channel(b, s, r))
    if ctx.need(1):
        xhat = b.Mul(centered, _per_channel(b, rstd, r))
        out[1] = b.sum(b.Mul(g, xhat), axes, keepdims=False)
    if ctx.need(2) or ctx.need(3):
        sum_g = b.sum(g, axes, keepdims=False)
        out[2] = sum_g if ctx.need(2) else None
        out[3] = b.Neg(b.Mul(sum_g, s)) if ctx.need(3) else None
    if ctx.need(4):
        g_centered = b.sum(b.Mul(g, centered), axes, keepdims=False)
        half_s_rstd2 = b.Mul(b.Mul(s, b.Mul(rstd, rstd)), b.scalar(-0.5, x))
        out[4] = b.Mul(g_centered, half_s_rstd2)
    return out


def _batch_norm_training_grads(
    ctx: GradContext, g: ir.Value, axes: list[int], eps: float
) -> list[ir.Value | None]:
    """The training-mode gradients of x, scale and bias (see :func:`batch_normalization`).

    ``xc = x - mean`` is taken from the mean rounded to ``x``'s type, up to half a unit in its
    last place off the true one, so every ``xc`` of a channel is off by the same ``e``, which
    their mean measures (``e = mean(xc)``, 0 for the exact mean). Where a channel's mean is
    large against its spread (BatchNorm over few values), that shift is the gradient's largest
    error: through ``k * xc`` it moves every ``dL/dx`` by ``k e`` and their sum over the
    channel (0 in exact arithmetic) by ``M k e``. It is taken out: ``T = sum(g * xc) - S e``
    (``sum(g * (x - true mean))``) and ``dL/dx = a g - (k xc + c - k e)``, whose sum over a
    channel is then 0 up to the rounding of its terms.

    The per-channel arithmetic runs on ``(C,)`` vectors, in as few ops as it takes (each is a
    kernel launch on a GPU): with ``am = a / M``, ``dL/dx = a g - (k xc + c')`` where
    ``k = am * rstd * dL/dscale`` and ``c' = am * S - k e``. The sums drop the reduced axes.

    Float16 or bfloat16 ``x`` and ``g`` (with float16 or float32 parameters) are read as
    float32 (:func:`statistics_input`): the statistics, the sums and ``dL/dx`` are computed
    in float32 and ``dL/dx`` is rounded once to ``x``'s type, the parameters' gradients to
    theirs.
    """
    b, x, scale = ctx.b, ctx.x(0), ctx.x(1)
    xs = statistics_input(b, x)
    low = xs is not x  # float16 activations, float32 arithmetic

    def wide(v: ir.Value) -> ir.Value:
        return b.cast(v, ir.DataType.FLOAT) if low else v

    def narrow(v: ir.Value, like: ir.Value) -> ir.Value:
        dtype = like.dtype
        return b.cast(v, dtype) if low and dtype and dtype != ir.DataType.FLOAT else v

    _, centered, var = batch_statistics(b, xs, axes)
    gs = wide(g)
    need_gc = ctx.need(0) or ctx.need(1)
    sum_g = b.sum(gs, axes, keepdims=False) if need_gc or ctx.need(2) else None
    out: list[ir.Value | None] = [None] * 5
    out[2] = narrow(sum_g, ctx.x(2)) if sum_g is not None and ctx.need(2) else None
    if sum_g is None or not need_gc:
        return out
    shift = b.mean(centered, axes, keepdims=False)
    sum_gc = b.Sub(b.sum(b.Mul(gs, centered), axes, keepdims=False), b.Mul(sum_g, shift))
    rstd = b.Pow(b.Add(b.squeeze(var, axes), b.scalar(eps, xs)), b.scalar(-0.5, xs))
    d_scale = b.Mul(rstd, sum_gc)
    out[1] = narrow(d_scale, scale) if ctx.need(1) else None
    if ctx.need(0):
        r = len(axes) + 1
        a = b.Mul(_as(b, scale, xs.dtype), rstd)
        am = b.Mul(a, inverse_channel_count(b, xs, scale))
        k = b.Mul(b.Mul(am, rstd), d_scale)
        c = b.Sub(b.Mul(am, sum_g), b.Mul(k, shift))
        # the full-size operand first: a provider's per-channel broadcast takes the
        # per-channel operand on the right (onnxruntime's CUDA kernels have a fast path only so)
        shifted = b.Add(b.Mul(centered, _per_channel(b, k, r)), _per_channel(b, c, r))
        # In float32 for low-precision activations, rounded once: ``a g`` and ``k xc + c`` may
        # be much larger than their difference.
        out[0] = narrow(b.Sub(b.Mul(gs, _per_channel(b, a, r)), shifted), x)
    return out


@register_gradient("InstanceNormalization")
def instance_normalization(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """InstanceNormalization: statistics over the spatial axes ``2..r-1`` of each (n, c)."""
    b, x, scale = ctx.b, ctx.x(0), ctx.x(1)
    g = ctx.grad_or_zeros(grads, 0)
    r = _known_rank(ctx, x, 3)
    xhat, rstd = standardize(b, x, list(range(2, r)), float(ctx.attr("epsilon", 1e-5)))
    axes = _channel_axes(r)
    dx = None
    if ctx.need(0):  # a native kernel's pattern (the CPU runtime's instance_norm_grad)
        with tagging(b, INSTANCE_NORM_GRAD, ctx.node.name or "InstanceNormalization"):
            gh = b.Mul(g, _per_channel(b, scale, r))
            dx = standardize_grad(b, gh, xhat, rstd, list(range(2, r)))
    return [
        dx,
        b.sum(b.Mul(g, xhat), axes, keepdims=False) if ctx.need(1) else None,
        b.sum(g, axes, keepdims=False) if ctx.need(2) else None,
    ]


def _inverse_count(b: OpBuilder, x: ir.Value, axis: int, like: ir.Value) -> ir.Value:
    """``1 / prod(x.shape[axis:])`` as a scalar of ``like``'s dtype."""
    dims = static_shape(x)
    if dims is not None:
        return b.scalar(1.0 / math.prod(dims[axis:]), like)
    count = b.reduce("ReduceProd", b.cast_like(b.shape(x, start=axis), like), None, False)
    return b.Reciprocal(count)


@register_gradient("LayerNormalization", since=17)
@tags("layer_norm_grad")
def layer_normalization(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """LayerNormalization over the axes ``axis..r-1``, with its optional Mean / InvStdDev outputs.

    The statistics are computed in ``stash_type`` when it is wider than X. Gradients flowing
    into the ``Mean`` and ``InvStdDev`` outputs add, with ``M`` the normalized element count,

        dL/dx += (g_mean - g_rstd * rstd^2 * xhat) / M.
    """
    b, x, scale = ctx.b, ctx.x(0), ctx.x(1)
    r = _known_rank(ctx, x, 1)
    axis = int(ctx.attr("axis", -1))
    if not -r <= axis < r:
        ctx.unsupported(f"axis={axis} is out of range for an input of rank {r}")
    axis %= r
    axes = list(range(axis, r))
    dtype = _compute_dtype(ctx, x)
    xc = _as(b, x, dtype)
    xhat, rstd = standardize(b, xc, axes, float(ctx.attr("epsilon", 1e-5)))
    g = grads[0]
    out: list[ir.Value | None] = [None] * len(ctx.inputs)
    if ctx.need(0):
        parts = []
        if g is not None:
            gh = _as(b, b.Mul(g, scale), dtype)
            parts.append(standardize_grad(b, gh, xhat, rstd, axes))
        g_mean = grads[1] if len(grads) > 1 else None
        g_rstd = grads[2] if len(grads) > 2 else None
        if g_mean is not None or g_rstd is not None:
            stats = _as(b, g_mean, dtype) if g_mean is not None else None
            if g_rstd is not None:
                term = b.Mul(b.Mul(_as(b, g_rstd, dtype), b.Mul(rstd, rstd)), xhat)
                stats = b.Neg(term) if stats is None else b.Sub(stats, term)
            assert stats is not None
            parts.append(b.Expand(b.Mul(stats, _inverse_count(b, x, axis, xc)), b.shape(x)))
        dx = parts[0] if len(parts) == 1 else b.Add(*parts)
        out[0] = _as(b, dx, x.dtype)
    if g is not None and ctx.need(1):
        out[1] = ctx.unbroadcast(b.Mul(g, _as(b, xhat, x.dtype)), scale, x)
    if g is not None and ctx.need(2):
        out[2] = ctx.unbroadcast(g, ctx.x(2), x)
    return out


@register_gradient("GroupNormalization", since=18)
def group_normalization(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """GroupNormalization: statistics over each group of ``C / num_groups`` channels.

    ``x`` is viewed as ``(N, G, C/G * spatial)`` and standardized over its last axis. The
    scale and bias are per group at opset 18-20 and per channel from opset 21.
    """
    b, x, scale = ctx.b, ctx.x(0), ctx.x(1)
    g = ctx.grad_or_zeros(grads, 0)
    r = _known_rank(ctx, x, 2)
    groups = int(ctx.attr("num_groups", 0))
    if groups <= 0:
        ctx.unsupported(f"num_groups={groups}; expected a positive number of groups")
    dtype = _compute_dtype(ctx, x)
    grouped_shape = b.ints([0, groups, -1])
    xr = b.Reshape(_as(b, x, dtype), grouped_shape)
    xr.dtype = dtype
    xhat_r, rstd = standardize(b, xr, [2], float(ctx.attr("epsilon", 1e-5)))
    per_channel = ctx.opset >= 21
    g_param = g if per_channel else b.Reshape(g, grouped_shape)
    param_axes = _channel_axes(r) if per_channel else [0, 2]
    out: list[ir.Value | None] = [None] * 3
    if ctx.need(0):
        if per_channel:
            gh = b.Reshape(b.Mul(g, _per_channel(b, scale, r)), grouped_shape)
        else:
            gh = b.Mul(g_param, b.unsqueeze(scale, [1]))
        dx_r = standardize_grad(b, _as(b, gh, dtype), xhat_r, rstd, [2])
        out[0] = _as(b, b.Reshape(dx_r, b.shape(x)), x.dtype)
    if ctx.need(1):
        xhat_param = b.Reshape(xhat_r, b.shape(x)) if per_channel else xhat_r
        out[1] = b.sum(b.Mul(g_param, _as(b, xhat_param, x.dtype)), param_axes, keepdims=False)
    if ctx.need(2):
        out[2] = b.sum(g_param, param_axes, keepdims=False)
    return out


def _dropout_mask(ctx: GradContext) -> ir.Value:
    """The node's ``mask`` output, added to the node when the model did not request it.

    The mask comes from the same random draw as the output, so the gradient matches the
    forward pass exactly.
    """
    node, x = ctx.node, ctx.x(0)
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    mask = node.outputs[1]
    if not mask.name:
        mask.name = ctx.b.fresh_name("dropout_mask")
        mask.dtype = ir.DataType.BOOL
        mask.shape = x.shape
    return mask


@register_gradient("Dropout", since=12)
def dropout(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Dropout: ``dL/dx = g * mask / (1 - ratio)`` in training mode, ``g`` otherwise.

    ``training_mode`` may be absent (inference), a constant or a run-time bool; ``ratio`` a
    constant or a run-time value.
    """
    if ctx.need(1):
        ctx.unsupported("the ratio input needs a gradient; ratio is a hyper-parameter")
    b, g = ctx.b, grads[0]
    training: bool | None = False
    if ctx.has_input(2):
        constant = ctx.const_input(2)
        training = None if constant is None else bool(constant)
    if training is False:
        return [g]
    ratio = ctx.const_input(1)
    if not ctx.has_input(1):
        keep_scale = b.scalar(2.0, ctx.x(0))
    elif ratio is not None:
        keep_scale = b.scalar(1.0 / (1.0 - float(ratio)), ctx.x(0))
    else:
        one = b.scalar(1.0, ctx.x(1))
        keep_scale = b.cast_like(b.Div(one, b.Sub(one, ctx.x(1))), ctx.x(0))
    mask = b.cast_like(_dropout_mask(ctx), ctx.x(0))
    dx = b.Mul(b.Mul(g, mask), keep_scale)
    if training is None:
        dx = b.Where(ctx.x(2), dx, g)
    return [dx]
