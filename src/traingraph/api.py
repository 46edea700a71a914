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
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from traingraph.checkpoint import CheckpointData, load_checkpoint_data, save_checkpoint_data
from traingraph.checkpoint.state import PropertyTypeError, check_matches_model
from traingraph.errors import (
    ArgumentTypeError,
    CheckpointError,
    ModelError,
    TraingraphError,
    UsageError,
    reports_load_errors,
)
from traingraph.limits import check_model_proto
from traingraph.losses import ClassLabels, class_labels
from traingraph.optim.schedulers import (
    ConstantLRScheduler,
    CosineLRScheduler,
    ExponentialLRScheduler,
    LinearLRScheduler,
    StepLRScheduler,
)
from traingraph.program import BUFFER_UPDATE_SUFFIX, export_inference_model
from traingraph.runtime.cpu.segments import SegmentedRunner
from traingraph.runtime.device import Device, parse_device
from traingraph.runtime.optimizer import OptimizerUpdate
from traingraph.runtime.session import (
    BoundRunner,
    SessionConfig,
    WithSessionOptions,
    check_feeds,
    create_session,
)
from traingraph.runtime.state import TrainingState
from traingraph.runtime.step import GradientHook, TrainStep

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
            # the runtime holds the values from now on: keep their shapes and dtypes only
            stubs = {n: _stub(a) for n, a in self._data.parameters.items()}
            self._data = dataclasses.replace(self._data, parameters=stubs, optimizer_state={})
        elif self._runtime.device != device:
            raise ModelError(
                f"this checkpoint state already lives on {self._runtime.device}; a Module on"
                f" {device} needs its own state: load the checkpoint again"
            )
        return self._runtime


def _stub(array: np.ndarray) -> np.ndarray:
    """A read-only array of ``array``'s shape and dtype that holds one element."""
    return np.broadcast_to(np.zeros((), array.dtype), array.shape)


