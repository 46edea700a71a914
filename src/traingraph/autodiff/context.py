"""What a gradient rule sees: the node, its opset, a builder and helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import onnx_ir as ir

from traingraph.errors import GradientNotImplementedError
from traingraph.ir.builder import OpBuilder, static_shape
from traingraph.ir.fold import constant_value


@dataclass
class GradContext:
    """The context of one node's gradient rule.

    Attributes:
        b: Builder that appends the gradient nodes.
        node: The forward node.
        needs: For each node input, whether its gradient is wanted.
    """

    b: OpBuilder
    node: ir.Node
    needs: tuple[bool, ...]

    @property
    def opset(self) -> int:
        return self.b.opset

    @property
    def inputs(self) -> Sequence[ir.Value | None]:
        return self.node.inputs

    @property
    def outputs(self) -> Sequence[ir.Value]:
        return self.node.outputs

    def x(self, i: int) -> ir.Value:
        """Input ``i`` of the node (which must be present)."""
        value = self.node.inputs[i] if i < len(self.node.inputs) else None
        if value is None:
            self.unsupported(f"input {i} is missing")
        return value

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def need(self, i: int) -> bool:
        """Whether the gradient of input ``i`` is wanted."""
        return i < len(self.needs) and self.needs[i]

    def attr(self, name: str, default: Any = None) -> Any:
        """The value of attribute ``name`` (``default`` when absent)."""
        attr = self.node.attributes.get(name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return list(value)
        return value

    def const_input(self, i: int) -> Any:
        """The value of input ``i`` as numpy, or None when it is only known at run time.

        Constants, and small integer arithmetic on static shapes
        (:func:`traingraph.ir.fold.constant_value`), count as known.
        """
        if not self.has_input(i):
            return None
        return constant_value(self.node.inputs[i])

    def unsupported(self, reason: str) -> NoReturn:
        """Raise the error for an attribute value or input form this rule does not handle."""
        raise GradientNotImplementedError(
            self.node.op_type,
            self.node.name or "<unnamed>",
            self.opset,
            reason=reason,
            domain=self.node.domain,
        )

    def grad_or_zeros(self, grads: Sequence[ir.Value | None], i: int) -> ir.Value:
        """The gradient of output ``i``, or zeros of that output's shape when none flows in."""
        g = grads[i] if i < len(grads) else None
        return g if g is not None else self.b.zeros_like(self.node.outputs[i])

    def unbroadcast(
        self, grad: ir.Value, target: ir.Value, source: ir.Value | None = None
    ) -> ir.Value:
        """Sum ``grad`` (shaped like ``source``, default: the first output) to ``target``'s shape.

        Uses the static shapes where every dimension is known and a run-time reduction otherwise.
        """
        return unbroadcast(self.b, grad, target, source or self.node.outputs[0])


def unbroadcast(b: OpBuilder, grad: ir.Value, target: ir.Value, source: ir.Value) -> ir.Value:
    """Reduce ``grad`` (broadcast to ``source``'s shape) to the shape of ``target``."""
    t_shape, s_shape = target.shape, source.shape
    if t_shape is not None and s_shape is not None:
        axes: list[int] = []
        known = True
        lead = len(s_shape) - len(t_shape)
        if lead < 0:
            known = False
        else:
            axes.extend(range(lead))
            for i, dt in enumerate(t_shape.dims):
                ds = s_shape.dims[lead + i]
                if dt == ds and (isinstance(dt, int) or getattr(dt, "value", None) is not None):
                    continue
                if dt == 1:
                    if ds != 1:
                        axes.append(lead + i)
                    continue
                if isinstance(dt, int) and dt > 1:
                    continue
                known = False
                break
        if known:
            if not axes:
                return grad
            out = b.sum(grad, axes, keepdims=True)
            if lead:
                out = b.squeeze(out, list(range(lead)))
            return out
    # Run-time path: reduce every axis where the (left-padded) target dimension is 1.
    s_dims = b.shape(grad)
    t_dims = b.shape(target)
    pad_len = b.Sub(b.op("Size", s_dims), b.op("Size", t_dims))
    ones = b.op(
        "ConstantOfShape",
        b.unsqueeze(pad_len, [0]),
        value=ir.tensor([1], dtype=ir.DataType.INT64),
    )
    padded = b.Concat(ones, t_dims, axis=0)
    mask = b.Equal(padded, b.ints([1]))
    axes_value = b.Reshape(b.NonZero(mask), b.ints([-1]))
    reduced = b.op(
        "ReduceSum", grad, axes_value, keepdims=1, noop_with_empty_axes=1
    )
    shape = static_shape(target)
    return b.Reshape(reduced, b.ints(shape) if shape is not None else t_dims)
