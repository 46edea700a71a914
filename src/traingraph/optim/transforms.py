r"""Gradient transformations that build ONNX graphs, in the style of optax.

A :class:`GradientTransformation` is a pair of functions:

- ``init(params) -> [StateSlot, ...]`` declares the state tensors it keeps per parameter
  (name, shape, dtype and initial value);
- ``update(ctx, updates, state, params) -> (updates, state)`` appends the nodes that turn the
  incoming updates (at first the gradients) into new updates and new state values.

Named optimizers are chains of these small transforms; the last one,
:func:`scale_by_learning_rate`, turns the update into the step :math:`-\eta u` that the
optimizer model adds to each parameter. Every transform reproduces the arithmetic of its
``torch.optim`` counterpart, including torch's bias corrections and first-step rules.

Example:
    >>> adamw = chain(scale_by_adam(), add_decayed_weights(0.01), scale_by_learning_rate())
    >>> slots = adamw.init([ParamInfo("fc.weight", (4, 3), np.dtype(np.float32))])
    >>> [s.name for s in slots]
    ['fc.weight.exp_avg', 'fc.weight.exp_avg_sq']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder

Values = list[ir.Value]
State = dict[str, ir.Value]


@dataclass(frozen=True)
class ParamInfo:
    """A trainable parameter: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class StateSlot:
    """One optimizer state tensor of one parameter.

    Attributes:
        name: Unique name, ``f"{param}.{kind}"`` (e.g. ``"fc1.weight.exp_avg"``).
        param: Name of the parameter it belongs to.
        shape: Shape of the tensor.
        dtype: Element type of the tensor.
        init: Value every element starts at.
    """

    name: str
    param: str
    shape: tuple[int, ...]
    dtype: np.dtype
    init: float


@dataclass
class UpdateContext:
    """What an ``update`` function receives besides the tensors.

    Attributes:
        b: Builder that appends the update nodes.
        lr: The learning rate, a scalar of the parameters' dtype.
        step: The 1-based number of the step being taken, a scalar of the parameters' dtype.
    """

    b: OpBuilder
    lr: ir.Value
    step: ir.Value


InitFn = Callable[[Sequence[ParamInfo]], list[StateSlot]]
UpdateFn = Callable[[UpdateContext, Values, State, Values], tuple[Values, State]]


class GradientTransformation(NamedTuple):
    """A pair ``(init, update)`` of graph-building functions (see the module docstring)."""

    init: InitFn
    update: UpdateFn


# ---------------------------------------------------------------------------- helpers
def _stateless(fn: Callable[[UpdateContext, Values, Values], Values]) -> GradientTransformation:
    """A transformation without state from ``fn(ctx, updates, params) -> updates``."""

    def update(
        ctx: UpdateContext, updates: Values, state: State, params: Values
    ) -> tuple[Values, State]:
        return fn(ctx, updates, params), {}

    return GradientTransformation(lambda params: [], update)


Slots = dict[str, ir.Value]
"""One parameter's state slots by kind (``exp_avg``, ...)."""


def _per_param(
    kinds: Sequence[str],
    step: Callable[[OpBuilder, ir.Value, ir.Value, Slots, Any], tuple[ir.Value, Slots]],
    prepare: Callable[[UpdateContext, ir.Value], Any] | None = None,
    init: float = 0.0,
) -> GradientTransformation:
    """A transformation with slots ``kinds`` per parameter, taken one parameter at a time.

    ``step(b, u, p, slots, shared) -> (u', new slots)`` updates one parameter ``p``'s update
    ``u``; ``shared`` is what ``prepare(ctx, like)`` builds once a step (``like``: the first
    parameter, for its dtype), or None without ``prepare``.
    """

    def update(
        ctx: UpdateContext, updates: Values, state: State, params: Values
    ) -> tuple[Values, State]:
        shared = prepare(ctx, params[0]) if prepare is not None and params else None
        new_state: State = {}
        out: Values = []
        for u, p in zip(updates, params):
            slots = {kind: state[_slot_name(p, kind)] for kind in kinds}
            u, new_slots = step(ctx.b, u, p, slots, shared)
            new_state.update({_slot_name(p, kind): v for kind, v in new_slots.items()})
            out.append(u)
        return out, new_state

    return GradientTransformation(_slots(*kinds, init=init), update)


