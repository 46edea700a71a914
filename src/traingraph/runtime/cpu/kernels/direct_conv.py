"""A network's first convolutions, run natively on the CPU before the first segment.

The first Conv of an image network reads few channels (1 for grey images, 3 for colour).
onnxruntime's blocked (NCHWc) convolution pads such a Conv's filters to its block of 8 or 16,
computes the padded ones too, and reorders its output back to NCHW, after which the Relu is
one more pass: for LeNet's first layer (1 channel, 6 filters of 5 x 5) about five times the
arithmetic's time.

:class:`DirectConv` computes ``Conv`` (and the ``Relu`` that is the only reader of its output)
directly, a block of filters by a row of outputs at a time in vector registers. It replaces a
Conv whose inputs the graph reads from outside (the data, the weights, the bias), so it runs
before the first onnxruntime segment and adds no cut. Each match is checked against the nodes
it replaces on random inputs.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

MAX_CHANNELS = 4
"""Input channels up to which a Conv runs directly; with more, onnxruntime's blocked
convolution fills its vectors along the channels."""


@dataclass(frozen=True)
class DirectConv(OneOutput):
    """``out = Conv(x, weight, bias)`` with strides and dilations 1 and one group, then Relu
    where ``relu``.

    Attributes:
        x: The Conv's input ``[N, C, H, W]``.
        weight: Its filters ``[M, C, KH, KW]``.
        bias: Its bias ``[M]``, or None.
        out: The value the kernel writes: the Conv's output, or the Relu's.
        pads: Top, left, bottom and right pads.
        relu: Whether the Relu after the Conv is applied.
    """

    x: str
    weight: str
    bias: str | None
    out: str
    pads: tuple[int, int, int, int]
    relu: bool

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.weight] + ([self.bias] if self.bias else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x, weight = values[self.x], values[self.weight]
        top, left, bottom, right = self.pads
        if x.ndim != 4 or weight.ndim != 4:
            raise ValueError(
                f"conv {self.out!r}: x {list(x.shape)} and weight {list(weight.shape)} must be"
                " 4-D ([N, C, H, W] and [M, C, KH, KW])"
            )
        shape = (
            x.shape[0],
            weight.shape[0],
            x.shape[2] + top + bottom - weight.shape[2] + 1,
            x.shape[3] + left + right - weight.shape[3] + 1,
        )
        target = output_array(out, self.out, shape)
        assert NATIVE is not None
        NATIVE.conv_direct(
            x,
            weight,
            values[self.bias] if self.bias else None,
            target,
            (top, left),
            self.relu,
            threads,
        )


def split_direct_convs(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[DirectConv, set[int]]]:
    """Each Conv of ``model`` (with the Relu that alone reads it) that :class:`DirectConv`
    computes, with the indices of the nodes it replaces, none in ``taken``: 2-D float Convs
    of at most :data:`MAX_CHANNELS` input channels, strides and dilations 1 and one group,
    whose inputs are all graph inputs. ``[]`` where the extension is missing or nothing
    matches."""
    native = NATIVE
    if native is None or not hasattr(native, "conv_direct"):
        return []
    graph = model.graph
    inputs = {i.name for i in graph.input}
    if not any(_candidate(n, inputs) for n in graph.node):
        return []
    if any(graph_match.has_subgraph(n) for n in graph.node):
        return []
    shapes = graph_match.inferred_shapes(model)
    g = graph_match.GraphIndex.of(graph)
    matches = []
    for i, node in enumerate(g.nodes):
        if i in taken or not _candidate(node, inputs):
            continue
        match = _match(g, i, shapes, taken)
        if match is not None:
            matches.append(match)
    return verify.verified_kernels(model, g, matches, shapes)


def _candidate(node: onnx.NodeProto, inputs: Set[str]) -> bool:
    return (
        node.op_type == "Conv"
        and node.domain in ("", "ai.onnx")
        and len(node.input) >= 2
        and all(v in inputs for v in node.input if v)
    )


def _match(
    g: graph_match.GraphIndex,
    i: int,
    shapes: Mapping[str, list[int | None]],
    taken: Set[int],
) -> tuple[DirectConv, set[int]] | None:
    node = g.nodes[i]
    x, weight = shapes.get(node.input[0]), shapes.get(node.input[1])
    if x is None or weight is None or len(x) != 4 or len(weight) != 4 or None in weight:
        return None
    if int(weight[1] or 0) > MAX_CHANNELS or x[1] != weight[1]:
        return None
    attrs = {a.name: a for a in node.attribute}
    ints = {name: list(a.ints) for name, a in attrs.items() if a.type == onnx.AttributeProto.INTS}
    auto_pad = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
    group = attrs["group"].i if "group" in attrs else 1
    if auto_pad not in ("NOTSET", "VALID") or group != 1:
        return None
    if any(v != 1 for v in ints.get("strides", []) + ints.get("dilations", [])):
        return None
    if "kernel_shape" in ints and ints["kernel_shape"] != list(weight[2:]):
        return None
    pads = ints.get("pads", [0, 0, 0, 0]) if auto_pad == "NOTSET" else [0, 0, 0, 0]
    if len(pads) != 4 or min(pads) < 0:
        return None
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out, relu, nodes = node.output[0], False, {i}
    reader = g.only_reader(out, taken)
    if reader is not None and _is_relu(g.nodes[reader]):
        out, relu = g.nodes[reader].output[0], True
        nodes.add(reader)
    return DirectConv(node.input[0], node.input[1], bias, out, tuple(pads), relu), nodes


def _is_relu(node: onnx.NodeProto) -> bool:
    return node.op_type == "Relu" and node.domain in ("", "ai.onnx")


__all__ = ["MAX_CHANNELS", "DirectConv", "split_direct_convs"]
