"""Provider rewrites written as onnxscript rewriter rules: a pattern, a replacement and a check.

Each rule computes what the nodes it replaces compute, in a form one execution provider has a
better kernel for; :func:`rules_pass` makes an onnx-ir pass that applies a provider's rules in
one pass over an ``ir.Model`` (:func:`traingraph.runtime.rewrites.specialize.for_cuda` and
:func:`~traingraph.runtime.rewrites.specialize.for_cpu` run them), and :func:`apply` applies them
to a ``ModelProto``. The rules of the CUDA provider
(:data:`CUDA_RULES`):

- ``shift_as_division``: a right ``BitShift`` by a constant is a ``Div`` by ``2^k``: the CUDA
  provider has no BitShift kernel, so a model that shifts (the hash of a lowered training
  Dropout) would otherwise run those nodes on the CPU, with copies around them, on every step.
- ``mask_as_where``: a product with a cast boolean mask, ``Mul(g, Cast(mask))`` (the gradient
  of Relu, a Dropout mask), is ``Where(mask, g, 0)``: one kernel instead of two. The two differ
  only where the mask is off and ``g`` is not finite (0 instead of NaN) or negative (0 instead
  of -0).
- ``reductions_over_runs`` (four rules: ReduceSum and ReduceMean, axes as an input or an
  attribute): a reduction over constant, non-negative axes that form several runs of
  neighbouring axes (``[0, 2, 3]``, the per-channel statistics of BatchNormalization) is a
  chain of reductions, one per run: a run that starts at axis 0 first (column sums over
  contiguous rows, which the provider runs faster than rows of a short trailing run), then the
  others innermost first; each keeps or drops its dimensions as the original does. The
  provider reduces a run that starts or ends the tensor with its own kernels and hands other
  axis sets to cuDNN's general reduction, which is slower on these shapes. Means of
  equal-sized groups are the mean: the values are the same, added in another order.

After the weight gradients (:mod:`traingraph.runtime.rewrites.weight_grads`), on a model whose
values carry their inferred shapes, :data:`CUDA_FOLD_RULES`:

- ``shared_filters_as_batch``: a grouped ``Conv`` with one input channel per group, no bias,
  no ``auto_pad`` and the same constant filters in every group (the one-hot unfold of a
  convolution's weight gradient), whose input has a static shape of fewer than
  :data:`FOLD_LIMIT` elements, is one ungrouped Conv over the channels folded into the batch,
  between two Reshapes: the same values in the same layout.

The rules of the CPU provider (:data:`CPU_RULES`), on a model whose values carry their
inferred shapes (with the ConvTranspose rules of :mod:`traingraph.runtime.rewrites.conv_transpose`):

- ``column_sums_as_matmul``: a float32 ``ReduceSum`` over the leading axes of a static shape
  (a bias's gradient, the sum of the output gradient over the batch and positions), keeping
  axes of 64 elements or more, is ``MatMul(ones, X)`` between two Reshapes: onnxruntime's
  MatMul runs it as a vectorized GEMV over contiguous rows, where its ReduceSum over leading
  axes walks the kept axis with a stride. The sums are the same, added in another order.
- ``expanded_addend_as_broadcast_*``: ``Sum(a, Expand(b, shape))`` (or ``Add``, either order)
  where the Expand has ``a``'s static shape is ``Add(a, b)``: one broadcasting pass on every
  thread instead of onnxruntime's single-threaded Expand and a Sum
  (:data:`EXPANDED_ADDEND_AS_BROADCAST`).

and :data:`SCATTER_RULES` (``scatter_rows_as_elements``): a ``ScatterND`` with a reduction over
rows is the same ``ScatterElements`` on axis 0, which applies every update in index order
where onnxruntime's CPU ScatterND, with two threads or more, loses updates of repeated rows.

Example:
    >>> model = apply(model, CUDA_RULES)  # doctest: +SKIP
    >>> modified = rules_pass(CUDA_FOLD_RULES)(ir_model).modified  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import RewritePass, pattern

_BOOLEAN_OPS = frozenset(
    {"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor"}
)
_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)


def _right_shift(op: Any, x: ir.Value, shift: ir.Value) -> ir.Value:
    return op.BitShift(x, shift, direction="RIGHT")


def _is_constant_shift(context: Any, x: ir.Value, shift: ir.Value, **_: Any) -> bool:
    return ir.convenience.get_const_tensor(shift) is not None


def _division(op: Any, x: ir.Value, shift: ir.Value) -> ir.Value:
    amount = ir.convenience.get_const_tensor(shift)
    assert amount is not None
    bits = amount.numpy()
    divisor = (np.ones_like(bits) << bits).astype(bits.dtype)
    return op.Div(x, op.Constant(value=ir.tensor(divisor)))


def _masked(op: Any, mask: ir.Value, g: ir.Value) -> ir.Value:
    return op.Mul(op.Cast(mask, _allow_other_attributes=True, _outputs=["cast"]), g)


def _cast_type(cast: ir.Value) -> ir.DataType | None:
    node = cast.producer()
    to = node.attributes.get_int("to") if node is not None else None
    return ir.DataType(to) if to is not None else None


def _is_boolean_mask(context: Any, mask: ir.Value, g: ir.Value, cast: ir.Value, **_: Any) -> bool:
    producer = mask.producer()
    return (
        producer is not None
        and producer.op_type in _BOOLEAN_OPS
        and producer.domain in ("", "ai.onnx")
        and _cast_type(cast) in _FLOAT_TYPES
        and not cast.is_graph_output()
    )


def _where(op: Any, mask: ir.Value, g: ir.Value, cast: ir.Value) -> ir.Value:
    dtype = _cast_type(cast)
    assert dtype is not None
    return op.Where(mask, g, op.Constant(value=ir.tensor(np.zeros((), dtype.numpy()))))


_MIN_KEPT = 64  # below, a GEMV's call costs what it saves


def _column_sums(op: Any, x: ir.Value, axes: ir.Value) -> ir.Value:
    return op.ReduceSum(x, axes, _allow_other_attributes=True, _outputs=["sums"])


def _column_sums_by_attribute(op: Any, x: ir.Value) -> ir.Value:
    return op.ReduceSum(x, _allow_other_attributes=True, _outputs=["sums"])


def _summed_rows(
    x: ir.Value, sums: ir.Value, axes: ir.Value | None = None
) -> tuple[int, int, list[int]] | None:
    """The rows and the kept elements of ``x`` that the ReduceSum writing ``sums`` sums over
    the leading axes (``axes``, or its attribute), and the shape of the sums; None where it is
    not such a sum of a static float32 shape."""
    node = sums.producer()
    if node is None or x.dtype != ir.DataType.FLOAT or x.shape is None:
        return None
    if axes is None:
        attribute = node.attributes.get_ints("axes")
        leading = sorted(int(a) for a in attribute) if attribute is not None else []
    else:
        given = ir.convenience.get_const_tensor(axes)
        leading = sorted(int(a) for a in given.numpy().reshape(-1)) if given is not None else []
    shape = [d for d in x.shape.dims if isinstance(d, int)]
    k = len(leading)
    if not k or leading != list(range(k)) or k >= len(shape) or len(shape) != len(x.shape):
        return None
    if node.attributes.get_int("noop_with_empty_axes", 0):
        return None
    rows, kept = int(np.prod(shape[:k])), int(np.prod(shape[k:]))
    keepdims = node.attributes.get_int("keepdims", 1)
    return rows, kept, ([1] * k if keepdims else []) + shape[k:]


def _is_column_sum(
    context: Any, x: ir.Value, sums: ir.Value, axes: ir.Value | None = None, **_: Any
) -> bool:
    found = _summed_rows(x, sums, axes)
    return found is not None and found[0] >= 2 and found[1] >= _MIN_KEPT


def _gemv(op: Any, x: ir.Value, sums: ir.Value, axes: ir.Value | None = None) -> ir.Value:
    found = _summed_rows(x, sums, axes)
    assert found is not None
    rows, kept, shape = found
    matrix = op.Reshape(x, op.Constant(value=ir.tensor(np.array([rows, kept], np.int64))))
    ones = op.Constant(value=ir.tensor(np.ones((1, rows), np.float32)))
    return op.Reshape(op.MatMul(ones, matrix), op.Constant(value=ir.tensor(np.array(shape))))


COLUMN_SUMS_AS_MATMUL = pattern.RewriteRule(
    _column_sums, _gemv, _is_column_sum, name="column_sums_as_matmul"
)
COLUMN_SUMS_BY_ATTRIBUTE_AS_MATMUL = pattern.RewriteRule(
    _column_sums_by_attribute, _gemv, _is_column_sum, name="column_sums_by_attribute_as_matmul"
)
def _scatter_rows(op: Any, data: ir.Value, indices: ir.Value, updates: ir.Value) -> ir.Value:
    return op.ScatterND(data, indices, updates, _allow_other_attributes=True, _outputs=["y"])


def _reduces_rows(context: Any, data: ir.Value, indices: ir.Value, y: ir.Value, **_: Any) -> bool:
    node = y.producer()
    reduction = node.attributes.get_string("reduction", "none") if node is not None else "none"
    last = indices.shape[-1] if indices.shape is not None and indices.shape.rank() else None
    return reduction != "none" and last == 1


def _rows_as_elements(
    op: Any, data: ir.Value, indices: ir.Value, updates: ir.Value, y: ir.Value
) -> ir.Value:
    node = y.producer()
    assert node is not None
    def ints(*values: int) -> ir.Value:
        return op.Constant(value=ir.tensor(np.array(values, np.int64)))

    flat = op.Reshape(indices, ints(-1))
    rows = op.Reshape(updates, op.Concat(op.Shape(flat), ints(-1), axis=0))
    table = op.Reshape(data, op.Concat(op.Shape(data, end=1), op.Shape(rows, start=1), axis=0))
    positions = op.Expand(op.Unsqueeze(flat, ints(1)), op.Shape(rows))
    summed = op.ScatterElements(
        table, positions, rows, axis=0, reduction=node.attributes.get_string("reduction")
    )
    return op.Reshape(summed, op.Shape(data))


SCATTER_ROWS_AS_ELEMENTS = pattern.RewriteRule(
    _scatter_rows, _rows_as_elements, _reduces_rows, name="scatter_rows_as_elements"
)


def _scatter_elements(op: Any, base: ir.Value, positions: ir.Value, rows: ir.Value) -> ir.Value:
    return op.ScatterElements(base, positions, rows, _allow_other_attributes=True, _outputs=["y"])


def _made_by(value: ir.Value | None, op_type: str, inputs: int) -> ir.Node | None:
    """``value``'s producer where it is a default-domain ``op_type`` node of ``inputs`` inputs,
    all given; else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node if len(node.inputs) == inputs and all(node.inputs) else None


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def _one_element(value: ir.Value | None) -> bool:
    """Whether ``value`` is a one-element int64 vector: a constant, of static shape [1], or a
    Slice of one position of a vector (``shape[0:1]``)."""
    if value is None or value.dtype != ir.DataType.INT64:
        return False
    constant = _ints(value)
    if constant is not None:
        return len(constant) == 1
    if value.shape is not None and list(value.shape.dims) == [1]:
        return True
    node = value.producer()
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx"):
        return False
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = _ints(inputs[1]), _ints(inputs[2])
    axes = _ints(inputs[3]) if inputs[3] is not None else [0]
    steps = _ints(inputs[4]) if inputs[4] is not None else [1]
    source = inputs[0]
    if source is None:
        return False
    maker = source.producer()
    vector = source.shape is not None and len(source.shape) == 1
    if not (vector or (maker is not None and maker.op_type == "Shape")):
        return False
    if starts is None or ends is None or len(starts) != 1 or axes != [0] or steps != [1]:
        return False
    return starts[0] >= 0 and ends[0] == starts[0] + 1


