"""The training runtime, with the interface of ``onnxruntime.training.api``.

Migrating from onnxruntime-training means changing the import:

    >>> from traingraph.api import CheckpointState, Module, Optimizer, LinearLRScheduler
    >>> state = CheckpointState.load_checkpoint("artifacts/checkpoint")
    >>> model = Module("artifacts/training_model.onnx", state, "artifacts/eval_model.onnx")
    >>> optimizer = Optimizer("artifacts/optimizer_model.onnx", model)
    >>> model.train()
    >>> loss = model(x, y)
    >>> optimizer.step()
    >>> model.lazy_reset_grad()

The graphs are plain ONNX run by stock onnxruntime; parameters, gradients and optimizer state
stay in device buffers bound with IOBinding between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort
from onnx import helper

from traingraph.checkpoint import CheckpointData, load_checkpoint_data, save_checkpoint_data
from traingraph.checkpoint.state import PropertyTypeError, check_matches_model
from traingraph.errors import (
    ArgumentTypeError,
    CheckpointError,
    ModelError,
    NonFiniteLossError,
    TraingraphError,
    UsageError,
    reports_load_errors,
)
from traingraph.ir.model import max_ir_version, to_proto
from traingraph.ir.model import save as save_model
from traingraph.limits import check_model_proto
from traingraph.onnxblock._training import (
    ACCUMULATION_BUFFER,
    ACCUMULATION_OUT,
    LAZY_RESET_GRAD,
)
from traingraph.optim import (
    ParamInfo,
    build_flat_optimizer_model,
    build_optimizer_model,
    flattenable,
    from_hyperparameters,
    state_slots,
)
from traingraph.optim.schedulers import (
    ConstantLRScheduler,
    CosineLRScheduler,
    ExponentialLRScheduler,
    LinearLRScheduler,
    StepLRScheduler,
)
from traingraph.precision import GRADS_FINITE, LOSS_SCALE
from traingraph.program import BUFFER_UPDATE_SUFFIX
from traingraph.runtime import conv_grads, segments
from traingraph.runtime.amp import DynamicLossScaler
from traingraph.runtime.device import Device, parse_device
from traingraph.runtime.fused import fused_update
from traingraph.runtime.optimizer import FlatLayout, flat_layout, optimizer_step
from traingraph.runtime.session import (
    BoundRunner,
    SessionConfig,
    check_feeds,
    create_session,
    ort_type_to_numpy,
)
from traingraph.runtime.state import TrainingState
from traingraph.runtime.tensors import PingPong, TensorStore

__all__ = [
    "CheckpointState",
    "ConstantLRScheduler",
    "CosineLRScheduler",
    "ExponentialLRScheduler",
    "LinearLRScheduler",
    "Module",
    "Optimizer",
    "Parameter",
    "StepLRScheduler",
]

# Larger training models keep their Conv weight gradients in the graph: splitting them out
# means holding the model, weights included, in memory once more.
_NATIVE_SPLIT_MAX_BYTES = 1 << 30

PropertyValue = int | float | str


NOT_LOADED = "Please load the model parameters first."
"""How the errors raised for a nominal checkpoint's missing values begin (onnxruntime's words)."""


class Parameter:
    """One parameter of a :class:`CheckpointState`: ``.data``, ``.grad``, ``.requires_grad``."""

    def __init__(self, state: CheckpointState, name: str) -> None:
        self._state = state
        self.name = name

    @property
    def data(self) -> np.ndarray:
        """A host copy of the current value; assigning copies the new value in."""
        return self._state._read(self.name)

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._state._write(self.name, np.asarray(value))

    @property
    def grad(self) -> np.ndarray | None:
        """The accumulated gradient: zeros before the first train step; None for a frozen
        parameter."""
        if not self.requires_grad:
            return None
        runtime = self._state._runtime
        grad = None if runtime is None else runtime.read_grad(self.name)
        if grad is None:
            spec = self._state._data.parameters[self.name]
            return np.zeros(spec.shape, spec.dtype)
        return grad

    @property
    def requires_grad(self) -> bool:
        return bool(self._state._data.requires_grad.get(self.name, False))

    def __repr__(self) -> str:
        shape = tuple(self._state._data.parameters[self.name].shape)
        return f"Parameter({self.name!r}, shape={shape}, requires_grad={self.requires_grad})"


class Parameters:
    """The parameters of a :class:`CheckpointState`, as in onnxruntime-training.

    ``params[name]`` is a :class:`Parameter`; ``params[name] = array`` sets its value;
    ``name in params`` and ``len(params)`` work by name; iterating yields ``(name, Parameter)``
    pairs (as onnxruntime does); ``keys()``, ``values()`` and ``items()`` as a dict's.

    Reading a parameter of a nominal checkpoint before its value is loaded raises, and so does
    setting one while any is missing: load all values at once with
    :meth:`Module.copy_buffer_to_parameters` (``trainable_only=False``).
    """

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def _check(self, name: str) -> None:
        if name not in self._state._data.parameters:
            raise KeyError(
                f"no parameter {name!r}; the checkpoint has"
                f" {list(self._state._data.parameters)[:10]}"
            )

    def __getitem__(self, name: str) -> Parameter:
        self._check(name)
        if name in self._state._unloaded():
            raise CheckpointError(
                f"Please load the parameter states first: parameter {name!r} of this nominal"
                " checkpoint has no value yet. Load the values with"
                " Module.copy_buffer_to_parameters(buffer, trainable_only=False)."
            )
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._check(name)
        unloaded = self._state._unloaded()
        if unloaded:
            raise CheckpointError(
                f"Please load all the parameter states first: this nominal checkpoint has no"
                f" values for {sorted(unloaded)[:5]} yet. Load them all with"
                " Module.copy_buffer_to_parameters(buffer, trainable_only=False)."
            )
        self._state._write(name, np.asarray(value))

    def __contains__(self, name: object) -> bool:
        return name in self._state._data.parameters

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        return iter(self.items())

    def __len__(self) -> int:
        return len(self._state._data.parameters)

    def keys(self) -> list[str]:
        return list(self._state._data.parameters)

    def values(self) -> list[Parameter]:
        return [self[name] for name in self._state._data.parameters]

    def items(self) -> list[tuple[str, Parameter]]:
        return [(name, self[name]) for name in self._state._data.parameters]


class Properties:
    """The property bag: int, float and str values saved with the checkpoint.

    ``props[key]`` reads, ``props[key] = value`` sets, ``del props[key]`` removes; ``key in
    props`` and ``len(props)`` work by key; iterating yields ``(key, value)`` pairs (as
    onnxruntime does); ``get``, ``keys()``, ``values()`` and ``items()`` as a dict's.
    """

    def __init__(self, values: dict[str, PropertyValue]) -> None:
        self._values = values

    def __getitem__(self, key: str) -> PropertyValue:
        return self._values[key]

    def __setitem__(self, key: str, value: PropertyValue) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise PropertyTypeError(
                f"property {key!r} must be an int, float or str, got {type(value).__name__};"
                " convert it (e.g. str(value)) before storing it"
            )
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[tuple[str, PropertyValue]]:
        return iter(list(self._values.items()))

    def __len__(self) -> int:
        return len(self._values)

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def keys(self) -> list[str]:
        return list(self._values)

    def values(self) -> list[PropertyValue]:
        return list(self._values.values())

    def items(self) -> list[tuple[str, PropertyValue]]:
        return list(self._values.items())


class CheckpointState:
    """Parameters, optimizer state and properties; shared by a :class:`Module` and its
    :class:`Optimizer`.

    Example:
        >>> state = CheckpointState.load_checkpoint("artifacts/checkpoint")
        >>> state.parameters["fc1.weight"].data.shape
        (256, 784)
        >>> state.properties["epoch"] = 3
        >>> CheckpointState.save_checkpoint(state, "ckpt", include_optimizer_state=True)
    """

    def __init__(self, data: CheckpointData) -> None:
        self._data = data
        self._runtime: TrainingState | None = None
        self.properties = Properties(data.properties)

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Load a checkpoint in traingraph's format or onnxruntime-training's."""
        return cls(load_checkpoint_data(checkpoint_uri))

    @classmethod
    def save_checkpoint(
        cls,
        state: CheckpointState,
        checkpoint_uri: str | os.PathLike,
        include_optimizer_state: bool = False,
        *,
        format: str = "native",
    ) -> None:
        """Save ``state`` atomically ("native" safetensors, or "ort" for onnxruntime-training)."""
        save_checkpoint_data(
            state._snapshot(include_optimizer_state),
            checkpoint_uri,
            format=format,
            include_optimizer_state=include_optimizer_state,
        )

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    # ---------------------------------------------------------------- internal
    def _snapshot(self, include_optimizer_state: bool) -> CheckpointData:
        if self._runtime is None:
            data = self._data
            return CheckpointData(
                parameters=dict(data.parameters),
                requires_grad=dict(data.requires_grad),
                optimizer_state=dict(data.optimizer_state) if include_optimizer_state else {},
                optimizer_step=data.optimizer_step,
                learning_rate=data.learning_rate,
                properties=dict(self.properties),
                nominal=data.nominal,
            )
        return self._runtime.to_checkpoint_data(dict(self.properties), include_optimizer_state)

    def _unloaded(self) -> set[str]:
        """The parameters of a nominal checkpoint that have no value yet."""
        if self._runtime is not None:
            return set(self._runtime.unloaded)
        return set(self._data.parameters) if self._data.nominal else set()

    def _read(self, name: str) -> np.ndarray:
        if name not in self._data.parameters:
            raise KeyError(name)
        if self._runtime is not None:
            return self._runtime.read(name)
        return np.array(self._data.parameters[name], copy=True)

    def _write(self, name: str, value: np.ndarray) -> None:
        current = self._data.parameters[name]
        if tuple(value.shape) != tuple(current.shape):
            raise ModelError(
                f"parameter {name!r} has shape {list(current.shape)}; got {list(value.shape)}"
            )
        if self._runtime is not None:
            self._runtime.write(name, value)
        else:
            self._data.parameters[name] = np.array(value, dtype=current.dtype, copy=True)

    def _attach(self, device: Device, buffers: set[str]) -> TrainingState:
        if self._runtime is None:
            self._runtime = TrainingState(self._data, device, buffers)
        elif self._runtime.device != device:
            raise ModelError(
                f"this checkpoint state already lives on {self._runtime.device}; a Module on"
                f" {device} needs its own state: load the checkpoint again"
            )
        return self._runtime


