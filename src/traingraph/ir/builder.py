"""A tape-style op builder over onnx_ir graphs.

``OpBuilder`` appends default-domain nodes to an ``onnx_ir.Graph`` and hides the differences
between opsets (``axes`` as an attribute or as an input, ``Split``'s ``num_outputs``, ...), so
that gradient rules, losses and optimizers are written once for every opset from 13 on.

Example:
    >>> b = OpBuilder(graph, opset=17)
    >>> y = b.Mul(x, b.const(2.0, like=x))
    >>> s = b.reduce("ReduceSum", y, axes=[0], keepdims=False)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

FLOAT_TYPES = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.DOUBLE,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
    }
)

# Reductions whose ``axes`` moved from attribute to input at opset 18 (ReduceSum moved at 13).
_AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceSumSquare": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceLogSum": 18,
    "ReduceLogSumExp": 18,
}

Axes = Sequence[int] | ir.Value | None


def is_float(value: ir.Value | None) -> bool:
    """Whether ``value`` holds a floating-point tensor (and so can carry a gradient)."""
    return value is not None and value.dtype in FLOAT_TYPES


def static_shape(value: ir.Value) -> tuple[int, ...] | None:
    """The shape of ``value`` as ints, or None when any dimension (or the rank) is unknown."""
    if value.shape is None:
        return None
    dims = tuple(value.shape.dims)
    if all(isinstance(d, int) for d in dims):
        return dims  # type: ignore[return-value]
    return None


def value_spec(value: ir.Value) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of a value whose shape is static and dtype known (a parameter)."""
    shape = static_shape(value)
    if shape is None or value.dtype is None:
        raise ValueError(
            f"tensor {value.name!r} needs a static shape and a known dtype; it has shape"
            f" {value.shape} and dtype {value.dtype}"
        )
    return shape, np.dtype(value.dtype.numpy())


def rank(value: ir.Value) -> int | None:
    """The rank of ``value`` when known."""
    return None if value.shape is None else len(value.shape)


def _to_attr(name: str, value: Any) -> ir.Attr:
    if isinstance(value, ir.Attr):
        return value
    return ir.convenience.convert_attribute(name, value)


