"""Convolution weight gradients computed natively on the CPU, outside the training graph.

In a standard-op training graph the weight gradient of a Conv is an unfold (a grouped Conv
with one-hot kernels, 9 copies of the input for a 3x3 kernel) and a GEMM. On the CPU the
native kernel ``traingraph.runtime._convc`` computes the same sums without materializing the
unfold, reading shifted rows of the input in place, and is 2-4x faster than the graph's form;
the 3 x 3 Convs of strides 1 and pads 1 of a ResNet go by Winograd's F(4 x 4, 3 x 3) (a
quarter of the products), about 2x faster again.

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

import contextlib
import dataclasses
import hashlib
import heapq
import importlib
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from traingraph import limits
from traingraph.ir.tags import tagged_kernels
from traingraph.runtime.device import physical_cores

if TYPE_CHECKING:
    from traingraph.runtime.tensors import TensorStore

# Relative tolerance of the numeric check, against the largest magnitude of the result.
_CHECK_RTOL = 1e-4
FLOAT = onnx.TensorProto.FLOAT
SHAPE_OPS = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"})
"""Ops that keep a value's elements and only change its shape."""


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._convc")
    except ImportError:  # built at install time only where a C compiler exists
        return None


NATIVE = _load_native()

AVAILABLE: bool = NATIVE is not None
"""Whether the native kernel was built at install time."""


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
            for g in grads
        ],
        threads,
    )
    for g in grads:
        if not np.isfinite(targets[g.output]).all():
            unfolded_weight_grad(values[g.x], values[g.dy], g, targets[g.output])


def unfolded_weight_grad(x: np.ndarray, dy: np.ndarray, grad: WeightGrad, out: np.ndarray) -> None:
    """Write the weight gradient of ``grad`` into ``out`` as the training graph forms it
    (:func:`traingraph.autodiff.rules.conv.unfold`): each column ``k`` of the zero-padded input
    is the sum over the window of the one-hot weights times the window's values, then one
    product with the output gradient summed over the batch and the positions. A NaN or an
    infinity in a window thus reaches every column of that window (``0 * inf`` is NaN), as it
    does in the graph. The native kernel multiplies each value by its own weight only, so
    where it writes a NaN or an infinity (it does wherever a value it reads is one),
    :func:`compute` writes this form instead."""
    oh, ow = dy.shape[2:]
    kh, kw = out.shape[2:]
    (top, left), (bottom, right) = grad.pads, grad.end_pads
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (sh, sw), (dh, dw) = grad.strides, grad.dilations
    cg, og = x.shape[1] // grad.group, dy.shape[1] // grad.group
    one_hot = np.eye(kh * kw, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for g in range(grad.group):
            xs = padded[:, g * cg : (g + 1) * cg]
            windows = [
                xs[:, :, i * dh : i * dh + (oh - 1) * sh + 1 : sh,
                   j * dw : j * dw + (ow - 1) * sw + 1 : sw]
                for i in range(kh)
                for j in range(kw)
            ]  # fmt: skip
            for k in range(kh * kw):
                column = windows[0] * one_hot[k, 0]
                for other in range(1, kh * kw):
                    column = column + windows[other] * one_hot[k, other]
                out[g * og : (g + 1) * og, :, k // kw, k % kw] = np.tensordot(
                    dy[:, g * og : (g + 1) * og], column, axes=([0, 2, 3], [0, 2, 3])
                )


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
    :class:`~traingraph.runtime.segments.SegmentedRunner`, as soon as the values it reads
    are written (while the output gradient is still in cache), instead of after the run."""

    grad: WeightGrad

    @property
    def inputs(self) -> list[str]:
        return list(reads(self.grad))

    @property
    def outputs(self) -> list[str]:
        bias = self.grad.route.bias if self.grad.route is not None else None
        return [self.grad.output] + ([f"{bias}_grad"] if bias is not None else [])

    def compute(
        self, values: Mapping[str, np.ndarray], out: dict[str, np.ndarray], threads: int
    ) -> None:
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


def default_threads(intra_op_threads: int) -> int:
    """The kernels' thread count: onnxruntime's intra-op count, one per physical core when 0."""
    return intra_op_threads if intra_op_threads > 0 else physical_cores()


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
    tags = tagged_kernels(model.graph.node)
    if tags and "conv_weight_grad" not in tags:
        return model, []
    graph = model.graph
    with shared_analyses():  # one shape inference and one index of the model
        g = GraphIndex.of(graph)
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
        reads = _graph_reads(graph)
        convs += [n for n in forward.graph.node if n.input and n.input[0] in reads]
    shapes: dict[str, list[int | None]] | None = None
    found: list[_Match] = []
    for node in convs:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        param, x = node.input[1], node.input[0]
        output = f"{param}_grad"
        if param not in inputs or output not in outputs or output not in producer:
            continue
        w_shape = value_dims(inputs[param])
        if len(w_shape) != 4 or None in w_shape or _elem_type(inputs[param]) != FLOAT:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            continue
        if shapes is None:
            shapes = inferred_shapes(model)
        x_shape = shapes.get(x)
        if x_shape is None or len(x_shape) != 4 or None in x_shape[1:]:
            continue
        pads = [int(p) for p in attrs.get("pads", [0, 0, 0, 0])]
        strides, dilations = pair_of(attrs.get("strides")), pair_of(attrs.get("dilations"))
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
                grad = WeightGrad(
                    output=output,
                    param=param,
                    x=x,
                    dy=dy,
                    strides=strides,
                    pads=(pads[0], pads[1]),
                    end_pads=(pads[2], pads[3]),
                    dilations=dilations,
                    group=int(attrs.get("group", 1)),
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


def _graph_reads(graph: onnx.GraphProto) -> set[str]:
    """The names a graph reads from outside its nodes: its inputs and initializers."""
    return {i.name for i in graph.input} | {t.name for t in graph.initializer}


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return int(value.type.tensor_type.elem_type)


def value_dims(value: onnx.ValueInfoProto, symbols: bool = False) -> list[Any]:
    """A value's dimensions: numbers, None where unknown (with ``symbols``, a named symbolic
    dimension is its name)."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return []
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) if symbols else None
        for d in tensor.shape.dim
    ]


