"""Values a graph computes from constants and static shapes, known before it runs.

Exporters often compute slice bounds, reshape targets, resize sizes and split sizes from
``Shape`` of a tensor: ``Shape -> Gather -> Div -> Mul -> Slice``. :func:`constant_value`
evaluates such small integer subgraphs so that gradient rules can pick the formulation for
constant arguments.

Shapes are folded per element: ``Shape`` of a tensor whose batch dimension is dynamic still
gives its static dimensions, so ``Gather(Shape(x), 2)``, ``Slice(Shape(x), 2, 4)`` and their
``Concat`` with constants are known wherever they read static dimensions only.
:func:`partial_value` gives such a value element by element: a number where it is known, a
:class:`Dim` where it is the dynamic length of an axis of some tensor (so that a rule can tell
that ``Resize`` keeps that axis), None where it is unknown. Nothing unknown is ever guessed.

Example:
    >>> bounds = constant_value(slice_node.inputs[2])  # numpy array, or None
    >>> sizes = partial_value(resize_node.inputs[3])  # e.g. [Dim(x, 0), 3, 64, 64]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

_MAX_DEPTH = 16
_MAX_ELEMENTS = 1024  # only small (shape-like) tensors are evaluated


@dataclass(frozen=True, eq=False)
class Dim:
    """The dynamic length of axis ``axis`` of ``value``, an element of :func:`partial_value`.

    Attributes:
        value: The tensor whose shape the element was read from.
        axis: The axis of ``value``.
    """

    value: ir.Value
    axis: int

    def is_dim_of(self, x: ir.Value, axis: int) -> bool:
        """Whether this is the length of ``x``'s axis ``axis``: read from ``x`` itself, or a
        dimension with the same symbolic name (ONNX gives equal names equal lengths)."""
        if self.value is x and self.axis == axis:
            return True
        name = _dim_name(self.value, self.axis)
        return name is not None and name == _dim_name(x, axis)


def _dim_name(x: ir.Value, axis: int) -> str | None:
    """The symbolic name of ``x``'s axis ``axis``; None where it has none or a name that
    ONNX shape inference made up (``unk__<n>``, which it also gives lengths that differ)."""
    if x.shape is None or not -len(x.shape) <= axis < len(x.shape):
        return None
    dim = x.shape.dims[axis]
    if isinstance(dim, int) or dim.value is None or dim.value.startswith("unk__"):
        return None
    return dim.value


_UNKNOWN = object()  # an unknown element with no identity


@dataclass
class _Partial:
    """A value known element by element: ``values`` holds the known elements (1 elsewhere),
    ``dims`` is None when every element is known, else an object array of the same shape
    holding None at known elements and a :class:`Dim` or ``_UNKNOWN`` at the others."""

    values: np.ndarray
    dims: np.ndarray | None = None

    @property
    def known(self) -> bool:
        return self.dims is None or all(d is None for d in self.dims.flat)


def constant_value(value: ir.Value | None, depth: int = _MAX_DEPTH) -> np.ndarray | None:
    """The value of ``value`` as numpy when it follows from constants and static shapes.

    Covers initializers, ``Constant`` nodes in every attribute form (``value``,
    ``value_float(s)``, ``value_int(s)``, ``value_string(s)`` as an object array), ``Shape`` /
    ``Size`` and small integer arithmetic on them (Gather, Concat, Unsqueeze, Squeeze, Cast,
    Identity, Reshape, Slice, Add, Sub, Mul, Div, Neg, Max, Min) where every element it reads
    is static. Returns None for anything else.
    """
    partial = _evaluate(value, depth)
    return partial.values if partial is not None and partial.known else None


def partial_value(value: ir.Value | None) -> list[int | float | Dim | None] | None:
    """The elements of a scalar or 1-D ``value``, each known or not.

    Returns:
        None where ``value`` is not a small tensor computed from constants and shapes; else
        one entry per element (row-major): its number where it is known, a :class:`Dim`
        where it is the dynamic length of an axis, None where it is otherwise unknown.
    """
    partial = _evaluate(value, _MAX_DEPTH)
    if partial is None or partial.values.ndim > 1:
        return None
    numbers = partial.values.reshape(-1).tolist()
    if partial.dims is None:
        return numbers
    return [
        n if d is None else (d if isinstance(d, Dim) else None)
        for n, d in zip(numbers, partial.dims.reshape(-1))
    ]


def constant_attribute_value(node: ir.Node) -> np.ndarray | None:
    """The tensor a ``Constant`` node holds, whichever attribute holds it (None if none)."""
    for name, attr in node.attributes.items():
        if name == "value":
            return attr.value.numpy()
        if name == "value_float":
            return np.array(attr.value, dtype=np.float32)
        if name == "value_floats":
            return np.array(list(attr.value), dtype=np.float32)
        if name == "value_int":
            return np.array(attr.value, dtype=np.int64)
        if name == "value_ints":
            return np.array(list(attr.value), dtype=np.int64)
        if name == "value_string":
            return np.array(attr.value, dtype=object)
        if name == "value_strings":
            return np.array(list(attr.value), dtype=object)
    return None


def densify_sparse_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``Constant(sparse_value=...)`` holding the dense tensor instead.

    onnx_ir does not read sparse tensors; their dense form is the same constant. Returns
    ``model`` itself when it has none, else a copy.
    """
    found = [
        node for graph in _graphs(model.graph) for node in graph.node
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
        and any(a.name == "sparse_value" for a in node.attribute)
    ]  # fmt: skip
    if not found:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for graph in _graphs(copy.graph):
        for node in graph.node:
            sparse = [a for a in node.attribute if a.name == "sparse_value"]
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not sparse:
                continue
            dense = _densify(sparse[0].sparse_tensor)
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("value", dense))
    return copy


