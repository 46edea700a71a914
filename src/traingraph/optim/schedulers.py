r"""Learning-rate schedulers.

A scheduler drives any object with ``set_learning_rate(lr)`` and ``get_learning_rate()`` (the
runtime's optimizer, or an ``onnxruntime.training``-style ``Optimizer``). Construction sets the
rate of step 0, and each :meth:`LRScheduler.step` advances one step and sets the next rate;
:meth:`LRScheduler.lr_at` is the pure schedule.

Example:
    >>> scheduler = CosineLRScheduler(optimizer, warmup_step_count=100, total_step_count=1000,
    ...                               initial_lr=1e-3, min_lr=1e-5)
    >>> for batch in data:
    ...     train_step(batch)
    ...     scheduler.step()
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol


class LearningRateSetter(Protocol):
    """What a scheduler drives."""

    def set_learning_rate(self, lr: float) -> None: ...

    def get_learning_rate(self) -> float: ...


class LRScheduler:
    """Base class: subclasses define :meth:`lr_at`.

    Args:
        optimizer: Any object with ``set_learning_rate(lr)`` and ``get_learning_rate()``.
        initial_lr: The base learning rate of the schedule.
    """

    def __init__(self, optimizer: LearningRateSetter, initial_lr: float) -> None:
        name = type(self).__name__
        for method in ("set_learning_rate", "get_learning_rate"):
            if not callable(getattr(optimizer, method, None)):
                raise TypeError(
                    f"{name}: the optimizer must have a {method}() method; got an object of type"
                    f" {type(optimizer).__name__}"
                )
        _require(name, initial_lr >= 0, f"initial_lr must be non-negative; got {initial_lr}")
        self.optimizer = optimizer
        self.initial_lr = float(initial_lr)
        self.step_count = 0
        self._last_lr = self._apply()

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (0-based: the rate before the first ``step()`` call)."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance one step and set the new learning rate on the optimizer."""
        self.step_count += 1
        self._last_lr = self._apply()

    def get_last_lr(self) -> float:
        """The learning rate set by the last ``step()`` (or by construction)."""
        return self._last_lr

    def _apply(self) -> float:
        lr = self.lr_at(self.step_count)
        self.optimizer.set_learning_rate(lr)
        return lr


