"""The gradient of a training-mode BatchNormalization, and a Conv's output gradient routed
through the MaxPool after it, computed natively between two segments.

- :class:`BatchNormGrad`: the gradient of a (lowered) training-mode BatchNormalization, with
  the Relu gradient in front of it: the statistics, two sums, the affine map and the mask in
  two passes over the activations instead of about ten; :func:`split_batch_norm_grads` finds
  them.
- :class:`~traingraph.runtime.cpu.kernels.conv_grads.MaxPoolGrad`: a Conv's output gradient
  routed through the MaxPool (and Relu) after the Conv, where the Conv's input gradient reads
  it too (the graph's ArgMax over the windows, two upsamplings, a comparison and the masks);
  :func:`split_max_pool_grads` finds them.

Each match is checked numerically against its kernel before it is used
(:func:`traingraph.runtime.cpu.verify.verified_kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from traingraph.ir.tags import origin
from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.cpu.kernels.conv_grads import MaxPoolGrad
from traingraph.runtime.cpu.native import NATIVE, Arrays, NormalizationGrad, Outputs
from traingraph.runtime.cpu.verify import Values

KERNEL = "batch_norm_grad"
"""The tag of the nodes of a BatchNormalization's gradient."""


@dataclass(frozen=True)
class BatchNormGrad(NormalizationGrad):
    """One training-mode BatchNormalization gradient that the native kernel computes (see
    :class:`~traingraph.runtime.cpu.native.NormalizationGrad`), with the Relu gradient in front of
    it where ``y`` is set: ``dy`` is then the gradient of the Relu's output ``y``."""

    y: str | None = None

    @property
    def inputs(self) -> list[str]:
        scale = [self.scale] if self.dx else []  # the scale enters dx alone
        return [self.x, self.dy, *scale] + ([self.y] if self.y else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``dx``, ``dscale`` and ``dbias`` into ``out`` (arrays there are written in
        place; missing ones are allocated) from ``values``."""
        x = values[self.x]
        # without dx (nothing reads x's gradient: a first layer), the graph need not hold the
        # scale; the kernel reads it for dx alone
        scale = values[self.scale] if self.dx else np.ones(x.shape[1:2], np.float32)
        inputs = [x, values[self.dy], values[self.y] if self.y else None, scale]
        self.run_native("batch_norm_grad", inputs, out, x.shape[1:2], self.epsilon, threads)


def split_batch_norm_grads(
    model: onnx.ModelProto,
    forward: onnx.ModelProto | None = None,
    make: Callable[..., BatchNormGrad] | None = None,
) -> list[tuple[BatchNormGrad, set[int]]]:
    """Each BatchNormalization gradient of ``model`` the native kernel computes, with the
    indices of the nodes it replaces; checked numerically, all in one onnxruntime session.
    ``[]`` where the extension is missing or nothing matches.

    ``forward`` is the model that ran the forward pass where ``model`` is a separate gradient
    phase: its BatchNormalizations (and the Relus after them) count too. ``make`` builds
    each kernel from :class:`BatchNormGrad`'s fields (another device's kernel, checked the
    same way); by default the native one, which needs the extension."""
    if (make is None and NATIVE is None) or graph_match.has_subgraphs(model):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    f = graph_match.GraphIndex.of(forward.graph) if forward is not None else g
    shapes = graph_match.inferred_shapes(model)
    found = []
    for node in g.nodes + (f.nodes if f is not g else []):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            if not g.made_for(node, KERNEL):
                continue
            match = _match(g, f, node, shapes, make or BatchNormGrad)
            if match is not None:
                found.append(match)
    return verify.verified_kernels(model, g, found, shapes, check=_Check(g, shapes))


def _match(
    g: graph_match.GraphIndex,
    f: graph_match.GraphIndex,
    bn: onnx.NodeProto,
    shapes: Mapping[str, Sequence[int | None]],
    make: Callable[..., BatchNormGrad],
) -> tuple[BatchNormGrad, set[int]] | None:
    """The gradient of the inference-form BatchNormalization ``bn`` (the lowering of a training
    one: its statistics come from its input), when the graph computes it from the input, the
    scale and the output gradient (through a Relu) alone."""
    if len(bn.output) != 1 or len(bn.input) < 5:
        return None
    x, scale, bias = bn.input[:3]
    x_shape = shapes.get(x)
    if x_shape is None or len(x_shape) < 2 or x_shape[1] is None:
        return None
    dbias = f"{bias}_grad"
    # dbias = ReduceSum(G) through shape ops; G = dy (behind a Relu: dy * mask(y))
    gated = g.summed_into(dbias)
    if gated is None:  # no bias gradient among the outputs: a computed or constant bias
        return _match_by_tag(g, bn, shapes, make)
    # the forward graph (g itself, or the forward phase f) holds the Relu that reads bn
    home = g if bn.output[0] in g.producer else f
    readers = [home.nodes[j] for j in home.consumers.get(bn.output[0], ())]
    relus = [n for n in readers if n.op_type == "Relu"]
    y = relus[0].output[0] if len(relus) == 1 and len(readers) == 1 else None
    dy = gated
    if y is not None:
        product = g.nodes[g.producer[gated]] if gated in g.producer else None
        if product is None or product.op_type != "Mul":
            y, dy = None, gated
        else:
            mask_side = [v for v in product.input if g.derived_from(v, {y})]
            others = [v for v in product.input if v not in mask_side]
            if len(mask_side) != 1 or len(others) != 1:
                y, dy = None, gated
            else:
                dy = others[0]
    sources = {x, scale, dy} | ({y} if y else set())
    channels = int(x_shape[1])

    def normalization_value(name: str) -> bool:
        """Of x's shape or per channel: what a normalization's gradient computes (not the
        reshaped copies that the next gradient, a Conv's weight gradient, makes of dx)."""
        shape = shapes.get(name)
        if shape is None or None in shape[1:]:
            return False
        if _like(shape, x_shape, unknown=False):
            return True
        dims = [d for d in shape if d is not None]
        return len(dims) == len(shape) and math.prod(dims) in (1, channels)

    found = g.normalization_grad(
        dy,
        sources,
        normalization_value,
        lambda name: _like(shapes.get(name), x_shape, unknown=False),
        dbias,
        f"{scale}_grad",
    )
    if found is None:
        return None
    nodes, dx, dscale = found
    if dx is not None and not _like(shapes.get(dx), x_shape):
        return None
    attrs = graph_match.attributes(bn)
    epsilon = float(attrs.get("epsilon", 1e-5))
    grad = make(x, scale, dy, epsilon, dx, dscale, dbias, y=y)
    return grad, nodes


def _match_by_tag(
    g: graph_match.GraphIndex,
    bn: onnx.NodeProto,
    shapes: Mapping[str, Sequence[int | None]],
    make: Callable[..., BatchNormGrad],
) -> tuple[BatchNormGrad, set[int]] | None:
    """The gradient of ``bn`` where its bias's gradient is no model output (a BatchNorm whose
    scale or bias the graph computes or holds constant: standardized Conv filters): the
    nodes the gradient rule tagged for it, which read ``x``, the scale, one output gradient
    ``dy`` of ``x``'s shape and statistics of ``x``, and write the input's gradient and, where
    the graph reads them, the scale's and the bias's (the sum of ``dy``)."""
    x, scale = bn.input[:2]
    x_shape = shapes.get(x)
    found = g.tagged_gradient(KERNEL, origin(bn), {x, scale}) if x_shape is not None else None
    if found is None or x_shape is None or None in x_shape[1:]:
        return None
    nodes, dy, outputs = found
    if not _like(shapes.get(dy), x_shape, unknown=False):
        return None
    channels = int(x_shape[1] or 0)
    dx = [o for o in outputs if _like(shapes.get(o), x_shape, unknown=False)]
    sums = [o for o in outputs if _channel_sized(shapes.get(o), channels) and _sum_of(g, o, dy)]
    rest = outputs - set(dx) - set(sums)
    dscale = [o for o in rest if _channel_sized(shapes.get(o), channels)]
    if len(dx) > 1 or len(sums) > 1 or len(dscale) > 1 or rest - set(dscale):
        return None
    epsilon = float(graph_match.attributes(bn).get("epsilon", 1e-5))
    grad = make(
        x, scale, dy, epsilon, next(iter(dx), None), next(iter(dscale), None),
        next(iter(sums), None),
    )  # fmt: skip
    return (grad, nodes) if grad.outputs else None


def _channel_sized(shape: Sequence[int | None] | None, channels: int) -> bool:
    return shape is not None and None not in shape and math.prod(shape) == channels  # type: ignore[arg-type]


def _sum_of(g: graph_match.GraphIndex, value: str, dy: str) -> bool:
    """Whether ``value`` is a ReduceSum of ``dy`` (through shape ops and a Cast)."""
    i = g.producer.get(value)
    while i is not None and g.nodes[i].op_type in (*graph_match.SHAPE_OPS, "Cast"):
        i = g.producer.get(g.nodes[i].input[0])
    return i is not None and g.nodes[i].op_type == "ReduceSum" and g.nodes[i].input[0] == dy


def _like(
    shape: Sequence[int | None] | None, x_shape: Sequence[int | None], unknown: bool = True
) -> bool:
    """Whether ``shape`` may be ``x_shape``: equal but perhaps for the batch (inference may
    know it for one value and not for another), or ``unknown`` where it is None."""
    if shape is None:
        return unknown
    return len(shape) == len(x_shape) and list(shape[1:]) == list(x_shape[1:])


_CHECK_VALUES = 1024
"""Values per channel in the numeric check of a BatchNormalization gradient (see
:class:`_Check`)."""


@dataclass(frozen=True)
class _Check(verify.Check):
    """The numeric check of BatchNormalization gradients: on random inputs (a Relu output with
    zeros) of the model's batch. Where the batch is not static, the check takes as many images
    as give each channel ``_CHECK_VALUES`` values, 2 to 16: any batch is one the graph runs,
    and what decides the check is the count of values a channel's statistics are over (with
    as few as 2, dx is all cancellation), not the count of images. A match of the same form
    and shapes as one checked (the same layer repeated) takes its verdict.

    The inputs of one check are independent standard-normal values: windows of one draw,
    one window per input (x, dy, y, scale), so that another check may see the same values,
    which weakens neither."""

    g: graph_match.GraphIndex
    shapes: Mapping[str, Sequence[int | None]]

    def x_shape(self, grad: BatchNormGrad) -> list[int] | None:
        """The shape of ``x`` in the check (None where it is not static beyond the batch)."""
        dims = self.shapes[grad.x]
        if any(d is None for d in dims[1:]):
            return None
        pixels = math.prod(int(d or 0) for d in dims[2:])
        # the model's batch where it is static (the graph may hold 1 / M as a constant)
        batch = dims[0] or min(16, max(2, -(-_CHECK_VALUES // max(pixels, 1))))
        x_shape = [int(batch), *(int(d or 0) for d in dims[1:])]
        return x_shape if min(x_shape) >= 1 else None

    def form(self, kernel: BatchNormGrad, nodes: set[int]) -> tuple[object, ...] | None:
        x_shape = self.x_shape(kernel)
        if x_shape is None:
            return None
        roles = {getattr(kernel, f): f for f in ("x", "scale", "dy", "y", "dx", "dscale", "dbias")}
        return (
            self.g.form(nodes, {name: role for name, role in roles.items() if name}),
            tuple(x_shape),
            kernel.epsilon,
            tuple(sorted(role for name, role in roles.items() if name)),
        )

    def inputs(
        self, matches: Sequence[tuple[BatchNormGrad, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        x_shapes = [self.x_shape(grad) for grad, _ in matches]
        window = max((math.prod(s) for s in x_shapes if s is not None), default=0)
        draws = verify.WindowedDraws(np.random.default_rng(0), 4, window)
        drawn: list[dict[str, np.ndarray] | None] = []
        for (grad, _), x_shape in zip(matches, x_shapes):
            if x_shape is None:
                drawn.append(None)
                continue
            # a value two matches read (one gradient into two branches) gets one array
            values = draws.inputs(
                [
                    (grad.x, 0, x_shape, lambda a: a * 2 + 1),
                    (grad.dy, 1, x_shape, None),
                    (grad.scale, 3, x_shape[1:2], None),
                ]
                + ([(grad.y, 2, x_shape, lambda a: np.maximum(a, 0))] if grad.y else [])
            )
            shaped = all(list(values[v].shape) == x_shape for v in (grad.x, grad.dy))
            drawn.append(values if shaped else None)
        return drawn

    def agrees(self, kernel: BatchNormGrad, values: Values, expected: Values, run: int) -> bool:
        # the parameters' gradients may keep dims of one
        flat = [name for name in (kernel.dscale, kernel.dbias) if name]
        return verify.kernel_agrees(kernel, values, expected, flat=flat)


def split_max_pool_grads(
    model: onnx.ModelProto,
    weight_grads: Sequence[conv_grads.WeightGrad],
    forward: onnx.ModelProto | None = None,
) -> list[tuple[MaxPoolGrad, set[int]]]:
    """For each Conv whose weight gradient the native kernel computes (``weight_grads``) and
    whose output feeds (through a Relu) a MaxPool of tiling windows, the routing of the
    MaxPool's gradient into the Conv's output gradient, where the graph computes it from the
    MaxPool's input and output gradient alone; checked numerically on inputs with many ties.
    ``forward``: as for :func:`split_batch_norm_grads`."""
    if NATIVE is None or graph_match.has_subgraphs(model):
        return []
    unrouted = [(grad, set[int]()) for grad in weight_grads]
    routes = conv_grads.find_routes(model, unrouted, forward, exclusive=False)
    return [(MaxPoolGrad(weight_grads[i].dy, route), nodes) for i, (route, nodes) in routes.items()]
