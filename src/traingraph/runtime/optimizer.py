"""One optimizer update over a :class:`~traingraph.runtime.state.TrainingState`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from traingraph.runtime.session import BoundRunner
from traingraph.runtime.state import TrainingState


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where an optimizer model over one flat vector finds its tensors in the state's blocks.

    The model updates a single parameter ``name`` of ``size`` elements: the trainable
    parameters' flat block (padding included), with the gradients' block as ``<name>_grad``
    and, for each slot kind, the range ``kinds[kind]`` of the slots' block as
    ``<name>.<kind>``.
    """

    name: str
    size: int
    kinds: Mapping[str, tuple[int, int]]


def flat_layout(
    state: TrainingState, params: list[str], slot_names: Mapping[str, Mapping[str, str]]
) -> dict[str, tuple[int, int]] | None:
    """Each slot kind's ``(start, stop)`` in the slots' flat block, when the slots of every kind
    lie like the trainable parameters in theirs (same order, shapes and padding) and the
    gradients do too; else None.

    Args:
        state: The training state, with its optimizer slots.
        params: The parameters the optimizer updates.
        slot_names: Parameter -> slot kind -> slot name.
    """
    slots, trainable = state.optimizer_slots, state.trainable.cur
    if slots is None or trainable.offsets is None or slots.cur.offsets is None:
        return None
    if sorted(trainable) != sorted(params) or state.grads.offsets != trainable.offsets:
        return None
    kinds = list(dict.fromkeys(k for keys in slot_names.values() for k in keys))
    dtypes = {d for _, d in trainable.specs.values()} | {d for _, d in slots.cur.specs.values()}
    if len(dtypes) > 1 or len(slots.cur) != len(kinds) * len(trainable):
        return None
    size = trainable.flat_size
    for i, kind in enumerate(kinds):
        for name, offset in trainable.offsets.items():
            slot = slot_names.get(name, {}).get(kind)
            if (
                slot is None
                or slots.cur.specs[slot][0] != trainable.specs[name][0]
                or slots.cur.offsets[slot] != i * size + offset
            ):
                return None
    return {kind: (i * size, (i + 1) * size) for i, kind in enumerate(kinds)}


def optimizer_io(
    state: TrainingState, flat: FlatLayout | None
) -> tuple[dict[str, ort.OrtValue], dict[str, ort.OrtValue]]:
    """The optimizer model's tensor inputs and outputs (all but ``learning_rate`` and
    ``step``) bound to the state: the current parameters, gradients and slots in, the other
    copies out. Per parameter, or as blocks for a model over the flat vector ``flat``."""
    slots = state.optimizer_slots
    assert slots is not None
    cur, alt = state.trainable.cur, state.trainable.alt
    if flat is not None:
        n = flat.size
        inputs = {flat.name: cur.block(0, n), f"{flat.name}_grad": state.grads.block(0, n)}
        outputs = {f"{flat.name}_out": alt.block(0, n)}
        for kind, (start, stop) in flat.kinds.items():
            inputs[f"{flat.name}.{kind}"] = slots.cur.block(start, stop)
            outputs[f"{flat.name}.{kind}_out"] = slots.alt.block(start, stop)
        return inputs, outputs
    inputs, outputs = {}, {}
    for name in state.grads:
        inputs[name] = cur.ortvalue(name)
        inputs[f"{name}_grad"] = state.grads.ortvalue(name)
        outputs[f"{name}_out"] = alt.ortvalue(name)
    for name in slots.cur:
        inputs[name] = slots.cur.ortvalue(name)
        outputs[f"{name}_out"] = slots.alt.ortvalue(name)
    return inputs, outputs


def optimizer_step(runner: BoundRunner, state: TrainingState, flat: FlatLayout | None) -> None:
    """Run the optimizer graph once: read the current parameters, gradients and slots, write
    the other copies, swap, and count the step.

    The graph's inputs are ``learning_rate``, ``step`` (1-based) and those of
    :func:`optimizer_io`; its outputs ``p_out`` and ``<slot>_out``.
    """
    slots = state.optimizer_slots
    assert slots is not None and state.learning_rate is not None
    runner.bind_input("learning_rate", np.array(state.learning_rate, dtype=np.float32))
    runner.bind_input("step", np.array(state.step + 1, dtype=np.int64))
    inputs, outputs = optimizer_io(state, flat)
    for name, value in inputs.items():
        runner.bind_input(name, value)
    runner.run(dict(outputs))
    state.trainable.swap()
    slots.swap()
    state.step += 1
