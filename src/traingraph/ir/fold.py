"""Values a graph computes from constants and static shapes, known before it runs.

Exporters often compute slice bounds, reshape targets and split sizes from ``Shape`` of a
tensor whose shape is static: ``Shape -> Gather -> Div -> Mul -> Slice``. :func:`constant_value`
evaluates such small integer subgraphs so that gradient rules can pick the formulation for
constant arguments.

Example:
    >>> bounds = constant_value(slice_node.inputs[2])  # numpy array, or None
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

_MAX_DEPTH = 16
_MAX_ELEMENTS = 1024  # only small (shape-like) tensors are evaluated


def constant_value(value: ir.Value | None, depth: int = _MAX_DEPTH) -> np.ndarray | None:
    """The value of ``value`` as numpy when it follows from constants and static shapes.

    Covers initializers, ``Constant`` nodes, ``Shape`` / ``Size`` of statically shaped tensors
    and small integer arithmetic on them (Gather, Concat, Unsqueeze, Squeeze, Cast, Identity,
    Reshape, Slice, Add, Sub, Mul, Div, Neg). Returns None for anything else.
    """
    if value is None or depth <= 0:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Constant":
        attr = node.attributes.get("value")
        return None if attr is None else attr.value.numpy()
    if node.op_type in ("Shape", "Size"):
        return _shape_of(node)
    if node.op_type == "Gather":
        picked = _gather_dims(node, depth)
        if picked is not None:
            return picked
    evaluate = _EVALUATORS.get(node.op_type)
    if evaluate is None:
        return None
    args = [constant_value(v, depth - 1) if v is not None else None for v in node.inputs]
    if any(a is None for a, v in zip(args, node.inputs) if v is not None):
        return None
    if any(a is not None and a.size > _MAX_ELEMENTS for a in args):
        return None
    try:
        result = evaluate(node, args)
    except (ValueError, IndexError, TypeError, ZeroDivisionError):
        return None
    return None if result is None else np.asarray(result)


def _shape_of(node: ir.Node) -> np.ndarray | None:
    x = node.inputs[0]
    if x is None or x.shape is None:
        return None
    dims = list(x.shape.dims)
    if node.op_type == "Size":
        sizes = [d for d in dims if isinstance(d, int)]
        if len(sizes) != len(dims):
            return None
        return np.array(math.prod(sizes), dtype=np.int64)
    r = len(dims)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", r)
    start, end = (min(max(v + r if v < 0 else v, 0), r) for v in (start, end))
    picked = dims[start:end]
    if not all(isinstance(d, int) for d in picked):
        return None
    return np.array(picked, dtype=np.int64)


def _gather_dims(node: ir.Node, depth: int) -> np.ndarray | None:
    """``Gather(Shape(x), i)`` where just the gathered dimensions of ``x`` are static."""
    source = node.inputs[0].producer() if node.inputs[0] is not None else None
    if source is None or source.op_type != "Shape" or source.inputs[0] is None:
        return None
    x = source.inputs[0]
    index = constant_value(node.inputs[1], depth - 1)
    if x.shape is None or index is None:
        return None
    r = len(x.shape)
    start = source.attributes.get_int("start", 0)
    end = source.attributes.get_int("end", r)
    start, end = (min(max(v + r if v < 0 else v, 0), r) for v in (start, end))
    dims = list(x.shape.dims)[start:end]
    positions = index.astype(np.int64).reshape(-1).tolist()
    if not all(-len(dims) <= i < len(dims) for i in positions):
        return None
    picked = [dims[i] for i in positions]
    if not all(isinstance(d, int) for d in picked):
        return None
    return np.array(picked, dtype=np.int64).reshape(index.shape)


def _axes(node: ir.Node, args: list[np.ndarray | None]) -> list[int] | None:
    if len(args) > 1 and args[1] is not None:
        return [int(a) for a in args[1].reshape(-1)]
    attr = node.attributes.get_ints("axes")
    return None if attr is None else list(attr)


def _unsqueeze(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, axes = args[0], _axes(node, args)
    if x is None or axes is None:
        return None
    r = x.ndim + len(axes)
    for axis in sorted(a % r for a in axes):
        x = np.expand_dims(x, axis)
    return x


def _squeeze(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, axes = args[0], _axes(node, args)
    if x is None:
        return None
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


def _div(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    a, b = args[0], args[1]
    assert a is not None and b is not None
    if a.dtype.kind in "iu":
        return (np.trunc(a / b)).astype(a.dtype)  # ONNX integer Div truncates
    return a / b


def _slice(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, starts, ends = args[0], args[1], args[2]
    assert x is not None and starts is not None and ends is not None
    axes = args[3] if len(args) > 3 and args[3] is not None else np.arange(len(starts))
    steps = args[4] if len(args) > 4 and args[4] is not None else np.ones(len(starts), np.int64)
    index = [slice(None)] * x.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[int(axis) % x.ndim] = slice(int(start), int(end), int(step))
    return x[tuple(index)]


def _binary(op: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable:
    def evaluate(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray:
        a, b = args[0], args[1]
        assert a is not None and b is not None
        return op(a, b).astype(np.result_type(a, b))

    return evaluate


_EVALUATORS: dict[str, Callable[[ir.Node, list[np.ndarray | None]], np.ndarray | None]] = {
    "Identity": lambda node, args: args[0],
    "Neg": lambda node, args: -args[0],  # type: ignore[operator]
    "Cast": lambda node, args: args[0].astype(  # type: ignore[union-attr]
        ir.DataType(node.attributes.get_int("to", 1)).numpy()
    ),
    "Gather": lambda node, args: np.take(
        args[0],  # type: ignore[arg-type]
        args[1],  # type: ignore[arg-type]
        axis=node.attributes.get_int("axis", 0),
    ),
    "Concat": lambda node, args: np.concatenate(
        args,  # type: ignore[arg-type]
        axis=node.attributes.get_int("axis", 0),
    ),
    "Reshape": lambda node, args: (
        None if 0 in args[1] or -1 in args[1]  # type: ignore[operator]
        else args[0].reshape(args[1])  # type: ignore[union-attr]
    ),
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _div,
}

__all__ = ["constant_value"]