def _densify(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    shape = tuple(sparse.dims)
    dense = np.zeros(math.prod(shape), dtype=values.dtype)
    if indices.ndim == 2:  # [nnz, rank] coordinates
        indices = np.ravel_multi_index(tuple(indices.T), shape) if indices.size else indices[:, 0]
    dense[indices.reshape(-1)] = values.reshape(-1)
    return numpy_helper.from_array(dense.reshape(shape), sparse.values.name)


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """``graph`` and every subgraph of its nodes, recursively."""
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            for sub in subgraphs:
                found.extend(_graphs(sub))
    return found


def fold_shape_computations(graph: ir.Graph) -> bool:
    """Replace each value ``graph`` computes from static dimensions and constants (``Shape ->
    Gather -> Div -> Slice`` bounds, resize sizes, reshape targets), and each integer value it
    computes from constants alone (``Unsqueeze(Constant)`` Slice starts), with a ``Constant``.

    ONNX shape inference does not see through such arithmetic, so a ``Slice`` whose bounds are
    computed (torch's ``chunk``) gets an output of unknown shape, and so does everything after
    it. With the computations folded, inferring shapes again gives them. Only values that read
    a ``Shape`` or ``Size`` and no floating-point initializer, or integer values of constants,
    are folded (a parameter is never made a constant), so the model computes the same for every
    batch size. The nodes left without readers are removed.

    Returns:
        Whether any value was folded.
    """
    shape_based: dict[ir.Value, bool] = {}

    def foldable(value: ir.Value) -> bool:
        return _reads_shapes(value, shape_based) or _integers_from_constants(value)

    nodes = [
        node for node in graph
        if node.op_type not in ("Constant", "Shape", "Size") and node.op_type in _EVALUATORS
        and node.domain in ("", "ai.onnx") and len(node.outputs) == 1
        and foldable(node.outputs[0])
    ]  # fmt: skip
    folded = False
    for node in nodes:  # the last values of each computation: those read by other nodes
        out = node.outputs[0]
        readers = [o for use in out.uses() for o in use.node.outputs]
        if out.is_graph_output() or all(foldable(o) for o in readers):
            continue
        value = constant_value(out)
        if value is None or value.dtype == object or value.size > _MAX_ELEMENTS:
            continue
        if value.dtype.kind == "f" and not shape_based.get(out, False):
            continue  # floating-point arithmetic on constants stays as written
        constant = ir.Node(
            "", "Constant", [], [ir.AttrTensor("value", ir.tensor(value))],
            name=f"{node.name or out.name}/folded",
        )  # fmt: skip
        graph.insert_before(node, constant)
        replacement = constant.outputs[0]
        replacement.name, replacement.type, replacement.shape = out.name, out.type, out.shape
        out.name = None
        out.replace_all_uses_with(replacement)
        folded = True
    if not folded:
        return False
    for node in reversed(list(graph)):
        evaluable = node.op_type in _EVALUATORS or node.op_type in ("Constant", "Shape", "Size")
        if evaluable and node.domain in ("", "ai.onnx") and not any(
            o.uses() or o.is_graph_output() for o in node.outputs
        ):
            graph.remove(node, safe=True)
    for node in graph:  # shapes inference made up without the folded values: infer them again
        for output in node.outputs:
            if output.shape is not None and any(
                not isinstance(d, int) and (d.value is None or d.value.startswith("unk__"))
                for d in output.shape.dims
            ):
                output.shape = None
    return True


_BIASED_OPS = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}
"""Ops with an optional bias input, and its position."""
_ZERO_PRESERVING = frozenset({"Expand", "Cast", "CastLike", "Identity", "Reshape", "Unsqueeze"})
"""Ops whose output is all zeros where their first input is."""


