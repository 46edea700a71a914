"""Mixed precision: float16 or bfloat16 compute with float32 master weights.

:func:`autocast` rewrites a forward graph so that its compute-heavy ops (MatMul, Gemm, Conv)
run in a low-precision type while the parameters stay float32: a ``Cast`` is inserted where a
float32 value enters such an op, elementwise and data-movement ops follow their inputs, and
numerically sensitive ops (Softmax, normalizations, Exp/Log/Pow, reductions, and every op this
module does not know) get float32 inputs; BatchNormalization reads and writes its activations in
float16 where its input is float16, with float32 statistics. The autodiff then differentiates
through the Casts, so the gradient of each float32 parameter arrives in float32.

Float16 has a small range (about 6e-5 to 65504), so small gradients underflow. Loss scaling
multiplies the loss by ``S`` before differentiation (the backward pass then carries ``S`` times
the gradients) and divides the float32 gradients by ``S`` again:

.. math::

    g = \\frac{1}{S} \\nabla_\\theta (S \\cdot L)

A scale too large overflows to inf; :func:`unscale_gradients` therefore also returns one boolean
"all gradients finite", with which the runtime's
:class:`~traingraph.runtime.amp.DynamicLossScaler` skips the step and lowers ``S``.

Example:
    >>> generate_artifacts("model.onnx", loss=LossType.CrossEntropyLoss,
    ...                    optimizer=OptimType.AdamW, mixed_precision="fp16")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir

from traingraph.errors import ModelError
from traingraph.ir.builder import OpBuilder

__all__ = [
    "GRADS_FINITE",
    "LOSS_SCALE",
    "LOW_PRECISION_OPS",
    "autocast",
    "low_precision_type",
    "scale_loss",
    "unscale_gradients",
]

LOSS_SCALE = "loss_scale"
GRADS_FINITE = "grads_finite"

_TYPES = {
    "fp16": ir.DataType.FLOAT16,
    "float16": ir.DataType.FLOAT16,
    "bf16": ir.DataType.BFLOAT16,
    "bfloat16": ir.DataType.BFLOAT16,
}

# Run in the low-precision type: the ops whose cost dominates and whose tensor-core kernels
# accumulate in float32.
LOW_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

# Take the type of their inputs: exact in any type (data movement, max/min, sign changes), or
# elementwise with a bounded result.
FOLLOW_OPS = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu",
        "Celu", "Gelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Erf", "Clip", "Max",
        "Min", "Where", "Identity", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze",
        "Concat", "Split", "Slice", "Gather", "GatherElements", "Expand", "Tile", "Pad",
        "MaxPool", "AveragePool", "Dropout", "Sum", "Resize", "DepthToSpace", "SpaceToDepth",
        "Shape", "Size",
    }
)  # fmt: skip

# bfloat16 runs only the products in low precision: onnxruntime's CUDA provider has no
# bfloat16 kernels for several ops that gradients use (Greater in Relu's, Pad in Slice's), and
# ONNX allows bfloat16 Conv only from opset 22 on.
_BF16_OPS = frozenset({"MatMul", "Gemm"})
_BF16_CONV_SINCE = 22

# Inputs of FOLLOW_OPS that hold the data; the others (Dropout's ratio, Resize's scales)
# keep their own type.
_DATA_INPUTS = {"Dropout": (0,), "Resize": (0,)}


def low_precision_type(name: str) -> ir.DataType:
    """``"fp16"``/``"float16"`` or ``"bf16"``/``"bfloat16"`` -> the ONNX data type.

    Raises:
        ModelError: For any other name.
    """
    if name not in _TYPES:
        raise ModelError(
            f"unknown mixed precision {name!r}; expected 'fp16' or 'bf16' (or None for float32)"
        )
    return _TYPES[name]


def _is_cheap(value: ir.Value) -> bool:
    """Whether ``value`` is a weight or a constant, which is cast rather than promoted."""
    producer = value.producer()
    return value.const_value is not None or (
        producer is not None and producer.op_type == "Constant"
    )


def autocast(graph: ir.Graph, opset: int, dtype: ir.DataType) -> int:
    """Run ``graph``'s compute in ``dtype`` (float16 or bfloat16), in place.

    Every value of the graph must have its dtype set (run shape inference first). Float32
    values entering a :data:`LOW_PRECISION_OPS` op are cast to ``dtype`` (for bfloat16: MatMul
    and Gemm, and Conv/ConvTranspose from opset 22 on, and no op follows them). An op of
    :data:`FOLLOW_OPS` with a low-precision input runs in ``dtype`` too, its float32 weights and
    constants cast down; where it meets a float32 activation, both go to float32 (as PyTorch's
    autocast promotes). Every other op gets float32 inputs. Graph outputs keep their float32
    type and name.

    Args:
        graph: A forward graph (parameters still initializers, no loss yet).
        opset: The model's opset.
        dtype: ``ir.DataType.FLOAT16`` or ``ir.DataType.BFLOAT16``.

    Returns:
        The number of Cast nodes inserted.
    """
    if dtype not in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        raise ModelError(f"autocast needs FLOAT16 or BFLOAT16, got {dtype}")
    b = OpBuilder(graph, opset, prefix="autocast")
    casts: dict[tuple[int, ir.DataType], ir.Value] = {}
    floats = (ir.DataType.FLOAT, dtype)
    low_ops, follow_ops = LOW_PRECISION_OPS, FOLLOW_OPS
    if dtype == ir.DataType.BFLOAT16:
        convs = {"Conv", "ConvTranspose"} if opset >= _BF16_CONV_SINCE else set()
        low_ops, follow_ops = _BF16_OPS | convs, frozenset()

    def cast(value: ir.Value, to: ir.DataType) -> ir.Value:
        key = (id(value), to)
        if key not in casts:
            out = b.cast(value, to)
            out.shape = value.shape
            casts[key] = out
        return casts[key]

    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type == "Cast":
            continue
        indices = _DATA_INPUTS.get(node.op_type, range(len(node.inputs)))
        data = [
            (i, v)
            for i in indices
            if i < len(node.inputs)
            and (v := node.inputs[i]) is not None
            and v.dtype in floats
        ]
        if not data:
            continue
        if node.op_type == "BatchNormalization" and follow_ops:
            _batch_norm_inputs(node, dtype, opset, cast)
            continue
        target: ir.DataType
        if node.op_type in low_ops:
            target = dtype
        elif node.op_type in follow_ops:
            low = any(v.dtype == dtype for _, v in data)
            promote = any(v.dtype == ir.DataType.FLOAT and not _is_cheap(v) for _, v in data)
            target = dtype if low and not promote else ir.DataType.FLOAT
        else:
            target = ir.DataType.FLOAT
        for i, v in data:
            if v.dtype != target:
                node.replace_input_with(i, cast(v, target))
        if target == dtype:
            for out in node.outputs:
                if out.dtype == ir.DataType.FLOAT:
                    out.dtype = dtype
    for index, out in enumerate(list(graph.outputs)):
        if out.dtype == dtype:
            restored = b.cast(out, ir.DataType.FLOAT)
            restored.shape = out.shape
            name = out.name
            out.name = f"{name}_{dtype.name.lower()}"
            restored.name = name
            graph.outputs[index] = restored
            casts[(id(out), ir.DataType.FLOAT)] = restored
    graph.sort()
    return len(casts)


def _batch_norm_inputs(
    node: ir.Node, dtype: ir.DataType, opset: int, cast: Callable[[ir.Value, ir.DataType], ir.Value]
) -> None:
    """Type a BatchNormalization as :func:`autocast` does: in ``dtype`` where its input is,
    else in float32.

    In ``dtype``, an inference-mode node takes every input in ``dtype``. A training-mode node
    keeps its running statistics (``input_mean``, ``input_var`` and the updated outputs)
    float32, as ONNX allows from opset 14 on, and its scale and bias too from opset 15 on:
    the lowering (:mod:`traingraph.autodiff.lowering`) and the gradient compute the batch
    statistics and the per-channel sums in float32 and only read and write the activations
    in ``dtype``.
    """
    x = node.inputs[0]
    low = x is not None and x.dtype == dtype
    attr = node.attributes.get("training_mode")
    training = attr is not None and bool(attr.value)
    for i, v in enumerate(node.inputs):
        if v is None or v.dtype not in (ir.DataType.FLOAT, dtype):
            continue
        target = ir.DataType.FLOAT
        if low and (i == 0 or not training or (i < 3 and opset < 15)):
            target = dtype
        if v.dtype != target:
            node.replace_input_with(i, cast(v, target))
    if low:
        node.outputs[0].dtype = dtype


def scale_loss(graph: ir.Graph) -> ir.Value:
    """Add the float32 scalar graph input :data:`LOSS_SCALE`: the loss gradient's seed.

    Differentiating with ``loss_seed`` set to it computes the gradients of
    ``loss_scale * loss``.
    """
    scale = ir.Value(
        name=LOSS_SCALE, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT)
    )
    graph.inputs.append(scale)
    return scale


def unscale_gradients(
    b: OpBuilder, grads: Sequence[ir.Value], scale: ir.Value
) -> tuple[list[ir.Value], ir.Value]:
    """Divide each gradient by ``scale`` and test them all for inf and NaN.

    Finiteness uses ``x * 0``, which is 0 for a finite ``x`` and NaN for inf or NaN: the sum of
    ``g * 0`` over every gradient is NaN exactly when some element is not finite.

    Returns:
        The unscaled gradients and a boolean scalar, true when every element is finite.
    """
    unscaled = []
    probes = []
    for g in grads:
        u = b.Div(g, b.cast_like(scale, g))
        unscaled.append(u)
        probe = b.reduce("ReduceSum", b.Mul(u, b.scalar(0.0, like=u)), None, keepdims=False)
        probes.append(probe if u.dtype == ir.DataType.FLOAT else b.cast(probe, ir.DataType.FLOAT))
    total = probes[0] if len(probes) == 1 else b.op("Sum", *probes)
    finite = b.op("Not", b.op("IsNaN", total))
    finite.dtype = ir.DataType.BOOL
    finite.shape = ir.Shape([])
    return unscaled, finite
