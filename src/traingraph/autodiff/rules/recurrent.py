"""Gradients of LSTM, GRU and RNN over the static time steps of the recurrence.

The node is replaced in the training graph by its forward written step by step
(:func:`_stepwise_gradient`): one ``MatMul`` over all steps for ``X W^T`` and the biases, then
per step a ``MatMul`` or two for the recurrence and the gates' elementwise math, each op
serving every direction at once; the gradient reads the gates the forward made instead of
recomputing them. For LSTM the forward also makes
the slopes the backward recurrence reads, while the step's gates are at hand. With gate order
``i, o, f, c`` (``g`` the candidate ``c``) and ``t + 1`` the step after ``t`` in the
direction's order:

    c_t = f_t c_{t-1} + i_t g_t,   h_t = o_t tanh c_t
    dh_t = dY_t + dG_{t+1} R,   dc_t = dh_t o_t (1 - tanh^2 c_t) + dc_{t+1} f_{t+1}
    dG_t = [dc_t, dh_t, dc_t, dc_t] * [i_t g_t (1 - i_t), h_t (1 - o_t),
                                       f_t c_{t-1} (1 - f_t), i_t (1 - g_t^2)]

for GRU as :func:`~traingraph.autodiff.rules.recurrent_steps.gru_backward` says and for RNN as
:func:`~traingraph.autodiff.rules.recurrent_steps.rnn_backward` says (the steps
are built in :mod:`traingraph.autodiff.rules.recurrent_steps`). The weight, bias and input
gradients are then one ``MatMul`` each over all steps: ``dW = dG^T X``,
``dR = dG^T H_prev``, ``dB = sum dG``, ``dX = dG W``. The steps hold their tensors
feature-major with the directions stacked (``[D, H, N]``, the transposes of the rows above),
so that each step's ``MatMul`` takes the weights as its first operand and the small state as
the second; a reverse direction runs over its input reversed in time, so that step ``s`` of
every direction is that direction's ``s``-th step.

An LSTM with peepholes keeps its node: the rule rebuilds the node's forward computation from
primitive ops (``MatMul``, ``Add``, ``Mul``, ``Sigmoid``, ``Tanh``, ``Split``, ``Concat``, ...)
in a scratch graph, one step per time step and direction (:func:`unroll`), differentiates that
graph with :func:`traingraph.autodiff.engine.differentiate` (backpropagation through time), and
moves the rebuilt forward and its gradient into the model's graph; the node keeps computing the
forward outputs, and the gradient recomputes the activations it needs.

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
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.engine import differentiate
from traingraph.autodiff.registry import register_gradient
from traingraph.autodiff.rules.recurrent_steps import (
    BACKWARDS,
    FORWARDS,
    DirectionInputs,
    OutputGradients,
    projection_bias,
    split,
)
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import max_ir_version
from traingraph.ir.tags import tagging

Grads = Sequence[ir.Value | None]

_DEFAULT_ACTIVATIONS = {
    "LSTM": ("sigmoid", "tanh", "tanh"),
    "GRU": ("sigmoid", "tanh"),
    "RNN": ("tanh",),
}
_DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
_SEQUENCE_LENS = 4


@dataclass(frozen=True)
class RecurrentSpec:
    """The form of one LSTM / GRU node.

    Attributes:
        op_type: ``"LSTM"``, ``"GRU"`` or ``"RNN"``.
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
        x_bias, rb_h = projection_bias(b, bias, spec, dtype)
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


def _permuted(b: OpBuilder, v: ir.Value | None, perm: list[int]) -> ir.Value | None:
    """``v`` transposed by ``perm``; None stays None."""
    return None if v is None else b.Transpose(v, perm=perm)


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