def _model_input_names(
    path: str | os.PathLike, state: CheckpointData | None = None
) -> tuple[list[str], list[str]]:
    """The model's input and output names, once its declared sizes (and, given ``state``, the
    checkpoint's parameters) are checked against it."""
    model = onnx.load(os.fspath(path), load_external_data=False)
    check_model_proto(model, f"model {os.fspath(path)!r}")
    if state is not None:
        check_matches_model(state, model.graph.input, os.fspath(path), "(the CheckpointState)")
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output]


class Module:
    """Runs the training and eval graphs on a device.

    Args:
        train_model_uri: Path of ``training_model.onnx``.
        state: The :class:`CheckpointState` holding the parameters.
        eval_model_uri: Path of ``eval_model.onnx`` (needed for :meth:`eval` mode).
        device: "cpu", "cuda" or "cuda:N".
        session_options: An ``onnxruntime.SessionOptions`` that every session of this Module
            (and of its :class:`Optimizer`) is created with, in place of the options
            ``session_config`` makes; e.g. one with ``register_custom_ops_library(path)`` for
            a model with custom ops.
        session_config: onnxruntime session settings (threads, optimization level, spinning).

    Attributes:
        loss_scaler: For a model generated with ``mixed_precision``, the
            :class:`~traingraph.runtime.amp.DynamicLossScaler` whose scale each train step
            uses and which :meth:`Optimizer.step` updates; None otherwise.
    """

    training: bool

    @reports_load_errors("train_model_uri", "training model")
    def __init__(
        self,
        train_model_uri: str | os.PathLike,
        state: CheckpointState,
        eval_model_uri: str | os.PathLike | None = None,
        device: str | Device = "cpu",
        session_options: ort.SessionOptions | None = None,
        session_config: SessionConfig | None = None,
    ) -> None:
        if not isinstance(state, CheckpointState):
            raise ArgumentTypeError(
                f"state must be a CheckpointState, got {type(state).__name__}; load one with"
                " CheckpointState.load_checkpoint(path)"
            )
        self._device = parse_device(device)
        self._config = session_config or SessionConfig()
        if session_options is not None:
            self._config = _WithSessionOptions.of(self._config, session_options)
        self._state = state
        self._train_uri = Path(train_model_uri)
        self._eval_uri = Path(eval_model_uri) if eval_model_uri is not None else None
        if not self._train_uri.is_file():
            raise ModelError(f"training model {str(self._train_uri)!r} does not exist")
        if self._eval_uri is not None and not self._eval_uri.is_file():
            raise ModelError(f"eval model {str(self._eval_uri)!r} does not exist")
        params = set(state._data.parameters)
        inputs, outputs = _model_input_names(self._train_uri, state._data)
        missing = [n for n, r in state._data.requires_grad.items() if r and n not in inputs]
        if missing:
            raise CheckpointError(
                f"the checkpoint's trainable parameters {missing[:5]} are not inputs of"
                f" {str(self._train_uri)!r}; the checkpoint and the model do not belong together"
            )
        self._trainable = [n for n in state._data.parameters if state._data.requires_grad.get(n)]
        # A training model of onnxblock.TrainingBlock names its gradients
        # "<name>_grad.accumulation.out" and takes gradient buffers and lazy_reset_grad; the
        # Module accumulates on its own, so it feeds zeros and True (each run's own gradient).
        self._grad_names = {n: _grad_output(n, outputs) for n in self._trainable}
        self._accumulation_feeds = _accumulation_feeds(inputs, state._data.parameters)
        grad_outputs = set(self._grad_names.values())
        self._buffer_outputs = {
            o: o[: -len(BUFFER_UPDATE_SUFFIX)]
            for o in outputs
            if o.endswith(BUFFER_UPDATE_SUFFIX) and o[: -len(BUFFER_UPDATE_SUFFIX)] in params
        }
        self._train_inputs = [
            n
            for n in inputs
            if n not in params and n != LOSS_SCALE and n not in self._accumulation_feeds
        ]
        self._train_outputs = [
            o
            for o in outputs
            if o not in grad_outputs and o not in self._buffer_outputs and o != GRADS_FINITE
        ]
        # Mixed-precision graphs take a loss scale and say whether their gradients are finite.
        self.loss_scaler = DynamicLossScaler() if LOSS_SCALE in inputs else None
        self._grads_finite = True
        self._runtime = state._attach(self._device, set(self._buffer_outputs.values()))
        train_model, self._native_grads, kernels = self._split_native()
        self._native_threads = conv_grads.default_threads(self._config.intra_op_threads)
        self._train: BoundRunner | segments.SegmentedRunner
        if kernels:
            assert isinstance(train_model, onnx.ModelProto)
            self._train = segments.runner(
                train_model,
                kernels,
                lambda model: create_session(model, self._device, self._config),
                self._device,
                self._native_threads,
                self._native_grads,
            )
        else:
            self._train = BoundRunner(
                create_session(train_model, self._device, self._config), self._device
            )
        # the weight gradients computed after each run, from values the run returns
        self._after_run = segments.after_run(self._train, self._native_grads)
        self._native_params = conv_grads.native_params(self._after_run)
        self._native_values = conv_grads.run_outputs(self._after_run, inputs)
        self._train_params = [n for n in inputs if n in params]
        self._eval: BoundRunner | None = None
        self._eval_inputs: list[str] = []
        self._eval_outputs: list[str] = []
        self._eval_params: list[str] = []
        if self._eval_uri is not None:
            e_inputs, e_outputs = _model_input_names(self._eval_uri)
            self._eval_inputs = [n for n in e_inputs if n not in params]
            self._eval_outputs = list(e_outputs)
            self._eval_params = [n for n in e_inputs if n in params]
        self._accumulator: BoundRunner | None = None
        self._accumulated: TensorStore | None = None  # the sum's target; swaps with the grads
        # Outputs of a static shape get buffers once; calls return copies of them.
        self._fixed_outputs = _preallocated_outputs(self._train, self._train_outputs)
        self._checked: set[tuple[object, ...]] = set()  # input signatures already validated
        self.training = True
        self._lock = threading.Lock()  # one step at a time: calls from threads are serialized
        self._loss_finite = True  # every train step since the gradients were reset

    def _split_native(
        self,
    ) -> tuple[
        Path | onnx.ModelProto,
        list[conv_grads.WeightGrad],
        list[tuple[segments.Kernel, set[int]]],
    ]:
        """The training model to run, the Conv weight gradients computed natively beside it
        (:mod:`traingraph.runtime.conv_grads`) and the BatchNormalization gradients computed
        natively between its segments (:mod:`traingraph.runtime.segments`); on the CPU, where
        enabled and built."""
        config = self._config
        native = config.native_conv_grads or config.native_segments
        if not (self._device.kind == "cpu" and native and conv_grads.AVAILABLE):
            return self._train_uri, [], []
        if self._train_uri.stat().st_size > _NATIVE_SPLIT_MAX_BYTES:
            return self._train_uri, [], []  # with its weights inline the copy grows large
        proto = onnx.load(self._train_uri)
        if proto.ByteSize() > _NATIVE_SPLIT_MAX_BYTES:
            return self._train_uri, [], []
        model, grads = proto, list[conv_grads.WeightGrad]()
        if config.native_conv_grads:
            model, grads = conv_grads.split_weight_grads(proto)
        kernels: list[tuple[segments.Kernel, set[int]]] = []
        if config.native_segments:
            model, kernels = segments.find_kernels(model, grads)
        if not grads and not kernels:
            return self._train_uri, [], []
        return model, grads, kernels

    # ----------------------------------------------------------------- modes
    def train(self, mode: bool = True) -> Module:
        """Switch to training mode (forward + gradients) or, with ``mode=False``, eval mode."""
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Switch to eval mode (forward + loss, Dropout off, BatchNorm on running stats)."""
        if self._eval_uri is None:
            raise ModelError(
                "this Module has no eval model; create it with"
                " Module(train_model_uri, state, eval_model_uri=...)"
            )
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """Make the next train step overwrite the gradients instead of adding to them."""
        self._runtime.reset_grads_pending = True

    def input_names(self) -> list[str]:
        """The inputs a call takes, in order, for the current mode."""
        return list(self._train_inputs if self.training else self._eval_inputs)

    def output_names(self) -> list[str]:
        """The outputs a call returns, in order, for the current mode."""
        return list(self._train_outputs if self.training else self._eval_outputs)

    # -------------------------------------------------------------- running
    def __call__(self, *user_inputs: Any, **named_inputs: Any) -> Any:
        """Run one train step (forward + gradients) or, in eval mode, a forward pass.

        Inputs are numpy arrays or OrtValues, positionally in :meth:`input_names` order or by
        name. Returns the outputs, one value or a list when there are several: OrtValues on the
        Module's device when every input is an OrtValue, else numpy arrays.
        """
        _require_loaded(self._runtime)
        names = self.input_names()
        if user_inputs and named_inputs:
            raise ModelError("pass the inputs either positionally or by name, not both")
        if len(user_inputs) == 1 and isinstance(user_inputs[0], Mapping):
            feeds = dict(user_inputs[0])
        elif named_inputs:
            feeds = named_inputs
        else:
            if len(user_inputs) != len(names):
                raise ModelError(
                    f"got {len(user_inputs)} inputs, but the"
                    f" {'training' if self.training else 'eval'}"
                    f" model takes {len(names)}: {names}"
                )
            feeds = dict(zip(names, user_inputs))
        as_ortvalues = bool(feeds) and all(isinstance(v, ort.OrtValue) for v in feeds.values())
        feeds = {k: _as_feed(v) for k, v in feeds.items()}
        with self._lock, _run_errors(feeds, self.training):
            if self.training:
                runtime = self._runtime
                accumulating = not runtime.reset_grads_pending and runtime.grads_valid
                outputs = self._train_step(feeds)
                fixed = self._fixed_outputs
                finite = _finite_loss(outputs[self.output_names()[0]])
                self._loss_finite = finite and (self._loss_finite or not accumulating)
            else:
                outputs, fixed = self._eval_step(feeds), {}
        values: list[Any]
        if as_ortvalues:  # the fixed outputs' buffers are written again by the next call
            values = [
                self._device_copy(outputs[n]) if n in fixed else outputs[n]
                for n in self.output_names()
            ]
        else:
            values = [
                outputs[n].numpy().copy() if n in fixed else outputs[n].numpy()
                for n in self.output_names()
            ]
        return values[0] if len(values) == 1 else values

    def _device_copy(self, value: ort.OrtValue) -> ort.OrtValue:
        device = self._device
        return ort.OrtValue.ortvalue_from_numpy(
            value.numpy().copy(), device.ort_device_type, device.index
        )

    def _check_feeds(
        self,
        runner: BoundRunner | segments.SegmentedRunner,
        names: list[str],
        feeds: dict[str, Any],
    ) -> None:
        """Validate ``feeds`` against the model once per distinct names / shapes / dtypes."""
        signature = tuple(
            (k, tuple(v.shape()), v.data_type())
            if isinstance(v, ort.OrtValue)
            else (k, v.shape, v.dtype)
            for k, v in feeds.items()
        )
        if signature not in self._checked:
            check_feeds(runner.inputs, names, feeds)
            if len(self._checked) >= 256:  # many shapes (e.g. variable lengths): stay small
                self._checked.clear()
            self._checked.add(signature)

    def _train_step(self, feeds: dict[str, Any]) -> dict[str, ort.OrtValue]:
        runner, state = self._train, self._runtime
        self._check_feeds(runner, self._train_inputs, feeds)
        for name, value in feeds.items():
            runner.bind_input(name, value)
        for name in self._train_params:
            runner.bind_input(name, state.ortvalue(name))
        for name, value in self._accumulation_feeds.items():
            runner.bind_input(name, value)
        if self.loss_scaler is not None:
            runner.bind_input(LOSS_SCALE, np.array(self.loss_scaler.scale, np.float32))
        accumulate = not state.reset_grads_pending and state.grads_valid
        if accumulate and state.grad_scratch is None:
            state.grad_scratch = state.grads.like()
        target = state.grad_scratch if accumulate else state.grads
        assert target is not None
        outs: dict[str, ort.OrtValue | None] = {
            self._grad_names[name]: target.ortvalue(name)
            for name in self._trainable
            if name not in self._native_params
        }
        for name in self._native_values:
            outs[name] = None
        for out, buffer in self._buffer_outputs.items():
            outs[out] = state.buffers.alt.ortvalue(buffer)
        for name in self._train_outputs:
            outs[name] = self._fixed_outputs.get(name)
        if self.loss_scaler is not None:
            outs[GRADS_FINITE] = None
        outputs = runner.run(outs)
        if self._after_run:
            conv_grads.compute_after_run(
                self._after_run, outputs, feeds, target, self._native_threads
            )
        if self.loss_scaler is not None:
            finite = bool(outputs[GRADS_FINITE].numpy())
            self._grads_finite = finite and (self._grads_finite or not accumulate)
        if accumulate:
            self._accumulate()
        if self._buffer_outputs:
            state.buffers.swap()
        state.grads_valid = True
        state.reset_grads_pending = False
        return outputs

    def _accumulate(self) -> None:
        state = self._runtime
        scratch = state.grad_scratch
        assert scratch is not None
        if self._device.kind == "cpu":
            for name in self._trainable:
                view, extra = state.grads.view(name), scratch.view(name)
                assert view is not None and extra is not None
                np.add(view, extra, out=view)
            return
        if self._accumulator is None:
            self._accumulator = BoundRunner(
                create_session(_accumulator_model(state.grads), self._device, self._config),
                self._device,
            )
        if self._accumulated is None:
            self._accumulated = state.grads.like()
        total = self._accumulated
        outs: dict[str, ort.OrtValue | None] = {}
        for i, name in enumerate(self._trainable):
            self._accumulator.bind_input(f"a{i}", state.grads.ortvalue(name))
            self._accumulator.bind_input(f"b{i}", scratch.ortvalue(name))
            outs[f"s{i}"] = total.ortvalue(name)
        self._accumulator.run(outs)
        self._accumulated, state.grads = state.grads, total

    def _eval_step(self, feeds: dict[str, Any]) -> dict[str, ort.OrtValue]:
        if self._eval is None:
            assert self._eval_uri is not None
            self._eval = BoundRunner(
                create_session(self._eval_uri, self._device, self._config), self._device
            )
        runner, state = self._eval, self._runtime
        self._check_feeds(runner, self._eval_inputs, feeds)
        for name, value in feeds.items():
            runner.bind_input(name, value)
        for name in self._eval_params:
            runner.bind_input(name, state.ortvalue(name))
        return runner.run(dict.fromkeys(self._eval_outputs))

    # ---------------------------------------------------------- parameters
    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """All parameters (or the trainable ones) as one flat OrtValue on the Module's device,
        in checkpoint order."""
        runtime = self._runtime
        _require_loaded(runtime, runtime.trainable.cur if trainable_only else runtime.names)
        flat = runtime.contiguous(trainable_only)
        device = self._device
        # An OrtValue that owns its memory: ortvalue_from_numpy would only borrow ``flat``.
        value = ort.OrtValue.ortvalue_from_shape_and_type(
            list(flat.shape), flat.dtype, device.ort_device_type, device.index
        )
        value.update_inplace(flat)
        return value

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """Number of elements that :meth:`get_contiguous_parameters` returns."""
        return self._runtime.parameters_size(trainable_only)

    def copy_buffer_to_parameters(
        self, buffer: ort.OrtValue | np.ndarray, trainable_only: bool = True
    ) -> None:
        """Set the parameters from one flat buffer (as returned by get_contiguous_parameters)."""
        array = buffer.numpy() if isinstance(buffer, ort.OrtValue) else np.asarray(buffer)
        self._runtime.load_contiguous(array, trainable_only)

    # -------------------------------------------------------------- export
    def export_model_for_inferencing(
        self, inference_model_uri: str | os.PathLike, graph_output_names: Sequence[str]
    ) -> None:
        """Write a plain inference model with the current weights and only the given outputs."""
        if self._eval_uri is None:
            raise ModelError(
                "exporting needs the eval model; create the Module with eval_model_uri=..."
            )
        export_inference_model(
            onnx.load(os.fspath(self._eval_uri)),
            {n: self._runtime.read(n) for n in self._runtime.names},
            graph_output_names,
            inference_model_uri,
        )


def _finite_loss(value: ort.OrtValue) -> bool:
    """Whether a scalar loss on the host is finite; True for other outputs and device values."""
    if value.device_name().lower() != "cpu" or int(np.prod(value.shape())) != 1:
        return True
    return bool(np.isfinite(value.numpy()).all())


@contextlib.contextmanager
def _run_errors(feeds: Mapping[str, Any], training: bool) -> Iterator[None]:
    """Turns a failure of onnxruntime on valid-looking inputs into a ModelError naming the
    inputs' shapes and the range of their integer values (labels out of range are the most
    common cause)."""
    try:
        yield
    except TraingraphError:
        raise
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "onnxruntime" and not isinstance(
            exc, RuntimeError
        ):
            raise
        described = []
        for name, value in feeds.items():
            array = value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)
            text = f"{name!r} {array.dtype} {list(array.shape)}"
            if array.dtype.kind in "iu" and array.size:
                text += f" with values {array.min()}..{array.max()}"
            described.append(text)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"the {'training' if training else 'eval'} model failed on the inputs"
            f" {', '.join(described)}: {message}. Check that class labels lie in [0, number of"
            " classes), that every input has the model's batch size and that the values are"
            " finite"
        ) from exc


def _grad_output(param: str, outputs: Sequence[str]) -> str:
    """The training model's output holding ``param``'s gradient: ``<param>_grad``, or
    onnxblock.TrainingBlock's ``<param>_grad.accumulation.out``."""
    accumulated = f"{param}_grad{ACCUMULATION_OUT}"
    return accumulated if accumulated in outputs else f"{param}_grad"


