"""Convolution weight gradients computed natively on the CPU, outside the training graph.

In a standard-op training graph the weight gradient of a Conv is an unfold (a grouped Conv
with one-hot kernels, 9 copies of the input for a 3x3 kernel) and a GEMM. On the CPU the
native kernel ``traingraph.runtime._convc`` computes the same sums without materializing the
unfold, reading shifted rows of the input in place, and is 2-4x faster than the graph's form.

:func:`split_weight_grads` finds, in a training model, each gradient output that is the
weight gradient of one 2-D float32 Conv: the nodes that feed only that output read nothing
but the Conv's input ``X``, one other tensor ``G`` (the gradient of the Conv's output) and
constants. It checks that claim numerically (the subgraph and the kernel give the same
result on random ``X`` and ``G``), then returns the model without those nodes, with ``X``
and ``G`` as outputs instead of the gradient, and a :class:`WeightGrad` for each, which
:func:`compute` evaluates after each run. Everything else, the artifact on disk included,
stays standard ONNX; where the extension is missing or nothing matches, the model is used
as it is.

Example:
    >>> model, grads = split_weight_grads(onnx.load("training_model.onnx"))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

if TYPE_CHECKING:
    from traingraph.runtime.tensors import TensorStore

# Relative tolerance of the numeric check, against the largest magnitude of the result.
_CHECK_RTOL = 1e-4
FLOAT = onnx.TensorProto.FLOAT


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._convc")
    except ImportError:  # built at install time only where a C compiler exists
        return None


_native = _load_native()

AVAILABLE: bool = _native is not None
"""Whether the native kernel was built at install time."""


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


def compute(
    grads: Sequence[WeightGrad],
    values: Mapping[str, np.ndarray],
    targets: Mapping[str, np.ndarray],
    threads: int,
) -> None:
    """Write each gradient of ``grads`` into ``targets[grad.output]``, from ``values`` (the
    arrays of each ``x`` and ``dy`` by name), on ``threads`` threads."""
    assert _native is not None
    for g in grads:
        _check_geometry(g, values[g.x].shape, values[g.dy].shape)
    _native.weight_grads(
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


def run_outputs(grads: Sequence[WeightGrad], inputs: Collection[str]) -> list[str]:
    """The values the split model must return for ``grads``: each ``x`` and ``dy`` that is
    not one of the model's ``inputs``."""
    return sorted({name for g in grads for name in (g.x, g.dy)} - set(inputs))


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
        for name in (g.x, g.dy)
    }
    compute(grads, values, {g.output: store.host_view(g.param) for g in grads}, threads)


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
    """The kernel's thread count: onnxruntime's intra-op count, or the usable cores when 0."""
    if intra_op_threads > 0:
        return intra_op_threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def split_weight_grads(
    model: onnx.ModelProto, forward: onnx.ModelProto | None = None
) -> tuple[onnx.ModelProto, list[WeightGrad]]:
    """``model`` without the nodes of each Conv weight gradient the native kernel can compute,
    and those gradients; ``model`` itself and ``[]`` where there are none (or no kernel).

    ``forward`` is the model that ran the forward pass where ``model`` is a separate gradient
    phase: its Convs count too where ``model`` reads their input (as a saved value or a feed).
    """
    if _native is None:
        return model, []
    graph = model.graph
    found = _verified(model, _candidates(model, forward))
    if not found:
        return model, []
    removed: set[int] = set()
    for _, cone in found:
        removed |= cone
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    g = rewritten.graph
    del g.node[:]
    g.node.extend(n for i, n in enumerate(graph.node) if i not in removed)
    replaced = {grad.output for grad, _ in found}
    kept = [o for o in graph.output if o.name not in replaced]
    names = {o.name for o in kept} | {i.name for i in graph.input}
    types = _value_types(graph)
    for grad, _ in found:
        for name in (grad.x, grad.dy):
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


def _candidates(model: onnx.ModelProto, forward: onnx.ModelProto | None = None) -> list[_Match]:
    """The gradient outputs that look like one Conv's weight gradient (see the module
    docstring), with the nodes that compute them; the Convs of ``forward`` count where
    ``model`` reads their input."""
    graph = model.graph
    nodes = list(graph.node)
    outputs = {o.name for o in graph.output}
    inputs = {i.name: i for i in graph.input}
    producer = {name: i for i, n in enumerate(nodes) for name in n.output if name}
    convs = list(nodes)
    if forward is not None:
        # a weight the gradient phase does not read (no input gradient) is typed in forward
        inputs = {i.name: i for i in forward.graph.input} | inputs
        reads = _graph_reads(graph)
        convs += [n for n in forward.graph.node if n.input and n.input[0] in reads]
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
    shapes: dict[str, list[int | None]] | None = None
    found: list[_Match] = []
    for node in convs:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        param, x = node.input[1], node.input[0]
        output = f"{param}_grad"
        if param not in inputs or output not in outputs or output not in producer:
            continue
        w_shape = _dims(inputs[param])
        if len(w_shape) != 4 or None in w_shape or _elem_type(inputs[param]) != FLOAT:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            continue
        if shapes is None:
            shapes = _inferred_shapes(model)
        x_shape = shapes.get(x)
        if x_shape is None or len(x_shape) != 4 or None in x_shape[1:]:
            continue
        pads = [int(p) for p in attrs.get("pads", [0, 0, 0, 0])]
        strides, dilations = _pair(attrs.get("strides")), _pair(attrs.get("dilations"))
        out_shape = [w_shape[0]]
        for axis in range(2):
            extent = (w_shape[2 + axis] - 1) * dilations[axis] + 1  # type: ignore[operator]
            padded = x_shape[2 + axis] + pads[axis] + pads[2 + axis]  # type: ignore[operator]
            out_shape.append((padded - extent) // strides[axis] + 1)
        if consumers.get(output):
            continue  # read inside the graph as well (a finiteness check, a sum)
        cone = _cone(nodes, producer[output], outputs, consumers)
        if any(_has_subgraph(nodes[i]) for i in cone):
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
            below = _below(nodes, cone, {x, dy}, constants, consumers)
            if producer[output] in below:
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


def _dims(value: onnx.ValueInfoProto) -> list[int | None]:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The shapes onnx's shape inference gives each float value; {} where it fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # without shapes nothing is matched
        return {}
    graph = inferred.graph
    return {
        v.name: _dims(v)
        for v in list(graph.value_info) + list(graph.input) + list(graph.output)
        if _elem_type(v) == FLOAT and v.type.tensor_type.HasField("shape")
    }


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def _below(
    nodes: list[onnx.NodeProto],
    cone: set[int],
    sources: set[str],
    constants: set[str],
    consumers: dict[str, set[int]],
) -> set[int]:
    """The nodes of ``cone`` computed from ``sources`` and constants alone, and read only by
    each other."""
    known = set(sources) | constants
    below: set[int] = set()
    for i in sorted(cone):
        node = nodes[i]
        reads = [name for name in node.input if name]
        if all(name in known for name in reads):
            below.add(i)
            known.update(name for name in node.output if name)
    # A node below that also feeds the rest of the cone (a shared Constant) stays.
    for i in sorted(below, reverse=True):
        if any(consumers.get(name, set()) - below for name in nodes[i].output):
            below.discard(i)
    return below


def _pair(values: Sequence[int] | None) -> tuple[int, int]:
    return (1, 1) if not values else (int(values[0]), int(values[1]))


def _cone(
    nodes: list[onnx.NodeProto], root: int, outputs: set[str], consumers: dict[str, set[int]]
) -> set[int]:
    """The nodes whose results reach only ``root``'s output: ``root`` and, walking back in
    topological order, every node all of whose used outputs feed only nodes already in."""
    cone = {root}
    for i in range(root - 1, -1, -1):
        used = [name for name in nodes[i].output if name and consumers.get(name)]
        if (
            used
            and not any(name in outputs for name in nodes[i].output)
            and all(consumers[name] <= cone for name in used)
        ):
            cone.add(i)
    return cone


def _verified(model: onnx.ModelProto, found: list[_Match]) -> list[tuple[WeightGrad, set[int]]]:
    """The candidates whose subgraph computes what the kernel computes, on random inputs of
    batch 2 (all in one onnxruntime session)."""
    graph = model.graph
    nodes = list(graph.node)
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    checks: list[tuple[WeightGrad, set[int], np.ndarray]] = []
    for match in found:
        grad = match.grad
        if min(match.dy_shape) < 1:
            continue
        x = feeds.setdefault(grad.x, rng.standard_normal(match.x_shape).astype(np.float32))
        dy = feeds.setdefault(grad.dy, rng.standard_normal(match.dy_shape).astype(np.float32))
        if list(x.shape) != match.x_shape or list(dy.shape) != match.dy_shape:
            continue
        expected = np.zeros(match.w_shape, np.float32)
        try:
            compute([grad], feeds, {grad.output: expected}, 1)
        except ValueError:
            continue
        checks.append((grad, match.cone, expected))
    if not checks:
        return []
    keep = sorted(set().union(*(cone for _, cone, _ in checks)))
    needed = {name for i in keep for name in nodes[i].input}
    constant_nodes = [
        n for n in nodes if n.op_type == "Constant" and any(o in needed for o in n.output)
    ]
    sub = helper.make_graph(
        constant_nodes + [nodes[i] for i in keep],
        "weight_grad_check",
        [helper.make_tensor_value_info(name, FLOAT, list(v.shape)) for name, v in feeds.items()],
        [helper.make_tensor_value_info(g.output, FLOAT, None) for g, _, _ in checks],
        [t for t in graph.initializer if t.name in needed],
    )
    check = helper.make_model(sub, opset_imports=list(model.opset_import))
    check.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(
            check.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        results = session.run([g.output for g, _, _ in checks], feeds)
    except Exception:  # a subgraph onnxruntime rejects stays in the graph
        return []
    verified = []
    for (grad, cone, expected), got in zip(checks, results):
        scale = float(np.abs(expected).max()) or 1.0
        if got.shape == expected.shape and np.abs(got - expected).max() <= _CHECK_RTOL * scale:
            verified.append((grad, cone))
    return verified
