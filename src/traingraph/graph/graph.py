"""Graphs built from layers: a :class:`Graph` is an ONNX graph with tensor handles.

Example:
    >>> g = Graph("mlp")
    >>> x = g.input("x", shape=[None, 4])
    >>> y = layers.ReLU()(layers.Linear(4, 2)(x))
    >>> g.output("y", y)
    >>> g.save("mlp.onnx")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from traingraph.errors import ModelError
from traingraph.graph.data import WeightSource
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import load_ir, max_ir_version, to_proto
from traingraph.ir.model import save as save_model

__all__ = ["DEFAULT_OPSET", "Graph", "Tensor", "TensorSpec", "compose"]

DEFAULT_OPSET = 17

Dim = int | str | None


def _binary_operator(op_type: str, reverse: bool = False) -> Callable[[Tensor, Any], Tensor]:
    """A :class:`Tensor` operator adding an ``op_type`` node; ``reverse`` swaps the operands."""

    def operator(self: Tensor, other: Any) -> Tensor:
        return self._binary(op_type, other, reverse)

    return operator


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of an input: ``TensorSpec([None, 1, 8, 8], "float32")``.

    Attributes:
        shape: Dimensions: ints, names of symbolic dimensions, or None for a dynamic one.
        dtype: A numpy dtype or its name.
    """

    shape: Sequence[Dim] | None
    dtype: Any = "float32"

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def ir_value(self, name: str) -> ir.Value:
        """A graph input with this spec."""
        shape = None if self.shape is None else ir.Shape(list(self.shape))
        element = ir.DataType.from_numpy(self.numpy_dtype)
        return ir.Value(name=name, shape=shape, type=ir.TensorType(element))


class Tensor:
    """A handle to a tensor of a :class:`Graph`; layers take and return these.

    Arithmetic operators build nodes: ``a + b``, ``a * 2.0``, ``a @ w``, ``-a``.
    """

    def __init__(self, graph: Graph, value: ir.Value) -> None:
        self.graph = graph
        self.value = value

    @property
    def name(self) -> str:
        return self.value.name or ""

    @property
    def dtype(self) -> np.dtype | None:
        return None if self.value.dtype is None else np.dtype(self.value.dtype.numpy())

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, graph={self.graph.name!r})"

    def _binary(self, op_type: str, other: Any, reverse: bool = False) -> Tensor:
        other_value = self.graph.as_value(other, like=self)
        a, b = (other_value, self.value) if reverse else (self.value, other_value)
        return self.graph.wrap(self.graph.builder.op(op_type, a, b), like=self)

    __add__ = _binary_operator("Add")
    __radd__ = _binary_operator("Add", reverse=True)
    __sub__ = _binary_operator("Sub")
    __rsub__ = _binary_operator("Sub", reverse=True)
    __mul__ = _binary_operator("Mul")
    __rmul__ = _binary_operator("Mul", reverse=True)
    __truediv__ = _binary_operator("Div")
    __rtruediv__ = _binary_operator("Div", reverse=True)
    __matmul__ = _binary_operator("MatMul")

    def __neg__(self) -> Tensor:
        return self.graph.wrap(self.graph.builder.Neg(self.value), like=self)


