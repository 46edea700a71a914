"""Gradients of Conv and ConvTranspose (1-D, 2-D and 3-D), and the window helpers the pools share.

For ``Y = Conv(X, W, B)`` with strides ``s``, dilations ``d``, begin pads ``p`` and groups ``g``::

    Y[n, m, o] = B[m] + sum_{c, k} W[m, c, k] * X[n, g(m) * Cg + c, o * s + k * d - p]

so, with ``G = dL/dY``:

- ``dL/dX[n, c, i] = sum_{m, k} G[n, m, (i + p - k * d) / s] * W[m, c, k]`` (over the ``k`` where
  the division is exact and in range). With stride 1 this is a plain Conv of ``G`` with the
  weight transposed to ``[C, M / g, k...]`` per group and flipped along every spatial axis,
  dilations ``d`` and pads ``extent - 1 - p`` at each end (``extent = (k - 1) * d + 1``); it is
  used when those pads are not negative, ``X`` has no more positions than ``Y`` and the groups
  have enough channels (see :func:`flipped_conv_fits`), where onnxruntime runs it faster than
  the alternative. Otherwise ``dL/dX = ConvTranspose(G, W)`` with the
  same strides, dilations, groups and pads, the end pads and ``output_padding`` chosen so that
  the result has exactly ``X``'s shape (input rows that no window reaches get a zero gradient).
- ``dL/dW[m, c, k] = sum_{n, o} G[n, m, o] * X[n, g(m) * Cg + c, o * s + k * d - p]``: the input is
  unfolded into its ``K = prod(kernel)`` shifted, strided views (one grouped Conv with one-hot
  kernels, which copies values exactly and runs faster than a strided Slice; nothing for an
  unpadded stride-1 1x1 kernel) and contracted with ``G``. Where a sample has more output
  positions ``O`` than a group has filters ``Mg``, the contraction is one batched MatMul per
  sample, summed over ``N``; otherwise that sum would cost more than the product, and the batch
  is moved inside the contraction instead: one GEMM ``[Mg, N * O] x [N * O, Cg * K]`` per group.
- ``dL/dB[m] = sum_{n, o} G[n, m, o]``.

``benchmarks/conv_grad_micro.py`` times these forms against each other on the benchmark models'
shapes. ``ConvTranspose`` is the adjoint of ``Conv`` with the same weight and geometry, so its
gradients are the same three pieces with the roles of input and output exchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import OpBuilder
from traingraph.ir.tags import tagging

Grads = Sequence[ir.Value | None]

_INT64_MIN = int(np.iinfo(np.int64).min)
# Fewer input channels per group make the flipped Conv's GEMM too thin to beat ConvTranspose.
_MIN_FLIPPED_CHANNELS = 8


@dataclass(frozen=True)
class Window:
    """The sliding-window geometry of a convolution or pooling node, per spatial axis.

    Attributes:
        kernel: Kernel size.
        strides: Strides.
        dilations: Dilations.
        begins: Padding before the first element.
        ends: Padding after the last element.
    """

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begins: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def extents(self) -> tuple[int, ...]:
        """The span of one dilated window, ``(k - 1) * d + 1``."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    def attrs(self) -> dict[str, Any]:
        """The Conv / ConvTranspose attributes that describe this window."""
        return {
            "kernel_shape": list(self.kernel),
            "strides": list(self.strides),
            "dilations": list(self.dilations),
            "pads": list(self.begins) + list(self.ends),
        }

    def out_dims(self, in_dims: Sequence[int | None], ceil_mode: bool = False) -> list[int | None]:
        """The number of windows along each axis (None where the input size is unknown).

        With ``ceil_mode`` a last, partial window is kept when it starts inside the input or
        the begin padding (the rule of onnxruntime and PyTorch).
        """
        out: list[int | None] = []
        for size, s, e, pb, pe in zip(in_dims, self.strides, self.extents, self.begins, self.ends):
            if size is None:
                out.append(None)
                continue
            span = size + pb + pe - e
            n = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (n - 1) * s >= size + pb:
                n -= 1
            out.append(n)
        return out


def spatial_dims(x: ir.Value, n: int) -> list[int | None]:
    """The ``n`` trailing (spatial) dimensions of ``x`` as ints, None where unknown."""
    if x.shape is None or len(x.shape) != n + 2:
        return [None] * n
    return [d if isinstance(d, int) else None for d in x.shape.dims[2:]]