_shared: dict[tuple[object, ...], Any] | None = None
"""Within :func:`shared_analyses`: the shapes and indexes computed so far, by the content of
the model or graph they are of."""


@contextlib.contextmanager
def shared_analyses() -> Iterator[None]:
    """Within this context :func:`inferred_shapes` and :meth:`GraphIndex.of` compute their
    result once for each model (or graph) content and give it again for the same content: the
    matchers of the kernels each ask for the model's shapes and index, and on a large graph
    shape inference takes a good part of a second. Left, the results are dropped."""
    global _shared
    outer = _shared
    if outer is None:
        _shared = {}
    try:
        yield
    finally:
        if outer is None:
            _shared = None


def _content(message: onnx.ModelProto | onnx.GraphProto) -> bytes:
    return hashlib.blake2b(message.SerializeToString(deterministic=True)).digest()


def inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The shapes onnx's shape inference gives each float value; {} where it fails."""
    key = ("shapes", _content(model)) if _shared is not None else None
    if key is not None and _shared is not None and key in _shared:
        return {name: list(dims) for name, dims in _shared[key].items()}
    try:
        inferred = onnx.shape_inference.infer_shapes(
            model, data_prop=limits.data_propagation_allowed(model)
        )
    except Exception:  # without shapes nothing is matched
        return {}
    graph = inferred.graph
    shapes = {
        v.name: value_dims(v)
        for v in list(graph.value_info) + list(graph.input) + list(graph.output)
        if _elem_type(v) == FLOAT and v.type.tensor_type.HasField("shape")
    }
    if key is not None and _shared is not None:
        _shared[key] = {name: list(dims) for name, dims in shapes.items()}
    return shapes


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def has_subgraphs(model: onnx.ModelProto) -> bool:
    """Whether a node of ``model`` holds a subgraph (whose reads of outer values a match
    would not see)."""
    return any(has_subgraph(n) for n in model.graph.node)


def _below(g: GraphIndex, cone: set[int], sources: set[str]) -> set[int]:
    """The nodes of ``cone`` computed from ``sources`` and constants alone, and read only by
    each other."""
    below = g.computed_from(cone, sources)
    # A node below that also feeds the rest of the cone (a shared Constant) stays.
    for i in sorted(below, reverse=True):
        if any(g.consumers.get(name, set()) - below for name in g.nodes[i].output):
            below.discard(i)
    return below


def pair_of(values: Sequence[int] | None) -> tuple[int, int]:
    return (1, 1) if not values else (int(values[0]), int(values[1]))


