"""The step-by-step forward and backward of an LSTM, GRU or RNN, all directions at once.

:func:`traingraph.autodiff.rules.recurrent` replaces a recurrent node whose gradient is needed
by its forward written step by step (:data:`FORWARDS`: one ``MatMul`` over all steps for the
input, then per step the recurrence ``MatMul`` and the gate math, keeping what the backward
reads) and writes the gradient from those steps (:data:`BACKWARDS`). Every per-step tensor is
``[D, features, N]``, the ``D`` directions stacked, so that one op a step serves them all; a
reverse direction runs over its input reversed in time, so that step ``s`` of every direction
is its ``s``-th step. The gate orders are ONNX's (LSTM ``i, o, f, c``, GRU ``z, r, h``; RNN
has one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder

if TYPE_CHECKING:
    from traingraph.autodiff.rules.recurrent import RecurrentSpec

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
"""The gates of each recurrent op."""


def projection_bias(
    b: OpBuilder,
    bias: ir.Value | None,
    spec: RecurrentSpec,
    dtype: ir.DataType,
    stacked: bool = False,
) -> tuple[ir.Value | None, ir.Value | None]:
    """``(bias added to x_t W^T, GRU's Rb_h applied inside the reset gate or None)``, the
    biases along the last axis of ``bias``: one direction's ``[2*G*H]`` or, ``stacked``, all
    directions' ``[D, 2*G*H]``."""
    if bias is None:
        return None, None
    size = GATES[spec.op_type] * spec.hidden
    w_bias, r_bias = b.split(bias, [size, size], axis=-1)
    if spec.op_type == "GRU" and spec.linear_before_reset:
        r_zr, r_h = b.split(r_bias, [size - spec.hidden, spec.hidden], axis=-1)
        lead = (len(spec.reverses),) if stacked else ()
        zeros = b.const(np.zeros((*lead, spec.hidden)), dtype)
        return b.Add(w_bias, b.Concat(r_zr, zeros, axis=-1)), r_h
    return b.Add(w_bias, r_bias), None


def split(b: OpBuilder, x: ir.Value, pieces: int, axis: int) -> tuple[ir.Value, ...]:
    """Split ``x`` into ``pieces`` equal pieces along ``axis``."""
    if pieces == 1:
        return (x,)
    if b.opset >= 18:
        count = ir.AttrInt64("num_outputs", pieces)
        return tuple(b.op("Split", x, axis=axis, num_outputs=pieces, count=count))
    return tuple(b.op("Split", x, axis=axis, num_outputs=pieces))


def columns(b: OpBuilder, pieces: dict[int, ir.Value], steps: int) -> ir.Value:
    """``[D, X, N]`` pieces by time step side by side: ``[D, X, T*N]``, time-major columns."""
    return b.Concat(*(pieces[t] for t in range(steps)), axis=-1) if steps > 1 else pieces[0]


def transposed(b: OpBuilder, r: ir.Value) -> ir.Value:
    """``R^T`` (``[D, X, G*H]`` from ``[D, G*H, X]``: the recurrence weights, or the input
    weights) as a tensor of its own for a ``MatMul``. It is transposed as ``[D, G*H, X, 1] ->
    [D, X, 1, G*H]``, which onnxruntime does not fold into the ``MatMul`` as a transposed
    operand (one it multiplies about half again as slowly as a plain one)."""
    moved = b.Transpose(b.unsqueeze(r, [3]), perm=[0, 2, 3, 1])
    return b.Reshape(moved, b.ints([0, 0, -1]))


@dataclass
class Steps:
    """The directions' forward by time step, every tensor feature-major (``[D, features, N]``):
    ``order`` the steps in the order they run, ``h0`` the initial hidden state,
    ``h`` the hidden states and ``c`` the final cell state (LSTM), with what the direction's
    backward reads (see the subclasses)."""

    order: list[int]
    h0: ir.Value
    c: ir.Value | None = None
    h: dict[int, ir.Value] = field(default_factory=dict)

    def previous(self, b: OpBuilder, steps: int) -> ir.Value:
        """The hidden state before each step as time-major columns ``[D, H, T*N]``."""
        before = dict(zip(self.order, [self.h0] + [self.h[t] for t in self.order[:-1]]))
        return columns(b, before, steps)

    def hidden_gradient(
        self,
        b: OpBuilder,
        t: int,
        back: ir.Value | None,
        dy: Sequence[ir.Value] | None,
        dy_h: ir.Value | None,
    ) -> ir.Value:
        """``dh_t``: the gradient ``dy[t]`` of ``Y_t`` plus ``back``, what flows back from the
        step after ``t`` (None for the last step, which takes ``Y_h``'s gradient ``dy_h``)."""
        dh = dy_h if back is None else back
        if dy is not None:
            dh = dy[t] if dh is None else b.Add(dy[t], dh)
        return dh if dh is not None else b.zeros_like(self.h0)


@dataclass
class LstmSteps(Steps):
    """LSTM steps, with the forget gates ``f``, the gate slopes ``slope``
    (``[D, 4H, N]``: what ``[dc_t, dh_t, dc_t, dc_t]`` is multiplied by to give the gates'
    gradient) and ``through`` (``o_t (1 - tanh^2 c_t)``: what ``dh_t`` is multiplied by in
    ``dc_t``)."""

    f: dict[int, ir.Value] = field(default_factory=dict)
    slope: dict[int, ir.Value] = field(default_factory=dict)
    through: dict[int, ir.Value] = field(default_factory=dict)


@dataclass
class GruSteps(Steps):
    """GRU steps, with the update gates ``z``, the reset gates ``r``, the
    candidates ``n`` and ``inner``: ``u_t = R_h h_{t-1} + Rb_h`` (linear_before_reset=1) or
    ``r_t h_{t-1}`` (linear_before_reset=0)."""

    z: dict[int, ir.Value] = field(default_factory=dict)
    r: dict[int, ir.Value] = field(default_factory=dict)
    n: dict[int, ir.Value] = field(default_factory=dict)
    inner: dict[int, ir.Value] = field(default_factory=dict)


@dataclass
class RnnSteps(Steps):
    """RNN steps, with the slopes ``1 - h_t^2`` of their ``tanh``."""

    slope: dict[int, ir.Value] = field(default_factory=dict)


@dataclass(frozen=True)
class DirectionInputs:
    """The directions' inputs: ``x2`` the time-major input rows ``[D, T*N, I]`` (reversed in
    time for a reverse direction) and ``xt`` their transpose ``[D, I, T*N]``, with a last
    column (row) of ones where the node has a bias, ``w`` ``[D, G*H, I]``, ``r``
    ``[D, G*H, H]``, ``bias`` ``[D, 2*G*H]`` (``G`` gates), the initial states ``[D, H, N]``
    (zeros where absent; no cell state for GRU), ``order`` the steps in the order they run and
    ``dtype`` the node's float type.

    With the ones, the input projection's ``MatMul`` adds the bias (a last column of the
    weights) and the weight gradient's ``MatMul`` sums the bias gradient over all steps (its
    last column)."""

    x2: ir.Value
    xt: ir.Value
    w: ir.Value
    r: ir.Value
    bias: ir.Value | None
    h0: ir.Value
    c0: ir.Value | None
    order: list[int]
    dtype: ir.DataType


@dataclass(frozen=True)
class OutputGradients:
    """The output gradients, feature-major: ``dy`` those of the hidden states by step
    (``[D, H, N]`` each, in the order of the steps the directions run), ``dy_h`` / ``dy_c``
    those of the final states; None where absent."""

    dy: Sequence[ir.Value] | None
    dy_h: ir.Value | None
    dy_c: ir.Value | None


def projection(b: OpBuilder, d: DirectionInputs, bias: ir.Value | None) -> ir.Value:
    """``W x_t + bias`` as time-major columns ``[D, G*H, T*N]``, one ``MatMul`` over all steps
    (``bias`` ``[D, G*H]`` is None exactly where the node has none)."""
    if bias is None:
        return b.MatMul(d.w, d.xt)
    return b.MatMul(b.Concat(d.w, b.unsqueeze(bias, [2]), axis=2), d.xt)


def weight_gradients(
    b: OpBuilder, d: DirectionInputs, rows: ir.Value, need: Callable[[int], bool]
) -> tuple[ir.Value | None, ir.Value | None]:
    """``(dW, the column sums of rows or None)`` where wanted from ``rows`` ``[D, G*H, T*N]``
    (the gradients of the input projection): one ``MatMul`` by the input rows, whose last
    column is the sums where the rows have ones."""
    if d.bias is None or not need(1):
        total = b.sum(rows, [2], keepdims=False) if need(3) else None
        return (b.MatMul(rows, d.x2) if need(1) else None), total
    full = b.MatMul(rows, d.x2)
    dw = b.slice(full, [0], [-1], [2])
    return dw, b.squeeze(b.slice(full, [-1], [2**62], [2]), [2]) if need(3) else None


def lstm_forward(b: OpBuilder, d: DirectionInputs, spec: RecurrentSpec) -> LstmSteps:
    """The LSTM forward: one ``MatMul`` over all steps for ``W x_t + Wb + Rb``, then one
    ``MatMul`` per step for the gates, and the slopes its gradient reads, made while the
    step's gates are at hand (the module docstring's formulas with ``i_t g_t``, ``h_t`` and
    ``f_t c_{t-1}`` reused: ``[i_t g_t, h_t, f_t c_{t-1}] (1 - [i, o, f])``,
    ``i_t - i_t g_t g_t`` and ``o_t - h_t tanh c_t``)."""
    hidden = spec.hidden
    bias = d.bias
    if bias is not None:
        bias = b.Add(*b.split(bias, [4 * hidden] * 2, axis=1))
    pieces = split(b, projection(b, d, bias), spec.steps, axis=2)
    one = b.const(1.0, d.dtype)
    assert d.c0 is not None
    steps = LstmSteps(d.order, d.h0)
    gate_sizes, iof_sizes = b.ints([3 * hidden, hidden]), b.ints([hidden] * 3)
    h, c = d.h0, d.c0
    for t in d.order:
        gates = b.Add(b.MatMul(d.r, h), pieces[t])
        pre_iof, pre_g = b.op("Split", gates, gate_sizes, axis=1, num_outputs=2)
        iof, g = b.Sigmoid(pre_iof), b.Tanh(pre_g)
        i, o, f = b.op("Split", iof, iof_sizes, axis=1, num_outputs=3)
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


def gru_forward(b: OpBuilder, d: DirectionInputs, spec: RecurrentSpec) -> GruSteps:
    """The GRU forward: one ``MatMul`` over all steps for ``W x_t`` and the biases outside the
    reset gate, then per step one ``MatMul`` for the update and reset gates and one for the
    candidate."""
    hidden = spec.hidden
    x_bias, rb_h = projection_bias(b, d.bias, spec, d.dtype, stacked=True)
    projected = projection(b, d, x_bias)
    p_zr, p_h = b.split(projected, [2 * hidden, hidden], axis=1)
    p_zr_t, p_h_t = split(b, p_zr, spec.steps, axis=2), split(b, p_h, spec.steps, axis=2)
    r_zr, r_h = b.split(d.r, [2 * hidden, hidden], axis=1)
    rb_column = None if rb_h is None else b.unsqueeze(rb_h, [2])
    steps = GruSteps(d.order, d.h0)
    halves = b.ints([hidden] * 2)
    h = d.h0
    for t in d.order:
        zr = b.Sigmoid(b.Add(b.MatMul(r_zr, h), p_zr_t[t]))
        z, r = b.op("Split", zr, halves, axis=1, num_outputs=2)
        if spec.linear_before_reset:
            inner = b.MatMul(r_h, h)
            if rb_column is not None:
                inner = b.Add(inner, rb_column)
            n = b.Tanh(b.Add(p_h_t[t], b.Mul(r, inner)))
        else:
            inner = b.Mul(r, h)
            n = b.Tanh(b.Add(b.MatMul(r_h, inner), p_h_t[t]))
        h = b.Add(n, b.Mul(z, b.Sub(h, n)))
        steps.z[t], steps.r[t], steps.n[t], steps.inner[t], steps.h[t] = z, r, n, inner, h
    return steps


def rnn_forward(b: OpBuilder, d: DirectionInputs, spec: RecurrentSpec) -> RnnSteps:
    """The RNN forward: one ``MatMul`` over all steps for ``W x_t + Wb + Rb``, then per step
    ``h_t = tanh(R h_{t-1} + W x_t + Wb + Rb)`` and its slope ``1 - h_t^2``."""
    bias = d.bias
    if bias is not None:
        bias = b.Add(*b.split(bias, [spec.hidden] * 2, axis=1))
    pieces = split(b, projection(b, d, bias), spec.steps, axis=2)
    one = b.const(1.0, d.dtype)
    steps = RnnSteps(d.order, d.h0)
    h = d.h0
    for t in d.order:
        h = b.Tanh(b.Add(b.MatMul(d.r, h), pieces[t]))
        steps.slope[t], steps.h[t] = b.Sub(one, b.Mul(h, h)), h
    return steps


def rnn_backward(
    b: OpBuilder,
    fwd: Steps,
    d: DirectionInputs,
    g: OutputGradients,
    spec: RecurrentSpec,
    need: Callable[[int], bool],
) -> dict[int, ir.Value]:
    """The RNN gradients by node input where wanted: X (as ``[D, I, T*N]``, in the steps'
    order), W, R, B and initial_h (``[D, H, N]``). Three nodes a step: ``dh_t = dY_t + R^T
    dA_{t+1}`` and ``dA_t = dh_t (1 - h_t^2)``, ``A_t`` the step's ``tanh`` input."""
    assert isinstance(fwd, RnnSteps)
    r_t = transposed(b, d.r)
    da: dict[int, ir.Value] = {}
    after: int | None = None
    for t in reversed(fwd.order):
        back = None if after is None else b.MatMul(r_t, da[after])
        da[t] = b.Mul(fwd.hidden_gradient(b, t, back, g.dy, g.dy_h), fwd.slope[t])
        after = t
    assert after is not None
    first = after  # the step that runs first
    rows = columns(b, da, spec.steps)  # [D, H, T*N]
    return node_gradients(b, fwd, d, spec, need, rows, lambda: b.MatMul(r_t, da[first]))


def node_gradients(
    b: OpBuilder,
    fwd: Steps,
    d: DirectionInputs,
    spec: RecurrentSpec,
    need: Callable[[int], bool],
    rows: ir.Value,
    initial_h: Callable[[], ir.Value],
    more: dict[int, Callable[[], ir.Value | None]] | None = None,
) -> dict[int, ir.Value]:
    """The gradients by node input, where wanted, from the gates' gradients ``rows`` (``[D,
    G*H, T*N]``, every step's columns): X, W, R and B over all steps at once; initial_h from
    ``initial_h``, and those of ``more`` (LSTM's initial_c)."""
    dw, db = weight_gradients(b, d, rows, need)
    makers: dict[int, Callable[[], ir.Value | None]] = {
        0: lambda: b.MatMul(transposed(b, d.w), rows),
        1: lambda: dw,
        2: lambda: b.MatMul(rows, b.Transpose(fwd.previous(b, spec.steps), perm=[0, 2, 1])),
        3: lambda: None if db is None else b.Concat(db, db, axis=1),
        5: initial_h,
        **(more or {}),
    }
    made = {i: make() for i, make in makers.items() if need(i)}
    return {i: v for i, v in made.items() if v is not None}


def lstm_backward(
    b: OpBuilder,
    fwd: Steps,
    d: DirectionInputs,
    g: OutputGradients,
    spec: RecurrentSpec,
    need: Callable[[int], bool],
) -> dict[int, ir.Value]:
    """The LSTM gradients by node input where wanted: X (as ``[D, I, T*N]``, in the steps'
    order), W, R, B, initial_h and initial_c (``[D, H, N]``). Seven nodes a step: ``dh_t =
    dY_t + R^T dG_{t+1}``, ``dc_t``, then ``dG_t``."""
    assert isinstance(fwd, LstmSteps)
    r_t = transposed(b, d.r)
    dgates: dict[int, ir.Value] = {}
    dc: ir.Value | None = None
    after: int | None = None
    for t in reversed(fwd.order):
        if after is None or dc is None:
            dh, c_back = fwd.hidden_gradient(b, t, None, g.dy, g.dy_h), g.dy_c
        else:
            back = dgates[after]
            dh = b.MatMul(r_t, back)
            if g.dy is not None:
                dh = b.Add(dh, g.dy[t])
            c_back = b.Mul(dc, fwd.f[after])
        from_h = b.Mul(dh, fwd.through[t])
        dc = from_h if c_back is None else b.Add(from_h, c_back)
        dgates[t] = b.Mul(b.Concat(dc, dh, dc, dc, axis=1), fwd.slope[t])
        after = t
    assert dc is not None and after is not None
    dg = columns(b, dgates, spec.steps)  # [D, 4H, T*N]
    first = after  # the step that runs first
    final_dc = dc
    return node_gradients(
        b, fwd, d, spec, need, dg, lambda: b.MatMul(r_t, dgates[first]),
        {6: lambda: b.Mul(final_dc, fwd.f[first])},
    )  # fmt: skip


def gru_backward(
    b: OpBuilder,
    fwd: Steps,
    d: DirectionInputs,
    g: OutputGradients,
    spec: RecurrentSpec,
    need: Callable[[int], bool],
) -> dict[int, ir.Value]:
    """The GRU gradients by node input where wanted: X (as ``[D, I, T*N]``, in the steps'
    order), W, R, B and initial_h (``[D, H, N]``). The slopes come from the forward's gates over all
    steps at once; only the backward recurrence runs step by step::

        dn_t = dh_t (1 - z_t) (1 - n_t^2),   dz_t = dh_t (h_{t-1} - n_t) z_t (1 - z_t)
        linear_before_reset=1 (u_t = R_h h_{t-1} + Rb_h):
            dr_t = dn_t u_t r_t (1 - r_t),   dh_{t-1} = dh_t z_t + R^T [dz_t, dr_t, dn_t r_t]
        linear_before_reset=0 (e_t = R_h^T dn_t):
            dr_t = e_t h_{t-1} r_t (1 - r_t),   dh_{t-1} = dh_t z_t + e_t r_t + R_zr^T [dz_t, dr_t]
    """
    assert isinstance(fwd, GruSteps)
    steps, hidden = spec.steps, spec.hidden
    order = fwd.order
    h_prev = fwd.previous(b, steps)
    z, r, n = (columns(b, v, steps) for v in (fwd.z, fwd.r, fwd.n))
    inner = columns(b, fwd.inner, steps)
    r_zr, r_h = b.split(d.r, [2 * hidden, hidden], axis=1)
    one = b.const(1.0, d.dtype)
    to_n = b.Mul(b.Sub(one, z), b.Sub(one, b.Mul(n, n)))  # dn_t = dh_t * to_n
    to_z = b.Mul(b.Sub(h_prev, n), b.Mul(z, b.Sub(one, z)))  # dz_t = dh_t * to_z
    r_slope = b.Mul(r, b.Sub(one, r))
    z_t = fwd.z
    dh_t: dict[int, ir.Value] = {}
    dgates: dict[int, ir.Value] = {}  # the rows R (R_zr without linear_before_reset) takes
    if spec.linear_before_reset:
        r_t = transposed(b, d.r)
        # dgates_t = [dz_t, dr_t, dn_t r_t] = [dh_t, dh_t, dh_t] * slopes
        slopes = b.Concat(to_z, b.Mul(to_n, b.Mul(inner, r_slope)), b.Mul(to_n, r), axis=1)
        slope_t = split(b, slopes, steps, axis=2)
        after = None
        for t in reversed(order):
            back = None
            if after is not None:
                back = b.Add(b.MatMul(r_t, dgates[after]), b.Mul(dh_t[after], z_t[after]))
            dh = dh_t[t] = fwd.hidden_gradient(b, t, back, g.dy, g.dy_h)
            dgates[t] = b.Mul(b.Concat(dh, dh, dh, axis=1), slope_t[t])
            after = t
        assert after is not None
        first = after  # the step that runs first
        dh_all = columns(b, dh_t, steps)
        d_r_rows = columns(b, dgates, steps)  # [dz, dr, dn r]
        d_zr = b.slice(d_r_rows, [0], [2 * hidden], [1])
        d_n = b.Mul(dh_all, to_n)
        d_x_rows = b.Concat(d_zr, d_n, axis=1)  # [dz, dr, dn]

        def recurrence_gradient() -> ir.Value:
            return b.MatMul(d_r_rows, b.Transpose(h_prev, perm=[0, 2, 1]))

        def bias_gradient(db: ir.Value) -> ir.Value:
            return b.Concat(db, b.sum(d_r_rows, [2], keepdims=False), axis=1)

        def initial_gradient() -> ir.Value:
            return b.Add(b.MatMul(r_t, dgates[first]), b.Mul(dh_t[first], z_t[first]))

    else:
        r_zr_t, r_h_t = transposed(b, r_zr), transposed(b, r_h)
        to_n_t, to_z_t = split(b, to_n, steps, axis=2), split(b, to_z, steps, axis=2)
        to_r_t = split(b, b.Mul(h_prev, r_slope), steps, axis=2)
        reset_t = fwd.r
        d_n_t: dict[int, ir.Value] = {}
        reset: dict[int, ir.Value] = {}  # e_t = R_h^T dn_t
        after = None
        for t in reversed(order):
            back = None
            if after is not None:
                direct = b.Add(
                    b.Mul(dh_t[after], z_t[after]), b.Mul(reset[after], reset_t[after])
                )
                back = b.Add(b.MatMul(r_zr_t, dgates[after]), direct)
            dh = dh_t[t] = fwd.hidden_gradient(b, t, back, g.dy, g.dy_h)
            d_n_t[t] = b.Mul(dh, to_n_t[t])
            reset[t] = b.MatMul(r_h_t, d_n_t[t])
            dgates[t] = b.Concat(b.Mul(dh, to_z_t[t]), b.Mul(reset[t], to_r_t[t]), axis=1)
            after = t
        assert after is not None
        first = after
        d_zr = columns(b, dgates, steps)
        d_n = columns(b, d_n_t, steps)
        d_x_rows = b.Concat(d_zr, d_n, axis=1)

        def recurrence_gradient() -> ir.Value:
            return b.Concat(
                b.MatMul(d_zr, b.Transpose(h_prev, perm=[0, 2, 1])),
                b.MatMul(d_n, b.Transpose(inner, perm=[0, 2, 1])),
                axis=1,
            )

        def bias_gradient(db: ir.Value) -> ir.Value:
            return b.Concat(db, db, axis=1)

        def initial_gradient() -> ir.Value:
            direct = b.Add(b.Mul(dh_t[first], z_t[first]), b.Mul(reset[first], reset_t[first]))
            return b.Add(b.MatMul(r_zr_t, dgates[first]), direct)

    dw, db = weight_gradients(b, d, d_x_rows, need)
    makers: dict[int, Callable[[], ir.Value | None]] = {
        0: lambda: b.MatMul(b.Transpose(d.w, perm=[0, 2, 1]), d_x_rows),
        1: lambda: dw,
        2: recurrence_gradient,
        3: lambda: None if db is None else bias_gradient(db),
        5: initial_gradient,
    }
    made = {i: make() for i, make in makers.items() if need(i)}
    return {i: v for i, v in made.items() if v is not None}


FORWARDS: dict[str, Callable[[OpBuilder, DirectionInputs, RecurrentSpec], Steps]] = {
    "LSTM": lstm_forward,
    "GRU": gru_forward,
    "RNN": rnn_forward,
}
BACKWARDS = {"LSTM": lstm_backward, "GRU": gru_backward, "RNN": rnn_backward}


__all__ = [
    "BACKWARDS",
    "FORWARDS",
    "GATES",
    "DirectionInputs",
    "GruSteps",
    "LstmSteps",
    "OutputGradients",
    "RnnSteps",
    "Steps",
    "columns",
    "projection_bias",
    "split",
    "transposed",
]
