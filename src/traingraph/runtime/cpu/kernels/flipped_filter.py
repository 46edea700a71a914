"""The flipped filters of Convs' input gradients, copied natively on the CPU.

The input gradient of a Conv of stride 1 is the Conv of the output gradient with the filters
transposed and turned by 180 degrees (:func:`traingraph.autodiff.rules.conv.flipped_weight`):
``Slice(Transpose(W, perm=[1, 0, 2, 3]))`` with steps of -1 along the spatial axes (with
groups, each group's two axes exchanged by a Reshape, a Transpose and a Reshape), which
onnxruntime runs as passes that index every element (a 256 x 256 x 3 x 3 filter: about
1.8 ms on one thread; a grouped 400 x 16 x 3 x 3 one about 0.3 ms on two).
:class:`FlippedFilter` writes the same values in one native strided copy
(:func:`~traingraph.runtime.cpu.kernels.permutes.permute` with the taps reversed; the threads
share its rows of taps), for any 2-D kernel and any groups, of a parameter or of filters the
graph computes (standardized weights). Where the Winograd kernel takes the Conv, it reads the
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
    """The filters of a Conv's input gradient: ``weight`` ``[K, C / group, kh, kw]`` with each
    group's filter and channel axes exchanged and its taps read back to front, ``[C, K / group,
    kh, kw]`` (:func:`traingraph.autodiff.rules.conv.flipped_weight`).

    Attributes:
        weight: The Conv's filters.
        out: The flipped filters.
        group: The Conv's groups.
    """

    weight: str
    out: str
    group: int = 1

    @property
    def inputs(self) -> list[str]:
        return [self.weight]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        weight = _filters(values[self.weight], self.group, self.out)
        k, cg, kh, kw = weight.shape
        target = output_array(out, self.out, (self.group * cg, k // self.group, kh, kw))
        copied = _copy_flipped(weight, self.group, target.shape[:2] + (kh * kw,), [0, 1, 2],
                               target, threads)  # fmt: skip
        assert copied  # the flipped filters' own axes are whole pieces of the parameter's


def _filters(weight: np.ndarray, group: int, name: str) -> np.ndarray:
    """``weight`` as float32 ``[K, C / group, kh, kw]``, checked."""
    if weight.ndim != 4 or weight.shape[0] % group:
        raise ValueError(
            f"flipped filter {name!r}: weight {list(weight.shape)} must be [K, C / group, kh, kw]"
            f" with K divisible by the {group} groups"
        )
    return np.ascontiguousarray(weight, np.float32)


def _copy_flipped(
    weight: np.ndarray,
    group: int,
    dims: Sequence[int],
    perm: Sequence[int],
    target: np.ndarray,
    threads: int,
) -> bool:
    """Write ``flipped(weight).reshape(dims).transpose(perm)`` into ``target`` in one strided
    copy of ``weight`` (:func:`composed_layout`); False, writing nothing, where ``dims`` does
    not cut into whole pieces of the parameter's axes."""
    layout = composed_layout(dims, perm, weight.shape, group)
    if layout is None:
        return False
    source_dims, source_perm, reversed_axes = layout
    permute(weight, target, source_dims, source_perm, threads, reversed_axes=reversed_axes)
    return True


@dataclass(frozen=True)
class FlippedReorder:
    """A :class:`FlippedFilter`'s filters reordered by a
    :class:`~traingraph.runtime.cpu.kernels.permutes.FilterReorder` (for onnxruntime's blocked
    Conv), in one strided copy of the parameter.

    Attributes:
        weight: The Conv's filters ``[K, C / group, kh, kw]``.
        reorder: The reorder of the flipped filters ``[C, K / group, kh, kw]``; its ``out`` is
            this kernel's.
        group: The Conv's groups.
    """

    weight: str
    reorder: FilterReorder
    group: int = 1

    @property
    def inputs(self) -> list[str]:
        return [self.weight]

    @property
    def outputs(self) -> list[str]:
        return [self.reorder.out]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        reorder = self.reorder
        weight = _filters(values[self.weight], self.group, reorder.out)
        target = output_array(out, reorder.out, reorder.shape)
        if not _copy_flipped(weight, self.group, reorder.dims, reorder.perm, target, threads):
            # a part of the reorder's axes is not whole pieces of the parameter's: two copies
            flipped: dict[str, np.ndarray] = {}
            FlippedFilter(self.weight, reorder.src, self.group).compute(
                {self.weight: weight}, flipped, threads
            )
            reorder.compute(flipped, out, threads)