def _step_order(b: OpBuilder, steps: int, reverses: Sequence[bool]) -> ir.Value:
    """The ``Gather`` indices that take a ``[T*D, ...]`` tensor (row ``t*D + d``: time ``t``
    of direction ``d``) from time order to the directions' step order, where a reverse
    direction's step ``s`` is time ``T - 1 - s``; the same indices take it back."""
    count = len(reverses)
    return b.ints(
        [(steps - 1 - t if reverse else t) * count + d
         for t in range(steps) for d, reverse in enumerate(reverses)]
    )  # fmt: skip


def _in_step_order(b: OpBuilder, v: ir.Value, steps: int, reverses: Sequence[bool]) -> ir.Value:
    """``v`` (``[T*D, ...]``, rows as :func:`_step_order` says) reordered between time order
    and step order by one ``Gather``; ``v`` itself where no direction is reversed."""
    if not any(reverses) or steps == 1:
        return v
    return b.Gather(v, _step_order(b, steps, reverses), axis=0)


def _directions_summed(
    b: OpBuilder, v: ir.Value, reverses: Sequence[bool], time: int
) -> ir.Value:
    """The sum over the leading direction axis of ``v`` with the time axis ``time`` reversed in
    the reverse directions: one ``Slice`` a direction (reversing where it is reversed) and the
    ``Add`` of the slices, the direction axis squeezed."""
    if len(reverses) == 1 and not reverses[0]:
        return b.squeeze(v, [0])
    total = None
    for d, reverse in enumerate(reverses):
        if reverse:
            piece = b.slice(v, [d, -1], [d + 1, -(2**62)], [0, time], [1, -1])
        else:
            piece = b.slice(v, [d], [d + 1], [0])
        total = piece if total is None else b.Add(total, piece)
    assert total is not None
    return b.squeeze(total, [0])


