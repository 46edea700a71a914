"""Convolution weight gradients computed natively on the CPU, outside the training graph.

In a standard-op training graph the weight gradient of a Conv is an unfold (a grouped Conv
with one-hot kernels, 9 copies of the input for a 3x3 kernel) and a GEMM. On the CPU the
native kernel ``traingraph.runtime._convc`` computes the same sums without materializing the
unfold, reading shifted rows of the input in place: one pass over the input instead of writing
and reading 9 copies of it. The weight gradients of 3 x 3 Convs of strides 1 and pads 1 over 8
or more channels and filters, with a height and width divisible by 4, go by Winograd's
F(4 x 4, 3 x 3) (36 products per 4 x 4 tile and filter pair instead of 144). That is the
weight gradient only: the forward Convs and input gradients of
:mod:`traingraph.runtime.cpu.kernels.winograd` use F(2 x 2, 3 x 3), whose rounding error is smaller
(its docstring says why that matters there). Where the plane is small (a few positions late
in a network) and the filters many (:func:`by_product`), the gradient is instead one matrix
product of the output gradient and the unfold, written by onnxruntime's GEMM
(:func:`product_weight_grad`): the kernel's sums over each sample's small plane are short, and
its threads have few samples to share.

:func:`split_weight_grads` finds, in a training model, each gradient output that is the
weight gradient of one 2-D float32 Conv: the nodes that feed only that output read nothing
but the Conv's input ``X``, one other tensor ``G`` (the gradient of the Conv's output) and
constants. It checks that claim numerically (the subgraph and the kernel give the same
result on random ``X`` and ``G``), then returns the model without those nodes, with ``X``
and ``G`` as outputs instead of the gradient, and a :class:`WeightGrad` for each, which
:func:`compute` evaluates after each run, or, where the run is cut into segments around other
native kernels, a :class:`WeightGradKernel` between them as soon as ``X`` and ``G`` are
written. Everything else, the artifact on disk included,
stays standard ONNX; where the extension is missing or nothing matches, the model is used
as it is.

Where the graph computes ``G`` only for that weight gradient (and the Conv's bias gradient),
as for the first Conv of a network, whose input gradient nobody asks for, and the Conv feeds
(through a Relu) a MaxPool whose windows tile its input, ``G`` itself is computed natively
too (:class:`MaxPoolRoute`): the MaxPool's output gradient goes to each window's first
maximum, behind a Relu only where it is above 0, in one pass that also sums the bias
gradient. The graph's routing (an ArgMax over the windows, two upsamplings, a comparison and
the masks) is then left out; the same numeric check guards it, on inputs with many ties.

Example:
    >>> model, grads = split_weight_grads(onnx.load("training_model.onnx"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from traingraph.runtime.cpu.graph_match import (
    FLOAT,
    GraphIndex,
    attributes,
    elem_type,
    exclusive_cone,
    graph_reads,
    has_subgraph,
    inferred_shapes,
    pair_of,
    shared_analyses,
    value_dims,
)
from traingraph.runtime.cpu.kernels.products import Product
from traingraph.runtime.cpu.native import (
    AVAILABLE,
    NATIVE,
    Arrays,
    Outputs,
    default_threads,
    output_array,
)
from traingraph.runtime.cpu.verify import (
    Check,
    Values,
    WindowedDraws,
    kernel_agrees,
    verified_kernels,
)

__all__ = [
    "AVAILABLE",
    "MaxPoolGrad",
    "MaxPoolRoute",
    "WeightGrad",
    "WeightGradKernel",
    "compute",
    "compute_after_run",
    "default_threads",
    "find_routes",
    "native_params",
    "product_weight_grad",
    "reads",
    "run_outputs",
    "split_weight_grads",
    "unfolded_weight_grad",
]

if TYPE_CHECKING:
    from traingraph.runtime.tensors import TensorStore

MAX_STRIDE_PHASES = 64
"""The most stride phases (``stride_h * stride_w``) the C weight-gradient kernel takes; a Conv
of larger strides (a 16 x 16 patch embedding) keeps the gradient its graph computes."""

DENSE_ON_NARROW = False
"""Whether the kernel takes the weight gradients of Convs other than depthwise ones where the
CPU lacks AVX-512 (``_convc.narrow_blocks()``). Its dot products are blocked for AVX-512's 32
registers; with AVX2's 16, the graph's form in onnxruntime was as fast or faster: on a 2-core
AMD EPYC, two threads, the resnet18 zoo step took 501 ms with those gradients in the graph and
567 ms with the kernel, resnet50 1053 against 1079 ms. Depthwise gradients (channels in the
vector lanes) stay native."""


@dataclass(frozen=True)
class MaxPoolRoute:
    """A Conv's output gradient ``dy`` computed natively from the MaxPool that reads the Conv's
    output, or the Relu of it: the gradient ``dp`` of the MaxPool's output goes to each window's
    first maximum of ``y``, the MaxPool's input, and behind a Relu only where that maximum is
    above 0. Used where the graph needs ``dy`` for nothing but the weight (and bias) gradient:
    the first convolution of a network, whose input gradient nobody asks for.

    Attributes:
        y: The MaxPool's input.
        dp: The gradient of the MaxPool's output.
        kernel: The window, which is also the stride (the windows tile ``y``).
        relu: Whether ``y`` is the output of a Relu of the Conv's output.
        bias: The Conv's bias, whose gradient (the sum of ``dy``) comes with it, or None.
    """

    y: str
    dp: str
    kernel: tuple[int, int]
    relu: bool
    bias: str | None = None


@dataclass(frozen=True)
class WeightGrad:
    """One Conv weight gradient that the native kernel computes.

    Attributes:
        output: The training model's gradient output it replaces (``<param>_grad``).
        param: The weight.
        x: The Conv's input, an input or (after the split) an output of the model.
        dy: The gradient of the Conv's output, an output of the model after the split.
        strides: Strides (2).
        pads: Begin pads (2).
        end_pads: End pads (2).
        dilations: Dilations (2).
        group: Groups.
        route: Where ``dy`` is not computed by the graph but from a MaxPool's gradient.
        kernel: The weight's height and width, where known.
    """

    output: str
    param: str
    x: str
    dy: str
    strides: tuple[int, int]
    pads: tuple[int, int]
    end_pads: tuple[int, int]
    dilations: tuple[int, int]
    group: int
    route: MaxPoolRoute | None = None
    kernel: tuple[int, int] | None = None


def compute(
    grads: Sequence[WeightGrad],
    values: Mapping[str, np.ndarray],
    targets: Mapping[str, np.ndarray],
    threads: int,
) -> None:
    """Write each gradient of ``grads`` into ``targets[grad.output]``, from ``values`` (the
    arrays of each name :func:`reads` gives, by name), on ``threads`` threads. A routed
    gradient also writes its bias gradient into ``targets["<bias>_grad"]``."""
    assert NATIVE is not None
    values = dict(values)
    for g in grads:
        if g.route is not None:
            r = g.route
            y = values[r.y]
            dy = np.empty(y.shape, np.float32)
            bias = targets[f"{r.bias}_grad"] if r.bias is not None else None
            NATIVE.route_max_pool(y, values[r.dp], dy, bias, r.kernel, r.relu, threads)
            values[g.dy] = dy
    for g in grads:
        _check_geometry(g, values[g.x].shape, values[g.dy].shape)
    native = []
    for g in grads:
        if by_product(g, values[g.dy].shape, targets[g.output].shape[2:]):
            product_weight_grad(values[g.x], values[g.dy], g, targets[g.output], threads)
        else:
            native.append(g)
    NATIVE.weight_grads(
        [
            (
                values[g.x],
                values[g.dy],
                targets[g.output],
                g.strides,
                g.pads,
                g.dilations,
                g.group,
            )
            for g in native
        ],
        threads,
    )
    for g in grads:
        if not np.isfinite(targets[g.output]).all():
            unfolded_weight_grad(values[g.x], values[g.dy], g, targets[g.output])


PRODUCT_UNFOLD = 196
"""The most values per sample and input channel (``OH * OW * KH * KW``) in the unfold of a Conv
whose weight gradient is one matrix product (:func:`product_weight_grad`) rather than the
native kernel's sums (a 3 x 3 Conv over a 4 x 4 plane, a 1 x 1 Conv over 14 x 14)."""