def drop_zero_biases(graph: ir.Graph) -> int:
    """Remove the bias input of each ``Conv``, ``ConvTranspose`` and ``Gemm`` whose bias is
    zeros computed from constants, and the nodes left without readers.

    Exporters give a convolution without a bias one filled with zeros (the dynamo exporter:
    ``Expand(CastLike(0, x), [C])``); the providers then add it to every output element, a
    full pass over the output for nothing. Adding zeros changes no value but a ``-0`` (to
    ``+0``), NaN and infinities included (a provider's kernel may still round differently
    where it adds a bias inside its accumulation). Initializers are never taken for such a
    bias: a zero initializer may be a parameter, which training moves.

    Returns:
        How many bias inputs were removed.
    """
    removed = 0
    for node in list(graph):
        position = _BIASED_OPS.get(node.op_type)
        if position is None or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.inputs) <= position or not is_computed_zeros(node.inputs[position]):
            continue
        bias = node.inputs[position]
        node.resize_inputs(position)
        remove_if_unused(graph, bias)
        removed += 1
    return removed


_TO_THE_END = 2**62
"""A Slice ``end`` at least this large reaches the end of any axis (exporters write INT64_MAX)."""


def identity_slices(graph: ir.Graph) -> int:
    """Make each ``Slice`` that keeps every element of its input an ``Identity``.

    The dynamo exporter writes ``x[:, 1:]`` as a Slice of axis 0 from 0 to INT64_MAX followed
    by a Slice of axis 1. Such a full Slice is a copy in the forward pass and, where its axis
    is dynamic (the batch), its gradient could not be a Pad: the general gradient scatters
    into zeros through an int64 index of every element (on a language model's logits, twice
    the logits' memory). A Slice is the identity where, on each axis it slices, the step is 1,
    the start is 0 (or at most minus a static length) and the end is at least the static
    length or at least :data:`_TO_THE_END`, all constants; its output keeps its name.

    Returns:
        How many Slices became Identities.
    """
    changed = 0
    for node in list(graph):
        if node.op_type != "Slice" or node.domain not in ("", "ai.onnx"):
            continue
        if not _keeps_everything(node):
            continue
        bounds = list(node.inputs[1:])
        node.op_type = "Identity"
        node.resize_inputs(1)
        x, out = node.inputs[0], node.outputs[0]
        if x is not None and x.shape is not None:  # inference could not see through the bounds
            out.shape = x.shape
        for value in bounds:
            remove_if_unused(graph, value)
        changed += 1
    return changed


def slice_inputs(node: ir.Node) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """A Slice's starts, ends, axes and steps where every one given is a constant, the axes
    as written (not normalized) and the defaults of the op where absent (the leading axes,
    steps of 1); None where one is not constant or their lengths differ."""
    if len(node.inputs) < 3 or node.inputs[0] is None:
        return None
    given = [*node.inputs[1:5], *[None] * (5 - len(node.inputs))]
    args = [constant_value(v) if v is not None else None for v in given]
    if any(v is not None and a is None for v, a in zip(given, args)):
        return None
    starts, ends, axes, steps = (None if a is None else np.ravel(a).tolist() for a in args)
    assert starts is not None and ends is not None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        return None
    return starts, ends, axes, steps