def _stepwise_gradient(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """The gradient of an LSTM, GRU or RNN node, which is replaced by its forward written step by
    step (see the module docstring); an LSTM with peepholes takes :func:`_recurrent_gradient`.

    Every per-step tensor is feature-major, ``[D, features, N]`` with the directions stacked:
    each step's ``MatMul`` multiplies the recurrence weights of every direction by the small
    ``[D, H, N]`` state, which is cheaper to pack than the weights, and each of the step's ops
    serves all directions. A reverse direction runs over its input reversed in time, its
    outputs and their gradients reversed back.
    """
    spec = recurrent_spec(ctx)
    lstm = spec.op_type == "LSTM"
    dtype = ctx.x(0).dtype
    if (lstm and ctx.has_input(7)) or ctx.node.graph is None or dtype is None:
        return _recurrent_gradient(ctx, grads)
    b, layout, count = ctx.b, spec.layout, len(spec.reverses)
    steps, hidden, reverses = spec.steps, spec.hidden, spec.reverses
    scratch = ir.Graph([], [], nodes=[], opset_imports={"": ctx.opset})
    fb = OpBuilder(scratch, ctx.opset, prefix=b.fresh_name("forward"))
    # perms from layout 0 / 1 to feature-major: [T, D, N, H] / [N, T, D, H] -> [T, D, H, N],
    # [D, N, H] / [N, D, H] -> [D, H, N]; and back
    steps_in, states_in = ([1, 2, 3, 0], [1, 2, 0]) if layout else ([0, 1, 3, 2], [0, 2, 1])
    steps_out, states_out = ([3, 0, 1, 2], [2, 0, 1]) if layout else ([0, 1, 3, 2], [0, 2, 1])

    def optional(i: int) -> ir.Value | None:
        return ctx.inputs[i] if ctx.has_input(i) else None

    def grad(k: int) -> ir.Value | None:
        return grads[k] if k < len(grads) else None

    x = _time_major(fb, ctx.x(0), layout, [1, 0, 2])
    assert x is not None
    # the input rows [D, T*N, I], reversed in time for a reverse direction (one Gather over
    # the time axis), with a column of ones where the node has a bias
    if ctx.has_input(3):
        shape = fb.Concat(fb.shape(x, 0, 2), fb.ints([1]), axis=0)
        ones = fb.op("ConstantOfShape", shape, value=ir.tensor(np.ones(1, dtype.numpy())))
        x = fb.Concat(x, ones, axis=2)
    if any(reverses) and steps > 1:
        times = [
            t for reverse in reverses
            for t in (range(steps - 1, -1, -1) if reverse else range(steps))
        ]  # fmt: skip
        x = fb.Gather(x, fb.ints(times), axis=0)  # [D*T, N, I]
    elif count > 1:
        x = fb.Concat(*[x] * count, axis=0)
    x2 = fb.Reshape(x, fb.ints([count, -1, 0]))
    xt = fb.Transpose(x2, perm=[0, 2, 1])
    h0, c0 = (
        _permuted(fb, v, states_in) for v in (optional(5), optional(6) if lstm else None)
    )
    if h0 is None or (lstm and c0 is None):
        shape = fb.Concat(fb.ints([count, hidden]), fb.shape(x, 1, 2), axis=0)
        zeros = fb.op("ConstantOfShape", shape, value=ir.tensor(np.zeros(1, dtype.numpy())))
        h0 = h0 or zeros
        c0 = (c0 or zeros) if lstm else None
    d = DirectionInputs(
        x2, xt, ctx.x(1), ctx.x(2), optional(3), h0, c0, list(range(steps)), dtype
    )
    fwd = FORWARDS[spec.op_type](fb, d, spec)
    new: list[ir.Value | None] = [None] * len(ctx.outputs)
    if _in_use(ctx.outputs[0]):
        pieces = [fwd.h[t] for t in range(steps)]  # [D, H, N] each
        hs = fb.Concat(*pieces, axis=0) if len(pieces) > 1 else pieces[0]  # [T*D, H, N]
        hs = _in_step_order(fb, hs, steps, reverses)  # in time order
        y = fb.Reshape(hs, fb.ints([steps, count, hidden, -1]))  # [T, D, H, N]
        new[0] = fb.Transpose(y, perm=steps_out)
    finals = {1: fwd.h[steps - 1], 2: fwd.c}
    for k, state in finals.items():
        if k < len(ctx.outputs) and _in_use(ctx.outputs[k]) and state is not None:
            new[k] = fb.Transpose(state, perm=states_out)
    _replace_outputs(ctx, scratch, new)

    dy = _permuted(b, grad(0), steps_in)  # [T, D, H, N]
    dy_steps = None
    if dy is not None:
        # by step, [D, H, N] each, every direction in the order of its steps
        shape = b.Concat(b.ints([-1]), b.shape(dy, 2, 4), axis=0)
        dy = _in_step_order(b, b.Reshape(dy, shape), steps, reverses)  # [T*D, H, N]
        dy_steps = split(b, dy, steps, axis=0)
    dy_h, dy_c = (_permuted(b, grad(k), states_in) for k in (1, 2))
    g = OutputGradients(dy_steps, dy_h, dy_c)
    instance = ctx.node.name or ctx.node.op_type
    with tagging(b, "lstm_backward", instance) if lstm else nullcontext():  # a native kernel's
        by_input = BACKWARDS[spec.op_type](b, fwd, d, g, spec, ctx.need)
    out: list[ir.Value | None] = [None] * len(ctx.inputs)
    if 0 in by_input:
        dx = b.Reshape(by_input[0], b.ints([0, 0, steps, -1]))  # [D, I, T, N]
        dx = _directions_summed(b, dx, reverses, 2)  # [I, T, N]
        out[0] = b.Transpose(dx, perm=[2, 1, 0] if layout else [1, 2, 0])
    for i, value in by_input.items():
        if i in (1, 2, 3):
            out[i] = value
        elif i in (5, 6):
            out[i] = b.Transpose(value, perm=states_out)
    return out


register_gradient("LSTM")(_stepwise_gradient)
register_gradient("GRU")(_stepwise_gradient)
register_gradient("RNN")(_stepwise_gradient)