def _shape_of(value: ir.Value | None, of: ir.Value, start: int, end: int | None) -> bool:
    """Whether ``value`` is ``Shape(of, start=start, end=end)``."""
    node = _made_by(value, "Shape", 1)
    if node is None or node.inputs[0] is not of:
        return False
    given_end = node.attributes.get_int("end")
    return node.attributes.get_int("start", 0) == start and given_end == end


def _one_row_parts(
    base: ir.Value, positions: ir.Value, rows: ir.Value, y: ir.Value
) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(fill, depth, column)`` where the ScatterElements writing ``y`` (axis 0, reduction
    "add" or "none") scatters one row into a filled table, in the form
    :func:`traingraph.autodiff.rules.indexing.scatter_add_rows` writes for one index (a Gather
    of one position whose axis is not static, the ``qkv[0]`` of an exported attention):

    - ``rows = Reshape(updates, Concat(Shape(flat), [-1]))`` with ``flat`` one int64 element,
      so ``rows`` is ``[1, R]``;
    - ``positions = Expand(Unsqueeze(flat, [1]), Shape(rows))``, that one index everywhere;
    - ``base = Expand(fill, Concat(depth, Shape(rows, start=1, end=2)))``, a one-element
      constant ``fill`` of rank 2 or less over ``[D, R]``, ``depth`` the one element ``D``.

    None otherwise."""
    node = y.producer()
    if node is None or node.attributes.get_int("axis", 0) != 0:
        return None
    if node.attributes.get_string("reduction", "none") not in ("add", "none"):
        return None
    reshape = _made_by(rows, "Reshape", 2)
    rows_shape = _made_by(reshape.inputs[1], "Concat", 2) if reshape is not None else None
    expand = _made_by(positions, "Expand", 2)
    unsqueeze = _made_by(expand.inputs[0], "Unsqueeze", 2) if expand is not None else None
    filled = _made_by(base, "Expand", 2)
    table = _made_by(filled.inputs[1], "Concat", 2) if filled is not None else None
    if rows_shape is None or expand is None or unsqueeze is None or table is None:
        return None
    flat = unsqueeze.inputs[0]
    counted = rows_shape.inputs[0]
    if flat is None or not _one_element(flat) or _ints(unsqueeze.inputs[1]) != [1]:
        return None
    if _ints(rows_shape.inputs[1]) != [-1]:
        return None
    if not (_shape_of(counted, flat, 0, None) or _ints(counted) == [1]):
        return None
    if not _shape_of(expand.inputs[1], rows, 0, None) or not _shape_of(table.inputs[1], rows, 1, 2):
        return None
    assert filled is not None  # a table implies its Expand
    fill, depth = filled.inputs[0], table.inputs[0]
    constant = ir.convenience.get_const_tensor(fill) if fill is not None else None
    if fill is None or constant is None or constant.size != 1 or len(constant.shape) > 2:
        return None
    if depth is None or not _one_element(depth) or fill.dtype != rows.dtype:
        return None
    return fill, depth, unsqueeze.outputs[0]


def _is_one_row(
    context: Any, base: ir.Value, positions: ir.Value, rows: ir.Value, y: ir.Value, **_: Any
) -> bool:
    return _one_row_parts(base, positions, rows, y) is not None


def _one_row_as_where(
    op: Any, base: ir.Value, positions: ir.Value, rows: ir.Value, y: ir.Value
) -> ir.Value:
    node = y.producer()
    parts = _one_row_parts(base, positions, rows, y)
    assert node is not None and parts is not None
    fill, depth, column = parts

    def ints(*values: int) -> ir.Value:
        return op.Constant(value=ir.tensor(np.array(values, np.int64)))

    def scalar(value: int) -> ir.Value:
        return op.Constant(value=ir.tensor(np.int64(value)))

    size = op.Reshape(depth, ints())
    indices = op.Unsqueeze(op.Range(scalar(0), size, scalar(1)), ints(1))
    chosen = op.Equal(indices, op.Mod(column, size))
    added = node.attributes.get_string("reduction", "none") == "add"
    # Sum, not Add: onnxruntime's optimizer drops an Add of a constant 0, whose -0.0 + 0.0 is
    # the scatter's 0.0
    return op.Where(chosen, op.Sum(rows, fill) if added else rows, fill)


ONE_ROW_SCATTER_AS_WHERE = pattern.RewriteRule(
    _scatter_elements, _one_row_as_where, _is_one_row, name="one_row_scatter_as_where"
)
SCATTER_RULES: tuple[pattern.RewriteRule, ...] = (
    SCATTER_ROWS_AS_ELEMENTS,
    ONE_ROW_SCATTER_AS_WHERE,
)
"""The CPU provider's rules for scatters:

