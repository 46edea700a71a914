"""Gradients of ops that select, scatter, pad, mask, accumulate or resample elements.

Every op here is linear in its data input, so each gradient applies the adjoint (transposed)
map to the output gradient ``g``:

- selections (Slice, Gather, GatherElements, GatherND, TopK) scatter ``g`` back to the selected
  positions, adding where a position was selected more than once;
- scatters (ScatterElements, ScatterND) pass ``g`` to the data and gather it for the updates;
- Pad crops ``g`` (constant mode) or sums the reflected / replicated copies;
- Trilu masks ``g``, CumSum accumulates it in the opposite direction;
- Resize contracts ``g`` with the transposed per-axis interpolation matrices.

Selections find the positions they picked by applying the forward op itself to an ``iota``
tensor (each element holding its own flat position), which covers negative indices, steps and
run-time shapes in one stroke. Index, axis, shape and pad inputs get no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.autodiff.rules.shape import static_dim
from traingraph.ir.builder import OpBuilder, rank, static_shape
from traingraph.ir.fold import Dim, partial_value, slice_inputs

Grads = Sequence[ir.Value | None]

# ScatterND / ScatterElements accept ``reduction="add"`` from this opset on.
_SCATTER_REDUCTION_SINCE = 16


def _int64(b: OpBuilder, value: ir.Value) -> ir.Value:
    return value if value.dtype == ir.DataType.INT64 else b.cast(value, ir.DataType.INT64)


def _known_rank(ctx: GradContext, value: ir.Value, what: str) -> int:
    r = rank(value)
    if r is None:
        ctx.unsupported(f"the rank of {what} is unknown; give it a shape with a known rank")
    return r


def _dim_scalar(b: OpBuilder, x: ir.Value, axis: int) -> ir.Value:
    """Dimension ``axis`` of ``x`` as a scalar int64 (a constant when known)."""
    dim = static_dim(x, axis)
    if dim is not None:
        return b.const(np.int64(dim))
    return b.Gather(b.shape(x), b.const(np.int64(axis)))


def _iota(b: OpBuilder, x: ir.Value) -> ir.Value:
    """An int64 tensor of ``x``'s shape whose elements are their own flat (row-major) positions."""
    flat = b.Range(b.const(np.int64(0)), b.op("Size", x), b.const(np.int64(1)))
    return b.reshape_like(flat, x)


def _flat(b: OpBuilder, value: ir.Value) -> ir.Value:
    return b.Reshape(value, b.ints([-1]))


def _zeros(b: OpBuilder, shape: ir.Value, like: ir.Value) -> ir.Value:
    """Zeros of the run-time ``shape`` and ``like``'s dtype."""
    return b.Expand(b.scalar(0.0, like), shape)


SMALL_TABLE_ROWS = 8
"""Up to this many rows (a static count), :func:`scatter_add_rows` selects each row's updates
with a ``Where`` and sums them, instead of scattering: token-type and other small embedding
tables, where onnxruntime's CPU ScatterElements adds thousands of rows into two one element
at a time on one thread."""


def scatter_add_rows(
    ctx: GradContext,
    rows_shape: ir.Value,
    index: ir.Value,
    updates: ir.Value,
    depth: int | None = None,
) -> ir.Value:
    """Zeros of shape ``rows_shape = [D, *rest]`` with ``updates[i]`` added to row ``index[i]``.

    ``index`` (int64, any shape, values in ``[0, D)``) may repeat a row; repeats accumulate.
    ``updates`` has shape ``index.shape + rest``. From opset 16 this is ``ScatterElements``
    with ``reduction="add"`` on axis 0 of ``updates`` flattened to ``[M, R]`` (``M =
    index.size``, ``R = prod(rest)``), each row's index repeated across it; before, it is
    ``onehot(index)^T @ updates`` with a ``[M, D]`` one-hot matrix, which also accumulates.
    ``ScatterND`` with ``reduction="add"`` would take the rows as they are, but onnxruntime's
    CPU kernel adds rows from several threads without ordering them, so that updates of one
    row are lost when the index repeats it (an embedding's gradient; ``tests/autodiff/rules/
    test_rules_indexing.py`` shows it), and its CUDA kernel gives each index one thread block.
    Where ``depth``, the static ``D``, is at most :data:`SMALL_TABLE_ROWS`, row ``d`` is the sum
    over ``i`` of ``Where(index[i] == d, updates[i], 0)``: the same terms, each update reaching
    its own row only (a NaN too), summed in another order.
    """
    b, like = ctx.b, ctx.x(0)
    if depth is not None and depth <= SMALL_TABLE_ROWS:
        flat = _flat(b, index)
        rows = b.Reshape(updates, b.Concat(b.shape(flat), b.ints([-1]), axis=0))
        table = b.const(np.arange(depth, dtype=np.int64).reshape(1, depth))
        mask = b.unsqueeze(b.Equal(b.unsqueeze(flat, [1]), table), [2])
        picked = b.Where(mask, b.unsqueeze(rows, [1]), b.scalar(0.0, like))
        summed = b.sum(picked, [0], keepdims=False)
        return summed if rank(like) == 2 else b.Reshape(summed, rows_shape)
    if b.opset >= _SCATTER_REDUCTION_SINCE:
        flat = _flat(b, index)
        rows = b.Reshape(updates, b.Concat(b.shape(flat), b.ints([-1]), axis=0))
        first = b.slice(rows_shape, [0], [1], [0])
        base = _zeros(b, b.Concat(first, b.shape(rows, 1, 2), axis=0), like)
        positions = b.Expand(b.unsqueeze(flat, [1]), b.shape(rows))
        summed = b.ScatterElements(base, positions, rows, axis=0, reduction="add")
        if rank(like) == 2:  # already [D, R]
            return summed
        return b.Reshape(summed, rows_shape)
    column = b.Reshape(index, b.ints([-1, 1]))
    depth = b.Gather(rows_shape, b.const(np.int64(0)))
    rows = b.Range(b.const(np.int64(0)), depth, b.const(np.int64(1)))
    onehot = b.cast_like(b.Equal(column, rows), like)
    matrix = b.Reshape(updates, b.Concat(b.shape(column, 0, 1), b.ints([-1]), axis=0))
    summed = b.MatMul(b.Transpose(onehot, perm=[1, 0]), matrix)
    return b.Reshape(summed, rows_shape)


