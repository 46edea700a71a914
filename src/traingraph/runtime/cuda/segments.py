"""Training steps cut around traingraph's own CUDA kernels, captured as one CUDA graph.

onnxruntime's CUDA provider runs a training-mode BatchNormalization, lowered to standard ops,
as about seven kernels forward and ten for its gradient, each a pass over the activations,
several of them reductions over every axis but the channels. The kernels of
``batch_norm.cu`` make two passes each way: the batch statistics, then the normalized values
(with the residual Add and the Relu after them); the gradient's four sums, then the input's
gradient (with the Relu's gradient in front of it).

The matches are the CPU runtime's
(:func:`~traingraph.runtime.cpu.kernels.bn_forward.split_batch_norm_forwards`,
:func:`~traingraph.runtime.cpu.kernels.batch_norm.split_batch_norm_grads`), each checked
numerically against its nodes run by onnxruntime's CUDA provider, on random inputs and on
inputs with a NaN and infinities (a match that disagrees is dropped, with a warning).
:func:`~traingraph.runtime.cpu.segments.plan_segments` cuts the rest of the model into
onnxruntime sessions with the kernels between them, all on one stream.
:class:`SegmentedCudaSession` runs them with the parts of ``InferenceSession``'s interface
that :class:`~traingraph.runtime.cuda.CudaGraphStep` uses: the first run of each binding
warms the sessions up, then the whole step (sessions and kernels) is captured into one CUDA
graph (:class:`~traingraph.runtime.cuda.cudart.CapturedGraph`), which every later run
replays with one launch. The values that cross a cut live in one device block, where those
not needed at the same time share memory; the sessions allocate what they compute inside
from one arena.

Each session has its own cuBLAS handle, whose workspace cuBLAS sizes from the environment
variable ``CUBLAS_WORKSPACE_CONFIG``, read once per process: about 64 MiB each on Hopper GPUs by
default (ResNet-50's 99 sessions held 18.0 GiB on an H200), 4 MiB each with
``CUBLAS_WORKSPACE_CONFIG=:4096:1`` set before the process starts (12.2 GiB, at the same
speed).

The artifacts on disk stay standard ONNX; this is how a CUDA graph step runs them.

Example:
    >>> session = segmented_session(model, device, config, stream)  # None: nothing to cut
    >>> binding = session.io_binding()
    >>> binding.bind_ortvalue_input("x", x)
    >>> session.run_with_iobinding(binding)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, shape_inference

from traingraph.errors import DeviceError
from traingraph.runtime.cpu import verify
from traingraph.runtime.cpu.kernels.batch_norm import BatchNormGrad, split_batch_norm_grads
from traingraph.runtime.cpu.kernels.bn_forward import (
    BatchNormForward,
    split_batch_norm_forwards,
)
from traingraph.runtime.cpu.native import Arrays, Outputs
from traingraph.runtime.cpu.segments import (
    OutputInfo,
    Plan,
    Segment,
    offsets,
    plan_segments,
    step_reads,
    step_writes,
)
from traingraph.runtime.cuda import kernels
from traingraph.runtime.cuda.cudart import CapturedGraph, Stream, shared_stream
from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig, create_session
from traingraph.runtime.views import view

SOURCE = "batch_norm.cu"
"""The CUDA source of the kernels."""

KERNELS = ("batch_norm_grad", "batch_norm_forward")
"""The kernels' names in ``SessionConfig(native_kernels=...)``, as on the CPU."""

_PART = 2048
"""The fewest values of a channel that one block of a kernel takes (a channel of more values
is shared by several blocks, so that the grid fills the GPU)."""

Shapes = Mapping[str, tuple[int, ...]]


def _ncs(shape: Sequence[int]) -> tuple[int, int, int]:
    """``[N, C, ...]`` as (N, C, the product of the rest)."""
    if len(shape) < 2:
        raise ValueError(f"a batch norm's input must be [N, C, ...], got {list(shape)}")
    return int(shape[0]), int(shape[1]), int(np.prod(shape[2:], dtype=np.int64))