PRODUCT_PLANE = 49
"""The most output positions (``OH * OW``) of a Conv whose weight gradient is one matrix
product whatever its kernel (a 3 x 3 Conv over a 7 x 7 plane)."""

STRIDED_PRODUCT_PLANE = 196
"""The same for a strided Conv, whose native sums first split the input into its stride
phases (a 3 x 3 Conv of stride 2 onto a 14 x 14 plane)."""

PRODUCT_FILTERS_PER_TAP = 16
"""The fewest filters per kernel position (``M / (KH * KW)``) for the product form: the unfold
copies the input once per position, and the product's work per copied value is one
multiply-add per filter (a 3 x 3 Conv of 32 filters, a DenseNet layer's, keeps the native sums,
twice as fast there)."""


def by_product(grad: WeightGrad, dy: tuple[int, ...], kernel: tuple[int, ...]) -> bool:
    """Whether :func:`compute` writes ``grad`` by :func:`product_weight_grad`: one group, at
    least :data:`PRODUCT_FILTERS_PER_TAP` filters per kernel position, and an unfold of at most
    :data:`PRODUCT_UNFOLD` values per sample and channel or an output plane of at most
    :data:`PRODUCT_PLANE` positions (:data:`STRIDED_PRODUCT_PLANE` for a strided Conv); ``dy``
    is the output gradient's shape, ``kernel`` the filters' height and width. The native kernel
    sums each sample's output plane in turn, and its threads share the samples: over a small
    plane its sums are short and its threads' shares few, while the product sums every
    sample's positions in one run, after writing the unfold (``_convc.unfold``, the threads
    sharing its rows). A 1 x 1 Conv of stride 1 and no padding on 1 x 1 planes (a
    squeeze-and-excitation block's) is always a product, of ``x`` and ``dy`` in place."""
    if grad.group != 1 or len(dy) != 4:
        return False
    taps = math.prod(kernel)
    unpadded = grad.pads == (0, 0) and grad.end_pads == (0, 0)
    if taps == 1 and dy[2] * dy[3] == 1 and grad.strides == (1, 1) and unpadded:
        return True  # a product of x and dy as they are, however few the filters
    if dy[1] < PRODUCT_FILTERS_PER_TAP * taps:
        return False
    plane = dy[2] * dy[3]
    if grad.strides != (1, 1):
        return plane <= STRIDED_PRODUCT_PLANE
    return plane <= PRODUCT_PLANE or plane * taps <= PRODUCT_UNFOLD


