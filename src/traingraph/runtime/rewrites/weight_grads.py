"""A Conv's weight gradient as one Conv, where cuDNN runs that form faster.

The Conv rule of the autodiff (:func:`traingraph.autodiff.rules.conv.conv_weight_grad`) writes
``dW[m, c, k] = sum_{n, o} G[n, m, o] * X[n, c, o * s + k - p]`` as the input unfolded into its
``K`` shifted views and one contraction, and tags those nodes ``conv_weight_grad`` with the
forward Conv's name (:mod:`traingraph.ir.tags`). The same sums are one Conv with the roles
exchanged: the input ``X`` transposed to ``[C, N, H, W]`` (the batch as channels), convolved
with the output gradient transposed to ``[M, N, H', W']`` as its filters, dilated by the
forward stride, gives ``[C, M, KH, KW]``: ``dW`` transposed. cuDNN runs that Conv in one
implicit GEMM whose cost grows with the filter, ``H' x W'`` positions: on an H100 it is the
fastest weight gradient of a 3 x 3 Conv of stride 1 or 2 whose output has at most 28 x 28
positions (ResNet-50 at batch 64: 0.33 against 0.76 ms for layer3's), and up to 100 times
slower on 56 x 56 outputs (``benchmarks/conv_grad_micro.py --device cuda``). Its result has
as many elements as the weight, and a small weight leaves most of the GPU idle: ResNet-8's
(at most 64 x 64 x 3 x 3) and LeNet's weight gradients take longer that way, and their steps
10-30% longer.

:func:`weight_grads_as_convs` replaces each tagged weight gradient of such a Conv (2-D, one
group, dilation 1, stride at most :data:`MAX_STRIDE`, a kernel larger than 1 x 1, at most
:data:`MAX_POSITIONS` output positions, at least :data:`MIN_WEIGHT` weight elements, static
shapes) by the exchanged Conv; the values are the same sums in another order. The CUDA
sessions apply it (:func:`traingraph.runtime.rewrites.specialize.for_cuda`); artifacts on
disk keep the portable form.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from traingraph.ir.tags import KEY

KERNEL = "conv_weight_grad"
"""The tag of a Conv's weight-gradient nodes."""
MAX_POSITIONS = 28 * 28
"""The most output positions per sample for which the exchanged Conv is used."""
MAX_STRIDE = 2
"""The largest forward stride for which the exchanged Conv is used."""
MIN_WEIGHT = 1 << 17
"""The fewest weight elements for which the exchanged Conv is used (ResNet-50's smallest 3 x 3
weight, 128 x 128 x 3 x 3, has 147,456)."""

Shapes = Mapping[str, list[int | None]]


def weight_grads_as_convs(graph: onnx.GraphProto, shapes: Shapes) -> bool:
    """Replace the tagged weight gradients that qualify (see the module docstring) by the
    exchanged Conv, in place; return whether any was."""
    regions = _tagged_regions(graph)
    if not regions:
        return False
    forwards: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == "Conv" and node.domain in ("", "ai.onnx") and KEY not in _keys(node):
            forwards.setdefault(node.name, []).append(node)
    constants = {t.name for t in graph.initializer}
    constants.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    outputs = {o.name for o in graph.output}
    removed: set[int] = set()
    added: dict[int, list[onnx.NodeProto]] = {}
    for instance, indices in regions.items():
        convs = forwards.get(instance, [])
        if len(convs) != 1:  # the forward Conv is not known by its name
            continue
        replacement = _exchanged(graph, convs[0], indices, shapes, constants, readers, outputs)
        if replacement is not None:
            # In the place of the node that wrote the gradient: what it read is written
            # before it, what reads the gradient after it.
            dw = replacement[-1].output[0]
            removed.update(indices)
            added[next(i for i in indices if dw in graph.node[i].output)] = replacement
    if not removed:
        return False
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i not in removed:
            nodes.append(node)
        nodes.extend(added.get(i, []))
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def _keys(node: onnx.NodeProto) -> set[str]:
    return {entry.key for entry in node.metadata_props}


