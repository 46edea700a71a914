"""Gradients of MaxPool, AveragePool, GlobalAveragePool and GlobalMaxPool.

- Max pooling routes each output gradient to the input element it selected (on ties, the first
  in row-major window order, as onnxruntime and PyTorch pick it):
  ``dL/dX[i] = sum_{o : argmax(o) = i} G[o]``. Windows that tile the input (kernel equal to
  the strides, no padding or dilation, static spatial sizes, float32) are gathered into one axis
  and their ``ArgMax`` is compared with each input position's place in its window, all in dense
  elementwise ops. Any other window geometry takes the positions from MaxPool's ``Indices``
  output (flattened over ``N x C x D...``) and scatter-adds the gradients into zeros.
- Average pooling is linear, ``Y[o] = sum_{i in window(o)} X[i] / div(o)``, so
  ``dL/dX = ConvTranspose(G / div, ones)`` per channel. ``1 / div(o)`` is read off the forward
  op itself, ``AveragePool(ones)[o] / count(o)`` with ``count(o)`` the input elements (not
  padding) in window ``o``, so it matches every ``count_include_pad`` / ``ceil_mode`` convention.
  With strides and dilations 1 (the 3 x 3 pools of PoolFormer, Inception and NAS cells), the
  transposed convolution with a window of ones is the sum over the window turned around, that
  is over the same window with the pads ``k - 1 - p`` exchanged: an ``AveragePool`` that counts
  the pads, of ``G * prod(k) / div``, one pooling pass where the ConvTranspose unfolds
  ``prod(k)`` columns and folds them back.
- The global pools are the same over the whole spatial extent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.autodiff.rules.conv import (
    Window,
    kernel_shape,
    sliding_window,
    spatial_dims,
    transposed_conv_to,
)
from traingraph.ir.builder import OpBuilder
from traingraph.ir.tags import tags

Grads = Sequence[ir.Value | None]


def _max_pool_indices(ctx: GradContext) -> ir.Value:
    """Row-major flat argmax positions of the node's windows, from its ``Indices`` output or
    from a second MaxPool with the same attributes that returns them."""
    outputs = ctx.outputs
    if len(outputs) > 1 and outputs[1].name and not ctx.attr("storage_order", 0):
        return outputs[1]
    attrs: dict[str, Any] = {
        name: attr for name, attr in ctx.node.attributes.items() if name != "storage_order"
    }
    _, indices = ctx.b.op("MaxPool", ctx.x(0), num_outputs=2, **attrs)
    return indices


def _scatter_add(
    b: OpBuilder, zeros: ir.Value, indices: ir.Value, updates: ir.Value, win: Window
) -> ir.Value:
    """``zeros`` (flat) with ``updates`` added at the flat ``indices`` of a pooling's windows.

    From opset 16, one ``ScatterElements(reduction="add")``. Below, ScatterElements only
    overwrites, so the windows are split into classes that never overlap: windows whose output
    positions agree modulo ``r = ceil(extent / stride)`` along every axis are at least
    ``extent`` apart, hence pick distinct elements. Each class is scattered on its own and the
    results are summed.
    """
    if b.opset >= 16:
        flat = [b.Reshape(v, b.ints([-1])) for v in (indices, updates)]
        return b.ScatterElements(zeros, *flat, axis=0, reduction="add")
    n = len(win.kernel)
    periods = [-(-e // s) for e, s in zip(win.extents, win.strides)]
    axes = list(range(2, n + 2))
    parts = []
    for offsets in itertools.product(*(range(p) for p in periods)):
        picked = [
            b.Reshape(b.slice(v, list(offsets), [2**62] * n, axes, periods), b.ints([-1]))
            for v in (indices, updates)
        ]
        parts.append(b.ScatterElements(zeros, *picked, axis=0))
    return parts[0] if len(parts) == 1 else b.Sum(*parts)


def _tiling_counts(ctx: GradContext, win: Window, x: ir.Value) -> list[int] | None:
    """The number of windows per spatial axis when they tile ``x`` without overlap, else None.

    Tiling windows have the kernel as strides, no dilation or padding, and static spatial
    sizes; input rows past the last whole window are allowed (no window reads them). The
    routing also needs float32 (onnxruntime's ``Resize`` has no float64 kernel) and
    ``Resize``'s opset-13 form.
    """
    n = len(win.kernel)
    sizes = spatial_dims(x, n)
    if (
        ctx.opset < 13
        or x.dtype != ir.DataType.FLOAT
        or win.strides != win.kernel
        or any(d != 1 for d in win.dilations)
        or any(win.begins)
        or any(win.ends)
        or any(size is None for size in sizes)
    ):
        return None
    counts = win.out_dims(sizes, bool(ctx.attr("ceil_mode", 0)))
    fits = all(
        o is not None and s is not None and 0 < o * k <= s
        for o, k, s in zip(counts, win.kernel, sizes)
    )
    return [int(o) for o in counts if o is not None] if fits else None


def _route_to_first_max(
    b: OpBuilder, x: ir.Value, g: ir.Value, kernel: tuple[int, ...], counts: list[int]
) -> ir.Value:
    """``G`` routed to the first maximum of each of the tiling windows of ``x``.

    With ``K = prod(kernel)``, ``x`` (cropped to the windows) is viewed as
    ``[N, C, O1, k1, O2, k2, ...]`` and transposed to ``[N, C, O..., K]``; ``a = ArgMax``
    over the last axis is the row-major place of the first maximum (``select_last_index=0``,
    the element MaxPool itself reports). Both ``a`` and ``G`` are upsampled to the input
    size by nearest-neighbour ``Resize`` and

        dL/dX[p] = G[p // k] * (a[p // k] == place(p % k)),

    with ``place`` the row-major index within a window (a constant). Rows past the last
    window get zeros. A non-finite ``G`` gives NaN (not 0) at the other places of its window.
    """
    n = len(kernel)
    axes = list(range(2, n + 2))
    sizes = spatial_dims(x, n)
    covered = [o * k for o, k in zip(counts, kernel)]
    tiled = x if covered == sizes else b.slice(x, [0] * n, covered, axes)
    split = b.Reshape(tiled, b.ints([0, 0, *itertools.chain(*zip(counts, kernel))]))
    perm = [0, 1, *range(2, 2 * n + 2, 2), *range(3, 2 * n + 2, 2)]
    windows = split if n == 1 else b.Transpose(split, perm=perm)
    flat = b.Reshape(windows, b.ints([0, 0, *counts, math.prod(kernel)]))
    first = b.cast_like(b.ArgMax(flat, axis=-1, keepdims=0, select_last_index=0), x)
    scales = b.const(np.array([1.0, 1.0, *kernel], dtype=np.float32), name="scales")

    def upsample(v: ir.Value) -> ir.Value:
        return b.Resize(
            v, None, scales, mode="nearest", coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        )

    grid = np.indices(covered)
    place = np.ravel_multi_index(tuple(i % k for i, k in zip(grid, kernel)), kernel)
    chosen = b.Equal(upsample(first), b.const(place, like=x, name="window_place"))
    dx = b.Mul(upsample(g), b.cast_like(chosen, x))
    if covered == sizes:
        return dx
    rest = [int(s) - c for s, c in zip(sizes, covered) if s is not None]
    return b.Pad(dx, b.ints([0] * (n + 2) + [0, 0, *rest]))


@register_gradient("MaxPool")
@tags("max_pool_grad")
def max_pool(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``MaxPool``: ``dL/dX[i] = sum_{o : argmax(o) = i} G[o]``."""
    g = ctx.grad_or_zeros(grads, 0)
    b, x = ctx.b, ctx.x(0)
    win = sliding_window(ctx, kernel_shape(ctx, None), x)
    counts = _tiling_counts(ctx, win, x)
    if counts is not None:
        return [_route_to_first_max(b, x, g, win.kernel, counts)]
    zeros = b.Reshape(b.zeros_like(x), b.ints([-1]))
    dx = _scatter_add(b, zeros, _max_pool_indices(ctx), g, win)
    return [b.reshape_like(dx, x)]


def _average_scale(ctx: GradContext, win: Window, x: ir.Value) -> ir.Value:
    """``1 / div(o)`` for every window ``o``, shaped ``[1, 1, O...]`` (or a scalar).

    Static spatial sizes: ``AveragePool(ones)[o] / count(o)``, all constants (onnxruntime folds
    them when the session starts). Unknown sizes: windows without padding or ``ceil_mode`` all
    hold ``prod(kernel)`` input elements.
    """
    b, n = ctx.b, len(win.kernel)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    sizes = [size for size in spatial_dims(x, n) if size is not None]
    if len(sizes) < n or x.dtype is None:
        if ceil_mode or any(win.begins) or any(win.ends):
            ctx.unsupported(
                "padding or ceil_mode with unknown spatial input sizes (input shape"
                f" {x.shape}) is not supported; give the input static spatial dimensions"
            )
        return b.scalar(1.0 / math.prod(win.kernel), like=x)
    counts = np.ones((1, 1), dtype=np.float64)
    for size, o, s, d, k, pb in zip(
        sizes, win.out_dims(sizes, ceil_mode), win.strides, win.dilations, win.kernel, win.begins
    ):
        starts = np.arange(o)[:, None] * s - pb + np.arange(k)[None, :] * d
        inside = ((starts >= 0) & (starts < size)).sum(axis=1)
        counts = counts[..., None] * inside
    ones = b.op(
        "ConstantOfShape",
        b.ints([1, 1, *sizes]),
        value=ir.tensor(np.ones((1,), dtype=x.dtype.numpy())),
    )
    attrs: dict[str, Any] = dict(ctx.node.attributes)
    averaged = b.op("AveragePool", ones, **attrs)
    return b.Div(averaged, b.const(counts, like=x))


@register_gradient("AveragePool")
def average_pool(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``AveragePool``: ``dL/dX = ConvTranspose(G / div, ones)`` per channel."""
    g = ctx.grad_or_zeros(grads, 0)
    b, x = ctx.b, ctx.x(0)
    win = sliding_window(ctx, kernel_shape(ctx, None), x)
    n = len(win.kernel)
    unit = all(s == 1 for s in win.strides) and all(d == 1 for d in win.dilations)
    if unit and all(p < k for k, p in zip(win.kernel * 2, win.begins + win.ends)):
        size = float(math.prod(win.kernel))
        scale = b.Mul(_average_scale(ctx, win, x), b.scalar(size, like=x))
        # window o reads inputs o - pb .. o - pb + k - 1, so input i is read by outputs
        # i + pb - k + 1 .. i + pb: a window of k again, with the pads k - 1 - pb before
        # and k - 1 - pe after, each of which the pool divides by prod(k)
        pads = [k - 1 - p for k, p in zip(win.kernel * 2, win.begins + win.ends)]
        summed = b.op(
            "AveragePool",
            b.Mul(g, scale),
            kernel_shape=list(win.kernel),
            pads=pads,
            count_include_pad=1,
        )
        return [summed]
    planes = b.ints([-1, 1] + [0] * n)
    scaled = b.Reshape(b.Mul(g, _average_scale(ctx, win, x)), planes)
    ones = b.const(np.ones((1, 1, *win.kernel)), like=x)
    sizes = spatial_dims(x, n)
    dx = transposed_conv_to(
        b, scaled, ones, win, 1, b.Reshape(x, planes), sizes,
        win.out_dims(sizes, bool(ctx.attr("ceil_mode", 0))),
    )
    return [b.reshape_like(dx, x)]


@register_gradient("GlobalAveragePool")
def global_average_pool(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``GlobalAveragePool``: ``dL/dX[n, c, i] = G[n, c] / prod(D)``."""
    g = ctx.grad_or_zeros(grads, 0)
    b, x = ctx.b, ctx.x(0)
    dims = [None] if x.shape is None else spatial_dims(x, len(x.shape) - 2)
    sizes = [size for size in dims if size is not None]
    if len(sizes) == len(dims):
        count = b.scalar(float(math.prod(sizes)), like=x)
    else:
        count = b.cast_like(b.Div(b.op("Size", x), b.op("Size", g)), x)
    return [b.Expand(b.Div(g, count), b.shape(x))]


@register_gradient("GlobalMaxPool")
def global_max_pool(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``GlobalMaxPool``: ``G[n, c]`` goes to the first maximum of ``X[n, c]``."""
    g = ctx.grad_or_zeros(grads, 0)
    b, x = ctx.b, ctx.x(0)
    flat = b.ints([0, 0, -1])
    first_max = b.ArgMax(b.Reshape(x, flat), axis=2, keepdims=1)
    routed = b.ScatterElements(
        b.Reshape(b.zeros_like(x), flat), first_max, b.Reshape(g, b.ints([0, 0, 1])), axis=2
    )
    return [b.reshape_like(routed, x)]