def product_weight_grad(
    x: np.ndarray, dy: np.ndarray, grad: WeightGrad, out: np.ndarray, threads: int
) -> None:
    """Write the weight gradient of the one-group ``grad`` into ``out`` ``[M, C, KH, KW]`` as
    one product by onnxruntime's GEMM: ``dy`` as ``[M, N * OH * OW]`` times the transposed
    unfold of the zero-padded input, ``[C * KH * KW, N * OH * OW]``, whose row ``(c, i, j)``
    holds the input values that filter tap ``(i, j)`` of channel ``c`` meets at every sample
    and output position; on 1 x 1 planes with a 1 x 1 filter, ``dy`` ``[N, M]`` transposed
    times ``x`` ``[N, C]`` without copies. Each weight's gradient is the sum over the same
    products as the native kernel's, in another order."""
    for name, array in (("x", x), ("dy", dy), ("dw", out)):
        if array.dtype != np.float32:
            raise ValueError(f"weight gradient {grad.param!r}: {name} is not float32")
    if not out.flags.writeable:
        raise ValueError(f"weight gradient {grad.param!r}: dw is read-only")
    n, c = x.shape[:2]
    m, oh, ow = dy.shape[1:]
    if out.ndim != 4 or out.shape[:2] != (m, c):
        raise ValueError(
            f"weight gradient {grad.param!r}: x {list(x.shape)}, dy {list(dy.shape)} and dw"
            f" {list(out.shape)} do not form a convolution; dw must be [{m}, {c}, KH, KW]"
        )
    kh, kw = out.shape[2:]
    target = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    if (kh, kw, oh, ow) == (1, 1, 1, 1) and x.shape[2:] == (1, 1):
        # a 1 x 1 Conv on 1 x 1 planes (a squeeze-and-excitation block's): x and dy are the
        # product's [N, C] and [N, M] as they are
        rows = np.ascontiguousarray(dy).reshape(n, m)
        Product("Gemm", threads, transA=1)(rows, np.ascontiguousarray(x).reshape(n, c),
                                           target.reshape(m, c))  # fmt: skip
    else:
        columns = np.empty((c * kh * kw, n * oh * ow), np.float32)
        assert NATIVE is not None
        NATIVE.unfold(
            np.ascontiguousarray(x), columns, (kh, kw), (oh, ow),
            grad.strides, grad.pads, grad.dilations, threads,
        )  # fmt: skip
        rows = np.ascontiguousarray(dy.reshape(n, m, oh * ow).transpose(1, 0, 2))
        Product("Gemm", threads, transB=1)(rows.reshape(m, -1), columns, target.reshape(m, -1))
    if target is not out:
        out[...] = target


