"""Gradients of LSTM and GRU, by unrolling the recurrence over its static time steps.

The rule rebuilds the node's forward computation from primitive ops (``MatMul``, ``Add``,
``Mul``, ``Sigmoid``, ``Tanh``, ``Split``, ``Concat``, ...) in a scratch graph, one step per
time step and direction (:func:`unroll`), differentiates that graph with
:func:`traingraph.autodiff.engine.differentiate` (backpropagation through time), and moves the
rebuilt forward and its gradient into the model's graph. The original node keeps computing the
forward outputs; the rebuilt copy provides the activations the backward pass needs.

With ``x_t`` the input at step ``t``, ``h``/``c`` the previous hidden and cell states and ``W``,
``R``, ``Wb``, ``Rb``, ``P`` the weights, recurrences, biases and peepholes of one direction
(ONNX gate orders: LSTM ``i, o, f, c``, GRU ``z, r, h``):

    LSTM: i = sigmoid(x_t W_i^T + h R_i^T + P_i * c + Wb_i + Rb_i)
          f = sigmoid(x_t W_f^T + h R_f^T + P_f * c + Wb_f + Rb_f)
          c' = f * c + i * tanh(x_t W_c^T + h R_c^T + Wb_c + Rb_c)
          o = sigmoid(x_t W_o^T + h R_o^T + P_o * c' + Wb_o + Rb_o),   h' = o * tanh(c')
    GRU:  z = sigmoid(x_t W_z^T + h R_z^T + Wb_z + Rb_z),   r likewise
          n = tanh(x_t W_h^T + (r * h) R_h^T + Rb_h + Wb_h)          (linear_before_reset=0)
          n = tanh(x_t W_h^T + r * (h R_h^T + Rb_h) + Wb_h)          (linear_before_reset=1)
          h' = (1 - z) * n + z * h

Supported: directions forward / reverse / bidirectional, layouts 0 and 1, optional bias,
initial states and LSTM peepholes, ``sequence_lens`` absent or a constant equal to the sequence
length everywhere, and the default activations. Anything else raises an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.engine import differentiate
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import max_ir_version

Grads = Sequence[ir.Value | None]

_DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh")}
_GATES = {"LSTM": 4, "GRU": 3}
_DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
_SEQUENCE_LENS = 4


@dataclass(frozen=True)
class RecurrentSpec:
    """The form of one LSTM / GRU node.

    Attributes:
        op_type: ``"LSTM"`` or ``"GRU"``.
        hidden: The hidden size ``H``.
        reverses: For each direction, whether it runs from the last step to the first.
        steps: The static sequence length.
        layout: 0 for ``[seq, batch, ...]`` tensors, 1 for ``[batch, seq, ...]``.
        linear_before_reset: GRU's ``linear_before_reset``.
    """

    op_type: str
    hidden: int
    reverses: tuple[bool, ...]
    steps: int
    layout: int
    linear_before_reset: bool


def recurrent_spec(ctx: GradContext) -> RecurrentSpec:
    """Read and check the node's attributes and static sizes; unsupported forms raise."""
    op_type = ctx.node.op_type
    direction = ctx.attr("direction", "forward")
    if direction not in _DIRECTIONS:
        ctx.unsupported(f"direction={direction!r}; expected one of {sorted(_DIRECTIONS)}")
    reverses = _DIRECTIONS[direction]
    activations = ctx.attr("activations")
    default = _DEFAULT_ACTIVATIONS[op_type]
    if activations is not None and [a.lower() for a in activations] != list(default) * len(
        reverses
    ):
        ctx.unsupported(
            f"activations={activations}; only the default activations {list(default)} per"
            " direction are supported"
        )
    if ctx.attr("clip") is not None:
        ctx.unsupported(f"clip={ctx.attr('clip')}; cell clipping is not supported")
    if ctx.attr("input_forget", 0):
        ctx.unsupported("input_forget=1 (coupled input and forget gates) is not supported")
    layout = int(ctx.attr("layout", 0))
    x, r = ctx.x(0), ctx.x(2)
    hidden = ctx.attr("hidden_size")
    if hidden is None and r.shape is not None and isinstance(r.shape.dims[-1], int):
        hidden = r.shape.dims[-1]
    if hidden is None:
        ctx.unsupported("hidden_size is absent and R's last dimension is not static")
    steps = x.shape.dims[layout] if x.shape is not None and len(x.shape) == 3 else None
    if not isinstance(steps, int):
        ctx.unsupported(
            f"the sequence length of X (shape {x.shape}) is not static; the gradient unrolls"
            " the recurrence over a fixed number of steps, so export with a fixed sequence length"
        )
    if ctx.has_input(_SEQUENCE_LENS):
        lens = ctx.const_input(_SEQUENCE_LENS)
        if lens is None:
            ctx.unsupported(
                "sequence_lens is computed at run time; only a constant sequence_lens equal to"
                " the sequence length is supported (or leave it out)"
            )
        if np.any(lens != steps):
            ctx.unsupported(
                f"sequence_lens={lens.tolist()} differs from the sequence length {steps};"
                " padded sequences are not supported"
            )
    return RecurrentSpec(
        op_type, int(hidden), reverses, steps, layout, bool(ctx.attr("linear_before_reset", 0))
    )


