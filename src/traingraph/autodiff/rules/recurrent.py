"""Gradients of LSTM and GRU over the static time steps of the recurrence.

An LSTM without peepholes is replaced in the training graph by its forward written step by
step (:func:`_lstm_gradient`): one ``Gemm`` over all steps for ``X W^T + Wb + Rb``, then per
step one ``Gemm`` for ``+ H_prev R^T``, the gates and the cell state, and the slopes that the
backward recurrence reads, made while the step's gates are at hand; the gradient reads them
instead of recomputing the gates. With gate order ``i, o, f, c`` (``g`` the candidate ``c``)
and ``t + 1`` the step after ``t`` in the direction's order:

    c_t = f_t c_{t-1} + i_t g_t,   h_t = o_t tanh c_t
    dh_t = dY_t + dG_{t+1} R,   dc_t = dh_t o_t (1 - tanh^2 c_t) + dc_{t+1} f_{t+1}
    dG_t = [dc_t, dh_t, dc_t, dc_t] * [i_t g_t (1 - i_t), h_t (1 - o_t),
                                       f_t c_{t-1} (1 - f_t), i_t (1 - g_t^2)]

A GRU whose output ``Y`` is present keeps its node; its gradient runs over all steps at once
(:func:`_gru_gradient`): the previous hidden states are ``Y`` shifted by a step, so the gates
of every step come from a few ``Gemm`` over all steps; only the backward recurrence runs step
by step, as :func:`_gru_direction_gradient` says. Either way the weight, bias and input
gradients are one ``Gemm`` or ``MatMul`` over all steps: ``dW = dG^T X``,
``dR = dG^T H_prev``, ``dB = sum dG``, ``dX = dG W``.

Otherwise (an LSTM with peepholes, a GRU without ``Y``) the rule rebuilds the node's forward
computation from primitive ops (``MatMul``, ``Add``, ``Mul``, ``Sigmoid``, ``Tanh``, ``Split``,
``Concat``, ...) in a scratch graph, one step per time step and direction (:func:`unroll`),
differentiates that graph with :func:`traingraph.autodiff.engine.differentiate`
(backpropagation through time), and moves the rebuilt forward and its gradient into the model's
graph; the original node keeps computing the forward outputs, and the gradient recomputes the
activations it needs.

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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

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
    scratch = ir.Graph(list(placeholders.values()), [], nodes=[], opset_imports={"": ctx.opset})
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


def _time_major(b: OpBuilder, v: ir.Value | None, layout: int, perm: list[int]) -> ir.Value | None:
    """``v`` in layout 0 (``perm`` takes a layout-1 tensor there); None stays None."""
    return b.Transpose(v, perm=perm) if v is not None and layout else v


def _steps(b: OpBuilder, rows: ir.Value, steps: int) -> tuple[ir.Value, ...]:
    """Split time-major rows ``[steps * batch, n]`` into ``steps`` pieces ``[batch, n]``."""
    if steps == 1:
        return (rows,)
    if b.opset >= 18:
        count = ir.AttrInt64("num_outputs", steps)
        return tuple(b.op("Split", rows, axis=0, num_outputs=steps, count=count))
    return tuple(b.op("Split", rows, axis=0, num_outputs=steps))


@dataclass(frozen=True)
class _Direction:
    """The inputs of one GRU direction, time-major: ``x`` ``[T, N, I]``, ``w`` ``[3H, I]``,
    ``r`` ``[3H, H]``, ``bias`` ``[6H]``, the initial state ``h0`` ``[N, H]``, ``y`` the
    hidden states ``[T, D, N, H]`` the node computed (this direction at ``index``), ``dy`` the
    gradients of this direction's hidden states by step (``[N, H]`` each) and ``dy_h`` that of
    the final state; ``needs`` says for each node input whether its gradient is wanted;
    ``dtype`` is the node's float type and ``input_size`` ``I`` where it is static."""

    x: ir.Value
    w: ir.Value
    r: ir.Value
    bias: ir.Value | None
    h0: ir.Value
    y: ir.Value
    index: int
    dy: Sequence[ir.Value] | None
    dy_h: ir.Value | None
    reverse: bool
    needs: Sequence[bool]
    dtype: ir.DataType
    input_size: int | None

    def order(self, steps: int) -> list[int]:
        """The time steps in the order the direction runs them."""
        return list(range(steps - 1, -1, -1)) if self.reverse else list(range(steps))

    def previous_hidden(self, b: OpBuilder, steps: int) -> ir.Value:
        """The hidden state before each step, time-major rows ``[T*N, H]``: ``Y`` shifted by
        a step, the initial state first."""
        if steps == 1:
            return self.h0
        h0, k = b.unsqueeze(self.h0, [0, 1]), self.index
        before = [h0, b.slice(self.y, [0, k], [steps - 1, k + 1], [0, 1])]
        if self.reverse:
            before = [b.slice(self.y, [1, k], [steps, k + 1], [0, 1]), h0]
        return b.Flatten(b.Concat(*before, axis=0), axis=3)

    def hidden_gradient(self, b: OpBuilder, t: int, back: ir.Value | None) -> ir.Value:
        """``dh_t``: the gradient of ``Y_t`` plus ``back``, what flows back from the step after
        ``t`` (None for the last step, which takes ``Y_h``'s gradient)."""
        dh = self.dy_h if back is None else back
        if self.dy is not None:
            dh = self.dy[t] if dh is None else b.Add(self.dy[t], dh)
        return dh if dh is not None else b.zeros_like(self.h0)

    def wanted(self, gradients: dict[int, Callable[[], ir.Value]]) -> dict[int, ir.Value]:
        """The gradients of the wanted node inputs, built from their makers."""
        return {i: make() for i, make in gradients.items() if i < len(self.needs) and self.needs[i]}


