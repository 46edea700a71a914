"""A ConvTranspose as ``Col2Im(MatMul(W^T, G)) [+ B]``: onnxscript rewriter rules for the CPU.

For ``Y = ConvTranspose(G [N, M, O...], W [M, C, k...])`` the columns are
``cols[n, c * K + k, o] = sum_m W[m, c, k] * G[n, m, o]`` (``K = prod(k)``), one batched
MatMul over every sample, and Col2Im adds column ``o`` of kernel offset ``k`` at image position
``o * s + k * d - p``, which is ConvTranspose's definition. The image has ConvTranspose's output
size ``(O - 1) * s + output_padding + extent - p_begin - p_end``; Col2Im fits exactly ``O``
windows into it when every ``output_padding`` is below its stride. onnxruntime's ConvTranspose
kernel computes the same sums one sample at a time, a GEMM per sample too small to use the cores
well (``benchmarks/conv_grad_micro.py`` times both forms).

:data:`RULES` rewrite an ungrouped float32 ConvTranspose (onnxruntime's CPU Col2Im is float32
only) of the default domain whose geometry is static (:func:`geometry`), in a model whose
default opset is at least :data:`COL2IM_OPSET` (Col2Im's first), on a model whose values carry
their inferred shapes. Grouped ones stay: their per-group products are too thin for one batched
MatMul to use the cores better than ConvTranspose's own kernel.

Example:
    >>> modified = rewrites.rules_pass(RULES)(ir_model).modified  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

COL2IM_OPSET = 18
"""The first default opset with Col2Im."""


def geometry(
    attributes: Mapping[str, Any],
    grad: Sequence[int | None] | None,
    weight: Sequence[int | None] | None,
) -> tuple[list[int], list[int], int] | None:
    """``(image size, kernel, M)`` of a ConvTranspose that :data:`RULES` rewrite, else None:
    one group, explicit pads (no ``auto_pad``, no ``output_shape``), static spatial input and
    weight shapes, and every ``output_padding`` below its stride.

    Args:
        attributes: The node's attributes by name (strings as ``str``, lists of ints).
        grad: The input's shape (None for a dimension not known), or None.
        weight: The weight's shape, likewise.
    """
    if "output_shape" in attributes or attributes.get("auto_pad", "NOTSET") not in ("", "NOTSET"):
        return None
    if attributes.get("group", 1) != 1:
        return None
    if grad is None or weight is None or len(grad) < 3 or len(weight) != len(grad):
        return None
    n = len(grad) - 2
    given = list(attributes["kernel_shape"]) if "kernel_shape" in attributes else weight[2:]
    spatial = [d for d in grad[2:] if d is not None]
    kernel = [k for k in given if k is not None]
    filters = weight[0]
    if len(spatial) < n or len(kernel) < n or filters is None or grad[1] not in (None, filters):
        return None

    def ints(key: str, default: int, count: int) -> list[int]:
        return [int(v) for v in attributes[key]] if key in attributes else [default] * count

    strides, dilations = ints("strides", 1, n), ints("dilations", 1, n)
    pads, out_pad = ints("pads", 0, 2 * n), ints("output_padding", 0, n)
    image = []
    for i in range(n):
        extent = (kernel[i] - 1) * dilations[i] + 1
        size = (spatial[i] - 1) * strides[i] + out_pad[i] + extent - pads[i] - pads[i + n]
        if out_pad[i] >= strides[i] or size < 1:
            return None
        image.append(size)
    return image, kernel, filters


def _dims(value: ir.Value) -> list[int | None] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape.dims]


def _geometry_of(g: ir.Value, w: ir.Value, y: ir.Value) -> tuple[list[int], list[int], int] | None:
    node = y.producer()
    if node is None or node.domain not in ("", "ai.onnx") or g.dtype != ir.DataType.FLOAT:
        return None
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    return geometry(attributes, _dims(g), _dims(w))


def _conv_transpose(op: Any, g: ir.Value, w: ir.Value) -> ir.Value:
    return op.ConvTranspose(g, w, _allow_other_attributes=True, _outputs=["y"])


def _conv_transpose_with_bias(op: Any, g: ir.Value, w: ir.Value, b: ir.Value) -> ir.Value:
    return op.ConvTranspose(g, w, b, _allow_other_attributes=True, _outputs=["y"])


def _fits(context: Any, g: ir.Value, w: ir.Value, y: ir.Value, **_: Any) -> bool:
    opsets = context.model.opset_imports
    opset = opsets.get("", opsets.get("ai.onnx", 1))
    return opset >= COL2IM_OPSET and _geometry_of(g, w, y) is not None


def _col2im(op: Any, g: ir.Value, w: ir.Value, y: ir.Value, b: ir.Value | None = None) -> ir.Value:
    """The columns (one batched MatMul), the Col2Im, and the bias added where there is one;
    the new values are named after ``y``."""
    found = _geometry_of(g, w, y)
    node = y.producer()
    assert found is not None and node is not None
    image, kernel, filters = found
    n = len(image)
    name = f"{y.name}_col2im"

    def constant(values: list[int], key: str) -> ir.Value:
        tensor = ir.Tensor(np.array(values, np.int64), name=f"{name}_{key}")
        return op.initializer(tensor, name=f"{name}_{key}")

    positions = op.Reshape(
        g, constant([0, filters, -1], "positions_shape"), _outputs=[f"{name}_positions"]
    )
    # W^T as a tensor of its own ([M, C*K, 1] -> [C*K, 1, M]): a Transpose of two axes that
    # feeds a MatMul is fused into it as a transposed operand, which onnxruntime multiplies
    # one to two times as slowly as a plain one
    rows = op.Reshape(
        w, constant([filters, -1, 1], "weight_shape"), _outputs=[f"{name}_weight_rows"]
    )
    moved = op.Transpose(rows, perm=[1, 2, 0], _outputs=[f"{name}_weight_moved"])
    weight = op.Reshape(
        moved, constant([-1, filters], "weight_columns"), _outputs=[f"{name}_weight"]
    )
    columns = op.MatMul(weight, positions, _outputs=[f"{name}_columns"])
    attributes = node.attributes
    image_out = op.Col2Im(
        columns, constant(image, "image"), constant(kernel, "block"),
        pads=list(attributes.get_ints("pads", [0] * 2 * n)),
        strides=list(attributes.get_ints("strides", [1] * n)),
        dilations=list(attributes.get_ints("dilations", [1] * n)),
        _outputs=[f"{name}_image_out" if b is not None else f"{name}_image_y"],
    )  # fmt: skip
    if b is None:
        return image_out
    bias = op.Reshape(b, constant([-1] + [1] * n, "bias_shape"), _outputs=[f"{name}_bias"])
    return op.Add(image_out, bias)


_TARGETS: list[tuple[Callable[..., ir.Value], str]] = [
    (_conv_transpose, "conv_transpose_as_col2im"),
    (_conv_transpose_with_bias, "conv_transpose_with_bias_as_col2im"),
]
RULES: tuple[pattern.RewriteRule, ...] = tuple(
    pattern.RewriteRule(target, _col2im, _fits, name=name) for target, name in _TARGETS
)
"""ConvTranspose, without and with a bias, as Col2Im."""

__all__ = ["COL2IM_OPSET", "RULES", "geometry"]