class Graph:
    """An ONNX graph under construction: inputs, layer nodes, parameters and outputs.

    Parameters are initializers of the ONNX graph; their values are numpy arrays or
    :class:`~traingraph.graph.data.WeightSource` objects, loaded when the model is materialized
    (:meth:`to_onnx`, :meth:`save`, compiling a training graph) and purged afterwards.

    Args:
        name: The graph's name; it prefixes generated node and tensor names, so the graphs
            composed into one training graph need distinct names.
        opset: The default-domain opset of the nodes (13 to the newest onnxruntime supports).
    """

    def __init__(self, name: str = "graph", opset: int = DEFAULT_OPSET) -> None:
        self.name = name
        self.opset = opset
        self.ir_graph = ir.Graph([], [], nodes=[], opset_imports={"": opset}, name=name)
        self.builder = OpBuilder(self.ir_graph, opset, prefix=name)
        self.parameters: dict[str, np.ndarray | WeightSource] = {}
        self.frozen: set[str] = set()
        self._layer_names: dict[int, tuple[object, str]] = {}  # the graph keeps its layers alive
        self._kind_counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return (
            f"Graph({self.name!r}, inputs={[v.name for v in self.ir_graph.inputs]},"
            f" outputs={[v.name for v in self.ir_graph.outputs]}, nodes={len(self.ir_graph)})"
        )

    # ------------------------------------------------------------ building
    def input(
        self, name: str, shape: Sequence[Dim] | None = None, dtype: Any = "float32"
    ) -> Tensor:
        """Add a graph input; ``None`` dimensions are dynamic (the batch, typically)."""
        if any(v.name == name for v in self.ir_graph.inputs):
            raise ModelError(f"graph {self.name!r} already has an input {name!r}")
        value = TensorSpec(shape, dtype).ir_value(name)
        self.ir_graph.inputs.append(value)
        return Tensor(self, value)

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Expose ``tensor`` as the graph output ``name``."""
        self._check_own(tensor, "output")
        out = self.builder.Identity(tensor.value)
        out.name, out.type, out.shape = name, tensor.value.type, tensor.value.shape
        self.ir_graph.outputs.append(out)
        return Tensor(self, out)

    def parameter(
        self, name: str, value: np.ndarray | WeightSource, trainable: bool = True
    ) -> Tensor:
        """Add a parameter (an initializer) with its initial value or weight source."""
        if name in self.parameters:
            if self.parameters[name] is not value:
                raise ModelError(
                    f"graph {self.name!r} already has a different parameter {name!r}; give the"
                    " layer another name (name=...)"
                )
            return Tensor(self, self.ir_graph.initializers[name])
        shape, dtype = (
            (value.shape, value.dtype)
            if isinstance(value, WeightSource)
            else (np.shape(value), np.asarray(value).dtype)
        )
        element = ir.DataType.from_numpy(np.dtype(dtype))
        v = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(element))
        v.const_value = ir.LazyTensor(
            lambda: ir.tensor(self.weight(name), name=name), element, ir.Shape(list(shape))
        )
        self.ir_graph.initializers.add(v)
        self.parameters[name] = value
        if not trainable:
            self.frozen.add(name)
        return Tensor(self, v)

    def layer_name(self, layer: object, kind: str, name: str | None) -> str:
        """The name of ``layer`` in this graph (given, or ``<kind><n>`` in call order)."""
        key = id(layer)
        if key not in self._layer_names:
            if name is None:
                count = self._kind_counts.get(kind, 0)
                self._kind_counts[kind] = count + 1
                name = f"{kind}{count}"
            self._layer_names[key] = (layer, name)
        return self._layer_names[key][1]

    def wrap(self, value: ir.Value, like: Tensor | None = None) -> Tensor:
        """A handle to ``value``; its dtype defaults to that of ``like``."""
        if value.type is None and like is not None and like.value.type is not None:
            value.type = like.value.type
        return Tensor(self, value)

    def as_value(self, x: Any, like: Tensor | None = None) -> ir.Value:
        """``x`` (a Tensor of this graph, a number or an array) as a value of this graph."""
        if isinstance(x, Tensor):
            self._check_own(x, "operand")
            return x.value
        dtype = like.value.dtype if like is not None and like.value.dtype is not None else None
        return self.builder.const(np.asarray(x), dtype)

    def _check_own(self, tensor: Tensor, role: str) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"the {role} must be a traingraph Tensor; got {type(tensor).__name__}")
        if tensor.graph is not self:
            raise ModelError(
                f"tensor {tensor.name!r} belongs to graph {tensor.graph.name!r}, not"
                f" {self.name!r}; pass it between graphs as an output of one and an input of"
                " the other with the same name"
            )

    # ------------------------------------------------------------- output
    def to_onnx(self) -> onnx.ModelProto:
        """The graph as a standard ONNX model, with the parameter values embedded."""
        return to_proto(load_ir(self._model(load_weights=True)))

    def save(self, path: str | os.PathLike) -> None:
        """Save the graph as an ``.onnx`` file (large weights go to external data)."""
        save_model(self.to_onnx(), path)

    def _model(self, load_weights: bool) -> onnx.ModelProto:
        """The graph as a model proto.

        With ``load_weights`` the parameters are initializers holding their values; without,
        they are typed graph inputs, so no weight is read.
        """
        if not self.ir_graph.outputs:
            raise ModelError(f"graph {self.name!r} has no outputs; add one with g.output(name, t)")
        model = ir.Model(self.ir_graph, ir_version=max_ir_version())
        if load_weights:
            return to_proto(model)
        lifted = list(self.ir_graph.initializers.values())
        values = {v: v.const_value for v in lifted}
        for v in lifted:
            self.ir_graph.initializers.pop(v.name or "")
            v.const_value = None
            self.ir_graph.inputs.append(v)
        try:
            return to_proto(model)
        finally:
            for v, const in values.items():
                self.ir_graph.inputs.remove(v)
                v.const_value = const
                self.ir_graph.initializers.add(v)

    def weight(self, name: str) -> np.ndarray:
        """The value of parameter ``name`` (a weight source loads it, then purges it)."""
        value = self.parameters[name]
        if isinstance(value, WeightSource):
            with value:
                return np.array(value.data, copy=True)
        return np.asarray(value)


def compose(
    graphs: Sequence[Graph], load_weights: bool = False
) -> tuple[ir.Model, dict[str, Graph]]:
    """Connect ``graphs`` into one model, in order.

    An input of a later graph whose name is an output of an earlier graph reads that output.

    Returns:
        The composed model (shapes inferred; parameters as initializers with their values when
        ``load_weights``, else as graph inputs) and the graph that owns each parameter.
    """
    if not graphs:
        raise ModelError("expected at least one Graph; got an empty list")
    for g in graphs:
        if not isinstance(g, Graph):
            raise TypeError(f"expected traingraph Graph objects; got {type(g).__name__}")
    opsets = {g.opset for g in graphs}
    if len(opsets) > 1:
        raise ModelError(f"the graphs use different opsets {sorted(opsets)}; build them at one")
    names = [g.name for g in graphs]
    if len(set(names)) != len(names):
        raise ModelError(f"the graphs need distinct names to be composed; got {names}")
    owners: dict[str, Graph] = {}
    for g in graphs:
        for p in g.parameters:
            if p in owners:
                raise ModelError(
                    f"parameter {p!r} is defined in graphs {owners[p].name!r} and {g.name!r};"
                    " give one of the layers another name (name=...)"
                )
            owners[p] = g
    protos = [g._model(load_weights) for g in graphs]
    merged = protos[0]
    produced = {o.name for o in merged.graph.output}
    for proto in protos[1:]:
        merged.graph.input.extend(i for i in proto.graph.input if i.name not in produced)
        merged.graph.node.extend(proto.graph.node)
        merged.graph.initializer.extend(proto.graph.initializer)
        merged.graph.output.extend(proto.graph.output)
        produced.update(o.name for o in proto.graph.output)
    merged.graph.name = "_".join(names)
    return load_ir(merged, copy=False), owners