def _slots(*kinds: str, init: float = 0.0) -> InitFn:
    """An ``init`` that declares, for each parameter, slots ``f"{param}.{kind}"`` like it."""

    def make(params: Sequence[ParamInfo]) -> list[StateSlot]:
        return [
            StateSlot(f"{p.name}.{kind}", p.name, tuple(p.shape), np.dtype(p.dtype), init)
            for p in params
            for kind in kinds
        ]

    return make


def _slot_name(param: ir.Value, kind: str) -> str:
    return f"{param.name}.{kind}"


def _check_non_negative(transform: str, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{transform}: {name} must be non-negative; got {value}")


def _scalar(b: OpBuilder, value: float, like: ir.Value) -> ir.Value:
    return b.scalar(value, like=like)


# ------------------------------------------------------------------ stateless transforms
def scale_by_learning_rate() -> GradientTransformation:
    r"""The final step of an optimizer: :math:`u \leftarrow -\eta\, u`."""

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        neg_lr = ctx.b.Neg(ctx.lr)
        return [ctx.b.Mul(u, neg_lr) for u in updates]

    return _stateless(fn)


def scale(factor: float) -> GradientTransformation:
    r"""Multiply every update by a constant: :math:`u \leftarrow c\, u`."""

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        return [ctx.b.Mul(u, _scalar(ctx.b, factor, p)) for u, p in zip(updates, params)]

    return _stateless(fn)


def add_decayed_weights(
    weight_decay: float, exclude: Sequence[str] = ()
) -> GradientTransformation:
    r"""Add weight decay: :math:`u \leftarrow u + \lambda\, p`.

    Placed before the moment estimates it is torch's coupled L2 penalty (``SGD``, ``Adam``);
    placed after ``scale_by_adam`` it is AdamW's decoupled weight decay. Parameters whose name
    contains one of the strings ``exclude`` are not decayed (the parameter group of biases and
    normalization weights with ``weight_decay=0`` that fine-tuning scripts give torch).
    """
    _check_non_negative("add_decayed_weights", weight_decay=weight_decay)

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        if weight_decay == 0:
            return updates
        b = ctx.b
        return [
            u if decay_excluded(p.name or "", exclude)
            else b.Add(u, b.Mul(p, _scalar(b, weight_decay, p)))
            for u, p in zip(updates, params)
        ]  # fmt: skip

    return _stateless(fn)


add_l2 = add_decayed_weights


def decay_excluded(name: str, exclude: Sequence[str]) -> bool:
    """Whether the parameter ``name`` contains one of the strings ``exclude``."""
    return any(part in name for part in exclude)


def add_l1_regularization(l1: float) -> GradientTransformation:
    r"""Add the gradient of the penalty :math:`\lambda_1 \lVert p \rVert_1`.

    :math:`u \leftarrow u + \lambda_1 \operatorname{sign}(p)`.
    """
    _check_non_negative("add_l1_regularization", l1=l1)

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        b = ctx.b
        return [b.Add(u, b.Mul(b.Sign(p), _scalar(b, l1, p))) for u, p in zip(updates, params)]

    return _stateless(fn)


def clip(max_delta: float) -> GradientTransformation:
    r"""Clip every element to :math:`[-c, c]`, as ``torch.nn.utils.clip_grad_value_``."""
    if not max_delta > 0:
        raise ValueError(f"clip: max_delta must be positive; got {max_delta}")

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        b = ctx.b
        return [
            b.Clip(u, _scalar(b, -max_delta, p), _scalar(b, max_delta, p))
            for u, p in zip(updates, params)
        ]

    return _stateless(fn)


def clip_coefficient(b: OpBuilder, norm: ir.Value, max_norm: float, like: ir.Value) -> ir.Value:
    r""":math:`\min(1, c / (\lVert u \rVert + 10^{-6}))`, torch's clipping factor."""
    ratio = b.Div(_scalar(b, max_norm, like), b.Add(norm, _scalar(b, 1e-6, like)))
    return b.Min(ratio, _scalar(b, 1.0, like))


def _squared_norm(b: OpBuilder, u: ir.Value) -> ir.Value:
    return b.reduce("ReduceSumSquare", u, keepdims=False)


def clip_by_norm(max_norm: float) -> GradientTransformation:
    r"""Scale each tensor to an L2 norm of at most :math:`c`, one tensor at a time.

    :math:`u \leftarrow u \min(1, c / (\lVert u \rVert_2 + 10^{-6}))`, which is
    ``torch.nn.utils.clip_grad_norm_([p], c)`` applied to each parameter alone.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_norm: max_norm must be positive; got {max_norm}")

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        b = ctx.b
        return [
            b.Mul(u, clip_coefficient(b, b.Sqrt(_squared_norm(b, u)), max_norm, p))
            for u, p in zip(updates, params)
        ]

    return _stateless(fn)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    r"""Scale all tensors together to a global L2 norm of at most :math:`c`.

    As ``torch.nn.utils.clip_grad_norm_(params, c)``: with
    :math:`n = \sqrt{\sum_i \lVert u_i \rVert_2^2}`,
    :math:`u_i \leftarrow u_i \min(1, c/(n + 10^{-6}))`.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be positive; got {max_norm}")

    def fn(ctx: UpdateContext, updates: Values, params: Values) -> Values:
        if not updates:
            return updates
        b = ctx.b
        squares = [_squared_norm(b, u) for u in updates]
        total = squares[0] if len(squares) == 1 else b.Sum(*squares)
        coefficient = clip_coefficient(b, b.Sqrt(total), max_norm, params[0])
        return [b.Mul(u, coefficient) for u in updates]

    return _stateless(fn)


# -------------------------------------------------------------------- stateful transforms
def trace(
    momentum: float, dampening: float = 0.0, nesterov: bool = False, kind: str = "momentum_buffer"
) -> GradientTransformation:
    r"""Momentum, as ``torch.optim.SGD``.

    .. math::
        b_t = \begin{cases} u_t & t = 1 \\ \mu\, b_{t-1} + (1 - \tau)\, u_t & t > 1 \end{cases},
        \qquad u \leftarrow \begin{cases} u_t + \mu\, b_t & \text{nesterov} \\ b_t \end{cases}

    The first step copies the update into the buffer without dampening, as torch does.

    Args:
        momentum: :math:`\mu \ge 0`.
        dampening: :math:`\tau`.
        nesterov: Use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        kind: Suffix of the state slot names.
    """
    _check_non_negative("trace", momentum=momentum)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"trace: Nesterov momentum needs momentum > 0 and dampening == 0; got"
            f" momentum={momentum}, dampening={dampening}"
        )

    def first_step(ctx: UpdateContext, like: ir.Value) -> ir.Value | None:
        return ctx.b.Equal(ctx.step, _scalar(ctx.b, 1.0, like)) if dampening != 0 else None

    def step(
        b: OpBuilder, u: ir.Value, p: ir.Value, slots: Slots, first: ir.Value | None
    ) -> tuple[ir.Value, Slots]:
        decayed = b.Mul(slots[kind], _scalar(b, momentum, p))
        if first is None:
            buf = b.Add(decayed, u)
        else:
            later = b.Add(decayed, b.Mul(u, _scalar(b, 1.0 - dampening, p)))
            buf = b.Where(first, u, later)
        return (b.Add(u, b.Mul(buf, _scalar(b, momentum, p))) if nesterov else buf), {kind: buf}

    return _per_param([kind], step, first_step)


