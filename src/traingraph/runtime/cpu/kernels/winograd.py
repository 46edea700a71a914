"""3 x 3 convolutions of stride 1, run natively on the CPU by Winograd's minimal filtering.

A ResNet spends most of its step in 3 x 3 convolutions of stride 1 and pads 1: the forward
Convs, and their input gradients, which the training graph writes as the same convolution of
the output gradient with the filters flipped and transposed. onnxruntime computes each as a
blocked direct convolution, 9 multiplications per output and channel pair.
:class:`WinogradConv` makes 4 by F(2 x 2, 3 x 3): each 4 x 4 input patch and each filter are
transformed, the 16 places multiplied and summed over the channels as as many matrix products,
and the sums transformed back into the 2 x 2 outputs (``_convc.conv_winograd`` with tile 2). A
Sum or Add that alone reads the Conv's output (the two gradient paths of a residual block
meeting) is added as the outputs are written. Where the filters are a parameter transposed and
turned by 180 degrees for this Conv alone (an input gradient's ``Slice(Transpose(W))``), the
kernel reads the parameter in place and turns each filter as it transforms it: the same values
the graph's two copies give, without them.

It replaces a Conv wherever it sits: it runs between the segments, after the values it reads
are written. Each match is checked against the nodes it replaces on random inputs. The
channels are summed in runs of 64 whose sums are then added, so that F(2 x 2, 3 x 3)'s results
stay within 1.3 times onnxruntime's Conv's distance from the exact sums from 64 to 2048
channels (one float32 run over the channels is 2 to 2.5 times as far at 512, 4 times at 2048).
F(4 x 4, 3 x 3) (2.25 multiplications per output and channel pair) is not used for these
Convs: its transforms' larger coefficients give a rounding error about an order of
magnitude above a direct convolution's, and a BatchNormalization over few values per channel
that follows the Conv amplifies the error of its output into every parameter gradient (the
weight-gradient kernel of :mod:`traingraph.runtime.cpu.kernels.conv_grads` does use F(4 x 4, 3 x
3): its
result feeds only the optimizer). Where the
output holds a NaN or an Inf (read from the input, the filters or the addend, or an
overflow), the Conv is computed again as the direct sums, which propagate them as the Conv's
do.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.kernels.flipped_filter import flipped_source
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

_DEFAULT = ("", "ai.onnx")
_TILE = 2  # F(2 x 2, 3 x 3): within about twice a direct convolution's rounding
_ODD_PLANE_CHANNELS = 56
"""The least ``C K / (C + K)`` (input and output channels) of a Conv over an odd plane that the
kernel takes. The products grow as ``C K``, the patch and output transforms as ``C + K``; an odd
plane adds the copies to and from the padded plane and its extra tiles. Measured at batch 8,
two threads, against onnxruntime's Conv of a filter that is a graph input: 256 and 256
channels over 7 x 7 1.8 times as fast, 128 and 128 over 13 x 13 1.3 times; 16 and 64 over
23 x 23 (SqueezeNet's expand Convs, 12.8) 0.65 times, 64 and 256 over 5 x 5 (51) 0.77 times.
Against the blocked Conv the step would run instead (:mod:`traingraph.runtime.rewrites.nchwc`)
it is at about parity alone, and ahead in the step, where it reads the parameter in place of
the flipped and reordered copies (benchmarks/RESULTS.md)."""
_ODD_PLANE_SIDE = 7
"""The least height and width of an odd plane the kernel takes: below, the padded plane's
extra tiles (16 for 9 outputs at 3 x 3) and the filters' transform, whose cost does not shrink
with the plane, outweigh the products (512 and 512 channels at batch 8: 0.65 times the speed of
onnxruntime's Conv of a filter input over 3 x 3, 0.75 over 5 x 5, 1.17 over 7 x 7)."""


@dataclass(frozen=True)
class WinogradConv(OneOutput):
    """``out = Conv(x, weight, bias) + addend`` for 3 x 3 filters, strides and dilations 1,
    pads 1 and one group; without the bias or the addend where they are None. An odd height
    or width is computed over the plane one row or column larger, zeros there, and cut back.

    Attributes:
        x: The Conv's input ``[N, C, H, W]``.
        weight: Its filters ``[K, C, 3, 3]``.
        bias: Its bias ``[K]``, or None.
        addend: A value of the output's shape added to it, or None.
        out: The value the kernel writes: the Conv's output, or the Sum's.
        flipped: Whether ``weight`` is ``[C, K, 3, 3]`` and the filters are
            ``weight.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]``.
    """

    x: str
    weight: str
    bias: str | None
    addend: str | None
    out: str
    flipped: bool = False

    @property
    def inputs(self) -> list[str]:
        optional = [v for v in (self.bias, self.addend) if v]
        return [self.x, self.weight, *optional]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        x, weight = values[self.x], values[self.weight]
        if x.ndim != 4 or weight.ndim != 4:
            raise ValueError(
                f"conv {self.out!r}: x {list(x.shape)} and weight {list(weight.shape)} must be"
                " 4-D ([N, C, H, W] and [K, C, 3, 3])"
            )
        shape = (x.shape[0], weight.shape[1 if self.flipped else 0], x.shape[2], x.shape[3])
        target = output_array(out, self.out, shape)
        native = NATIVE
        assert native is not None
        bias = values[self.bias] if self.bias else None
        addend = values[self.addend] if self.addend else None
        native.conv_winograd(x, weight, bias, addend, target, threads, _TILE, self.flipped)
        if not np.isfinite(target).all():
            # A NaN or Inf read: the transforms spread it over whole tiles (and make NaN of
            # an Inf), where the Conv's sums keep it to the outputs whose windows read it.
            if self.flipped:
                weight = np.ascontiguousarray(weight.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
            native.conv_direct(x, weight, bias, target, (1, 1), False, threads)
            if addend is not None:
                with np.errstate(invalid="ignore"):  # Inf + -Inf: NaN, as the graph's Sum
                    np.add(target, addend, out=target)


def split_winograd_convs(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[WinogradConv, set[int]]]:
    """Each Conv of ``model`` (with the Sum or Add that alone reads it) that
    :class:`WinogradConv` computes, with the indices of the nodes it replaces, none in
    ``taken``: 2-D float Convs of 3 x 3 filters, strides and dilations 1, pads 1 and one group
    over a height and width known from shape inference (odd ones of enough channels and
    size, :data:`_ODD_PLANE_CHANNELS`, :data:`_ODD_PLANE_SIDE`). ``[]`` where the extension is
    missing or nothing matches."""
    if not graph_match.can_match(model, "conv_winograd", "Conv"):
        return []
    graph = model.graph
    shapes = graph_match.inferred_shapes(model)
    g = graph_match.GraphIndex.of(graph)
    constants = graph_match.constant_values(graph)
    matches = graph_match.claim_matches(
        g, "Conv", taken, lambda i, claimed: _match(g, i, shapes, claimed, constants)
    )
    # A Conv's bias is [K] (the ONNX spec) where inference left it open (a zero bias an
    # exporter writes as an Expand): the check feeds it at that length.
    refined = dict(shapes)
    for kernel, _ in matches:
        if kernel.bias and None in (refined.get(kernel.bias) or [None]):
            refined[kernel.bias] = [shapes[kernel.weight][0]]
    return verify.verified_kernels(model, g, matches, refined)


def _match(
    g: graph_match.GraphIndex,
    i: int,
    shapes: Mapping[str, list[int | None]],
    taken: Set[int],
    constants: Mapping[str, np.ndarray],
) -> tuple[WinogradConv, set[int]] | None:
    node = g.nodes[i]
    if len(node.input) < 2 or len([o for o in node.output if o]) != 1:
        return None
    x, weight = shapes.get(node.input[0]), shapes.get(node.input[1])
    if x is None or weight is None or len(x) != 4 or len(weight) != 4:
        return None
    if weight[2:] != [3, 3] or weight[1] is None or x[1] != weight[1] or weight[0] is None:
        return None
    height, width = x[2], x[3]
    if height is None or width is None:
        return None
    channels, filters = weight[1], weight[0]
    if (height % 2 or width % 2) and (
        min(height, width) < _ODD_PLANE_SIDE
        or channels * filters < _ODD_PLANE_CHANNELS * (channels + filters)
    ):
        return None
    attrs = {a.name: a for a in node.attribute}
    ints = {name: list(a.ints) for name, a in attrs.items() if a.type == onnx.AttributeProto.INTS}
    auto_pad = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
    group = attrs["group"].i if "group" in attrs else 1
    if group != 1 or any(v != 1 for v in ints.get("strides", []) + ints.get("dilations", [])):
        return None
    if "kernel_shape" in ints and ints["kernel_shape"] != [3, 3]:
        return None
    same = auto_pad in ("SAME_UPPER", "SAME_LOWER")
    if not same and (auto_pad != "NOTSET" or ints.get("pads") != [1, 1, 1, 1]):
        return None
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out, addend, nodes = node.output[0], None, {i}
    reader = g.only_reader(out, taken)
    if reader is not None:
        total = g.nodes[reader]
        if total.op_type in ("Sum", "Add") and total.domain in _DEFAULT and len(total.input) == 2:
            other = total.input[1] if total.input[0] == out else total.input[0]
            if other != out and shapes.get(other) == shapes.get(out) == [
                x[0], weight[0], height, width
            ]:
                addend, out = other, total.output[0]
                nodes.add(reader)
    source = flipped_source(g, node.input[1], taken, constants, shapes)
    if source is not None and source.group == 1:
        return WinogradConv(node.input[0], source.weight, bias, addend, out, True), (
            nodes | source.nodes
        )
    return WinogradConv(node.input[0], node.input[1], bias, addend, out), nodes


__all__ = ["WinogradConv", "split_winograd_convs"]
