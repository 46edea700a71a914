"""Gradients of ops that move elements without changing their values.

Each of these ops is a permutation, a copy or a selection of its input's elements, so each
gradient is the adjoint data movement: reshape back, transpose by the inverse permutation, split
what was concatenated, concatenate what was split, or sum the copies that broadcasting and tiling
made. Inputs that describe the movement (shapes, axes, repeats, split sizes) get no gradient;
they may be constants or computed at run time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import rank, static_shape

Grads = Sequence[ir.Value | None]


def restore_shape(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """The gradient of an op that only changes the shape: reshape ``g`` back to the input's."""
    return [ctx.b.reshape_like(ctx.grad_or_zeros(grads, 0), ctx.x(0))]


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    register_gradient(_op)(restore_shape)


@register_gradient("Transpose")
def transpose(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``dx = Transpose(g, argsort(perm))``; the default perm (reversal) is its own inverse."""
    g, perm = ctx.grad_or_zeros(grads, 0), ctx.attr("perm")
    if perm is None:
        return [ctx.b.Transpose(g)]
    return [ctx.b.Transpose(g, perm=[int(p) for p in np.argsort(perm)])]


def static_dim(x: ir.Value, axis: int) -> int | None:
    """Dimension ``axis`` (negative counts from the end) of ``x`` when it is a known int."""
    if x.shape is None or not -len(x.shape) <= axis < len(x.shape):
        return None
    dim = x.shape.dims[axis]
    return dim if isinstance(dim, int) else None


def dim_vector(ctx: GradContext, x: ir.Value, axis: int) -> ir.Value:
    """Dimension ``axis`` of ``x`` as a 1-D int64 tensor of one element (constant when known)."""
    dim = static_dim(x, axis)
    if dim is not None:
        return ctx.b.ints([dim])
    return ctx.b.Gather(ctx.b.shape(x), ctx.b.ints([axis]))


@register_gradient("Concat")
def concat(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Split ``g`` along ``axis`` into pieces the sizes of the inputs."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    axis = int(ctx.attr("axis"))
    xs = [ctx.x(i) for i in range(len(ctx.inputs))]
    if len(xs) == 1:
        return [g]
    sizes = [static_dim(x, axis) for x in xs]
    known = [s for s in sizes if s is not None]
    if len(known) == len(xs):
        pieces = b.split(g, known, axis=axis)
    else:
        split = b.Concat(*[dim_vector(ctx, x, axis) for x in xs], axis=0)
        pieces = b.op("Split", g, split, axis=axis, num_outputs=len(xs))
    return [piece if ctx.need(i) else None for i, piece in enumerate(pieces)]


@register_gradient("Split")
def split(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Concatenate the output gradients (zeros for unused outputs) along ``axis``."""
    pieces = [ctx.grad_or_zeros(grads, k) for k in range(len(ctx.outputs))]
    axis = int(ctx.attr("axis", 0))
    if len(pieces) == 1:
        return [pieces[0]]
    return [ctx.b.Concat(*pieces, axis=axis)]


@register_gradient("Expand")
def expand(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Sum ``g`` over the broadcast axes back to the input's shape."""
    return [ctx.unbroadcast(ctx.grad_or_zeros(grads, 0), ctx.x(0)), None]


@register_gradient("Tile")
def tile(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Sum the tiled copies.

    With ``x`` of shape ``[d0, ..., dn]`` and repeats ``[r0, ..., rn]``, output index
    ``k * d_i + j`` along axis ``i`` is copy ``k`` of ``x``'s index ``j``, so
    ``dx = ReduceSum(Reshape(g, [r0, d0, ..., rn, dn]), axes=[0, 2, ..., 2n])``.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    n = rank(x)
    if n is None:
        ctx.unsupported("the input's rank is unknown; give the input a shape with a known rank")
    if n == 0:
        return [g, None]
    repeats = ctx.const_input(1)
    dims = static_shape(x)
    if repeats is not None and dims is not None:
        interleaved = b.ints([v for pair in zip(repeats.reshape(-1).tolist(), dims) for v in pair])
    else:
        reps = b.ints(repeats.reshape(-1).tolist()) if repeats is not None else ctx.x(1)
        pairs = b.Concat(b.unsqueeze(reps, [1]), b.unsqueeze(b.shape(x), [1]), axis=1)
        interleaved = b.Reshape(pairs, b.ints([-1]))
    summed = b.sum(b.Reshape(g, interleaved), list(range(0, 2 * n, 2)), keepdims=False)
    return [summed, None]


def _block_size(ctx: GradContext) -> int:
    block = ctx.attr("blocksize")
    if block is None:
        ctx.unsupported("the blocksize attribute is missing")
    return int(block)


@register_gradient("SpaceToDepth")
def space_to_depth(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """SpaceToDepth is a permutation whose inverse is ``DepthToSpace`` in ``DCR`` mode."""
    g = ctx.grad_or_zeros(grads, 0)
    return [ctx.b.DepthToSpace(g, blocksize=_block_size(ctx), mode="DCR")]


@register_gradient("DepthToSpace")
def depth_to_space(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Undo the permutation.

    ``DCR`` is inverted by ``SpaceToDepth``. ``CRD`` views ``x`` as ``[N, C', b, b, H, W]`` and
    transposes it by ``[0, 1, 4, 2, 5, 3]`` into ``[N, C', H, b, W, b]``; the gradient views ``g``
    that way and applies the inverse permutation ``[0, 1, 3, 5, 2, 4]``.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    block = _block_size(ctx)
    mode = ctx.attr("mode", "DCR")
    if mode == "DCR":
        return [b.SpaceToDepth(g, blocksize=block)]
    if mode != "CRD":
        ctx.unsupported(f"mode={mode!r} is not a DepthToSpace mode; expected 'DCR' or 'CRD'")
    blocks = b.Concat(b.ints([0, 0]), dim_vector(ctx, x, 2), b.ints([block, -1, block]), axis=0)
    moved = b.Transpose(b.Reshape(g, blocks), perm=[0, 1, 3, 5, 2, 4])
    return [b.reshape_like(moved, x)]
