"""Training-mode BatchNormalization forward passes, run natively on the CPU between segments.

A training graph holds a training-mode BatchNormalization as what the ONNX specification
defines (:mod:`traingraph.autodiff.lowering`): ``mean = ReduceMean(x)``,
``var = ReduceMean((x - mean)^2)`` and an inference-mode BatchNormalization with them, often
followed by a Relu, or by a residual Add and a Relu. onnxruntime runs that as six or seven passes
over the activations. :class:`BatchNormForward` makes two, a channel at a time, the second while
the channel is still in the cache: the statistics, then the normalized, scaled and shifted
values with the residual added and the Relu applied. It writes the mean and variance the graph's
running-statistics update reads. Each match is checked against the nodes it replaces on random
inputs.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

import onnx
from onnx import numpy_helper

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, Outputs, output_array
from traingraph.runtime.rewrites import specialize

KERNEL = "batch_norm_forward"
"""The tag of a lowered training-mode BatchNormalization."""

_DEFAULT = ("", "ai.onnx")


@dataclass(frozen=True)
class BatchNormForward:
    """``out = Relu(BatchNormalization(x, scale, bias, mean, var) + addend)`` with the batch
    statistics ``mean`` and ``var`` of ``x`` (over every axis but 1, kept as ``[1, C, 1...]``),
    without the Relu where ``relu`` is False and without the addend where it is None.

    Attributes:
        x: The input ``[N, C, ...]``.
        scale: The scale ``[C]``.
        bias: The bias ``[C]``.
        addend: A value of ``x``'s shape added after the normalization, or None.
        mean: The batch mean the graph's ReduceMean writes.
        var: The biased batch variance the graph's second ReduceMean writes.
        out: The value the kernel writes: the BatchNormalization's output, the Add's or the
            Relu's.
        epsilon: The BatchNormalization's epsilon.
        relu: Whether a Relu is applied last.
    """

    x: str
    scale: str
    bias: str
    addend: str | None
    mean: str
    var: str
    out: str
    epsilon: float
    relu: bool

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.scale, self.bias] + ([self.addend] if self.addend else [])

    @property
    def outputs(self) -> list[str]:
        return [self.out, self.mean, self.var]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out``, ``mean`` and ``var`` into ``out`` (in place where arrays of their
        shapes are there)."""
        x = values[self.x]
        if x.ndim < 2:
            raise ValueError(
                f"batch norm {self.out!r}: x {list(x.shape)} must be [N, C, ...] (rank 2 or"
                " more)"
            )
        stats = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        for name, shape in ((self.out, x.shape), (self.mean, stats), (self.var, stats)):
            output_array(out, name, shape)
        assert NATIVE is not None
        NATIVE.batch_norm_forward(
            x,
            values[self.scale],
            values[self.bias],
            values[self.addend] if self.addend else None,
            out[self.out],
            out[self.mean].reshape(-1),
            out[self.var].reshape(-1),
            self.epsilon,
            self.relu,
            threads,
        )


def split_batch_norm_forwards(
    model: onnx.ModelProto,
    taken: Set[int] = frozenset(),
    make: Callable[..., BatchNormForward] | None = None,
) -> list[tuple[BatchNormForward, set[int]]]:
    """Each lowered training-mode BatchNormalization of ``model`` (with the Relu, or the Add and
    the Relu, after it) that :class:`BatchNormForward` computes, with the indices of the nodes
    it replaces, none in ``taken``. ``[]`` where the extension is missing or nothing
    matches. ``make`` builds each kernel from :class:`BatchNormForward`'s fields (another
    device's kernel, checked the same way); by default the native one."""
    native = NATIVE
    if make is None and (native is None or not hasattr(native, "batch_norm_forward")):
        return []
    graph = model.graph
    if not any(n.op_type == "BatchNormalization" for n in graph.node):
        return []
    if any(graph_match.has_subgraph(n) for n in graph.node):
        return []
    shapes = graph_match.inferred_shapes(model)
    g = graph_match.GraphIndex.of(graph)
    constants = specialize.constant_tensors(graph)
    matches = graph_match.claim_matches(  # an Add of two of them goes with the first
        g,
        "BatchNormalization",
        taken,
        lambda i, claimed: _match(g, i, shapes, constants, claimed, make or BatchNormForward),
        KERNEL,
    )
    offsets = {kernel.x: 1.5 for kernel, _ in matches}  # statistics off zero
    return verify.verified_kernels(model, g, matches, shapes, offsets)


