"""LayerNormalization gradients, run natively on the CPU between onnxruntime segments.

onnxruntime runs a LayerNormalization's forward as one op, but the training graph writes its
gradient as about twenty elementwise nodes and reductions (the row statistics recomputed, the
two means of the scaled output gradient, dx from them, and the sums over the rows that give the
scale's and bias's gradients), each a pass over the activation. :class:`LayerNormGrad`
computes them in one pass over each row while it is in the cache (``_convc.layer_norm_grad``).

:func:`split_layer_norm_grads` finds, for each LayerNormalization over the last axis whose bias
gradient the graph returns, the nodes computed from the input, the scale and the output's
gradient alone that lead to the gradients of the input, the scale and the bias; each match is
checked against its nodes on random inputs.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import onnx

from traingraph.autodiff.rules.normalization import INSTANCE_NORM_GRAD as INSTANCE_KERNEL
from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import (
    NATIVE,
    Arrays,
    NormalizationGrad,
    Outputs,
    output_array,
)

KERNEL = "layer_norm_grad"
"""The tag of the nodes of a LayerNormalization's gradient."""


@dataclass(frozen=True)
class LayerNormGrad(NormalizationGrad):
    """The gradient of one LayerNormalization over the last axis."""

    @property
    def inputs(self) -> list[str]:
        """The input, the output's gradient, and the scale where ``dx`` is computed (only
        ``dx`` reads it: a LayerNormalization of a graph input has no ``dx``)."""
        return [self.x, self.dy] + ([self.scale] if self.dx else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``dx``, ``dscale`` and ``dbias`` into ``out`` (arrays there are written in
        place; missing ones are allocated) from ``values``."""
        x = values[self.x]
        features = x.shape[-1:] if x.ndim else (0,)
        scale = values[self.scale] if self.dx else np.ones(features, np.float32)
        inputs = [x, values[self.dy], scale]
        self.run_native("layer_norm_grad", inputs, out, features, self.epsilon, threads)


def split_layer_norm_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[LayerNormGrad, set[int]]]:
    """Each LayerNormalization gradient of ``model`` the native kernel computes, with the
    indices of the nodes it replaces (none in ``taken``); ``[]`` where the extension is missing
    or nothing matches."""
    if not graph_match.can_match(model, "layer_norm_grad", "LayerNormalization"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    shapes = graph_match.inferred_shapes(model)
    found = []
    for node in g.nodes:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            if not g.made_for(node, KERNEL):
                continue
            match = _match(g, node, shapes)
            if match is not None and not match[1] & taken:
                found.append(match)
    return verify.verified_kernels(model, g, found, shapes)


def _match(
    g: graph_match.GraphIndex, ln: onnx.NodeProto, shapes: Mapping[str, list[int | None]]
) -> tuple[LayerNormGrad, set[int]] | None:
    """The gradient of ``ln`` where the graph computes it from its input, scale and output
    gradient alone."""
    if len(ln.input) < 3 or not ln.input[2]:
        return None
    x, scale, bias = ln.input[:3]
    x_shape = shapes.get(x)
    attrs = graph_match.attributes(ln)
    if not x_shape or x_shape[-1] is None or attrs.get("axis", -1) not in (-1, len(x_shape) - 1):
        return None
    if int(attrs.get("stash_type", 1)) != 1:
        return None
    dbias = f"{bias}_grad"
    dy = g.summed_into(dbias)  # dbias = ReduceSum(dy) over the leading axes
    if dy is None or not _like(shapes.get(dy), x_shape):
        return None
    features = int(x_shape[-1])

    def row_value(name: str) -> bool:
        """Of x's shape, per row (x's with a last axis of 1) or per feature: what the gradient
        computes."""
        shape = shapes.get(name)
        if shape is None:
            return False
        if _like(shape, x_shape) or _like(shape, [*x_shape[:-1], 1]):
            return True
        return len(shape) <= len(x_shape) and list(shape[-1:]) == [features] and all(
            d == 1 for d in shape[:-1]
        )

    def like_x(name: str) -> bool:
        return _like(shapes.get(name), x_shape)

    found = g.normalization_grad(dy, {x, scale, dy}, row_value, like_x, dbias, f"{scale}_grad")
    if found is None:
        return None
    nodes, dx, dscale = found
    if dx is not None and not like_x(dx):
        return None
    epsilon = float(attrs.get("epsilon", 1e-5))
    return LayerNormGrad(x, scale, dy, epsilon, dx, dscale, dbias), nodes


@dataclass(frozen=True)
class InstanceNormGrad:
    """The input gradient of one InstanceNormalization (statistics over the axes after the
    second, for each sample and channel), which PyTorch's exporters also write for GroupNorm
    (over ``[N, groups, -1]``, with unit scale and the affine map after it).

    Each row of ``x`` ``[N, C, ...]`` flattened to ``[N, C, L]`` is standardized over its
    ``L`` values: its gradient is a LayerNormalization's over the last axis with a unit scale
    (the ``layer_norm_grad`` kernel), times the row's channel's scale, which enters ``dx``
    linearly.

    Attributes:
        x: The normalization's input.
        scale: Its per-channel scale.
        dy: The gradient of its output.
        epsilon: Its epsilon.
        dx: The gradient of ``x``.
    """

    x: str
    scale: str
    dy: str
    epsilon: float
    dx: str

    @property
    def inputs(self) -> list[str]:
        return [self.x, self.dy, self.scale]

    @property
    def outputs(self) -> list[str]:
        return [self.dx]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``dx`` into ``out`` (in place where an array of its shape is there)."""
        assert NATIVE is not None
        x = np.ascontiguousarray(values[self.x], np.float32)
        n, c = x.shape[:2]
        rows = x.reshape(n, c, -1)
        dy = np.ascontiguousarray(values[self.dy], np.float32).reshape(rows.shape)
        scale = np.asarray(values[self.scale], np.float32).reshape(-1)
        if scale.size != c:
            raise ValueError(
                f"instance norm {self.dx!r}: scale has {scale.size} values for {c} channels"
            )
        target = output_array(out, self.dx, x.shape)
        features = rows.shape[-1]
        sums = np.empty(features, np.float32)  # the unit scale's and bias's gradients: unread
        dx = target.reshape(rows.shape)
        ones = np.ones(features, np.float32)
        NATIVE.layer_norm_grad(rows, dy, ones, dx, None, sums, self.epsilon, threads)
        if not np.all(scale == 1.0):
            dx *= scale[None, :, None]


