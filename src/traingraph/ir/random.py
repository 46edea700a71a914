r"""Training-mode Dropout as standard integer and elementwise ops.

onnxruntime's CPU ``Dropout`` draws one number at a time from a Mersenne twister, a serial
chain that one thread walks element by element. :func:`lower_dropout` writes a training-mode
Dropout as a counter-based hash instead: every element gets the hash of its position and a
per-step seed,

.. math::
    h_0 = (i \cdot G + s) \bmod 2^{32}, \quad
    h \leftarrow h (h + 1), \ h \leftarrow h + (h \gg 16), \ h \leftarrow h K, \
    h \leftarrow h + (h \gg 16), \\
    \text{keep}_i = [h < (1 - p) \, 2^{32}], \quad y = x \cdot \text{keep} / (1 - p)

with :math:`G` the 32-bit golden ratio and :math:`K` the first multiplier of MurmurHash3's
finalizer, all modulo :math:`2^{32}`. The product :math:`h (h + 1)` is the non-linear step
(opsets before 18 have no exclusive or); tests check the keep rate and the independence of
neighbouring elements and of successive Dropouts. Each pass is a vectorized elementwise
kernel, so the whole mask costs a few memory passes. The seed :math:`s` comes from one
``RandomUniform`` draw per step, shared by the graph's Dropouts with a distinct offset each.
The gradient of the lowered form is ``g * keep / (1 - p)``, the same as Dropout's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder, rank
from traingraph.ir.fold import constant_value
from traingraph.ir.tags import tagging

GOLDEN = 0x9E3779B9
MIX = 0x85EBCA6B
NODE_OFFSET = 0x632BE5AB  # seeds of successive Dropouts differ by this odd constant
SEED_OUTPUT = "dropout_seed"  # name hint of the per-step seed value
DRAWS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli")
"""The random ops that draw from a distribution their attributes (or input) give."""


def lower_dropout(b: OpBuilder, nodes: list[ir.Node]) -> int:
    """Replace each training-mode ``Dropout`` in ``nodes`` by the hash form; return how many.

    A node is lowered when its ratio is a constant in ``[0, 1)``, its ``training_mode`` a
    constant True and its mask output unused; other Dropouts stay as they are. A ratio of 0
    becomes an Identity.
    """
    seed: ir.Value | None = None
    lowered = 0
    for node in nodes:
        ratio = _ratio(node)
        if ratio is None:
            continue
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            continue  # the model reads the mask itself
        if ratio == 0.0:
            out = b.Identity(x)
        else:
            if seed is None:
                seed = _step_seed(b)
            with tagging(b, "dropout_mask", node.name or f"Dropout{lowered}"):
                start = b.Add(seed, b.const(np.int64(lowered * NODE_OFFSET % 2**32)))
                keep = _keep_mask(b, x, start, 1.0 - ratio)
                keep = b.cast(keep, x.dtype or ir.DataType.FLOAT)
            out = b.Mul(x, b.Mul(keep, b.scalar(1.0 / (1.0 - ratio), x)))
        out.shape, out.type = y.shape, y.type
        y.replace_all_uses_with(out, replace_graph_outputs=True)
        name, y.name = y.name, None
        out.name = name
        b.graph.remove(node, safe=True)
        lowered += 1
    return lowered


def _ratio(node: ir.Node) -> float | None:
    """The constant drop ratio of a training-mode Dropout, else None."""
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
        return None
    inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
    training = constant_value(inputs[2]) if inputs[2] is not None else None
    if training is None or not bool(training):
        return None
    ratio = 0.5 if inputs[1] is None else constant_value(inputs[1])
    if ratio is None or not 0.0 <= float(ratio) < 1.0:
        return None
    return float(ratio)


def _step_seed(b: OpBuilder) -> ir.Value:
    """A fresh int64 seed in ``[0, 2^48)`` per run, from two 24-bit uniform draws."""
    draws = b.op(
        "RandomUniform", shape=[2], dtype=ir.DataType.FLOAT, low=0.0, high=2.0**24, name=SEED_OUTPUT
    )
    high, low = b.op(
        "Split", b.op("Cast", draws, to=ir.DataType.INT64), b.ints([1, 1]), num_outputs=2, axis=0
    )
    return b.squeeze(b.Add(b.Mul(high, b.const(np.int64(2**24))), low), [0])


def _keep_mask(b: OpBuilder, x: ir.Value, start: ir.Value, keep: float) -> ir.Value:
    """Bool tensor of ``x``'s shape, True with probability ``keep`` per element."""
    h = _hashed_positions(b, x, start)
    h = b.Mul(h, b.Add(h, b.const(np.uint32(1))))
    for multiplier in (MIX, None):
        h = b.Add(h, b.op("BitShift", h, b.const(np.uint32(16)), direction="RIGHT"))
        if multiplier is not None:
            h = b.Mul(h, b.const(np.uint32(multiplier)))
    threshold = b.const(np.uint32(min(round(keep * 2**32), 2**32 - 1)))
    return b.reshape_like(b.Less(h, threshold), x)


def _hashed_positions(b: OpBuilder, x: ir.Value, start: ir.Value) -> ir.Value:
    """``(i * G + start) mod 2^32`` for each flat position ``i`` of ``x``, as uint32.

    With ``C`` the last dimension, position ``i = r * C + c`` gives ``r * (C G) + (c G + s)``:
    two short ranges added with broadcasting, one vectorized pass over the whole tensor
    (a ``Range`` over every element is a slow scalar loop). The ranges depend on the shape
    only, so with static shapes they fold to constants, and the seed enters through one
    addition on the ``C`` column values: no shape arithmetic is left in a CUDA graph step.
    """
    golden = b.const(np.int64(GOLDEN))
    zero = b.const(np.int64(0))
    uint32 = ir.DataType.UINT32
    seed = b.op("Cast", start, to=uint32)
    r = rank(x)
    if not r:  # a scalar, or the rank is unknown: one range over every element
        count = b.op("Size", x)
        positions = b.op("Cast", b.Range(zero, b.Mul(count, golden), golden), to=uint32)
        return b.Add(positions, seed)
    columns = b.Max(b.squeeze(b.shape(x, -1), [0]), b.const(np.int64(1)))
    rows = (
        b.reduce("ReduceProd", b.shape(x, 0, -1), [0], keepdims=False)
        if r > 1
        else b.const(np.int64(1))
    )
    stride = b.Mul(columns, golden)
    within = b.Add(b.op("Cast", b.Range(zero, stride, golden), to=uint32), seed)
    across = b.op("Cast", b.Range(zero, b.Mul(rows, stride), stride), to=uint32)
    return b.Add(b.unsqueeze(across, [1]), b.unsqueeze(within, [0]))
