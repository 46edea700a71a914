"""The step engine: one training step on one device.

A :class:`TrainStep` runs a graph that computes gradients (a whole training model, or the
gradient phase of a :class:`~traingraph.graph.TrainingGraph`) over a
:class:`~traingraph.runtime.state.TrainingState`: it binds the inputs and the device-resident
parameters, runs the graph with the native CPU kernels wired in (:class:`GradientRunner`),
writes or accumulates the gradients into the state, and applies an optimizer update
(:class:`~traingraph.runtime.optimizer.OptimizerUpdate`). ``api.Module`` / ``api.Optimizer``,
``graph.TrainingGraph`` and :class:`~traingraph.runtime.cuda.CudaGraphStep` are faces over it.

Example:
    >>> step = TrainStep.for_model("training_model.onnx", state, config, inputs, outputs)
    >>> outputs = step.run({"x": x, "y": y})
    >>> step.update(OptimizerUpdate(optimizer_proto, state, step.trainable, step.config))
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from traingraph.errors import NonFiniteLossError
from traingraph.ir.model import max_ir_version
from traingraph.precision import GRADS_FINITE, LOSS_SCALE
from traingraph.program import (
    ACCUMULATION_BUFFER,
    ACCUMULATION_OUT,
    BUFFER_UPDATE_SUFFIX,
    LAZY_RESET_GRAD,
)
from traingraph.runtime import heap
from traingraph.runtime.amp import DynamicLossScaler
from traingraph.runtime.cpu import kernels, segments
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.device import Device
from traingraph.runtime.optimizer import OptimizerUpdate
from traingraph.runtime.session import BoundRunner, SessionConfig, create_session, ort_type_to_numpy
from traingraph.runtime.state import TrainingState
from traingraph.runtime.tensors import TensorStore

__all__ = ["GradientHook", "GradientRunner", "TrainStep"]

NATIVE_SPLIT_MAX_BYTES = 1 << 30
"""Larger training models keep their native-kernel subgraphs in the graph: splitting them out
means holding the model, weights included, in memory once more."""

GradientHook = Callable[[TensorStore, bool], bool]
"""``hook(grads, finite) -> finite``: called between the gradients and the update with the
gradients' store (which it may change in place) and whether the step's loss (with a loss
scaler: its gradients) is finite; it returns the finiteness the update goes by."""


@dataclasses.dataclass
class GradientRunner:
    """A runner of a graph that computes gradients, with the native CPU kernels wired in.

    This is the one place that wires them: :func:`traingraph.runtime.cpu.kernels.split` finds the
    kernels ``SessionConfig.native_kernels`` names (Conv weight gradients split out of the
    graph, and kernels between onnxruntime segments of it, :mod:`~traingraph.runtime.cpu.segments`).

    Attributes:
        runner: Runs the (possibly split) graph: a ``BoundRunner`` or a ``SegmentedRunner``.
        weight_grads: The Conv weight gradients split out of the graph.
        after_run: Those of ``weight_grads`` computed after each run (the others are kernels
            of the segmented runner).
        threads: The native kernels' thread count.
    """

    runner: BoundRunner | segments.SegmentedRunner
    weight_grads: list[conv_grads.WeightGrad]
    after_run: list[conv_grads.WeightGrad]
    threads: int
    native_params: set[str]
    """The parameters whose gradients the native kernels write after a run."""
    read_outputs: list[str]
    """The values the graph returns for the kernels that run after it."""

    @classmethod
    def create(
        cls,
        model: str | os.PathLike | onnx.ModelProto,
        device: Device,
        config: SessionConfig,
        forward: onnx.ModelProto | None = None,
    ) -> GradientRunner:
        """The runner of ``model`` on ``device``: on the CPU, with the kernels ``config``
        enables (where the extension is built), else onnxruntime's session of the model.

        Args:
            model: The graph (a path or a model).
            device: Where it runs.
            config: Session settings; ``native_conv_grads``, ``native_segments`` and
                ``native_kernels`` choose the kernels.
            forward: The forward phase, where ``model`` is a separate gradient phase.
        """
        threads = conv_grads.default_threads(config.intra_op_threads)
        proto = _native_candidate(model, device, config)
        grads: list[conv_grads.WeightGrad] = []
        found: list[tuple[kernels.Kernel, set[int]]] = []
        if proto is not None:
            split, grads, found = kernels.split(proto, config, forward)
            if grads or found:
                model = split
        runner: BoundRunner | segments.SegmentedRunner
        if found:
            assert isinstance(model, onnx.ModelProto)
            runner = segments.runner(
                model,
                found,
                lambda m: create_session(m, device, config),
                device,
                threads,
                grads,
                layouts=config.specialize,
            )
        else:
            runner = BoundRunner(create_session(model, device, config), device)
        after = segments.after_run(runner, grads)
        if proto is not None:
            heap.trim()  # the memory the kernels' search and checks left free in the heap
        return cls(
            runner=runner,
            weight_grads=grads,
            after_run=after,
            threads=threads,
            native_params=conv_grads.native_params(after),
            read_outputs=conv_grads.run_outputs(after, _input_names(model)) if after else [],
        )

    @property
    def inputs(self) -> Mapping[str, Any]:
        """The graph's inputs by name."""
        return self.runner.inputs

    def run(
        self,
        inputs: Mapping[str, Any],
        outputs: dict[str, ort.OrtValue | None],
        grads: TensorStore,
    ) -> dict[str, Any]:
        """Bind ``inputs``, run, and write the natively computed gradients into ``grads``.

        Args:
            inputs: Every input of the graph by name.
            outputs: The outputs wanted, each a buffer to write or None.
            grads: The store whose host views receive the native weight gradients.
        """
        for name, value in inputs.items():
            self.runner.bind_input(name, value)
        for name in self.read_outputs:
            outputs[name] = None
        results = self.runner.run(outputs)
        if self.after_run:
            conv_grads.compute_after_run(self.after_run, results, inputs, grads, self.threads)
        return results