def _time_rows(b: OpBuilder, pieces: dict[int, ir.Value], steps: int) -> ir.Value:
    """``[N, X]`` pieces by time step as time-major rows ``[T*N, X]``."""
    return b.Concat(*(pieces[t] for t in range(steps)), axis=0) if steps > 1 else pieces[0]


def _gru_direction_gradient(
    b: OpBuilder, d: _Direction, spec: RecurrentSpec
) -> dict[int, ir.Value]:
    """The gradients of one GRU direction by node input where wanted: X (as ``[T*N, I]``),
    W, R, B and initial_h.

    With the previous hidden states read from ``Y``, every gate of every step is a ``Gemm``
    over all steps (a GRU has no cell state); only the backward recurrence runs step by step::

        dn_t = dh_t (1 - z_t) (1 - n_t^2),   dz_t = dh_t (h_{t-1} - n_t) z_t (1 - z_t)
        linear_before_reset=1 (u_t = h_{t-1} R_h^T + Rb_h):
            dr_t = dn_t u_t r_t (1 - r_t),   dh_{t-1} = dh_t z_t + [dz_t, dr_t, dn_t r_t] R
        linear_before_reset=0 (e_t = dn_t R_h):
            dr_t = e_t h_{t-1} r_t (1 - r_t),   dh_{t-1} = dh_t z_t + e_t r_t + [dz_t, dr_t] R_zr
    """
    steps, hidden = spec.steps, spec.hidden
    order = d.order(steps)
    x2, h_prev = b.Flatten(d.x, axis=2), d.previous_hidden(b, steps)
    x_bias, rb_h = _projection_bias(b, d.bias, spec, d.dtype)
    projected = b.Gemm(x2, d.w, *([] if x_bias is None else [x_bias]), transB=1)
    p_zr, p_h = b.split(projected, [2 * hidden, hidden], axis=1)
    r_zr, r_h = b.split(d.r, [2 * hidden, hidden], axis=0)
    z, r = b.split(b.Sigmoid(b.Gemm(h_prev, r_zr, p_zr, transB=1)), [hidden, hidden], axis=1)
    one = b.scalar(1.0, like=d.x)
    if spec.linear_before_reset:
        u = b.Gemm(h_prev, r_h, *([] if rb_h is None else [rb_h]), transB=1)
        n = b.Tanh(b.Add(p_h, b.Mul(r, u)))
    else:
        rh = b.Mul(r, h_prev)
        n = b.Tanh(b.Gemm(rh, r_h, p_h, transB=1))
    to_n = b.Mul(b.Sub(one, z), b.Sub(one, b.Mul(n, n)))  # dn_t = dh_t * to_n
    to_z = b.Mul(b.Sub(h_prev, n), b.Mul(z, b.Sub(one, z)))  # dz_t = dh_t * to_z
    r_slope = b.Mul(r, b.Sub(one, r))
    z_t = _steps(b, z, steps)
    dh_t: dict[int, ir.Value] = {}
    dgates: dict[int, ir.Value] = {}  # the rows that multiply R (R_zr without linear_before_reset)
    if spec.linear_before_reset:
        # dgates_t = [dz_t, dr_t, dn_t r_t] = [dh_t, dh_t, dh_t] * slopes
        slopes = b.Concat(to_z, b.Mul(to_n, b.Mul(u, r_slope)), b.Mul(to_n, r), axis=1)
        slope_t = _steps(b, slopes, steps)
        after = None
        for t in reversed(order):
            back = None
            if after is not None:
                back = b.Gemm(dgates[after], d.r, b.Mul(dh_t[after], z_t[after]))
            dh = dh_t[t] = d.hidden_gradient(b, t, back)
            dgates[t] = b.Mul(b.Concat(dh, dh, dh, axis=1), slope_t[t])
            after = t
        assert after is not None
        first = after  # the step the direction runs first
        dh_all = _time_rows(b, dh_t, steps)
        d_r_rows = _time_rows(b, dgates, steps)  # [dz, dr, dn r]
        d_zr = b.slice(d_r_rows, [0], [2 * hidden], [1])
        d_n = b.Mul(dh_all, to_n)
        d_x_rows = b.Concat(d_zr, d_n, axis=1)  # [dz, dr, dn]

        def recurrence_gradient() -> ir.Value:
            return b.Gemm(d_r_rows, h_prev, transA=1)

        def bias_gradient() -> ir.Value:
            return b.Concat(
                b.sum(d_x_rows, [0], keepdims=False), b.sum(d_r_rows, [0], keepdims=False), axis=0
            )

        def initial_gradient() -> ir.Value:
            return b.Gemm(dgates[first], d.r, b.Mul(dh_t[first], z_t[first]))

    else:
        to_n_t, to_z_t = _steps(b, to_n, steps), _steps(b, to_z, steps)
        r_t, to_r_t = _steps(b, r, steps), _steps(b, b.Mul(h_prev, r_slope), steps)
        d_n_t: dict[int, ir.Value] = {}
        reset: dict[int, ir.Value] = {}  # e_t = dn_t R_h
        after = None
        for t in reversed(order):
            back = None
            if after is not None:
                direct = b.Add(b.Mul(dh_t[after], z_t[after]), b.Mul(reset[after], r_t[after]))
                back = b.Gemm(dgates[after], r_zr, direct)
            dh = dh_t[t] = d.hidden_gradient(b, t, back)
            d_n_t[t] = b.Mul(dh, to_n_t[t])
            reset[t] = b.MatMul(d_n_t[t], r_h)
            dgates[t] = b.Concat(b.Mul(dh, to_z_t[t]), b.Mul(reset[t], to_r_t[t]), axis=1)
            after = t
        assert after is not None
        first = after
        d_zr = _time_rows(b, dgates, steps)
        d_n = _time_rows(b, d_n_t, steps)
        d_x_rows = b.Concat(d_zr, d_n, axis=1)

        def recurrence_gradient() -> ir.Value:
            return b.Concat(b.Gemm(d_zr, h_prev, transA=1), b.Gemm(d_n, rh, transA=1), axis=0)

        def bias_gradient() -> ir.Value:
            db = b.sum(d_x_rows, [0], keepdims=False)
            return b.Concat(db, db, axis=0)

        def initial_gradient() -> ir.Value:
            direct = b.Add(b.Mul(dh_t[first], z_t[first]), b.Mul(reset[first], r_t[first]))
            return b.Gemm(dgates[first], r_zr, direct)

    return d.wanted(
        {
            0: lambda: b.MatMul(d_x_rows, d.w),
            1: lambda: b.Gemm(d_x_rows, x2, transA=1),
            2: recurrence_gradient,
            3: bias_gradient,
            5: initial_gradient,
        }
    )


