"""The flipped filters of Convs' input gradients, copied natively on the CPU.

The input gradient of a Conv of stride 1 is the Conv of the output gradient with the filters
transposed and turned by 180 degrees (:func:`traingraph.autodiff.rules.conv.flipped_weight`):
``Slice(Transpose(W, perm=[1, 0, 2, 3]))`` with steps of -1 along both spatial axes, which
onnxruntime runs as two passes that index every element (a 256 x 256 x 3 x 3 filter: about
1.8 ms on one thread). :class:`FlippedFilter` writes the same values in one native strided copy
(:func:`~traingraph.runtime.cpu.kernels.permutes.permute` with the spatial axes reversed; the
threads share its rows of nine floats). Where the Winograd kernel takes the Conv, it reads the
parameter in place instead (:mod:`traingraph.runtime.cpu.kernels.winograd`); this kernel takes
the flips left to onnxruntime's Convs (dilated ones, small odd planes, planes whose size shape
inference leaves open), which then read a filter of the step's inputs, whose blocked reorder
the segmented run copies natively too (:mod:`traingraph.runtime.cpu.kernels.permutes`); where
that reorder alone reads the flipped filters, the two copies are one (:class:`FlippedReorder`).
Values are copied, so NaN and infinities stay as they are; the load-time check compares the
flip with the graph's nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.kernels.permutes import FilterReorder, permute
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

_DEFAULT = ("", "ai.onnx")


@dataclass(frozen=True)
class FlippedFilter(OneOutput):
    """``out = weight.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]`` for 3 x 3 filters.

    Attributes:
        weight: The Conv's filters ``[K, C, 3, 3]``.
        out: The flipped filters ``[C, K, 3, 3]``.
    """

    weight: str
    out: str

    @property
    def inputs(self) -> list[str]:
        return [self.weight]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        weight = values[self.weight]
        if weight.ndim != 4 or weight.shape[2:] != (3, 3):
            raise ValueError(
                f"flipped filter {self.out!r}: weight {list(weight.shape)} must be [K, C, 3, 3]"
            )
        k, c = weight.shape[:2]
        target = output_array(out, self.out, (c, k, 3, 3))
        # both spatial axes reversed: the nine taps of each filter back to front
        permute(np.ascontiguousarray(weight, np.float32), target, [k, c, 9], [1, 0, 2], threads,
                reversed_axes=(2,))  # fmt: skip


@dataclass(frozen=True)
class FlippedReorder:
    """A :class:`FlippedFilter`'s filters reordered by a
    :class:`~traingraph.runtime.cpu.kernels.permutes.FilterReorder` (for onnxruntime's blocked
    Conv), in one strided copy of the parameter.

    Attributes:
        weight: The Conv's filters ``[K, C, 3, 3]``.
        reorder: The reorder of the flipped filters ``[C, K, 3, 3]``; its ``out`` is this
            kernel's.
    """

    weight: str
    reorder: FilterReorder

    @property
    def inputs(self) -> list[str]:
        return [self.weight]

    @property
    def outputs(self) -> list[str]:
        return [self.reorder.out]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        weight = np.ascontiguousarray(values[self.weight], np.float32)
        if weight.ndim != 4 or weight.shape[2:] != (3, 3):
            raise ValueError(
                f"flipped filter {self.reorder.out!r}: weight {list(weight.shape)} must be"
                " [K, C, 3, 3]"
            )
        reorder = self.reorder
        layout = composed_layout(reorder.dims, reorder.perm, weight.shape[0], weight.shape[1])
        if layout is None:  # blocks across the flipped filters' axes: two copies
            flipped: dict[str, np.ndarray] = {}
            FlippedFilter(self.weight, reorder.src).compute({self.weight: weight}, flipped, threads)
            reorder.compute(flipped, out, threads)
            return
        dims, perm, reversed_axes = layout
        target = output_array(out, reorder.out, reorder.shape)
        permute(weight, target, dims, perm, threads, reversed_axes=reversed_axes)


def composed_layout(
    dims: Sequence[int], perm: Sequence[int], k: int, c: int
) -> tuple[list[int], list[int], tuple[int, ...]] | None:
    """``(dims', perm', reversed)`` with ``W.reshape(dims')`` read back to front along
    ``reversed`` and transposed by ``perm'`` equal to ``flipped(W).reshape(dims).transpose(perm)``
    for filters ``W`` ``[k, c, 3, 3]``, where ``dims`` splits the flipped filters' axes
    ``[c, k, 9]`` each into whole parts; None where a part spans two of them.

    The flipped filters are ``W`` with its first two axes exchanged and its nine taps read
    back to front; reading a split axis back to front is reading each of its parts so."""
    sizes = (c, k, 9)
    groups: list[list[int]] = [[], [], []]  # dims' indices in each of c, k and the taps
    axis, left = 0, sizes[0]
    for index, size in enumerate(dims):
        while left == 1 and axis < 2:  # this axis is whole: the next one
            axis += 1
            left = sizes[axis]
        if left % size:
            return None
        groups[axis].append(index)
        left //= size
    if left != 1 or axis != 2:
        return None
    order = groups[1] + groups[0] + groups[2]  # W's axes: k, c, taps
    place = {index: position for position, index in enumerate(order)}
    return (
        [dims[i] for i in order],
        [place[i] for i in perm],
        tuple(place[i] for i in groups[2]),
    )


def split_flipped_filters(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[FlippedFilter, set[int]]]:
    """Each flipped 3 x 3 filter of ``model`` (see the module) whose Transpose and Slice are not
    in ``taken``, of a float32 model input, as a :class:`FlippedFilter` with the indices of the
    two nodes, checked numerically. ``[]`` where the extension is missing (the kernels between
    segments need it) or nothing matches."""
    if NATIVE is None:
        return []
    graph = model.graph
    if not any(n.op_type == "Slice" for n in graph.node) or graph_match.has_subgraphs(model):
        return []
    g = graph_match.GraphIndex.of(graph)
    shapes = graph_match.inferred_shapes(model)
    constants = graph_match.constant_values(graph)
    inputs = {i.name for i in graph.input}
    matches = []
    for i, node in enumerate(g.nodes):
        if i in taken or node.op_type != "Slice" or node.domain not in _DEFAULT:
            continue
        consumers = g.consumers.get(node.output[0], set())
        if not consumers or node.output[0] in g.outputs or consumers & taken:
            continue
        found = flipped_source(g, node.output[0], taken, constants, readers=False)
        if found is None or found[0] not in inputs:
            continue
        dims = shapes.get(found[0])
        if dims is None or len(dims) != 4 or None in dims or dims[2:] != [3, 3]:
            continue
        matches.append((FlippedFilter(found[0], node.output[0]), found[1]))
    return verify.verified_kernels(model, g, matches, shapes)


def flipped_source(
    g: graph_match.GraphIndex,
    weight: str,
    taken: Set[int],
    constants: Mapping[str, np.ndarray],
    readers: bool = True,
) -> tuple[str, set[int]] | None:
    """Where ``weight`` is ``Slice(Transpose(w, perm=[1, 0, 2, 3]))`` reversing both spatial
    axes of a 3 x 3 filter (a Conv's input gradient) and nothing else reads the Transpose,
    ``w`` and the indices of the two nodes; else None. With ``readers``, one node alone (the
    Conv) must read ``weight`` too."""
    if weight not in g.producer or (readers and g.only_reader(weight, taken) is None):
        return None
    flip = g.nodes[g.producer[weight]]
    if flip.op_type != "Slice" or flip.domain not in _DEFAULT or len(flip.input) != 5:
        return None
    if any(v not in constants for v in flip.input[1:]):
        return None
    starts, ends, axes, steps = (constants[v].reshape(-1).tolist() for v in flip.input[1:])
    if sorted(a % 4 for a in axes) != [2, 3] or any(s != -1 for s in steps):
        return None
    # along an axis of 3, a step of -1 from the last place (start 2 or more, or -1) past the
    # first (end -4 or less) takes the axis whole and reversed
    if any(not (s >= 2 or s == -1) or e > -4 for s, e in zip(starts, ends)):
        return None
    swapped = flip.input[0]
    if swapped not in g.producer or g.only_reader(swapped, taken) is None:
        return None
    swap = g.nodes[g.producer[swapped]]
    perm = next((list(a.ints) for a in swap.attribute if a.name == "perm"), None)
    if swap.op_type != "Transpose" or swap.domain not in _DEFAULT or perm != [1, 0, 2, 3]:
        return None
    nodes = {g.producer[weight], g.producer[swapped]}
    return (swap.input[0], nodes) if not nodes & taken else None


__all__ = ["FlippedFilter", "flipped_source", "split_flipped_filters"]
