"""The input gradients of HardSwish, SiLU and Relu, one native pass each on the CPU.

The autodiff rules write them as chains of elementwise ops, and onnxruntime makes one pass over
the activation per op:

- ``HardSwish`` (:func:`traingraph.autodiff.rules.elementwise.hard_swish`):
  ``Mul(g, Where(Less(x, -3), 0, Where(Greater(x, 3), 1, Add(Div(x, 3), 0.5))))``, seven
  passes, two of them onnxruntime's Where with a scalar branch, the slowest of its elementwise
  kernels (MobileNetV3 has one HardSwish per block and a large one after its stem).
- SiLU, ``x * Sigmoid(x)`` as exported (EfficientNet has two per block): the Mul's and the
  Sigmoid's rules give ``Sum(Mul(g, s), Mul(Mul(g, x), Mul(s, Sub(1, s))))``, six passes.
- Relu (:func:`traingraph.autodiff.rules.elementwise.relu`): ``Mul(g, Cast(Greater(y, 0)))``,
  three passes, after the ``Sum`` of ``g``'s parts where the Relu's output is read twice (a
  residual block's: by the next block's branch and by its skip), whose BatchNorm-less form no
  BatchNorm gradient kernel takes. :class:`ReluGrad` adds the parts in the Sum's order and
  multiplies by the mask, the graph's float operations, bit for bit.

:class:`HardSwishGrad` computes the same float operations in the same order in one pass
(``_convc.hardswish_grad``; no fused multiply-adds), so each element is the graph's, NaN and
infinities included. :class:`SiluGrad` (``_convc.silu_grad``) computes the Sigmoid itself
from ``x``, as onnxruntime's at its ends (0 from ``x <= -18``, 1 from ``x >= 18``, NaN for
NaN), then the graph's operations in its order: reading the forward's Sigmoid output instead
would keep that activation alive from the forward to the backward (EfficientNet-B0's step
held 248 MiB more), where the graph lets onnxruntime compute it again in the backward. Its
values differ from the graph's by the Sigmoid's rounding (about 1e-7 relative); NaN and
infinities fall where the graph's do. The load-time check
(:func:`traingraph.runtime.cpu.verify.verified_kernels`) compares each kernel with its nodes.
The matchers take any one-element float32 constants in the HardSwish form (the rule's -3, 3,
0, 1, 3 and 0.5 are not assumed) and either operand order of each Mul and of the Sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

Shapes = Mapping[str, list[int | None]]


@dataclass(frozen=True)
class HardSwishGrad(OneOutput):
    """``out = g * Where(x < lo, below, Where(x > hi, above, x / divisor + offset))``.

    Attributes:
        x: The HardSwish's input.
        g: The gradient of its output, of ``x``'s shape.
        out: The gradient of ``x``.
        lo: The bound below which the slope is ``below`` (-3 in the rule).
        hi: The bound above which the slope is ``above`` (3).
        below: The slope below ``lo`` (0).
        above: The slope above ``hi`` (1).
        divisor: ``x``'s divisor in the slope between the bounds (3).
        offset: The offset of that slope (0.5).
    """

    x: str
    g: str
    out: str
    lo: float
    hi: float
    below: float
    above: float
    divisor: float
    offset: float

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.g]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x, g = _same_shape(self.out, values, [self.x, self.g])
        assert NATIVE is not None
        target = output_array(out, self.out, x.shape)
        constants = (self.lo, self.hi, self.below, self.above, self.divisor, self.offset)
        NATIVE.hardswish_grad(x, g, target, *constants, threads)


@dataclass(frozen=True)
class SiluGrad(OneOutput):
    """``out = g s + (g x) (s (1 - s))``: the input gradient of ``x * s``, ``s = Sigmoid(x)``
    (computed here from ``x``).

    Attributes:
        x: The Sigmoid's input (the Mul's other operand).
        g: The gradient of the Mul's output, of ``x``'s shape.
        out: The gradient of ``x``.
    """

    x: str
    g: str
    out: str

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.g]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x, g = _same_shape(self.out, values, [self.x, self.g])
        assert NATIVE is not None
        NATIVE.silu_grad(x, g, output_array(out, self.out, x.shape), threads)


@dataclass(frozen=True)
class ReluGrad(OneOutput):
    """``out = Sum(parts) * Cast(y > 0)``: a Relu's input gradient as its rule writes it, of a
    gradient that is the ``Sum`` of its parts where only the product reads that Sum (a
    residual block's output: its branch's gradient and its skip's).

    Attributes:
        parts: The gradient, or the Sum's inputs in its order (of ``y``'s shape).
        y: The Relu's output.
        out: The gradient of its input.
    """

    parts: tuple[str, ...]
    y: str
    out: str

    @property
    def inputs(self) -> list[str]:
        return [*self.parts, self.y]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        arrays = _same_shape(self.out, values, [*self.parts, self.y])
        assert NATIVE is not None
        target = output_array(out, self.out, arrays[0].shape)
        NATIVE.relu_grad(arrays[:-1], arrays[-1], target, threads)


RELU_GRAD_PARTS = 8
"""The most inputs of a Sum that :class:`ReluGrad` adds itself."""

RELU_GRAD_MIN_VALUES = 1 << 15
"""The fewest values per sample (the dimensions after the first, which is often the dynamic
batch) of a Relu whose gradient :class:`ReluGrad` takes. The kernel saves two of the graph's
three or four passes over the values, while the cut it makes between onnxruntime segments
costs tens of microseconds whatever their size: on ResNet-8's (16 x 32 x 32 and smaller, batch
32), LeNet's and the MLP's Relus the step was 4-13% slower with the kernel; with ResNet-50's
at batch 16 on 112 x 112 (32768 values a sample and more) its step is 1-3% faster."""


HARDSWISH_ALPHA = float(np.float32(1 / 6))
"""The slope of the HardSigmoid that ONNX's HardSwish is defined by (``alpha = 1/6``)."""