def _accumulation_feeds(
    inputs: Sequence[str], parameters: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Values for the gradient-buffer inputs and ``lazy_reset_grad`` of an
    onnxblock.TrainingBlock training model (none for other models): zeros and True."""
    feeds: dict[str, np.ndarray] = {}
    for name in inputs:
        param = name[: -len(ACCUMULATION_BUFFER)] if name.endswith(ACCUMULATION_BUFFER) else None
        if param is not None and param.endswith("_grad") and param[:-5] in parameters:
            value = parameters[param[:-5]]
            feeds[name] = np.zeros(value.shape, value.dtype)
        elif name == LAZY_RESET_GRAD:
            feeds[name] = np.ones(1, np.bool_)
    return feeds if LAZY_RESET_GRAD in feeds else {}


def _per_tensor_optimizer(proto: onnx.ModelProto, module: Module) -> onnx.ModelProto:
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
    specs = module._runtime.trainable.cur.specs
    infos = [ParamInfo(n, tuple(specs[n][0]), np.dtype(specs[n][1])) for n in module._trainable]
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    model = build_optimizer_model(optimizer, infos, opset)
    model.metadata_props.extend(proto.metadata_props)
    return model


def _require_loaded(runtime: TrainingState, names: Any = None) -> None:
    """Raise where a nominal checkpoint's parameters (among ``names``; default: all) have no
    values yet."""
    missing = runtime.unloaded if names is None else runtime.unloaded & set(names)
    if missing:
        raise CheckpointError(
            f"{NOT_LOADED} The checkpoint is nominal and parameters {sorted(missing)[:5]} have no"
            " values yet; load them with Module.copy_buffer_to_parameters(buffer,"
            " trainable_only=False)."
        )


@dataclasses.dataclass
class _WithSessionOptions(SessionConfig):
    """A :class:`SessionConfig` whose sessions use the caller's ``onnxruntime.SessionOptions``."""

    options: ort.SessionOptions | None = None

    @classmethod
    def of(cls, config: SessionConfig, options: ort.SessionOptions) -> _WithSessionOptions:
        if not isinstance(options, ort.SessionOptions):
            raise ArgumentTypeError(
                f"session_options must be an onnxruntime.SessionOptions, got"
                f" {type(options).__name__}; use session_config= for traingraph's SessionConfig"
            )
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(SessionConfig)}
        return cls(**fields, options=options)

    def session_options(self) -> ort.SessionOptions:
        assert self.options is not None
        return self.options


