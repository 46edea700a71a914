"""``GridSample`` as the ops it is made of, so that the gradient rules of those ops give its
gradients with respect to the input and the grid.

A 2-D ``GridSample`` (a 4-D input) with linear or nearest interpolation reads, for each output
position, the input's values at the neighbouring integer positions of its grid point: each is
one ``GatherElements`` of the input flattened over its spatial axes, weighted by the bilinear
weights (``1 - frac`` and ``frac`` along each axis) and by whether the position lies inside
the input (``padding_mode="zeros"``). ``"border"`` clips the unnormalized coordinates into the
input first and ``"reflection"`` reflects them at its edges (at the corner pixels' centres with
``align_corners=1``, at their outer edges otherwise), as torch's ``grid_sample`` does. The
weights depend on the grid (the positions, through ``Floor`` and ``Round``, do not), which
gives the grid's gradient; the gather gives the input's (a ``ScatterElements`` sum).

Cubic interpolation and inputs of other ranks are left as they are (their gradient is then
reported as not implemented).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx_ir as ir

from traingraph.ir.builder import OpBuilder, rank

_DEFAULT_DOMAINS = ("", "ai.onnx")
_LINEAR = ("linear", "bilinear")


def lowerable(node: ir.Node) -> bool:
    """Whether ``node`` is a ``GridSample`` that :func:`lower_grid_sample` can write out."""
    if node.op_type != "GridSample" or node.domain not in _DEFAULT_DOMAINS:
        return False
    mode = node.attributes.get_string("mode", "")
    x = node.inputs[0]
    return (mode in (*_LINEAR, "nearest") or not mode) and x is not None and rank(x) == 4


def lower_grid_sample(b: OpBuilder, node: ir.Node) -> ir.Value:
    """Append the standard-op form of the ``GridSample`` ``node`` (see the module) to ``b``'s
    graph and return its output, which takes the place of the node's."""
    x, grid = node.inputs[0], node.inputs[1]
    assert x is not None and grid is not None
    mode = node.attributes.get_string("mode", "linear") or "linear"
    padding = node.attributes.get_string("padding_mode", "zeros")
    align = bool(node.attributes.get_int("align_corners", 0))
    grid = b.cast_like(grid, x) if grid.dtype != x.dtype else grid
    dims = b.Shape(x)
    height, width = (b.squeeze(b.cast_like(b.shape(x, a, a + 1), x), [0]) for a in (2, 3))
    points = [
        _source_coordinate(b, b.Gather(grid, b.ints([k]), axis=3), size, padding, align)
        for k, size in ((0, width), (1, height))
    ]  # (N, Ho, Wo, 1) each: the column, then the row
    batch_channels = b.Slice(dims, b.ints([0]), b.ints([2]))
    flat = b.Reshape(x, b.Concat(batch_channels, b.ints([-1]), axis=0))
    flat.type = x.type
    if x.shape is not None:
        flat.shape = ir.Shape([*x.shape.dims[:2], _product(x.shape.dims[2:])])
    one, zero = b.scalar(1.0, x), b.scalar(0.0, x)
    corners: list[tuple[list[ir.Value], ir.Value | None]]
    if mode == "nearest":
        corners = [([b.Round(p) for p in points], None)]
    else:
        # along each axis: the position below (weight 1 - frac) and the one above (frac)
        neighbours = []
        for p in points:
            below = b.Floor(p)
            frac = b.Sub(p, below)
            neighbours.append([(below, b.Sub(one, frac)), (b.Add(below, one), frac)])
        corners = [
            ([column, row], b.Mul(column_weight, row_weight))
            for row, row_weight in neighbours[1]
            for column, column_weight in neighbours[0]
        ]
    total: ir.Value | None = None
    for (column, row), weight in corners:
        inside = b.And(_within(b, column, width), _within(b, row, height))
        weight = b.cast_like(inside, x) if weight is None else b.Where(inside, weight, zero)
        position = b.Add(
            b.Mul(_clipped(b, row, height), width), _clipped(b, column, width)
        )  # (N, Ho, Wo, 1)
        index = b.Cast(b.Reshape(position, b.ints([0, 1, -1])), to=ir.DataType.INT64)
        index = b.Expand(index, b.Concat(batch_channels, b.ints([1]), axis=0))
        term = b.Mul(b.GatherElements(flat, index, axis=2), b.Reshape(weight, b.ints([0, 1, -1])))
        total = term if total is None else b.Add(total, term)
    assert total is not None
    out_dims = b.Concat(batch_channels, b.Slice(b.Shape(grid), b.ints([1]), b.ints([3])), axis=0)
    return b.Reshape(total, out_dims)


def _source_coordinate(
    b: OpBuilder, g: ir.Value, size: ir.Value, padding: str, align: bool
) -> ir.Value:
    """The input position that the normalized grid coordinate ``g`` (-1 to 1) reads along an
    axis of ``size`` positions, with the padding mode's clipping or reflection."""
    one, half = b.scalar(1.0, g), b.scalar(0.5, g)
    if align:  # -1 and 1 are the centres of the first and last positions
        position = b.Mul(b.Mul(b.Add(g, one), half), b.Sub(size, one))
    else:  # -1 and 1 are the outer edges of the first and last positions
        position = b.Mul(b.Sub(b.Mul(b.Add(g, one), size), one), half)
    if padding == "border":
        return b.Clip(position, b.scalar(0.0, g), b.Sub(size, one))
    if padding == "reflection":
        if align:
            position = _reflect(b, position, b.scalar(0.0, g), b.Sub(size, one))
        else:
            position = _reflect(b, position, b.scalar(-0.5, g), b.Sub(size, half))
        return b.Clip(position, b.scalar(0.0, g), b.Sub(size, one))
    return position


def _reflect(b: OpBuilder, p: ir.Value, low: ir.Value, high: ir.Value) -> ir.Value:
    """``p`` reflected at ``low`` and ``high`` until it lies between them (``low`` where
    they are equal)."""
    span = b.Sub(high, low)
    zero, two = b.scalar(0.0, p), b.scalar(2.0, p)
    safe_span = b.Where(b.Equal(span, zero), b.scalar(1.0, p), span)
    distance = b.Abs(b.Sub(p, low))
    flips = b.Floor(b.Div(distance, safe_span))
    extra = b.Sub(distance, b.Mul(flips, safe_span))
    odd = b.Sub(flips, b.Mul(two, b.Floor(b.Div(flips, two))))
    reflected = b.Where(b.Equal(odd, zero), b.Add(low, extra), b.Sub(high, extra))
    return b.Where(b.Equal(span, zero), b.Expand(low, b.Shape(p)), reflected)


def _within(b: OpBuilder, p: ir.Value, size: ir.Value) -> ir.Value:
    """Whether the integer position ``p`` lies in ``[0, size)``."""
    return b.And(
        b.GreaterOrEqual(p, b.scalar(0.0, p)), b.LessOrEqual(p, b.Sub(size, b.scalar(1.0, p)))
    )


def _clipped(b: OpBuilder, p: ir.Value, size: ir.Value) -> ir.Value:
    """``p`` clipped into ``[0, size - 1]`` (a position read where the weight is 0)."""
    return b.Clip(p, b.scalar(0.0, p), b.Sub(size, b.scalar(1.0, p)))


def _product(dims: Sequence[int | ir.SymbolicDim]) -> int | None:
    """The product of ``dims`` where all are known, else None (an unknown dimension)."""
    sizes = [d for d in dims if isinstance(d, int)]
    return math.prod(sizes) if len(sizes) == len(dims) else None