def _tagged_regions(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The indices of each forward Conv's weight-gradient nodes, by the Conv's name."""
    regions: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for entry in node.metadata_props:
            if entry.key == KEY:
                kernel, _, instance = entry.value.partition(":")
                if kernel == KERNEL:
                    regions.setdefault(instance, []).append(i)
    return regions


def _exchanged(
    graph: onnx.GraphProto,
    conv: onnx.NodeProto,
    indices: list[int],
    shapes: Shapes,
    constants: set[str],
    readers: Mapping[str, list[int]],
    outputs: set[str],
) -> list[onnx.NodeProto] | None:
    """The nodes of the exchanged Conv that computes what the region ``indices`` computes,
    the weight gradient of ``conv``; None where it does not qualify."""
    region = set(indices)
    nodes = [graph.node[i] for i in indices]
    made = {o for n in nodes for o in n.output}
    x = conv.input[0]
    external = {v for n in nodes for v in n.input if v and v not in made and v not in constants}
    leaving = [
        o for o in made
        if o in outputs or any(r not in region for r in readers.get(o, []))
    ]  # fmt: skip
    if x not in external or len(external) != 2 or len(leaving) != 1:
        return None
    (g,) = external - {x}
    dw = leaving[0]
    x_shape, g_shape, w_shape = shapes.get(x), shapes.get(g), shapes.get(conv.input[1])
    window = _window(conv, x_shape, g_shape, w_shape)
    if window is None:
        return None
    pads, strides, kernel = window
    ends, crop = [], False
    for size, out, s, k, begin in zip(x_shape[2:], g_shape[2:], strides, kernel, pads[:2]):  # type: ignore[index]
        end = k + (out - 1) * s - size - begin  # type: ignore[operator]
        crop = crop or end < 0
        ends.append(max(end, 0))
    base = dw
    swap = [1, 0, 2, 3]
    xt, gt, grad = f"{base}_input_t", f"{base}_grad_t", f"{base}_exchanged"
    result = [
        helper.make_node("Transpose", [x], [xt], perm=swap, name=f"{base}_input_t"),
        helper.make_node("Transpose", [g], [gt], perm=swap, name=f"{base}_grad_t"),
        helper.make_node(
            "Conv", [xt, gt], [grad], name=f"{base}_exchanged",
            dilations=list(strides), pads=list(pads[:2]) + ends,
        ),
    ]  # fmt: skip
    if crop:
        starts, limits = f"{base}_crop_starts", f"{base}_crop_ends"
        axes = f"{base}_crop_axes"
        graph.initializer.extend([
            numpy_helper.from_array(np.zeros(2, np.int64), starts),
            numpy_helper.from_array(np.array(kernel, np.int64), limits),
            numpy_helper.from_array(np.array([2, 3], np.int64), axes),
        ])  # fmt: skip
        cropped = f"{base}_cropped"
        result.append(
            helper.make_node("Slice", [grad, starts, limits, axes], [cropped], name=cropped)
        )
        grad = cropped
    result.append(helper.make_node("Transpose", [grad], [dw], perm=swap, name=f"{base}_t"))
    return result


def _window(
    conv: onnx.NodeProto,
    x: list[int | None] | None,
    g: list[int | None] | None,
    w: list[int | None] | None,
) -> tuple[list[int], list[int], list[int]] | None:
    """``(pads, strides, kernel)`` of ``conv`` where its weight gradient qualifies for the
    exchanged Conv (see the module docstring); else None."""
    if x is None or g is None or w is None or len(x) != 4 or len(g) != 4 or len(w) != 4:
        return None
    if None in x or None in g or None in w or x[0] != g[0] or w[1] != x[1]:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    if attrs.get("group", 1) != 1 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b""):
        return None
    kernel = [int(k) for k in w[2:]]  # type: ignore[arg-type]
    strides = list(attrs.get("strides", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    if list(attrs.get("dilations", [1, 1])) != [1, 1] or max(strides) > MAX_STRIDE:
        return None
    if kernel == [1, 1] or g[2] * g[3] > MAX_POSITIONS:  # type: ignore[operator]
        return None
    if int(np.prod(w)) < MIN_WEIGHT:  # type: ignore[arg-type]
        return None
    return pads, strides, kernel


__all__ = ["KERNEL", "MAX_POSITIONS", "MAX_STRIDE", "MIN_WEIGHT", "weight_grads_as_convs"]