- ``scatter_rows_as_elements``: a ``ScatterND`` with a reduction over rows (indices
  ``[..., 1]``) is the same ``ScatterElements`` on axis 0 of the data as ``[D, R]`` and the
  updates as ``[M, R]``, each row's index repeated across it. onnxruntime's CPU ScatterND adds
  rows from several threads without ordering them and loses updates of a row that the indices
  repeat; its ScatterElements applies every update, in index order.
- ``one_row_scatter_as_where``: a ``ScatterElements`` that adds one row ``[1, R]`` into a
  table ``[D, R]`` filled with a constant ``c`` (the gradient of a Gather of one position,
  ``qkv[0]``, where the axis is not static; :func:`_one_row_parts` gives the form) is
  ``Where(Equal(Range(D)[:, None], index mod D), Sum(rows, c), c)``: onnxruntime's CPU
  ScatterElements walks the row on one thread after the table is filled, a broadcast Where is
  one parallel pass (ViT-Tiny's 36 of them: about 40 ms of a 200 ms step at one thread and at
  two). The values are the same, ``-0.0`` updates made ``0.0`` by the same ``c + u``; only an
  index outside ``[-D, D)``, which the scatter rejects, is taken modulo ``D``."""


def _static(value: ir.Value) -> list[int] | None:
    """``value``'s dimensions where all are known numbers; else None."""
    if value.shape is None:
        return None
    dims = list(value.shape.dims)
    return dims if all(isinstance(d, int) for d in dims) else None  # type: ignore[return-value]


