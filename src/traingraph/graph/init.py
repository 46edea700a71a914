r"""Seeded weight initializers with ``torch.nn.init``'s distributions.

An initializer is a callable ``init(shape, rng, dtype) -> array``. Fans follow torch: for a
weight of shape ``(out, in, *kernel)``, :math:`\mathrm{fan\_in} = \mathrm{in} \cdot \prod
\mathrm{kernel}` and :math:`\mathrm{fan\_out} = \mathrm{out} \cdot \prod \mathrm{kernel}`.

- Glorot (Xavier) uniform: :math:`U(-a, a)`, :math:`a = g\sqrt{6 / (\mathrm{fan\_in} +
  \mathrm{fan\_out})}`; Glorot normal: :math:`N(0, g^2 \cdot 2 / (\mathrm{fan\_in} +
  \mathrm{fan\_out}))`.
- Kaiming (He) uniform: :math:`U(-b, b)`, :math:`b = g\sqrt{3 / \mathrm{fan}}`; Kaiming normal:
  :math:`N(0, g^2 / \mathrm{fan})`, with the gain :math:`g` of :func:`calculate_gain`.

Layers draw from :func:`generator`: a layer's own ``seed`` when given, else the module's
generator, which :func:`manual_seed` resets (seed 0 at import), so a script that builds the same
layers in the same order gets the same weights.

Example:
    >>> manual_seed(0)
    >>> w = kaiming_uniform(a=5 ** 0.5)((8, 4), generator())   # torch.nn.Linear's default
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "Initializer",
    "calculate_fans",
    "calculate_gain",
    "constant",
    "generator",
    "glorot_normal",
    "glorot_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "manual_seed",
    "normal",
    "ones",
    "uniform",
    "zeros",
]

Initializer = Callable[..., np.ndarray]

_global = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Reset the generator that layers without their own ``seed`` draw from."""
    global _global
    _global = np.random.default_rng(seed)


def generator(seed: int | None = None) -> np.random.Generator:
    """A generator for ``seed``, or the module's shared generator when ``seed`` is None."""
    return _global if seed is None else np.random.default_rng(seed)


def calculate_fans(shape: Sequence[int]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight, as ``torch.nn.init._calculate_fan_in_and_fan_out``."""
    if len(shape) < 2:
        raise ValueError(
            f"fans need a weight of rank 2 or more (out, in, *kernel); got shape {list(shape)}"
        )
    receptive = math.prod(shape[2:])
    return int(shape[1]) * receptive, int(shape[0]) * receptive


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The gain torch recommends for ``nonlinearity`` (``torch.nn.init.calculate_gain``)."""
    linear = ("linear", "identity", "sigmoid", "conv1d", "conv2d", "conv3d", "conv_transpose2d")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    known = [*linear, "tanh", "relu", "leaky_relu", "selu"]
    raise ValueError(f"unknown nonlinearity {nonlinearity!r}; expected one of {known}")


def _fan(shape: Sequence[int], mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out'; got {mode!r}")
    fan_in, fan_out = calculate_fans(shape)
    return fan_in if mode == "fan_in" else fan_out


@dataclass(frozen=True)
class _Sample:
    """Draws of the ``numpy.random.Generator`` method ``method`` at ``args``, cast to ``dtype``."""

    method: str
    args: tuple[float, ...]

    def __call__(
        self, shape: Sequence[int], rng: np.random.Generator, dtype: npt.DTypeLike = np.float32
    ) -> np.ndarray:
        draw = getattr(rng, self.method)
        return draw(*self.args, size=tuple(shape)).astype(dtype)


def uniform(low: float = 0.0, high: float = 1.0) -> Initializer:
    """:math:`U(\\mathrm{low}, \\mathrm{high})`, as ``torch.nn.init.uniform_``."""
    return _Sample("uniform", (low, high))


def normal(mean: float = 0.0, std: float = 1.0) -> Initializer:
    """:math:`N(\\mathrm{mean}, \\mathrm{std}^2)`, as ``torch.nn.init.normal_``."""
    return _Sample("normal", (mean, std))


@dataclass(frozen=True)
class constant:  # noqa: N801 - used like a function, as torch.nn.init.constant_
    """Every element equals ``value``."""

    value: float = 0.0

    def __call__(
        self, shape: Sequence[int], rng: np.random.Generator, dtype: npt.DTypeLike = np.float32
    ) -> np.ndarray:
        return np.full(tuple(shape), self.value, dtype=dtype)


def zeros() -> constant:
    """All zeros."""
    return constant(0.0)


def ones() -> constant:
    """All ones."""
    return constant(1.0)


@dataclass(frozen=True)
class _FanScaled:
    """An initializer whose distribution depends on the weight's fans."""

    def _distribution(self, shape: Sequence[int]) -> Initializer:
        raise NotImplementedError

    def __call__(
        self, shape: Sequence[int], rng: np.random.Generator, dtype: npt.DTypeLike = np.float32
    ) -> np.ndarray:
        return self._distribution(shape)(shape, rng, dtype)


@dataclass(frozen=True)
class _Glorot(_FanScaled):
    gain: float = 1.0


@dataclass(frozen=True)
class _Kaiming(_FanScaled):
    a: float = 0.0
    mode: str = "fan_in"
    nonlinearity: str = "leaky_relu"


class glorot_uniform(_Glorot):  # noqa: N801 - used like a function, as torch.nn.init.xavier_uniform_
    """Glorot (Xavier) uniform initialization with gain ``gain``."""

    def _distribution(self, shape: Sequence[int]) -> Initializer:
        fan_in, fan_out = calculate_fans(shape)
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        return uniform(-bound, bound)


class glorot_normal(_Glorot):  # noqa: N801 - used like a function, as torch.nn.init.xavier_normal_
    """Glorot (Xavier) normal initialization with gain ``gain``."""

    def _distribution(self, shape: Sequence[int]) -> Initializer:
        fan_in, fan_out = calculate_fans(shape)
        return normal(0.0, self.gain * math.sqrt(2.0 / (fan_in + fan_out)))


class kaiming_uniform(_Kaiming):  # noqa: N801 - used like a function, as torch.nn.init.kaiming_uniform_
    """Kaiming (He) uniform initialization; ``a`` is the negative slope for leaky_relu."""

    def _distribution(self, shape: Sequence[int]) -> Initializer:
        gain = calculate_gain(self.nonlinearity, self.a)
        bound = gain * math.sqrt(3.0 / _fan(shape, self.mode))
        return uniform(-bound, bound)


class kaiming_normal(_Kaiming):  # noqa: N801 - used like a function, as torch.nn.init.kaiming_normal_
    """Kaiming (He) normal initialization; ``a`` is the negative slope for leaky_relu."""

    def _distribution(self, shape: Sequence[int]) -> Initializer:
        gain = calculate_gain(self.nonlinearity, self.a)
        return normal(0.0, gain / math.sqrt(_fan(shape, self.mode)))