def _scatter_flat(ctx: GradContext, positions: ir.Value, g: ir.Value) -> ir.Value:
    """Place ``g`` at the distinct flat ``positions`` of a zero tensor shaped like the input."""
    b, x = ctx.b, ctx.x(0)
    flat = b.ScatterElements(_flat(b, b.zeros_like(x)), _flat(b, positions), _flat(b, g), axis=0)
    return b.reshape_like(flat, x)


@register_gradient("Slice")
def slice_(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Zero-pad ``g`` back to the input's shape; where that cannot be written, scatter it.

    A unit-step Slice takes ``x[start:end]`` along each sliced axis, so its adjoint pads
    ``start`` zeros before and ``D - end`` after (bounds resolved and clamped as Slice does):
    constants where the bounds and lengths are known (:func:`_padded_slice_grad`, which also
    spreads ``g`` for constant positive steps), else computed when the step runs
    (:func:`_run_time_slice_pads`). Otherwise (negative, unknown or run-time steps, an empty
    slice) the positions are ``Slice(iota(x), starts, ends, axes, steps)``, handled exactly as
    the forward op handles them.
    """
    b = ctx.b
    g = ctx.grad_or_zeros(grads, 0)
    padded = _padded_slice_grad(ctx, g)
    if padded is not None:
        return [padded]
    pads = _run_time_slice_pads(ctx)
    if pads is not None:
        return [b.op("Pad", g, pads)]
    positions = b.Slice(_iota(b, ctx.x(0)), *ctx.inputs[1:])
    return [_scatter_flat(ctx, positions, g)]


def _resolved(bound: int, size: int) -> int:
    """A Slice bound resolved (negative counts from ``size``) and clamped to ``[0, size]``."""
    return min(max(bound + size if bound < 0 else bound, 0), size)


def _padded_slice_grad(ctx: GradContext, g: ir.Value) -> ir.Value | None:
    """The adjoint of a non-empty Slice with constant bounds, positive steps and static sliced
    lengths, without a scatter; None where it does not apply.

    Along an axis sliced as ``x[start:end:step]`` (``n`` elements) with ``step > 1``, ``g`` is
    interleaved with ``step - 1`` zeros after each element (an Unsqueeze, a Pad of the new axis
    to ``step``, a Reshape merging the two: ``n * step`` elements, ``g[i]`` at ``i * step``)
    and cut to the ``D - start`` elements from ``start`` on (only zeros go: the last element
    sits below ``end``). Then one Pad puts ``start`` zeros before and what is left of ``D``
    after, on every sliced axis. Torch's ``x[:, 0::2, 1::2]`` (Swin's patch merging) is two
    interleavings and one Pad; ``x[:, 1:]`` one Pad; a Slice that keeps everything ``g``.
    """
    b, x = ctx.b, ctx.x(0)
    r, args = rank(x), slice_inputs(ctx.node)
    if r is None or args is None:
        return None
    pads = [0] * (2 * r)
    dims: list[int | None] = [None] * r
    if g.shape is not None and len(g.shape) == r:
        dims = [d if isinstance(d, int) else None for d in g.shape.dims]
    for start, end, axis, step in zip(*args):
        axis %= r
        size = static_dim(x, axis)
        if size is None or step <= 0:
            return None
        start, end = _resolved(start, size), _resolved(end, size)
        count = -(-(end - start) // step)
        if count <= 0:
            return None  # an empty slice: its gradient is zeros, which the scatter gives
        if step > 1:
            spread = _interleave_zeros(b, g, dims, axis, count, step)
            if spread is None:
                return None
            g = spread
            if count * step > size - start:
                g = b.Slice(g, b.ints([0]), b.ints([size - start]), b.ints([axis]))
        kept = min(count * step, size - start)
        dims[axis] = kept
        pads[axis], pads[axis + r] = start, size - start - kept
    return g if not any(pads) else b.op("Pad", g, b.ints(pads))


def _interleave_zeros(
    b: OpBuilder, g: ir.Value, dims: list[int | None], axis: int, count: int, step: int
) -> ir.Value | None:
    """``g`` (of dimensions ``dims``, None where not static) with ``step - 1`` zeros after
    each of its ``count`` elements along ``axis``, or None where the dimensions after ``axis``
    leave the Reshape's target unknown."""
    trailing = dims[axis + 1 :]
    if trailing.count(None) > 1:
        return None
    r = len(dims)
    pads = [0] * (2 * (r + 1))
    pads[r + 1 + axis + 1] = step - 1
    spread = b.op("Pad", b.unsqueeze(g, [axis + 1]), b.ints(pads))
    target = [0] * axis + [count * step] + [-1 if d is None else d for d in trailing]
    return b.Reshape(spread, b.ints(target))