class OpBuilder:
    """Appends nodes to ``graph`` at ``opset``; ``b.Relu(x)`` is ``b.op("Relu", x)``.

    Args:
        graph: The graph that receives the nodes.
        opset: The default-domain opset the nodes are written for.
        prefix: Prefix of the generated node and value names.
        names: Names already taken in the graph; generated names avoid them.
    """

    def __init__(
        self,
        graph: ir.Graph,
        opset: int,
        prefix: str = "tg",
        names: set[str] | None = None,
    ) -> None:
        self.graph = graph
        self.opset = opset
        self.prefix = prefix
        self._counter = itertools.count()
        self._names = names if names is not None else _taken_names(graph)
        self.scope = ""

    # ------------------------------------------------------------------ naming
    def fresh_name(self, hint: str) -> str:
        """A value or node name not yet used in the graph."""
        base = f"{self.prefix}/{self.scope}{hint}" if self.scope else f"{self.prefix}/{hint}"
        name = base
        while name in self._names:
            name = f"{base}_{next(self._counter)}"
        self._names.add(name)
        return name

    # --------------------------------------------------------------- emission
    def op(
        self,
        op_type: str,
        *inputs: ir.Value | None,
        num_outputs: int = 1,
        name: str | None = None,
        **attributes: Any,
    ) -> Any:
        """Append one default-domain node and return its output (or tuple of outputs)."""
        attrs = [_to_attr(k, v) for k, v in attributes.items() if v is not None]
        node_name = self.fresh_name(name or op_type)
        outputs = [
            ir.Value(name=self.fresh_name(f"{name or op_type}_out{i}")) for i in range(num_outputs)
        ]
        node = ir.Node(
            "",
            op_type,
            list(inputs),
            attrs,
            outputs=outputs,
            name=node_name,
        )
        self.graph.append(node)
        return outputs[0] if num_outputs == 1 else tuple(outputs)

    def __getattr__(self, op_type: str) -> Any:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def emit(*inputs: ir.Value | None, **attributes: Any) -> Any:
            return self.op(op_type, *inputs, **attributes)

        return emit

    # -------------------------------------------------------------- constants
    def const(
        self,
        value: Any,
        dtype: ir.DataType | None = None,
        *,
        like: ir.Value | None = None,
        name: str | None = None,
    ) -> ir.Value:
        """A ``Constant`` node holding ``value``.

        The dtype is ``dtype``, else that of ``like``, else the numpy dtype of ``value``.
        """
        if dtype is None and like is not None:
            dtype = like.dtype
        array = np.asarray(value)
        if dtype is not None:
            array = array.astype(dtype.numpy())
        tensor = ir.tensor(array)
        out = self.op("Constant", name=name or "const", value=tensor)
        out.dtype = ir.DataType.from_numpy(array.dtype) if dtype is None else dtype
        out.shape = ir.Shape(array.shape)
        out.const_value = tensor
        return out

    def ints(self, values: Sequence[int], name: str | None = None) -> ir.Value:
        """A 1-D int64 constant."""
        return self.const(np.asarray(list(values), dtype=np.int64), name=name or "ints")

    def scalar(self, value: float, like: ir.Value) -> ir.Value:
        """A scalar constant of ``like``'s dtype (``CastLike`` to ``like`` when it is unknown)."""
        if like.dtype is None:
            return self.op("CastLike", self.const(value, ir.DataType.FLOAT, name="scalar"), like)
        return self.const(value, like=like, name="scalar")

    # ------------------------------------------------------ opset-aware forms
    def _axes(self, axes: Axes) -> ir.Value | None:
        if axes is None or isinstance(axes, ir.Value):
            return axes
        return self.ints(axes, name="axes")

    def reduce(
        self,
        op_type: str,
        x: ir.Value,
        axes: Axes = None,
        keepdims: bool = True,
        noop_with_empty_axes: bool = False,
    ) -> ir.Value:
        """A ``Reduce*`` node; ``axes`` None reduces all axes."""
        extra: dict[str, Any] = {"noop_with_empty_axes": 1} if noop_with_empty_axes else {}
        if self.opset >= _AXES_INPUT_SINCE[op_type]:
            if axes is None:
                return self.op(op_type, x, keepdims=int(keepdims), **extra)
            return self.op(op_type, x, self._axes(axes), keepdims=int(keepdims), **extra)
        if isinstance(axes, ir.Value):
            raise TypeError(f"{op_type} at opset {self.opset} takes static axes only")
        return self.op(
            op_type,
            x,
            keepdims=int(keepdims),
            axes=None if axes is None else list(axes),
        )

    def sum(self, x: ir.Value, axes: Axes = None, keepdims: bool = True) -> ir.Value:
        """``ReduceSum`` over ``axes`` (all when None)."""
        return self.reduce("ReduceSum", x, axes, keepdims)

    def mean(self, x: ir.Value, axes: Axes = None, keepdims: bool = True) -> ir.Value:
        """``ReduceMean`` over ``axes`` (all when None)."""
        return self.reduce("ReduceMean", x, axes, keepdims)

    def squeeze(self, x: ir.Value, axes: Axes) -> ir.Value:
        return self.op("Squeeze", x, self._axes(axes))

    def unsqueeze(self, x: ir.Value, axes: Axes) -> ir.Value:
        return self.op("Unsqueeze", x, self._axes(axes))

    def split(
        self, x: ir.Value, sizes: Sequence[int] | ir.Value, axis: int = 0
    ) -> tuple[ir.Value, ...]:
        """``Split`` into pieces of ``sizes`` along ``axis`` (always returns a tuple)."""
        if isinstance(sizes, ir.Value):
            raise TypeError("split needs a static list of sizes; pass a Python sequence")
        outs = self.op("Split", x, self.ints(sizes), axis=axis, num_outputs=len(sizes))
        return outs if isinstance(outs, tuple) else (outs,)

    def shape(self, x: ir.Value, start: int | None = None, end: int | None = None) -> ir.Value:
        """``Shape`` of ``x`` (opset 15+ slicing attributes are emulated below 15)."""
        if start is None and end is None:
            return self.op("Shape", x)
        if self.opset >= 15:
            return self.op("Shape", x, start=start, end=end)
        full = self.op("Shape", x)
        return self.slice(
            full, [0 if start is None else start], [end if end is not None else 2**62], [0]
        )

    def slice(
        self,
        x: ir.Value,
        starts: Sequence[int] | ir.Value,
        ends: Sequence[int] | ir.Value,
        axes: Sequence[int] | ir.Value | None = None,
        steps: Sequence[int] | ir.Value | None = None,
    ) -> ir.Value:
        def as_value(v: Sequence[int] | ir.Value | None) -> ir.Value | None:
            if v is None or isinstance(v, ir.Value):
                return v
            return self.ints(v)

        inputs = [as_value(starts), as_value(ends), as_value(axes), as_value(steps)]
        while inputs and inputs[-1] is None:
            inputs.pop()
        return self.op("Slice", x, *inputs)

    def cast(self, x: ir.Value, dtype: ir.DataType) -> ir.Value:
        out = self.op("Cast", x, to=dtype)
        out.dtype = dtype
        return out

    def cast_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """Cast ``x`` to ``like``'s dtype (``CastLike`` when the dtype is unknown)."""
        if like.dtype is not None:
            if x.dtype == like.dtype:
                return x
            return self.cast(x, like.dtype)
        return self.op("CastLike", x, like)

    def zeros_like(self, x: ir.Value) -> ir.Value:
        """Zeros of ``x``'s shape and dtype."""
        return self._fill_like(x, 0.0)

    def ones_like(self, x: ir.Value) -> ir.Value:
        """Ones of ``x``'s shape and dtype."""
        return self._fill_like(x, 1.0)

    def _fill_like(self, x: ir.Value, value: float) -> ir.Value:
        dims = static_shape(x)
        shape = self.ints(dims) if dims is not None else self.shape(x)
        if x.dtype is None:
            filled = self.op(
                "ConstantOfShape", shape, value=ir.tensor(np.full((1,), value, np.float32))
            )
            return self.op("CastLike", filled, x)
        out = self.op(
            "ConstantOfShape", shape, value=ir.tensor(np.full((1,), value, x.dtype.numpy()))
        )
        out.dtype = x.dtype
        return out

    def reshape_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        """Reshape ``x`` to the (run-time) shape of ``like``."""
        target = static_shape(like)
        if target is not None and static_shape(x) == target:
            return x
        shape = self.ints(target) if target is not None else self.shape(like)
        if self.opset >= 14:
            return self.op("Reshape", x, shape, allowzero=1)
        return self.op("Reshape", x, shape)


def _taken_names(graph: ir.Graph) -> set[str]:
    names: set[str] = set()
    for v in graph.inputs:
        if v.name:
            names.add(v.name)
    for name in graph.initializers:
        names.add(name)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.name:
            names.add(node.name)
        for out in node.outputs:
            if out.name:
                names.add(out.name)
    return names
