"""Provider rewrites written as onnxscript rewriter rules: a pattern, a replacement and a check.

Each rule computes what the nodes it replaces compute, in a form one execution provider has a
better kernel for; :func:`apply` runs a provider's rules over a model in one pass. The rules of
the CUDA provider (:data:`CUDA_RULES`):

- ``shift_as_division``: a right ``BitShift`` by a constant is a ``Div`` by ``2^k``: the CUDA
  provider has no BitShift kernel, so a model that shifts (the hash of a lowered training
  Dropout) would otherwise run those nodes on the CPU, with copies around them, on every step.
- ``mask_as_where``: a product with a cast boolean mask, ``Mul(g, Cast(mask))`` (the gradient
  of Relu, a Dropout mask), is ``Where(mask, g, 0)``: one kernel instead of two. The two differ
  only where the mask is off and ``g`` is not finite (0 instead of NaN) or negative (0 instead
  of -0).

The rules of the CPU provider (:data:`CPU_RULES`), on a model whose values carry their
inferred shapes:

- ``column_sums_as_matmul``: a float32 ``ReduceSum`` over the leading axes of a static shape
  (a bias's gradient, the sum of the output gradient over the batch and positions), keeping
  axes of 64 elements or more, is ``MatMul(ones, X)`` between two Reshapes: onnxruntime's
  MatMul runs it as a vectorized GEMV over contiguous rows, where its ReduceSum over leading
  axes walks the kept axis with a stride. The sums are the same, added in another order.

Example:
    >>> model = apply(model, CUDA_RULES)  # doctest: +SKIP
"""

from __future__ import annotations

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
CPU_RULES: tuple[pattern.RewriteRule, ...] = (
    COLUMN_SUMS_AS_MATMUL,
    COLUMN_SUMS_BY_ATTRIBUTE_AS_MATMUL,
)
"""The rules of the CPU provider."""

SHIFT_AS_DIVISION = pattern.RewriteRule(
    _right_shift, _division, _is_constant_shift, name="shift_as_division"
)
MASK_AS_WHERE = pattern.RewriteRule(_masked, _where, _is_boolean_mask, name="mask_as_where")
CUDA_RULES: tuple[pattern.RewriteRule, ...] = (SHIFT_AS_DIVISION, MASK_AS_WHERE)
"""The rules of the CUDA provider, in the order they are applied."""


def apply(model: onnx.ModelProto, rules: Sequence[pattern.RewriteRule]) -> onnx.ModelProto | None:
    """``model`` with ``rules`` applied (each product in either order of its inputs), or None
    where none applies."""
    ir_model = ir.serde.deserialize_model(model)
    result = RewritePass(pattern.RewriteRuleSet(list(rules), commute=True))(ir_model)
    return ir.serde.serialize_model(result.model) if result.modified else None
