"""What training and inference graphs share: compile options, results, ordered async execution."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnxruntime as ort

from traingraph.errors import ModelError
from traingraph.graph.graph import Graph, Tensor, TensorSpec
from traingraph.runtime.device import Device
from traingraph.runtime.session import BoundRunner, SessionConfig, check_feeds

__all__ = ["CompileOptions", "ExecutionResult", "OnComplete"]

T = TypeVar("T")
OnComplete = Callable[[Any, BaseException | None], None]


@dataclass
class CompileOptions:
    """How a graph is compiled.

    Attributes:
        debug: No fusion, and after every phase the parameters and gradients are synchronised
            to the host (``ExecutionResult.parameters`` / ``.gradients``).
        disable_fusion: Run the graphs as written: without onnxruntime's graph optimizations
            (no fusion), the runtime's rewrites for the device
            (:mod:`traingraph.runtime.rewrites.specialize`) or the native Conv weight gradients
            (:mod:`traingraph.runtime.cpu.kernels.conv_grads`).
        compute_all_gradients: Also compute the gradients of every data input.
        profile: Report each phase's execution time in ``ExecutionResult.times``.
        intra_op_threads: onnxruntime threads per op (0: its default).
        memory_arena: Use onnxruntime's CPU memory arena (off for exact memory measurements).
        mixed_precision: "fp16" or "bf16" to compute in that type with float32 parameters and
            a dynamic loss scale (:mod:`traingraph.precision`), as
            :func:`traingraph.artifacts.generate_artifacts` does; None: float32.
        tf32: On CUDA, let float32 MatMul/Gemm/Conv use TensorFloat-32 tensor cores
            (:attr:`traingraph.runtime.session.SessionConfig.tf32`); False keeps full float32.
    """

    debug: bool = False
    disable_fusion: bool = False
    compute_all_gradients: bool = False
    profile: bool = False
    intra_op_threads: int = 0
    memory_arena: bool = True
    mixed_precision: str | None = None
    tf32: bool = True

    def session_config(self) -> SessionConfig:
        as_written = self.debug or self.disable_fusion
        return SessionConfig(
            optimization="disable" if as_written else "all",
            intra_op_threads=self.intra_op_threads,
            memory_arena=self.memory_arena,
            native_conv_grads=not as_written,
            native_segments=not as_written,
            specialize=not as_written,
            tf32=self.tf32,
        )


@dataclass
class ExecutionResult:
    """What one execution returns (host copies).

    Attributes:
        loss: The loss (None for a phase that does not compute it, or without a loss).
        outputs: The graph outputs and added outputs by name.
        times: Seconds per phase ("forward", "gradient", "optimizer"), when profiling.
        parameters: The parameters after the phase, in debug mode.
        gradients: The parameter gradients after the gradient phase, in debug mode.
    """

    loss: np.ndarray | None = None
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    gradients: dict[str, np.ndarray] = field(default_factory=dict)

    def merge(self, other: ExecutionResult) -> ExecutionResult:
        """This result with ``other``'s fields added (other's values win)."""
        if other.loss is not None:
            self.loss = other.loss
        self.outputs.update(other.outputs)
        self.times.update(other.times)
        self.parameters.update(other.parameters)
        self.gradients.update(other.gradients)
        return self


class OrderedExecutor:
    """Runs submitted work on one worker thread, in submission order.

    Synchronous calls go through the same queue, so they see the effect of every asynchronous
    call made before them; a call made from the worker itself (an ``on_complete`` callback)
    runs at once.
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._worker: threading.Thread | None = None

    def _in_worker(self) -> bool:
        return threading.current_thread() is self._worker

    def run(
        self,
        fn: Callable[[], T],
        asynchronous: bool = False,
        on_complete: OnComplete | None = None,
    ) -> T | Future[T]:
        """Run ``fn``; returns its result, or a Future when ``asynchronous``.

        ``on_complete(result, error)`` is called before the Future resolves.
        """

        def task() -> T:
            self._worker = threading.current_thread()
            try:
                result = fn()
            except BaseException as error:
                if on_complete is not None:
                    on_complete(None, error)
                raise
            if on_complete is not None:
                on_complete(result, None)
            return result

        if self._in_worker():
            if asynchronous:
                future: Future[T] = Future()
                try:
                    future.set_result(task())
                except BaseException as error:
                    future.set_exception(error)
                return future
            return task()
        future = self._pool.submit(task)
        return future if asynchronous else future.result()

    def wait(self) -> None:
        """Block until everything submitted so far has run."""
        if not self._in_worker():
            self._pool.submit(lambda: None).result()


def host(value: ort.OrtValue | np.ndarray) -> np.ndarray:
    """A host copy of an OrtValue (or of an array a native CPU kernel wrote)."""
    return np.array(value if isinstance(value, np.ndarray) else value.numpy(), copy=True)


def as_device_feed(value: Any, device_type: str, device_index: int) -> ort.OrtValue:
    """``value`` as an OrtValue on the device, owning its own copy of the data."""
    if isinstance(value, ort.OrtValue):
        return value
    array = np.array(value, copy=True, order="C")
    return ort.OrtValue.ortvalue_from_numpy(array, device_type, device_index)


def check_names(kind: str, given: Mapping[str, Any], expected: list[str]) -> None:
    """Raise a ValueError when ``given`` misses or adds names against ``expected``."""
    missing = [n for n in expected if n not in given]
    unknown = [n for n in given if n not in expected]
    if missing or unknown:
        raise ValueError(f"{kind}: expected {expected}; missing {missing}, unknown {unknown}")


def device_feeds(
    kind: str, feeds: Mapping[str, Any], expected: list[str], runner: BoundRunner, device: Device
) -> dict[str, ort.OrtValue]:
    """``feeds`` checked against the ``expected`` names and the runner's inputs, on ``device``.

    Raises:
        ValueError: ``feeds`` misses or adds names against ``expected``.
        ModelError: A feed's rank, fixed dimensions or dtype differ from the runner's input.
    """
    check_names(kind, feeds, expected)
    check_feeds(
        runner.inputs,
        [n for n in expected if n in runner.inputs],
        {n: v for n, v in feeds.items() if n in runner.inputs},
    )
    return {n: as_device_feed(v, device.ort_device_type, device.index) for n, v in feeds.items()}


def input_specs(
    graphs: Sequence[Graph], inputs: Mapping[str, Tensor | TensorSpec]
) -> dict[str, TensorSpec | None]:
    """The spec of each declared input: its TensorSpec, or None where a Tensor names it.

    Raises:
        ModelError: A name is no input of ``graphs``.
    """
    known = {v.name for g in graphs for v in g.ir_graph.inputs}
    specs: dict[str, TensorSpec | None] = {}
    for name, value in inputs.items():
        if name not in known:
            raise ModelError(
                f"{name!r} is not an input of the graphs; inputs: {sorted(map(str, known))}"
            )
        specs[name] = value if isinstance(value, TensorSpec) else None
    return specs
