"""Slices moved before the products and elementwise ops that commute with them.

A causal language model's loss reads ``logits[:, :-1]``: the whole vocabulary's logits for
every position, then a copy without the last one. Taking the rows before the output
projection, ``MatMul(h[:, :-1], W)``, computes the same elements without the copy of the
largest tensor of the step, its gradient's zero padding, and the products of the row that is
dropped. :func:`hoist_slices` moves a Slice of constant bounds above

- a ``MatMul`` whose output axes it slices all come from the first operand's rows or batch
  axes, where the second operand is a matrix (``[K, N]``), so that each output element reads
  only the row it keeps;
- an elementwise ``Add``, ``Sub``, ``Mul`` or ``Div`` whose other operand broadcasts along
  the sliced axes (length 1 or absent there: a bias);
- an ``Identity``;

where the Slice is the op's only reader and the op's output is not a value a caller reads by
name. The kept elements are computed by the same operations on the same operands. A weight's
gradient then sums the products of the kept rows only, where it added the zeros of the
padded gradient before: the same sum, grouped otherwise by the GEMM, so it can differ by
rounding (the zoo's gpt2_stack: losses 1.2e-7 apart after 10 steps).

Example:
    >>> hoist_slices(graph, keep={"logits"})  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from traingraph.ir.fold import slice_inputs

__all__ = ["hoist_slices"]

_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})


def hoist_slices(graph: ir.Graph, keep: Iterable[str] = ()) -> int:
    """Move Slices above the ops that commute with them (see the module docstring), in place.

    Args:
        graph: A forward graph with its shapes inferred.
        keep: Names of values that must stay (values a caller reads by name).

    Returns:
        How many times a Slice was moved.
    """
    kept = set(keep) | {v.name for v in graph.outputs if v.name}
    moved = 0
    for _ in range(16):
        step = 0
        for node in list(graph):
            if node.graph is graph and node.op_type == "Slice" and node.domain in ("", "ai.onnx"):
                step += _hoist(graph, node, kept)
        moved += step
        if not step:
            break
    return moved


def _sliced_axes(node: ir.Node) -> list[int] | None:
    """The axes ``node`` (a Slice) slices, normalized, where its bounds are constants."""
    x, args = node.inputs[0], slice_inputs(node)
    if x is None or x.shape is None or args is None:
        return None
    r = len(x.shape)
    if any(not -r <= a < r for a in args[2]):
        return None
    return sorted(a % r for a in args[2])


def _hoist(graph: ir.Graph, node: ir.Node, kept: set[str]) -> int:
    """Move Slice ``node`` above its input's producer where that commutes; 1 if moved."""
    x = node.inputs[0]
    producer = None if x is None else x.producer()
    if x is None or producer is None or producer.domain not in ("", "ai.onnx"):
        return 0
    if x.name in kept or x.is_graph_output() or len(x.uses()) != 1 or len(producer.outputs) != 1:
        return 0
    axes = _sliced_axes(node)
    if axes is None:
        return 0
    operand = _commuting_operand(producer, x, axes)
    if operand is None:
        return 0
    source = producer.inputs[operand]
    assert source is not None
    sliced = ir.Node(
        "", "Slice", [source, *node.inputs[1:]], name=f"{node.name or 'slice'}/hoisted"
    )
    graph.insert_before(producer, sliced)
    producer.replace_input_with(operand, sliced.outputs[0])
    out = node.outputs[0]
    sliced.outputs[0].type = source.type
    if source.shape is not None:  # the source's dims, the slice's on the axes it slices
        dims: list[int | ir.SymbolicDim] = list(source.shape.dims)
        for a in axes:
            dims[a] = out.shape.dims[a] if out.shape is not None else ir.SymbolicDim(None)
        sliced.outputs[0].shape = ir.Shape(dims)
    x.shape = out.shape  # the producer now writes the kept elements
    out.replace_all_uses_with(x, replace_graph_outputs=True)
    name = out.name
    graph.remove(node, safe=True)
    if name:  # the values after it keep their names
        x.name = name
    return 1


def _commuting_operand(producer: ir.Node, x: ir.Value, axes: list[int]) -> int | None:
    """Which input of ``producer`` (which writes ``x``) the Slice of ``axes`` can take instead
    of its output, or None."""
    r = len(x.shape) if x.shape is not None else None
    if r is None:
        return None
    op = producer.op_type
    if op == "Identity":
        return 0
    if op == "MatMul":
        a, b = producer.inputs
        if a is None or b is None or a.shape is None or b.shape is None:
            return None
        # A matrix second operand: every output axis but the last is the first operand's.
        if len(b.shape) != 2 or len(a.shape) != r or r < 2 or axes[-1] >= r - 1:
            return None
        return 0
    if op in _ELEMENTWISE:
        shapes = [v.shape if v is not None else None for v in producer.inputs]
        if len(shapes) != 2 or any(s is None for s in shapes):
            return None
        full = [i for i, s in enumerate(shapes) if s is not None and len(s) == r]
        for i in full:
            other = shapes[1 - i]
            assert other is not None
            lead = r - len(other)
            if all(a < lead or other.dims[a - lead] == 1 for a in axes) and _same_dims(
                shapes[i], x.shape, axes
            ):
                return i
        return None
    return None


def _same_dims(shape: ir.Shape | None, out: ir.Shape | None, axes: list[int]) -> bool:
    """Whether ``shape`` has ``out``'s dimensions on ``axes`` (no broadcast along them)."""
    if shape is None or out is None or len(shape) != len(out):
        return False
    return all(shape.dims[a] == out.dims[a] for a in axes)