def split_instance_norm_grads(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[InstanceNormGrad, set[int]]]:
    """Each InstanceNormalization input gradient of ``model`` (the nodes the gradient rule
    tagged for it, :data:`~traingraph.autodiff.rules.normalization.INSTANCE_NORM_GRAD`) that
    reads the input, the scale, one output gradient of the input's shape and values computed
    from the input and the scale alone (statistics the kernel computes again), with none of its
    nodes in ``taken``; checked numerically. ``[]`` where the extension is missing or nothing
    matches."""
    if not graph_match.can_match(model, "layer_norm_grad", "InstanceNormalization"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    shapes = graph_match.inferred_shapes(model)
    found = []
    for node in g.nodes:
        if node.op_type != "InstanceNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        x, scale = node.input[:2]
        x_shape = shapes.get(x)
        if len(node.input) < 3 or x_shape is None or len(x_shape) < 3 or None in x_shape[1:]:
            continue
        # (the statistics the rule computes from x are read by the scale's gradient too where
        # the scale is trained: such nodes stay in the graph for it)
        tagged = g.tagged_gradient(INSTANCE_KERNEL, node.name, {x, scale})
        if tagged is None or tagged[0] & taken or len(tagged[2]) != 1:
            continue
        nodes, dy, (dx,) = tagged
        if not _like(shapes.get(dy), x_shape) or not _like(shapes.get(dx), x_shape):
            continue
        epsilon = float(graph_match.attributes(node).get("epsilon", 1e-5))
        found.append((InstanceNormGrad(x, scale, dy, epsilon, dx), nodes))
    return verify.verified_kernels(model, g, found, shapes)


def _like(shape: Sequence[int | None] | None, x_shape: Sequence[int | None]) -> bool:
    """Whether ``shape`` is ``x_shape``, an unknown dimension matching only an unknown one."""
    return shape is not None and list(shape) == list(x_shape)


__all__ = [
    "InstanceNormGrad",
    "LayerNormGrad",
    "split_instance_norm_grads",
    "split_layer_norm_grads",
]