def _require(name: str, condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


def _count(name: str, arg: str, value: Any, minimum: int) -> int:
    """``value`` as an int, checked to be an integer of at least ``minimum``."""
    kind = "non-negative" if minimum == 0 else "positive"
    _require(
        name,
        isinstance(value, numbers.Integral) and int(value) >= minimum,
        f"{arg} must be a {kind} int; got {value!r}",
    )
    return int(value)


def _step_counts(name: str, warmup_step_count: Any, total_step_count: Any) -> tuple[int, int]:
    """The checked ``(warmup_step_count, total_step_count)``: ``0 <= warmup <= total >= 1``."""
    warmup = _count(name, "warmup_step_count", warmup_step_count, 0)
    total = _count(name, "total_step_count", total_step_count, 1)
    _require(
        name,
        total >= warmup,
        f"total_step_count ({total}) must be at least warmup_step_count ({warmup})",
    )
    return warmup, total


class _WarmupDecay(LRScheduler):
    r"""Linear warmup from 0 to ``initial_lr``, then a decay to ``min_lr``.

    :math:`\eta_t = \eta_0\, t / w` for :math:`t < w`, else :math:`\eta_{\min} + (\eta_0 -
    \eta_{\min})\, f_t` with the fraction :math:`f_t` that :meth:`remaining` gives.
    """

    def __init__(
        self,
        optimizer: LearningRateSetter,
        warmup_step_count: int,
        total_step_count: int,
        initial_lr: float,
        min_lr: float = 0.0,
    ) -> None:
        r"""Check and keep the schedule's parameters; set the rate of step 0.

        Args:
            optimizer: Any object with ``set_learning_rate(lr)`` and ``get_learning_rate()``.
            warmup_step_count: Steps of warmup :math:`w \ge 0`.
            total_step_count: Step :math:`T \ge \max(w, 1)` at which the rate reaches
                ``min_lr``.
            initial_lr: The peak learning rate :math:`\eta_0`.
            min_lr: The final learning rate :math:`0 \le \eta_{\min} \le \eta_0`.
        """
        name = type(self).__name__
        self.warmup_step_count, self.total_step_count = _step_counts(
            name, warmup_step_count, total_step_count
        )
        _require(
            name,
            0 <= min_lr <= max(initial_lr, 0),
            f"min_lr must be in [0, initial_lr={initial_lr}]; got {min_lr}",
        )
        self.min_lr = float(min_lr)
        self._decay_steps = max(1, self.total_step_count - self.warmup_step_count)
        super().__init__(optimizer, initial_lr)

    def remaining(self, step: int) -> float:
        r"""The fraction :math:`f_t \in [0, 1]` of the rate above ``min_lr`` left at a step
        :math:`t \ge w`."""
        raise NotImplementedError

    def lr_at(self, step: int) -> float:
        if step < self.warmup_step_count:
            return self.initial_lr * step / self.warmup_step_count
        return self.min_lr + (self.initial_lr - self.min_lr) * self.remaining(step)


class LinearLRScheduler(_WarmupDecay):
    r"""Linear warmup from 0 to ``initial_lr``, then linear decay to ``min_lr`` (default 0).

    .. math::
        \eta_t = \begin{cases} \eta_0\, t / w & t < w \\
                 \eta_{\min} + (\eta_0 - \eta_{\min})
                 \max\big(0, \frac{T - t}{\max(1, T - w)}\big) & t \ge w \end{cases}

    with :math:`w` = ``warmup_step_count`` and :math:`T` = ``total_step_count``. The names are
    those of ``onnxruntime.training.api.LinearLRScheduler`` (which decays to 0);
    onnxruntime-training 1.19.2 swaps the warmup and total step counts internally, while this
    scheduler applies them as named.
    """

    def remaining(self, step: int) -> float:
        return max(0.0, (self.total_step_count - step) / self._decay_steps)


class CosineLRScheduler(_WarmupDecay):
    r"""Linear warmup from 0 to ``initial_lr``, then cosine decay to ``min_lr``.

    .. math::
        \eta_t = \begin{cases} \eta_0\, t / w & t < w \\
                 \eta_{\min} + \tfrac12(\eta_0 - \eta_{\min})(1 + \cos \pi p_t) & t \ge w
                 \end{cases}, \quad p_t = \min\Big(1, \frac{t - w}{\max(1, T - w)}\Big)

    The rate stays at ``min_lr`` after step :math:`T`.
    """

    def remaining(self, step: int) -> float:
        progress = min(1.0, (step - self.warmup_step_count) / self._decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class StepLRScheduler(LRScheduler):
    r"""Multiply the rate by ``gamma`` every ``step_size`` steps, as ``torch``'s ``StepLR``.

    :math:`\eta_t = \eta_0\, \gamma^{\lfloor t / s \rfloor}`.

    Args:
        optimizer: Any object with ``set_learning_rate(lr)`` and ``get_learning_rate()``.
        step_size: Steps :math:`s \ge 1` between decays.
        gamma: The decay factor :math:`\gamma > 0`.
        initial_lr: The initial learning rate :math:`\eta_0`.
    """

    def __init__(
        self, optimizer: LearningRateSetter, step_size: int, gamma: float, initial_lr: float
    ) -> None:
        name = type(self).__name__
        self.step_size = _count(name, "step_size", step_size, 1)
        _require(name, gamma > 0, f"gamma must be positive; got {gamma}")
        self.gamma = float(gamma)
        super().__init__(optimizer, initial_lr)

    def lr_at(self, step: int) -> float:
        return self.initial_lr * self.gamma ** (step // self.step_size)


class ExponentialLRScheduler(LRScheduler):
    r"""Multiply the rate by ``gamma`` every step, as ``torch``'s ``ExponentialLR``.

    :math:`\eta_t = \eta_0\, \gamma^t`.

    Args:
        optimizer: Any object with ``set_learning_rate(lr)`` and ``get_learning_rate()``.
        gamma: The decay factor :math:`\gamma > 0`.
        initial_lr: The initial learning rate :math:`\eta_0`.
    """

    def __init__(self, optimizer: LearningRateSetter, gamma: float, initial_lr: float) -> None:
        _require(type(self).__name__, gamma > 0, f"gamma must be positive; got {gamma}")
        self.gamma = float(gamma)
        super().__init__(optimizer, initial_lr)

    def lr_at(self, step: int) -> float:
        return self.initial_lr * self.gamma**step


class ConstantLRScheduler(LRScheduler):
    r"""A constant rate: :math:`\eta_t = \eta_0`.

    Args:
        optimizer: Any object with ``set_learning_rate(lr)`` and ``get_learning_rate()``.
        initial_lr: The learning rate :math:`\eta_0`.
    """

    def lr_at(self, step: int) -> float:
        return self.initial_lr


__all__ = [
    "ConstantLRScheduler",
    "CosineLRScheduler",
    "ExponentialLRScheduler",
    "LRScheduler",
    "LearningRateSetter",
    "LinearLRScheduler",
    "StepLRScheduler",
]