@dataclass(frozen=True)
class HardSwish(OneOutput):
    """``out = x * max(min(x * alpha + beta, 1), 0)``: an ONNX ``HardSwish``, which
    onnxruntime's CPU provider runs as the HardSigmoid and the Mul of its definition, two
    passes and a temporary; here one pass, the same float operations (each rounded apart).

    Attributes:
        x: The input.
        out: The output, of ``x``'s shape.
        alpha: The HardSigmoid's slope (1/6).
        beta: Its offset (0.5).
    """

    x: str
    out: str
    alpha: float = HARDSWISH_ALPHA
    beta: float = 0.5

    @property
    def inputs(self) -> list[str]:
        return [self.x]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x = values[self.x]
        assert NATIVE is not None
        NATIVE.hardswish(x, output_array(out, self.out, x.shape), self.alpha, self.beta, threads)


def _same_shape(out: str, values: Arrays, names: list[str]) -> list[np.ndarray]:
    arrays = [values[n] for n in names]
    if any(a.shape != arrays[0].shape for a in arrays):
        shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in zip(names, arrays))
        raise ValueError(
            f"activation gradient {out!r}: {shapes}; expected one shape (the graph's"
            " elementwise form without broadcasting)"
        )
    return arrays


def split_hardswish_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[HardSwishGrad, set[int]]]:
    """Each HardSwish input gradient of the rule's form in float32 ``model`` whose intermediate
    values only it reads, as a :class:`HardSwishGrad` with the indices of its seven nodes (none
    in ``taken``), checked numerically. ``[]`` where the extension is missing or nothing
    matches."""
    return _split(model, taken, "hardswish_grad", "Where", "Mul", _hardswish)


def split_hardswishes(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[HardSwish, set[int]]]:
    """Each ``HardSwish`` node of float32 ``model`` (none in ``taken``) as a :class:`HardSwish`,
    checked numerically. ``[]`` where the extension is missing or nothing matches."""
    return _split(model, taken, "hardswish", "HardSwish", "HardSwish", _hardswish_node)


def _hardswish_node(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    taken: Set[int],
) -> tuple[HardSwish, set[int]] | None:
    node = g.nodes[i]
    if len(node.input) != 1 or len(node.output) != 1:
        return None
    x, out = node.input[0], node.output[0]
    return (HardSwish(x, out), {i}) if _one_shape(shapes, x, out) else None


def split_silu_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[SiluGrad, set[int]]]:
    """Each input gradient of ``x * Sigmoid(x)`` in float32 ``model`` of the rules' form whose
    intermediate values only it reads, as a :class:`SiluGrad` with the indices of its six nodes
    and of the Sigmoid (none in ``taken``; the Sigmoid, which the forward's product reads too,
    stays in the graph), checked numerically. ``[]`` where the extension is missing or nothing
    matches."""
    return _split(model, taken, "silu_grad", "Sigmoid", "Sigmoid", _silu)