def _expanded_addend(op_type: str, first: bool) -> Any:
    def expanded(op: Any, a: ir.Value, b: ir.Value, shape: ir.Value) -> ir.Value:
        e = op.Expand(b, shape, _outputs=["e"])
        operands = (e, a) if first else (a, e)
        return getattr(op, op_type)(*operands, _outputs=["total"])

    return expanded


def _broadcasts_to(
    context: Any, a: ir.Value, b: ir.Value, e: ir.Value, total: ir.Value, **_: Any
) -> bool:
    """Whether the Expand of ``b`` has ``a``'s static shape (the sum is then ``a``'s shape,
    and adding ``b`` broadcast gives every element the same value): its inferred shape, or
    that of the value whose Shape it expands to."""
    a_dims, b_dims, e_dims = _static(a), _static(b), _static(e)
    expand = e.producer()
    shape = expand.inputs[1] if expand is not None and len(expand.inputs) == 2 else None
    if e_dims is None and shape is not None:
        source = _made_by(shape, "Shape", 1)
        if source is not None and source.inputs[0] is not None and not source.attributes:
            e_dims = _static(source.inputs[0])
            if e_dims is not None and b_dims is not None and len(b_dims) > len(e_dims):
                return False
    if a_dims is None or b_dims is None or e_dims != a_dims or len(b_dims) > len(a_dims):
        return False
    if a.dtype != b.dtype:
        return False
    padded = [1] * (len(a_dims) - len(b_dims)) + b_dims
    return all(q in (1, d) for q, d in zip(padded, a_dims))