def unfolded_weight_grad(x: np.ndarray, dy: np.ndarray, grad: WeightGrad, out: np.ndarray) -> None:
    """Write the weight gradient of ``grad`` into ``out`` as the training graph forms it
    (:func:`traingraph.autodiff.rules.conv.unfold`): each column ``k`` of the zero-padded input
    is the sum over the window of the one-hot weights times the window's values, then one
    product with the output gradient summed over the batch and the positions. A NaN or an
    infinity in a window thus reaches every column of that window (``0 * inf`` is NaN), as it
    does in the graph. The native kernel multiplies each value by its own weight only, so
    where it writes a NaN or an infinity (it does wherever a value it reads is one),
    :func:`compute` writes this form instead.

    Column ``k``'s sum ``window_k * 1 + sum_{j != k} window_j * 0`` is ``window_k`` where every
    other window's value is finite (the zero products add nothing but the sign of a zero) and
    NaN where one is not; it is formed so for every group at once, and each group's product
    with the output gradient is one ``einsum``."""
    n, oh, ow = dy.shape[0], *dy.shape[2:]
    kh, kw = out.shape[2:]
    (top, left), (bottom, right) = grad.pads, grad.end_pads
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (sh, sw), (dh, dw) = grad.strides, grad.dilations
    groups = grad.group
    cg, og = x.shape[1] // groups, dy.shape[1] // groups
    windows = [
        padded[:, :, i * dh : i * dh + (oh - 1) * sh + 1 : sh,
               j * dw : j * dw + (ow - 1) * sw + 1 : sw]
        for i in range(kh)
        for j in range(kw)
    ]  # fmt: skip
    not_finite = [~np.isfinite(w) for w in windows]
    count = np.sum(not_finite, axis=0, dtype=np.int32)
    grads = dy.reshape(n, groups, og, oh * ow)
    with np.errstate(over="ignore", invalid="ignore"):
        for k, window in enumerate(windows):
            column = np.where(count - not_finite[k] > 0, np.float32(np.nan), window)
            columns = column.reshape(n, groups, cg, oh * ow)
            products = np.einsum("ngop,ngcp->goc", grads, columns, optimize=True)
            out[:, :, k // kw, k % kw] = products.reshape(groups * og, cg)


def reads(grad: WeightGrad) -> tuple[str, ...]:
    """The values :func:`compute` reads for ``grad``: ``x`` and ``dy``, or ``x`` and the
    route's ``y`` and ``dp``."""
    if grad.route is None:
        return grad.x, grad.dy
    return grad.x, grad.route.y, grad.route.dp


def native_params(grads: Sequence[WeightGrad]) -> set[str]:
    """The parameters whose gradients :func:`compute` writes: the weights, and the biases of
    routed gradients."""
    return {g.param for g in grads} | {
        g.route.bias for g in grads if g.route is not None and g.route.bias is not None
    }


def run_outputs(grads: Sequence[WeightGrad], inputs: Collection[str]) -> list[str]:
    """The values the split model must return for ``grads``: each that :func:`reads` names
    and that is not one of the model's ``inputs``."""
    return sorted({name for g in grads for name in reads(g)} - set(inputs))


@dataclass(frozen=True)
class WeightGradKernel:
    """A :class:`WeightGrad` computed between two segments of a
    :class:`~traingraph.runtime.cpu.segments.SegmentedRunner`, as soon as the values it reads
    are written (while the output gradient is still in cache), instead of after the run."""

    grad: WeightGrad

    @property
    def inputs(self) -> list[str]:
        return list(reads(self.grad))

    @property
    def outputs(self) -> list[str]:
        bias = self.grad.route.bias if self.grad.route is not None else None
        return [self.grad.output] + ([f"{bias}_grad"] if bias is not None else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write the gradients into ``out`` (arrays there of the parameters' shapes are
        written in place; others are allocated)."""
        g = self.grad
        x = values[g.x]
        filters = values[g.route.y if g.route is not None else g.dy].shape[1]
        if g.kernel is None and g.output not in out:
            raise ValueError(
                f"the weight gradient of {g.param!r} needs a buffer: its kernel size is not known"
            )
        shape = (filters, x.shape[1] // g.group, *(g.kernel or out[g.output].shape[2:]))
        output_array(out, g.output, shape)
        for name in self.outputs[1:]:
            output_array(out, name, (filters,))
        compute([g], values, out, threads)


@dataclass(frozen=True)
class MaxPoolGrad:
    """A Conv's output gradient ``dy`` routed natively through the MaxPool (and Relu) after
    the Conv (:class:`MaxPoolRoute`), where other nodes read ``dy`` too (the Conv's input
    gradient), with the Conv's bias gradient where the graph computes it from ``dy`` alone."""

    dy: str
    route: MaxPoolRoute

    @property
    def inputs(self) -> list[str]:
        return [self.route.y, self.route.dp]

    @property
    def outputs(self) -> list[str]:
        bias = self.route.bias
        return [self.dy] + ([f"{bias}_grad"] if bias is not None else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``dy`` (and the bias gradient) into ``out`` (arrays there are written in
        place; missing ones are allocated) from ``values``."""
        y, route = values[self.route.y], self.route
        shapes = dict(zip(self.outputs, (y.shape, (y.shape[1],))))
        for name, shape in shapes.items():
            output_array(out, name, shape)
        bias = out[f"{route.bias}_grad"] if route.bias is not None else None
        assert NATIVE is not None
        NATIVE.route_max_pool(
            y, values[route.dp], out[self.dy], bias, route.kernel, route.relu, threads
        )


def compute_after_run(
    grads: Sequence[WeightGrad],
    outputs: Mapping[str, Any],
    feeds: Mapping[str, Any],
    store: TensorStore,
    threads: int,
) -> None:
    """Write each gradient of ``grads`` into ``store``'s host view of its parameter, reading
    ``x`` and ``dy`` from a run's ``outputs``, else from the ``feeds`` it was given (CPU
    OrtValues or arrays)."""

    def host(value: Any) -> np.ndarray:
        return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)

    values = {
        name: host(outputs[name] if name in outputs else feeds[name])
        for g in grads
        for name in reads(g)
    }
    targets = {f"{name}_grad": store.host_view(name) for name in native_params(grads)}
    compute(grads, values, targets, threads)


def _check_geometry(grad: WeightGrad, x: tuple[int, ...], dy: tuple[int, ...]) -> None:
    if len(x) == 4 and len(dy) == 4:
        w = (x[2], x[3])
        # every output position's window starts inside the padded input
        fits = all(
            dy[2 + a] >= 1
            and (dy[2 + a] - 1) * grad.strides[a] <= w[a] + grad.pads[a] + grad.end_pads[a] - 1
            for a in range(2)
        )
        if fits and dy[0] == x[0]:
            return
    raise ValueError(
        f"the weight gradient of {grad.param!r} got x of shape {list(x)} and dy of shape"
        f" {list(dy)}, which are not the input and output of its Conv (strides {grad.strides},"
        f" pads {grad.pads + grad.end_pads}); the training model's shapes are inconsistent"
    )


def split_weight_grads(
    model: onnx.ModelProto,
    forward: onnx.ModelProto | None = None,
    kernels: Collection[str] | None = None,
) -> tuple[onnx.ModelProto, list[WeightGrad]]:
    """``model`` without the nodes of each Conv weight gradient the native kernel can compute,
    and those gradients; ``model`` itself and ``[]`` where there are none (or no kernel).

    ``forward`` is the model that ran the forward pass where ``model`` is a separate gradient
    phase: its Convs count too where ``model`` reads their input (as a saved value or a feed).
    ``kernels``: the native kernels chosen by name (``SessionConfig.native_kernels``); none is
    computed natively where they leave out ``"conv_weight_grad"``, nor where ``model`` holds
    kernel tags (:mod:`traingraph.ir.tags`) but no weight gradient's.
    """
    if NATIVE is None or (kernels is not None and "conv_weight_grad" not in kernels):
        return model, []
    graph = model.graph
    with shared_analyses():  # one shape inference and one index of the model
        g = GraphIndex.of(graph)
        if g.tags and "conv_weight_grad" not in g.tags:
            return model, []
        found = _verified(model, g, _candidates(model, g, forward))
        if not found:
            return model, []
        found = _routed(model, forward, found)
    removed: set[int] = set()
    for _, cone in found:
        removed |= cone
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    g = rewritten.graph
    del g.node[:]
    g.node.extend(n for i, n in enumerate(graph.node) if i not in removed)
    replaced = {f"{name}_grad" for name in native_params([grad for grad, _ in found])}
    kept = [o for o in graph.output if o.name not in replaced]
    names = {o.name for o in kept} | {i.name for i in graph.input}
    types = _value_types(graph)
    for grad, _ in found:
        for name in reads(grad):
            if name not in names:
                names.add(name)
                kept.append(types.get(name) or helper.make_tensor_value_info(name, FLOAT, None))
    del g.output[:]
    g.output.extend(kept)
    used = {name for n in g.node for name in n.input}
    initializers = [t for t in graph.initializer if t.name in used or t.name in names]
    del g.initializer[:]
    g.initializer.extend(initializers)
    return rewritten, [grad for grad, _ in found]


def _value_types(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    return {v.name: v for v in list(graph.value_info) + list(graph.input) + list(graph.output)}


@dataclass(frozen=True)
class _Match:
    grad: WeightGrad
    cone: set[int]  # indices of the nodes that compute it
    x_shape: list[int]  # with a batch of 2, for the numeric check
    dy_shape: list[int]
    w_shape: list[int]


def _candidates(
    model: onnx.ModelProto, g: GraphIndex, forward: onnx.ModelProto | None = None
) -> list[_Match]:
    """The gradient outputs that look like one Conv's weight gradient (see the module
    docstring), with the nodes that compute them (``g`` indexes ``model``'s graph); the Convs
    of ``forward`` count where ``model`` reads their input."""
    graph = model.graph
    nodes, producer, outputs = g.nodes, g.producer, g.outputs
    inputs = {i.name: i for i in graph.input}
    convs = list(nodes)
    if forward is not None:
        # a weight the gradient phase does not read (no input gradient) is typed in forward
        inputs = {i.name: i for i in forward.graph.input} | inputs
        reads = graph_reads(graph)
        convs += [n for n in forward.graph.node if n.input and n.input[0] in reads]
    shapes: dict[str, list[int | None]] | None = None
    found: list[_Match] = []
    for node in convs:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if not g.made_for(node, "conv_weight_grad"):
            continue
        param, x = node.input[1], node.input[0]
        output = f"{param}_grad"
        if param not in inputs or output not in outputs or output not in producer:
            continue
        w_shape = value_dims(inputs[param])
        if len(w_shape) != 4 or None in w_shape or elem_type(inputs[param]) != FLOAT:
            continue
        attrs = attributes(node)
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            continue
        if shapes is None:
            shapes = inferred_shapes(model)
        x_shape = shapes.get(x)
        if x_shape is None or len(x_shape) != 4 or None in x_shape[1:]:
            continue
        pads = [int(p) for p in attrs.get("pads", [0, 0, 0, 0])]
        strides, dilations = pair_of(attrs.get("strides")), pair_of(attrs.get("dilations"))
        if strides[0] * strides[1] > MAX_STRIDE_PHASES:
            continue
        out_shape = [w_shape[0]]
        for axis in range(2):
            extent = (w_shape[2 + axis] - 1) * dilations[axis] + 1  # type: ignore[operator]
            padded = x_shape[2 + axis] + pads[axis] + pads[2 + axis]  # type: ignore[operator]
            out_shape.append((padded - extent) // strides[axis] + 1)
        if g.consumers.get(output):
            continue  # read inside the graph as well (a finiteness check, a sum)
        cone = exclusive_cone(g, producer[output])
        if any(has_subgraph(nodes[i]) for i in cone):
            continue
        # The gradient of the Conv's output: a value the cone reads, of the output's shape,
        # below which the cone reads nothing but it, x and constants. The latest such value.
        for dy in sorted(
            {name for i in cone for name in nodes[i].input if name},
            key=lambda name: producer.get(name, -1),
            reverse=True,
        ):
            shape = shapes.get(dy)
            if dy == x or shape is None or len(shape) != 4 or shape[1:] != out_shape:
                continue
            below = _below(g, cone, {x, dy})
            # (a gradient of the weight reads x: not the weight gradient itself, of the same
            # shape where filters = batch and kernel = output size)
            if producer[output] in below and any(x in nodes[i].input for i in below):
                group = int(attrs.get("group", 1))
                depthwise = group > 1 and group == x_shape[1] == w_shape[0]
                narrow = NATIVE is not None and NATIVE.narrow_blocks()
                if not depthwise and not DENSE_ON_NARROW and narrow:
                    break  # onnxruntime's products are the faster there (see DENSE_ON_NARROW)
                grad = WeightGrad(
                    output=output,
                    param=param,
                    x=x,
                    dy=dy,
                    strides=strides,
                    pads=(pads[0], pads[1]),
                    end_pads=(pads[2], pads[3]),
                    dilations=dilations,
                    group=group,
                    kernel=(int(w_shape[2]), int(w_shape[3])),  # type: ignore[arg-type]
                )
                match = _Match(
                    grad,
                    below,
                    x_shape=[2, *x_shape[1:]],  # type: ignore[list-item]  # static, checked
                    dy_shape=[2, *out_shape],  # type: ignore[list-item]
                    w_shape=w_shape,  # type: ignore[arg-type]
                )
                found.append(match)
                break
    return found


def _below(g: GraphIndex, cone: set[int], sources: set[str]) -> set[int]:
    """The nodes of ``cone`` computed from ``sources`` and constants alone, and read only by
    each other."""
    below = g.computed_from(cone, sources)
    # A node below that also feeds the rest of the cone (a shared Constant) stays.
    for i in sorted(below, reverse=True):
        if any(g.consumers.get(name, set()) - below for name in g.nodes[i].output):
            below.discard(i)
    return below


def _routed(
    model: onnx.ModelProto,
    forward: onnx.ModelProto | None,
    found: list[tuple[WeightGrad, set[int]]],
) -> list[tuple[WeightGrad, set[int]]]:
    """``found`` with a :class:`MaxPoolRoute` on each gradient whose ``dy`` the graph computes
    from a MaxPool's gradient for nothing else (see :func:`_route`), checked numerically, and
    the nodes of ``dy`` (and of the bias gradient) added to its cone."""
    routes = find_routes(model, found, forward, exclusive=True)
    return [
        (dataclasses.replace(grad, route=routes[i][0]), cone | routes[i][1])
        if i in routes
        else (grad, cone)
        for i, (grad, cone) in enumerate(found)
    ]


def find_routes(
    model: onnx.ModelProto,
    grads: Sequence[tuple[WeightGrad, set[int]]],
    forward: onnx.ModelProto | None = None,
    *,
    exclusive: bool,
) -> dict[int, tuple[MaxPoolRoute, set[int]]]:
    """For each unrouted gradient of ``grads`` (with the nodes of its weight gradient) whose
    Conv feeds (through a Relu) a MaxPool of tiling windows, and whose ``dy`` the graph
    computes from the MaxPool's input and output gradient alone (see :func:`_route`), its
    route and the nodes the route replaces, by index into ``grads``; each checked numerically
    on inputs with many ties. ``forward`` holds the forward nodes where ``model`` is a
    separate gradient phase."""
    g = GraphIndex.of(model.graph)
    forward_nodes = g.nodes + (list(forward.graph.node) if forward is not None else [])
    # the first Conv of each (input, weight), and the Relus and MaxPools reading each value
    convs: dict[tuple[str, ...], onnx.NodeProto] = {}
    readers: dict[tuple[str, str], list[onnx.NodeProto]] = {}
    for n in forward_nodes:
        if n.op_type == "Conv" and len(n.input) >= 2:
            convs.setdefault(tuple(n.input[:2]), n)
        if n.op_type in ("Relu", "MaxPool") and n.domain in ("", "ai.onnx") and n.input:
            readers.setdefault((n.input[0], n.op_type), []).append(n)
    shapes: dict[str, list[int | None]] | None = None
    routes: dict[int, tuple[MaxPoolRoute, set[int]]] = {}
    for i, (grad, cone) in enumerate(grads):
        pool = _pooling(convs, readers, grad) if grad.route is None else None
        if pool is None:
            continue
        if shapes is None:
            shapes = inferred_shapes(model)
        match = _route(g, grad, cone, pool, shapes, exclusive)
        if match is not None:
            routes[i] = match
    if shapes is None:
        return {}
    found = {i: (MaxPoolGrad(grads[i][0].dy, route), nodes) for i, (route, nodes) in routes.items()}
    checked = verified_kernels(model, g, list(found.values()), shapes, check=_RouteCheck(shapes))
    agreed = {id(kernel) for kernel, _ in checked}
    return {i: routes[i] for i, (kernel, _) in found.items() if id(kernel) in agreed}


def _pooling(
    convs: Mapping[tuple[str, ...], onnx.NodeProto],
    readers: Mapping[tuple[str, str], list[onnx.NodeProto]],
    grad: WeightGrad,
) -> tuple[onnx.NodeProto, onnx.NodeProto | None, onnx.NodeProto] | None:
    """``(Conv, Relu or None, MaxPool)`` when the Conv of ``grad`` feeds (through a Relu) one
    MaxPool whose 2-D windows tile its input: kernel equal to the strides, no padding or
    dilation, ``ceil_mode`` 0; else None. ``convs``: the first Conv of each (input, weight);
    ``readers``: the Relus and MaxPools whose first input is a value, by (value, op type)."""
    conv = convs.get((grad.x, grad.param))
    if conv is None:
        return None
    relus = readers.get((conv.output[0], "Relu"), [])
    relu = relus[0] if len(relus) == 1 else None
    pools = readers.get((relu.output[0] if relu else conv.output[0], "MaxPool"), [])
    if len(pools) != 1:
        return None
    attrs = attributes(pools[0])
    kernel = [int(k) for k in attrs.get("kernel_shape", [])]
    tiles = (
        len(kernel) == 2
        and [int(s) for s in attrs.get("strides", [1, 1])] == kernel
        and not any(attrs.get("pads", []))
        and all(d == 1 for d in attrs.get("dilations", [1, 1]))
        and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")
        and not attrs.get("ceil_mode", 0)
    )
    return (conv, relu, pools[0]) if tiles else None


def _route(
    g: GraphIndex,
    grad: WeightGrad,
    cone: set[int],
    pool: tuple[onnx.NodeProto, onnx.NodeProto | None, onnx.NodeProto],
    shapes: dict[str, list[int | None]],
    exclusive: bool = True,
) -> tuple[MaxPoolRoute, set[int]] | None:
    """The route of ``grad`` and the nodes it replaces, when the training graph computes
    ``dy`` from the MaxPool's input ``y`` and one value ``dp`` of its output's shape alone,
    and (where ``exclusive``) reads ``dy`` only for the weight gradient (``cone``) and the
    bias gradient; else None. Not ``exclusive``, ``dy`` may have other readers (the Conv's
    input gradient): :mod:`traingraph.runtime.cpu.segments` computes it between segments."""
    conv, relu, max_pool = pool
    y = max_pool.input[0]
    if grad.dy not in g.producer:
        return None
    kernel = tuple(int(k) for a in max_pool.attribute if a.name == "kernel_shape" for k in a.ints)
    y_shape = shapes.get(y)
    if y_shape is None or len(y_shape) != 4 or None in y_shape[1:] or len(kernel) != 2:
        return None
    channels, height, width = (int(d or 0) for d in y_shape[1:])
    pooled: list[int | None] = [channels, height // kernel[0], width // kernel[1]]
    if min(channels, height // kernel[0], width // kernel[1]) < 1:
        return None
    bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
    bias_nodes: set[int] = set()
    if bias is not None and f"{bias}_grad" in g.outputs:
        root = g.producer.get(f"{bias}_grad")
        if root is None:
            return None
        bias_cone = exclusive_cone(g, root)
        bias_nodes = g.computed_from(bias_cone, {grad.dy})
        if root not in bias_nodes:
            return None
    elif bias is not None:
        bias = None  # frozen: no gradient asked for
    if exclusive and not g.consumers.get(grad.dy, set()) <= cone | bias_nodes:
        return None  # dy is read elsewhere (the Conv's input gradient)
    dy_cone = exclusive_cone(g, g.producer[grad.dy])
    for dp in sorted(
        {name for i in dy_cone for name in g.nodes[i].input if name},
        key=lambda name: g.producer.get(name, -1),
        reverse=True,
    ):
        shape = shapes.get(dp)
        if dp == y or shape is None or len(shape) != 4 or shape[1:] != pooled:
            continue
        nodes = g.computed_from(dy_cone, {y, dp})
        if g.producer[grad.dy] not in nodes:
            continue
        # a constant that other nodes read too stays in the graph
        nodes = {
            i for i in nodes
            if g.nodes[i].input
            or all(g.consumers.get(o, set()) <= nodes for o in g.nodes[i].output)
        }  # fmt: skip
        # every node computed from y and dp alone feeds only dy and each other
        allowed = nodes | cone | bias_nodes
        if all(
            g.consumers.get(o, set()) <= allowed
            for i in nodes
            for o in g.nodes[i].output
            if exclusive or o != grad.dy
        ):
            route = MaxPoolRoute(y, dp, kernel, relu is not None, bias)  # type: ignore[arg-type]
            return route, nodes | bias_nodes
    return None


@dataclass(frozen=True)
class _RouteCheck(Check):
    """The numeric check of routes (:class:`MaxPoolGrad`): on random inputs of batch 2 with
    many ties (and, behind a Relu, zeros); ``dy`` is routed, not summed, so exactly."""

    shapes: Mapping[str, list[int | None]]

    def inputs(
        self, matches: Sequence[tuple[MaxPoolGrad, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        drawn: list[dict[str, np.ndarray] | None] = []
        for kernel, _ in matches:
            route = kernel.route
            y_shape = [2, *(int(d or 0) for d in self.shapes[route.y][1:])]
            dp_shape = [2, *(int(d or 0) for d in self.shapes[route.dp][1:])]
            rng = np.random.default_rng(0)
            y = (np.round(rng.standard_normal(y_shape) * 2) / 2).astype(np.float32)  # ties
            if route.relu:
                y = np.maximum(y, np.float32(0))
            drawn.append({route.y: y, route.dp: rng.standard_normal(dp_shape).astype(np.float32)})
        return drawn

    def agrees(self, kernel: MaxPoolGrad, values: Values, expected: Values, run: int) -> bool:
        exact = {kernel.dy: 0.0}
        return kernel_agrees(kernel, values, expected, rtol=exact, flat=kernel.outputs[1:])


@dataclass(frozen=True)
class _WeightGradCheck(Check):
    """The numeric check of weight gradients: on random inputs of batch 2, windows of one
    draw; a candidate of the same form (the nodes and the Conv's attributes,
    :meth:`GraphIndex.form`) and shapes as one checked takes its verdict."""

    g: GraphIndex
    matches: Mapping[str, _Match]  # by gradient output

    def form(self, kernel: WeightGradKernel, nodes: set[int]) -> tuple[object, ...] | None:
        match = self.matches[kernel.grad.output]
        if min(match.dy_shape) < 1:
            return None
        grad = match.grad
        return (
            self.g.form(match.cone, {grad.x: "x", grad.dy: "dy", grad.output: "output"}),
            dataclasses.replace(grad, output="", param="", x="", dy=""),
            tuple(match.x_shape),
            tuple(match.dy_shape),
            tuple(match.w_shape),
        )

    def inputs(
        self, matches: Sequence[tuple[WeightGradKernel, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        size = max(
            (max(math.prod(m.x_shape), math.prod(m.dy_shape)) for m in self.matches.values()),
            default=0,
        )
        draws = WindowedDraws(np.random.default_rng(0), 2, size)
        drawn: list[dict[str, np.ndarray] | None] = []
        for kernel, _ in matches:
            match, grad = self.matches[kernel.grad.output], kernel.grad
            if min(match.dy_shape) < 1:
                drawn.append(None)
                continue
            values = draws.inputs(
                [(grad.x, 0, match.x_shape, None), (grad.dy, 1, match.dy_shape, None)]
            )
            shaped = [list(values[grad.x].shape), list(values[grad.dy].shape)]
            drawn.append(values if shaped == [match.x_shape, match.dy_shape] else None)
        return drawn


def _verified(
    model: onnx.ModelProto, g: GraphIndex, found: list[_Match]
) -> list[tuple[WeightGrad, set[int]]]:
    """The candidates whose subgraph computes what the kernel computes (:class:`_WeightGradCheck`,
    all in one onnxruntime session)."""
    check = _WeightGradCheck(g, {match.grad.output: match for match in found})
    kernels = [(WeightGradKernel(match.grad), match.cone) for match in found]
    return [(k.grad, cone) for k, cone in verified_kernels(model, g, kernels, {}, check=check)]