def split_relu_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[ReluGrad, set[int]]]:
    """Each Relu input gradient of the rule's form (``Mul(g, Cast(Greater(y, 0)))``) in float32
    ``model`` whose mask only it reads, with the ``Sum`` that writes ``g`` where only the Mul
    reads it, as a :class:`ReluGrad` with the indices of its nodes (none in ``taken``), checked
    numerically. ``[]`` where the extension is missing or nothing matches."""
    return _split(model, taken, "relu_grad", "Greater", "Greater", _relu)


def _relu(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    taken: Set[int],
) -> tuple[ReluGrad, set[int]] | None:
    greater = g.nodes[i]
    if len(greater.input) != 2 or _float(constants, greater.input[1]) != 0.0:
        return None
    y = greater.input[0]
    cast = _reader(g, greater.output[0], "Cast", taken)
    if cast is None or graph_match.attributes(cast[1]).get("to") != onnx.TensorProto.FLOAT:
        return None
    mul = _reader(g, cast[1].output[0], "Mul", taken)
    grad = _other(mul[1], cast[1].output[0]) if mul is not None else None
    if mul is None or grad is None:
        return None
    nodes = {i, cast[0], mul[0]}
    parts: tuple[str, ...] = (grad,)
    total = _inner(g, grad, "Sum", mul[0], taken) or _inner(g, grad, "Add", mul[0], taken)
    if total is not None and 2 <= len(total[1].input) <= RELU_GRAD_PARTS:
        inputs = tuple(total[1].input)
        if _one_shape(shapes, y, *inputs):
            parts = inputs
            nodes.add(total[0])
    if not _one_shape(shapes, y, *parts, mul[1].output[0]):
        return None
    per_sample = shapes[y][1:]
    if None in per_sample or math.prod(int(d or 0) for d in per_sample) < RELU_GRAD_MIN_VALUES:
        return None
    return ReluGrad(parts, y, mul[1].output[0]), nodes


_Match = TypeVar("_Match")


def _split(
    model: onnx.ModelProto,
    taken: Set[int],
    function: str,
    present: str,
    anchor: str,
    match: Callable[
        [graph_match.GraphIndex, int, Mapping[str, np.ndarray], Shapes, Set[int]],
        tuple[_Match, set[int]] | None,
    ],
) -> list[tuple[_Match, set[int]]]:
    """The matches ``match`` finds from each default-domain ``anchor`` node not in ``taken``,
    checked numerically; ``[]`` where the extension lacks ``function`` or ``model`` holds no
    ``present`` node."""
    if not graph_match.can_match(model, function, present):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    constants = graph_match.constant_values(model.graph)
    shapes = graph_match.inferred_shapes(model)
    matches = []
    for i, node in enumerate(g.nodes):
        if i not in taken and node.op_type == anchor and node.domain in ("", "ai.onnx"):
            found = match(g, i, constants, shapes, taken)
            if found is not None:
                matches.append(found)
    return verify.verified_kernels(model, g, matches, shapes)


def _float(constants: Mapping[str, np.ndarray], name: str) -> float | None:
    """``name``'s value where it is a float32 constant of one element, else None."""
    value = constants.get(name)
    if value is None or value.dtype != np.float32 or value.size != 1:
        return None
    return float(value.reshape(-1)[0])


def _fill(constants: Mapping[str, np.ndarray], name: str) -> float | None:
    """A Where's constant branch: onnxruntime's Where writes a -0.0 scalar as 0.0, so -0.0 is
    not taken."""
    value = _float(constants, name)
    return None if value is None or (value == 0.0 and np.signbit(value)) else value


def _inner(
    g: graph_match.GraphIndex, value: str, op_type: str, reader: int, taken: Set[int]
) -> tuple[int, onnx.NodeProto] | None:
    """``value``'s producer where it is an ``op_type`` node whose output only ``reader``
    reads."""
    found = g.produced_by(value, op_type, taken)
    if found is None or g.only_reader(value, taken) != reader:
        return None
    return found


def _one_shape(shapes: Shapes, *names: str) -> bool:
    """Whether the values have one known shape (no broadcasting in the elementwise form)."""
    first = shapes.get(names[0])
    return first is not None and all(shapes.get(n) == first for n in names[1:])


