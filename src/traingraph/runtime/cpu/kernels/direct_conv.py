"""A network's first convolutions, run natively on the CPU before the first segment.

The first Conv of an image network reads few channels (1 for grey images, 3 for colour).
onnxruntime's blocked (NCHWc) convolution pads such a Conv's filters to its block of 8 or 16,
computes the padded ones too, and reorders its output back to NCHW, after which the Relu is
one more pass: for LeNet's first layer (1 channel, 6 filters of 5 x 5) about five times the
arithmetic's time.

:class:`DirectConv` computes ``Conv`` (and the ``Relu`` that is the only reader of its output)
directly, a block of filters by a row of outputs at a time in vector registers. It replaces a
Conv whose inputs the graph reads from outside (the data, the weights, the bias), so it runs
before the first onnxruntime segment and adds no cut. Its nodes are the matches of the rules
of :data:`traingraph.runtime.cpu.patterns.FIRST_CONV`; each match is checked against the nodes
it replaces on random inputs.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import onnx

from traingraph.runtime.cpu import patterns, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

MAX_CHANNELS = patterns.DIRECT_CONV_CHANNELS
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
    """Each first Conv of ``model`` (with the Relu that alone reads it) that :class:`DirectConv`
    computes, the matches of :data:`traingraph.runtime.cpu.patterns.FIRST_CONV`, with the
    indices of the nodes it replaces, none in ``taken``. ``[]`` where the extension is missing
    or nothing matches."""
    native = NATIVE
    if native is None or not hasattr(native, "conv_direct"):
        return []
    found = patterns.find(model, patterns.FIRST_CONV, taken)
    if found.index is None or not found.matches:
        return []
    matches = [(_kernel(match), set(match.nodes)) for match in found.matches]
    return verify.verified_kernels(model, found.index, matches, found.shapes)


def _kernel(match: patterns.Match) -> DirectConv:
    """The kernel of a match of :data:`~traingraph.runtime.cpu.patterns.FIRST_CONV`."""
    conv = match.values["conv"]
    node = conv.producer() if conv is not None else None
    assert node is not None
    pads = patterns.conv_pads(node)
    assert pads is not None  # the rule's check
    x, weight, *rest = [v.name if v is not None else None for v in node.inputs]
    assert x is not None and weight is not None
    out = match.name("relu") or match.name("conv")
    assert out is not None
    return DirectConv(x, weight, rest[0] if rest else None, out, pads, match.rule == "conv_relu")


__all__ = ["MAX_CHANNELS", "DirectConv", "split_direct_convs"]