def _run_time_slice_pads(ctx: GradContext) -> ir.Value | None:
    """Pad's ``pads`` that undo a unit-step Slice whose bounds or sliced lengths are known only
    when the step runs, computed then; None where a step is not 1, the axes or the rank are
    not known, or everything is known (:func:`_padded_slice_grad`'s case).

    ``start`` and ``end`` are resolved (negative ones count from ``D``) and clamped to
    ``[0, D]`` as Slice does; the adjoint pads ``start`` before and ``D - max(end, start)``
    after.
    """
    b, x = ctx.b, ctx.x(0)
    r = rank(x)
    starts, ends, axes, steps = [
        ctx.const_input(i) if ctx.has_input(i) else None for i in range(1, 5)
    ]
    if r is None or (ctx.has_input(3) and axes is None) or (ctx.has_input(4) and steps is None):
        return None
    if steps is not None and any(int(step) != 1 for step in np.ravel(steps)):
        return None
    if axes is None:
        count = static_dim(ctx.x(1), 0) if starts is None else np.size(starts)
        if count is None:
            return None
        axes = np.arange(count)
    axes = [int(a) % r for a in np.ravel(axes)]
    if starts is not None and ends is not None and None not in [static_dim(x, a) for a in axes]:
        return None
    dims = b.Gather(b.shape(x), b.ints(axes))
    zero = b.const(np.int64(0))

    def resolve(bound: ir.Value) -> ir.Value:
        bound = _int64(b, bound)
        bound = b.Where(b.Less(bound, zero), b.Add(bound, dims), bound)
        return b.Min(b.Max(bound, zero), dims)

    start = resolve(ctx.x(1))
    after = b.Sub(dims, b.Max(resolve(ctx.x(2)), start))
    pieces = []
    for side in (start, after):
        for axis in range(r):
            if axis in axes:
                pieces.append(b.Gather(side, b.ints([axes.index(axis)])))
            else:
                pieces.append(b.ints([0]))
    return b.Concat(*pieces, axis=0)


PADDING_IDX_KEY = "traingraph.padding_idx"
"""The node metadata key of a ``Gather`` of table rows whose row of this index gets no gradient
(``torch.nn.Embedding(padding_idx=...)``, which an ONNX export writes as a plain Gather;
:func:`traingraph.from_torch` tags those Gathers)."""
SCALE_BY_FREQUENCY_KEY = "traingraph.scale_grad_by_freq"
"""The node metadata key (value ``"1"``) of a ``Gather`` of table rows whose gradient for each
looked-up position is divided by how often its row is looked up in the batch
(``torch.nn.Embedding(scale_grad_by_freq=True)``)."""


