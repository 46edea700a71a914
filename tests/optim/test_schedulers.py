"""Learning-rate schedulers against torch.optim.lr_scheduler over 30 steps, and edge cases."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler

from traingraph.optim import (
    ConstantLRScheduler,
    CosineLRScheduler,
    ExponentialLRScheduler,
    LinearLRScheduler,
    LRScheduler,
    StepLRScheduler,
)

STEPS = 30
LR = 0.1


class Recorder:
    """Stands for an optimizer: it records every learning rate set."""

    def __init__(self) -> None:
        self.lr = float("nan")
        self.history: list[float] = []

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        self.history.append(lr)

    def get_learning_rate(self) -> float:
        return self.lr


def torch_rates(make: Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]) -> list[float]:
    """The learning rates of a torch scheduler at steps 0..STEPS."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    scheduler = make(optimizer)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


def our_rates(make: Callable[[Recorder], LRScheduler]) -> tuple[list[float], LRScheduler, Recorder]:
    recorder = Recorder()
    scheduler = make(recorder)
    rates = [scheduler.get_last_lr()]
    for _ in range(STEPS):
        scheduler.step()
        rates.append(scheduler.get_last_lr())
    assert recorder.history == rates
    assert [scheduler.lr_at(s) for s in range(STEPS + 1)] == rates
    return rates, scheduler, recorder


def linear_factor(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


@pytest.mark.parametrize(("warmup", "total"), [(5, 20), (0, 25), (10, 10), (3, 40)])
def test_linear_matches_lambda_lr(warmup: int, total: int) -> None:
    rates, _, _ = our_rates(lambda o: LinearLRScheduler(o, warmup, total, LR))
    expected = torch_rates(lambda o: lr_scheduler.LambdaLR(o, linear_factor(warmup, total)))
    np.testing.assert_allclose(rates, expected, rtol=1e-12)


def test_linear_shape() -> None:
    s = LinearLRScheduler(Recorder(), warmup_step_count=4, total_step_count=12, initial_lr=1.0)
    assert [s.lr_at(t) for t in (0, 2, 4, 8, 12, 13)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    no_warmup = LinearLRScheduler(Recorder(), 0, 10, initial_lr=1.0)
    assert no_warmup.get_last_lr() == 1.0


@pytest.mark.parametrize(
    ("warmup", "total", "min_lr"), [(5, 30, 0.0), (0, 30, 0.01), (8, 25, 0.02)]
)
def test_cosine_matches_warmup_then_cosine_annealing(
    warmup: int, total: int, min_lr: float
) -> None:
    rates, scheduler, _ = our_rates(lambda o: CosineLRScheduler(o, warmup, total, LR, min_lr))

    def reference(o: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        cosine = lr_scheduler.CosineAnnealingLR(o, T_max=total - warmup, eta_min=min_lr)
        if warmup == 0:
            return cosine
        ramp = lr_scheduler.LambdaLR(o, lambda s: s / warmup)
        return lr_scheduler.SequentialLR(o, [ramp, cosine], milestones=[warmup])

    expected = torch_rates(reference)
    # torch's cosine is periodic: past total_step_count it rises again, ours stays at min_lr.
    np.testing.assert_allclose(rates[: total + 1], expected[: total + 1], rtol=1e-10, atol=1e-15)
    assert rates[total:] == [min_lr] * (STEPS + 1 - total)
    assert scheduler.lr_at(total + 100) == min_lr


def test_cosine_midpoint_and_total_equal_to_warmup() -> None:
    s = CosineLRScheduler(Recorder(), 0, 10, initial_lr=1.0, min_lr=0.2)
    assert math.isclose(s.lr_at(5), 0.6)
    flat = CosineLRScheduler(Recorder(), 4, 4, initial_lr=1.0, min_lr=0.1)
    assert [flat.lr_at(t) for t in (0, 2, 4, 5)] == [0.0, 0.5, 1.0, 0.1]


@pytest.mark.parametrize(("step_size", "gamma"), [(1, 0.9), (7, 0.5), (10, 1.5)])
def test_step_matches_step_lr(step_size: int, gamma: float) -> None:
    rates, _, _ = our_rates(lambda o: StepLRScheduler(o, step_size, gamma, LR))
    expected = torch_rates(lambda o: lr_scheduler.StepLR(o, step_size, gamma))
    np.testing.assert_allclose(rates, expected, rtol=1e-12)


@pytest.mark.parametrize("gamma", [0.9, 0.5, 1.02])
def test_exponential_matches_exponential_lr(gamma: float) -> None:
    rates, _, _ = our_rates(lambda o: ExponentialLRScheduler(o, gamma, LR))
    expected = torch_rates(lambda o: lr_scheduler.ExponentialLR(o, gamma))
    np.testing.assert_allclose(rates, expected, rtol=1e-12)


def test_constant_matches_lambda_lr() -> None:
    rates, _, recorder = our_rates(lambda o: ConstantLRScheduler(o, LR))
    expected = torch_rates(lambda o: lr_scheduler.LambdaLR(o, lambda s: 1.0))
    assert rates == expected
    assert recorder.get_learning_rate() == LR


def test_construction_sets_the_first_rate() -> None:
    recorder = Recorder()
    StepLRScheduler(recorder, step_size=2, gamma=0.5, initial_lr=0.4)
    assert recorder.history == [0.4]
    LinearLRScheduler(recorder, warmup_step_count=3, total_step_count=9, initial_lr=0.4)
    assert recorder.history == [0.4, 0.0]


def test_numpy_ints_are_accepted() -> None:
    s = LinearLRScheduler(Recorder(), np.int64(2), np.int64(4), 1.0)
    assert s.lr_at(1) == 0.5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda o: LinearLRScheduler(o, -1, 10, LR), "warmup_step_count must be a non-negative"),
        (lambda o: LinearLRScheduler(o, 2.5, 10, LR), "warmup_step_count must be a non-negative"),
        (lambda o: LinearLRScheduler(o, 0, 0, LR), "total_step_count must be a positive int"),
        (lambda o: LinearLRScheduler(o, 10, 5, LR), r"total_step_count \(5\) must be at least"),
        (lambda o: LinearLRScheduler(o, 1, 5, -0.1), "initial_lr must be non-negative"),
        (lambda o: CosineLRScheduler(o, 12, 5, LR), r"total_step_count \(5\) must be at least"),
        (lambda o: CosineLRScheduler(o, 1, 5, LR, min_lr=0.5), r"min_lr must be in \[0, initial"),
        (lambda o: StepLRScheduler(o, 0, 0.5, LR), "step_size must be a positive int"),
        (lambda o: StepLRScheduler(o, 2, 0.0, LR), "gamma must be positive"),
        (lambda o: ExponentialLRScheduler(o, -0.5, LR), "gamma must be positive"),
    ],
)
def test_invalid_arguments(make: Callable[[Recorder], LRScheduler], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(Recorder())


def test_optimizer_without_learning_rate_methods() -> None:
    with pytest.raises(TypeError, match=r"must have a set_learning_rate\(\) method; got .* object"):
        ConstantLRScheduler(object(), LR)