def exclusive_cone(
    g: GraphIndex,
    root: int,
    within: set[int] | None = None,
) -> set[int]:
    """The nodes whose results reach only ``root``'s output: ``root`` and, walking back in
    topological order, every node (of ``within``, where given) all of whose used outputs feed
    only nodes already in.

    Only the producers of what the nodes already in read can join, so the walk visits those
    (latest first) rather than every earlier node."""
    nodes, producer, consumers, outputs = g.nodes, g.producer, g.consumers, g.outputs
    cone = {root}
    pending = [-j for j in _producers_of(nodes[root], producer)]
    heapq.heapify(pending)
    position = root  # the walk goes down from here; a node above it was passed already
    while pending:
        i = -heapq.heappop(pending)
        if i >= position or i in cone or (within is not None and i not in within):
            continue
        position = i
        used = [name for name in nodes[i].output if name and consumers.get(name)]
        if (
            used
            and not any(name in outputs for name in nodes[i].output)
            and all(consumers[name] <= cone for name in used)
        ):
            cone.add(i)
            for j in _producers_of(nodes[i], producer):
                heapq.heappush(pending, -j)
    return cone


def _producers_of(node: onnx.NodeProto, producer: Mapping[str, int]) -> set[int]:
    return {producer[name] for name in node.input if name in producer}


def can_match(model: onnx.ModelProto, function: str, op_type: str) -> bool:
    """Whether a native kernel's matcher has anything to look at: the extension has
    ``function``, ``model`` holds a default-domain ``op_type`` node, and no node holds a
    subgraph (whose reads of outer values a match would not see)."""
    if NATIVE is None or not hasattr(NATIVE, function):
        return False
    nodes = model.graph.node
    if not any(n.op_type == op_type and n.domain in ("", "ai.onnx") for n in nodes):
        return False
    return not any(has_subgraph(n) for n in nodes)


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The values of ``graph``'s small constants (initializers and Constant nodes) by name."""
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            attr = node.attribute[0]
            if attr.name == "value":
                values[node.output[0]] = attr.t
    return {
        name: numpy_helper.to_array(tensor)
        for name, tensor in values.items()
        if np.prod(tensor.dims, dtype=np.int64) <= 16
    }