momentum = trace


def _lerp(b: OpBuilder, start: ir.Value, end: ir.Value, weight: float, like: ir.Value) -> ir.Value:
    r""":math:`s + w(e - s)`, the running mean in torch's ``lerp_`` form."""
    return b.Add(start, b.Mul(b.Sub(end, start), _scalar(b, weight, like)))


def _average_square(
    b: OpBuilder, average: ir.Value, u: ir.Value, decay: float, like: ir.Value
) -> ir.Value:
    r""":math:`\beta a + (1-\beta) u^2`, the running mean of squares (torch's ``addcmul_`` form)."""
    decayed = b.Mul(average, _scalar(b, decay, like))
    return b.Add(decayed, b.Mul(b.Mul(u, u), _scalar(b, 1.0 - decay, like)))


def _bias_corrections(
    b: OpBuilder, b1: float, b2: float, step: ir.Value, like: ir.Value
) -> tuple[ir.Value, ir.Value]:
    r""":math:`1 - \beta_1^t` and :math:`\sqrt{1 - \beta_2^t}`, in ``like``'s dtype.

    They are computed in float64, as torch computes them in Python: in float32,
    :math:`1 - \beta_2^t` loses about five digits to cancellation in the first steps.
    """
    double = ir.DataType.DOUBLE
    t = b.cast(step, double)

    def one_minus_power(beta: float) -> ir.Value:
        return b.Sub(b.const(1.0, double), b.Pow(b.const(beta, double), t))

    bc2_sqrt = b.Sqrt(one_minus_power(b2))
    results = []
    for value in (one_minus_power(b1), bc2_sqrt):
        value.dtype = double
        results.append(b.cast_like(value, like))
    return results[0], results[1]


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, amsgrad: bool = False
) -> GradientTransformation:
    r"""Adam's moment estimates with torch's bias correction.

    .. math::
        m_t = m_{t-1} + (1-\beta_1)(u - m_{t-1}), \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\, u^2, \\
        u \leftarrow \frac{m_t}{1-\beta_1^t} \Big/
            \Big(\frac{\sqrt{\hat v_t}}{\sqrt{1-\beta_2^t}} + \epsilon\Big)

    with :math:`\hat v_t = v_t`, or :math:`\max(\hat v_{t-1}, v_t)` with ``amsgrad``; this is
    ``torch.optim.Adam``'s ``denom`` and ``step_size`` exactly.

    Args:
        b1, b2: The decay rates :math:`\beta_1, \beta_2 \in [0, 1)`.
        eps: :math:`\epsilon \ge 0`, added after the square root.
        amsgrad: Keep the running maximum of :math:`v` (slot ``max_exp_avg_sq``).
    """
    for name, beta in (("b1", b1), ("b2", b2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"scale_by_adam: {name} must be in [0, 1); got {beta}")
    _check_non_negative("scale_by_adam", eps=eps)
    kinds = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])

    def corrections(ctx: UpdateContext, like: ir.Value) -> tuple[ir.Value, ir.Value]:
        return _bias_corrections(ctx.b, b1, b2, ctx.step, like)

    def step(
        b: OpBuilder, u: ir.Value, p: ir.Value, slots: Slots, bc: tuple[ir.Value, ir.Value]
    ) -> tuple[ir.Value, Slots]:
        bc1, bc2_sqrt = bc
        m = _lerp(b, slots["exp_avg"], u, 1.0 - b1, p)
        v = _average_square(b, slots["exp_avg_sq"], u, b2, p)
        new = {"exp_avg": m, "exp_avg_sq": v}
        if amsgrad:
            v = new["max_exp_avg_sq"] = b.Max(slots["max_exp_avg_sq"], v)
        denom = b.Add(b.Div(b.Sqrt(v), bc2_sqrt), _scalar(b, eps, p))
        return b.Div(b.Div(m, bc1), denom), new

    return _per_param(kinds, step, corrections)