def _keeps_everything(node: ir.Node) -> bool:
    args = slice_inputs(node)
    if args is None:
        return False
    shape = node.inputs[0].shape if node.inputs[0] is not None else None
    for start, end, axis, step in zip(*args):
        size = None
        if shape is not None and -len(shape) <= axis < len(shape):
            dim = shape.dims[axis]
            size = dim if isinstance(dim, int) else None
        elif shape is not None:
            return False
        if step != 1:
            return False
        if not (start == 0 or (size is not None and start <= -size)):
            return False
        if not (end >= _TO_THE_END or (size is not None and end >= size)):
            return False
    return True


_RANDOM_OPS = frozenset({
    "Bernoulli", "Dropout", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
    "RandomUniformLike",
})  # fmt: skip
"""Ops that draw random numbers: removing one would change what the others draw."""
_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def remove_dead_nodes(graph: ir.Graph) -> list[ir.Node]:
    """Remove the nodes whose outputs nothing reads and the graph does not return.

    onnxruntime runs every node of a model, read or not: a training graph whose loss reads the
    logits before the model's final Transpose would still transpose them at every step. Nodes
    of other domains, nodes with subgraphs and nodes that draw random numbers stay.

    Returns:
        The nodes removed.
    """
    removed = []
    for node in reversed(list(graph)):
        if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS:
            continue
        if any(a.type in _GRAPH_ATTRIBUTES for a in node.attributes.values()):
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        graph.remove(node, safe=True)
        removed.append(node)
    return removed


def remove_if_unused(graph: ir.Graph, value: ir.Value | None) -> list[ir.Node]:
    """Remove the node computing ``value`` where nothing reads it, then its inputs' likewise;
    return the nodes removed."""
    node = None if value is None else value.producer()
    if node is None or any(o.uses() or o.is_graph_output() for o in node.outputs):
        return []
    inputs = list(node.inputs)
    graph.remove(node, safe=True)
    removed = [node]
    for v in inputs:
        removed += remove_if_unused(graph, v)
    return removed


def is_computed_zeros(value: ir.Value | None, depth: int = _MAX_DEPTH) -> bool:
    """Whether ``value`` is all zeros, computed from ``Constant`` nodes (not initializers)."""
    if value is None or depth == 0 or value.is_graph_input() or value.is_initializer():
        return False
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Constant":
        array = constant_attribute_value(node)
        return array is not None and array.dtype != object and not np.any(array)
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        return attr is None or not np.any(attr.value.numpy())
    if node.op_type in _ZERO_PRESERVING:
        return is_computed_zeros(node.inputs[0] if node.inputs else None, depth - 1)
    return False


def _reads_shapes(value: ir.Value, memo: dict[ir.Value, bool]) -> bool:
    """Whether ``value`` is computed from a ``Shape`` or ``Size`` with nothing but constants,
    integer initializers and the evaluable ops besides (no floating-point initializer)."""
    if value in memo:
        return memo[value]
    node = value.producer()
    if node is None:  # a graph input or an initializer
        return False
    memo[value] = False  # until known, guards against cycles
    if node.op_type in ("Shape", "Size"):
        result = True
    elif node.op_type == "Constant" or node.op_type not in _EVALUATORS:
        result = False
    else:
        inputs = [v for v in node.inputs if v is not None]
        result = any(_reads_shapes(v, memo) for v in inputs) and all(
            _reads_shapes(v, memo) or _from_constants(v) for v in inputs
        )
    memo[value] = result
    return result


def _integers_from_constants(value: ir.Value) -> bool:
    """Whether ``value`` is computed by an evaluable op from constants alone and is not
    floating-point (the TorchScript exporter writes a Slice's starts, axes and steps as
    ``Unsqueeze(Constant)``)."""
    node = value.producer()
    if node is None or node.op_type == "Constant" or node.op_type not in _EVALUATORS:
        return False
    if value.dtype is not None and value.dtype.is_floating_point():
        return False
    return _from_constants(value)