@dataclass(frozen=True)
class GraphIndex:
    """A training model's nodes and the indexes over them that matching a subgraph uses."""

    nodes: list[onnx.NodeProto]
    producer: dict[str, int]
    consumers: dict[str, set[int]]
    outputs: set[str]
    constants: set[str]
    param_grads: set[str]  # the outputs "<input>_grad"
    initializers: Mapping[str, onnx.TensorProto] = dataclasses.field(default_factory=dict)
    _digests: dict[str, bytes] = dataclasses.field(default_factory=dict, compare=False)

    @staticmethod
    def of(graph: onnx.GraphProto) -> GraphIndex:
        """The index of ``graph`` (the same one again for the same graph, unchanged, within
        :func:`shared_analyses`)."""
        if _shared is None:
            return GraphIndex._of(graph)
        # the graph itself is kept too: the index holds its nodes, and its id stays its own
        key = ("index", id(graph), _content(graph))
        if key not in _shared:
            _shared[key] = (graph, GraphIndex._of(graph))
        return _shared[key][1]

    @staticmethod
    def _of(graph: onnx.GraphProto) -> GraphIndex:
        nodes = list(graph.node)
        consumers: dict[str, set[int]] = {}
        for i, n in enumerate(nodes):
            for name in n.input:
                consumers.setdefault(name, set()).add(i)
        constants = {t.name for t in graph.initializer} | {
            name
            for n in nodes
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
            for name in n.output
        }
        outputs = {o.name for o in graph.output}
        return GraphIndex(
            nodes,
            {name: i for i, n in enumerate(nodes) for name in n.output if name},
            consumers,
            outputs,
            constants,
            {f"{name}_grad" for name in _graph_reads(graph)} & outputs,
            {t.name: t for t in graph.initializer},
        )

    def derived_from(
        self, value: str, sources: set[str], memo: dict[str, bool] | None = None
    ) -> bool:
        """Whether ``value`` is computed from ``sources`` and constants alone (a node that
        reads nothing but is no Constant, a random draw, is not); ``memo`` keeps the answers
        for values along the way, for further calls with the same ``sources``."""
        memo = {} if memo is None else memo
        stack = [value]
        while stack:
            v = stack[-1]
            if v in memo:
                stack.pop()
                continue
            node = self.nodes[self.producer[v]] if v in self.producer else None
            if v in sources or v in self.constants:
                memo[v] = True
            elif node is None or not node.input:
                memo[v] = False
            else:
                # one input known not to be derived settles it; else look at the next unknown
                reads = [r for r in node.input if r]
                if any(memo.get(r) is False for r in reads):
                    memo[v] = False
                else:
                    pending = next((r for r in reads if r not in memo), None)
                    if pending is not None:
                        stack.append(pending)
                        continue
                    memo[v] = True
            stack.pop()
        return memo[value]

    def only_reader(self, value: str, taken: Collection[int] = ()) -> int | None:
        """The one node that reads ``value``, where ``value`` is no graph output and the node
        is not in ``taken`` (another kernel's); else None."""
        readers = self.consumers.get(value, set())
        if len(readers) != 1 or value in self.outputs:
            return None
        reader = next(iter(readers))
        return None if reader in taken else reader

    def descendants_computed_from(
        self, start: str, sources: set[str], allowed: Callable[[str], bool]
    ) -> set[int]:
        """The nodes that read ``start`` (transitively), are computed from ``sources`` and
        constants alone, and write only ``allowed`` values.

        The walk goes forward from the readers of ``start`` (in the nodes' order), not over
        every node."""
        computable: dict[int, bool] = {}  # a node's inputs come from sources and constants
        reached = {start}
        found: set[int] = set()
        pending = sorted(self.consumers.get(start, ()))
        position = -1  # the walk goes up from here; a node below it was passed already
        while pending:
            i = heapq.heappop(pending)
            if i <= position:
                continue
            position = i
            node = self.nodes[i]
            if not any(v in reached for v in node.input if v):
                continue
            if not self._computable(i, sources, computable):
                continue
            outputs = [o for o in node.output if o]
            if all(allowed(o) for o in outputs):
                found.add(i)
                reached.update(outputs)
                for o in outputs:
                    for j in self.consumers.get(o, ()):
                        heapq.heappush(pending, j)
        return found

    def _computable(self, i: int, sources: set[str], memo: dict[int, bool]) -> bool:
        """Whether every input of node ``i`` is one of ``sources``, a constant, or written by
        an earlier node whose inputs are so too (``memo`` keeps the answers by node)."""
        stack = [i]
        while stack:
            j = stack[-1]
            if j in memo:
                stack.pop()
                continue
            verdict: bool | None = True
            for v in self.nodes[j].input:
                if not v or v in sources or v in self.constants:
                    continue
                p = self.producer.get(v)
                if p is None or p >= j or memo.get(p) is False:
                    verdict = False
                    break
                if p not in memo:
                    verdict = None  # known once p is
            if verdict is None:
                stack.append(next(
                    p for v in self.nodes[j].input
                    if (p := self.producer.get(v, -1)) >= 0 and p not in memo
                    and v not in sources and v not in self.constants
                ))  # fmt: skip
                continue
            memo[j] = verdict
            stack.pop()
        return memo[i]

    def leading_to(self, nodes: set[int], targets: set[str]) -> set[int]:
        """The nodes of ``nodes`` from which one of ``targets`` is reached within ``nodes``."""
        keep: set[int] = set()
        wanted = set(targets)
        for i in sorted(nodes, reverse=True):
            if any(o in wanted for o in self.nodes[i].output):
                keep.add(i)
                wanted.update(v for v in self.nodes[i].input if v)
        return keep

    def external(self, nodes: set[int]) -> set[str]:
        """The values ``nodes`` write that a model output is or another node reads."""
        return {
            o
            for j in nodes
            for o in self.nodes[j].output
            if o and (o in self.outputs or not self.consumers.get(o, set()) <= nodes)
        }

    def helpers(self, nodes: set[int], sources: set[str]) -> set[int]:
        """Nodes computed from ``sources`` and constants (recomputed statistics) that feed
        only ``nodes`` and each other."""
        found: set[int] = set()
        derived: dict[str, bool] = {}  # derived_from's answers for these sources
        changed = True
        while changed:
            changed = False
            around = set().union(*(self._producers(j) for j in nodes | found))
            for i in sorted(around, reverse=True):
                if i in nodes or i in found:
                    continue
                node = self.nodes[i]
                if any(o in self.outputs for o in node.output):
                    continue
                if not all(self.derived_from(v, sources, derived) for v in node.input if v):
                    continue
                if all(self.consumers.get(o, set()) <= nodes | found for o in node.output if o):
                    found.add(i)
                    changed = True
        return found

    def summed_into(self, grad: str) -> str | None:
        """The value whose ReduceSum, through shape ops, is the model output ``grad`` (a bias's
        gradient); None where it is none."""
        if grad not in self.outputs or grad not in self.producer:
            return None
        i = self.producer[grad]
        while self.nodes[i].op_type in SHAPE_OPS and self.nodes[i].input[0] in self.producer:
            i = self.producer[self.nodes[i].input[0]]
        return self.nodes[i].input[0] if self.nodes[i].op_type == "ReduceSum" else None

    def normalization_grad(
        self,
        dy: str,
        sources: set[str],
        allowed: Callable[[str], bool],
        like_x: Callable[[str], bool],
        dbias: str,
        dscale: str,
    ) -> tuple[set[int], str | None, str | None] | None:
        """The nodes of a normalization's gradient: those computed from ``sources`` (the
        input, the scale, the output gradient ``dy``) that write only ``allowed`` values, lead
        from ``dy`` to the bias gradient ``dbias``, the scale gradient ``dscale`` or a value
        ``like_x`` (of the input's shape; not those of a normalization on a parallel branch
        that sums the same ``dy``), with the statistics they recompute; and the input's
        gradient and ``dscale`` where the nodes write them. None where they write other
        values too or no ``dbias``."""
        nodes = self.descendants_computed_from(dy, sources, allowed)
        ours = {dbias, dscale} | {
            o for o in self.external(nodes) if o not in self.param_grads and like_x(o)
        }
        nodes = self.leading_to(nodes, ours)
        nodes |= self.helpers(nodes, sources)
        external = self.external(nodes)
        written = dscale if dscale in external else None
        rest = external - {dbias, written}
        if dbias not in external or len(rest) > 1:
            return None
        return nodes, next(iter(rest), None), written

    def _producers(self, i: int) -> set[int]:
        return {self.producer[v] for v in self.nodes[i].input if v in self.producer}

    def form(self, nodes: Collection[int], roles: Mapping[str, str]) -> tuple[object, ...]:
        """What ``nodes`` compute, without the names of their values: each node's op,
        attributes and inputs, an input named by the node and output that write it within,
        by its role in ``roles`` (a kernel's inputs and outputs: "x", "dy", ...), by the
        contents of the constant it is, or else by its own name. Two matches of one form whose
        inputs have the same shapes compute the same function of their inputs, so one numeric
        check decides both."""
        order = sorted(nodes)
        at = {
            name: (k, j) for k, i in enumerate(order) for j, name in enumerate(self.nodes[i].output)
        }
        form: list[object] = []
        for i in order:
            node = self.nodes[i]
            inputs = tuple(
                at[v] if v in at
                else ("role", roles[v]) if v in roles
                else ("constant", self._constant_digest(v)) if v in self.constants
                else ("value", v)
                for v in node.input
            )  # fmt: skip
            form.append((
                node.domain or "ai.onnx",
                node.op_type,
                tuple(a.SerializeToString(deterministic=True) for a in node.attribute),
                inputs,
                tuple(roles.get(o, "") for o in node.output),
            ))  # fmt: skip
        return tuple(form)

    def _constant_digest(self, name: str) -> bytes:
        """A digest of the contents (type, shape, values) of the constant ``name``."""
        digests = self._digests
        if name not in digests:
            if name in self.producer:  # a Constant node: its attribute holds the value
                node = self.nodes[self.producer[name]]
                content = b"".join(a.SerializeToString(deterministic=True) for a in node.attribute)
            else:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(self.initializers[name])
                tensor.ClearField("name")
                content = tensor.SerializeToString(deterministic=True)
            digests[name] = hashlib.blake2b(content, digest_size=16).digest()
        return digests[name]

    def computed_from(self, cone: set[int], sources: set[str]) -> set[int]:
        """The nodes of ``cone`` computed from ``sources`` and constants alone."""
        known = set(sources)
        found: set[int] = set()
        for i in sorted(cone):
            if all(v in known or v in self.constants for v in self.nodes[i].input if v):
                found.add(i)
                known.update(name for name in self.nodes[i].output if name)
        return found


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
        if match is not None and _route_checks(model, g, grad, *match, shapes):
            routes[i] = match
    return routes


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
    attrs = {a.name: helper.get_attribute_value(a) for a in pools[0].attribute}
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
    input gradient): :mod:`traingraph.runtime.segments` computes it between segments."""
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


def _route_checks(
    model: onnx.ModelProto,
    g: GraphIndex,
    grad: WeightGrad,
    route: MaxPoolRoute,
    nodes: set[int],
    shapes: dict[str, list[int | None]],
) -> bool:
    """Whether the training graph's ``nodes`` compute what the native route computes, on
    random inputs of batch 2 with many ties (and, behind a Relu, zeros)."""
    y_shape = [2, *(int(d or 0) for d in shapes[route.y][1:])]
    dp_shape = [2, *(int(d or 0) for d in shapes[route.dp][1:])]
    rng = np.random.default_rng(0)
    y = (np.round(rng.standard_normal(y_shape) * 2) / 2).astype(np.float32)  # ties
    if route.relu:
        y = np.maximum(y, np.float32(0))
    feeds = {route.y: y, route.dp: rng.standard_normal(dp_shape).astype(np.float32)}
    outputs = [grad.dy] + ([f"{route.bias}_grad"] if route.bias is not None else [])
    runs = [feeds, with_non_finite(feeds)]  # then a NaN and infinities in them
    try:
        results = run_subgraph(model, [g.nodes[i] for i in sorted(nodes)], runs, outputs)
    except Exception:  # a subgraph onnxruntime rejects stays in the graph
        return False
    assert NATIVE is not None
    for run, got in zip(runs, results):
        dy = np.empty(y.shape, np.float32)
        bias = np.empty(y.shape[1], np.float32) if route.bias is not None else None
        NATIVE.route_max_pool(run[route.y], run[route.dp], dy, bias, route.kernel, route.relu, 1)
        if not same_values(dy, got[0], 0.0):  # routed, not summed: the same values
            return False
        if bias is not None and not same_values(bias, got[1].reshape(bias.shape)):
            return False
    return True


@overload
def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: dict[str, np.ndarray],
    outputs: list[str],
) -> list[np.ndarray]: ...


@overload
def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: list[dict[str, np.ndarray]],
    outputs: list[str],
) -> list[list[np.ndarray]]: ...


def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: dict[str, np.ndarray] | list[dict[str, np.ndarray]],
    outputs: list[str],
) -> list[np.ndarray] | list[list[np.ndarray]]:
    """Run ``nodes`` of ``model`` (with the constants they read) on ``feeds``, in one
    single-threaded onnxruntime CPU session, and return ``outputs``; for a list of feeds (of
    one set of names and shapes), a run on each, in the one session."""
    runs = feeds if isinstance(feeds, list) else [feeds]
    graph = model.graph
    needed = {name for n in nodes for name in n.input}
    constant_nodes = [
        n for n in graph.node
        if n.op_type == "Constant" and any(o in needed for o in n.output) and n not in nodes
    ]  # fmt: skip
    sub = helper.make_graph(
        constant_nodes + nodes,
        "native_check",
        [
            helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)
            )
            for name, v in runs[0].items()
        ],
        [helper.make_tensor_value_info(name, FLOAT, None) for name in outputs],
        [t for t in graph.initializer if t.name in needed],
    )
    check = helper.make_model(sub, opset_imports=list(model.opset_import))
    check.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        check.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    results = [list(session.run(outputs, run)) for run in runs]
    return results if isinstance(feeds, list) else results[0]


def verified_kernels(
    model: onnx.ModelProto,
    g: GraphIndex,
    matches: Sequence[tuple[Any, set[int]]],
    shapes: Mapping[str, list[int | None]],
    offsets: Mapping[str, float] | None = None,
) -> list[tuple[Any, set[int]]]:
    """The matches (native kernels of :mod:`traingraph.runtime.segments`, each with the indices
    of the nodes it replaces) whose kernel computes what their nodes compute on random inputs
    (of the model's batch, or 2 where it is open), ``offsets`` added to the named ones, all in
    one single-threaded onnxruntime session. The nodes between matches that stay (the Squeezes
    of a BatchNorm's statistics) run in the check too, and a kernel reads what the others'
    nodes computed (an addend that is another's output)."""
    checked = [
        (kernel, nodes) for kernel, nodes in matches
        if all((d := shapes.get(v)) is not None and None not in d[1:] for v in kernel.inputs)
    ]  # fmt: skip
    if not checked:
        return []
    members = set().union(*(nodes for _, nodes in checked))
    while True:
        produced = {o for i in members for o in g.nodes[i].output}
        reads = {v for i in members for v in g.nodes[i].input if v}
        between = {
            g.producer[v] for v in reads - produced
            if v in g.producer and all(
                u in produced or u in g.constants for u in g.nodes[g.producer[v]].input if u
            )
        }  # fmt: skip
        if between <= members:
            break
        members |= between
    external = sorted(reads - produced - g.constants)
    feeds = random_feeds(np.random.default_rng(0), external, shapes)
    if feeds is None:
        return []
    for name, offset in (offsets or {}).items():
        if name in feeds:  # else another kernel's nodes compute it
            feeds[name] += offset
    wanted = [o for kernel, _ in checked for o in kernel.outputs]
    # what the nodes between compute and a kernel reads (a Relu between two matches)
    wanted += sorted({v for kernel, _ in checked for v in kernel.inputs} & produced - set(wanted))
    replaced = [g.nodes[i] for i in sorted(members)]
    runs = [feeds, with_non_finite(feeds)]  # finite inputs, then a NaN and infinities in them
    try:
        results = run_subgraph(model, replaced, runs, wanted)
    except Exception:  # a subgraph onnxruntime rejects stays in the graph
        return []
    agreed = []
    for kernel, nodes in checked:
        for inputs, outputs in zip(runs, results):
            expected = dict(zip(wanted, outputs))
            if not kernel_agrees(kernel, {**inputs, **expected}, expected):
                break
        else:
            agreed.append((kernel, nodes))
    return agreed


def random_feeds(
    rng: np.random.Generator, names: Sequence[str], shapes: Mapping[str, list[int | None]]
) -> dict[str, np.ndarray] | None:
    """A standard-normal float32 value for each of ``names`` of its inferred shape (batch 2
    where it is open), to check a native kernel against the nodes it replaces; None where a
    shape beyond the batch is unknown."""
    feeds = {}
    for name in names:
        shape = shapes.get(name)
        if shape is None or None in shape[1:]:
            return None
        full = [int(shape[0] or 2), *(int(d or 0) for d in shape[1:])]
        feeds[name] = rng.standard_normal(full, dtype=np.float32)
    return feeds


class WindowedDraws:
    """Standard-normal float32 inputs for the numeric checks of many matches at once, drawn
    once: input k of a check (its x, its dy, ...) is a copy of the start of window k of one
    draw, so the inputs of one check are independent of each other, while another check may
    see the same values, which weakens neither. An input another check made already keeps its
    array (a value two matches read gets one); where its window is one this check's other
    inputs take too, a new input gets a draw of its own.

    Args:
        rng: The generator.
        windows: Windows (inputs per check).
        size: Elements per window: the largest input.
    """

    def __init__(self, rng: np.random.Generator, windows: int, size: int) -> None:
        self._rng = rng
        self._draw = rng.standard_normal((windows, size), dtype=np.float32)
        self._sources: dict[str, int] = {}  # a feed -> its window (< 0: a draw of its own)
        self.feeds: dict[str, np.ndarray] = {}
        """Every input made so far, by name."""

    def inputs(
        self,
        wanted: Sequence[
            tuple[str, int, Sequence[int], Callable[[np.ndarray], np.ndarray] | None]
        ],
    ) -> dict[str, np.ndarray]:
        """The inputs of one check: for each ``(name, window, shape, transform)`` the array
        of ``name``, made from ``window`` (a copy, or what ``transform`` makes of it: a new
        array) unless another check made it already."""
        used = {self._sources[name] for name, *_ in wanted if name in self.feeds}
        for name, window, shape, transform in wanted:
            if name in self.feeds:
                continue
            if window in used:
                window = -1 - len(self._sources)
                raw = self._rng.standard_normal(shape, dtype=np.float32)
            else:
                raw = self._draw[window, : math.prod(shape)].reshape(shape)
            used.add(window)
            self._sources[name] = window
            self.feeds[name] = transform(raw) if transform is not None else raw.copy()
        return {name: self.feeds[name] for name, *_ in wanted}


class NormalizationGradOutputs:
    """What a normalization's gradient kernel writes (``dx`` and ``dscale`` where not None,
    ``dbias``); mixed into the kernels' dataclasses that have those fields."""

    dx: str | None
    dscale: str | None
    dbias: str

    @property
    def outputs(self) -> list[str]:
        return [n for n in (self.dx, self.dscale, self.dbias) if n]

    def output_arrays(
        self, out: dict[str, np.ndarray], x: tuple[int, ...], features: tuple[int, ...]
    ) -> None:
        """Arrays in ``out`` for the outputs: ``dx`` of ``x``'s shape, the others of the shape
        of the ``features`` (channels, or the normalized axis)."""
        for name, shape in ((self.dx, x), (self.dscale, features), (self.dbias, features)):
            if name:
                output_array(out, name, shape)


def output_array(out: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``out[name]`` where it has ``shape`` (a native kernel writes it in place), else a new
    float32 array put there."""
    target = out.get(name)
    if target is None or target.shape != tuple(shape):
        target = out[name] = np.empty(shape, np.float32)
    return target


def kernel_agrees(
    kernel: Any, values: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]
) -> bool:
    """Whether ``kernel`` (a native kernel of :mod:`traingraph.runtime.segments`), computed
    single-threaded from ``values``, writes each of its outputs as ``expected`` holds it, to
    ``_CHECK_RTOL`` of its largest element; False where it refuses the shapes."""
    got: dict[str, np.ndarray] = {}
    try:
        kernel.compute(values, got, 1)
    except ValueError:
        return False
    return all(same_values(got[name], expected[name]) for name in kernel.outputs)


def same_values(got: np.ndarray, want: np.ndarray, rtol: float = _CHECK_RTOL) -> bool:
    """Whether ``got`` is what the graph computed, ``want``: the same shape, NaN exactly where
    ``want`` is NaN, the same infinities, and finite values within ``rtol`` of ``want``'s
    largest finite magnitude. Every check of a fast path against its nodes compares so."""
    if got.shape != want.shape:
        return False
    finite = np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)):
        return False
    if not np.array_equal(got[np.isinf(want)], want[np.isinf(want)]):
        return False
    if not np.isfinite(got[finite]).all():
        return False
    if not finite.any():
        return True
    scale = float(np.abs(want[finite]).max()) or 1.0
    return bool(np.abs(got[finite] - want[finite]).max() <= rtol * scale)


def with_non_finite(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of ``feeds`` with a NaN, a +Inf and a -Inf in each float array of rank 2 or more
    and 8 elements or more (the last sample's first, middle and last elements): the inputs
    on which a check sees that a fast path propagates them as the graph does. Vectors (a
    scale, a bias) keep their values, so that the other elements stay finite."""
    poisoned = dict(feeds)
    for name, value in feeds.items():
        if value.dtype.kind != "f" or value.ndim < 2 or value.size < 8:
            continue
        copy = value.copy()
        last = copy.reshape(copy.shape[0], -1)[-1]
        last[0], last[last.size // 2], last[-1] = np.nan, np.inf, -np.inf
        poisoned[name] = copy
    return poisoned


def _verified(
    model: onnx.ModelProto, g: GraphIndex, found: list[_Match]
) -> list[tuple[WeightGrad, set[int]]]:
    """The candidates whose subgraph computes what the kernel computes, on random inputs of
    batch 2 (all in one onnxruntime session); a candidate of the same form (the nodes and the
    Conv's attributes, :meth:`GraphIndex.form`) and shapes as one checked takes its verdict."""
    nodes = g.nodes
    size = max((max(math.prod(m.x_shape), math.prod(m.dy_shape)) for m in found), default=0)
    draws = WindowedDraws(np.random.default_rng(0), 2, size)
    feeds = draws.feeds
    checks: list[tuple[int, WeightGrad, set[int], list[int]]] = []
    decides: dict[tuple[object, ...], int] = {}  # a form -> the candidate checked for it
    checked_as: dict[int, int] = {}  # a candidate -> the one whose check decides it
    for index, match in enumerate(found):
        grad = match.grad
        if min(match.dy_shape) < 1:
            continue
        form = (
            g.form(match.cone, {grad.x: "x", grad.dy: "dy", grad.output: "output"}),
            dataclasses.replace(grad, output="", param="", x="", dy=""),
            tuple(match.x_shape),
            tuple(match.dy_shape),
            tuple(match.w_shape),
        )
        if form in decides:
            checked_as[index] = decides[form]
            continue
        values = draws.inputs(
            [(grad.x, 0, match.x_shape, None), (grad.dy, 1, match.dy_shape, None)]
        )
        x, dy = values[grad.x], values[grad.dy]
        if list(x.shape) != match.x_shape or list(dy.shape) != match.dy_shape:
            continue
        checks.append((index, grad, match.cone, match.w_shape))
        decides[form] = checked_as[index] = index
    if not checks:
        return []
    keep = sorted(set().union(*(cone for _, _, cone, _ in checks)))
    runs = [feeds, with_non_finite(feeds)]  # finite inputs, then a NaN and infinities in them
    try:
        results = run_subgraph(
            model, [nodes[i] for i in keep], runs, [grad.output for _, grad, _, _ in checks]
        )
    except Exception:  # a subgraph onnxruntime rejects stays in the graph
        return []
    passed = set()
    for k, (index, grad, _, w_shape) in enumerate(checks):
        agrees = True
        for run, outputs in zip(runs, results):
            got = np.zeros(w_shape, np.float32)
            try:
                compute([grad], run, {grad.output: got}, 1)
            except ValueError:
                agrees = False
                break
            agrees = agrees and same_values(got, outputs[k])
        if agrees:
            passed.add(index)
    return [
        (match.grad, match.cone) for i, match in enumerate(found) if checked_as.get(i) in passed
    ]