def scale_by_rms(
    alpha: float = 0.99, eps: float = 1e-8, centered: bool = False
) -> GradientTransformation:
    r"""RMSprop's scaling, as ``torch.optim.RMSprop``.

    .. math::
        s_t = \alpha s_{t-1} + (1-\alpha) u^2, \quad
        g_t = g_{t-1} + (1-\alpha)(u - g_{t-1}) \text{ (centered)}, \\
        u \leftarrow u \big/ \big(\sqrt{s_t - g_t^2} + \epsilon\big)
        \quad (\text{or } \sqrt{s_t} + \epsilon \text{ when not centered})

    Combine with :func:`trace` (``dampening=0``) for RMSprop's momentum.

    Args:
        alpha: Smoothing constant :math:`\alpha \ge 0` (slot ``square_avg``).
        eps: :math:`\epsilon \ge 0`, added after the square root.
        centered: Subtract the squared running mean of the updates (slot ``grad_avg``).
    """
    _check_non_negative("scale_by_rms", alpha=alpha, eps=eps)
    kinds = ["square_avg"] + (["grad_avg"] if centered else [])

    def step(
        b: OpBuilder, u: ir.Value, p: ir.Value, slots: Slots, _: None
    ) -> tuple[ir.Value, Slots]:
        s = _average_square(b, slots["square_avg"], u, alpha, p)
        new = {"square_avg": s}
        if centered:
            g = new["grad_avg"] = _lerp(b, slots["grad_avg"], u, 1.0 - alpha, p)
            s = b.Sub(s, b.Mul(g, g))
        return b.Div(u, b.Add(b.Sqrt(s), _scalar(b, eps, p))), new

    return _per_param(kinds, step)