def _from_constants(value: ir.Value, depth: int = _MAX_DEPTH) -> bool:
    """Whether ``value`` is a constant (:func:`_is_constant`) or computed from constants alone
    by the evaluable ops (torch's exporter writes a reshape target's constant part so)."""
    if _is_constant(value):
        return True
    node = value.producer()
    if node is None or depth <= 0 or node.op_type not in _EVALUATORS:
        return False
    return node.domain in ("", "ai.onnx") and all(
        _from_constants(v, depth - 1) for v in node.inputs if v is not None
    )


def _is_constant(value: ir.Value) -> bool:
    """A Constant node's output, or an initializer that is not floating-point."""
    node = value.producer()
    if node is not None:
        return node.op_type == "Constant" and node.domain in ("", "ai.onnx")
    return value.const_value is not None and value.dtype is not None and (
        not value.dtype.is_floating_point()
    )


def _evaluate(value: ir.Value | None, depth: int) -> _Partial | None:
    if value is None or depth <= 0:
        return None
    if value.const_value is not None:
        return _Partial(value.const_value.numpy())
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    if node.op_type == "Constant":
        constant = constant_attribute_value(node)
        return None if constant is None else _Partial(constant)
    if node.op_type in ("Shape", "Size"):
        return _shape_of(node)
    evaluate = _EVALUATORS.get(node.op_type)
    if evaluate is None:
        return None
    args = [_evaluate(v, depth - 1) if v is not None else None for v in node.inputs]
    if any(a is None for a, v in zip(args, node.inputs) if v is not None):
        return None
    if any(a is not None and a.values.size > _MAX_ELEMENTS for a in args):
        return None
    data = _DATA_ARGS.get(node.op_type, 0)
    elementwise = not data and node.op_type in _ELEMENTWISE
    if not elementwise and any(a is not None and not a.known for a in args[data:]):
        return None  # indices, axes and target shapes must be known
    try:
        values = evaluate(node, [None if a is None else a.values for a in args])
        if values is None:
            return None
        values = np.asarray(values)
        if all(a is None or a.dims is None for a in args):
            return _Partial(values)
        if node.op_type == "Cast":
            assert args[0] is not None and args[0].dims is not None
            dims = args[0].dims
        elif data:  # the same selection of the data's elements
            dims = np.asarray(evaluate(node, [
                _dims_of(a) if i < data else None if a is None else a.values
                for i, a in enumerate(args)
            ]))  # fmt: skip
        else:  # arithmetic: unknown where any operand is
            masks = [_unknown(a.dims) for a in args if a is not None and a.dims is not None]
            unknown = np.broadcast_to(functools.reduce(np.logical_or, masks), values.shape)
            dims = np.full(values.shape, None, dtype=object)
            dims[unknown] = _UNKNOWN
    except (ValueError, IndexError, TypeError, ZeroDivisionError):
        return None
    return _Partial(np.where(_unknown(dims), np.ones_like(values), values), dims)


def _unknown(dims: np.ndarray) -> np.ndarray:
    """Where ``dims`` (a :class:`_Partial`'s) marks an element unknown."""
    return np.vectorize(lambda d: d is not None, otypes=[bool])(dims)


def _dims_of(partial: _Partial | None) -> np.ndarray | None:
    if partial is None:
        return None
    if partial.dims is None:
        return np.full(partial.values.shape, None, dtype=object)
    return partial.dims


def _shape_of(node: ir.Node) -> _Partial | None:
    x = node.inputs[0]
    if x is None or x.shape is None:
        return None
    dims = list(x.shape.dims)
    if node.op_type == "Size":
        sizes = [d for d in dims if isinstance(d, int)]
        if len(sizes) != len(dims):
            return _Partial(np.array(1, dtype=np.int64), np.array(_UNKNOWN, dtype=object))
        return _Partial(np.array(math.prod(sizes), dtype=np.int64))
    r = len(dims)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", r)
    start, end = (min(max(v + r if v < 0 else v, 0), r) for v in (start, end))
    axes = range(start, end)
    values = np.array([d if isinstance(d, int) else 1 for d in dims[start:end]], dtype=np.int64)
    if all(isinstance(dims[a], int) for a in axes):
        return _Partial(values)
    unknown = np.empty(len(axes), dtype=object)
    unknown[:] = [None if isinstance(dims[a], int) else Dim(x, a) for a in axes]
    return _Partial(values, unknown)


