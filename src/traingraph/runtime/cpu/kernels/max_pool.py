"""The gradient of a MaxPool of any window geometry, in one pass on the CPU.

Where a MaxPool's windows overlap or are padded (a ResNet's 3 x 3 of stride 2 and pads 1), the
autodiff rule (:func:`traingraph.autodiff.rules.pool.max_pool`) writes the gradient as a second
MaxPool that returns each window's flat position, and a ``ScatterElements(reduction="add")``
of the output gradient at those positions into zeros, between Reshapes. onnxruntime's MaxPool
with positions is a scalar loop, and the scatter reads int64 positions: at 16 x 64 x 56 x 56 the
pair takes about 20 ms on one thread. :class:`MaxPoolScatter` walks each plane's windows as
onnxruntime's MaxPool does (a window's first element inside the input, replaced by each later
one strictly greater) and adds the window's gradient there, in the scatter's order
(``_convc.max_pool_grad``): the same sums in the same order, NaN and infinities included. The
load-time check (:func:`traingraph.runtime.cpu.verify.verified_kernels`) compares the two.
Windows that hold no input element (which the graph routes into another plane) are left to
the graph: the matcher takes only geometries without them.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

_DEFAULT = ("", "ai.onnx")
_TAG = "max_pool_grad"


@dataclass(frozen=True)
class MaxPoolScatter(OneOutput):
    """``out = Reshape(ScatterElements(zeros, positions, Reshape(g)), Shape(x))`` with the
    positions of ``MaxPool(x)``'s maxima, for a 2-D MaxPool of any window.

    Attributes:
        x: The MaxPool's input ``[N, C, H, W]``.
        g: The gradient of its output ``[N, C, OH, OW]``.
        out: The gradient of ``x``.
        kernel: The window's height and width.
        strides: The strides.
        pads: The begin pads.
        dilations: The dilations.
    """

    x: str
    g: str
    out: str
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int]
    dilations: tuple[int, int]

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.g]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x = values[self.x]
        assert NATIVE is not None
        NATIVE.max_pool_grad(
            x, values[self.g], output_array(out, self.out, x.shape), self.kernel, self.strides,
            self.pads, self.dilations, threads,
        )  # fmt: skip


def split_max_pool_scatters(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[MaxPoolScatter, set[int]]]:
    """Each MaxPool gradient of ``model`` written as a scatter of the maxima's positions (see
    the module), float32 and 2-D with static channels and sizes, as a
    :class:`MaxPoolScatter` with the indices of the nodes it replaces (none in ``taken``),
    checked numerically. ``[]`` where the extension is missing or nothing matches."""
    if not graph_match.can_match(model, "max_pool_grad", "ScatterElements"):
        return []
    graph = model.graph
    g = graph_match.GraphIndex.of(graph)
    candidates = [
        i for i, n in enumerate(g.nodes)
        if i not in taken and n.op_type == "ScatterElements" and n.domain in _DEFAULT
        and g.tagged(i, _TAG)
    ]  # fmt: skip
    if not candidates:
        return []
    shapes = graph_match.inferred_shapes(model)
    constants = graph_match.constant_values(graph)
    matches = [m for i in candidates if (m := _match(g, i, shapes, constants, taken))]
    return verify.verified_kernels(model, g, matches, shapes)


def _flattened(
    g: graph_match.GraphIndex, value: str, constants: Mapping[str, np.ndarray], taken: Set[int]
) -> tuple[int, str] | None:
    """Where ``value`` is ``Reshape(v, [-1])``: the Reshape's index and ``v``."""
    found = g.produced_by(value, "Reshape", taken)
    if found is None or len(found[1].input) != 2:
        return None
    shape = constants.get(found[1].input[1])
    if shape is None or shape.reshape(-1).tolist() != [-1]:
        return None
    return found[0], found[1].input[0]


def _shape_of(
    g: graph_match.GraphIndex, value: str, x: str, dims: list[int | None],
    constants: Mapping[str, np.ndarray], taken: Set[int],
) -> set[int] | None:  # fmt: skip
    """Where ``value`` is ``x``'s shape (``Shape(x)`` or a constant of its static ``dims``):
    the Shape node's index, or no index for a constant; else None."""
    if value in constants:
        return set() if constants[value].reshape(-1).tolist() == dims else None
    found = g.produced_by(value, "Shape", taken)
    if found is None or found[1].input[0] != x or found[1].attribute:
        return None
    return {found[0]}