def export_inference_model(
    eval_model: onnx.ModelProto,
    parameters: Mapping[str, np.ndarray],
    graph_output_names: Sequence[str],
    path: str | os.PathLike,
) -> None:
    """Prune ``eval_model`` to ``graph_output_names``, embed ``parameters`` and save it."""
    if isinstance(graph_output_names, str) or not graph_output_names:
        raise ModelError("graph_output_names must be a non-empty list of tensor names")
    m = ir.from_proto(eval_model)
    graph = m.graph
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for o in node.outputs:
            values[o.name] = o
    missing = [n for n in graph_output_names if n not in values]
    if missing:
        raise ModelError(
            f"outputs {missing} are not tensors of the eval model; model outputs are"
            f" {[o.name for o in graph.outputs]}"
        )
    graph.outputs.clear()
    graph.outputs.extend(values[n] for n in graph_output_names)
    for value in list(graph.inputs):
        if value.name is not None and value.name in parameters:
            graph.inputs.remove(value)
            value.const_value = ir.tensor(
                np.ascontiguousarray(parameters[value.name]), name=value.name
            )
            graph.register_initializer(value)
    common_passes.RemoveUnusedNodesPass()(m)
    used = {v for node in graph for v in node.inputs} | set(graph.outputs)
    for value in list(graph.inputs):
        if value not in used:
            graph.inputs.remove(value)
    for name in [n for n, v in graph.initializers.items() if v not in used]:
        graph.initializers.pop(name)
    save_model(to_proto(m), path)


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