def _parts(values: int, channels: int, multiprocessors: int) -> tuple[int, int]:
    """The blocks a channel of ``values`` values is shared by, and the values of each: about
    four blocks per multiprocessor in all, each of at least :data:`_PART` values."""
    wanted = -(-4 * multiprocessors // max(channels, 1))
    parts = max(1, min(wanted, -(-values // _PART)))
    part = -(-values // parts)
    return -(-values // part), part


def _pointer(address: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(address or None)


def _geometry(shape: Sequence[int], multiprocessors: int) -> tuple[tuple[int, int], list[Any]]:
    """The grid of a kernel over ``x`` of ``shape`` (parts, channels) and its size arguments
    (n, c, s, the values of a part)."""
    n, c, s = _ncs(shape)
    parts, part = _parts(n * s, c, multiprocessors)
    return (parts, c), [ctypes.c_longlong(v) for v in (n, c, s, part)]


class _ChannelPasses:
    """Mixed into a BatchNorm kernel on CUDA: ``<prefix>_sums`` (each block's partial sums, in
    :meth:`workspace`) then ``<prefix>_apply``, both over the (parts, channels) grid of its
    input ``x``; :meth:`arguments` gives the two launches' arguments."""

    x: str
    PREFIX: ClassVar[str]
    SUMS: ClassVar[int]
    """The partial sums of a block."""

    def workspace(self, shapes: Shapes, multiprocessors: int) -> int:
        """The doubles of partial sums the kernel needs."""
        (parts, channels), _ = _geometry(shapes[self.x], multiprocessors)
        return parts * channels * self.SUMS

    def queue(
        self,
        source: kernels.CompiledSource,
        address: Callable[[str], int],
        shapes: Shapes,
        workspace: int,
        stream: int,
    ) -> None:
        """Queue the kernel on ``stream``: ``address`` gives each value's device address,
        ``workspace`` that of :meth:`workspace` doubles."""
        grid, sizes = _geometry(shapes[self.x], source.multiprocessors)

        def at(name: str | None) -> ctypes.c_void_p:
            return _pointer(address(name) if name else 0)

        sums, apply = self.arguments(at, _pointer(workspace), sizes)
        source.launch_grid(f"{self.PREFIX}_sums", grid, sums, stream)
        source.launch_grid(f"{self.PREFIX}_apply", grid, apply, stream)

    def arguments(
        self, at: Callable[[str | None], ctypes.c_void_p], workspace: ctypes.c_void_p,
        sizes: list[Any],
    ) -> tuple[list[Any], list[Any]]:  # fmt: skip
        """The sums kernel's and the apply kernel's arguments, the values by ``at`` (a null
        pointer for None)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CudaBatchNormForward(_ChannelPasses, BatchNormForward):
    """:class:`~traingraph.runtime.cpu.kernels.bn_forward.BatchNormForward` on a CUDA device.

    Attributes:
        device_index: The device.
        relu_nan: Whether the Relu keeps a NaN (onnxruntime's CUDA Relu, :func:`relu_keeps_nan`).
    """

    PREFIX = "bn_forward"
    SUMS = 2
    device_index: int = 0
    relu_nan: bool = True

    def arguments(
        self, at: Callable[[str | None], ctypes.c_void_p], workspace: ctypes.c_void_p,
        sizes: list[Any],
    ) -> tuple[list[Any], list[Any]]:  # fmt: skip
        values = [at(v) for v in (self.x, self.scale, self.bias, self.addend)]
        values += [at(v) for v in (self.out, self.mean, self.var)]
        flags = [ctypes.c_int(int(self.relu)), ctypes.c_int(int(self.relu_nan))]
        apply = [*values, workspace, *sizes, ctypes.c_double(self.epsilon), *flags]
        return [values[0], workspace, *sizes], apply

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        x = values[self.x]
        stats = (1, x.shape[1]) + (1,) * (x.ndim - 2) if x.ndim >= 2 else ()
        shapes = {self.out: x.shape, self.mean: stats, self.var: stats}
        _computed_on_device(self, values, out, shapes)


@dataclass(frozen=True)
class CudaBatchNormGrad(_ChannelPasses, BatchNormGrad):
    """:class:`~traingraph.runtime.cpu.kernels.batch_norm.BatchNormGrad` on a CUDA device.

    Attributes:
        device_index: The device.
    """

    PREFIX = "bn_grad"
    SUMS = 4
    device_index: int = 0

    def arguments(
        self, at: Callable[[str | None], ctypes.c_void_p], workspace: ctypes.c_void_p,
        sizes: list[Any],
    ) -> tuple[list[Any], list[Any]]:  # fmt: skip
        read = [at(v) for v in (self.x, self.dy, self.y)]
        scale = at(self.scale if self.dx else None)  # the scale enters dx alone
        written = [at(v) for v in (self.dx, self.dscale, self.dbias)]
        apply = [*read, scale, *written, workspace, *sizes, ctypes.c_double(self.epsilon)]
        return [*read, workspace, *sizes], apply

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        x = values[self.x]
        features = tuple(x.shape[1:2])
        shapes = {self.dx: x.shape, self.dscale: features, self.dbias: features}
        _computed_on_device(self, values, out, {k: v for k, v in shapes.items() if k})


DeviceKernel = CudaBatchNormForward | CudaBatchNormGrad


def _computed_on_device(
    kernel: DeviceKernel, values: Arrays, out: Outputs, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Run ``kernel`` on its device from the host arrays ``values`` and put its outputs (of
    ``shapes``) into ``out``: the numeric check of a match. Raises ValueError for inputs that
    are not float32 (the match is then dropped)."""
    source = kernels.load(SOURCE, kernel.device_index)
    stream = shared_stream(kernel.device_index)
    if source is None or stream is None:
        raise ValueError(f"{SOURCE} is not available on CUDA device {kernel.device_index}")
    index = kernel.device_index
    device: dict[str, ort.OrtValue] = {}
    for name in kernel.inputs:
        array = values[name]
        if array.dtype != np.float32:
            raise ValueError(f"{name!r} is {array.dtype}; the CUDA kernels take float32")
        device[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), "cuda", index)
    for name, shape in shapes.items():
        device[name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cuda", index)
    all_shapes = {name: tuple(values[name].shape) for name in kernel.inputs} | dict(shapes)
    doubles = kernel.workspace(all_shapes, source.multiprocessors)
    workspace = ort.OrtValue.ortvalue_from_shape_and_type((doubles,), np.float64, "cuda", index)
    kernel.queue(
        source, lambda n: device[n].data_ptr(), all_shapes, workspace.data_ptr(), stream.handle
    )
    stream.synchronize()
    for name in shapes:
        out[name] = device[name].numpy()


@functools.cache
def relu_keeps_nan(device_index: int) -> bool:
    """Whether onnxruntime's CUDA Relu gives NaN for a NaN (else 0)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    session = ort.InferenceSession(
        model.SerializeToString(),
        providers=[("CUDAExecutionProvider", {"device_id": str(device_index)})],
    )
    (y,) = session.run(None, {"x": np.array([np.nan, 1.0], np.float32)})
    return bool(np.isnan(y[0]))


def find_device_kernels(
    model: onnx.ModelProto, device: Device, names: Sequence[str] | None = None
) -> list[tuple[DeviceKernel, set[int]]]:
    """The kernels of :data:`KERNELS` (those in ``names``; all where None) that ``model``
    holds, each with the indices of the nodes it replaces, checked against those nodes on
    ``device``; ``[]`` where the kernels do not compile there."""
    wanted = [k for k in KERNELS if names is None or k in names]
    if not wanted or kernels.load(SOURCE, device.index) is None:
        return []
    providers = [("CUDAExecutionProvider", {"device_id": str(device.index)})]
    found: list[tuple[DeviceKernel, set[int]]] = []
    with verify.checked_on(providers):
        if "batch_norm_grad" in wanted:
            make_grad = functools.partial(CudaBatchNormGrad, device_index=device.index)
            found += split_batch_norm_grads(model, make=make_grad)  # type: ignore[arg-type]
        if "batch_norm_forward" in wanted:
            taken = set().union(*(nodes for _, nodes in found)) if found else set()
            make_forward = functools.partial(
                CudaBatchNormForward,
                device_index=device.index,
                relu_nan=relu_keeps_nan(device.index),
            )
            found += split_batch_norm_forwards(model, taken, make=make_forward)  # type: ignore[arg-type]
    return found


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each value of ``model`` whose type and static shape inference finds."""
    inferred = shape_inference.infer_shapes(model)
    graph = inferred.graph
    found = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if tensor.elem_type and tensor.HasField("shape") and None not in dims:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
            found[info.name] = (tuple(int(d) for d in dims if d is not None), dtype)
    return found


_ORT_NAMES = {
    np.dtype(np.float32): "float", np.dtype(np.float16): "float16", np.dtype(np.float64): "double",
    np.dtype(np.int64): "int64", np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool",
}  # fmt: skip


class _Binding:
    """The OrtValues bound to a :class:`SegmentedCudaSession`'s inputs and outputs."""

    def __init__(self) -> None:
        self.inputs: dict[str, ort.OrtValue] = {}
        self.outputs: dict[str, ort.OrtValue] = {}

    def bind_ortvalue_input(self, name: str, value: ort.OrtValue) -> None:
        self.inputs[name] = value

    def bind_ortvalue_output(self, name: str, value: ort.OrtValue) -> None:
        self.outputs[name] = value


Step = tuple[Any, Segment] | DeviceKernel
"""A session with its segment, or a kernel."""


class SegmentedCudaSession:
    """A training model run as onnxruntime CUDA sessions with traingraph's kernels between them
    (a :class:`~traingraph.runtime.cpu.segments.Plan`), captured into one CUDA graph per
    binding. Its inputs and outputs are bound as an ``InferenceSession``'s are, to device
    OrtValues that stay put; each run waits for the step, as onnxruntime's own does.

    Args:
        plan: The segments and kernels.
        model: The whole model (its outputs' types and shapes).
        types: The type and static shape of every value that crosses a cut.
        device: The CUDA device.
        config: The sessions' configuration (their stream among its CUDA options).
        stream: The stream the sessions run on, where the kernels are queued.
    """

    def __init__(
        self,
        plan: Plan,
        model: onnx.ModelProto,
        types: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        device: Device,
        config: SessionConfig,
        stream: Stream,
    ) -> None:
        source = kernels.load(SOURCE, device.index)
        if source is None:
            raise DeviceError(f"{SOURCE}: {kernels.unavailable_reason(SOURCE, device.index)}")
        self._source = source
        self._stream = stream
        self._device = device
        self._types = types
        self._graph_outputs = [o.name for o in model.graph.output]
        self._outputs = [
            OutputInfo(name, list(types[name][0]), f"tensor({_ORT_NAMES[types[name][1]]})")
            for name in self._graph_outputs
            if name in types and types[name][1] in _ORT_NAMES
        ]
        extra = dict(config.extra)
        if _shared_cuda_arena(device, config):
            extra["session.use_env_allocators"] = "1"
        # each segment is rewritten for the CUDA provider (config.specialize) on its own
        segment_config = dataclasses.replace(config, cuda_graph=False, extra=extra)
        steps: list[Step] = list(plan.first)  # type: ignore[arg-type]
        for segment, after in zip(plan.segments, plan.kernels):
            if segment.model.graph.node:
                session = create_session(segment.model, device, segment_config)
                steps.append((session, segment))
            steps.extend(after)  # type: ignore[arg-type]
        self._steps = steps
        self._run_options = ort.RunOptions()
        self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        device_kernels = [s for s in steps if not isinstance(s, tuple)]
        doubles = max(
            (k.workspace(self._shapes(k), source.multiprocessors) for k in device_kernels),
            default=1,
        )
        self._workspace = ort.OrtValue.ortvalue_from_shape_and_type(
            (max(doubles, 1),), np.float64, "cuda", device.index
        )
        self._block: ort.OrtValue | None = None
        self._values: dict[str, ort.OrtValue] = {}
        self._graphs: dict[int, tuple[_Binding, list[Callable[[], None]], CapturedGraph]] = {}

    def _shapes(self, kernel: DeviceKernel) -> dict[str, tuple[int, ...]]:
        return {n: self._types[n][0] for n in [*kernel.inputs, *kernel.outputs] if n in self._types}

    def get_outputs(self) -> list[OutputInfo]:
        """The model's outputs (name, static shape, onnxruntime type name)."""
        return list(self._outputs)

    def io_binding(self) -> _Binding:
        """A new binding of this session's inputs and outputs."""
        return _Binding()

    def run_with_iobinding(self, binding: _Binding, options: ort.RunOptions | None = None) -> None:
        """Run the step with ``binding``'s values and wait for it: the first time for a
        binding, once uncaptured and then captured; afterwards, a replay."""
        entry = self._graphs.get(id(binding))
        if entry is None:
            calls = self._calls(binding)
            for call in calls:  # onnxruntime allocates and searches its algorithms
                call()
            self._stream.synchronize()

            def record() -> None:
                for call in calls:
                    call()

            try:
                graph = CapturedGraph(self._stream, record)
            except DeviceError as error:
                raise DeviceError(
                    f"the segmented training step could not be captured into a CUDA graph:"
                    f" {error}. Run it without the CUDA kernels"
                    " (SessionConfig(native_kernels=()))"
                ) from error
            entry = self._graphs[id(binding)] = (binding, calls, graph)
        entry[2].launch()
        self._stream.synchronize()

    def _calls(self, binding: _Binding) -> list[Callable[[], None]]:
        """The steps as calls that queue their work on the stream, bound to ``binding``'s
        values and the block's."""
        values = self._cut_values(binding)
        calls: list[Callable[[], None]] = []
        for step in self._steps:
            if isinstance(step, tuple):
                session, segment = step
                bound = session.io_binding()
                for name in segment.inputs:
                    bound.bind_ortvalue_input(name, values[name])
                for name in segment.outputs:
                    bound.bind_ortvalue_output(name, values[name])
                calls.append(functools.partial(self._run_segment, session, bound))
            else:
                calls.append(functools.partial(self._queue_kernel, step, values))
        return calls

    def _run_segment(self, session: Any, bound: Any) -> None:
        session.run_with_iobinding(bound, self._run_options)

    def _queue_kernel(self, kernel: DeviceKernel, values: Mapping[str, ort.OrtValue]) -> None:
        kernel.queue(
            self._source,
            lambda name: values[name].data_ptr(),
            self._shapes(kernel),
            self._workspace.data_ptr(),
            self._stream.handle,
        )

    def _cut_values(self, binding: _Binding) -> dict[str, ort.OrtValue]:
        """The caller's values, and views of the block for every other value that a step
        writes (made once: values that do not live at the same time share memory)."""
        if self._block is None:
            self._allocate(set(binding.outputs))
        values = dict(self._values)
        values.update(binding.inputs)
        values.update(binding.outputs)
        return values

    def _allocate(self, bound_outputs: set[str]) -> None:
        names: list[str] = []
        lives: list[tuple[int, int, int]] = []
        last: dict[str, int] = {}
        for index, step in enumerate(self._steps):
            for name in step_reads(step):
                last[name] = index
        for index, step in enumerate(self._steps):
            for name in step_writes(step):
                if name in bound_outputs or name in names:
                    continue
                if name not in self._types:
                    raise DeviceError(
                        f"value {name!r} crosses a cut of the segmented CUDA step but its shape"
                        " is not static; run it without the CUDA kernels"
                        " (SessionConfig(native_kernels=()))"
                    )
                shape, dtype = self._types[name]
                size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                end = len(self._steps) if name in self._graph_outputs else last.get(name, index)
                names.append(name)
                lives.append((max(size, 1), index, max(end, index)))
        starts, total = offsets(lives, alignment=256)
        block = ort.OrtValue.ortvalue_from_shape_and_type(
            (max(total, 1),), np.uint8, "cuda", self._device.index
        )
        for name, start in zip(names, starts):
            shape, dtype = self._types[name]
            index = self._device.index
            self._values[name] = view(block, start // dtype.itemsize, shape, dtype, index)
        self._block = block


_arenas: dict[int, bool] = {}


def _shared_cuda_arena(device: Device, config: SessionConfig) -> bool:
    """Register onnxruntime's CUDA arena for ``device`` once per process, so that the
    sessions of the segments (created with ``session.use_env_allocators``) allocate what they
    compute inside from it and what one frees the next reuses. False where onnxruntime
    refuses it (each session then has an arena of its own)."""
    if device.index not in _arenas:
        info = ort.OrtMemoryInfo(
            "Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device.index, ort.OrtMemType.DEFAULT
        )
        settings = {"arena_extend_strategy": int(config.arena_extend_strategy != "kNextPowerOfTwo")}
        if config.gpu_mem_limit is not None:
            settings["max_mem"] = int(config.gpu_mem_limit)
        arena = ort.OrtArenaCfg(settings)
        try:
            ort.create_and_register_allocator_v2(
                "CUDAExecutionProvider", info, {"device_id": str(device.index)}, arena
            )
            _arenas[device.index] = True
        except Exception as error:  # onnxruntime raises its own exception types
            verify.logger.warning(
                "onnxruntime refused a shared CUDA arena (%s); each segment has its own", error
            )
            _arenas[device.index] = False
    return _arenas[device.index]


def segmented_session(
    model: onnx.ModelProto, device: Device, config: SessionConfig, stream: Stream | None
) -> SegmentedCudaSession | None:
    """``model`` run as a :class:`SegmentedCudaSession` on ``device``, its sessions on
    ``stream``; None where no kernel applies (none matches, ``config.native_kernels`` names
    none, the kernels do not compile, or there is no stream), and the caller runs the model
    in one session."""
    if stream is None or config.recompute:
        return None
    names = config.native_kernels
    proto = model
    found = find_device_kernels(proto, device, None if names is None else list(names))
    if not found:
        return None
    types = _value_types(proto)
    float32 = np.dtype(np.float32)
    found = [
        (kernel, nodes) for kernel, nodes in found
        if all(types.get(v, ((), None))[1] == float32 for v in [*kernel.inputs, *kernel.outputs])
    ]  # fmt: skip
    if not found:
        return None
    plan = plan_segments(proto, found, cpu=False)
    crossing = {v for s in plan.segments for v in [*s.inputs, *s.outputs]}
    if not crossing <= set(types):
        return None
    return SegmentedCudaSession(plan, proto, types, device, config, stream)


__all__ = [
    "CudaBatchNormForward",
    "CudaBatchNormGrad",
    "SegmentedCudaSession",
    "find_device_kernels",
    "relu_keeps_nan",
    "segmented_session",
]