def _pooled(
    size: int, kernel: int, stride: int, begin: int, end: int, dilation: int, ceil: bool
) -> int | None:
    """The windows along one axis, or None where one of them holds no element of the input.
    In ceil mode a last window that would start past the input and its begin pads is
    dropped, as onnxruntime and PyTorch drop it."""
    span = size + begin + end - (kernel - 1) * dilation - 1
    count = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (count - 1) * stride >= size + begin:
        count -= 1
    for o in range(count):
        starts = o * stride - begin + np.arange(kernel) * dilation
        if not ((starts >= 0) & (starts < size)).any():
            return None
    return count


def _match(
    g: graph_match.GraphIndex,
    i: int,
    shapes: Mapping[str, list[int | None]],
    constants: Mapping[str, np.ndarray],
    taken: Set[int],
) -> tuple[MaxPoolScatter, set[int]] | None:
    scatter = g.nodes[i]
    attrs = graph_match.attributes(scatter)
    if len(scatter.input) != 3 or attrs.get("axis", 0) != 0 or attrs.get("reduction") != b"add":
        return None
    data, positions, updates = (_flattened(g, v, constants, taken) for v in scatter.input)
    if data is None or positions is None or updates is None:
        return None
    pool = g.produced_by(positions[1], "MaxPool", taken)
    zeros = g.produced_by(data[1], "ConstantOfShape", taken)
    if pool is None or zeros is None or len(pool[1].output) != 2:
        return None
    x, grad = pool[1].input[0], updates[1]
    dims, pooled = shapes.get(x), shapes.get(grad)
    if dims is None or pooled is None or len(dims) != 4 or None in dims[1:] or len(pooled) != 4:
        return None
    p = graph_match.attributes(pool[1])
    kernel = list(p.get("kernel_shape", []))  # type: ignore[call-overload]
    pads = list(p.get("pads", [0] * 4))  # type: ignore[call-overload]
    strides = list(p.get("strides", [1, 1]))  # type: ignore[call-overload]
    dilations = list(p.get("dilations", [1, 1]))  # type: ignore[call-overload]
    if (
        p.get("storage_order", 0) != 0
        or p.get("auto_pad", b"NOTSET") != b"NOTSET"
        or len(kernel) != 2 or len(pads) != 4 or len(strides) != 2 or len(dilations) != 2
    ):  # fmt: skip
        return None
    ceil = bool(p.get("ceil_mode", 0))
    counts = [
        _pooled(int(s), k, st, b, e, d, ceil)
        for s, k, st, b, e, d in zip(dims[2:], kernel, strides, pads[:2], pads[2:], dilations)
    ]
    if None in counts or pooled != [*dims[:2], *counts]:
        return None
    fill = next((a.t for a in zeros[1].attribute if a.name == "value"), None)
    if fill is not None:
        value = numpy_helper.to_array(fill).reshape(-1)
        if value.dtype != np.float32 or value.tolist() != [0.0] or np.signbit(value[0]):
            return None
    shape_nodes = _shape_of(g, zeros[1].input[0], x, dims, constants, taken)
    reader = g.only_reader(scatter.output[0], taken)
    if shape_nodes is None or reader is None:
        return None
    final = g.nodes[reader]
    if final.op_type != "Reshape" or final.domain not in _DEFAULT or len(final.input) != 2:
        return None
    final_shape = _shape_of(g, final.input[1], x, dims, constants, taken)
    if final_shape is None:
        return None
    essential = {i, reader, data[0], positions[0], updates[0], pool[0], zeros[0]}
    nodes = graph_match.exclusive_cone(g, reader, essential | shape_nodes | final_shape)
    if not essential <= nodes:
        return None
    kernel_ = MaxPoolScatter(
        x, grad, final.output[0], (kernel[0], kernel[1]), (strides[0], strides[1]),
        (pads[0], pads[1]), (dilations[0], dilations[1]),
    )  # fmt: skip
    return kernel_, nodes


__all__ = ["MaxPoolScatter", "split_max_pool_scatters"]
