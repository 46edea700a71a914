"""The training state on a device: parameters, buffers, gradients and optimizer slots."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import numpy as np
import onnxruntime as ort

from traingraph.checkpoint import CheckpointData
from traingraph.errors import ModelError
from traingraph.runtime.amp import DeviceCounters, Mirrored
from traingraph.runtime.device import Device
from traingraph.runtime.tensors import PingPong, TensorStore


class TrainingState:
    """Everything a training loop keeps between steps, resident on ``device``.

    Trainable parameters, updated buffers (BatchNorm running statistics) and optimizer slots
    are double-buffered (:class:`PingPong`): a graph reads the current copy and writes the other,
    then the two swap, so nothing is allocated or copied per step. The second copy is allocated
    when a graph first writes it: the fused CPU update writes the first in place and holds none.
    """

    step = Mirrored(int)
    """The number of optimizer steps applied."""

    def __init__(
        self, data: CheckpointData, device: Device, buffers: AbstractSet[str] = frozenset()
    ) -> None:
        self.device = device
        self.names = list(data.parameters)
        self.requires_grad = dict(data.requires_grad)
        specs = {n: (tuple(a.shape), a.dtype) for n, a in data.parameters.items()}
        trainable = {n: s for n, s in specs.items() if self.requires_grad.get(n, False)}
        updated = {n: s for n, s in specs.items() if n in buffers and n not in trainable}
        fixed = {n: s for n, s in specs.items() if n not in trainable and n not in updated}
        values = dict(data.parameters)
        self.trainable = PingPong(TensorStore(device, trainable, _pick(values, trainable)))
        self.buffers = PingPong(TensorStore(device, updated, _pick(values, updated)))
        self.fixed = TensorStore(device, fixed, _pick(values, fixed))
        self.grads = TensorStore(device, trainable)
        self.grad_scratch: TensorStore | None = None
        self.grads_valid = False  # gradients hold something (a train step has run)
        self.reset_grads_pending = True  # the next train step overwrites instead of adding
        self.optimizer_slots: PingPong | None = None
        self.pending_slot_values = dict(_flatten_slots(data.optimizer_state))
        # Set while a device keeps the step count (a captured CUDA-graph step with a loss
        # scaler, :class:`~traingraph.runtime.amp.DeviceCounters`).
        self.counters: DeviceCounters | None = None
        self.step = data.optimizer_step
        self.learning_rate = data.learning_rate
        self.unloaded = set(self.names) if data.nominal else set()

    def mirror_step(self, value: int) -> None:
        """Set the host copy of the step count to what the device holds."""
        self._step = value

    # ------------------------------------------------------------------ lookup
    def store_of(self, name: str) -> TensorStore:
        for store in (self.trainable.cur, self.buffers.cur, self.fixed):
            if name in store:
                return store
        raise KeyError(name)

    def ortvalue(self, name: str) -> ort.OrtValue:
        return self.store_of(name).ortvalue(name)

    def read(self, name: str) -> np.ndarray:
        return self.store_of(name).read(name)

    def write(self, name: str, value: np.ndarray) -> None:
        self.store_of(name).write(name, value)
        self.unloaded.discard(name)

    def read_grad(self, name: str) -> np.ndarray | None:
        if name not in self.grads or not self.grads_valid:
            return None
        return self.grads.read(name)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the device memory the state has allocated, by block: ``"parameters"``,
        ``"buffers"``, ``"fixed"``, ``"gradients"``, ``"gradient_scratch"`` (the step's own
        gradients while others accumulate) and ``"optimizer_slots"``; a double-buffered block
        counts its second copy once a graph has written it (an update in place never does)."""
        slots = self.optimizer_slots
        held = {
            "parameters": self.trainable.allocated,
            "buffers": self.buffers.allocated,
            "fixed": [self.fixed],
            "gradients": [self.grads],
            "gradient_scratch": [] if self.grad_scratch is None else [self.grad_scratch],
            "optimizer_slots": [] if slots is None else slots.allocated,
        }
        return {name: sum(s.allocated_bytes for s in stores) for name, stores in held.items()}

    # ----------------------------------------------------------- contiguity
    def contiguous(self, trainable_only: bool) -> np.ndarray:
        """The parameters as one flat host buffer, in checkpoint order."""
        if trainable_only:
            return self.trainable.cur.read_flat()
        if not self.names:
            return np.zeros(0, np.float32)
        return np.concatenate([self.read(n).reshape(-1) for n in self.names])

    def parameters_size(self, trainable_only: bool) -> int:
        return sum(
            int(np.prod(self.store_of(n).specs[n][0]))
            for n in self.names
            if self.requires_grad.get(n) or not trainable_only
        )

    def load_contiguous(self, buffer: np.ndarray, trainable_only: bool) -> None:
        if trainable_only:
            self.trainable.cur.write_flat(buffer)
            self.unloaded -= set(self.trainable.cur)
            return
        expected = self.parameters_size(False)
        flat = np.asarray(buffer).reshape(-1)
        if flat.size != expected:
            raise ModelError(
                f"the buffer holds {flat.size} elements, but all parameters need {expected};"
                " get the expected size from get_parameters_size(trainable_only=False)"
            )
        offset = 0
        for name in self.names:
            shape = self.store_of(name).specs[name][0]
            n = int(np.prod(shape))
            self.write(name, flat[offset : offset + n].reshape(shape))
            offset += n

    # ----------------------------------------------------------- checkpoint
    def to_checkpoint_data(
        self, properties: Mapping[str, int | float | str], include_optimizer_state: bool
    ) -> CheckpointData:
        optimizer_state: dict[str, dict[str, np.ndarray]] = {}
        if include_optimizer_state:
            if self.optimizer_slots is not None:
                for slot in self.optimizer_slots.cur:
                    param, key = self.slot_owner(slot)
                    optimizer_state.setdefault(param, {})[key] = self.optimizer_slots.cur.read(slot)
            else:
                for slot, value in self.pending_slot_values.items():
                    param, key = self.slot_owner(slot)
                    optimizer_state.setdefault(param, {})[key] = value
        return CheckpointData(
            parameters={n: self.read(n) for n in self.names},
            requires_grad=dict(self.requires_grad),
            optimizer_state=optimizer_state,
            optimizer_step=self.step,
            learning_rate=self.learning_rate,
            properties=dict(properties),
            nominal=bool(self.unloaded),
        )

    def slot_owner(self, slot: str) -> tuple[str, str]:
        """``"fc.weight.exp_avg"`` -> ``("fc.weight", "exp_avg")`` (longest parameter prefix)."""
        names = set(self.names)
        cut = slot.rfind(".")
        while cut > 0 and slot[:cut] not in names:  # the longest prefix first
            cut = slot.rfind(".", 0, cut)
        if cut <= 0:
            return slot.rsplit(".", 1)[0], slot.rsplit(".", 1)[-1]
        return slot[:cut], slot[cut + 1 :]


def _pick(values: Mapping[str, np.ndarray], names: Mapping[str, object]) -> dict[str, np.ndarray]:
    return {n: values[n] for n in names}


def _flatten_slots(state: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {
        f"{param}.{key}": value for param, slots in state.items() for key, value in slots.items()
    }