def _per_direction(b: OpBuilder, v: ir.Value | None, count: int) -> list[ir.Value | None]:
    """Split a ``[D, ...]`` tensor into ``D`` tensors without the leading axis."""
    if v is None:
        return [None] * count
    pieces = (v,) if count == 1 else b.split(v, [1] * count, axis=0)
    return [b.squeeze(p, [0]) for p in pieces]


def _stack(b: OpBuilder, values: Sequence[ir.Value], axis: int) -> ir.Value:
    """Stack ``values`` along a new ``axis``."""
    expanded = [b.unsqueeze(v, [axis]) for v in values]
    return expanded[0] if len(expanded) == 1 else b.Concat(*expanded, axis=axis)


def _zeros_state(b: OpBuilder, x: ir.Value, hidden: int, dtype: ir.DataType) -> ir.Value:
    """Zeros ``[batch, hidden]`` of ``dtype``, ``x`` being ``[seq, batch, input]``."""
    shape = b.Concat(b.shape(x, 1, 2), b.ints([hidden]), axis=0)
    return b.op("ConstantOfShape", shape, value=ir.tensor(np.zeros(1, dtype.numpy())))


def _lstm_step(
    b: OpBuilder,
    projected: ir.Value,
    h: ir.Value,
    c: ir.Value,
    r_t: ir.Value,
    peepholes: Sequence[ir.Value] | None,
    hidden: int,
) -> tuple[ir.Value, ir.Value]:
    """One LSTM step; ``projected`` is ``x_t W^T + Wb + Rb``, ``r_t`` is ``R^T``."""
    gates = b.Add(projected, b.MatMul(h, r_t))
    i, o, f, candidate = b.split(gates, [hidden] * 4, axis=1)
    if peepholes is not None:
        p_i, p_o, p_f = peepholes
        i, f = b.Add(i, b.Mul(p_i, c)), b.Add(f, b.Mul(p_f, c))
    c_next = b.Add(b.Mul(b.Sigmoid(f), c), b.Mul(b.Sigmoid(i), b.Tanh(candidate)))
    if peepholes is not None:
        o = b.Add(o, b.Mul(p_o, c_next))
    return b.Mul(b.Sigmoid(o), b.Tanh(c_next)), c_next


def _gru_step(
    b: OpBuilder,
    projected: ir.Value,
    h: ir.Value,
    r_zr_t: ir.Value,
    r_h_t: ir.Value,
    rb_h: ir.Value | None,
    spec: RecurrentSpec,
) -> ir.Value:
    """One GRU step; ``projected`` holds ``x_t W^T + Wb`` plus the recurrence biases that add
    outside the reset gate, ``r_zr_t`` / ``r_h_t`` are the transposed recurrences."""
    hidden = spec.hidden
    x_zr, x_h = b.split(projected, [2 * hidden, hidden], axis=1)
    z, reset = b.split(b.Sigmoid(b.Add(x_zr, b.MatMul(h, r_zr_t))), [hidden, hidden], axis=1)
    if spec.linear_before_reset:
        recurrent = b.MatMul(h, r_h_t)
        if rb_h is not None:
            recurrent = b.Add(recurrent, rb_h)
        n = b.Tanh(b.Add(x_h, b.Mul(reset, recurrent)))
    else:
        n = b.Tanh(b.Add(x_h, b.MatMul(b.Mul(reset, h), r_h_t)))
    return b.Add(n, b.Mul(z, b.Sub(h, n)))