def _axes(node: ir.Node, args: list[np.ndarray | None]) -> list[int] | None:
    if len(args) > 1 and args[1] is not None:
        return [int(a) for a in args[1].reshape(-1)]
    attr = node.attributes.get_ints("axes")
    return None if attr is None else list(attr)


def _unsqueeze(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, axes = args[0], _axes(node, args)
    if x is None or axes is None:
        return None
    r = x.ndim + len(axes)
    for axis in sorted(a % r for a in axes):
        x = np.expand_dims(x, axis)
    return x


def _squeeze(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, axes = args[0], _axes(node, args)
    if x is None:
        return None
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


def _div(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    a, b = args[0], args[1]
    assert a is not None and b is not None
    if a.dtype.kind in "iu":
        return (np.trunc(a / b)).astype(a.dtype)  # ONNX integer Div truncates
    return a / b


def _mod(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    """Integer ``Mod``: the remainder takes the divisor's sign, or the dividend's with ``fmod``
    (torch's exporter normalizes negative dimensions so)."""
    a, b = args[0], args[1]
    assert a is not None and b is not None
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu" or np.any(b == 0):
        return None
    remainder = np.fmod if node.attributes.get_int("fmod", 0) else np.mod
    return remainder(a, b).astype(np.result_type(a, b))


def _slice(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, starts, ends = args[0], args[1], args[2]
    assert x is not None and starts is not None and ends is not None
    axes = args[3] if len(args) > 3 and args[3] is not None else np.arange(len(starts))
    steps = args[4] if len(args) > 4 and args[4] is not None else np.ones(len(starts), np.int64)
    index = [slice(None)] * x.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps):
        index[int(axis) % x.ndim] = slice(int(start), int(end), int(step))
    return x[tuple(index)]


def _reshape(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    x, shape = args[0], args[1]
    assert x is not None and shape is not None
    target = [int(d) for d in shape.reshape(-1)]
    if not node.attributes.get_int("allowzero", 0):
        target = [x.shape[i] if d == 0 and i < x.ndim else d for i, d in enumerate(target)]
    return x.reshape(target)


def _binary(op: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable:
    def evaluate(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray:
        a, b = args[0], args[1]
        assert a is not None and b is not None
        return op(a, b).astype(np.result_type(a, b))

    return evaluate


_EVALUATORS: dict[str, Callable[[ir.Node, list[np.ndarray | None]], np.ndarray | None]] = {
    "Identity": lambda node, args: args[0],
    "Neg": lambda node, args: -args[0],  # type: ignore[operator]
    "Ceil": lambda node, args: np.ceil(args[0]),  # type: ignore[arg-type]
    "Floor": lambda node, args: np.floor(args[0]),  # type: ignore[arg-type]
    "Cast": lambda node, args: args[0].astype(  # type: ignore[union-attr]
        ir.DataType(node.attributes.get_int("to", 1)).numpy()
    ),
    "Gather": lambda node, args: np.take(
        args[0],  # type: ignore[arg-type]
        args[1],  # type: ignore[arg-type]
        axis=node.attributes.get_int("axis", 0),
    ),
    "Concat": lambda node, args: np.concatenate(
        args,  # type: ignore[arg-type]
        axis=node.attributes.get_int("axis", 0),
    ),
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _div,
    "Mod": _mod,
    "Max": lambda node, args: functools.reduce(np.maximum, args),  # type: ignore[arg-type]
    "Min": lambda node, args: functools.reduce(np.minimum, args),  # type: ignore[arg-type]
}
# Ops that select or rearrange the elements of their first n inputs (which may be partly
# known) as their other inputs (which must be known) say.
_DATA_ARGS = {
    "Identity": 1, "Cast": 1, "Gather": 1, "Reshape": 1, "Unsqueeze": 1, "Squeeze": 1,
    "Slice": 1, "Concat": _MAX_ELEMENTS,
}  # fmt: skip
_ELEMENTWISE = frozenset({"Neg", "Add", "Sub", "Mul", "Div", "Mod", "Max", "Min"})

__all__ = [
    "Dim",
    "constant_attribute_value",
    "constant_value",
    "densify_sparse_constants",
    "fold_shape_computations",
    "identity_slices",
    "is_computed_zeros",
    "remove_dead_nodes",
    "slice_inputs",
    "partial_value",
]
