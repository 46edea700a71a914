"""onnxruntime sessions with traingraph's defaults, and IOBinding-based execution."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from traingraph.errors import ArgumentTypeError, ModelError
from traingraph.runtime.device import Device
from traingraph.runtime.rewrites import recompute
from traingraph.runtime.rewrites.specialize import for_cpu, for_cuda

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_CONV_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
_ARENA_STRATEGIES = ("kNextPowerOfTwo", "kSameAsRequested")


@dataclass
class SessionConfig:
    """How sessions are created.

    Attributes:
        optimization: onnxruntime graph optimization level: "disable", "basic", "extended", "all".
        intra_op_threads: Threads per op (0: onnxruntime's default, one per physical core,
            each pinned to its core).
        allow_spinning: Whether onnxruntime's worker threads spin while they wait for work
            during a run, so that a graph's many small parallel kernels do not wait for
            sleeping threads to wake.
        spin_between_runs: Whether the workers go on spinning after a run returns. Off by
            default (onnxruntime's ``session.force_spinning_stop``): spinning then stops with
            the run, and the work between steps (the optimizer update, data loading, other
            sessions) keeps its cores.
        native_conv_grads: On the CPU, compute the weight gradients of 2-D float32 Convs with
            the native kernel instead of the training graph's nodes (see
            :mod:`traingraph.runtime.cpu.kernels.conv_grads`): the same sums, without the unfold's
            9 copies
            of the input. Needs the
            extension built at install time; without it, or with False, the graph computes them.
        native_segments: On the CPU, run the training graph as onnxruntime segments with
            native kernels between them (see :mod:`traingraph.runtime.cpu.segments`): the gradient
            of each training-mode BatchNormalization, with the Relu gradient in front of it
            (two passes over the activations instead of about ten), a Conv's output gradient
            routed through the MaxPool after it, and the keep masks of the Dropouts (one pass
            each instead of about twelve). Needs the extension; False runs the graph's nodes.
        native_kernels: Which native kernels to use, by name (those of
            :func:`traingraph.runtime.cpu.kernels.names`, e.g. ``{"gelu", "conv_weight_grad"}``);
            None uses every one available. An unknown name raises a ModelError listing them.
        specialize: Rewrite the model for the provider that runs it, with the same results
            (:mod:`traingraph.runtime.rewrites.specialize`: on the CPU, ConvTranspose as MatMul and
            Col2Im, Convs with parameter filters in onnxruntime's blocked kernels; on CUDA,
            forms its kernels lack or run slowly). False runs it as written.
        recompute: On CUDA, compute the cheap forward values the gradient pass reads again
            before it reads them instead of holding them through the forward pass
            (:mod:`traingraph.runtime.rewrites.recompute`): less memory for a pass over each
            (GPT-2 small at 8 x 512 on an H200: 12.20 -> 11.81 GiB, 49.9 -> 50.8 ms), or none
            where onnxruntime's peak lies elsewhere (BERT-base: 6.46 GiB either way, 29.8 ->
            30.5 ms). Needs ``specialize``.
        profile: Write onnxruntime's profile.
        memory_arena: Use onnxruntime's CPU memory arena (off gives exact memory measurements).
        memory_pattern: Let onnxruntime plan a run's values from the first run and allocate
            them, from the second on, as one block (its memory pattern). Off, each value is
            allocated from the arena as it is written and freed after its last reader, at the
            cost of an allocation per value (a step of many small values, as a small
            transformer's, takes several percent longer). On the shared CPU arena
            (:func:`shared_cpu_arena`) each session's block takes what the blocks of the
            sessions before it freed, and a segmented step holds about as much either way.
            None (the default) means on for CPU sessions and off for CUDA ones: a CUDA
            session's pattern block comes on top of what its arena grew to in the first run,
            which that arena keeps, and a large model holds most of its values twice
            (``benchmarks/RESULTS.md``, GPU section, has the figures).
        shared_arena: With ``memory_arena``, CPU sessions allocate from one arena registered
            once per process (:func:`shared_cpu_arena`) instead of one arena each: a segmented
            step's many sessions, and several Modules in one process, then reuse the same
            freed blocks. The shared arena keeps what it has grown to until the process
            ends, where an arena of its own goes with its session. False gives every
            session its own arena (sessions created from ``session_options`` or with
            ``session.use_env_allocators`` in ``extra`` keep what those say).
        extra: Further session config entries (``add_session_config_entry``); an entry here
            replaces the one the fields above would set.
        cuda_graph: Capture the session's kernels into a CUDA graph on the first run and replay
            it afterwards (onnxruntime's ``enable_cuda_graph``). Needs static shapes, every node
            on the GPU and inputs and outputs bound to device buffers that keep their
            addresses, as :class:`~traingraph.runtime.cuda.CudaGraphStep` binds them.
        cuda_segments: In a :class:`~traingraph.runtime.cuda.CudaGraphStep`, run each
            training-mode BatchNormalization (forward, and gradient with the Relu's in front)
            as traingraph's own CUDA kernels between onnxruntime sessions, the whole step
            captured as one CUDA graph (:mod:`traingraph.runtime.cuda.segments`; the kernels
            ``native_kernels`` names, all where None). ResNet-50 at batch 64 on an H200: 54.3
            ms a step against 62.5, holding 18.0 GiB against 10.1 (99 sessions, each with a
            cuBLAS workspace; 12.2 GiB with ``CUBLAS_WORKSPACE_CONFIG=:4096:1`` set in the
            environment). Off by default.
        tf32: Let float32 MatMul/Gemm/Conv use TensorFloat-32 tensor cores (products keep about
            10 bits of mantissa; onnxruntime's default). False gives full float32 products.
        cudnn_conv_algo_search: How cuDNN picks convolution algorithms: "EXHAUSTIVE" (benchmark
            them all on the first run; onnxruntime's default), "HEURISTIC" (cuDNN's heuristics,
            faster start) or "DEFAULT" (the implicit-GEMM algorithm, no search).
        gpu_mem_limit: Bytes the CUDA memory arena may hold (None: no limit). Parameters,
            gradients and optimizer slots are allocated outside it, by the runtime's stores.
        arena_extend_strategy: How the CUDA arena grows: "kSameAsRequested" (by what each
            allocation needs) or "kNextPowerOfTwo" (onnxruntime's default: by the next power of
            two, which the arena then keeps). On an H200, captured steps held 5.61 GiB against
            6.46 (BERT-base, 32 x 128), 12.20 against 12.40 (GPT-2 small, 8 x 512) and 10.13
            against 10.27 (ResNet-50, batch 64), at the same speed.
        cuda_extra: Further CUDA execution provider options, passed as they are (see
            onnxruntime's CUDA provider documentation), e.g. ``{"do_copy_in_default_stream": "0"}``.

    Example:
        >>> config = SessionConfig(tf32=False, cudnn_conv_algo_search="HEURISTIC")
        >>> config.cuda_options()["use_tf32"]
        '0'
    """

    optimization: str = "all"
    intra_op_threads: int = 0
    allow_spinning: bool = True
    spin_between_runs: bool = False
    native_conv_grads: bool = True
    native_segments: bool = True
    native_kernels: tuple[str, ...] | set[str] | frozenset[str] | None = None
    specialize: bool = True
    recompute: bool = False
    profile: bool = False
    memory_arena: bool = True
    memory_pattern: bool | None = None
    shared_arena: bool = True
    extra: dict[str, str] = field(default_factory=dict)
    cuda_graph: bool = False
    cuda_segments: bool = False
    tf32: bool = True
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    gpu_mem_limit: int | None = None
    arena_extend_strategy: str = "kSameAsRequested"
    cuda_extra: dict[str, str] = field(default_factory=dict)

    def memory_pattern_on(self, kind: str) -> bool:
        """Whether sessions on a device of ``kind`` ("cpu", "cuda") use onnxruntime's memory
        pattern (``memory_pattern``, or the device's default where it is None)."""
        return kind == "cpu" if self.memory_pattern is None else self.memory_pattern

    def cuda_options(self) -> dict[str, str]:
        """The CUDA execution provider options these settings stand for.

        Raises:
            ModelError: For an unknown algorithm search, arena strategy, or a memory limit
                that is not a positive number of bytes.
        """
        if self.cudnn_conv_algo_search not in _CONV_SEARCH:
            raise ModelError(
                f"unknown cudnn_conv_algo_search {self.cudnn_conv_algo_search!r}; expected one"
                f" of {list(_CONV_SEARCH)}"
            )
        if self.arena_extend_strategy not in _ARENA_STRATEGIES:
            raise ModelError(
                f"unknown arena_extend_strategy {self.arena_extend_strategy!r}; expected one of"
                f" {list(_ARENA_STRATEGIES)}"
            )
        options = {
            "enable_cuda_graph": "1" if self.cuda_graph else "0",
            "use_tf32": "1" if self.tf32 else "0",
            "cudnn_conv_algo_search": self.cudnn_conv_algo_search,
            "arena_extend_strategy": self.arena_extend_strategy,
        }
        if self.gpu_mem_limit is not None:
            if isinstance(self.gpu_mem_limit, bool) or int(self.gpu_mem_limit) <= 0:
                raise ModelError(
                    f"gpu_mem_limit must be a positive number of bytes or None, got"
                    f" {self.gpu_mem_limit!r}"
                )
            options["gpu_mem_limit"] = str(int(self.gpu_mem_limit))
        options.update({key: str(value) for key, value in self.cuda_extra.items()})
        return options

    def session_options(self) -> ort.SessionOptions:
        if self.optimization not in _LEVELS:
            raise ModelError(
                f"unknown optimization level {self.optimization!r}; expected one of {list(_LEVELS)}"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = _LEVELS[self.optimization]
        options.log_severity_level = 3
        if self.intra_op_threads:
            options.intra_op_num_threads = self.intra_op_threads
        spin = "1" if self.allow_spinning else "0"
        entries = {
            "session.intra_op.allow_spinning": spin,
            "session.inter_op.allow_spinning": spin,
            "session.force_spinning_stop": "0" if self.spin_between_runs else "1",
        }
        entries.update(self.extra)
        for key, value in entries.items():
            options.add_session_config_entry(key, str(value))
        options.enable_profiling = self.profile
        if self.profile:  # one file per session: a segmented step creates several at once
            options.profile_file_prefix = f"onnxruntime_profile_{next(_profiles)}"
        options.enable_cpu_mem_arena = self.memory_arena
        return options


_profiles = itertools.count()
_arena_lock = threading.Lock()
_arena_registered = False


def shared_cpu_arena() -> None:
    """Register onnxruntime's process-wide CPU arena allocator, once per process.

    Sessions created with the config entry ``session.use_env_allocators=1`` allocate their
    CPU tensors from it instead of from an arena of their own. The arena (onnxruntime's BFC
    arena) locks around each allocation, so sessions run one after another or from several
    threads may share it.

    Once a first run has given its free regions back (:class:`BoundRunner`), the arena grows
    by regions of at least :data:`SHARED_ARENA_REGION` bytes, address space of which only the
    pages written become resident: the blocks that the memory pattern takes from the second
    run on, one per session and each of its own size, then come from one or two regions, where
    a freed block merges with its free neighbours and the next session's block takes its
    place. onnxruntime's default grows from 2 MiB regions, doubling the size of the next one
    each time a block does not fit; a block freed in one of those regions cannot join the free
    memory of another, and the step's blocks would spread over all of them.
    """
    global _arena_registered
    with _arena_lock:
        if _arena_registered:
            return
        info = ort.OrtMemoryInfo(
            "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
        )
        config = ort.OrtArenaCfg({"initial_growth_chunk_size_bytes": SHARED_ARENA_REGION})
        ort.create_and_register_allocator(info, config)
        _arena_registered = True


SHARED_ARENA_REGION = 1 << 28
"""The least bytes by which the shared CPU arena grows after a shrink (:func:`shared_cpu_arena`):
address space, resident only where written."""


def create_session(
    model: str | os.PathLike | bytes | onnx.ModelProto,
    device: Device,
    config: SessionConfig | None = None,
) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` for ``model`` on ``device``."""
    config = config or SessionConfig()
    source: Any
    if isinstance(model, onnx.ModelProto):
        source = model.SerializeToString()
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ModelError(f"model file {path!r} does not exist")
        source = path
    else:
        source = model
    disabled: list[str] = []
    if config.specialize:
        if device.kind == "cuda":
            source = for_cuda(source, recompute=config.recompute)
            disabled = recompute.disabled_optimizers(source)
        else:
            source = for_cpu(source)
    providers = device.providers(config.cuda_options())
    options = config.session_options()
    if not isinstance(config, WithSessionOptions):
        options.enable_mem_pattern = config.memory_pattern_on(device.kind)
    if (
        device.kind == "cpu"
        and config.memory_arena
        and config.shared_arena
        and not isinstance(config, WithSessionOptions)
        and "session.use_env_allocators" not in config.extra
    ):
        shared_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    if disabled:
        return ort.InferenceSession(
            source, options, providers=providers, disabled_optimizers=disabled
        )
    return ort.InferenceSession(source, options, providers=providers)


class BoundRunner:
    """Runs one session through an IOBinding whose persistent bindings are set once.

    Per-step inputs are bound on each call; an input or output bound to the same OrtValue as
    in the previous run is not bound again. Outputs not bound to a buffer are allocated by
    onnxruntime on ``device`` and returned as OrtValues. String tensors, which IOBinding
    refuses, are fed to ``session.run`` instead: a run with a string input passes every input
    that way and copies the outputs into their buffers.
    """

    def __init__(self, session: ort.InferenceSession, device: Device) -> None:
        self.session = session
        self.device = device
        self.binding = session.io_binding()
        self.inputs = {i.name: i for i in session.get_inputs()}
        self.output_infos = session.get_outputs()
        self.outputs = [o.name for o in self.output_infos]
        self._alive: dict[str, object] = {}
        self._bound_outputs: dict[str, ort.OrtValue | None] = {}
        self._order: list[str] = []
        self._host = device.kind == "cpu"
        self._strings: set[str] = set()  # inputs bound to string arrays
        # onnxruntime allocates a run's values one by one the first time, then (its memory
        # pattern) in one block planned from them, which what the first run left free in the
        # arena seldom fits: the first run gives the arena's free regions back
        self._first_run = _arena_shrinking(session, device)

    def bind_input(self, name: str, value: ort.OrtValue | np.ndarray) -> None:
        """Bind ``name`` to ``value``; the runner keeps ``value`` alive until it is rebound
        (onnxruntime reads host arrays in place at run time)."""
        if self._alive.get(name) is value:
            return
        self._alive[name] = value
        if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
            self._strings.add(name)
            return
        self._strings.discard(name)
        if isinstance(value, ort.OrtValue):
            self.binding.bind_ortvalue_input(name, value)
        else:
            self.binding.bind_cpu_input(name, value)

    def run(self, outputs: Mapping[str, ort.OrtValue | None]) -> dict[str, ort.OrtValue]:
        """Run with ``outputs`` bound: name -> a buffer to write, or None for a fresh allocation
        on the device. Returns those outputs by name."""
        if self._strings:
            return self._run_fed(outputs)
        binding, bound = self.binding, self._bound_outputs
        if bound.keys() != outputs.keys():
            order = [name for name in self.outputs if name in outputs]
            if len(order) != len(outputs):
                unknown = sorted(set(outputs) - set(order))
                raise ModelError(f"outputs {unknown} are not outputs of the model ({self.outputs})")
            binding.clear_binding_outputs()
            bound.clear()
            self._order = order
        for name in self._order:
            value = outputs[name]
            if value is None:
                binding.bind_output(name, self.device.ort_device_type, self.device.index)
            elif bound.get(name) is not value:
                binding.bind_ortvalue_output(name, value)
            bound[name] = value
        if not self._host:
            binding.synchronize_inputs()
        self.session.run_with_iobinding(binding, self._first_run)
        self._first_run = None
        if not self._host:
            binding.synchronize_outputs()
        if all(outputs[name] is not None for name in self._order):
            return dict(outputs)  # type: ignore[arg-type]
        return dict(zip(self._order, binding.get_outputs()))

    def release(self) -> None:
        """Let go of what the binding holds: the inputs bound and the outputs onnxruntime
        allocated in the last run (kept until they are bound again otherwise), with a new
        binding (onnxruntime's keeps the host arrays bound to it alive until it goes, cleared
        or not). The next run binds them again."""
        self.binding = self.session.io_binding()
        self._alive.clear()
        self._bound_outputs.clear()
        self._strings.clear()

    def _run_fed(self, outputs: Mapping[str, ort.OrtValue | None]) -> dict[str, ort.OrtValue]:
        """:meth:`run` through ``session.run`` with every bound input as a feed."""
        order = [name for name in self.outputs if name in outputs]
        if len(order) != len(outputs):
            unknown = sorted(set(outputs) - set(order))
            raise ModelError(f"outputs {unknown} are not outputs of the model ({self.outputs})")
        results: dict[str, ort.OrtValue] = {}
        for name, array in zip(order, self.session.run(order, dict(self._alive))):
            buffer = outputs[name]
            if buffer is None:
                device = self.device
                buffer = ort.OrtValue.ortvalue_from_numpy(
                    np.ascontiguousarray(array), device.ort_device_type, device.index
                )
            else:
                buffer.update_inplace(np.ascontiguousarray(array))
            results[name] = buffer
        return results


def _arena_shrinking(session: ort.InferenceSession, device: Device) -> ort.RunOptions | None:
    """Run options that give the free regions of the CPU arena ``session`` allocates from back
    to the system at the end of a run; None where it has none (another device, or the arena
    off: onnxruntime then fails the run)."""
    if device.kind != "cpu" or not session.get_session_options().enable_cpu_mem_arena:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def check_feeds(
    session_inputs: Mapping[str, Any], names: list[str], feeds: Mapping[str, Any]
) -> None:
    """Raise a ModelError naming the expected input names, ranks, fixed dims or dtypes."""
    for name in feeds:
        if name not in names:
            raise ModelError(f"unknown input {name!r}; the model expects inputs {names}")
    for name in names:
        if name not in feeds:
            raise ModelError(f"missing input {name!r}; the model expects inputs {names}")
    symbols: dict[str, tuple[str, int]] = {}  # a named dimension (batch) -> first input, size
    for name, value in feeds.items():
        info = session_inputs[name]
        shape = tuple(value.shape() if isinstance(value, ort.OrtValue) else np.shape(value))
        expected = info.shape
        for got, want in zip(shape, expected or ()):
            if isinstance(want, str) and want:
                first, size = symbols.setdefault(want, (name, got))
                if size != got:
                    raise ModelError(
                        f"input {name!r} has {want!r} dimension {got}, but input {first!r} has"
                        f" {size}; the model takes the same {want!r} for both. Pass inputs and"
                        " labels with the same number of samples"
                    )
        if expected is not None and len(shape) != len(expected):
            raise ModelError(
                f"input {name!r} has shape {list(shape)}, but the model expects rank"
                f" {len(expected)} (shape {expected})"
            )
        for got, want in zip(shape, expected or ()):
            if isinstance(want, int) and want != got:
                raise ModelError(
                    f"input {name!r} has shape {list(shape)}, but the model expects {expected}"
                )
        dtype = ort_type_to_numpy(info.type)
        got_dtype = (
            ort_type_to_numpy(value.data_type())
            if isinstance(value, ort.OrtValue)
            else np.asarray(value).dtype
        )
        if dtype is not None and got_dtype is not None and np.dtype(got_dtype) != dtype:
            raise ModelError(
                f"input {name!r} has dtype {np.dtype(got_dtype).name}, but the model expects"
                f" {dtype.name}; convert it with .astype(np.{dtype.name})"
            )


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def ort_type_to_numpy(type_name: str) -> np.dtype | None:
    t = _ORT_TYPES.get(type_name)
    return None if t is None else np.dtype(t)


@dataclass
class WithSessionOptions(SessionConfig):
    """A :class:`SessionConfig` whose sessions use the caller's ``onnxruntime.SessionOptions``."""

    options: ort.SessionOptions | None = None

    @classmethod
    def of(cls, config: SessionConfig, options: ort.SessionOptions) -> WithSessionOptions:
        if not isinstance(options, ort.SessionOptions):
            raise ArgumentTypeError(
                f"session_options must be an onnxruntime.SessionOptions, got"
                f" {type(options).__name__}; use session_config= for traingraph's SessionConfig"
            )
        values = {f.name: getattr(config, f.name) for f in fields(SessionConfig)}
        return cls(**values, options=options)

    def session_options(self) -> ort.SessionOptions:
        assert self.options is not None
        return self.options
