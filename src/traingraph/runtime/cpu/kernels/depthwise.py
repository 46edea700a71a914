"""The input gradient of a strided depthwise convolution, computed natively on the CPU.

The Conv rules write a strided Conv's input gradient as a ``ConvTranspose``
(:func:`traingraph.autodiff.rules.conv.conv_input_grad`); the CPU rewrite that turns it into a
MatMul and a ``Col2Im`` (:mod:`traingraph.runtime.rewrites.conv_transpose`) takes one group
only, and onnxruntime runs a ``ConvTranspose`` of one group per channel (MobileNet's and
EfficientNet's stride-2 depthwise layers) as a small GEMM per channel into columns and a
col2im, three to four times the time of the forward convolution.

:class:`DepthwiseConvTranspose` computes it with ``_convc.depthwise_conv_transpose``: each
input row gathered by column phase, the output gradient's columns read in contiguous runs, the
same products summed (in another order), each position that no tap reaches 0, as col2im leaves
it. The load-time check (:func:`traingraph.runtime.cpu.verify.verified_kernels`) compares it
with the node, with NaN and infinities among the inputs; a filter with a non-finite value is
summed tap by tap, so that only the products the graph forms enter the sums.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

KERNEL = "conv_input_grad"
"""The tag of the Conv input gradients' nodes (:mod:`traingraph.ir.tags`)."""


@dataclass(frozen=True)
class DepthwiseConvTranspose(OneOutput):
    """``out = ConvTranspose(dy, w, group=C)`` for ``w`` ``[C, 1, KH, KW]``, dilations 1.

    Attributes:
        dy: The Conv's output gradient ``[N, C, OH, OW]``.
        w: The Conv's filter.
        out: The Conv's input gradient ``[N, C, H, W]``.
        strides: The Conv's strides.
        pads: Its begin pads (top, left).
        size: ``(H, W)``, the input's spatial size.
    """

    dy: str
    w: str
    out: str
    strides: tuple[int, int]
    pads: tuple[int, int]
    size: tuple[int, int]

    @property
    def inputs(self) -> list[str]:
        return [self.dy, self.w]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        dy = values[self.dy]
        target = output_array(out, self.out, (dy.shape[0], dy.shape[1], *self.size))
        assert NATIVE is not None
        w = values[self.w]
        NATIVE.depthwise_conv_transpose(dy, w, target, self.strides, self.pads, threads)


def split_depthwise_conv_transposes(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[DepthwiseConvTranspose, set[int]]]:
    """Each 2-D ``ConvTranspose`` of float32 ``model`` with one group per channel (filter
    ``[C, 1, KH, KW]``), no bias, dilations 1 and static channel and spatial sizes, as a
    :class:`DepthwiseConvTranspose` with its node (not in ``taken``), checked numerically.
    ``[]`` where the extension is missing or nothing matches."""
    if not graph_match.can_match(model, "depthwise_conv_transpose", "ConvTranspose"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    shapes = graph_match.inferred_shapes(model)
    matches = []
    for i, node in enumerate(g.nodes):
        if i in taken or node.op_type != "ConvTranspose" or node.domain not in ("", "ai.onnx"):
            continue
        if not g.tagged(i, KERNEL):
            continue
        kernel = _match(node, shapes)
        if kernel is not None:
            matches.append((kernel, {i}))
    return verify.verified_kernels(model, g, matches, shapes)


def _match(
    node: onnx.NodeProto, shapes: Mapping[str, list[int | None]]
) -> DepthwiseConvTranspose | None:
    if len(node.input) != 2 or len(node.output) != 1:
        return None
    dy, w = node.input
    dy_dims, w_dims, out_dims = shapes.get(dy), shapes.get(w), shapes.get(node.output[0])
    if dy_dims is None or w_dims is None or out_dims is None:
        return None
    if len(dy_dims) != 4 or len(w_dims) != 4 or len(out_dims) != 4:
        return None
    if None in dy_dims[1:] or None in w_dims or None in out_dims[1:]:
        return None
    attrs = graph_match.attributes(node)
    channels = dy_dims[1]
    if attrs.get("group", 1) != channels or w_dims[:2] != [channels, 1]:
        return None
    if out_dims[1] != channels or list(attrs.get("dilations", [1, 1])) != [1, 1]:
        return None
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    strides = [int(s) for s in attrs.get("strides", [1, 1])]
    pads = [int(p) for p in attrs.get("pads", [0, 0, 0, 0])]
    if len(strides) != 2 or len(pads) != 4 or min(strides) < 1 or min(pads) < 0:
        return None
    size = (int(out_dims[2] or 0), int(out_dims[3] or 0))
    return DepthwiseConvTranspose(
        dy, w, node.output[0], (strides[0], strides[1]), (pads[0], pads[1]), size
    )


__all__ = ["DepthwiseConvTranspose", "split_depthwise_conv_transposes"]