def _native_candidate(
    model: str | os.PathLike | onnx.ModelProto, device: Device, config: SessionConfig
) -> onnx.ModelProto | None:
    """``model`` loaded, where native kernels may run it: on the CPU, with a kernel enabled
    and built, and the model small enough to hold twice; else None."""
    native = config.native_conv_grads or config.native_segments
    if not (device.kind == "cpu" and native and conv_grads.AVAILABLE):
        return None
    if isinstance(model, onnx.ModelProto):
        return model
    if Path(model).stat().st_size > NATIVE_SPLIT_MAX_BYTES:
        return None  # with its weights inline the copy grows large
    proto = onnx.load(os.fspath(model))
    return None if proto.ByteSize() > NATIVE_SPLIT_MAX_BYTES else proto


def _input_names(model: str | os.PathLike | onnx.ModelProto) -> list[str]:
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model), load_external_data=False)
    return [i.name for i in model.graph.input]


class TrainStep:
    """One training step on one device: bind, run the gradients, accumulate, update.

    Args:
        model: The graph that computes the gradients (a path or a model).
        model_inputs: The names of all its inputs.
        state: The device-resident parameters, gradients and optimizer slots.
        config: Session settings (the native kernels included).
        inputs: The data inputs a step takes, in order.
        outputs: The outputs a step returns, in order (the loss first, where there is one).
        grad_outputs: Trainable parameter -> the graph output holding its gradient.
        buffer_outputs: Graph output -> the state buffer it updates (running statistics).
        constant_feeds: Inputs fed the same value at every step.
        accumulate: Whether a step adds its gradients to the previous ones until
            ``state.reset_grads_pending`` is set; False: each step overwrites them.
        forward: The forward phase, where ``model`` is a separate gradient phase.

    Attributes:
        gradients: The :class:`GradientRunner` of ``model``.
        param_inputs: The graph inputs bound from the state at every step.
        fixed_outputs: Buffers of the ``outputs`` whose shape is static, written by every
            step (the faces return copies of them).
        loss_scaler: For a mixed-precision graph (one that takes ``loss_scale``), the scaler
            whose scale each step uses and which :meth:`update` updates; else None.
        grads_finite: Whether every step's gradients since they were reset were finite (as the
            graph's ``grads_finite`` output says; mixed precision only).
        loss_finite: Whether every step's loss since the gradients were reset was finite.
        lock: Held by the faces while a step or an update runs.
    """

    def __init__(
        self,
        model: str | os.PathLike | onnx.ModelProto,
        model_inputs: Sequence[str],
        state: TrainingState,
        config: SessionConfig,
        *,
        inputs: Sequence[str],
        outputs: Sequence[str],
        grad_outputs: Mapping[str, str],
        buffer_outputs: Mapping[str, str] | None = None,
        constant_feeds: Mapping[str, np.ndarray] | None = None,
        accumulate: bool = True,
        forward: onnx.ModelProto | None = None,
    ) -> None:
        self.model = model
        self.state = state
        self.device = state.device
        self.config = config
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.grad_outputs = dict(grad_outputs)
        self.trainable = list(self.grad_outputs)
        self.buffer_outputs = dict(buffer_outputs or {})
        self.constant_feeds = dict(constant_feeds or {})
        self.accumulate = accumulate
        self.gradients = GradientRunner.create(model, state.device, config, forward)
        names = set(state.names)
        self.model_inputs = list(model_inputs)
        self.param_inputs = [n for n in model_inputs if n in names]
        self._input_set = set(model_inputs)
        self.loss_scaler = DynamicLossScaler() if LOSS_SCALE in model_inputs else None
        self.lock = threading.Lock()
        self.grads_finite = True
        self.loss_finite = True
        self.fixed_outputs = _preallocated_outputs(self.gradients.runner, self.outputs)
        self._accumulator: BoundRunner | None = None
        self._accumulated: TensorStore | None = None  # the sum's target; swaps with the grads

    @classmethod
    def for_model(
        cls,
        path: str | os.PathLike,
        state: TrainingState,
        config: SessionConfig,
        inputs: Sequence[str],
        outputs: Sequence[str],
    ) -> TrainStep:
        """The step of a training model file (as ``generate_artifacts`` or onnxblock writes
        it) whose graph has ``inputs`` and ``outputs``: the parameters, the data and labels
        (and ``loss_scale``) in; the loss and extra outputs, ``<parameter>_grad``, the buffer
        updates (and ``grads_finite``) out."""
        params = set(state.names)
        trainable = [n for n in state.names if state.requires_grad.get(n)]
        grad_outputs = {n: _grad_output(n, outputs) for n in trainable}
        # A training model of onnxblock.TrainingBlock names its gradients
        # "<name>_grad.accumulation.out" and takes gradient buffers and lazy_reset_grad; the
        # step accumulates on its own, so it feeds zeros and True (each run's own gradient).
        constant = _accumulation_feeds(inputs, state)
        buffer_outputs = {
            o: o[: -len(BUFFER_UPDATE_SUFFIX)]
            for o in outputs
            if o.endswith(BUFFER_UPDATE_SUFFIX) and o[: -len(BUFFER_UPDATE_SUFFIX)] in params
        }
        skipped = {*grad_outputs.values(), *buffer_outputs, GRADS_FINITE}
        return cls(
            path,
            inputs,
            state,
            config,
            inputs=[n for n in inputs if n not in params and n != LOSS_SCALE and n not in constant],
            outputs=[o for o in outputs if o not in skipped],
            grad_outputs=grad_outputs,
            buffer_outputs=buffer_outputs,
            constant_feeds=constant,
        )

    @property
    def runner(self) -> BoundRunner | segments.SegmentedRunner:
        """What runs the graph (a ``BoundRunner``, or a ``SegmentedRunner`` with kernels)."""
        return self.gradients.runner

    def run(
        self, feeds: Mapping[str, Any], outputs: Mapping[str, ort.OrtValue | None] | None = None
    ) -> dict[str, Any]:
        """One forward and backward pass: the gradients go to (or are added to) the state's.

        Args:
            feeds: The data inputs (and any other graph input by name: saved activations,
                user gradients), as arrays or OrtValues; parameters not among them are bound
                from the state, and names that are not inputs of the graph are left out.
            outputs: Further graph outputs wanted, each a buffer to write or None.

        Returns:
            The graph's outputs by name (those without a buffer of their own are valid until
            the next run).
        """
        state = self.state
        bound: dict[str, Any] = {n: state.ortvalue(n) for n in self.param_inputs if n not in feeds}
        bound.update(self.constant_feeds)
        inputs = self._input_set
        bound.update((n, v) for n, v in feeds.items() if n in inputs)
        if self.loss_scaler is not None:
            bound[LOSS_SCALE] = np.array(self.loss_scaler.scale, np.float32)
        accumulate = self.accumulate and not state.reset_grads_pending and state.grads_valid
        if accumulate and state.grad_scratch is None:
            state.grad_scratch = state.grads.like()
        target = state.grad_scratch if accumulate else state.grads
        assert target is not None
        wanted: dict[str, ort.OrtValue | None] = {
            out: target.ortvalue(name)
            for name, out in self.grad_outputs.items()
            if name not in self.gradients.native_params
        }
        for out, buffer in self.buffer_outputs.items():
            wanted[out] = state.buffers.alt.ortvalue(buffer)
        for name in self.outputs:
            wanted[name] = self.fixed_outputs.get(name)
        if self.loss_scaler is not None:
            wanted[GRADS_FINITE] = None
        wanted.update(outputs or {})
        results = self.gradients.run(bound, wanted, target)
        if self.loss_scaler is not None:
            finite = bool(results[GRADS_FINITE].numpy())
            self.grads_finite = finite and (self.grads_finite or not accumulate)
        if self.outputs:
            finite = finite_loss(results[self.outputs[0]])
            self.loss_finite = finite and (self.loss_finite or not accumulate)
        if accumulate:
            self._add_scratch()
        if self.buffer_outputs:
            state.buffers.swap()
        state.grads_valid = True
        if self.accumulate:
            state.reset_grads_pending = False
        return results

    def _add_scratch(self) -> None:
        """grads += grad_scratch (in place on the CPU, with a small graph elsewhere)."""
        state = self.state
        scratch = state.grad_scratch
        assert scratch is not None
        if self.device.kind == "cpu":
            for name in self.trainable:
                view, extra = state.grads.view(name), scratch.view(name)
                assert view is not None and extra is not None
                np.add(view, extra, out=view)
            return
        if self._accumulator is None:
            model = _accumulator_model(state.grads)
            self._accumulator = BoundRunner(
                create_session(model, self.device, self.config), self.device
            )
        if self._accumulated is None:
            self._accumulated = state.grads.like()
        total = self._accumulated
        outs: dict[str, ort.OrtValue | None] = {}
        for i, name in enumerate(self.trainable):
            self._accumulator.bind_input(f"a{i}", state.grads.ortvalue(name))
            self._accumulator.bind_input(f"b{i}", scratch.ortvalue(name))
            outs[f"s{i}"] = total.ortvalue(name)
        self._accumulator.run(outs)
        self._accumulated, state.grads = state.grads, total

    def update(
        self,
        optimizer: OptimizerUpdate,
        nonfinite: str = "apply",
        hooks: Sequence[GradientHook] = (),
    ) -> bool:
        """Apply ``optimizer`` to the parameters with the current gradients.

        The ``hooks`` see the gradients first (:data:`GradientHook`). A mixed-precision step's
        loss scaler then sees them: where some is inf or NaN the update is skipped and the
        scale shrinks. Otherwise, where the loss of a step since the gradients were reset was
        not finite, or, for an optimizer that clips by a gradient norm, a gradient on the host
        is not (clipping would make the parameters NaN), ``nonfinite`` says what happens:
        ``"apply"`` the update anyway, ``"skip"`` it, or ``"raise"``; either way but
        ``"apply"``, the gradients are dropped (the next step overwrites them).

        Returns:
            Whether the update was applied.

        Raises:
            NonFiniteLossError: For ``nonfinite="raise"`` and a loss or gradient that was not
                finite.
        """
        state = self.state
        for hook in hooks:
            if self.loss_scaler is None:
                self.loss_finite = bool(hook(state.grads, self.loss_finite))
            else:
                self.grads_finite = bool(hook(state.grads, self.grads_finite))
        if self.loss_scaler is None and not self.loss_finite and nonfinite != "apply":
            state.reset_grads_pending = True
            self.loss_finite = True
            if nonfinite == "skip":
                return False
            raise NonFiniteLossError(
                "the loss of a train step since the last update is NaN or infinite, so its"
                " gradients are too; the update was not applied and the gradients are dropped."
                " Check the batch for NaN/Inf values, lower the learning rate, or pass"
                " Optimizer(..., nonfinite='skip') to skip such updates"
            )
        if (
            self.loss_scaler is None
            and optimizer.clips_by_norm
            and nonfinite != "apply"
            and not host_grads_finite(state.grads)
        ):
            state.reset_grads_pending = True
            if nonfinite == "skip":
                return False
            raise NonFiniteLossError(
                "a gradient is NaN or infinite although the loss is finite, so the norm that"
                " gradient clipping divides by is too; the update was not applied and the"
                " gradients are dropped. Look for an op whose derivative is infinite where it"
                " is evaluated (Sqrt or Log at 0, Pow with a negative exponent), or pass"
                " Optimizer(..., nonfinite='skip') to skip such updates"
            )
        if self.loss_scaler is not None and not self.loss_scaler.update(self.grads_finite):
            return False
        optimizer.apply()
        return True