def _model_input_names(
    path: str | os.PathLike, state: CheckpointData | None = None
) -> tuple[list[str], list[str], dict[str, ClassLabels]]:
    """The model's input and output names and its class-index label inputs
    (:func:`traingraph.losses.class_labels`), once its declared sizes (and, given ``state``,
    the checkpoint's parameters) are checked against it."""
    model = onnx.load(os.fspath(path), load_external_data=False)
    check_model_proto(model, f"model {os.fspath(path)!r}")
    if state is not None:
        check_matches_model(state, model.graph.input, os.fspath(path), "(the CheckpointState)")
    names = [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    return *names, class_labels(model)


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
        step: The :class:`~traingraph.runtime.step.TrainStep` that runs the training graph.
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
        device = parse_device(device)
        config = session_config or SessionConfig()
        if session_options is not None:
            config = WithSessionOptions.of(config, session_options)
        self._state = state
        train_uri = Path(train_model_uri)
        self._eval_uri = Path(eval_model_uri) if eval_model_uri is not None else None
        if not train_uri.is_file():
            raise ModelError(f"training model {str(train_uri)!r} does not exist")
        if self._eval_uri is not None and not self._eval_uri.is_file():
            raise ModelError(f"eval model {str(self._eval_uri)!r} does not exist")
        params = set(state._data.parameters)
        inputs, outputs, self._labels = _model_input_names(train_uri, state._data)
        missing = [n for n, r in state._data.requires_grad.items() if r and n not in inputs]
        if missing:
            raise CheckpointError(
                f"the checkpoint's trainable parameters {missing[:5]} are not inputs of"
                f" {str(train_uri)!r}; the checkpoint and the model do not belong together"
            )
        suffix = BUFFER_UPDATE_SUFFIX
        buffers = {o[: -len(suffix)] for o in outputs if o.endswith(suffix)}
        runtime = state._attach(device, buffers & params)
        self.step = TrainStep.for_model(train_uri, runtime, config, inputs, outputs)
        self.loss_scaler = self.step.loss_scaler
        self._eval: BoundRunner | None = None
        self._eval_inputs: list[str] = []
        self._eval_outputs: list[str] = []
        self._eval_params: list[str] = []
        if self._eval_uri is not None:
            e_inputs, e_outputs, e_labels = _model_input_names(self._eval_uri)
            self._labels = {**e_labels, **self._labels}
            self._eval_inputs = [n for n in e_inputs if n not in params]
            self._eval_outputs = list(e_outputs)
            self._eval_params = [n for n in e_inputs if n in params]
        self._checked: set[tuple[object, ...]] = set()  # input signatures already validated
        self.training = True

    @property
    def device(self) -> Device:
        """The device the Module runs on."""
        return self.step.device

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
        self.step.state.reset_grads_pending = True

    def input_names(self) -> list[str]:
        """The inputs a call takes, in order, for the current mode."""
        return list(self.step.inputs if self.training else self._eval_inputs)

    def output_names(self) -> list[str]:
        """The outputs a call returns, in order, for the current mode."""
        return list(self.step.outputs if self.training else self._eval_outputs)

    # -------------------------------------------------------------- running
    def __call__(self, *user_inputs: Any, **named_inputs: Any) -> Any:
        """Run one train step (forward + gradients) or, in eval mode, a forward pass.

        Inputs are numpy arrays or OrtValues, positionally in :meth:`input_names` order or by
        name. Returns the outputs, one value or a list when there are several: OrtValues on the
        Module's device when every input is an OrtValue, else numpy arrays.
        """
        step = self.step
        _require_loaded(step.state)
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
        for name, allowed in self._labels.items():  # onnxruntime fails late or reads from the end
            if isinstance(feeds.get(name), np.ndarray):
                allowed.check(name, feeds[name])
        feeds = {k: _as_feed(v) for k, v in feeds.items()}
        with step.lock, _run_errors(feeds, self.training):
            if self.training:
                self._check_feeds(step.runner, names, feeds)
                outputs, fixed = step.run(feeds), step.fixed_outputs
            else:
                outputs, fixed = self._eval_step(feeds), {}
        # the next call writes the fixed outputs' buffers again, and the arrays of the outputs
        # a native CPU kernel writes (a model output of the last Conv's kernel): copies of them
        reused = set(fixed) | {n for n, v in outputs.items() if isinstance(v, np.ndarray)}
        values: list[Any] = []
        for name in self.output_names():
            value = outputs[name]
            if name in reused:
                value = self._device_copy(value) if as_ortvalues else _host_array(value).copy()
            elif not as_ortvalues:
                value = value.numpy()
            values.append(value)
        return values[0] if len(values) == 1 else values

    def _device_copy(self, value: ort.OrtValue | np.ndarray) -> ort.OrtValue:
        device = self.step.device
        return ort.OrtValue.ortvalue_from_numpy(
            _host_array(value).copy(), device.ort_device_type, device.index
        )

    def _check_feeds(
        self, runner: BoundRunner | SegmentedRunner, names: list[str], feeds: dict[str, Any]
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

    def _eval_step(self, feeds: dict[str, Any]) -> dict[str, ort.OrtValue]:
        step = self.step
        if self._eval is None:
            assert self._eval_uri is not None
            session = create_session(self._eval_uri, step.device, step.config)
            self._eval = BoundRunner(session, step.device)
        runner, state = self._eval, step.state
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
        runtime = self.step.state
        _require_loaded(runtime, runtime.trainable.cur if trainable_only else runtime.names)
        flat = runtime.contiguous(trainable_only)
        device = self.step.device
        # An OrtValue that owns its memory: ortvalue_from_numpy would only borrow ``flat``.
        value = ort.OrtValue.ortvalue_from_shape_and_type(
            list(flat.shape), flat.dtype, device.ort_device_type, device.index
        )
        value.update_inplace(flat)
        return value

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """Number of elements that :meth:`get_contiguous_parameters` returns."""
        return self.step.state.parameters_size(trainable_only)

    def copy_buffer_to_parameters(
        self, buffer: ort.OrtValue | np.ndarray, trainable_only: bool = True
    ) -> None:
        """Set the parameters from one flat buffer (as returned by get_contiguous_parameters)."""
        array = buffer.numpy() if isinstance(buffer, ort.OrtValue) else np.asarray(buffer)
        self.step.state.load_contiguous(array, trainable_only)

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
            {n: self.step.state.read(n) for n in self.step.state.names},
            graph_output_names,
            inference_model_uri,
        )



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
        if _UNSUPPORTED_TYPE.search(message):  # a kernel the provider lacks for a type
            hint = (
                "The execution provider has no kernel for that op in that element type;"
                " train the model in float32 there (on the CPU, float16 and bfloat16 ops are"
                " partly missing), or in mixed precision on CUDA (generate_artifacts("
                "mixed_precision=...))"
            )
        else:
            hint = (
                "Check that class labels lie in [0, number of classes), that every input has"
                " the model's batch size and that the values are finite"
            )
        raise ModelError(
            f"the {'training' if training else 'eval'} model failed on the inputs"
            f" {', '.join(described)}: {message}. {hint}"
        ) from exc


_UNSUPPORTED_TYPE = re.compile(
    r"data type is not supported|Could not find an implementation for|NOT_IMPLEMENTED", re.I
)
"""What onnxruntime says where a provider has no kernel of an op for an element type."""


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


def _host_array(value: ort.OrtValue | np.ndarray) -> np.ndarray:
    """``value``'s elements as a host array (``value`` itself where it is one)."""
    return value if isinstance(value, np.ndarray) else value.numpy()


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


NONFINITE_POLICIES = ("raise", "skip", "apply")


class Optimizer:
    """Runs the optimizer graph over the module's parameters and gradients.

    Args:
        optimizer_uri: Path of ``optimizer_model.onnx``.
        module: The :class:`Module` whose parameters it updates.
        fused: Update all parameters at once: on the CPU in place with the fused kernel of
            :mod:`traingraph.runtime.optimizer.fused` (one pass over flat blocks) when it has this
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

    Attributes:
        update: The :class:`~traingraph.runtime.optimizer.OptimizerUpdate` it applies.

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
        self._step = step = module.step
        self.update = OptimizerUpdate(
            onnx.load(os.fspath(path)),
            step.state,
            step.trainable,
            step.config,
            fused=fused,
            threads=step.gradients.threads,
            where=f"the optimizer model {str(path)!r}",
        )
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

    @property
    def graph_model(self) -> onnx.ModelProto:
        """The optimizer model the session runs: the file's, or its flat equivalent."""
        return self.update.graph_model

    def step(self) -> None:
        """Apply one optimizer update to the parameters with the current gradients.

        For a mixed-precision model the module's loss scaler sees the step first: when some
        gradient is inf or NaN the update is skipped (parameters, slots and the step count stay
        as they are) and the loss scale shrinks.
        """
        step = self._step
        with step.lock:
            _require_loaded(step.state)
            if not step.state.grads_valid:
                raise UsageError(
                    "Optimizer.step() was called before any train step computed gradients; call"
                    " the Module on a batch (in training mode) first, then optimizer.step()"
                )
            step.update(self.update, self._nonfinite, self._gradient_hooks)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Set the learning rate used by the next :meth:`step`."""
        self.update.set_learning_rate(learning_rate)

    def get_learning_rate(self) -> float:
        """The learning rate of the next :meth:`step`."""
        return self.update.get_learning_rate()