def composed_layout(
    dims: Sequence[int], perm: Sequence[int], shape: Sequence[int], group: int = 1
) -> tuple[list[int], list[int], tuple[int, ...]] | None:
    """``(dims', perm', reversed)`` with ``W.reshape(dims')`` read back to front along
    ``reversed`` and transposed by ``perm'`` equal to ``flipped(W).reshape(dims).transpose(perm)``
    for filters ``W`` of ``shape`` ``[K, C / group, kh, kw]``; None where an axis of ``dims``
    and an axis of the flipped filters overlap without one's size dividing the other's.

    The flipped filters' elements are ``[group, C / group, K / group, taps]`` in order, ``W``'s
    the same axes as ``[group, K / group, C / group, taps]``. Each axis of ``dims`` is cut into
    pieces that each lie in one of those four, so that both tensors are the same pieces in two
    orders; reading an axis back to front is reading each of its pieces so."""
    k, cg, kh, kw = shape
    sizes = (group, cg, k // group, kh * kw)  # the flipped filters' axes, outer to inner
    pieces: list[tuple[int, int]] = []  # (axis of sizes, size), in the flipped order
    owned: list[list[int]] = []  # the pieces of each axis of dims
    axis, left = 0, sizes[0]
    for size in dims:
        mine: list[int] = []
        while size > 1:
            while left == 1 and axis < 3:
                axis += 1
                left = sizes[axis]
            take = left if size % left == 0 else size if left % size == 0 else 0
            if take <= 1:
                return None
            mine.append(len(pieces))
            pieces.append((axis, take))
            left //= take
            size //= take
        if not mine:  # an axis of 1: anywhere
            mine.append(len(pieces))
            pieces.append((axis, 1))
        owned.append(mine)
    if left != 1 or any(s != 1 for s in sizes[axis + 1 :]):
        return None
    source = (0, 2, 1, 3)  # W's order of the four axes
    order = sorted(range(len(pieces)), key=lambda p: (source.index(pieces[p][0]), p))
    place = {piece: position for position, piece in enumerate(order)}
    return (
        [pieces[p][1] for p in order],
        [place[p] for axis_ in perm for p in owned[axis_]],
        tuple(place[p] for p in order if pieces[p][0] == 3),
    )


def split_flipped_filters(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[FlippedFilter, set[int]]]:
    """Each flipped filter of ``model`` (see the module) whose nodes are not in ``taken``, of a
    float32 model input, as a :class:`FlippedFilter` with the indices of its nodes, checked
    numerically. ``[]`` where the extension is missing (the kernels between segments need it)
    or nothing matches."""
    if NATIVE is None:
        return []
    graph = model.graph
    if not any(n.op_type == "Slice" for n in graph.node) or graph_match.has_subgraphs(model):
        return []
    g = graph_match.GraphIndex.of(graph)
    shapes = graph_match.inferred_shapes(model)
    constants = graph_match.constant_values(graph)
    matches = []
    for i, node in enumerate(g.nodes):
        if i in taken or node.op_type != "Slice" or node.domain not in _DEFAULT:
            continue
        consumers = g.consumers.get(node.output[0], set())
        if not consumers or node.output[0] in g.outputs or consumers & taken:
            continue
        found = flipped_source(g, node.output[0], taken, constants, shapes, readers=False)
        weight = shapes.get(found.weight) if found is not None else None
        if found is None or weight is None or None in weight:
            continue
        kernel = FlippedFilter(found.weight, node.output[0], found.group)
        matches.append((kernel, found.nodes))
    return verify.verified_kernels(model, g, matches, shapes)


@dataclass(frozen=True)
class FlipSource:
    """Where a Conv's filter is the flip of a parameter (:func:`flipped_source`).

    Attributes:
        weight: The parameter ``[K, C / group, kh, kw]``.
        nodes: The indices of the nodes that flip it.
        group: The Conv's groups.
    """

    weight: str
    nodes: set[int]
    group: int


def flipped_source(
    g: graph_match.GraphIndex,
    weight: str,
    taken: Set[int],
    constants: Mapping[str, np.ndarray],
    shapes: Mapping[str, Sequence[int | None]],
    readers: bool = True,
) -> FlipSource | None:
    """Where ``weight`` is the flip of a parameter ``w`` ``[K, C / group, kh, kw]`` as the
    gradient rule writes it (:func:`traingraph.autodiff.rules.conv.flipped_weight`): a Slice of
    steps -1 over the spatial axes longer than 1, each whole, of ``Transpose(w, perm=[1, 0, 2,
    3])``, or with groups of ``Reshape(Transpose(Reshape(w, [group, K / group, C / group, kh,
    kw]), perm=[0, 2, 1, 3, 4]), [C, K / group, kh, kw])``, with nothing else reading the
    values between: ``w``, the nodes and the groups; else None. With ``readers``, one node
    alone (the Conv) must read ``weight`` too."""
    if weight not in g.producer or (readers and g.only_reader(weight, taken) is None):
        return None
    flip = g.nodes[g.producer[weight]]
    if flip.op_type != "Slice" or flip.domain not in _DEFAULT or len(flip.input) != 5:
        return None
    if any(v not in constants for v in flip.input[1:]):
        return None
    shape = shapes.get(flip.input[0])
    if shape is None or len(shape) != 4 or None in shape:
        return None
    dims = [int(d or 0) for d in shape]
    starts, ends, axes, steps = (constants[v].reshape(-1).tolist() for v in flip.input[1:])
    if sorted(a % 4 for a in axes) != [axis for axis in (2, 3) if dims[axis] > 1]:
        return None
    # along an axis of k, a step of -1 from the last place (start k - 1 or more, or -1) past
    # the first (end -(k + 1) or less) takes the axis whole and reversed
    for axis, start, end, step in zip(axes, starts, ends, steps):
        size = dims[axis % 4]
        if step != -1 or not (start >= size - 1 or start == -1) or end > -(size + 1):
            return None
    found = _swap_source(g, flip.input[0], taken, constants)
    if found is None:
        return None
    source, nodes, group = found
    nodes = nodes | {g.producer[weight]}
    return None if nodes & taken else FlipSource(source, nodes, group)


def _swap_source(
    g: graph_match.GraphIndex, value: str, taken: Set[int], constants: Mapping[str, np.ndarray]
) -> tuple[str, set[int], int] | None:
    """``(w, nodes, group)`` where ``value`` is ``w`` with each group's first two axes exchanged
    (see :func:`flipped_source`) and only the next node reads each value between; else None."""

    def producer(name: str, op: str) -> onnx.NodeProto | None:
        if name not in g.producer or g.only_reader(name, taken) is None:
            return None
        node = g.nodes[g.producer[name]]
        return node if node.op_type == op and node.domain in _DEFAULT else None

    def perm(node: onnx.NodeProto) -> list[int] | None:
        return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)

    swap = producer(value, "Transpose")
    if swap is not None and perm(swap) == [1, 0, 2, 3]:
        return swap.input[0], {g.producer[value]}, 1
    outer = producer(value, "Reshape")
    if outer is None or outer.input[1] not in constants:
        return None
    regroup = producer(outer.input[0], "Transpose")
    if regroup is None or perm(regroup) != [0, 2, 1, 3, 4]:
        return None
    inner = producer(regroup.input[0], "Reshape")
    if inner is None or inner.input[1] not in constants:
        return None
    split = constants[inner.input[1]].reshape(-1).tolist()
    joined = constants[outer.input[1]].reshape(-1).tolist()
    if len(split) != 5 or len(joined) != 4 or split[0] < 1 or split[2] < 1:
        return None
    if joined[0] != split[0] * split[2] or joined[2:] != split[3:]:
        return None
    nodes = {g.producer[value], g.producer[outer.input[0]], g.producer[regroup.input[0]]}
    return inner.input[0], nodes, int(split[0])


__all__ = [
    "FlipSource",
    "FlippedFilter",
    "FlippedReorder",
    "flipped_source",
    "split_flipped_filters",
]