@dataclass
class _LstmSteps:
    """One LSTM direction's forward by time step, with what its backward reads: the hidden
    states ``h``, the forget gates ``f``, the gate slopes ``slope`` (``[N, 4H]``: what
    ``[dc_t, dh_t, dc_t, dc_t]`` is multiplied by to give the gates' gradient) and
    ``through`` (``o_t (1 - tanh^2 c_t)``: what ``dh_t`` is multiplied by in ``dc_t``),
    ``order`` the steps in the order the direction runs them, ``h0`` the initial hidden state
    and ``c`` the final cell state."""

    order: list[int]
    h0: ir.Value
    c: ir.Value
    h: dict[int, ir.Value] = field(default_factory=dict)
    f: dict[int, ir.Value] = field(default_factory=dict)
    slope: dict[int, ir.Value] = field(default_factory=dict)
    through: dict[int, ir.Value] = field(default_factory=dict)


def _lstm_forward(
    b: OpBuilder,
    projected: Sequence[ir.Value],
    h0: ir.Value,
    c0: ir.Value,
    r: ir.Value,
    order: list[int],
    hidden: int,
    dtype: ir.DataType,
) -> _LstmSteps:
    """One direction's forward, step by step from ``projected`` (``x_t W^T + Wb + Rb`` by
    step): one ``Gemm`` per step for the gates, and the slopes its gradient reads, made while
    the step's gates are at hand (the module docstring's formulas with ``i_t g_t``, ``h_t``
    and ``f_t c_{t-1}`` reused: ``[i_t g_t, h_t, f_t c_{t-1}] (1 - [i, o, f])``,
    ``i_t - i_t g_t g_t`` and ``o_t - h_t tanh c_t``)."""
    one = b.const(1.0, dtype)
    steps = _LstmSteps(order, h0, c0)
    h, c = h0, c0
    for t in order:
        pre_iof, pre_g = b.split(b.Gemm(h, r, projected[t], transB=1), [3 * hidden, hidden], 1)
        iof, g = b.Sigmoid(pre_iof), b.Tanh(pre_g)
        i, o, f = b.split(iof, [hidden] * 3, axis=1)
        fc, ig = b.Mul(f, c), b.Mul(i, g)
        c = b.Add(fc, ig)
        tanh_c = b.Tanh(c)
        h = b.Mul(o, tanh_c)
        slope_iof = b.Mul(b.Concat(ig, h, fc, axis=1), b.Sub(one, iof))
        steps.slope[t] = b.Concat(slope_iof, b.Sub(i, b.Mul(ig, g)), axis=1)
        steps.through[t] = b.Sub(o, b.Mul(h, tanh_c))
        steps.h[t], steps.f[t] = h, f
    steps.c = c
    return steps