@register_gradient("Gather")
def gather(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Add each gradient slice into the row of ``x`` it was gathered from.

    With ``x`` moved so that ``axis`` comes first (``x'``) and ``g`` moved so that the index
    dimensions come first (``g'``): ``dx'[d] = sum_{i: index[i] = d} g'[i]``.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    g = _by_frequency(ctx, _without_padding_row(ctx, g))
    padded = _gather_pads(ctx)
    if padded is not None:
        pads, axis = padded
        if np.ndim(ctx.const_input(1)) == 0:
            g = b.unsqueeze(g, [axis])
        return [b.op("Pad", g, b.ints(pads))]
    if int(ctx.attr("axis", 0)) == 0:
        # Axis 0 needs no rank: the rows are the first dimension whatever follows.
        index, _ = _looked_up_rows(ctx)
        return [scatter_add_rows(ctx, b.shape(x), index, g, static_dim(x, 0))]
    r = _known_rank(ctx, x, "the data input")
    axis = int(ctx.attr("axis", 0)) % r
    index = b.Mod(_int64(b, ctx.x(1)), _dim_scalar(b, x, axis))
    if axis == 0:
        return [scatter_add_rows(ctx, b.shape(x), index, g, static_dim(x, 0))]
    q = _known_rank(ctx, ctx.x(1), "the indices")
    perm_x = [axis, *range(axis), *range(axis + 1, r)]
    perm_g = [*range(axis, axis + q), *range(axis), *range(axis + q, r - 1 + q)]
    rows_shape = b.Gather(b.shape(x), b.ints(perm_x))
    rows = scatter_add_rows(
        ctx, rows_shape, index, b.Transpose(g, perm=perm_g), static_dim(x, axis)
    )
    return [b.Transpose(rows, perm=[int(p) for p in np.argsort(perm_x)])]


def _without_padding_row(ctx: GradContext, g: ir.Value) -> ir.Value:
    """``g`` with zeros where the Gather read the row its :data:`PADDING_IDX_KEY` names (axis
    0 only), so that row's gradient is zero and no other row's changes, as in torch's
    embedding backward (a NaN or infinity read for that row is dropped too); ``g`` itself
    where the node has no such tag."""
    pad = ctx.node.metadata_props.get(PADDING_IDX_KEY)
    if pad is None or int(ctx.attr("axis", 0)) != 0:
        return g
    b = ctx.b
    index, rows = _looked_up_rows(ctx)
    hit = b.Equal(index, b.Mod(b.const(np.int64(int(pad))), rows))
    return b.Where(_per_lookup(ctx, hit), b.scalar(0.0, g), g)


def _by_frequency(ctx: GradContext, g: ir.Value) -> ir.Value:
    """``g`` times the reciprocal of how many positions of the index read each position's row,
    where the Gather is tagged with :data:`SCALE_BY_FREQUENCY_KEY` (axis 0 only), as torch's
    embedding backward scales it; ``g`` itself otherwise."""
    if ctx.node.metadata_props.get(SCALE_BY_FREQUENCY_KEY) != "1" or int(ctx.attr("axis", 0)):
        return g
    b, x = ctx.b, ctx.x(0)
    index, rows = _looked_up_rows(ctx)
    ones = b.Expand(b.scalar(1.0, g), b.shape(index))
    counts = scatter_add_rows(ctx, b.unsqueeze(rows, [0]), index, ones, static_dim(x, 0))
    scale = b.Reciprocal(b.Gather(b.Reshape(counts, b.ints([-1])), index))
    return b.Mul(g, _per_lookup(ctx, scale))


def _looked_up_rows(ctx: GradContext) -> tuple[ir.Value, ir.Value]:
    """The row each position of an axis-0 Gather's index reads (negative indices resolved),
    and the number of rows."""
    b = ctx.b
    rows = _dim_scalar(b, ctx.x(0), 0)
    return b.Mod(_int64(b, ctx.x(1)), rows), rows


def _per_lookup(ctx: GradContext, value: ir.Value) -> ir.Value:
    """``value``, one element per index position, unsqueezed over the row's own dimensions,
    which follow the index's in the Gather's output and gradient."""
    r = _known_rank(ctx, ctx.x(0), "the data input")
    return ctx.b.unsqueeze(value, list(range(1 - r, 0))) if r > 1 else value


def _gather_pads(ctx: GradContext) -> tuple[list[int], int] | None:
    """Pad's ``pads`` and the axis, where a Gather picks one constant position or a constant
    run of neighbouring ones, in order, along a static axis (``qkv[0]``, ``x[:, 0]``, a range
    of rows); else None.

    The gradient is then ``g`` zero-padded on that axis (unsqueezed first for one position):
    one pass, where the general scatter with accumulation is slow on some providers
    (onnxruntime's CUDA ScatterND with ``reduction="add"`` runs one index per thread block,
    so a single index of a large slice is one block's work).
    """
    x = ctx.x(0)
    r = rank(x)
    index = ctx.const_input(1)
    if r is None or index is None or np.ndim(index) > 1:
        return None
    axis = int(ctx.attr("axis", 0)) % r
    size = static_dim(x, axis)
    if size is None:
        return None
    positions = np.asarray(index, np.int64).reshape(-1)
    if positions.size == 0 or np.any(positions < -size) or np.any(positions >= size):
        return None
    positions = positions % size
    if np.any(np.diff(positions) != 1):
        return None
    pads = [0] * (2 * r)
    pads[axis], pads[axis + r] = int(positions[0]), size - 1 - int(positions[-1])
    return pads, axis


@register_gradient("GatherElements")
def gather_elements(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``dx[..., d, ...] = sum over i with index[..., i, ...] = d of g[..., i, ...]`` along axis.

    From opset 16 this is ``ScatterElements`` with ``reduction="add"``. Before, it compares the
    index with ``0..D-1`` on a new axis (a one-hot tensor of ``index.size * D`` elements),
    weights ``g`` with it and sums over the index axis, then zero-pads up to ``x``'s shape where
    the index is smaller than ``x`` in the other axes.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    r = _known_rank(ctx, x, "the data input")
    axis = int(ctx.attr("axis", 0)) % r
    depth = _dim_scalar(b, x, axis)
    index = b.Mod(_int64(b, ctx.x(1)), depth)
    if b.opset >= _SCATTER_REDUCTION_SINCE:
        return [b.ScatterElements(b.zeros_like(x), index, g, axis=axis, reduction="add")]
    rows = b.Range(b.const(np.int64(0)), depth, b.const(np.int64(1)))
    rows = b.Reshape(rows, b.ints([-1] + [1] * (r - axis)))
    onehot = b.cast_like(b.Equal(b.unsqueeze(index, [axis]), rows), x)
    summed = b.sum(b.Mul(onehot, b.unsqueeze(g, [axis])), [axis + 1], keepdims=False)
    x_dims, i_dims = static_shape(x), static_shape(ctx.x(1))
    if x_dims is not None and i_dims is not None and all(
        a == c for k, (a, c) in enumerate(zip(x_dims, i_dims)) if k != axis
    ):
        return [summed]
    pads = b.Concat(b.ints([0] * r), b.Sub(b.shape(x), b.shape(summed)), axis=0)
    return [b.Pad(summed, pads)]


@register_gradient("GatherND")
def gather_nd(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Add each gathered slice back at its position, for any ``batch_dims``.

    With ``K`` the last index dimension, the leading ``batch_dims + K`` axes of ``x`` are
    flattened into rows; the row each slice came from is ``GatherND(iota, index, batch_dims)``
    over an ``iota`` of those leading dimensions, and the slices are then added into the rows.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    batch_dims = int(ctx.attr("batch_dims", 0))
    index = ctx.x(1)
    shape = b.shape(x)
    lead_rank = b.Add(b.ints([batch_dims]), b.shape(index, -1))
    lead = b.Slice(shape, b.ints([0]), lead_rank)
    rest = b.Slice(shape, lead_rank, b.ints([2**62]))
    count = b.reduce("ReduceProd", lead, [0], keepdims=True)
    iota = b.Reshape(
        b.Range(b.const(np.int64(0)), b.squeeze(count, [0]), b.const(np.int64(1))), lead
    )
    rows = b.GatherND(iota, index, batch_dims=batch_dims)
    summed = scatter_add_rows(ctx, b.Concat(count, rest, axis=0), rows, g)
    return [b.reshape_like(summed, x)]


def _reduction(ctx: GradContext, supported: tuple[str, ...] = ("none", "add")) -> str:
    reduction = ctx.attr("reduction", "none")
    if reduction not in supported:
        ctx.unsupported(
            f"reduction={reduction!r} has no gradient rule; {', '.join(map(repr, supported))}"
            " are supported"
        )
    return reduction


@register_gradient("ScatterElements")
def scatter_elements(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``d data = g`` (with the overwritten positions zeroed when ``reduction="none"``);
    ``d updates = GatherElements(g, indices, axis)``. With ``reduction="max"`` or ``"min"``
    (``scatter_reduce`` with ``"amax"`` / ``"amin"``) the gradient of each output goes to the
    data element and the updates that equal it, shared evenly among them, as torch shares it."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    reduction = _reduction(ctx, ("none", "add", "max", "min"))
    axis = int(ctx.attr("axis", 0))
    index = ctx.x(1)
    if reduction in ("max", "min"):
        return _scatter_extremum(ctx, g, index, axis)
    d_data = d_updates = None
    if ctx.need(0):
        d_data = g
        if reduction == "none":
            d_data = b.ScatterElements(g, index, b.zeros_like(ctx.x(2)), axis=axis)
    if ctx.need(2):
        d_updates = b.GatherElements(g, index, axis=axis)
    return [d_data, None, d_updates]


def _scatter_extremum(
    ctx: GradContext, g: ir.Value, index: ir.Value, axis: int
) -> list[ir.Value | None]:
    """The gradient of ``y = ScatterElements(data, index, updates, reduction=max|min)``:
    ``share = g / (data == y) + sum over the updates at each position of (update == y)``, then
    ``d data = (data == y) * share`` and ``d updates = (updates == y at their position) *
    share at their position``."""
    b, data, updates, y = ctx.b, ctx.x(0), ctx.x(2), ctx.outputs[0]
    data_is = b.cast_like(b.Equal(data, y), data)
    update_is = b.cast_like(b.Equal(updates, b.GatherElements(y, index, axis=axis)), updates)
    count = b.ScatterElements(data_is, index, update_is, axis=axis, reduction="add")
    share = b.Div(g, count)
    d_data = b.Mul(data_is, share) if ctx.need(0) else None
    d_updates = b.Mul(update_is, b.GatherElements(share, index, axis=axis)) if ctx.need(2) else None
    return [d_data, None, d_updates]


@register_gradient("ScatterND")
def scatter_nd(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``d data = g`` (with the overwritten slices zeroed when ``reduction="none"``);
    ``d updates = GatherND(g, indices)``."""
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    reduction = _reduction(ctx)
    index = ctx.x(1)
    d_data = d_updates = None
    if ctx.need(0):
        d_data = g
        if reduction == "none":
            d_data = b.ScatterND(g, index, b.zeros_like(ctx.x(2)))
    if ctx.need(2):
        d_updates = b.GatherND(g, index)
    return [d_data, None, d_updates]


@register_gradient("TopK")
def top_k(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Scatter the values' gradient to the (distinct) selected indices along ``axis``."""
    b, x = ctx.b, ctx.x(0)
    g = ctx.grad_or_zeros(grads, 0)
    axis = int(ctx.attr("axis", -1))
    return [b.ScatterElements(b.zeros_like(x), ctx.outputs[1], g, axis=axis)]


@register_gradient("Trilu")
def trilu(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Trilu masks its input, so the gradient is ``g`` under the same mask."""
    k = ctx.inputs[1] if ctx.has_input(1) else None
    g = ctx.grad_or_zeros(grads, 0)
    return [ctx.b.op("Trilu", g, k, upper=int(ctx.attr("upper", 1)))]


@register_gradient("CumSum")
def cum_sum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """``y_i = sum_{j <= i} x_j`` gives ``dx_j = sum_{i >= j} g_i``: the same CumSum, reversed.

    The ``exclusive`` attribute carries over unchanged.
    """
    reverse = int(ctx.attr("reverse", 0))
    exclusive = int(ctx.attr("exclusive", 0))
    g = ctx.grad_or_zeros(grads, 0)
    return [ctx.b.CumSum(g, ctx.x(1), exclusive=exclusive, reverse=1 - reverse)]


def contract_axis(b: OpBuilder, g: ir.Value, matrix: ir.Value, axis: int, r: int) -> ir.Value:
    """``out[..., i, ...] = sum_o matrix[o, i] * g[..., o, ...]`` along ``axis`` of ``g``.

    This is the adjoint of applying the ``[D_out, D_in]`` ``matrix`` along ``axis`` of a
    rank-``r`` tensor.
    """
    if axis == r - 1:
        return b.MatMul(g, matrix)
    if axis == r - 2:
        return b.MatMul(b.Transpose(matrix, perm=[1, 0]), g)
    perm = list(range(r))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return b.Transpose(b.MatMul(b.Transpose(g, perm=perm), matrix), perm=perm)


def _axes_input(ctx: GradContext, i: int, r: int) -> list[int]:
    """The constant axes input ``i`` (all ``r`` axes when absent), made non-negative."""
    if not ctx.has_input(i):
        return list(range(r))
    axes = ctx.const_input(i)
    if axes is None:
        ctx.unsupported(f"input {i} (axes) is computed at run time; make it a constant")
    return [int(a) % r for a in axes.reshape(-1)]


@register_gradient("Pad")
def pad(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Crop in ``constant`` mode; sum the copies in ``reflect``, ``edge`` and ``wrap`` modes.

    ``constant``: ``dx = Pad(g, -pads)`` (negative pads crop, and the cropping that negative
    forward pads did becomes zero padding); the constant value gets the sum of ``g`` over the
    padding. Other modes are separable: along each padded axis, ``y = A x`` with the 0/1 matrix
    ``A[o, i] = [src(o) = i]``, where ``src = Pad(0..D-1, pads of that axis, mode)``; so
    ``dx`` contracts ``g`` with each ``A`` in turn.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    mode = ctx.attr("mode", "constant")
    pads = ctx.x(1)
    axes = ctx.inputs[3] if ctx.has_input(3) else None
    if mode == "constant":
        dx = b.op("Pad", g, b.Neg(pads), *([None, axes] if axes is not None else []))
        if not ctx.need(2):
            return [dx]
        padding = b.Sub(b.sum(g, keepdims=False), b.sum(dx, keepdims=False))
        return [dx, None, b.reshape_like(padding, ctx.x(2))]
    if mode not in ("reflect", "edge", "wrap"):
        ctx.unsupported(
            f"mode={mode!r} is not a Pad mode; expected constant, reflect, edge or wrap"
        )
    r = _known_rank(ctx, x, "the data input")
    axes_list = _axes_input(ctx, 3, r)
    pad_values = ctx.const_input(1)
    for j, axis in enumerate(axes_list):
        if pad_values is not None:
            begin, end = int(pad_values[j]), int(pad_values[j + len(axes_list)])
            if begin == end == 0:
                continue
            axis_pads = b.ints([begin, end])
        else:
            axis_pads = b.Gather(pads, b.ints([j, j + len(axes_list)]))
        rows = b.Range(b.const(np.int64(0)), _dim_scalar(b, x, axis), b.const(np.int64(1)))
        source = b.Pad(rows, axis_pads, mode=mode)
        matrix = b.cast_like(b.Equal(b.unsqueeze(source, [1]), rows), x)
        g = contract_axis(b, g, matrix, axis, r)
    return [g]


def _source_coordinates(
    mode: str, out_dim: int, in_dim: int, scale: float, roi: tuple[float, float]
) -> np.ndarray:
    """Input coordinate of each output position along one axis (ONNX ``Resize`` formulas)."""
    y = np.arange(out_dim, dtype=np.float64)
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if out_dim > 1 else np.full(out_dim, -0.5)
    if mode == "align_corners":
        return y * (in_dim - 1) / (out_dim - 1) if out_dim > 1 else np.zeros(out_dim)
    if mode == "asymmetric":
        return y / scale
    if mode == "half_pixel_symmetric":
        offset = in_dim / 2 * (1 - out_dim / (scale * in_dim))
        return offset + (y + 0.5) / scale - 0.5
    start, end = roi
    if out_dim == 1:
        return np.full(out_dim, (end - start) * (in_dim - 1) / 2 + start * (in_dim - 1))
    return start * (in_dim - 1) + y * (end - start) * (in_dim - 1) / (out_dim - 1)


def _cubic_weight(t: np.ndarray, a: float) -> np.ndarray:
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def interpolation_matrix(
    in_dim: int,
    out_dim: int,
    scale: float,
    *,
    mode: str,
    coordinates: str,
    nearest_mode: str = "round_prefer_floor",
    cubic_coeff_a: float = -0.75,
    exclude_outside: bool = False,
    roi: tuple[float, float] = (0.0, 1.0),
) -> np.ndarray:
    """The ``[out_dim, in_dim]`` matrix of a one-axis ``Resize``: ``y = M @ x`` along that axis.

    Args:
        in_dim, out_dim: Input and output lengths.
        scale: The axis's scale (``out_dim / in_dim`` when sizes were given).
        mode: ``nearest``, ``linear`` or ``cubic``.
        coordinates: The ``coordinate_transformation_mode``.
        nearest_mode: Rounding of ``nearest`` mode.
        cubic_coeff_a: The cubic kernel's ``a``.
        exclude_outside: Whether cubic taps outside the input get weight 0 (and the rest are
            renormalized) instead of reading the clamped edge.
        roi: Start and end of the region of interest (``tf_crop_and_resize`` only); output
            positions whose source lies outside the input get an all-zero row (they hold the
            extrapolation value, which does not depend on ``x``).
    """
    x = _source_coordinates(coordinates, out_dim, in_dim, scale, roi)
    matrix = np.zeros((out_dim, in_dim))
    rows = np.arange(out_dim)
    if mode == "nearest":
        rounded = {
            "round_prefer_floor": np.ceil(x - 0.5),
            "round_prefer_ceil": np.floor(x + 0.5),
            "floor": np.floor(x),
            "ceil": np.ceil(x),
        }[nearest_mode]
        taps = rounded.astype(np.int64)[:, None]
        weights = np.ones((out_dim, 1))
    elif mode == "linear":
        base = np.floor(x)
        frac = (x - base)[:, None]
        taps = base.astype(np.int64)[:, None] + np.arange(2)
        weights = np.concatenate([1 - frac, frac], axis=1)
    else:
        base = np.floor(x)
        frac = (x - base)[:, None]
        taps = base.astype(np.int64)[:, None] + np.arange(-1, 3)
        weights = _cubic_weight(frac - np.arange(-1, 3), cubic_coeff_a)
        if exclude_outside:
            weights = np.where((taps < 0) | (taps >= in_dim), 0.0, weights)
            weights = weights / weights.sum(axis=1, keepdims=True)
    np.add.at(matrix, (rows[:, None], np.clip(taps, 0, in_dim - 1)), weights)
    if coordinates == "tf_crop_and_resize":
        matrix[(x < 0) | (x > in_dim - 1)] = 0.0
    return matrix


_RESIZE_COORDINATES = (
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
    "half_pixel_symmetric",
)  # fmt: skip
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_constant(ctx: GradContext, i: int, what: str) -> np.ndarray | None:
    """Constant input ``i`` of Resize, None when absent or empty."""
    if not ctx.has_input(i):
        return None
    value = ctx.const_input(i)
    if value is None:
        ctx.unsupported(
            f"the {what} input is computed at run time; the gradient builds interpolation"
            f" matrices from static values, so make {what} a constant"
        )
    return value.reshape(-1) if value.size else None


def _resize_sizes(ctx: GradContext, axes: list[int]) -> list[int | None] | None:
    """Resize's ``sizes``, one per axis of ``axes`` (None when absent or empty): each a
    number, or None where it is the input's own (dynamic) length of that axis.

    Sizes read from shapes are folded element by element, so ``Concat(Shape(x)[:2], [8, 8])``
    is known for the resized axes although the batch length is not.
    """
    if not ctx.has_input(3):
        return None
    x, sizes = ctx.x(0), partial_value(ctx.x(3))
    if sizes is None or len(sizes) not in (0, len(axes)):
        ctx.unsupported(
            "the sizes input is computed at run time; the gradient builds interpolation"
            " matrices from static values, so make sizes a constant (or a Concat of constants"
            " and Shape elements of static dimensions)"
        )
    if not sizes:
        return None
    unknown = [
        a for a, s in zip(axes, sizes)
        if not isinstance(s, int) and not (isinstance(s, Dim) and s.is_dim_of(x, a))
    ]  # fmt: skip
    if unknown:
        ctx.unsupported(
            f"the sizes of axes {unknown} are computed at run time; the gradient builds"
            " interpolation matrices from static values, so make them constants (or the"
            " input's own lengths, read with Shape)"
        )
    return [s if isinstance(s, int) else static_dim(x, a) for a, s in zip(axes, sizes)]


def _resized_axes(ctx: GradContext, axes: list[int]) -> list[tuple[int, int, int, float]]:
    """``(axis, input length, output length, scale)`` of each of Resize's ``axes``.

    An axis whose scale is exactly 1, or whose size is the input's own length, may have a
    dynamic length (reported as -1 in and out); every other axis needs a static input length.
    """
    x = ctx.x(0)
    scales = _resize_constant(ctx, 2, "scales")
    sizes = _resize_sizes(ctx, axes) if scales is None else None
    if scales is None and sizes is None:
        ctx.unsupported("neither scales nor sizes is given")
    in_dims = [static_dim(x, a) for a in axes]
    if scales is not None and all(d is not None or s == 1.0 for d, s in zip(in_dims, scales)):
        return [
            (a, -1, -1, 1.0) if d is None
            else (a, d, int(np.float32(d) * np.float32(s)), float(np.float32(s)))
            for a, d, s in zip(axes, in_dims, scales)
        ]
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    kept = [d is None and s is None for d, s in zip(in_dims, sizes or [])]
    if sizes is None or any(d is None and not k for d, k in zip(in_dims, kept)) or (
        any(kept) and policy != "stretch"
    ):
        dynamic = [a for a, d in zip(axes, in_dims) if d is None]
        ctx.unsupported(
            f"axes {dynamic} of the input have dynamic lengths and are resized; the gradient"
            " needs static lengths on resized axes (or scales of exactly 1, or sizes equal to"
            " the input's own lengths, on dynamic ones)"
        )
    if policy == "stretch":
        return [
            (a, -1, -1, 1.0) if d is None or o is None
            else (a, d, o, float(np.float32(o) / np.float32(d)))
            for a, d, o in zip(axes, in_dims, sizes)
        ]
    if policy not in ("not_larger", "not_smaller"):
        ctx.unsupported(f"keep_aspect_ratio_policy={policy!r} is not supported")
    lengths = [int(d) for d in in_dims if d is not None]
    targets = [int(s) for s in sizes if s is not None]
    ratios = [o / d for o, d in zip(targets, lengths)]
    common = min(ratios) if policy == "not_larger" else max(ratios)
    return [(a, d, int(np.floor(common * d + 0.5)), common) for a, d in zip(axes, lengths)]


@register_gradient("Resize")
def resize(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Contract ``g`` with the transposed interpolation matrix of each resized axis.

    Resize is linear in ``x`` and separable: ``y = x x_0 M_0 x_1 M_1 ...`` (``M_k`` applied along
    axis ``k``), so ``dx = g x_0 M_0^T x_1 M_1^T ...``. The matrices are built at graph-build
    time from the static input lengths of the resized axes and the constant scales or sizes;
    axes left at their size with an identity transform are skipped, so they may be dynamic.
    """
    b, g, x = ctx.b, ctx.grad_or_zeros(grads, 0), ctx.x(0)
    mode = ctx.attr("mode", "nearest")
    coordinates = ctx.attr("coordinate_transformation_mode", "half_pixel")
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear", "cubic"):
        ctx.unsupported(f"mode={mode!r} is not a Resize mode; expected nearest, linear or cubic")
    if coordinates not in _RESIZE_COORDINATES:
        ctx.unsupported(f"coordinate_transformation_mode={coordinates!r} is not supported")
    if mode == "nearest" and nearest_mode not in _NEAREST_MODES:
        ctx.unsupported(f"nearest_mode={nearest_mode!r} is not supported")
    antialias = bool(ctx.attr("antialias", 0)) and mode != "nearest"
    r = _known_rank(ctx, x, "the input")
    axes = [int(a) % r for a in ctx.attr("axes", range(r))]
    roi = _resize_constant(ctx, 1, "roi") if coordinates == "tf_crop_and_resize" else None
    for j, (axis, in_dim, out_dim, scale) in enumerate(_resized_axes(ctx, axes)):
        axis_roi = (0.0, 1.0) if roi is None else (float(roi[j]), float(roi[j + len(axes)]))
        if scale == 1.0 and in_dim == out_dim and axis_roi == (0.0, 1.0):
            continue
        if in_dim < 0:
            ctx.unsupported(
                f"axis {axis} has a dynamic length and a region of interest other than [0, 1];"
                " the gradient needs its static length"
            )
        if antialias and out_dim < in_dim:
            ctx.unsupported(
                f"antialias=1 changes the filter when downscaling (axis {axis}: {in_dim} to"
                f" {out_dim}) and has no gradient rule; set antialias=0"
            )
        matrix = interpolation_matrix(
            in_dim, out_dim, scale, mode=mode, coordinates=coordinates,
            nearest_mode=nearest_mode, cubic_coeff_a=float(ctx.attr("cubic_coeff_a", -0.75)),
            exclude_outside=bool(ctx.attr("exclude_outside", 0)), roi=axis_roi,
        )
        g = contract_axis(b, g, b.const(matrix, like=x), axis, r)
    return [g]
