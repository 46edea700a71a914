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

:class:`WeightGradsAsConvs`, an onnx-ir pass, replaces each tagged weight gradient of such a
Conv (2-D, one group, dilation 1, stride at most :data:`MAX_STRIDE`, a kernel larger than
1 x 1, at most :data:`MAX_POSITIONS` output positions, at least :data:`MIN_WEIGHT` weight
elements, static shapes on the model's values) by the exchanged Conv; the values are the same
sums in another order. The CUDA sessions apply it
(:func:`traingraph.runtime.rewrites.specialize.for_cuda`); artifacts on disk keep the portable
form.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

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


class WeightGradsAsConvs(ir.passes.InPlacePass):
    """Replace the tagged weight gradients that qualify (see the module docstring) by the
    exchanged Conv, in place; the result says whether any was."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = _tagged_regions(graph)
        if not regions:
            return ir.passes.PassResult(model, modified=False)
        forwards: dict[str, list[ir.Node]] = {}
        for node in graph:
            conv = node.op_type == "Conv" and node.domain in ("", "ai.onnx")
            if conv and KEY not in node.metadata_props:
                forwards.setdefault(node.name or "", []).append(node)
        modified = False
        for instance, nodes in regions.items():
            convs = forwards.get(instance, [])
            if len(convs) != 1:  # the forward Conv is not known by its name
                continue
            modified = _exchange(graph, convs[0], nodes) or modified
        return ir.passes.PassResult(model, modified=modified)


def _tagged_regions(graph: ir.Graph) -> dict[str, list[ir.Node]]:
    """Each forward Conv's weight-gradient nodes, in graph order, by the Conv's name."""
    regions: dict[str, list[ir.Node]] = {}
    for node in graph:
        kernel, _, instance = node.metadata_props.get(KEY, "").partition(":")
        if kernel == KERNEL:
            regions.setdefault(instance, []).append(node)
    return regions


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.is_initializer() or (producer is not None and producer.op_type == "Constant")


def _dims(value: ir.Value) -> list[int | None] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape.dims]


def _exchange(graph: ir.Graph, conv: ir.Node, nodes: list[ir.Node]) -> bool:
    """Replace the region ``nodes``, the weight gradient of ``conv``, by the exchanged Conv
    where it qualifies; return whether it was. The new nodes take the place of the node that
    wrote the gradient: what they read is written before it, what reads the gradient after
    it."""
    region = set(nodes)
    made = {v for n in nodes for v in n.outputs}
    x = conv.inputs[0]
    weight = conv.inputs[1] if len(conv.inputs) > 1 else None
    external = {
        v for n in nodes for v in n.inputs
        if v is not None and v not in made and not _is_constant(v)
    }  # fmt: skip
    leaving = [
        v for v in made
        if v.is_graph_output() or any(user not in region for user, _ in v.uses())
    ]  # fmt: skip
    if x is None or weight is None or x not in external or len(external) != 2:
        return False
    if len(leaving) != 1:
        return False
    (g,) = external - {x}
    dw = leaving[0]
    x_shape, g_shape = _dims(x), _dims(g)
    # the region reads the Conv's output gradient and writes a gradient of the weight's shape
    # (a region that another pass rewrote reads something else: it stays as it is)
    y_shape, dw_shape = _dims(conv.outputs[0]), _dims(dw)
    if (y_shape is not None and g_shape != y_shape) or dw_shape not in (None, _dims(weight)):
        return False
    window = _window(conv, x_shape, g_shape, _dims(weight))
    if window is None:
        return False
    pads, strides, kernel = window
    ends, crop = [], False
    for size, out, s, k, begin in zip(x_shape[2:], g_shape[2:], strides, kernel, pads[:2]):  # type: ignore[index]
        end = k + (out - 1) * s - size - begin  # type: ignore[operator]
        crop = crop or end < 0
        ends.append(max(end, 0))
    base = dw.name or "dw"
    swap = [1, 0, 2, 3]
    xt = ir.node("Transpose", [x], {"perm": swap}, name=f"{base}_input_t")
    gt = ir.node("Transpose", [g], {"perm": swap}, name=f"{base}_grad_t")
    exchanged = ir.node(
        "Conv", [xt.outputs[0], gt.outputs[0]],
        {"dilations": list(strides), "pads": list(pads[:2]) + ends}, name=f"{base}_exchanged",
    )  # fmt: skip
    new_nodes = [xt, gt, exchanged]
    grad = exchanged.outputs[0]
    if crop:
        bounds = {"starts": np.zeros(2, np.int64), "ends": np.array(kernel, np.int64),
                  "axes": np.array([2, 3], np.int64)}  # fmt: skip
        values = []
        for key, array in bounds.items():
            value = ir.Value(name=f"{base}_crop_{key}", const_value=ir.tensor(array))
            value.shape, value.dtype = ir.Shape(array.shape), ir.DataType.INT64
            graph.register_initializer(value)
            values.append(value)
        crop_node = ir.node("Slice", [grad, *values], name=f"{base}_cropped")
        new_nodes.append(crop_node)
        grad = crop_node.outputs[0]
    new_nodes.append(ir.node("Transpose", [grad], {"perm": swap}, name=f"{base}_t"))
    writer = dw.producer()
    assert writer is not None
    ir.convenience.replace_nodes_and_values(
        graph, writer, nodes, new_nodes, [dw], [new_nodes[-1].outputs[0]]
    )
    return True


def _window(
    conv: ir.Node,
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
    attrs = conv.attributes
    if attrs.get_int("group", 1) != 1 or attrs.get_string("auto_pad", "NOTSET") not in (
        "NOTSET",
        "",
    ):
        return None
    kernel = [int(k) for k in w[2:]]  # type: ignore[arg-type]
    strides = [int(s) for s in attrs.get_ints("strides", [1, 1])]
    pads = [int(p) for p in attrs.get_ints("pads", [0, 0, 0, 0])]
    if list(attrs.get_ints("dilations", [1, 1])) != [1, 1] or max(strides) > MAX_STRIDE:
        return None
    if kernel == [1, 1] or g[2] * g[3] > MAX_POSITIONS:  # type: ignore[operator]
        return None
    if int(np.prod(w)) < MIN_WEIGHT:  # type: ignore[arg-type]
        return None
    return pads, strides, kernel


__all__ = ["KERNEL", "MAX_POSITIONS", "MAX_STRIDE", "MIN_WEIGHT", "WeightGradsAsConvs"]