def _projection_bias(
    b: OpBuilder, bias: ir.Value | None, spec: RecurrentSpec, dtype: ir.DataType
) -> tuple[ir.Value | None, ir.Value | None]:
    """``(bias added to x_t W^T, GRU's Rb_h applied inside the reset gate or None)``."""
    if bias is None:
        return None, None
    size = _GATES[spec.op_type] * spec.hidden
    w_bias, r_bias = b.split(bias, [size, size], axis=0)
    if spec.op_type == "GRU" and spec.linear_before_reset:
        r_zr, r_h = b.split(r_bias, [size - spec.hidden, spec.hidden], axis=0)
        zeros = b.const(np.zeros(spec.hidden), dtype)
        return b.Add(w_bias, b.Concat(r_zr, zeros, axis=0)), r_h
    return b.Add(w_bias, r_bias), None


def unroll(
    ctx: GradContext,
    b: OpBuilder,
    inputs: Sequence[ir.Value | None],
    wanted: Sequence[bool],
) -> list[ir.Value | None]:
    """Rebuild the outputs of the LSTM / GRU node ``ctx.node`` from primitive ops.

    Args:
        ctx: The node's context (attributes, errors).
        b: The builder that receives the rebuilt nodes.
        inputs: The values standing for the node's inputs (None for absent ones).
        wanted: For each node output, whether to build it.

    Returns:
        The rebuilt outputs (``Y``, ``Y_h`` and, for LSTM, ``Y_c``), None where not wanted.
    """
    spec = recurrent_spec(ctx)
    lstm = spec.op_type == "LSTM"
    count = len(spec.reverses)

    def optional(i: int) -> ir.Value | None:
        return inputs[i] if i < len(inputs) else None

    x, h0, c0 = inputs[0], optional(5), optional(6) if lstm else None
    assert x is not None
    dtype = x.dtype
    if dtype is None:
        ctx.unsupported("the dtype of X is unknown; run shape inference first")
    if spec.layout:
        x = b.Transpose(x, perm=[1, 0, 2])
        h0, c0 = (None if s is None else b.Transpose(s, perm=[1, 0, 2]) for s in (h0, c0))
    columns = zip(
        _per_direction(b, inputs[1], count),
        _per_direction(b, inputs[2], count),
        _per_direction(b, optional(3), count),
        _per_direction(b, h0, count),
        _per_direction(b, c0, count),
        _per_direction(b, optional(7) if lstm else None, count),
        spec.reverses,
    )
    ys, last_h, last_c = [], [], []
    for w, r, bias, h, c, peephole, reverse in columns:
        assert w is not None and r is not None
        projected = b.MatMul(x, b.Transpose(w, perm=[1, 0]))
        x_bias, rb_h = _projection_bias(b, bias, spec, dtype)
        if x_bias is not None:
            projected = b.Add(projected, x_bias)
        steps = (projected,) if spec.steps == 1 else b.split(projected, [1] * spec.steps, axis=0)
        h = h if h is not None else _zeros_state(b, x, spec.hidden, dtype)
        if lstm:
            c = c if c is not None else _zeros_state(b, x, spec.hidden, dtype)
            peepholes = None if peephole is None else b.split(peephole, [spec.hidden] * 3, axis=0)
            r_t = b.Transpose(r, perm=[1, 0])
        else:
            r_zr, r_h = b.split(r, [2 * spec.hidden, spec.hidden], axis=0)
            r_zr_t, r_h_t = b.Transpose(r_zr, perm=[1, 0]), b.Transpose(r_h, perm=[1, 0])
        hs: dict[int, ir.Value] = {}
        order = range(spec.steps - 1, -1, -1) if reverse else range(spec.steps)
        for t in order:
            step = b.squeeze(steps[t], [0])
            if lstm:
                h, c = _lstm_step(b, step, h, c, r_t, peepholes, spec.hidden)
            else:
                h = _gru_step(b, step, h, r_zr_t, r_h_t, rb_h, spec)
            hs[t] = h
        ys.append([hs[t] for t in range(spec.steps)])
        last_h.append(h)
        last_c.append(c)
    outputs: list[ir.Value | None] = [None] * len(wanted)
    if wanted[0]:
        y = _stack(b, [_stack(b, hs, 0) for hs in ys], 1)
        outputs[0] = b.Transpose(y, perm=[2, 0, 1, 3]) if spec.layout else y
    for k, finals in ((1, last_h), (2, last_c)):
        if k < len(wanted) and wanted[k]:
            state = _stack(b, finals, 0)
            outputs[k] = b.Transpose(state, perm=[1, 0, 2]) if spec.layout else state
    return outputs


