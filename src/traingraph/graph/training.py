"""``TrainingGraph``: graphs + loss + optimizer, compiled into forward, gradient and optimizer
phases that run on a device (ML Compute's ``MLCTrainingGraph``).

Compiling differentiates the composed graphs with :func:`traingraph.autodiff.differentiate`
and the same training-mode, loss and optimizer builders as :func:`traingraph.program.build_program`;
:func:`~traingraph.graph.phases.split_phases` cuts the train graph into a forward and a
gradient model. Training-mode BatchNormalization is first lowered to standard ops
(:func:`~traingraph.autodiff.lowering.lower_training_batch_norm`), as in the artifacts, so that
every phase runs on execution providers without a training-mode kernel (CUDA from opset 14
on). Parameters, gradients and optimizer slots live in a
:class:`~traingraph.runtime.state.TrainingState` on the device; the forward phase hands its saved
activations to the gradient phase as device OrtValues. :meth:`TrainingGraph.execute` runs the
three phases in a row, exactly as calling them one by one does.

Example:
    >>> train = TrainingGraph([g], loss=losses.CrossEntropyLoss(), optimizer=optim.AdamW(lr=1e-3))
    >>> train.add_inputs({"x": x}, loss_labels={"y": TensorSpec([None], "int64")})
    >>> train.compile(device="cpu")
    >>> result = train.execute({"x": X}, loss_labels={"y": Y})
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from traingraph.autodiff.engine import values_by_name
from traingraph.checkpoint import CheckpointData
from traingraph.errors import ModelError
from traingraph.graph.execution import (
    CompileOptions,
    ExecutionResult,
    OnComplete,
    OrderedExecutor,
    as_device_feed,
    device_feeds,
    host,
    input_specs,
)
from traingraph.graph.graph import Graph, Tensor, TensorSpec, compose
from traingraph.graph.layers import Layer
from traingraph.graph.phases import MemoryPlan, PhaseModels, plan_memory, split_phases
from traingraph.ir.builder import is_float, value_spec
from traingraph.ir.model import to_proto
from traingraph.losses import LabelSpec, Loss
from traingraph.optim.alias import Optimizer
from traingraph.optim.model import build_optimizer_model, init_state
from traingraph.optim.transforms import ParamInfo
from traingraph.program import (
    LOSS_OUTPUT,
    batchnorm_buffers,
    build_train_graph,
    export_inference_model,
    to_inference_mode,
)
from traingraph.runtime.device import Device, parse_device
from traingraph.runtime.optimizer import OptimizerUpdate
from traingraph.runtime.session import BoundRunner, create_session
from traingraph.runtime.state import TrainingState
from traingraph.runtime.step import TrainStep
from traingraph.runtime.tensors import PingPong, TensorStore

__all__ = ["TrainingGraph"]

TensorRef = Tensor | str
Feeds = Mapping[str, Any]


def tensor_name(t: TensorRef) -> str:
    if isinstance(t, Tensor):
        return t.name
    if isinstance(t, str):
        return t
    raise TypeError(f"expected a Tensor or a tensor name; got {type(t).__name__}")


def param_names(items: Sequence[str | Layer], graphs: Sequence[Graph]) -> list[str]:
    """Parameter names from names and layers (a layer stands for its parameters)."""
    names: list[str] = []
    for item in items:
        if isinstance(item, Layer):
            owner = [g for g in graphs if id(item) in g._layer_names]
            if not owner:
                raise ModelError(f"layer {item!r} was not called in any of the graphs")
            names += item.parameter_names(owner[0])
        else:
            names.append(item)
    return names


class TrainingGraph:
    """Graphs trained with a loss and an optimizer (``MLCTrainingGraph``).

    Args:
        graphs: The graphs, composed in order (an input of a later graph that has the name of
            an earlier graph's output reads it).
        loss: The loss applied to ``loss_inputs``; None when the backward pass is driven only
            by user gradients (:meth:`allocate_user_gradient`), e.g. the first of linked graphs.
        optimizer: The optimizer; None leaves the parameters to the caller.
        loss_inputs: The outputs the loss applies to (default: the last graph's outputs).
    """

    def __init__(
        self,
        graphs: Sequence[Graph],
        loss: Loss | None = None,
        optimizer: Optimizer | None = None,
        loss_inputs: Sequence[TensorRef] | None = None,
    ) -> None:
        self.graphs = list(graphs)
        self.loss = loss
        self.optimizer = optimizer
        self.loss_inputs = (
            [tensor_name(t) for t in loss_inputs]
            if loss_inputs is not None
            else [o.name or "" for o in self.graphs[-1].ir_graph.outputs]
        )
        self.input_specs: dict[str, TensorSpec | None] = {}
        self.label_specs: dict[str, TensorSpec | None] = {}
        self.label_weight_specs: dict[str, TensorSpec | None] = {}
        self.extra_outputs: list[str] = []
        self.stopped: list[str] = []
        self.user_gradients: list[str] = []
        self.tracked: list[str] = []
        self.linked: list[TrainingGraph] = []
        self.frozen: set[str] = set().union(*(g.frozen for g in self.graphs))
        self.trainable_override: list[str] | None = None
        self.options = CompileOptions()
        self.device: Device | None = None
        self._executor = OrderedExecutor("traingraph-train")
        self._compiled = False
        self._stale = False
        self._state: TrainingState | None = None
        self._pending: dict[str, ort.OrtValue] | None = None
        self._tensor_grads: dict[str, ort.OrtValue] = {}
        self._last_shapes: dict[str, tuple[int, ...]] = {}
        self._host_parameters: dict[str, np.ndarray] = {}
        self.step: TrainStep | None = None
        """The compiled gradient phase and optimizer update (None before :meth:`compile`)."""
        self._forward_runner: BoundRunner | None = None
        self._update: OptimizerUpdate | None = None

    # ---------------------------------------------------------------- definition
    def add_inputs(
        self,
        inputs: Mapping[str, Tensor | TensorSpec],
        loss_labels: Mapping[str, TensorSpec] | None = None,
        loss_label_weights: Mapping[str, TensorSpec] | None = None,
    ) -> TrainingGraph:
        """Declare the data inputs fed at each step, the loss labels and per-sample weights.

        Label names are free; they are matched to the loss's labels in order. A label weight
        (shape ``[N]``) scales each sample's loss: ``mean`` becomes the weighted mean
        :math:`\\sum_i w_i \\ell_i / \\sum_i w_i`, ``sum`` the weighted sum.
        """
        self.input_specs.update(input_specs(self.graphs, inputs))
        self.label_specs.update(loss_labels or {})
        self.label_weight_specs.update(loss_label_weights or {})
        if self.label_weight_specs and self.loss is None:
            raise ModelError("loss_label_weights need a loss; pass loss=... to TrainingGraph")
        self._changed()
        return self

    def add_outputs(self, outputs: Sequence[TensorRef] | Mapping[str, TensorRef]) -> TrainingGraph:
        """Also return these tensors (intermediate ones included) from the forward phase."""
        values = outputs.values() if isinstance(outputs, Mapping) else outputs
        self.extra_outputs += [
            tensor_name(t) for t in values if tensor_name(t) not in self.extra_outputs
        ]
        self._changed()
        return self

    def stop_gradient(self, tensors: Sequence[TensorRef]) -> TrainingGraph:
        """Treat these tensors as constants in the backward pass."""
        self.stopped += [tensor_name(t) for t in tensors]
        self._changed()
        return self

    def freeze(self, parameters: Sequence[str | Layer]) -> TrainingGraph:
        """Keep these parameters (names, or layers for all of theirs) out of the optimizer."""
        self.frozen.update(param_names(parameters, self.graphs))
        self._changed()
        return self

    def unfreeze(self, parameters: Sequence[str | Layer]) -> TrainingGraph:
        """Train these parameters again."""
        self.frozen.difference_update(param_names(parameters, self.graphs))
        self._changed()
        return self

    def set_trainable_parameters(self, parameters: Sequence[str | Layer]) -> TrainingGraph:
        """Train exactly these parameters; every other one is frozen."""
        self.trainable_override = param_names(parameters, self.graphs)
        self._changed()
        return self

    def track_gradient(self, tensors: Sequence[TensorRef | Layer]) -> TrainingGraph:
        """Keep the gradients of these tensors (or of a layer's input and output) readable."""
        for t in tensors:
            names = (
                [x.name for x in (*t.inputs, t.output) if x is not None]
                if isinstance(t, Layer)
                else [tensor_name(t)]
            )
            self.tracked += [n for n in names if n not in self.tracked]
        self._changed()
        return self

    def allocate_user_gradient(self, tensor: TensorRef) -> str:
        """Let outside code supply the gradient of ``tensor`` to the backward pass.

        Returns:
            The name under which :meth:`execute_gradient` takes it in ``user_gradients``
            (the tensor's name).
        """
        name = tensor_name(tensor)
        if name not in self.user_gradients:
            self.user_gradients.append(name)
        self._changed()
        return name

    def link(self, others: Sequence[TrainingGraph]) -> TrainingGraph:
        """Chain ``others`` after this graph: their input gradients flow back into this one.

        For each user gradient of this graph (:meth:`allocate_user_gradient`) whose tensor name
        is an input of a linked graph, :meth:`execute_gradient` takes that input's gradient
        from the linked graph when the call gives none; code traingraph does not run may sit
        between the graphs and pass its own gradient instead.
        """
        for other in others:
            if not isinstance(other, TrainingGraph):
                raise TypeError(f"link takes TrainingGraphs; got {type(other).__name__}")
            self.linked.append(other)
            inputs = {v.name for g in other.graphs for v in g.ir_graph.inputs}
            shared = [n for n in self.user_gradients if n in inputs]
            if not shared:
                raise ModelError(
                    "no user gradient of this graph is an input of the linked graph; call"
                    " allocate_user_gradient(tensor) for the tensor the other graph reads"
                )
            other.track_gradient(shared)
        return self

    def _changed(self) -> None:
        if self._compiled:
            self._stale = True

    def _make_labels(self, specs: list[LabelSpec]) -> list[ir.Value]:
        """The loss's label inputs: as :meth:`add_inputs` declared them, else as the loss's
        ``specs`` say."""
        if self.label_specs and len(self.label_specs) != len(specs):
            raise ModelError(
                f"{type(self.loss).__name__} takes {len(specs)} label(s)"
                f" ({[s.name for s in specs]}); add_inputs declared {list(self.label_specs)}"
            )
        names = list(self.label_specs) or [s.name for s in specs]
        labels = []
        for name, spec in zip(names, specs):
            user = self.label_specs.get(name)
            labels.append(
                user.ir_value(name)
                if user is not None
                else ir.Value(name=name, shape=spec.shape, type=ir.TensorType(spec.dtype))
            )
        return labels

    # ---------------------------------------------------------------- compile
    def compile(
        self, device: str | Device = "cpu", options: CompileOptions | None = None
    ) -> TrainingGraph:
        """Build the phase graphs and their sessions on ``device``; parameters go to the device.

        Compiling again (after freezing or adding outputs) keeps the current parameter values.
        """
        self.options = options or CompileOptions()
        self.device = parse_device(device)
        previous = self.get_parameters() if self._compiled else None
        model, owners = compose(self.graphs)
        self._owners = owners
        self._program = _TrainProgram.build(self, model)
        config = self.options.session_config()
        program = self._program
        self._state = state = program.new_state(self.device, previous, owners)
        forward = program.phases.forward
        session = create_session(forward, self.device, config)
        self._forward_runner = BoundRunner(session, self.device)
        gradient = program.phases.gradient
        self.step = None
        if gradient is not None:
            self.step = TrainStep(
                gradient,
                [i.name for i in gradient.graph.input],
                state,
                config,
                inputs=[],
                outputs=[],
                grad_outputs={n: f"{n}_grad" for n in state.grads},
                accumulate=False,
                forward=forward,
            )
        self._update = None
        if program.optimizer_model is not None:
            self._update = OptimizerUpdate(
                program.optimizer_model, state, list(state.grads), config, fused=False
            )
        self._pending = None
        self._tensor_grads = {}
        self._compiled, self._stale = True, False
        return self

    def _require_compiled(self) -> TrainingState:
        if not self._compiled or self._state is None:
            raise ModelError("the training graph is not compiled; call compile(device=...) first")
        if self._stale:
            raise ModelError(
                "the training graph changed after compile (inputs, outputs, frozen parameters,"
                " gradients); call compile(...) again (parameters are kept)"
            )
        return self._state

    # ---------------------------------------------------------------- execution
    def execute(
        self,
        inputs: Feeds,
        loss_labels: Feeds | None = None,
        loss_label_weights: Feeds | None = None,
        *,
        user_gradients: Feeds | None = None,
        asynchronous: bool = False,
        on_complete: OnComplete | None = None,
    ) -> ExecutionResult | Future[ExecutionResult]:
        """One training step: forward, gradient and optimizer update."""

        def step() -> ExecutionResult:
            result = self._forward(inputs, loss_labels, loss_label_weights)
            result.merge(self._gradient(user_gradients))
            return result.merge(self._optimizer_update())

        return self._submit(step, asynchronous, on_complete)

    def execute_forward(
        self,
        inputs: Feeds,
        loss_labels: Feeds | None = None,
        loss_label_weights: Feeds | None = None,
        *,
        asynchronous: bool = False,
        on_complete: OnComplete | None = None,
    ) -> ExecutionResult | Future[ExecutionResult]:
        """The forward phase: loss and outputs; the saved activations stay on the device."""
        return self._submit(
            lambda: self._forward(inputs, loss_labels, loss_label_weights),
            asynchronous,
            on_complete,
        )

    def execute_gradient(
        self,
        user_gradients: Feeds | None = None,
        *,
        asynchronous: bool = False,
        on_complete: OnComplete | None = None,
    ) -> ExecutionResult | Future[ExecutionResult]:
        """The gradient phase, from the last forward phase's saved activations."""
        return self._submit(lambda: self._gradient(user_gradients), asynchronous, on_complete)

    def execute_optimizer_update(
        self, *, asynchronous: bool = False, on_complete: OnComplete | None = None
    ) -> ExecutionResult | Future[ExecutionResult]:
        """The optimizer phase: update the trainable parameters with the current gradients."""
        return self._submit(self._optimizer_update, asynchronous, on_complete)

    def _submit(
        self,
        phases: Callable[[], ExecutionResult],
        asynchronous: bool,
        on_complete: OnComplete | None,
    ) -> ExecutionResult | Future[ExecutionResult]:
        """Run ``phases`` on the executor, in order with the work submitted before."""
        self._require_compiled()
        return self._executor.run(phases, asynchronous, on_complete)

    def synchronize_updates(self) -> dict[str, np.ndarray]:
        """Wait for submitted work and bring the parameters to the host (returned by name)."""
        self._executor.wait()
        self._host_parameters = self.get_parameters()
        return dict(self._host_parameters)

    def _timed(self, phase: str, result: ExecutionResult, start: float) -> None:
        if self.options.profile:
            result.times[phase] = time.perf_counter() - start
        if self.options.debug:
            state = self._state
            assert state is not None
            result.parameters = {n: state.read(n) for n in state.names}
            if phase == "gradient":
                result.gradients = {n: state.grads.read(n) for n in state.grads}

    def _forward(
        self, inputs: Feeds, labels: Feeds | None, weights: Feeds | None
    ) -> ExecutionResult:
        start = time.perf_counter()
        state, program = self._require_compiled(), self._program
        feeds = {**inputs, **(labels or {}), **(weights or {})}
        runner = self._forward_runner
        assert runner is not None
        on_device = device_feeds("feeds", feeds, program.feed_names, runner, state.device)
        self._last_shapes = {n: tuple(v.shape()) for n, v in on_device.items()}
        for name in runner.inputs:
            runner.bind_input(name, on_device[name] if name in on_device else state.ortvalue(name))
        bound: dict[str, ort.OrtValue | None] = {
            out: state.buffers.alt.ortvalue(buffer)
            for out, buffer in program.buffer_updates.items()
        }
        bound.update({n: None for n in [*program.forward_outputs, *program.phases.saved]})
        outputs = runner.run(bound)
        if program.buffer_updates:
            state.buffers.swap()
        self._pending = {**on_device, **{n: outputs[n] for n in program.phases.saved}}
        result = ExecutionResult(
            loss=host(outputs[LOSS_OUTPUT]) if program.has_loss else None,
            outputs={n: host(outputs[n]) for n in program.output_names},
        )
        self._timed("forward", result, start)
        return result

    def _gradient(self, user_gradients: Feeds | None) -> ExecutionResult:
        start = time.perf_counter()
        state, program = self._require_compiled(), self._program
        if self._pending is None:
            raise ModelError(
                "execute_gradient needs the activations of a forward phase; call"
                " execute_forward(...) first (each forward phase feeds one gradient phase)"
            )
        device = state.device
        given = dict(user_gradients or {})
        for name in self.user_gradients:
            if name in given:
                continue
            source = next((g for g in self.linked if name in g._tensor_grads), None)
            if source is None:
                raise ModelError(
                    f"the gradient of {name!r} is supplied by outside code: pass"
                    f" user_gradients={{{name!r}: array}} or link the graph that computes it"
                )
            given[name] = source._tensor_grads[name]
        unknown = [n for n in given if n not in self.user_gradients]
        if unknown:
            raise ModelError(
                f"user gradients {unknown} were not allocated; call allocate_user_gradient(t)"
                " before compile"
            )
        step = self.step
        assert step is not None
        fed: dict[str, ort.OrtValue] = dict(self._pending)
        for name, value in given.items():
            fed[f"{name}_user_grad"] = as_device_feed(value, device.ort_device_type, device.index)
        outputs = step.run(fed, {f"{n}_grad": None for n in program.tensor_grads})
        self._tensor_grads = {n: outputs[f"{n}_grad"] for n in program.tensor_grads}
        state.grads_valid = True
        self._pending = None
        result = ExecutionResult()
        self._timed("gradient", result, start)
        return result

    def _optimizer_update(self) -> ExecutionResult:
        start = time.perf_counter()
        state = self._require_compiled()
        result = ExecutionResult()
        if self._update is None or not state.grads:
            return result
        if not state.grads_valid:
            raise ModelError("no gradients yet; run execute_gradient(...) before the update")
        if self.step is not None:
            self.step.update(self._update)  # a mixed-precision step may skip it
        else:
            self._update.apply()
        self._timed("optimizer", result, start)
        return result

    # ---------------------------------------------------------------- inspection
    def gradient_tensor(self, tensor: TensorRef) -> np.ndarray:
        """The gradient of a data input (``compute_all_gradients``) or tracked tensor."""
        self._executor.wait()
        name = tensor_name(tensor)
        if name not in self._tensor_grads:
            raise ModelError(
                f"no gradient of {name!r} was computed; compile with"
                " CompileOptions(compute_all_gradients=True) for data inputs, or call"
                f" track_gradient([...]) before compile, then run a gradient phase. Available:"
                f" {sorted(self._tensor_grads)}"
            )
        return host(self._tensor_grads[name])

    def layer_gradients(self, layer: Layer) -> tuple[np.ndarray, list[np.ndarray]]:
        """A layer's source gradient (of its output) and result gradients (of its inputs)."""
        if layer.output is None:
            raise ModelError(f"layer {layer!r} was never called")
        return self.gradient_tensor(layer.output), [self.gradient_tensor(x) for x in layer.inputs]

    def gradient_data(self, parameter: str | Layer) -> np.ndarray | dict[str, np.ndarray]:
        """The last gradient of a trainable parameter (of each of a layer's, by name)."""
        state = self._require_compiled()
        self._executor.wait()
        names = param_names([parameter], self.graphs)
        for name in names:
            if name not in state.grads:
                raise ModelError(
                    f"{name!r} is not a trainable parameter; trainable: {list(state.grads)[:10]}"
                )
        if not state.grads_valid:
            raise ModelError("no gradients yet; run execute_gradient(...) or execute(...) first")
        values = {n: state.grads.read(n) for n in names}
        return values[names[0]] if isinstance(parameter, str) else values

    @property
    def gradient_store(self) -> TensorStore:
        """The trainable parameters' gradients where they live (one flat block), which code
        run between :meth:`execute_gradient` and :meth:`execute_optimizer_update` may change in
        place, as :class:`traingraph.distributed.DataParallel` does to average them."""
        state = self._require_compiled()
        self._executor.wait()
        return state.grads

    def memory_plan(
        self, input_shapes: Mapping[str, Sequence[int]] | int | None = None
    ) -> MemoryPlan:
        """The static plan of the intermediates' bytes.

        Args:
            input_shapes: Shapes of the data and label inputs, or a batch size (substituted for
                the dynamic dimensions of the declared inputs), or None for the shapes of the
                last forward phase.
        """
        self._require_compiled()
        program = self._program
        if input_shapes is None:
            if not self._last_shapes:
                raise ModelError("no step has run yet; pass input_shapes or a batch size")
            shapes = dict(self._last_shapes)
        elif isinstance(input_shapes, int):
            shapes = program.batch_shapes(input_shapes)
        else:
            shapes = {n: tuple(s) for n, s in input_shapes.items()}
        return plan_memory(
            program.phases,
            shapes,
            [*program.forward_outputs],
            [f"{n}_grad" for n in program.trainable],
        )

    @property
    def device_memory_size(self) -> int:
        """Bytes of intermediates of the compiled phases for the last step's input shapes."""
        return self.memory_plan().total

    # ---------------------------------------------------------------- state
    def get_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter (and buffer) by name, as host copies."""
        if self._state is None:
            return {n: g.weight(n) for g in self.graphs for n in g.parameters}
        self._executor.wait()
        return {n: self._state.read(n) for n in self._state.names}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy values into parameters (before compile: into the graphs' initial values)."""
        self._executor.wait()
        if self._state is None:
            owners = {n: g for g in self.graphs for n in g.parameters}
            for name, value in values.items():
                if name not in owners:
                    raise KeyError(f"no parameter {name!r}; parameters: {sorted(owners)[:10]}")
                owners[name].parameters[name] = np.array(value, dtype=np.float32, copy=True)
            return
        for name, value in values.items():
            self._state.write(name, np.asarray(value))

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The optimizer's slots by name (e.g. ``"fc.weight.exp_avg"``) and ``"step"``."""
        state = self._require_compiled()
        self._executor.wait()
        slots = (
            {}
            if state.optimizer_slots is None
            else {n: state.optimizer_slots.cur.read(n) for n in state.optimizer_slots.cur}
        )
        return {**slots, "step": np.array(state.step, dtype=np.int64)}

    def bind_optimizer_data(self, data: Mapping[str, np.ndarray]) -> None:
        """Restore or transplant optimizer slots and ``"step"`` (from :meth:`optimizer_state`)."""
        state = self._require_compiled()
        self._executor.wait()
        slots = state.optimizer_slots
        for name, value in data.items():
            if name == "step":
                state.step = int(np.asarray(value))
            elif slots is not None and name in slots.cur:
                slots.cur.write(name, np.asarray(value))
            else:
                known = [] if slots is None else list(slots.cur)
                raise KeyError(f"no optimizer slot {name!r}; slots: {known[:10]} and 'step'")

    @property
    def learning_rate(self) -> float:
        state = self._require_compiled()
        assert state.learning_rate is not None
        return float(state.learning_rate)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        state = self._require_compiled()
        self._executor.wait()
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"learning rate must be a finite number >= 0; got {value!r}")
        state.learning_rate = float(value)

    def export_inference(
        self, path: str | os.PathLike, outputs: Sequence[str] | None = None
    ) -> None:
        """Write a plain inference ``.onnx`` (inference mode, current weights embedded)."""
        self._require_compiled()
        names = list(outputs) if outputs is not None else self._program.model_outputs
        export_inference_model(self._program.eval_model, self.get_parameters(), names, path)


@dataclasses.dataclass
class _TrainProgram:
    """The compiled form of a :class:`TrainingGraph`."""

    phases: PhaseModels
    optimizer_model: onnx.ModelProto | None
    eval_model: onnx.ModelProto
    requires_grad: dict[str, bool]
    buffer_updates: dict[str, str]
    feed_names: list[str]
    feed_specs: dict[str, ir.Value]
    output_names: list[str]
    model_outputs: list[str]
    tensor_grads: list[str]
    has_loss: bool
    optimizer: Optimizer | None

    @property
    def trainable(self) -> list[str]:
        return [n for n, r in self.requires_grad.items() if r]

    @property
    def forward_outputs(self) -> list[str]:
        return [*([LOSS_OUTPUT] if self.has_loss else []), *self.output_names]

    @classmethod
    def build(cls, tg: TrainingGraph, model: ir.Model) -> _TrainProgram:
        graph = model.graph
        opset = model.opset_imports[""]
        param_order = [n for g in tg.graphs for n in g.parameters]
        buffers = batchnorm_buffers(graph)
        if tg.trainable_override is not None:
            trainable = set(tg.trainable_override)
        else:
            trainable = {n for n in param_order if n not in tg.frozen and n not in buffers}
        unknown = sorted(trainable - set(param_order))
        if unknown:
            raise ModelError(f"{unknown} are not parameters; parameters: {param_order[:10]}")
        requires_grad = {n: n in trainable for n in param_order}
        params = set(param_order)
        data_inputs = [v.name or "" for v in graph.inputs if v.name not in params]
        undeclared = [n for n in data_inputs if n not in tg.input_specs]
        if tg.input_specs and undeclared:
            raise ModelError(f"inputs {undeclared} were not declared; add them with add_inputs")
        values = values_by_name(graph)
        model_outputs = [o.name or "" for o in graph.outputs]
        for name in [*tg.loss_inputs, *tg.extra_outputs, *tg.stopped, *tg.user_gradients,
                     *tg.tracked]:  # fmt: skip
            if name not in values:
                raise ModelError(f"{name!r} is not a tensor of the graphs; e.g. {model_outputs}")
        eval_ir = ir.from_proto(to_proto(model))
        to_inference_mode(eval_ir.graph)
        eval_model = to_proto(eval_ir)
        tensor_grads = list(tg.tracked)
        if tg.options.compute_all_gradients:
            tensor_grads += [
                n for n in data_inputs if n not in tensor_grads and is_float(values[n])
            ]
        output_names = [*model_outputs, *[n for n in tg.extra_outputs if n not in model_outputs]]
        weight = None
        if tg.label_weight_specs:
            ((weight_name, weight_spec),) = tg.label_weight_specs.items()
            weight = (weight_spec or TensorSpec([None])).ir_value(weight_name)
        built = build_train_graph(
            model, requires_grad, loss=tg.loss, attach_loss=tg.loss is not None,
            loss_input_names=tg.loss_inputs, labels=tg._make_labels, label_weight=weight,
            output_names=output_names, mixed_precision=tg.options.mixed_precision,
            tensor_grads=tensor_grads, stop_gradients=tg.stopped,
            user_gradients=tg.user_gradients, forward_first=True,
        )  # fmt: skip
        values = values_by_name(graph)
        phases = split_phases(
            to_proto(model), built.forward_node_count, built.forward_outputs, built.grad_outputs
        )
        wrt_names = [n for n in param_order if requires_grad[n]]
        optimizer_model = None
        if tg.optimizer is not None and wrt_names:
            infos = [ParamInfo(n, *value_spec(values[n])) for n in wrt_names]
            optimizer_model = build_optimizer_model(tg.optimizer, infos, opset=opset)
        feed_names = [*data_inputs, *built.label_names]
        return cls(
            phases=phases, optimizer_model=optimizer_model, eval_model=eval_model,
            requires_grad=requires_grad, buffer_updates=built.buffer_updates,
            feed_names=feed_names, feed_specs={n: values[n] for n in feed_names},
            output_names=output_names, model_outputs=model_outputs, tensor_grads=tensor_grads,
            has_loss=built.has_loss, optimizer=tg.optimizer,
        )  # fmt: skip

    def batch_shapes(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """Input shapes with every dynamic dimension set to ``batch_size``."""
        shapes = {}
        for name, value in self.feed_specs.items():
            if value.shape is None:
                raise ModelError(f"input {name!r} has no known rank; pass its shape explicitly")
            shapes[name] = tuple(d if isinstance(d, int) else batch_size for d in value.shape.dims)
        return shapes

    def new_state(
        self, device: Device, previous: Mapping[str, np.ndarray] | None, owners: Mapping[str, Graph]
    ) -> TrainingState:
        """A device state holding the parameters; each weight is loaded, copied, purged in turn."""
        specs = self.phases.full.graph.input
        shapes = {
            v.name: (tuple(d.dim_value for d in v.type.tensor_type.shape.dim),
                     np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)))
            for v in specs if v.name in self.requires_grad
        }  # fmt: skip
        placeholders = {n: np.broadcast_to(np.zeros((), d), s) for n, (s, d) in shapes.items()}
        data = CheckpointData(
            parameters={n: placeholders[n] for n in self.requires_grad},
            requires_grad=dict(self.requires_grad), optimizer_state={},
            learning_rate=None if self.optimizer is None else float(self.optimizer.lr),
        )  # fmt: skip
        state = TrainingState(data, device, set(self.buffer_updates.values()))
        for name in self.requires_grad:
            state.write(name, previous[name] if previous is not None else owners[name].weight(name))
        if self.optimizer is not None and self.trainable:
            infos = [ParamInfo(n, *shapes[n]) for n in self.trainable]
            initial = init_state(self.optimizer, infos)
            slot_specs = {n: (a.shape, a.dtype) for n, a in initial.items()}
            state.optimizer_slots = PingPong(TensorStore(device, slot_specs, initial))
        return state

