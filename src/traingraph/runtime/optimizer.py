"""One optimizer update over a :class:`~traingraph.runtime.state.TrainingState`."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from traingraph.runtime.session import BoundRunner
from traingraph.runtime.state import TrainingState


def optimizer_step(runner: BoundRunner, state: TrainingState) -> None:
    """Run the optimizer graph once: read the current parameters, gradients and slots, write
    the other copies, swap, and count the step.

    The graph's inputs are ``learning_rate``, ``step`` (1-based), each trainable parameter
    ``p``, ``p_grad`` and each slot; its outputs ``p_out`` and ``<slot>_out``.
    """
    slots = state.optimizer_slots
    assert slots is not None and state.learning_rate is not None
    runner.bind_input("learning_rate", np.array(state.learning_rate, dtype=np.float32))
    runner.bind_input("step", np.array(state.step + 1, dtype=np.int64))
    outputs: dict[str, ort.OrtValue | None] = {}
    for name in state.grads:
        runner.bind_input(name, state.trainable.cur.ortvalue(name))
        runner.bind_input(f"{name}_grad", state.grads.ortvalue(name))
        outputs[f"{name}_out"] = state.trainable.alt.ortvalue(name)
    for name in slots.cur:
        runner.bind_input(name, slots.cur.ortvalue(name))
        outputs[f"{name}_out"] = slots.alt.ortvalue(name)
    runner.run(outputs)
    state.trainable.swap()
    slots.swap()
    state.step += 1