def _broadcast_add(op: Any, a: ir.Value, b: ir.Value, **_: Any) -> ir.Value:
    return op.Add(a, b)


EXPANDED_ADDEND_AS_BROADCAST: tuple[pattern.RewriteRule, ...] = tuple(
    pattern.RewriteRule(
        _expanded_addend(op_type, first), _broadcast_add, _broadcasts_to,
        name=f"expanded_addend_as_broadcast_{op_type.lower()}_{k}",
    )  # fmt: skip
    for op_type in ("Sum", "Add")
    for k, first in enumerate((True, False))
)
"""``Sum(a, Expand(b, shape))`` or ``Add`` (either order) where the Expand has ``a``'s static
shape: ``Add(a, b)``. The gradient of a global average pool (a squeeze-excitation block's, a
classifier head's) is such an Expand of the per-channel gradient, added to the other gradient
of the pooled input: onnxruntime's Expand writes the full tensor on one thread, then Sum reads
it again; its broadcasting Add makes one pass, on every thread. Each element is ``a + b`` in
both."""

CPU_RULES: tuple[pattern.RewriteRule, ...] = (
    COLUMN_SUMS_AS_MATMUL,
    COLUMN_SUMS_BY_ATTRIBUTE_AS_MATMUL,
    *EXPANDED_ADDEND_AS_BROADCAST,
)
"""The rules of the CPU provider."""