def host_grads_finite(grads: TensorStore) -> bool:
    """Whether every gradient on the host is finite: one pass, a sum in float64, which is
    finite exactly where float32 or narrower terms are (float64 terms large enough to overflow
    it overflow the norm too). Gradients on another device count as finite."""
    if grads.device.kind != "cpu":
        return True
    views = [grads.flat] if grads.flat is not None else [grads.host_view(n) for n in grads]
    return all(np.isfinite(np.sum(v, dtype=np.float64)) for v in views)


def finite_loss(value: ort.OrtValue | np.ndarray) -> bool:
    """Whether a scalar loss on the host is finite; True for other outputs and device values."""
    if isinstance(value, np.ndarray):
        return value.size != 1 or math.isfinite(value.item())
    if value.device_name().lower() != "cpu" or math.prod(value.shape()) != 1:
        return True
    return math.isfinite(value.numpy().item())


def _grad_output(param: str, outputs: Sequence[str]) -> str:
    """The training model's output holding ``param``'s gradient: ``<param>_grad``, or
    onnxblock.TrainingBlock's ``<param>_grad.accumulation.out``."""
    accumulated = f"{param}_grad{ACCUMULATION_OUT}"
    return accumulated if accumulated in outputs else f"{param}_grad"


def _accumulation_feeds(inputs: Sequence[str], state: TrainingState) -> dict[str, np.ndarray]:
    """Values for the gradient-buffer inputs and ``lazy_reset_grad`` of an
    onnxblock.TrainingBlock training model (none for other models): zeros and True."""
    feeds: dict[str, np.ndarray] = {}
    names = set(state.names)
    for name in inputs:
        param = name[: -len(ACCUMULATION_BUFFER)] if name.endswith(ACCUMULATION_BUFFER) else None
        if param is not None and param.endswith("_grad") and param[:-5] in names:
            shape, dtype = state.store_of(param[:-5]).specs[param[:-5]]
            feeds[name] = np.zeros(shape, dtype)
        elif name == LAZY_RESET_GRAD:
            feeds[name] = np.ones(1, np.bool_)
    return feeds if LAZY_RESET_GRAD in feeds else {}


