"""CUDA-specific execution: provider options and whole-step CUDA graph capture.

onnxruntime's CUDA execution provider can capture a session's kernels into a CUDA graph
(``enable_cuda_graph``) and replay it in one launch. A captured graph reads and writes fixed
device addresses, so every input and output must be bound to a device buffer that stays put.
:class:`CudaGraphStep` does that for a whole training step (train graph, then optimizer graph):
each input batch is copied once into a fixed device buffer, and parameters, gradients, updated
buffers and optimizer slots stay in the :class:`~traingraph.runtime.state.TrainingState` that
the :class:`~traingraph.api.Module` owns. That state double-buffers what a step rewrites (it reads
one copy and writes the other, then swaps), so the step keeps one captured graph per buffer
layout (two in steady state), told apart by onnxruntime's ``gpu_graph_id`` run option.

Example:
    >>> module = Module("training_model.onnx", state, device="cuda")
    >>> step = CudaGraphStep(module, "optimizer_model.onnx")
    >>> for x, y in batches:
    ...     step(x, y)  # the loss stays on the GPU
    >>> float(step(x, y, fetch_loss=True))
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from traingraph.errors import DeviceError, ModelError
from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig, _ort_type_to_numpy
from traingraph.runtime.tensors import TensorStore

if TYPE_CHECKING:
    from traingraph.api import Module, Optimizer


def cuda_providers(device: Device, *, cuda_graph: bool = False, tf32: bool = True) -> list[Any]:
    """The execution providers, with options, for a CUDA session on ``device``.

    Args:
        device: A CUDA device.
        cuda_graph: Capture the session's kernels into a CUDA graph on the first runs and replay
            it afterwards (every node must run on the GPU, and inputs and outputs must be bound
            to device buffers that keep their addresses).
        tf32: Let float32 MatMul/Gemm/Conv use TensorFloat-32 tensor cores (about 10 bits of
            mantissa in the products; onnxruntime's default).
    """
    if device.kind != "cuda":
        raise DeviceError(f"cuda_providers needs a CUDA device, got {device}")
    options = {
        "device_id": str(device.index),
        "enable_cuda_graph": "1" if cuda_graph else "0",
        "use_tf32": "1" if tf32 else "0",
    }
    return [("CUDAExecutionProvider", options)]


def create_cuda_session(
    model: str | os.PathLike | bytes,
    device: Device,
    config: SessionConfig | None = None,
    *,
    cuda_graph: bool = False,
    tf32: bool = True,
) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``model`` on the CUDA ``device`` only (no CPU fallback).

    Raises:
        DeviceError: When onnxruntime cannot place the whole graph on the GPU while
            ``cuda_graph`` is asked for (the message says which check failed).
    """
    config = config or SessionConfig()
    source = os.fspath(model) if isinstance(model, (str, os.PathLike)) else model
    providers = cuda_providers(device, cuda_graph=cuda_graph, tf32=tf32)
    try:
        return ort.InferenceSession(source, config.session_options(), providers=providers)
    except Exception as error:  # onnxruntime raises its own exception types
        if not cuda_graph:
            raise
        raise DeviceError(
            f"onnxruntime could not capture {source if isinstance(source, str) else 'the model'}"
            f" into a CUDA graph: {error}. CUDA graphs need every node on the GPU and static"
            " shapes; run without cuda_graph, or export the model with a fixed batch size"
        ) from error


class CudaGraphStep:
    """One training step (forward, gradients, optimizer update) replayed as CUDA graphs.

    The step overwrites the gradients each time (no accumulation) and updates the
    ``module``'s training state in place, so the module's parameters, checkpoints and eval
    mode see every step. Batches must keep the shape and dtype of the first one.

    Args:
        module: A :class:`~traingraph.api.Module` on a CUDA device, in training mode.
        optimizer_uri: Path of ``optimizer_model.onnx``; an :class:`~traingraph.api.Optimizer`
            for it is available as :attr:`optimizer` (learning rate, step count).
        tf32: Let float32 matrix products and convolutions use TensorFloat-32.
    """

    def __init__(
        self, module: Module, optimizer_uri: str | os.PathLike, *, tf32: bool = True
    ) -> None:
        from traingraph.api import Optimizer

        device = module._device
        if device.kind != "cuda":
            raise DeviceError(
                f"CudaGraphStep needs a Module on a CUDA device; this one runs on {device}."
                " Create it with Module(..., device='cuda')"
            )
        self.module = module
        self.optimizer: Optimizer = Optimizer(optimizer_uri, module)
        self.device = device
        config = module._config
        self._train = create_cuda_session(
            module._train_uri, device, config, cuda_graph=True, tf32=tf32
        )
        self._optim = create_cuda_session(
            os.fspath(optimizer_uri), device, config, cuda_graph=True, tf32=tf32
        )
        self._inputs: TensorStore | None = None
        self._outputs = TensorStore(device, self._static_outputs())
        self._scalars = TensorStore(
            device, {"learning_rate": ((), np.dtype(np.float32)), "step": ((), np.dtype(np.int64))}
        )
        self._graphs: dict[tuple[int, ...], tuple[int, Any, Any, tuple[object, ...]]] = {}

    def _static_outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        infos = {o.name: o for o in self._train.get_outputs()}
        specs = {}
        for name in self.module._train_outputs:
            info = infos[name]
            dtype = _ort_type_to_numpy(info.type)
            if dtype is None or not all(isinstance(d, int) for d in info.shape):
                raise ModelError(
                    f"output {name!r} has shape {info.shape} and type {info.type}; a CUDA graph"
                    " needs static output shapes: export the model with a fixed batch size"
                )
            specs[name] = (tuple(info.shape), dtype)
        return specs

    def __call__(self, *batch: np.ndarray, fetch_loss: bool = False) -> np.ndarray | None:
        """Run one step on ``batch`` (in ``module.input_names()`` order).

        Args:
            batch: The data inputs then the labels, as host arrays.
            fetch_loss: Copy the outputs back to the host and return the first (the loss);
                otherwise they stay on the GPU and nothing waits for the host.

        Returns:
            The loss as a numpy array when ``fetch_loss``, else None.
        """
        module, state = self.module, self.module._runtime
        names = module._train_inputs
        if len(batch) != len(names):
            raise ModelError(f"got {len(batch)} inputs, but the training model takes {names}")
        arrays = {n: np.ascontiguousarray(a) for n, a in zip(names, batch)}
        if self._inputs is None:
            specs = {n: (tuple(a.shape), a.dtype) for n, a in arrays.items()}
            self._inputs = TensorStore(self.device, specs)
        for name, array in arrays.items():
            shape, dtype = self._inputs.specs[name]
            if array.shape != shape or array.dtype != dtype:
                raise ModelError(
                    f"input {name!r} has shape {list(array.shape)} and dtype {array.dtype};"
                    f" this CUDA graph step was captured for {list(shape)} {dtype}: every batch"
                    " must match the first (drop the last partial batch)"
                )
            self._inputs.write(name, array)
        assert state.learning_rate is not None
        self._scalars.write("learning_rate", np.array(state.learning_rate, np.float32))
        self._scalars.write("step", np.array(state.step + 1, np.int64))
        graph_id, train_binding, optim_binding, _ = self._graph_for_layout()
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self._train.run_with_iobinding(train_binding, options)
        self._optim.run_with_iobinding(optim_binding, options)
        state.trainable.swap()
        if module._buffer_outputs:
            state.buffers.swap()
        assert state.optimizer_slots is not None
        state.optimizer_slots.swap()
        state.step += 1
        state.grads_valid = True
        state.reset_grads_pending = True
        if not fetch_loss:
            return None
        return self._outputs.read(module._train_outputs[0])

    def _graph_for_layout(self) -> tuple[int, Any, Any, tuple[object, ...]]:
        """The bindings (and graph id) for the state's current buffer layout, made once."""
        state = self.module._runtime
        slots = state.optimizer_slots
        assert slots is not None
        stores: tuple[object, ...] = (
            state.trainable.cur,
            state.trainable.alt,
            state.buffers.cur,
            state.buffers.alt,
            slots.cur,
            slots.alt,
            state.grads,
            state.fixed,
        )
        key = tuple(id(s) for s in stores)
        if key not in self._graphs:
            self._graphs[key] = (
                len(self._graphs),
                self._bind_train(),
                self._bind_optimizer(),
                stores,  # keeps the stores alive, so their ids stay unique
            )
        return self._graphs[key]

    def _bind_train(self) -> Any:
        module, state = self.module, self.module._runtime
        assert self._inputs is not None
        binding = self._train.io_binding()
        for name in module._train_inputs:
            binding.bind_ortvalue_input(name, self._inputs.ortvalue(name))
        for name in module._train_params:
            binding.bind_ortvalue_input(name, state.ortvalue(name))
        for name in module._trainable:
            binding.bind_ortvalue_output(f"{name}_grad", state.grads.ortvalue(name))
        for out, buffer in module._buffer_outputs.items():
            binding.bind_ortvalue_output(out, state.buffers.alt.ortvalue(buffer))
        for name in module._train_outputs:
            binding.bind_ortvalue_output(name, self._outputs.ortvalue(name))
        return binding

    def _bind_optimizer(self) -> Any:
        state = self.module._runtime
        slots = state.optimizer_slots
        assert slots is not None
        binding = self._optim.io_binding()
        binding.bind_ortvalue_input("learning_rate", self._scalars.ortvalue("learning_rate"))
        binding.bind_ortvalue_input("step", self._scalars.ortvalue("step"))
        for name in self.module._trainable:
            binding.bind_ortvalue_input(name, state.trainable.cur.ortvalue(name))
            binding.bind_ortvalue_input(f"{name}_grad", state.grads.ortvalue(name))
            binding.bind_ortvalue_output(f"{name}_out", state.trainable.alt.ortvalue(name))
        for name in slots.cur:
            binding.bind_ortvalue_input(name, slots.cur.ortvalue(name))
            binding.bind_ortvalue_output(f"{name}_out", slots.alt.ortvalue(name))
        return binding