def _runs(reduced: ir.Value, axes: ir.Value | None = None) -> list[list[int]] | None:
    """The axes the reduction writing ``reduced`` reduces (``axes``, or its attribute) as runs
    of neighbouring axes, where they are constant, non-negative, distinct and form more than
    one run; else None."""
    node = reduced.producer()
    if node is None or node.attributes.get_int("noop_with_empty_axes"):
        return None
    if axes is None:
        attribute = node.attributes.get_ints("axes")
        if attribute is None:
            return None
        given = [int(a) for a in attribute]
    else:
        tensor = ir.convenience.get_const_tensor(axes)
        if tensor is None:
            return None
        given = [int(a) for a in tensor.numpy().reshape(-1)]
    if not given or min(given) < 0 or len(set(given)) != len(given):
        return None
    runs: list[list[int]] = []
    for axis in sorted(given):
        if runs and runs[-1][-1] == axis - 1:
            runs[-1].append(axis)
        else:
            runs.append([axis])
    return runs if len(runs) > 1 else None


def _over_runs(
    context: Any, x: ir.Value, reduced: ir.Value, axes: ir.Value | None = None, **_: Any
) -> bool:
    return _runs(reduced, axes) is not None


def _chain(op: Any, x: ir.Value, reduced: ir.Value, axes: ir.Value | None = None) -> ir.Value:
    """The reductions over the runs: a run that starts at axis 0 first, then the others
    innermost first. Summing over the leading axes first reads the whole tensor as columns of
    contiguous rows, which the CUDA provider does faster than the rows of a short trailing run
    (the 7 x 7 positions of a CNN's last stage); dropping a run's dimensions then shifts the
    axes after it, and leaves those before it as they are."""
    node = reduced.producer()
    runs = _runs(reduced, axes)
    assert node is not None and runs is not None
    keepdims = node.attributes.get_int("keepdims", 1)
    reduce = getattr(op, node.op_type)
    leading = runs[0] if runs[0][0] == 0 else []
    shift = 0 if keepdims or not leading else len(leading)
    ordered = [runs[0], *reversed(runs[1:])] if leading else list(reversed(runs))
    current = x
    for i, run in enumerate(ordered):
        run = run if i == 0 else [a - shift for a in run]
        if axes is None:
            current = reduce(current, axes=run, keepdims=keepdims)
        else:
            run_axes = op.Constant(value=ir.tensor(np.array(run, np.int64)))
            current = reduce(current, run_axes, keepdims=keepdims)
    return current


def _reduction_rules(op_type: str) -> list[pattern.RewriteRule]:
    def by_input(op: Any, x: ir.Value, axes: ir.Value) -> ir.Value:
        return getattr(op, op_type)(x, axes, _allow_other_attributes=True, _outputs=["reduced"])

    def by_attribute(op: Any, x: ir.Value) -> ir.Value:
        return getattr(op, op_type)(x, _allow_other_attributes=True, _outputs=["reduced"])

    name = f"{op_type.lower()}_over_runs"
    return [
        pattern.RewriteRule(by_input, _chain, _over_runs, name=name),
        pattern.RewriteRule(by_attribute, _chain, _over_runs, name=f"{name}_by_attribute"),
    ]


REDUCTIONS_OVER_RUNS: tuple[pattern.RewriteRule, ...] = (
    *_reduction_rules("ReduceSum"),
    *_reduction_rules("ReduceMean"),
)
"""ReduceSum and ReduceMean over several runs of axes as chains of reductions over runs."""

FOLD_LIMIT = 1 << 20
"""The input size (elements) from which a grouped one-hot Conv stays grouped on CUDA (see
:mod:`traingraph.runtime.rewrites.specialize`)."""