def _lstm_backward(
    b: OpBuilder,
    steps: _LstmSteps,
    r: ir.Value,
    dy: Sequence[ir.Value] | None,
    dy_h: ir.Value | None,
    dy_c: ir.Value | None,
) -> tuple[dict[int, ir.Value], ir.Value]:
    """The gates' gradients by step, from the last step the direction runs to the first, and
    the first step's ``dc`` (six nodes a step: ``dh_t = dY_t + dG_{t+1} R`` in one ``Gemm``,
    ``dc_t``, then ``dG_t``)."""
    dgates: dict[int, ir.Value] = {}
    dc: ir.Value | None = None
    after: int | None = None
    for t in reversed(steps.order):
        if after is None or dc is None:
            parts = [v for v in (None if dy is None else dy[t], dy_h) if v is not None]
            dh = b.Add(*parts) if len(parts) == 2 else parts[0] if parts else None
            dh = b.zeros_like(steps.h[t]) if dh is None else dh
            c_back = dy_c
        else:
            back = dgates[after]
            dh = b.MatMul(back, r) if dy is None else b.Gemm(back, r, dy[t])
            c_back = b.Mul(dc, steps.f[after])
        from_h = b.Mul(dh, steps.through[t])
        dc = from_h if c_back is None else b.Add(from_h, c_back)
        dgates[t] = b.Mul(b.Concat(dc, dh, dc, dc, axis=1), steps.slope[t])
        after = t
    assert dc is not None
    return dgates, dc


def _replace_outputs(ctx: GradContext, scratch: ir.Graph, new: Sequence[ir.Value | None]) -> None:
    """Put the nodes of ``scratch`` in the place of the node ``ctx.node``, its outputs
    replaced by ``new`` (None for outputs that are absent or unused)."""
    graph = ctx.node.graph
    assert graph is not None
    pairs = [(old, v) for old, v in zip(ctx.outputs, new) if v is not None]
    nodes = list(scratch)
    scratch.remove(nodes)
    ir.convenience.replace_nodes_and_values(
        graph, ctx.node, [ctx.node], nodes, [old for old, _ in pairs], [v for _, v in pairs]
    )


