"""The input gradient of a Clip with both bounds, in one pass on the CPU.

The autodiff rule of ``Clip`` writes ``dx`` as ``Where(Or(Less(x, lo), Greater(x, hi)), 0, g)``
(:func:`traingraph.autodiff.rules.elementwise.clip`): onnxruntime makes four passes over the
activation for it, two of them writing boolean masks, and its Where is among the slowest of
its elementwise kernels. MobileNet's ReLU6 (a dynamo export's ``Clip(x, 0, 6)``) has one per
block. :class:`ClipGrad` computes the same selection in one pass with the native kernel
``_convc.clip_grad``: the same comparisons (false for a NaN ``x``, which keeps ``g``), so each
element is the one the graph selects, NaN and infinities included; the load-time check
(:func:`traingraph.runtime.cpu.verify.verified_kernels`) compares the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

Scalar = str | float
"""A one-element operand: the name of a value read at run time, or a constant's value."""


@dataclass(frozen=True)
class ClipGrad(OneOutput):
    """``out = Where(Or(Less(x, lo), Greater(x, hi)), fill, g)``.

    Attributes:
        x: The Clip's input.
        lo: Its lower bound.
        hi: Its upper bound.
        fill: The value where ``x`` is outside the bounds (0 in the rule).
        g: The gradient of the Clip's output, of ``x``'s shape.
        out: The gradient of ``x``.
    """

    x: str
    lo: Scalar
    hi: Scalar
    fill: Scalar
    g: str
    out: str

    @property
    def inputs(self) -> list[str]:
        scalars = [v for v in (self.lo, self.hi, self.fill) if isinstance(v, str)]
        return [self.x, self.g, *scalars]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x, g = values[self.x], values[self.g]
        if x.shape != g.shape:
            raise ValueError(
                f"clip gradient {self.out!r}: x {list(x.shape)} and g {list(g.shape)} must have"
                " one shape"
            )
        lo, hi, fill = (
            np.array(values[v] if isinstance(v, str) else v, np.float32).reshape(1)
            for v in (self.lo, self.hi, self.fill)
        )
        assert NATIVE is not None
        NATIVE.clip_grad(x, lo, hi, fill, g, output_array(out, self.out, x.shape), threads)


def split_clip_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[ClipGrad, set[int]]]:
    """Each ``Where(Or(Less(x, lo), Greater(x, hi)), fill, g)`` of float32 ``model`` with
    one-element ``lo``, ``hi`` and ``fill`` and ``g`` of ``x``'s shape, whose masks only it
    reads, as a :class:`ClipGrad` with the indices of its four nodes (none in ``taken``).
    ``[]`` where the extension is missing or nothing matches."""
    if NATIVE is None or not hasattr(NATIVE, "clip_grad"):
        return []
    graph = model.graph
    if not any(n.op_type == "Where" for n in graph.node) or graph_match.has_subgraphs(model):
        return []
    g = graph_match.GraphIndex.of(graph)
    candidates = [
        i for i, n in enumerate(g.nodes)
        if i not in taken and n.op_type == "Where" and n.domain in ("", "ai.onnx")
    ]  # fmt: skip
    if not candidates:
        return []
    shapes = graph_match.inferred_shapes(model)
    matches = []
    for i in candidates:
        match = _match(g, i, shapes, taken)
        if match is not None:
            matches.append(match)
    return verify.verified_kernels(model, g, matches, shapes)


def _match(
    g: graph_match.GraphIndex,
    i: int,
    shapes: Mapping[str, list[int | None]],
    taken: Set[int],
) -> tuple[ClipGrad, set[int]] | None:
    where = g.nodes[i]
    if len(where.input) != 3:
        return None
    cond, fill, grad = where.input
    either = g.producer.get(cond)
    if either is None or either in taken or g.only_reader(cond, taken) != i:
        return None
    node = g.nodes[either]
    if node.op_type != "Or" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    sides: dict[str, tuple[int, onnx.NodeProto]] = {}
    for mask in node.input:
        k = g.producer.get(mask)
        if k is None or k in taken or g.only_reader(mask, taken) != either:
            return None
        sides[g.nodes[k].op_type] = (k, g.nodes[k])
    if set(sides) != {"Less", "Greater"}:
        return None
    (less_i, less), (greater_i, greater) = sides["Less"], sides["Greater"]
    x = less.input[0]
    if greater.input[0] != x or any(n.domain not in ("", "ai.onnx") for n in (less, greater)):
        return None
    lo, hi = less.input[1], greater.input[1]
    if x not in shapes or shapes[x] != shapes.get(grad):
        return None
    scalars = [_scalar(g, shapes, v) for v in (lo, hi, fill)]
    if None in scalars:
        return None
    lo_s, hi_s, fill_s = (v for v in scalars if v is not None)
    if not isinstance(fill_s, float) or (fill_s == 0.0 and np.signbit(fill_s)):
        return None  # onnxruntime's Where writes a -0.0 fill as 0.0: constants other than -0.0
    kernel = ClipGrad(x, lo_s, hi_s, fill_s, grad, where.output[0])
    return kernel, {i, either, less_i, greater_i}


def _scalar(
    g: graph_match.GraphIndex, shapes: Mapping[str, list[int | None]], name: str
) -> Scalar | None:
    """``name`` as a :data:`Scalar`: its value where it is a float32 constant of one element
    (an initializer or a Constant), else its name where it is a float32 value of one element;
    None otherwise."""
    tensor = g.initializers.get(name)
    producer = g.producer.get(name)
    if tensor is None and producer is not None and g.nodes[producer].op_type == "Constant":
        value = [a for a in g.nodes[producer].attribute if a.name == "value"]
        tensor = value[0].t if value else None
    if tensor is not None:
        array = numpy_helper.to_array(tensor)
        if array.dtype != np.float32 or array.size != 1:
            return None
        return float(array.reshape(-1)[0])
    dims = shapes.get(name)
    if dims is None or any(d != 1 for d in dims):  # one element: every dimension 1
        return None
    return name


__all__ = ["ClipGrad", "Scalar", "split_clip_grads"]