def _hardswish(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    taken: Set[int],
) -> tuple[HardSwishGrad, set[int]] | None:
    mul = g.nodes[i]
    for grad, slope in (tuple(mul.input), tuple(reversed(mul.input))):
        outer = _inner(g, slope, "Where", i, taken)
        if outer is None:
            continue
        outer_i, outer_node = outer
        less = _inner(g, outer_node.input[0], "Less", outer_i, taken)
        upper = _inner(g, outer_node.input[2], "Where", outer_i, taken)
        if less is None or upper is None:
            continue
        x = less[1].input[0]
        greater = _inner(g, upper[1].input[0], "Greater", upper[0], taken)
        add = _inner(g, upper[1].input[2], "Add", upper[0], taken)
        if greater is None or add is None or greater[1].input[0] != x:
            continue
        div_value, offset_value = add[1].input
        div = _inner(g, div_value, "Div", add[0], taken)
        if div is None:
            div_value, offset_value = offset_value, div_value
            div = _inner(g, div_value, "Div", add[0], taken)
        if div is None or div[1].input[0] != x:
            continue
        scalars = (
            _float(constants, less[1].input[1]),
            _float(constants, greater[1].input[1]),
            _fill(constants, outer_node.input[1]),
            _fill(constants, upper[1].input[1]),
            _float(constants, div[1].input[1]),
            _float(constants, offset_value),
        )
        if any(v is None for v in scalars) or not _one_shape(shapes, x, grad, mul.output[0]):
            continue
        lo, hi, below, above, divisor, offset = (float(v) for v in scalars if v is not None)
        kernel = HardSwishGrad(x, grad, mul.output[0], lo, hi, below, above, divisor, offset)
        nodes = {i, outer_i, less[0], upper[0], greater[0], add[0], div[0]}
        return kernel, nodes
    return None


def _silu(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    taken: Set[int],
) -> tuple[SiluGrad, set[int]] | None:
    """The gradient's six nodes and the Sigmoid ``i`` (which the kernel computes again; the
    forward's product still reads it, so it stays in the graph)."""
    sigmoid = g.nodes[i]
    x, s = sigmoid.input[0], sigmoid.output[0]
    readers = {j: g.nodes[j] for j in g.consumers.get(s, ()) if j not in taken}
    # (1 - s) and its product with s: the Sigmoid's slope
    subs = [
        j for j, n in readers.items()
        if n.op_type == "Sub" and n.input[1] == s and _float(constants, n.input[0]) == 1.0
    ]  # fmt: skip
    for sub_i in subs:
        slope = _reader(g, g.nodes[sub_i].output[0], "Mul", taken)
        if slope is None or set(slope[1].input) != {s, g.nodes[sub_i].output[0]}:
            continue
        # (g x) times the slope, and g s beside it, summed into x's gradient
        through = _reader(g, slope[1].output[0], "Mul", taken)
        if through is None:
            continue
        gx = _other(through[1], slope[1].output[0])
        gx_node = _inner(g, gx, "Mul", through[0], taken) if gx else None
        if gx_node is None or x not in gx_node[1].input:
            continue
        grad = _other(gx_node[1], x)
        total = _reader(g, through[1].output[0], "Sum", taken) or _reader(
            g, through[1].output[0], "Add", taken
        )
        if grad is None or total is None or len(total[1].input) != 2:
            continue
        direct_value = _other(total[1], through[1].output[0])
        direct = _inner(g, direct_value, "Mul", total[0], taken) if direct_value else None
        if direct is None or sorted(direct[1].input) != sorted([grad, s]):
            continue
        out = total[1].output[0]
        if not _one_shape(shapes, x, s, grad, out):
            continue
        nodes = {i, sub_i, slope[0], through[0], gx_node[0], total[0], direct[0]}
        return SiluGrad(x, grad, out), nodes
    return None


def _reader(
    g: graph_match.GraphIndex, value: str, op_type: str, taken: Set[int]
) -> tuple[int, onnx.NodeProto] | None:
    """The one reader of ``value`` where it is a default-domain ``op_type`` node."""
    j = g.only_reader(value, taken)
    if j is None:
        return None
    node = g.nodes[j]
    return (j, node) if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _other(node: onnx.NodeProto, value: str) -> str | None:
    """The other input of the two-input ``node`` that reads ``value`` once."""
    if len(node.input) != 2 or list(node.input).count(value) != 1:
        return None
    return node.input[1] if node.input[0] == value else node.input[0]


__all__ = [
    "HardSwish",
    "HardSwishGrad",
    "ReluGrad",
    "SiluGrad",
    "split_hardswish_grads",
    "split_hardswishes",
    "split_relu_grads",
    "split_silu_grads",
]