def _reduced_axes(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> list[int]:
    """The axes a ReduceMean reduces (from its attribute or its constant input), kept dims
    only; [] where they are not known."""
    attrs = {a.name: a for a in node.attribute}
    if "keepdims" in attrs and attrs["keepdims"].i != 1:
        return []
    if "axes" in attrs:
        return list(attrs["axes"].ints)
    if len(node.input) > 1 and node.input[1] in constants:
        return [int(v) for v in numpy_helper.to_array(constants[node.input[1]]).ravel()]
    return []


def _match(
    g: graph_match.GraphIndex,
    i: int,
    shapes: Mapping[str, list[int | None]],
    constants: Mapping[str, onnx.TensorProto],
    taken: Set[int],
    make: Callable[..., BatchNormForward],
) -> tuple[BatchNormForward, set[int]] | None:
    """The kernel of the BatchNormalization at ``i`` where its mean and variance are the
    lowered batch statistics of its input."""
    node = g.nodes[i]
    attrs = {a.name: a for a in node.attribute}
    if "training_mode" in attrs and attrs["training_mode"].i != 0:
        return None
    if len(node.input) != 5 or len([o for o in node.output if o]) != 1:
        return None
    x, scale, bias, mean_in, var_in = node.input
    shape = shapes.get(x)
    if shape is None or len(shape) < 2 or shape[1] is None:
        return None
    axes = [0, *range(2, len(shape))]
    found = []
    for value in (mean_in, var_in):
        squeeze = g.produced_by(value, "Squeeze", taken)
        reduce = squeeze and g.produced_by(squeeze[1].input[0], "ReduceMean", taken)
        if not reduce:
            return None
        reduced = sorted(a % len(shape) for a in _reduced_axes(reduce[1], constants))
        if reduced != axes:
            return None
        found.append(reduce)
    (mean_i, mean_node), (var_i, var_node) = found
    mean = mean_node.output[0]
    if mean_node.input[0] != x:
        return None
    square = g.produced_by(var_node.input[0], "Mul", taken)
    centered = (
        square
        and square[1].input[0] == square[1].input[1]
        and g.produced_by(square[1].input[0], "Sub", taken)
    )
    if not square or not centered or list(centered[1].input) != [x, mean]:
        return None
    nodes = {i, mean_i, var_i}
    if g.only_reader(centered[1].output[0]) == square[0] and g.only_reader(
        square[1].output[0]
    ) == var_i:
        nodes |= {square[0], centered[0]}  # else they stay, reading the kernel's mean
    epsilon = attrs["epsilon"].f if "epsilon" in attrs else 1e-5
    out, addend, relu = node.output[0], None, False
    after = g.only_reader(out, taken)
    if after is not None and _is_relu(g.nodes[after]):
        out, relu = g.nodes[after].output[0], True
        nodes.add(after)
    elif after is not None and g.nodes[after].op_type == "Add":
        total = g.nodes[after]
        other = total.input[1] if total.input[0] == out else total.input[0]
        last = g.only_reader(total.output[0], taken)
        same = shapes.get(other) == shape and None not in shape[1:]
        default = total.domain in _DEFAULT
        if default and other != out and same and last is not None and _is_relu(g.nodes[last]):
            addend, out, relu = other, g.nodes[last].output[0], True
            nodes |= {after, last}
    kernel = make(x, scale, bias, addend, mean, var_node.output[0], out, epsilon, relu)
    return kernel, nodes


def _is_relu(node: onnx.NodeProto) -> bool:
    return node.op_type == "Relu" and node.domain in _DEFAULT


__all__ = ["BatchNormForward", "split_batch_norm_forwards"]
