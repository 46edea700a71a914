"""Sums over the leading axes of a large value, row by row on the CPU.

A Conv's weight gradient left to the graph (``conv_grads.DENSE_ON_NARROW``) is a batched
product, one ``[C, K]`` slice per sample, then a ``ReduceSum`` over the samples; a bias's
gradient sums over the batch too. onnxruntime's CPU ReduceSum over the leading axes adds the
slices one after another, but where the slices are long, several times slower than the adds
themselves (``[16, 1, 1152, 128]`` over axis 0 on a 2-core AVX2 machine: 3.2-4.9 ms against
0.4-0.5 ms). :class:`BatchSum` adds them with numpy's ``add.reduce`` over the outer axis,
which adds each slice into the running sum in order: each sum is the graph's, term by term in
its order (the same bits, infinities included, and NaN where the graph has NaN: the sign of a
NaN made of an Inf minus an Inf may differ, as the operands' order of each add decides).

It is taken where each slice holds at least :data:`LEAST_SLICE` values (the slices then stay
numpy's inner loop); the load-time check (:func:`traingraph.runtime.cpu.verify.verified_kernels`)
compares it with the node, on finite values and with NaN and infinities.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import Arrays, OneOutput, Outputs, output_array

LEAST_SLICE = 4096
"""The fewest values of a slice (the product of the axes kept) where :class:`BatchSum` is
taken: below it the graph's ReduceSum, whose cost is not per slice, stays."""


@dataclass(frozen=True)
class BatchSum(OneOutput):
    """``out = x[0] + x[1] + ... `` over the ``leading`` first axes of ``x``, added in order.

    Attributes:
        x: The value summed.
        leading: How many leading axes are summed.
        keepdims: Whether ``out`` keeps them as dims of one.
        out: The sum.
    """

    x: str
    leading: int
    keepdims: bool
    out: str

    @property
    def inputs(self) -> list[str]:
        return [self.x]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x = values[self.x]
        if x.ndim <= self.leading:
            raise ValueError(
                f"batch sum {self.out!r}: x {list(x.shape)} must have more than"
                f" {self.leading} axes"
            )
        kept = x.shape[self.leading :]
        shape = (1,) * self.leading + kept if self.keepdims else kept
        target = output_array(out, self.out, shape).reshape(-1)
        rows = np.ascontiguousarray(x).reshape(-1, math.prod(kept))
        # numpy reduces the outer axis of a C-contiguous array slice after slice, each into
        # the running sum (not pairwise: that is for the inner axis), as the graph does
        with np.errstate(all="ignore"):  # infinities and NaN are added as the graph adds them
            np.add.reduce(rows, axis=0, out=target)


def split_batch_sums(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[BatchSum, set[int]]]:
    """Each float32 ``ReduceSum`` of ``model`` over its input's leading axes (none in
    ``taken``) whose kept axes hold at least :data:`LEAST_SLICE` values, as a
    :class:`BatchSum` with its node's index."""
    graph = model.graph
    if not any(n.op_type == "ReduceSum" for n in graph.node) or graph_match.has_subgraphs(model):
        return []
    g = graph_match.GraphIndex.of(graph)
    candidates = [
        i for i, n in enumerate(g.nodes)
        if i not in taken and n.op_type == "ReduceSum" and n.domain in ("", "ai.onnx")
    ]  # fmt: skip
    if not candidates:
        return []
    shapes = graph_match.inferred_shapes(model)
    constants = graph_match.constant_values(graph)
    matches = []
    for i in candidates:
        kernel = _match(g.nodes[i], shapes, constants)
        if kernel is not None:
            matches.append((kernel, {i}))
    return verify.verified_kernels(model, g, matches, shapes)


def _match(
    node: onnx.NodeProto,
    shapes: Mapping[str, list[int | None]],
    constants: Mapping[str, np.ndarray],
) -> BatchSum | None:
    attrs = {a.name: a for a in node.attribute}
    keepdims = attrs["keepdims"].i != 0 if "keepdims" in attrs else True
    if not node.input or len(node.output) != 1 or not node.output[0]:
        return None
    shape = shapes.get(node.input[0])
    if shape is None or len(shape) < 2:
        return None
    if "axes" in attrs:  # opset 11 and before
        axes = list(attrs["axes"].ints)
    elif len(node.input) > 1 and node.input[1] in constants:
        axes = [int(a) for a in np.asarray(constants[node.input[1]]).reshape(-1)]
    else:
        return None  # no axes: every axis (or none, with noop_with_empty_axes)
    leading = sorted(a % len(shape) for a in axes)
    if not leading or leading != list(range(len(leading))) or len(leading) == len(shape):
        return None
    kept = shape[len(leading) :]
    if any(d is None for d in kept) or math.prod(d or 0 for d in kept) < LEAST_SLICE:
        return None
    return BatchSum(node.input[0], len(leading), keepdims, node.output[0])


__all__ = ["LEAST_SLICE", "BatchSum", "split_batch_sums"]