def kernel_shape(ctx: GradContext, w_index: int | None) -> tuple[int, ...]:
    """The kernel size: the ``kernel_shape`` attribute, else the weight's static shape."""
    attr = ctx.attr("kernel_shape")
    if attr:
        return tuple(int(k) for k in attr)
    if w_index is not None:
        w = ctx.x(w_index)
        dims = [] if w.shape is None else [d for d in w.shape.dims[2:] if isinstance(d, int)]
        if dims and w.shape is not None and len(dims) == len(w.shape) - 2:
            return tuple(dims)
    ctx.unsupported(
        "the kernel size is unknown: the node has no kernel_shape attribute and the weight's"
        " spatial dimensions are not static; add kernel_shape or give the weight a static shape"
    )


def steps_and_auto_pad(
    ctx: GradContext, n: int
) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """The node's strides and dilations (default 1) and its ``auto_pad`` mode."""
    strides = tuple(int(v) for v in ctx.attr("strides") or [1] * n)
    dilations = tuple(int(v) for v in ctx.attr("dilations") or [1] * n)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        ctx.unsupported(
            f"auto_pad={auto_pad!r} is unknown; expected NOTSET, VALID, SAME_UPPER or SAME_LOWER"
        )
    return strides, dilations, auto_pad


def explicit_window(
    ctx: GradContext,
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    auto_pad: str,
) -> Window:
    """The window with the node's ``pads`` attribute (none for ``auto_pad=VALID``)."""
    n = len(kernel)
    pads = (ctx.attr("pads") if auto_pad == "NOTSET" else None) or [0] * (2 * n)
    return Window(kernel, strides, dilations, tuple(pads[:n]), tuple(pads[n:]))


