"""Dynamic loss scaling for mixed-precision training (see :mod:`traingraph.precision`).

The training graph of a mixed-precision model takes the loss scale ``S`` as an input and
returns its gradients already divided by ``S``, with a flag that says whether they are all
finite. :class:`DynamicLossScaler` picks ``S`` the way ``torch.amp.GradScaler`` does: a
non-finite step is skipped and halves ``S``; every ``growth_interval`` finite steps in a row
double it.

A captured CUDA-graph step decides on the GPU instead (:func:`device_update_nodes`): the
scale, its counters and the optimizer's step count are tensors that the step's own graph
updates, so no step waits for the host to read the finite flag. The host copies
(:class:`DynamicLossScaler`'s attributes, the training state's ``step``) read them back when
they are read (:class:`DeviceCounters`).

Example:
    >>> scaler = DynamicLossScaler()
    >>> scaler.update(finite=False)  # skip this step
    False
    >>> scaler.scale
    32768.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, overload

import numpy as np
from onnx import NodeProto, TensorProto, helper

from traingraph.precision import LOSS_SCALE

__all__ = [
    "COUNTERS",
    "GOOD_STEPS",
    "SKIPPED_STEPS",
    "STEP_COUNT",
    "DeviceCounters",
    "DynamicLossScaler",
    "Mirrored",
    "device_update_nodes",
]

_T = TypeVar("_T", int, float)

GOOD_STEPS = "loss_scale.good_steps"
SKIPPED_STEPS = "loss_scale.skipped_steps"
STEP_COUNT = "optimizer_step_count"

COUNTERS: dict[str, tuple[tuple[int, ...], np.dtype]] = {
    LOSS_SCALE: ((), np.dtype(np.float32)),
    GOOD_STEPS: ((), np.dtype(np.float32)),
    SKIPPED_STEPS: ((), np.dtype(np.float32)),
    STEP_COUNT: ((), np.dtype(np.int64)),
}
"""The scalars a device-side scaler keeps: the scale and its two counters (float32: exact up
to 2**24 steps) and the number of applied optimizer steps (the optimizer reads one more)."""


class DeviceCounters(Protocol):
    """Counters a device updates between host reads (a captured CUDA-graph step keeps the
    loss scale and the step count on the GPU): the host objects that mirror them ask it to
    :meth:`pull` before a read and tell it through :meth:`host_changed` after a write."""

    def pull(self) -> None:
        """Bring the host copies up to date (reads the device, so waits for it)."""

    def host_changed(self) -> None:
        """The host copies were set; the device takes them before its next step."""


class Mirrored(Generic[_T]):
    """An attribute whose value a device may hold, through its owner's ``counters`` (a
    :class:`DeviceCounters` or None): a read pulls the device's value first, a write tells the
    device that the host's is newer. The value is kept in ``_<name>``, where the counters write
    what they pull."""

    def __init__(self, kind: Callable[[Any], _T]) -> None:
        self.kind: Callable[[Any], _T] = kind
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Mirrored[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object, owner: type | None = None) -> Mirrored[_T] | _T:
        if obj is None:
            return self
        counters: DeviceCounters | None = getattr(obj, "counters", None)
        if counters is not None:
            counters.pull()
        return getattr(obj, self.slot)  # type: ignore[no-any-return]

    def __set__(self, obj: object, value: _T) -> None:
        counters: DeviceCounters | None = getattr(obj, "counters", None)
        if counters is not None:
            counters.pull()
        setattr(obj, self.slot, self.kind(value))
        if counters is not None:
            counters.host_changed()


class DynamicLossScaler:
    """The loss scale and its update rule.

    Attributes:
        scale: The current loss scale ``S`` (PyTorch's default start: 2**16).
        growth_factor: ``S`` is multiplied by this after ``growth_interval`` finite steps.
        backoff_factor: ``S`` is multiplied by this after a non-finite step.
        growth_interval: Finite steps in a row before ``S`` grows.
        good_steps: Finite steps since the last change of ``S``.
        skipped_steps: Non-finite steps so far (their updates were skipped).
        counters: Where ``scale``, ``good_steps`` and ``skipped_steps`` live when a device
            updates them (:class:`DeviceCounters`); None while the host does.
    """

    def __init__(
        self,
        scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        good_steps: int = 0,
        skipped_steps: int = 0,
    ) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.counters: DeviceCounters | None = None
        self.scale = scale
        self.good_steps = good_steps
        self.skipped_steps = skipped_steps

    scale = Mirrored(float)
    good_steps = Mirrored(int)
    skipped_steps = Mirrored(int)

    def mirror(self, scale: float, good_steps: int, skipped_steps: int) -> None:
        """Set the host copies to what the device holds (for :class:`DeviceCounters`)."""
        self._scale, self._good_steps, self._skipped_steps = scale, good_steps, skipped_steps

    def update(self, finite: bool) -> bool:
        """Account for one step whose gradients were ``finite`` (or not).

        Returns:
            Whether the optimizer should apply this step.
        """
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale!r}, growth_factor={self.growth_factor!r},"
            f" backoff_factor={self.backoff_factor!r}, growth_interval={self.growth_interval!r},"
            f" good_steps={self.good_steps!r}, skipped_steps={self.skipped_steps!r})"
        )


def device_update_nodes(
    scaler: DynamicLossScaler, finite: str, prefix: str
) -> tuple[list[NodeProto], list[TensorProto]]:
    """The nodes and constants that apply :meth:`DynamicLossScaler.update` to the tensors of
    :data:`COUNTERS`, given the boolean scalar ``finite``: each ``<name>`` input has the
    output ``<name>_out`` (the step count counts the step where it is finite). Their
    intermediate names start with ``prefix``. The scale is multiplied in float32, so a factor
    that is not a power of two rounds as float32 does (the host multiplies in float64)."""
    p = prefix

    def const(name: str, value: float) -> TensorProto:
        return helper.make_tensor(f"{p}{name}", TensorProto.FLOAT, [], [value])

    constants = [
        const("one", 1.0),
        const("zero", 0.0),
        const("interval", float(scaler.growth_interval)),
        const("growth", scaler.growth_factor),
        const("backoff", scaler.backoff_factor),
    ]
    nodes = [
        helper.make_node("Add", [GOOD_STEPS, f"{p}one"], [f"{p}good1"]),
        helper.make_node("GreaterOrEqual", [f"{p}good1", f"{p}interval"], [f"{p}due"]),
        helper.make_node("And", [finite, f"{p}due"], [f"{p}grow"]),
        helper.make_node("Mul", [LOSS_SCALE, f"{p}growth"], [f"{p}grown"]),
        helper.make_node("Mul", [LOSS_SCALE, f"{p}backoff"], [f"{p}backed"]),
        helper.make_node("Where", [f"{p}grow", f"{p}grown", LOSS_SCALE], [f"{p}kept"]),
        helper.make_node("Where", [finite, f"{p}kept", f"{p}backed"], [f"{LOSS_SCALE}_out"]),
        helper.make_node("Where", [f"{p}grow", f"{p}zero", f"{p}good1"], [f"{p}counted"]),
        helper.make_node("Where", [finite, f"{p}counted", f"{p}zero"], [f"{GOOD_STEPS}_out"]),
        helper.make_node("Not", [finite], [f"{p}skip"]),
        helper.make_node("Cast", [f"{p}skip"], [f"{p}skip_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", [SKIPPED_STEPS, f"{p}skip_f"], [f"{SKIPPED_STEPS}_out"]),
        helper.make_node("Cast", [finite], [f"{p}applied"], to=TensorProto.INT64),
        helper.make_node("Add", [STEP_COUNT, f"{p}applied"], [f"{STEP_COUNT}_out"]),
    ]
    return nodes, constants