def _grouped_conv(op: Any, x: ir.Value, w: ir.Value) -> ir.Value:
    return op.Conv(x, w, _allow_other_attributes=True, _outputs=["y"])


def _shared_filters(w: ir.Value, y: ir.Value) -> tuple[np.ndarray, int] | None:
    """``(filters [K, 1, k...], spatial rank)`` where the Conv writing ``y`` has ``group`` >= 2
    groups of one input channel each, no ``auto_pad``, and a constant weight
    ``w = [group * K, 1, k...]`` whose groups all hold ``filters``; else None."""
    node = y.producer()
    if node is None:
        return None
    groups = node.attributes.get_int("group", 1)
    if groups < 2 or node.attributes.get_string("auto_pad", "NOTSET") not in ("", "NOTSET"):
        return None
    tensor = ir.convenience.get_const_tensor(w)
    if tensor is None:
        return None
    dims = list(tensor.shape.numpy())
    if len(dims) < 3 or dims[1] != 1 or dims[0] % groups:
        return None
    weight = tensor.numpy()
    per_group = weight.reshape(groups, -1, *weight.shape[1:])
    if not (per_group == per_group[:1]).all():
        return None
    return np.ascontiguousarray(per_group[0]), len(dims) - 2


def _is_small_shared(context: Any, x: ir.Value, w: ir.Value, y: ir.Value, **_: Any) -> bool:
    if _shared_filters(w, y) is None or x.shape is None:
        return False
    dims = [d for d in x.shape.dims if isinstance(d, int)]
    return len(dims) == len(x.shape) and math.prod(dims) < FOLD_LIMIT


def _folded(op: Any, x: ir.Value, w: ir.Value, y: ir.Value) -> ir.Value:
    node = y.producer()
    shared = _shared_filters(w, y)
    assert node is not None and shared is not None
    filters, spatial = shared
    groups = node.attributes.get_int("group", 1)
    attrs = {k: a.value for k, a in node.attributes.items() if k != "group"}
    planes_shape = np.array([-1, 1] + [0] * spatial, np.int64)
    out_shape = np.array([-1, filters.shape[0] * groups] + [0] * spatial, np.int64)
    planes = op.Reshape(x, op.Constant(value=ir.tensor(planes_shape)))
    out = op.Conv(planes, op.Constant(value=ir.tensor(filters)), **attrs)
    return op.Reshape(out, op.Constant(value=ir.tensor(out_shape)))


SHARED_FILTERS_AS_BATCH = pattern.RewriteRule(
    _grouped_conv, _folded, _is_small_shared, name="shared_filters_as_batch"
)

SHIFT_AS_DIVISION = pattern.RewriteRule(
    _right_shift, _division, _is_constant_shift, name="shift_as_division"
)
MASK_AS_WHERE = pattern.RewriteRule(_masked, _where, _is_boolean_mask, name="mask_as_where")
CUDA_RULES: tuple[pattern.RewriteRule, ...] = (
    SHIFT_AS_DIVISION,
    MASK_AS_WHERE,
    *REDUCTIONS_OVER_RUNS,
)
"""The rules of the CUDA provider applied before its weight gradients, in this order."""
CUDA_FOLD_RULES: tuple[pattern.RewriteRule, ...] = (SHARED_FILTERS_AS_BATCH,)
"""The rules of the CUDA provider applied after its weight gradients, on inferred shapes."""


def rules_pass(rules: Sequence[pattern.RewriteRule]) -> RewritePass:
    """The onnx-ir pass that applies ``rules`` in one pass (each product in either order of
    its inputs)."""
    return RewritePass(pattern.RewriteRuleSet(list(rules), commute=True))


def apply(model: onnx.ModelProto, rules: Sequence[pattern.RewriteRule]) -> onnx.ModelProto | None:
    """``model`` with ``rules`` applied (each product in either order of its inputs), or None
    where none applies."""
    ir_model = ir.serde.deserialize_model(model)
    result = rules_pass(rules)(ir_model)
    return ir.serde.serialize_model(result.model) if result.modified else None