def sliding_window(ctx: GradContext, kernel: tuple[int, ...], x: ir.Value) -> Window:
    """The window of a Conv or pooling node, with ``auto_pad`` resolved to explicit pads.

    ``SAME_UPPER`` / ``SAME_LOWER`` pad ``(ceil(D / s) - 1) * s + extent - D`` in total (at least
    0), the odd element at the end for ``SAME_UPPER`` and at the start for ``SAME_LOWER``.
    """
    n = len(kernel)
    strides, dilations, auto_pad = steps_and_auto_pad(ctx, n)
    if auto_pad in ("NOTSET", "VALID"):
        return explicit_window(ctx, kernel, strides, dilations, auto_pad)
    begins, ends = [], []
    for size, k, s, d in zip(spatial_dims(x, n), kernel, strides, dilations):
        extent = (k - 1) * d + 1
        if s == 1:
            total = extent - 1
        elif size is None:
            ctx.unsupported(
                f"auto_pad={auto_pad} with stride {s} needs static spatial input dimensions to"
                f" place the padding, got input shape {x.shape}; export with explicit pads"
            )
        else:
            total = max((-(-size // s) - 1) * s + extent - size, 0)
        small = total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else total - small)
        ends.append(total - begins[-1])
    return Window(kernel, strides, dilations, tuple(begins), tuple(ends))


def transposed_conv_to(
    b: OpBuilder,
    g: ir.Value,
    w: ir.Value,
    win: Window,
    group: int,
    like: ir.Value,
    in_dims: Sequence[int | None],
    out_dims: Sequence[int | None],
) -> ir.Value:
    """``ConvTranspose(g, w)`` over ``win``, with exactly the spatial shape ``in_dims`` of ``like``.

    The transposed convolution of the ``O`` windows spans ``full = (O - 1) * s + extent``
    padded positions. Where the sizes are static, the end padding cropped is
    ``max(full - p_begin - D, 0)`` and ``output_padding`` adds the rows no window reached (or,
    where ``output_padding`` stays below the stride, the end crop equals the begin crop and
    ``output_padding`` makes up the difference: the same values with symmetric pads); where
    they are not (and a stride exceeds 1), the result is cropped and zero-padded to ``x``'s shape
    at run time.

    Args:
        b: Builder.
        g: The gradient of the windows' output, ``[N, M, O...]``.
        w: Weight in Conv layout ``[M, C / group, k...]``.
        win: The window geometry of the forward node.
        group: Number of groups.
        like: A tensor of the result's rank and (run-time) shape, such as the forward input.
        in_dims: The static spatial sizes of ``like`` (None where unknown).
        out_dims: The number of windows per axis (None where unknown).
    """
    n = len(win.kernel)
    ends, out_pad, fit = [], [], False
    for size, o, s, d, e, pb, pe in zip(
        in_dims, out_dims, win.strides, win.dilations, win.extents, win.begins, win.ends
    ):
        if size is not None and o is not None:
            full = (o - 1) * s + e
            end = max(full - pb - size, 0)
            pad = size - (full - pb - end)
            if end < pb and pad + pb - end < max(s, d):
                # The same result with symmetric pads: onnxruntime's CUDA provider runs
                # ConvTranspose on the GPU only when the pads are symmetric.
                end, pad = pb, pad + pb - end
            ends.append(end)
            out_pad.append(pad)
        elif s == 1:
            ends.append(pe)
            out_pad.append(0)
        else:
            ends.append(0)
            out_pad.append(0)
            fit = True
    attrs = {**win.attrs(), "pads": list(win.begins) + ends, "group": group}
    if any(out_pad):
        attrs["output_padding"] = out_pad
    dx = b.op("ConvTranspose", g, w, **attrs)
    if not fit:
        return dx
    axes = list(range(2, n + 2))
    dx = b.slice(dx, [0] * n, b.shape(like, 2), axes)
    missing = b.Sub(b.shape(like), b.shape(dx))
    return b.op("Pad", dx, b.Concat(b.Sub(missing, missing), missing, axis=0))


def flipped_conv_fits(win: Window, channels: int | None, filters: int | None, group: int) -> bool:
    """Whether ``dL/dX`` of a Conv over ``win`` is best taken as a Conv with the flipped weight.

    That needs stride 1 and pads ``extent - 1 - p`` that are not negative. It is chosen only
    where it does no more work than ConvTranspose: the input has no more positions than the
    output (``p_begin + p_end >= extent - 1``), and the flipped Conv's filters, the input
    channels per group ``Cg``, fill a GEMM (``Cg >= 8``) or the Conv is depthwise.

    Args:
        win: The window geometry of the forward node.
        channels: The static number of input channels ``C`` (None where unknown).
        filters: The static number of output channels ``M``, which tells a depthwise Conv
            (None where unknown).
        group: Number of groups.
    """
    if channels is None:
        return False
    if channels // group < _MIN_FLIPPED_CHANNELS and not channels == filters == group:
        return False
    return all(
        s == 1 and pb <= e - 1 and pe <= e - 1 and pb + pe >= e - 1
        for s, e, pb, pe in zip(win.strides, win.extents, win.begins, win.ends)
    )


def flipped_weight(
    b: OpBuilder, w: ir.Value, kernel: tuple[int, ...], group: int
) -> ir.Value | None:
    """``W [M, C / group, k...]`` as the weight of the adjoint Conv, ``[C, M / group, k...]``.

    Each group's filter and channel axes are exchanged and every spatial axis longer than 1 is
    reversed (Slice with step -1). Returns None when ``group > 1`` and the weight's channel
    dimension is not static, which the regrouping needs.
    """
    n = len(kernel)
    spatial = list(range(2, n + 2))
    if group == 1:
        swapped = b.Transpose(w, perm=[1, 0, *spatial])
    else:
        cg = static_dim(w, 1)
        if cg is None:
            return None
        grouped = b.Reshape(w, b.ints([group, -1, cg, *kernel]))
        regrouped = b.Transpose(grouped, perm=[0, 2, 1, *range(3, n + 3)])
        swapped = b.Reshape(regrouped, b.ints([group * cg, -1, *kernel]))
    axes = [axis for axis, k in zip(spatial, kernel) if k > 1]
    if not axes:
        return swapped
    flips = [-1] * len(axes)
    return b.slice(swapped, flips, [_INT64_MIN] * len(axes), axes, flips)


def conv_input_grad(ctx: GradContext, g: ir.Value, win: Window, group: int) -> ir.Value:
    """``dL/dX`` of the Conv node ``Y = Conv(X, W)`` of ``ctx``, given ``g = dL/dY``: a Conv of
    ``g`` with the flipped weight where :func:`flipped_conv_fits`, else
    :func:`transposed_conv_to`."""
    b, x, w = ctx.b, ctx.x(0), ctx.x(1)
    channels = channel_count(x, w, group)
    filters = static_dim(w, 0) or static_dim(g, 1)
    fits = flipped_conv_fits(win, channels, filters, group)
    flipped = flipped_weight(b, w, win.kernel, group) if fits else None
    if flipped is None:
        sizes = spatial_dims(x, len(win.kernel))
        return transposed_conv_to(b, g, w, win, group, x, sizes, win.out_dims(sizes))
    return flipped_conv(b, g, flipped, win, group)


def flipped_conv(
    b: OpBuilder, g: ir.Value, flipped: ir.Value, win: Window, group: int
) -> ir.Value:
    """``dL/dX`` as a Conv of the output gradient ``g`` with the :func:`flipped_weight`, pads
    ``extent - 1 - p`` at each end (where :func:`flipped_conv_fits`)."""
    pads = [e - 1 - p for e, p in zip(win.extents, win.begins)]
    pads += [e - 1 - p for e, p in zip(win.extents, win.ends)]
    return b.Conv(
        g, flipped, group=group, kernel_shape=list(win.kernel),
        dilations=list(win.dilations), pads=pads,
    )


def unfold(b: OpBuilder, x: ir.Value, win: Window, channels: int | None) -> ir.Value:
    """The windows of ``x [N, C, D...]``, ``K = prod(kernel)`` values per channel and window.

    Channel ``c * K + k`` holds the input element at kernel offset ``k`` (row-major) of every
    window of channel ``c``: a grouped Conv with one-hot kernels, which copies each value
    exactly. The result is ``[N, C * K, O...]``; when the channel count ``C`` is not static,
    the same values come as ``[N * C, K, O...]`` (one plane per channel, a slower Conv). An
    unpadded 1x1 kernel with stride 1 needs no copy: its windows are ``x`` itself.
    """
    n = len(win.kernel)
    if set(win.kernel) == set(win.strides) == {1} and not any(win.begins + win.ends):
        return x
    count = math.prod(win.kernel)
    one_hot = np.eye(count).reshape(count, 1, *win.kernel)
    if channels is None:
        planes = b.Reshape(x, b.ints([-1, 1] + [0] * n))
        return b.Conv(planes, b.const(one_hot, like=x), **win.attrs())
    kernels = b.const(np.tile(one_hot, (channels,) + (1,) * (n + 1)), like=x)
    return b.Conv(x, kernels, group=channels, **win.attrs())


def conv_weight_grad(
    b: OpBuilder, x: ir.Value, g: ir.Value, w: ir.Value, win: Window, group: int
) -> ir.Value:
    """``dL/dW`` of ``Y = Conv(X, W)`` from the input ``x`` and the output gradient ``g``.

    ``dW[m, c, k] = sum_{n, o} g[n, m, o] * unfold(x)[n, c, k, o]``: one GEMM over the batch
    (:func:`weight_grad_by_gemm`) where the channel count, the filters per group ``Mg`` and the
    output positions per sample ``O`` are static and ``O <= Mg``, else per sample
    (:func:`weight_grad_by_sample`).

    Args:
        b: Builder.
        x: Conv input ``[N, C, D...]``.
        g: Gradient of the Conv output ``[N, M, O...]``.
        w: The weight ``[M, C / group, k...]`` (only its shape is used).
        win: The window geometry of the forward node.
        group: Number of groups.
    """
    channels = channel_count(x, w, group)
    cols = unfold(b, x, win, channels)
    n = len(win.kernel)
    out_dims = spatial_dims(g, n)
    if None in out_dims:
        out_dims = win.out_dims(spatial_dims(x, n))
    filters = static_dim(w, 0) or static_dim(g, 1)
    positions = None if None in out_dims else math.prod(out_dims)  # type: ignore[arg-type]
    if channels and filters and positions and positions <= filters // group:
        return weight_grad_by_gemm(b, cols, g, w, group, positions)
    return weight_grad_by_sample(b, cols, x, g, w, group)


def weight_grad_by_sample(
    b: OpBuilder, cols: ir.Value, x: ir.Value, g: ir.Value, w: ir.Value, group: int
) -> ir.Value:
    """``dL/dW`` as one batched MatMul per sample and group,
    ``[N, g, Cg * K, O] x [N, g, O, Mg]``, summed over ``N``.

    Args:
        b: Builder.
        cols: ``unfold(x)``.
        x: Conv input ``[N, C, D...]`` (only its run-time batch size is used).
        g: Gradient of the Conv output ``[N, M, O...]``.
        w: The weight ``[M, C / group, k...]`` (only its shape is used).
        group: Number of groups.
    """
    grad = b.Reshape(b.Reshape(g, b.ints([0, 0, 1, -1])), b.ints([0, group, -1, 0]))
    shape = b.Concat(b.shape(x, 0, 1), b.ints([group, -1]), b.shape(grad, 3, 4), axis=0)
    per_sample = b.MatMul(b.Reshape(cols, shape), b.Transpose(grad, perm=[0, 1, 3, 2]))
    summed = b.sum(per_sample, [0], keepdims=False)
    return b.reshape_like(b.Transpose(summed, perm=[0, 2, 1]), w)


def weight_grad_by_gemm(
    b: OpBuilder, cols: ir.Value, g: ir.Value, w: ir.Value, group: int, positions: int
) -> ir.Value:
    """``dL/dW`` as one GEMM per group with the batch inside the contraction,
    ``[g, Mg, N * O] x [g, N * O, Cg * K]``.

    Args:
        b: Builder.
        cols: ``unfold(x)`` as ``[N, C * K, O...]``.
        g: Gradient of the Conv output ``[N, M, O...]``.
        w: The weight ``[M, C / group, k...]`` (only its shape is used).
        group: Number of groups.
        positions: The number of output positions per sample, ``O = prod(O...)``.
    """

    def batch_inside(t: ir.Value) -> ir.Value:
        grouped = b.Reshape(t, b.ints([0, group, -1, positions]))
        return b.Reshape(b.Transpose(grouped, perm=[1, 2, 0, 3]), b.ints([0, 0, -1]))

    dw = b.MatMul(batch_inside(g), b.Transpose(batch_inside(cols), perm=[0, 2, 1]))
    return b.reshape_like(dw, w)


def static_dim(value: ir.Value, index: int) -> int | None:
    """Dimension ``index`` of ``value`` where it is static, else None."""
    if value.shape is None or len(value.shape) <= index:
        return None
    dim = value.shape.dims[index]
    return dim if isinstance(dim, int) else None


def channel_count(x: ir.Value, w: ir.Value, group: int) -> int | None:
    """The static channel count of ``x``: its dimension 1, else the weight's times ``group``."""
    channels = static_dim(x, 1)
    if channels is None and (per_group := static_dim(w, 1)) is not None:
        channels = per_group * group
    return channels


def bias_grad(b: OpBuilder, g: ir.Value, n: int) -> ir.Value:
    """``dL/dB``: ``g`` summed over the batch and the ``n`` spatial axes."""
    return b.sum(g, [0, *range(2, n + 2)], keepdims=False)


def _conv_grads(ctx: GradContext, grads: Grads, transposed: bool) -> list[ir.Value | None]:
    """The gradients of a Conv, or with ``transposed`` a ConvTranspose, node (see the rules)."""
    g = ctx.grad_or_zeros(grads, 0)
    b, x, w = ctx.b, ctx.x(0), ctx.x(1)
    kernel = kernel_shape(ctx, 1)
    win = (transpose_window if transposed else sliding_window)(ctx, kernel, x)
    group = int(ctx.attr("group", 1))
    dx = dw = db = None
    instance = ctx.node.name or "Conv"
    if transposed:  # the adjoint of a Conv with the same window and weight
        dx = b.Conv(g, w, group=group, **win.attrs()) if ctx.need(0) else None
        dw = conv_weight_grad(b, g, x, w, win, group) if ctx.need(1) else None
    else:
        if ctx.need(0):
            with tagging(b, "conv_input_grad", instance):
                dx = conv_input_grad(ctx, g, win, group)
        if ctx.need(1):
            with tagging(b, "conv_weight_grad", instance):
                dw = conv_weight_grad(b, x, g, w, win, group)
    if ctx.need(2):
        db = bias_grad(b, g, len(kernel))
    return [dx, dw, db][: len(ctx.inputs)]


@register_gradient("Conv")
def conv(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradients of ``Conv(X, W[, B])``; see the module docstring."""
    return _conv_grads(ctx, grads, transposed=False)


def transpose_window(ctx: GradContext, kernel: tuple[int, ...], x: ir.Value) -> Window:
    """The window of a ConvTranspose node as the window of its adjoint Conv.

    With ``output_shape`` or ``auto_pad=SAME_*`` the pads follow from the static input size:
    ``total = s * (D - 1) + output_padding + extent - output_shape`` (``output_shape = D * s``
    for ``SAME_*``), the odd element at the start except for ``SAME_UPPER``.
    """
    n = len(kernel)
    strides, dilations, auto_pad = steps_and_auto_pad(ctx, n)
    output_shape = ctx.attr("output_shape")
    if not output_shape and auto_pad in ("NOTSET", "VALID"):
        return explicit_window(ctx, kernel, strides, dilations, auto_pad)
    sizes = [size for size in spatial_dims(x, n) if size is not None]
    if len(sizes) < n:
        ctx.unsupported(
            "output_shape or auto_pad=SAME_* needs static spatial input dimensions to place the"
            f" padding, got input shape {x.shape}; export with explicit pads"
        )
    out_pad = ctx.attr("output_padding") or [0] * n
    targets = output_shape[-n:] if output_shape else [size * s for size, s in zip(sizes, strides)]
    begins, ends = [], []
    for size, k, s, d, op, target in zip(sizes, kernel, strides, dilations, out_pad, targets):
        total = s * (size - 1) + op + (k - 1) * d + 1 - target
        if total < 0:
            ctx.unsupported(
                f"output_shape {list(targets)} is larger than the transposed convolution's extent"
                " (negative padding); export with explicit pads and output_padding"
            )
        small = total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else total - small)
        ends.append(total - begins[-1])
    return Window(kernel, strides, dilations, tuple(begins), tuple(ends))


@register_gradient("ConvTranspose")
def conv_transpose(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradients of ``ConvTranspose(X, W[, B])``, the adjoint of ``Conv`` with weight ``W``.

    ``dL/dX = Conv(G, W)`` with the same window and groups; ``dL/dW`` is the Conv weight
    gradient with input ``G`` and output gradient ``X``; ``dL/dB`` sums ``G``.
    """
    return _conv_grads(ctx, grads, transposed=True)


@register_gradient("Col2Im", since=18)
def col2im(ctx: GradContext, grads: Sequence[ir.Value | None]) -> list[ir.Value | None]:
    """``y = Col2Im(x, image_shape, block_shape)`` adds column ``l`` of each channel's block
    offset ``k`` into the image at block ``l``'s position ``k`` (``torch.nn.functional.fold``):
    ``dx`` gathers those positions back from ``g`` zero-padded as the image was (the unfold of
    ``g``), one ``Gather`` over the padded image's flattened positions with a constant index."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    image, block = ctx.const_input(1), ctx.const_input(2)
    if image is None or block is None:
        ctx.unsupported(
            "image_shape or block_shape is computed at run time; the gradient needs them"
            " constant (as torch.nn.functional.fold writes them)"
        )
    image = [int(v) for v in np.asarray(image).reshape(-1)]
    block = [int(v) for v in np.asarray(block).reshape(-1)]
    k = len(image)
    dilations = [int(v) for v in ctx.attr("dilations", [1] * k)]
    pads = [int(v) for v in ctx.attr("pads", [0] * (2 * k))]
    strides = [int(v) for v in ctx.attr("strides", [1] * k)]
    padded = [image[d] + pads[d] + pads[d + k] for d in range(k)]
    blocks = [(padded[d] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(k)]
    if min(blocks) < 1:
        ctx.unsupported(f"no block of {block} fits the padded image {padded}")
    place = np.cumprod([1, *padded[::-1]])[:-1][::-1]  # flat stride of each padded axis
    offsets = np.indices(block).reshape(k, -1)  # [k, K], block offsets in row-major order
    starts = np.indices(blocks).reshape(k, -1)  # [k, L], block positions in row-major order
    at = sum(
        (offsets[d][:, None] * dilations[d] + starts[d][None, :] * strides[d]) * place[d]
        for d in range(k)
    )  # [K, L]: each (offset, block)'s flat position in the padded image
    if any(pads):
        g = b.Pad(g, b.ints([0, 0, *pads[:k], 0, 0, *pads[k:]]))
    flat = b.Reshape(g, b.ints([0, 0, -1]))
    cols = b.Gather(flat, b.const(np.asarray(at, np.int64)), axis=2)  # [N, C, K, L]
    return [b.Reshape(cols, b.ints([0, -1, int(at.shape[1])])), None, None]