def _in_use(value: ir.Value) -> bool:
    return bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def _lstm_gradient(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """The LSTM's gradient, with the node replaced by its forward step by step (see the module
    docstring); peepholes take :func:`_recurrent_gradient`."""
    spec = recurrent_spec(ctx)
    dtype = ctx.x(0).dtype
    if ctx.has_input(7) or ctx.node.graph is None or dtype is None:
        return _recurrent_gradient(ctx, grads)
    b, layout, count = ctx.b, spec.layout, len(spec.reverses)
    steps, hidden = spec.steps, spec.hidden
    scratch = ir.Graph([], [], nodes=[], opset_imports={"": ctx.opset})
    fb = OpBuilder(scratch, ctx.opset, prefix=b.fresh_name("forward"))

    def optional(i: int) -> ir.Value | None:
        return ctx.inputs[i] if ctx.has_input(i) else None

    def grad(k: int) -> ir.Value | None:
        return grads[k] if k < len(grads) else None

    x = _time_major(fb, ctx.x(0), layout, [1, 0, 2])
    assert x is not None
    x2 = fb.Flatten(x, axis=2)
    h0s, c0s = (
        _per_direction(fb, _time_major(fb, optional(i), layout, [1, 0, 2]), count) for i in (5, 6)
    )
    zeros = None
    if any(s is None for s in (*h0s, *c0s)):
        zeros = _zeros_state(fb, x, hidden, dtype)
    ws, rs = _per_direction(fb, ctx.x(1), count), _per_direction(fb, ctx.x(2), count)
    biases = _per_direction(fb, optional(3), count)
    directions = []
    for k, reverse in enumerate(spec.reverses):
        w, r, bias = ws[k], rs[k], biases[k]
        assert w is not None and r is not None
        if bias is not None:
            bias = fb.Add(*fb.split(bias, [4 * hidden] * 2, axis=0))
        projected = fb.Gemm(x2, w, *([] if bias is None else [bias]), transB=1)
        h0, c0 = h0s[k] or zeros, c0s[k] or zeros
        assert h0 is not None and c0 is not None
        order = list(range(steps - 1, -1, -1) if reverse else range(steps))
        directions.append(
            _lstm_forward(fb, _steps(fb, projected, steps), h0, c0, r, order, hidden, dtype)
        )
    new: list[ir.Value | None] = [None] * len(ctx.outputs)
    if _in_use(ctx.outputs[0]):
        pieces = [d.h[t] for t in range(steps) for d in directions]  # [T, D, N, H] in order
        rows = fb.Concat(*pieces, axis=0) if len(pieces) > 1 else pieces[0]
        y = fb.Reshape(rows, fb.ints([steps, count, -1, hidden]))
        new[0] = fb.Transpose(y, perm=[2, 0, 1, 3]) if layout else y
    for k, finals in ((1, [d.h[d.order[-1]] for d in directions]), (2, [d.c for d in directions])):
        if k < len(ctx.outputs) and _in_use(ctx.outputs[k]):
            state = _stack(fb, finals, 0)
            new[k] = fb.Transpose(state, perm=[1, 0, 2]) if layout else state
    _replace_outputs(ctx, scratch, new)

    dy = _time_major(b, grad(0), layout, [1, 2, 0, 3])
    dy_steps = None if dy is None else _steps(b, b.Flatten(dy, axis=3), steps * count)
    dy_h, dy_c = (
        _per_direction(b, _time_major(b, grad(k), layout, [1, 0, 2]), count) for k in (1, 2)
    )
    out: list[ir.Value | None] = [None] * len(ctx.inputs)
    by_input: dict[int, list[ir.Value]] = {i: [] for i in (0, 1, 2, 3, 5, 6)}
    for k, d in enumerate(directions):
        w, r = ws[k], rs[k]
        assert w is not None and r is not None
        dgates, dc = _lstm_backward(
            b, d, r, None if dy_steps is None else dy_steps[k::count], dy_h[k], dy_c[k]
        )
        dg = _time_rows(b, dgates, steps)
        first = d.order[0]
        if ctx.need(0):
            by_input[0].append(b.MatMul(dg, w))
        if ctx.need(1):
            by_input[1].append(b.Gemm(dg, x2, transA=1))
        if ctx.need(2):
            before = dict(zip(d.order, [d.h0] + [d.h[t] for t in d.order[:-1]]))
            by_input[2].append(b.Gemm(dg, _time_rows(b, before, steps), transA=1))
        if ctx.need(3):
            db = b.sum(dg, [0], keepdims=False)
            by_input[3].append(b.Concat(db, db, axis=0))
        if ctx.need(5):
            by_input[5].append(b.MatMul(dgates[first], r))
        if ctx.need(6):
            by_input[6].append(b.Mul(dc, d.f[first]))
    if ctx.need(0):
        dx_rows = by_input[0][0]
        for other in by_input[0][1:]:
            dx_rows = b.Add(dx_rows, other)
        dx = b.reshape_like(dx_rows, x)
        out[0] = b.Transpose(dx, perm=[1, 0, 2]) if layout else dx
    for i in (1, 2, 3):
        if ctx.need(i):
            out[i] = _stack(b, by_input[i], 0)
    for i in (5, 6):
        if ctx.need(i):
            state = _stack(b, by_input[i], 0)
            out[i] = b.Transpose(state, perm=[1, 0, 2]) if layout else state
    return out


def _gru_gradient(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """The GRU's gradient over all steps at once where the node's ``Y`` is there to read the
    hidden states from; else :func:`_recurrent_gradient`."""
    spec = recurrent_spec(ctx)
    outputs = ctx.outputs
    if not outputs or not outputs[0].name:
        return _recurrent_gradient(ctx, grads)
    dtype = outputs[0].dtype
    if dtype is None:
        return _recurrent_gradient(ctx, grads)
    b, layout, count = ctx.b, spec.layout, len(spec.reverses)

    def optional(i: int) -> ir.Value | None:
        return ctx.inputs[i] if ctx.has_input(i) else None

    def grad(k: int) -> ir.Value | None:
        return grads[k] if k < len(grads) else None

    x = _time_major(b, ctx.x(0), layout, [1, 0, 2])
    y = _time_major(b, outputs[0], layout, [1, 2, 0, 3])
    assert x is not None and y is not None
    dy = _time_major(b, grad(0), layout, [1, 2, 0, 3])
    h0s, dy_h = (
        _per_direction(b, _time_major(b, v, layout, [1, 0, 2]), count)
        for v in (optional(5), grad(1))
    )
    zeros = _zeros_state(b, x, spec.hidden, dtype)
    ws, rs = _per_direction(b, ctx.x(1), count), _per_direction(b, ctx.x(2), count)
    biases = _per_direction(b, optional(3), count)
    w_shape = ctx.x(1).shape
    input_size = w_shape.dims[-1] if w_shape is not None and len(w_shape) == 3 else None
    input_size = input_size if isinstance(input_size, int) else None
    # dY by step and direction: [N, H] pieces in (step, direction) order
    dy_steps = None if dy is None else _steps(b, b.Flatten(dy, axis=3), spec.steps * count)
    results = []
    for k, reverse in enumerate(spec.reverses):
        w, r = ws[k], rs[k]
        assert w is not None and r is not None
        direction = _Direction(
            x, w, r, biases[k], h0s[k] or zeros, y, k,
            None if dy_steps is None else dy_steps[k::count], dy_h[k], reverse, ctx.needs,
            dtype, input_size,
        )  # fmt: skip
        results.append(_gru_direction_gradient(b, direction, spec))
    out: list[ir.Value | None] = [None] * len(ctx.inputs)
    if ctx.need(0):
        dx_rows = results[0][0]
        for other in results[1:]:
            dx_rows = b.Add(dx_rows, other[0])
        dx = b.reshape_like(dx_rows, x)
        out[0] = b.Transpose(dx, perm=[1, 0, 2]) if layout else dx
    for i in (1, 2, 3):
        if ctx.need(i):
            out[i] = _stack(b, [res[i] for res in results], 0)
    if ctx.need(5):
        state = _stack(b, [res[5] for res in results], 0)
        out[5] = b.Transpose(state, perm=[1, 0, 2]) if layout else state
    return out


register_gradient("LSTM")(_lstm_gradient)
register_gradient("GRU")(_gru_gradient)