def scale_by_adagrad(
    lr_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10
) -> GradientTransformation:
    r"""Adagrad's scaling, as ``torch.optim.Adagrad``.

    .. math::
        S_t = S_{t-1} + u^2, \quad
        u \leftarrow \frac{u}{(\sqrt{S_t} + \epsilon)\,(1 + (t - 1)\,\delta)}

    Args:
        lr_decay: :math:`\delta \ge 0`, the decay of the effective learning rate.
        initial_accumulator_value: :math:`S_0` (slot ``sum``).
        eps: :math:`\epsilon \ge 0`, added after the square root.
    """
    _check_non_negative(
        "scale_by_adagrad",
        lr_decay=lr_decay,
        initial_accumulator_value=initial_accumulator_value,
        eps=eps,
    )

    def decay(ctx: UpdateContext, like: ir.Value) -> ir.Value | None:
        if lr_decay == 0:
            return None
        b, one = ctx.b, _scalar(ctx.b, 1.0, like)
        return b.Add(one, b.Mul(b.Sub(ctx.step, one), _scalar(b, lr_decay, like)))

    def step(
        b: OpBuilder, u: ir.Value, p: ir.Value, slots: Slots, rate: ir.Value | None
    ) -> tuple[ir.Value, Slots]:
        total = b.Add(slots["sum"], b.Mul(u, u))
        scaled = b.Div(u, b.Add(b.Sqrt(total), _scalar(b, eps, p)))
        return (scaled if rate is None else b.Div(scaled, rate)), {"sum": total}

    return _per_param(["sum"], step, decay, init=initial_accumulator_value)


# --------------------------------------------------------------------------- chaining
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; their state slots are concatenated.

    Raises:
        ValueError: (from ``init``) when two transforms declare a slot of the same name; give
            one of them another ``kind``.
    """

    def init(params: Sequence[ParamInfo]) -> list[StateSlot]:
        slots = [slot for t in transforms for slot in t.init(params)]
        seen: set[str] = set()
        for slot in slots:
            if slot.name in seen:
                raise ValueError(
                    f"chain: two transforms keep a state slot named {slot.name!r}; pass a"
                    " different kind= to one of them"
                )
            seen.add(slot.name)
        return slots

    def update(
        ctx: UpdateContext, updates: Values, state: State, params: Values
    ) -> tuple[Values, State]:
        new_state: State = {}
        for t in transforms:
            updates, changed = t.update(ctx, updates, state, params)
            new_state.update(changed)
        return updates, new_state

    return GradientTransformation(init, update)


__all__ = [
    "GradientTransformation",
    "ParamInfo",
    "StateSlot",
    "UpdateContext",
    "add_decayed_weights",
    "add_l1_regularization",
    "add_l2",
    "chain",
    "clip",
    "clip_by_global_norm",
    "clip_by_norm",
    "momentum",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "trace",
]