def _preallocated_outputs(
    runner: BoundRunner | segments.SegmentedRunner, names: Sequence[str]
) -> dict[str, ort.OrtValue]:
    """Buffers on the runner's device for the outputs among ``names`` whose shape is static."""
    device, buffers = runner.device, {}
    for info in runner.output_infos:
        dtype = ort_type_to_numpy(info.type)
        static = info.shape is not None and all(isinstance(d, int) for d in info.shape)
        if info.name in names and static and dtype is not None:
            buffers[info.name] = ort.OrtValue.ortvalue_from_shape_and_type(
                list(info.shape), dtype, device.ort_device_type, device.index
            )
    return buffers


def _accumulator_model(grads: TensorStore) -> onnx.ModelProto:
    """A graph whose outputs ``s<i>`` are the sums of its inputs ``a<i>`` and ``b<i>``, one
    triple per gradient of ``grads``."""
    nodes, inputs, outputs = [], [], []
    for i, (name, (shape, dtype)) in enumerate(grads.specs.items()):
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        inputs += [helper.make_tensor_value_info(f"{p}{i}", elem, list(shape)) for p in "ab"]
        outputs.append(helper.make_tensor_value_info(f"s{i}", elem, list(shape)))
        nodes.append(
            helper.make_node("Add", [f"a{i}", f"b{i}"], [f"s{i}"], name=f"accumulate_{name}")
        )
    graph = helper.make_graph(nodes, "accumulate_gradients", inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )
