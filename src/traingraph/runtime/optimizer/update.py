"""One optimizer update over a :class:`~traingraph.runtime.state.TrainingState`.

An optimizer has two forms: the portable optimizer graph (:mod:`traingraph.optim`, standard
ONNX ops, what the artifacts hold, the reference) and, for AdamW and SGD, a fused kernel that
computes the same numbers in place in one pass: native C on the CPU
(:mod:`traingraph.runtime.optimizer.fused`), CUDA compiled at run time on a GPU
(:mod:`traingraph.runtime.optimizer.device`). :class:`OptimizerUpdate` chooses between them,
in this one place: the fused kernel where it exists for the device (the extension was built;
the CUDA kernels compile, and the state lies in flat blocks) and takes the optimizer and the
dtypes, else the graph, run over all parameters at once (one flat vector) where the optimizer
allows it, else as the file holds it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from traingraph.errors import ModelError
from traingraph.optim import (
    ParamInfo,
    build_flat_optimizer_model,
    build_optimizer_model,
    flattenable,
    from_hyperparameters,
    state_slots,
)
from traingraph.runtime.optimizer.device import DeviceUpdate, device_update
from traingraph.runtime.optimizer.fused import DTYPES, FusedUpdate, fused_update
from traingraph.runtime.session import BoundRunner, SessionConfig, create_session
from traingraph.runtime.state import TrainingState
from traingraph.runtime.tensors import PingPong, TensorStore

FLAT_CHUNK = 1 << 22
"""Elements of the trainable parameters' flat block one chunk of a flat optimizer model
updates (16 MiB of float32). A GPU runs each elementwise op of the update as one kernel over a
chunk, so a chunk's temporaries are what the update holds beside its inputs and outputs: a
model over the whole block would hold several temporaries the size of all parameters, which a
memory arena grown around a training step's activations cannot place in the space they free."""


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where an optimizer model over the flat blocks finds its tensors in the state's blocks.

    The trainable parameters' flat block (``size`` elements, padding included) is updated in
    chunks of ``chunk`` elements (:attr:`chunks`), each a parameter of the model: chunk ``c``
    is the range ``[start, stop)`` of the block, with the same range of the gradients' block
    as ``<c>_grad`` and, for each slot kind, of the range ``kinds[kind]`` of the slots' block
    as ``<c>.<kind>``.
    """

    name: str
    size: int
    kinds: Mapping[str, tuple[int, int]]
    chunk: int = dataclasses.field(default_factory=lambda: FLAT_CHUNK)

    @property
    def chunks(self) -> list[tuple[str, int, int]]:
        """``(name, start, stop)`` of each chunk: ``name`` alone where one chunk holds all."""
        starts = range(0, self.size, self.chunk)
        if len(starts) <= 1:
            return [(self.name, 0, self.size)]
        stops = [min(s + self.chunk, self.size) for s in starts]
        return [(f"{self.name}_{i}", s, e) for i, (s, e) in enumerate(zip(starts, stops))]


@dataclasses.dataclass(frozen=True)
class InPlace:
    """Which double-buffered stores an optimizer graph writes in place: its new parameters over
    the current ones (``parameters``), its new slots over the current slots (``slots``). A
    store written in place is not swapped and never allocates its second copy."""

    parameters: bool = False
    slots: bool = False


# Ops that read each element of an operand shaped like their output at the index they write, so
# that the output may be the operand's own buffer.
_SAME_INDEX = frozenset(
    {"Abs", "Add", "Div", "Max", "Min", "Mul", "Neg", "Reciprocal", "Sqrt", "Sub", "Sum", "Where"}
)


def overwritable(model: onnx.ModelProto, pairs: Mapping[str, str]) -> set[str]:
    """The inputs ``x`` of ``pairs`` (input -> the output holding its new value) whose new value
    may be written over ``x`` itself (no other input may be bound to the same memory).

    That holds where the node writing the output reads ``x``, if at all, as an elementwise op
    of ``x``'s shape (each element read before it is written), and every other node reading
    ``x`` is among that node's ancestors, so a runtime runs it before. A node that reads ``x``
    and does not lead to the output (a training graph's reader of a parameter whose update does
    not wait for it) keeps ``x`` from being overwritten.
    """
    graph = model.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output}
    readers: dict[str, set[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, set()).add(i)
    shapes = {
        v.name: tuple(d.dim_value if d.HasField("dim_value") else None for d in shape.dim)
        for v in (*graph.input, *graph.output)
        if (shape := v.type.tensor_type.shape) is not None
    }
    found = set()
    for x, out in pairs.items():
        w = producer.get(out)
        if w is None:
            continue
        writer = graph.node[w]
        if x in writer.input and (
            writer.op_type not in _SAME_INDEX
            or writer.domain not in ("", "ai.onnx")
            or shapes.get(x) != shapes.get(out)
            or None in shapes.get(x, (None,))
        ):
            continue
        others = readers.get(x, set()) - {w}
        if others <= _ancestors(graph, w, producer, others):
            found.add(x)
    return found


def _ancestors(
    graph: onnx.GraphProto, node: int, producer: Mapping[str, int], wanted: set[int]
) -> set[int]:
    """The nodes ``node`` depends on, searched until every one of ``wanted`` is found."""
    seen: set[int] = set()
    stack = [node]
    while stack and not wanted <= seen:
        for name in graph.node[stack.pop()].input:
            i = producer.get(name)
            if i is not None and i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def writes_in_place(
    model: onnx.ModelProto, state: TrainingState, flat: FlatLayout | None
) -> InPlace:
    """Which of the state's stores the optimizer model ``model``, run on its own, may write in
    place: those whose every tensor is :func:`overwritable`."""
    _, outputs = optimizer_io(state, flat, InPlace(True, True))
    held = [name[: -len("_out")] for name in outputs]
    params = {n for n, _, _ in flat.chunks} if flat is not None else set(state.grads)
    ok = overwritable(model, {n: f"{n}_out" for n in held})
    return InPlace(
        parameters=all(n in ok for n in held if n in params),
        slots=all(n in ok for n in held if n not in params),
    )


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
    state: TrainingState, flat: FlatLayout | None, in_place: InPlace = InPlace()
) -> tuple[dict[str, ort.OrtValue], dict[str, ort.OrtValue]]:
    """The optimizer model's tensor inputs and outputs (all but ``learning_rate`` and
    ``step``) bound to the state: the current parameters, gradients and slots in, the other
    copies out (the current ones where ``in_place`` says so). Per parameter, or as blocks for a
    model over the flat blocks' chunks ``flat``."""
    slots = state.optimizer_slots
    assert slots is not None
    cur = state.trainable.cur
    alt = cur if in_place.parameters else state.trainable.alt
    new_slots = slots.cur if in_place.slots else slots.alt
    inputs, outputs = {}, {}
    if flat is not None:
        for name, start, stop in flat.chunks:
            inputs[name] = cur.block(start, stop)
            inputs[f"{name}_grad"] = state.grads.block(start, stop)
            outputs[f"{name}_out"] = alt.block(start, stop)
        for kind, (offset, _) in flat.kinds.items():
            for name, start, stop in flat.chunks:
                inputs[f"{name}.{kind}"] = slots.cur.block(offset + start, offset + stop)
                outputs[f"{name}.{kind}_out"] = new_slots.block(offset + start, offset + stop)
        return inputs, outputs
    for name in state.grads:
        inputs[name] = cur.ortvalue(name)
        inputs[f"{name}_grad"] = state.grads.ortvalue(name)
        outputs[f"{name}_out"] = alt.ortvalue(name)
    for name in slots.cur:
        inputs[name] = slots.cur.ortvalue(name)
        outputs[f"{name}_out"] = new_slots.ortvalue(name)
    return inputs, outputs


def optimizer_step(
    runner: BoundRunner, state: TrainingState, flat: FlatLayout | None, in_place: InPlace
) -> None:
    """Run the optimizer graph once: read the current parameters, gradients and slots, write
    the other copies and swap (or write them in place, as ``in_place`` says), and count the
    step.

    The graph's inputs are ``learning_rate``, ``step`` (1-based) and those of
    :func:`optimizer_io`; its outputs ``p_out`` and ``<slot>_out``.
    """
    slots = state.optimizer_slots
    assert slots is not None and state.learning_rate is not None
    runner.bind_input("learning_rate", np.array(state.learning_rate, dtype=np.float32))
    runner.bind_input("step", np.array(state.step + 1, dtype=np.int64))
    inputs, outputs = optimizer_io(state, flat, in_place)
    for name, value in inputs.items():
        runner.bind_input(name, value)
    runner.run(dict(outputs))
    if not in_place.parameters:
        state.trainable.swap()
    if not in_place.slots:
        slots.swap()
    state.step += 1


class OptimizerUpdate:
    """The optimizer update of a :class:`~traingraph.runtime.state.TrainingState`, in the form
    its device runs best (the module docstring says which).

    Creating it gives the state its optimizer slots (from the checkpoint's values where it has
    them, else the slots' initial values) and its learning rate (the model's, where the
    checkpoint has none).

    Args:
        model: The optimizer model (inputs ``learning_rate``, ``step``, the parameters,
            ``<parameter>_grad`` and the slots), or an onnxblock.optim model over tensor
            sequences whose metadata names a traingraph optimizer.
        state: The training state it updates.
        trainable: The parameters it updates, in the state's order.
        config: The settings of the session that runs the graph.
        fused: Update all parameters at once (fused kernel or flat graph); False runs ``model``
            as it is.
        threads: Threads of the fused kernel.
        where: How errors name the model (e.g. its path).

    Attributes:
        graph_model: The optimizer model the session runs: ``model``, or its flat equivalent.
        flat: How the flat graph binds the state's blocks; None where the graph runs per tensor
            (or the fused kernel runs).
        blocks: Slot kind -> its range in the slots' flat block, where a fused kernel (the
            CPU's or the CUDA one, :attr:`device_kernel`) updates the flat blocks at once; None
            where it runs per tensor (or the graph runs).
        in_place: Which stores the graph writes in place (:func:`writes_in_place`); none
            where a fused kernel runs, which updates them in place itself.
        clips_by_norm: Whether the optimizer clips the gradients by a norm (so a gradient that
            is not finite would make every parameter NaN).
        state: The training state.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        state: TrainingState,
        trainable: Sequence[str],
        config: SessionConfig,
        *,
        fused: bool = True,
        threads: int = 1,
        where: str = "the optimizer model",
    ) -> None:
        self.state = state
        proto = _per_tensor_optimizer(model, state, trainable)
        meta = {p.key: p.value for p in proto.metadata_props}
        inputs = [i.name for i in proto.graph.input]
        unknown = [n for n in trainable if n not in inputs]
        if unknown:
            raise ModelError(
                f"{where} does not update parameters {unknown[:5]}; it was generated for another"
                " model"
            )
        no_grads = [n for n in trainable if f"{n}_grad" not in inputs]
        if no_grads:
            raise ModelError(
                f"{where} is not an optimizer model: it takes no gradient inputs for"
                f" {no_grads[:5]} (expected inputs named '<parameter>_grad'); pass the"
                " optimizer_model.onnx that generate_artifacts wrote, not the training or eval"
                " model"
            )
        known = {"learning_rate", "step", *trainable, *(f"{n}_grad" for n in trainable)}
        params = [n for n in inputs if n in trainable]
        slot_keys = self._attach_slots(proto, [n for n in inputs if n not in known], meta)
        if state.learning_rate is None:
            state.learning_rate = float(meta.get("traingraph.learning_rate", 1e-3))
        self._slot_keys = {name: slot_keys.get(name, {}) for name in params}
        layout = flat_layout(state, params, self._slot_keys)
        hyperparameters = json.loads(meta.get("traingraph.hyperparameters", "null"))
        name = meta.get("traingraph.optimizer", "")
        self.clips_by_norm = any(
            (hyperparameters or {}).get(k) for k in ("clip_grad_norm", "max_grad_norm_per_tensor")
        )
        self._fused: FusedUpdate | None = None
        self._device: DeviceUpdate | None = None
        dtypes = {np.dtype(d) for _, d in state.trainable.cur.specs.values()}
        if state.optimizer_slots is not None:
            dtypes |= {np.dtype(d) for _, d in state.optimizer_slots.cur.specs.values()}
        spans = None
        if layout is not None and state.trainable.cur.offsets is not None:
            specs, offsets = state.trainable.cur.specs, state.trainable.cur.offsets
            spans = {n: (at, at + math.prod(specs[n][0])) for n, at in offsets.items()}
        runs_fused = fused and hyperparameters is not None and dtypes <= set(DTYPES)
        if runs_fused and state.device.kind == "cpu":
            self._fused = fused_update(name, hyperparameters, threads=threads, spans=spans)
        elif runs_fused and state.device.kind == "cuda" and layout is not None:
            from traingraph.runtime.cuda.cudart import shared_stream

            if shared_stream(state.device.index) is not None:
                self._device = device_update(
                    name, hyperparameters, spans, device_index=state.device.index
                )
        self.blocks = layout if self._fused is not None or self._device is not None else None
        self.flat: FlatLayout | None = None
        self.graph_model = proto
        if fused and self._fused is None and hyperparameters is not None:
            size = state.trainable.cur.flat_size
            flat = flat_equivalent(proto, name, hyperparameters, layout, size)
            if flat is not None:
                self.graph_model, self.flat = flat
        self.in_place = InPlace()
        self._runner: BoundRunner | None = None
        if self._fused is None and self._device is None:
            self.in_place = writes_in_place(self.graph_model, state, self.flat)
            session = create_session(self.graph_model, state.device, config)
            self._runner = BoundRunner(session, state.device)

    @property
    def device_kernel(self) -> DeviceUpdate | None:
        """The one-kernel update on a CUDA device (:mod:`~traingraph.runtime.optimizer.device`)
        where it runs there, else None (the graph runs)."""
        return self._device

    def queue_device_update(self, stream: int) -> None:
        """Queue the one-kernel update on CUDA ``stream`` (after the gradients' writers on it);
        it updates the parameters and slots in place. Counts the step."""
        device, state, blocks = self._device, self.state, self.blocks
        assert device is not None and blocks is not None and state.learning_rate is not None
        slots = state.optimizer_slots
        assert slots is not None
        params = state.trainable.cur
        size = params.flat_size
        addresses = {
            "param": params.block(0, size).data_ptr(),
            "grad": state.grads.block(0, size).data_ptr(),
        }
        for kind, (start, stop) in blocks.items():
            addresses[kind] = slots.cur.block(start, stop).data_ptr()
        dtype = next(iter(params.specs.values()))[1]
        lr = float(np.float32(state.learning_rate))
        device(addresses, size, dtype, lr=lr, step=state.step + 1, stream=stream)
        state.step += 1

    def _attach_slots(
        self, proto: onnx.ModelProto, slot_names: list[str], meta: Mapping[str, str]
    ) -> dict[str, dict[str, str]]:
        """Give the state the model's slots; returns parameter -> slot kind -> slot name.

        Slots of one kind (all "exp_avg", then all "exp_avg_sq", ...) lie next to each other
        in the parameters' order, so a fused update covers each kind as one flat block. Their
        values come from the state's pending values (a checkpoint's, or those of slots an
        earlier optimizer held), which the store then holds alone, else from their initial
        values.
        """
        state = self.state
        slot_init = json.loads(meta.get("traingraph.slot_init", "{}"))
        value_info = {i.name: i for i in proto.graph.input}
        owners = {slot: state.slot_owner(slot) for slot in slot_names}
        order = {name: i for i, name in enumerate(state.trainable.cur)}
        kinds = list(dict.fromkeys(key for _, key in owners.values()))
        slot_names = sorted(
            slot_names, key=lambda s: (kinds.index(owners[s][1]), order.get(owners[s][0], -1))
        )
        specs = {}
        for name in slot_names:
            t = value_info[name].type.tensor_type
            dims = tuple(d.dim_value for d in t.shape.dim)
            specs[name] = (dims, tensor_dtype(t.elem_type))
        if state.optimizer_slots is None or set(state.optimizer_slots.cur) != set(specs):
            pending = state.pending_slot_values
            if state.optimizer_slots is not None:  # the slots replaced keep their values
                replaced = state.optimizer_slots.cur
                pending.update((name, replaced.read(name)) for name in replaced)
            store = TensorStore(state.device, specs)
            for name, (shape, dtype) in specs.items():
                value = pending.get(name)
                if value is None:
                    value = np.full(shape, slot_init.get(name, 0.0), dtype)
                store.write(name, value)
            state.optimizer_slots = PingPong(store)
            for name in specs:  # the store holds them now
                pending.pop(name, None)
        keys: dict[str, dict[str, str]] = {}
        for slot, (owner, key) in owners.items():
            keys.setdefault(owner, {})[key] = slot
        return keys

    def apply(self) -> None:
        """Update the parameters and slots with the current gradients; count the step."""
        state = self.state
        if self._device is not None:
            from traingraph.runtime.cuda.cudart import shared_stream

            stream = shared_stream(state.device.index)
            assert stream is not None  # checked when the kernel was chosen
            # The training step's session finished its run before returning; the update
            # is done before the next one starts.
            self.queue_device_update(stream.handle)
            stream.synchronize()
            return
        if self._fused is None:
            assert self._runner is not None
            optimizer_step(self._runner, state, self.flat, self.in_place)
            return
        assert state.optimizer_slots is not None and state.learning_rate is not None
        lr = float(np.float32(state.learning_rate))
        params, grads, slots = state.trainable.cur.flat, state.grads.flat, state.optimizer_slots.cur
        if self.blocks is not None and params is not None and grads is not None:
            assert slots.flat is not None
            blocks = {key: slots.flat[start:stop] for key, (start, stop) in self.blocks.items()}
            self._fused(params, grads, blocks, lr=lr, step=state.step + 1)
        else:
            for name, keys in self._slot_keys.items():
                self._fused(
                    state.trainable.cur.host_view(name),
                    state.grads.host_view(name),
                    {key: slots.host_view(slot) for key, slot in keys.items()},
                    lr=lr,
                    step=state.step + 1,
                )
        state.step += 1

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate used by the next update."""
        lr = float(learning_rate)
        if not np.isfinite(lr) or lr < 0:
            raise ModelError(f"learning rate must be a finite number >= 0, got {learning_rate!r}")
        self.state.learning_rate = lr

    def get_learning_rate(self) -> float:
        """The learning rate of the next update."""
        assert self.state.learning_rate is not None
        return float(self.state.learning_rate)


def _per_tensor_optimizer(
    proto: onnx.ModelProto, state: TrainingState, trainable: Sequence[str]
) -> onnx.ModelProto:
    """``proto``, or for an onnxblock.optim model (tensor sequences ``params``, ``gradients``,
    ...) the per-tensor optimizer model of the optimizer its metadata names."""
    sequences = {i.name for i in proto.graph.input if i.type.HasField("sequence_type")}
    if "params" not in sequences:
        return proto
    meta = {p.key: p.value for p in proto.metadata_props}
    name = meta.get("traingraph.optimizer", "")
    optimizer = from_hyperparameters(name, json.loads(meta.get("traingraph.hyperparameters", "{}")))
    if optimizer is None:
        raise ModelError(
            "the optimizer model takes tensor sequences (onnxruntime-training's layout) and does"
            " not name a traingraph optimizer in its metadata; build it with"
            " traingraph.onnxblock.optim or generate it with traingraph.artifacts"
        )
    specs = state.trainable.cur.specs
    infos = [ParamInfo(n, tuple(specs[n][0]), np.dtype(specs[n][1])) for n in trainable]
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    model = build_optimizer_model(optimizer, infos, opset)
    model.metadata_props.extend(proto.metadata_props)
    return model


def flat_equivalent(
    proto: onnx.ModelProto,
    name: str,
    hyperparameters: Mapping[str, Any],
    layout: Mapping[str, tuple[int, int]] | None = None,
    size: int = 0,
) -> tuple[onnx.ModelProto, FlatLayout | None] | None:
    """The optimizer model ``proto`` (generated for the optimizer named ``name`` with
    ``hyperparameters`` in its metadata) computed as one update of all parameters at once; None
    where that optimizer is not a named, elementwise one or the model's inputs are not the
    ones it would have.

    With a ``layout`` (:func:`flat_layout`) of the state's blocks (``size`` elements of
    parameters) that has the optimizer's slot kinds, the model updates the blocks themselves as
    one vector and the :class:`FlatLayout` says how to bind it; else
    (:func:`~traingraph.optim.model.build_flat_optimizer_model`) it takes and returns the
    tensors one by one, as ``proto`` does, and the layout is None.
    """
    optimizer = from_hyperparameters(name, hyperparameters)
    if optimizer is None or not flattenable(optimizer):
        return None
    inputs = {i.name: i.type.tensor_type for i in proto.graph.input}
    params = [n[: -len("_grad")] for n in inputs if n.endswith("_grad") and n[:-5] in inputs]
    if len(params) < 2:
        return None
    infos = [
        ParamInfo(
            n,
            tuple(d.dim_value for d in inputs[n].shape.dim),
            tensor_dtype(inputs[n].elem_type),
        )
        for n in params
    ]
    expected = ["learning_rate", "step", *params, *(f"{n}_grad" for n in params)]
    expected += [slot.name for slot in state_slots(optimizer, infos)]
    if expected != list(inputs):
        return None
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    flat = ParamInfo("flat", (size,), infos[0].dtype)
    kinds = {slot.name[len("flat.") :] for slot in state_slots(optimizer, [flat])}
    if layout is None or kinds != set(layout):
        return build_flat_optimizer_model(optimizer, infos, opset), None
    blocks = FlatLayout(flat.name, size, dict(layout))
    chunks = [ParamInfo(name, (stop - start,), flat.dtype) for name, start, stop in blocks.chunks]
    model = build_optimizer_model(optimizer, chunks, opset)
    model.graph.name = f"{optimizer.name}_flat_step"
    return model, blocks


def tensor_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX tensor element type."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