def _dim_names(values: Iterable[ir.Value]) -> set[str]:
    return {
        d.value
        for v in values
        if v.shape is not None
        for d in v.shape.dims
        if isinstance(d, ir.SymbolicDim) and d.value is not None
    }


def _infer_scratch_shapes(scratch: ir.Graph, inputs: Iterable[ir.Value]) -> None:
    """Infer the shapes of the unrolled ``scratch`` graph. The names that shape inference
    gives unknown dimensions (``unk__0``, ...) start again in each scratch graph, so those
    not already in the inputs' shapes are made anonymous: two recurrent nodes' unrolled
    graphs must not claim that their unknown dimensions are equal."""
    known = _dim_names(inputs)
    ShapeInferencePass()(ir.Model(scratch, ir_version=max_ir_version()))
    for node in scratch:
        for value in node.outputs:
            if value.shape is None or not (_dim_names([value]) - known):
                continue
            value.shape = ir.Shape(
                [
                    ir.SymbolicDim(None)
                    if isinstance(d, ir.SymbolicDim) and d.value not in known
                    else d
                    for d in value.shape.dims
                ]
            )


def _recurrent_gradient(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Backpropagation through time over the unrolled node (see the module docstring)."""
    recurrent_spec(ctx)
    real = {i: v for i, v in enumerate(ctx.inputs) if v is not None and i != _SEQUENCE_LENS}
    placeholders = {
        i: ir.Value(name=ctx.b.fresh_name(f"input{i}"), shape=v.shape, type=v.type)
        for i, v in real.items()
    }
    scratch = ir.Graph(
        list(placeholders.values()), [], nodes=[], opset_imports={"": ctx.opset}
    )
    rebuilt = OpBuilder(scratch, ctx.opset, prefix=ctx.b.fresh_name("unrolled"))
    stand_ins = [placeholders.get(i) for i in range(len(ctx.inputs))]
    outputs = unroll(ctx, rebuilt, stand_ins, [g is not None for g in grads])
    _infer_scratch_shapes(scratch, placeholders.values())
    targets = [(o, g) for o, g in zip(outputs, grads) if o is not None and g is not None]
    wrt = [p for i, p in placeholders.items() if ctx.need(i)]
    result = differentiate(
        scratch,
        ctx.opset,
        wrt,
        loss=None,
        user_gradients=[o for o, _ in targets],
        prefix=ctx.b.fresh_name("bptt"),
    )
    for o, g in targets:
        ir.convenience.replace_all_uses_with(result.user_grad_inputs[o.name or ""], g)
    for i, p in placeholders.items():
        ir.convenience.replace_all_uses_with(p, real[i])
    nodes = list(scratch)
    scratch.remove(nodes)
    ctx.b.graph.extend(nodes)
    return [
        result.grads[placeholders[i].name or ""] if i in placeholders and ctx.need(i) else None
        for i in range(len(ctx.inputs))
    ]


register_gradient("LSTM")(_recurrent_gradient)
register_gradient("GRU")(_recurrent_gradient)