def _as_feed(value: Any) -> Any:
    if isinstance(value, ort.OrtValue):
        return value
    if (
        hasattr(value, "__dlpack__")
        and not isinstance(value, np.ndarray)
        and hasattr(value, "numpy")
    ):
        value = value.numpy()
    return np.ascontiguousarray(value)


def _flat_equivalent(
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

    With a ``layout`` (:func:`~traingraph.runtime.optimizer.flat_layout`) of the state's blocks
    (``size`` elements of parameters) that has the optimizer's slot kinds, the model updates the
    blocks themselves as one vector and the :class:`~traingraph.runtime.optimizer.FlatLayout`
    says how to bind it; else (:func:`~traingraph.optim.model.build_flat_optimizer_model`) it
    takes and returns the tensors one by one, as ``proto`` does, and the layout is None.
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
            np.dtype(helper_dtype(inputs[n].elem_type)),
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
    model = build_optimizer_model(optimizer, [flat], opset)
    model.graph.name = f"{optimizer.name}_flat_step"
    return model, FlatLayout(flat.name, size, dict(layout))


NONFINITE_POLICIES = ("raise", "skip", "apply")

GradientHook = Callable[[TensorStore, bool], bool]
"""``hook(grads, finite) -> finite``: see :meth:`Optimizer.register_gradient_hook`."""


class Optimizer:
    """Runs the optimizer graph over the module's parameters and gradients.

    Args:
        optimizer_uri: Path of ``optimizer_model.onnx``.
        module: The :class:`Module` whose parameters it updates.
        fused: Update all parameters at once: on the CPU in place with
            :mod:`traingraph.runtime.fused` (one pass over flat blocks) when it has this
            optimizer, else with the optimizer graph rewritten as one update of all parameters
            concatenated (:func:`~traingraph.optim.model.build_flat_optimizer_model`: a few
            kernels instead of a few per parameter, which a GPU step needs). The numbers are the
            optimizer graph's. False runs the optimizer model as the file holds it.
        nonfinite: What :meth:`step` does when the loss of a train step since the last update
            was NaN or infinite (checked on the loss, a scalar, where it is on the host), or,
            for an optimizer that clips by a gradient norm, when a gradient on the host is
            (its norm would be, and clipping would make the parameters NaN):
            ``"raise"`` a :class:`~traingraph.errors.NonFiniteLossError` without updating,
            ``"skip"`` the update silently, or ``"apply"`` it as onnxruntime-training does.
            Either way but ``"apply"``, the gradients are dropped. A mixed-precision model's
            loss scaler handles non-finite gradients on its own.

    Example:
        >>> optimizer = Optimizer("artifacts/optimizer_model.onnx", module, nonfinite="skip")
    """

    @reports_load_errors("optimizer_uri", "optimizer model")
    def __init__(
        self,
        optimizer_uri: str | os.PathLike,
        module: Module,
        *,
        fused: bool = True,
        nonfinite: str = "raise",
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ModelError(
                f"nonfinite={nonfinite!r} is not a policy; expected one of {NONFINITE_POLICIES}"
            )
        self._nonfinite = nonfinite
        if not isinstance(module, Module):
            raise ArgumentTypeError(
                f"module must be a traingraph.api.Module, got {type(module).__name__}"
            )
        path = Path(optimizer_uri)
        if not path.is_file():
            raise ModelError(f"optimizer model {str(path)!r} does not exist")
        self._module = module
        state = module._runtime
        self._state = state
        proto = _per_tensor_optimizer(onnx.load(os.fspath(path)), module)
        meta = {p.key: p.value for p in proto.metadata_props}
        inputs = [i.name for i in proto.graph.input]
        trainable = module._trainable
        unknown = [n for n in trainable if n not in inputs]
        if unknown:
            raise ModelError(
                f"the optimizer model {str(path)!r} does not update parameters {unknown[:5]};"
                " it was generated for another model"
            )
        no_grads = [n for n in trainable if f"{n}_grad" not in inputs]
        if no_grads:
            raise ModelError(
                f"{str(path)!r} is not an optimizer model: it takes no gradient inputs for"
                f" {no_grads[:5]} (expected inputs named '<parameter>_grad'); pass the"
                " optimizer_model.onnx that generate_artifacts wrote, not the training or eval"
                " model"
            )
        known = {"learning_rate", "step", *trainable, *(f"{n}_grad" for n in trainable)}
        self._params = [n for n in inputs if n in trainable]
        slot_names = [n for n in inputs if n not in known]
        slot_init = json.loads(meta.get("traingraph.slot_init", "{}"))
        value_info = {i.name: i for i in proto.graph.input}
        # Slots of one kind (all "exp_avg", then all "exp_avg_sq", ...) lie next to each other
        # in the parameters' order, so a fused update covers each kind as one flat block.
        owners = {slot: state.slot_owner(slot) for slot in slot_names}
        order = {name: i for i, name in enumerate(state.trainable.cur)}
        kinds = list(dict.fromkeys(key for _, key in owners.values()))
        slot_names.sort(key=lambda s: (kinds.index(owners[s][1]), order.get(owners[s][0], -1)))
        specs = {}
        for name in slot_names:
            t = value_info[name].type.tensor_type
            dims = tuple(d.dim_value for d in t.shape.dim)
            specs[name] = (dims, helper_dtype(t.elem_type))
        if state.optimizer_slots is None or set(state.optimizer_slots.cur) != set(specs):
            store = TensorStore(state.device, specs)
            for name, (shape, dtype) in specs.items():
                if name in state.pending_slot_values:
                    store.write(name, state.pending_slot_values[name])
                else:
                    store.write(name, np.full(shape, slot_init.get(name, 0.0), dtype))
            state.optimizer_slots = PingPong(store)
        if state.learning_rate is None:
            state.learning_rate = float(meta.get("traingraph.learning_rate", 1e-3))
        # On the CPU a fused in-place update replaces the graph when one exists for this
        # optimizer; elsewhere the graph runs as one update of all parameters concatenated.
        # Both give the same numbers.
        self._fused = None
        hyperparameters = json.loads(meta.get("traingraph.hyperparameters", "null"))
        name = meta.get("traingraph.optimizer", "")
        if fused and state.device.kind == "cpu" and hyperparameters is not None:
            self._fused = fused_update(name, hyperparameters, threads=module._native_threads)
        self._clips_by_norm = any(
            (hyperparameters or {}).get(k) for k in ("clip_grad_norm", "max_grad_norm_per_tensor")
        )
        self._slot_keys = {
            name: {key: s for s, (owner, key) in owners.items() if owner == name}
            for name in self._params
        }
        layout = flat_layout(state, self._params, self._slot_keys)
        self._blocks = layout if self._fused is not None else None
        self._flat: FlatLayout | None = None
        self.graph_model: onnx.ModelProto = proto
        """The optimizer model the session runs: the file's, or its flat equivalent."""
        if fused and self._fused is None and hyperparameters is not None:
            size = state.trainable.cur.flat_size
            flat = _flat_equivalent(proto, name, hyperparameters, layout, size)
            if flat is not None:
                self.graph_model, self._flat = flat
        # a session runs the update where no fused update replaces it
        self._runner: BoundRunner | None = None
        if self._fused is None:
            session = create_session(self.graph_model, state.device, module._config)
            self._runner = BoundRunner(session, state.device)
        self._gradient_hooks: list[GradientHook] = []

    def register_gradient_hook(self, hook: GradientHook) -> None:
        """Call ``hook(grads, finite)`` in every :meth:`step`, between the gradients and the
        update: ``grads`` is the :class:`~traingraph.runtime.tensors.TensorStore` of the
        gradients on the device (one flat block: ``grads.flat`` on the CPU,
        ``grads.block(0, grads.flat_size)`` elsewhere), which the hook may change in place;
        ``finite`` says whether this step's loss (with a loss scaler: its gradients) is finite,
        and the hook returns the value the update goes by.
        :class:`traingraph.distributed.DataParallel` averages the gradients of several
        processes this way.
        """
        self._gradient_hooks.append(hook)

    def step(self) -> None:
        """Apply one optimizer update to the parameters with the current gradients.

        For a mixed-precision model the module's loss scaler sees the step first: when some
        gradient is inf or NaN the update is skipped (parameters, slots and the step count stay
        as they are) and the loss scale shrinks.
        """
        with self._module._lock:
            self._step()

    def _step(self) -> None:
        _require_loaded(self._state)
        if not self._state.grads_valid:
            raise UsageError(
                "Optimizer.step() was called before any train step computed gradients; call"
                " the Module on a batch (in training mode) first, then optimizer.step()"
            )
        module = self._module
        for hook in self._gradient_hooks:
            if module.loss_scaler is None:
                module._loss_finite = bool(hook(self._state.grads, module._loss_finite))
            else:
                module._grads_finite = bool(hook(self._state.grads, module._grads_finite))
        if module.loss_scaler is None and not module._loss_finite and self._nonfinite != "apply":
            self._state.reset_grads_pending = True  # the next train step starts afresh
            self._module._loss_finite = True
            if self._nonfinite == "skip":
                return
            raise NonFiniteLossError(
                "the loss of a train step since the last update is NaN or infinite, so its"
                " gradients are too; the update was not applied and the gradients are dropped."
                " Check the batch for NaN/Inf values, lower the learning rate, or pass"
                " Optimizer(..., nonfinite='skip') to skip such updates"
            )
        if (
            module.loss_scaler is None
            and self._clips_by_norm
            and self._nonfinite != "apply"
            and not self._grads_finite()
        ):
            self._state.reset_grads_pending = True
            if self._nonfinite == "skip":
                return
            raise NonFiniteLossError(
                "a gradient is NaN or infinite although the loss is finite, so the norm that"
                " gradient clipping divides by is too; the update was not applied and the"
                " gradients are dropped. Look for an op whose derivative is infinite where it"
                " is evaluated (Sqrt or Log at 0, Pow with a negative exponent), or pass"
                " Optimizer(..., nonfinite='skip') to skip such updates"
            )
        scaler = self._module.loss_scaler
        if scaler is not None and not scaler.update(self._module._grads_finite):
            return
        if self._fused is None:
            assert self._runner is not None
            optimizer_step(self._runner, self._state, self._flat)
            return
        state = self._state
        assert state.optimizer_slots is not None and state.learning_rate is not None
        lr = float(np.float32(state.learning_rate))
        params, grads, slots = state.trainable.cur.flat, state.grads.flat, state.optimizer_slots.cur
        if self._blocks is not None and params is not None and grads is not None:
            assert slots.flat is not None
            blocks = {key: slots.flat[start:stop] for key, (start, stop) in self._blocks.items()}
            self._fused(params, grads, blocks, lr=lr, step=state.step + 1)
            state.step += 1
            return
        for name, keys in self._slot_keys.items():
            self._fused(
                state.trainable.cur.host_view(name),
                state.grads.host_view(name),
                {key: state.optimizer_slots.cur.host_view(slot) for key, slot in keys.items()},
                lr=lr,
                step=state.step + 1,
            )
        state.step += 1

    def _grads_finite(self) -> bool:
        """Whether every gradient on the host is finite: one pass, a sum in float64, which is
        finite exactly where float32 or narrower terms are (float64 terms large enough to
        overflow it overflow the norm too). Gradients on another device count as finite."""
        grads = self._state.grads
        if self._state.device.kind != "cpu":
            return True
        views = [grads.flat] if grads.flat is not None else [grads.host_view(n) for n in grads]
        return all(np.isfinite(np.sum(v, dtype=np.float64)) for v in views)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate used by the next :meth:`step`."""
        lr = float(learning_rate)
        if not np.isfinite(lr) or lr < 0:
            raise ModelError(f"learning rate must be a finite number >= 0, got {learning_rate!r}")
        self._state.learning_rate = lr

    def get_learning_rate(self) -> float:
        """The learning rate of the next :meth:`step`."""
        assert self._state.learning_rate is not None
        return float(self._state.learning_rate)


def helper_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
