"""Training-graph Convs in onnxruntime's blocked (NCHWc) convolution kernels on the CPU.

onnxruntime's CPU provider runs a float32 Conv in one of two ways. Where the filter is a
constant, its graph optimizer rewrites the Conv into its ``com.microsoft.nchwc`` kernels: the
input reordered into channel blocks, a direct convolution over the blocks with a filter
reordered once, the output reordered back. Where the filter is a graph input, as every
parameter of a training graph is, the Conv stays in the im2col-and-GEMM kernel, which unfolds
the input into a matrix of ``k * k`` times its size and multiplies it in a second pass; the
blocked kernel reads the input in place, so small-channel 3x3 convolutions (ResNet-8's
16-channel ones) spend most of their time in the unfold that the blocked form does not do.

:class:`ConvsAsNchwc`, an onnx-ir pass, writes such Convs in the blocked form with the filter
reordered in the graph on every run: a ``Gather`` of the flattened filter and bias, or a
``Reshape``, a ``Transpose`` and a ``Reshape`` where the blocked layout only reorders it. The
reordering itself is learned from onnxruntime: a one-Conv model with the same geometry and a
constant filter whose elements are their own positions (and a bias after them) is optimized by
onnxruntime, and the optimized model's constants then say, element by element, where each
filter and bias value went (0 for the padding of a partial block). The nodes around the blocked
Conv come from the same model. Each learned form is checked against the plain Conv on random
values before it is used; where onnxruntime does not block a geometry, or the check fails, the
Conv stays.

The artifacts stay standard ONNX; this is how onnxruntime's CPU provider runs them.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper

from traingraph.runtime.cpu import graph_match, verify

DOMAIN = "com.microsoft.nchwc"
_FLOAT = onnx.TensorProto.FLOAT
_EXACT = 2**24  # positions up to here are exact in float32


class _Reorder(NamedTuple):
    """Positions that only reorder the filter: ``arange(size).reshape(dims).transpose(perm)``,
    of the constant's ``shape``."""

    dims: list[int]
    perm: list[int]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Form:
    """How onnxruntime runs one Conv geometry blocked: its nodes, reading ``x`` and writing
    ``y``, and for each constant they read, the positions (1-based in the filter, then the
    bias; 0 for zeros) of its elements, or, once learned and kept (:func:`_compact`), the
    :class:`_Reorder` they are."""

    nodes: list[onnx.NodeProto]
    gathers: dict[str, np.ndarray | _Reorder]  # constant name -> positions of its shape


_learned: dict[tuple, _Form | None] = {}


class ConvsAsNchwc(ir.passes.InPlacePass):
    """Rewrite each float32 2-D Conv whose filter is not a constant (and whose window is larger
    than 1x1, where the reorders cost more than the blocked kernel saves) into onnxruntime's
    blocked form, in place, on a model whose values carry their inferred shapes; the result
    says whether any was."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opsets = [
            helper.make_opsetid(domain, version)
            for domain, version in model.opset_imports.items()
            if domain in ("", "ai.onnx")
        ]
        count = 0
        for node in list(graph):
            form = _candidate(node, opsets)
            if form is not None:
                _instantiate(graph, node, form, f"{node.outputs[0].name}_nchwc{count}")
                count += 1
        if count and DOMAIN not in model.opset_imports:
            model.opset_imports[DOMAIN] = 1
        return ir.passes.PassResult(model, modified=bool(count))


def convs_as_nchwc(model: onnx.ModelProto, shapes: Mapping[str, list[int | None]]) -> bool:
    """:class:`ConvsAsNchwc` on a ``ModelProto``, in place, with ``shapes`` (None for an unknown
    dimension) as the shapes of its values; return whether any Conv was rewritten."""
    ir_model = ir.serde.deserialize_model(model)
    for value in [*ir_model.graph.inputs, *(o for n in ir_model.graph for o in n.outputs)]:
        dims = shapes.get(value.name or "")
        if dims is not None:
            value.shape = ir.Shape(dims)
    if not ConvsAsNchwc()(ir_model).modified:
        return False
    model.CopyFrom(ir.serde.serialize_model(ir_model))
    return True


def _dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape.dims]


def _candidate(node: ir.Node, opsets: Sequence[onnx.OperatorSetIdProto]) -> _Form | None:
    """The blocked form of ``node`` where it is a Conv that :class:`ConvsAsNchwc` rewrites."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    x, w = node.inputs[0], node.inputs[1]
    if x is None or x.dtype not in (None, ir.DataType.FLOAT):  # the blocked kernels: float32
        return None
    producer = w.producer() if w is not None else None
    if w is None or w.is_initializer() or (producer is not None and producer.op_type == "Constant"):
        return None
    bias = len(node.inputs) > 2 and node.inputs[2] is not None
    attributes = [ir.serde.serialize_attribute(a) for a in node.attributes.values()]
    return form_of(_dims(x), _dims(w), attributes, bias, opsets)


def form_for(
    node: onnx.NodeProto,
    shapes: Mapping[str, list[int | None]],
    opsets: Sequence[onnx.OperatorSetIdProto],
) -> _Form | None:
    """:func:`form_of` the Conv ``node`` with the shapes of ``shapes``."""
    bias = len(node.input) > 2 and bool(node.input[2])
    x, w = shapes.get(node.input[0]), shapes.get(node.input[1])
    return form_of(x, w, list(node.attribute), bias, opsets)


def form_of(
    x_dims: Sequence[int | None] | None,
    w_dims: Sequence[int | None] | None,
    attributes: Sequence[onnx.AttributeProto],
    bias: bool,
    opsets: Sequence[onnx.OperatorSetIdProto],
) -> _Form | None:
    """The blocked form of a Conv with input and filter shapes ``x_dims`` and ``w_dims`` (None
    for an unknown dimension; the batch may be unknown), learned once per geometry in the
    process; None where the Conv stays."""
    if not x_dims or not w_dims or len(x_dims) != 4 or len(w_dims) != 4:
        return None
    if any(d is None for d in [*x_dims[1:], *w_dims]):
        return None
    x_shape = [int(d or 1) for d in x_dims]  # a batch left open is learned as 1
    w_shape = [int(d or 0) for d in w_dims]
    if math.prod(w_shape[2:]) == 1:
        return None
    attrs = tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in attributes))
    key = (tuple(x_shape[1:]), tuple(w_shape), attrs, bias)
    if key not in _learned:
        try:
            _learned[key] = _compact(_learn(x_shape, w_shape, list(attributes), bias, opsets))
        except Exception:  # a geometry onnxruntime cannot take stays as it is
            _learned[key] = None
    return _learned[key]


def _compact(form: _Form | None) -> _Form | None:
    """``form`` as it is kept for the process: positions that only reorder the filter as their
    :class:`_Reorder` (a few numbers where the positions take 8 bytes per element), the
    others as int32 (all below ``_EXACT``)."""
    if form is None:
        return None
    gathers: dict[str, np.ndarray | _Reorder] = {}
    for name, positions in form.gathers.items():
        reorder = _reorder_of(positions) if isinstance(positions, np.ndarray) else positions
        gathers[name] = reorder if reorder is not None else np.asarray(positions, np.int32)
    return _Form(form.nodes, gathers)


def _conv_model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, list[int]]],
    initializers: list[onnx.TensorProto],
    opsets: Sequence[onnx.OperatorSetIdProto],
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info(n, _FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info("y", _FLOAT, None)],
        initializers,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=list(opsets))
    if any(n.domain == DOMAIN for n in nodes):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    model.ir_version = min(model.ir_version, 9)
    return model


def _learn(
    x_shape: list[int],
    w_shape: list[int],
    attributes: list[onnx.AttributeProto],
    bias: bool,
    opsets: Sequence[onnx.OperatorSetIdProto],
) -> _Form | None:
    """The blocked form of one Conv geometry, from onnxruntime's own rewrite, checked."""
    size, channels = math.prod(w_shape), w_shape[0]
    if size + channels >= _EXACT:
        return None
    positions = np.arange(1, size + channels + 1, dtype=np.float32)
    initializers = [numpy_helper.from_array(positions[:size].reshape(w_shape), "w")]
    if bias:
        initializers.append(numpy_helper.from_array(positions[size:], "b"))
    conv = helper.make_node("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["y"])
    conv.attribute.extend(attributes)
    model = _conv_model([conv], [("x", x_shape)], initializers, opsets)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    if not any(n.domain == DOMAIN for n in optimized.graph.node):
        return None
    gathers: dict[str, np.ndarray | _Reorder] = {}
    for tensor in optimized.graph.initializer:
        values = numpy_helper.to_array(tensor)
        if values.dtype != np.float32 or not np.all((values >= 0) & (values <= size + channels)):
            return None
        if not np.array_equal(values, np.round(values)):
            return None
        gathers[tensor.name] = values.astype(np.int64)
    form = _Form(list(optimized.graph.node), gathers)
    return form if _checked(form, x_shape, w_shape, conv, bias, opsets) else None


def as_permutation(positions: np.ndarray, size: int) -> tuple[list[int], list[int]] | None:
    """``(dims, perm)`` such that ``np.arange(size).reshape(dims).transpose(perm)`` has the
    elements of ``positions`` (0-based, any shape) in order; None where no such pair exists.

    The axes are read from the positions themselves: the innermost run of equal steps, then
    the run of equal steps between such blocks, and so on; each axis's step is its stride in
    the source. The strides sorted must then tile the source (each the next one's times its
    extent), and every position is checked against them.
    """
    flat = np.asarray(positions, np.int64).reshape(-1)
    if flat.size != size or size == 0:
        return None
    extents: list[int] = []
    strides: list[int] = []
    block = 1
    while block < size:
        step = int(flat[block] - flat[0])
        left = size // block
        run = 1
        while run < left and flat[run * block] - flat[0] == run * step:
            run += 1
        while left % run:
            run -= 1
        if run < 2 or step <= 0:
            return None
        extents.append(run)
        strides.append(step)
        block *= run
    if block != size:
        return None
    order = sorted(range(len(strides)), key=lambda a: -strides[a])  # the source's axes
    expected = 1
    for a in reversed(order):
        if strides[a] != expected:
            return None
        expected *= extents[a]
    offsets = np.full(1, int(flat[0]), np.int64)
    for a in reversed(range(len(extents))):  # outermost of dst first
        offsets = np.add.outer(offsets, np.arange(extents[a], dtype=np.int64) * strides[a])
        offsets = offsets.reshape(-1)
    if flat[0] != 0 or not np.array_equal(offsets, flat):
        return None
    dims = [extents[a] for a in order]
    rank = {a: k for k, a in enumerate(order)}
    perm = [rank[a] for a in reversed(range(len(extents)))]
    return dims, perm


def _reorder_of(positions: np.ndarray) -> _Reorder | None:
    """Where ``positions`` (1-based) take every element of the filter once and the block
    layout only reorders them (no padding of a partial block), that reorder; else None."""
    size = int(positions.size)
    if size == 0 or int(positions.min()) != 1 or int(positions.max()) != size:
        return None
    found = as_permutation(positions.reshape(-1) - 1, size)
    if found is None:
        return None
    return _Reorder(found[0], found[1], tuple(positions.shape))


def _instantiate(graph: ir.Graph, conv: ir.Node, form: _Form, prefix: str) -> None:
    """Replace ``conv`` in ``graph`` by ``form``'s nodes: the flattened filter and bias gathered
    into each reordered constant (a Reshape, a Transpose and a Reshape where the positions only
    reorder the filter: a strided copy, where a Gather reads an index per element), then the
    blocked nodes, reading ``conv``'s input and writing its output. The positions and shapes
    become initializers named after ``prefix``."""
    nodes: list[ir.Node] = []

    def constant(array: np.ndarray, name: str) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
        value.shape, value.dtype = ir.Shape(array.shape), ir.DataType.from_numpy(array.dtype)
        graph.register_initializer(value)
        return value

    def add(op_type: str, inputs: Sequence[ir.Value | None], name: str, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, inputs, attrs or None)
        node.outputs[0].name = name
        nodes.append(node)
        return node.outputs[0]

    filters, bias = conv.inputs[1], conv.inputs[2] if len(conv.inputs) > 2 else None
    flat = constant(np.array([-1], np.int64), f"{prefix}_flat")
    parts = [constant(np.zeros(1, np.float32), f"{prefix}_zero")]
    parts.append(add("Reshape", [filters, flat], f"{prefix}_flat_w"))
    if bias is not None:
        parts.append(add("Reshape", [bias, flat], f"{prefix}_flat_b"))
    values = add("Concat", parts, f"{prefix}_values", axis=0)
    renamed: dict[str, ir.Value | None] = {"x": conv.inputs[0]}
    for name, positions in form.gathers.items():
        out = f"{prefix}_c_{name}"
        reorder = positions if isinstance(positions, _Reorder) else _reorder_of(positions)
        if reorder is not None:  # a filter whose form only reorders it: a Transpose
            dims, perm, shape = reorder
            dims_value = constant(np.array(dims, np.int64), f"{prefix}_{name}_dims")
            split = add("Reshape", [filters, dims_value], f"{prefix}_{name}_split")
            moved = add("Transpose", [split], f"{prefix}_{name}_moved", perm=perm)
            shape_value = constant(np.array(shape, np.int64), f"{prefix}_{name}_shape")
            renamed[name] = add("Reshape", [moved, shape_value], out)
            continue
        # int32 positions (all below _EXACT): half the memory of int64
        # and half the bytes the Gather reads
        assert isinstance(positions, np.ndarray)
        index = constant(positions.astype(np.int32), f"{prefix}_p_{name}")
        renamed[name] = add("Gather", [values, index], out)
    result = None
    for proto in form.nodes:
        node = ir.Node(
            proto.domain, proto.op_type, [renamed[v] if v else None for v in proto.input],
            [ir.serde.deserialize_attribute(a) for a in proto.attribute],
            num_outputs=len(proto.output), name=f"{prefix}_{proto.name}" if proto.name else None,
        )  # fmt: skip
        for value, name in zip(node.outputs, proto.output):
            if name == "y":
                result = value  # named after conv's output where it replaces it
            else:
                value.name = f"{prefix}_v_{name}"
                renamed[name] = value
        nodes.append(node)
    assert result is not None
    ir.convenience.replace_nodes_and_values(graph, conv, [conv], nodes, [conv.outputs[0]], [result])


@dataclass(frozen=True)
class _Blocked:
    """A learned form run by onnxruntime, as :func:`traingraph.runtime.cpu.verify.verified_kernels`
    checks a kernel: it reads ``x``, ``w`` (and ``b``) and writes ``y``."""

    session: ort.InferenceSession
    inputs: list[str]

    @property
    def outputs(self) -> list[str]:
        return ["y"]

    def compute(
        self, values: Mapping[str, np.ndarray], out: dict[str, np.ndarray], threads: int
    ) -> None:
        out["y"] = self.session.run(None, {name: values[name] for name in self.inputs})[0]


class _PoisonedInput(verify.Check):
    """Runs on random values, then with a NaN and infinities in the input alone. (Where the
    filter itself holds a NaN or an infinity, the blocked kernel puts NaN and infinities in
    other places than the Conv: the parameters are then not finite, and neither is any later
    loss.)"""

    def runs(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [feeds, {**feeds, "x": verify.with_non_finite({"x": feeds["x"]})["x"]}]


def _checked(
    form: _Form,
    x_shape: list[int],
    w_shape: list[int],
    conv: onnx.NodeProto,
    bias: bool,
    opsets: Sequence[onnx.OperatorSetIdProto],
) -> bool:
    """Whether ``form`` computes the Conv ``conv`` (filter and bias as inputs) on random
    values of a batch of 2 (the form is learned on one), then with a NaN and infinities in
    the input (:class:`_PoisonedInput`)."""
    shapes = {"x": [2, *x_shape[1:]], "w": w_shape} | ({"b": w_shape[:1]} if bias else {})
    inputs = [(name, list(shape)) for name, shape in shapes.items()]
    plain = _conv_model([conv], inputs, [], opsets)
    blocked = ir.serde.deserialize_model(plain)
    _instantiate(blocked.graph, blocked.graph.node(0), form, "check")
    blocked.opset_imports[DOMAIN] = 1
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        ir.serde.serialize_model(blocked).SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
    )
    match = (_Blocked(session, list(shapes)), {0})
    g = graph_match.GraphIndex.of(plain.graph)
    return bool(verify.verified_kernels(plain, g, [match], shapes, check=_PoisonedInput()))
