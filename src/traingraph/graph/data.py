"""Data for graphs: weight sources that load just in time, and a double-buffered input pipeline.

A :class:`WeightSource` holds no weight until asked: a graph that is saved or compiled loads
each source on first use, copies it where it goes (the ONNX file, the device's parameter
buffers) and purges it, so a large model's weights are never all in host memory at once.

An :class:`InputPipeline` prepares batches on a host thread while the device runs earlier ones:
at most ``depth`` batches are prepared ahead, and :meth:`InputPipeline.run` keeps at most
``max_in_flight`` steps submitted to a training or inference graph.

Example:
    >>> pipe = InputPipeline(range(100), prepare=lambda i: Batch({"x": X[i]}, {"y": Y[i]}))
    >>> results = pipe.run(train, max_in_flight=2)
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from traingraph.errors import ModelError

__all__ = ["Batch", "InputPipeline", "PipelineStats", "WeightSource"]


class WeightSource:
    """A parameter value that is loaded on first use and can be purged afterwards.

    Args:
        loader: Returns the value (called on each :meth:`load` after a purge).
        shape: The value's shape, known without loading it.
        dtype: The value's dtype.

    Example:
        >>> src = WeightSource.from_file("fc1_weight.npy")
        >>> layer = layers.Linear(784, 256, weight=src)
    """

    def __init__(
        self, loader: Callable[[], np.ndarray], shape: Any, dtype: Any = "float32"
    ) -> None:
        self.loader = loader
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.loads = 0
        self._data: np.ndarray | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> WeightSource:
        """A source reading a ``.npy`` file (memory-mapped, so loading reads only what is used)."""
        path = os.fspath(path)
        header = np.load(path, mmap_mode="r", allow_pickle=False)
        shape, dtype = header.shape, header.dtype
        del header
        return cls(lambda: np.load(path, mmap_mode="r", allow_pickle=False), shape, dtype)

    @property
    def is_loaded(self) -> bool:
        return self._data is not None

    @property
    def data(self) -> np.ndarray:
        """The value, loading it first when purged."""
        self.load()
        assert self._data is not None
        return self._data

    def load(self) -> None:
        """Load the value (a no-op when loaded); checks its shape and dtype."""
        with self._lock:
            if self._data is not None:
                return
            value = np.asarray(self.loader())
            if value.shape != self.shape:
                raise ModelError(
                    f"the weight source returned shape {list(value.shape)}; it was declared"
                    f" with shape {list(self.shape)}"
                )
            self._data = value.astype(self.dtype, copy=False)
            self.loads += 1

    def purge(self) -> None:
        """Drop the loaded value; the next use loads it again."""
        with self._lock:
            self._data = None

    def __enter__(self) -> WeightSource:
        self.load()
        return self

    def __exit__(self, *exc: object) -> None:
        self.purge()

    def __repr__(self) -> str:
        state = "loaded" if self.is_loaded else "purged"
        return f"WeightSource(shape={self.shape}, dtype={self.dtype.name}, {state})"


@dataclass
class Batch:
    """One step's feeds: graph inputs, and the loss labels and label weights when training."""

    inputs: Mapping[str, Any]
    loss_labels: Mapping[str, Any] | None = None
    loss_label_weights: Mapping[str, Any] | None = None


class Executes(Protocol):
    def execute(self, inputs: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any: ...


@dataclass
class PipelineStats:
    """What a :meth:`InputPipeline.run` did.

    Attributes:
        max_in_flight: The most steps that were submitted and not complete at one time.
        prepare_spans: (start, end) ``time.perf_counter`` of each batch's preparation.
        step_spans: (start, end) of each step, from its submission to its completion.
    """

    max_in_flight: int = 0
    prepare_spans: list[tuple[float, float]] = field(default_factory=list)
    step_spans: list[tuple[float, float]] = field(default_factory=list)


_DONE = object()


class InputPipeline:
    """Batches prepared on a host thread, at most ``depth`` ahead of their consumer.

    Args:
        source: The items to prepare (indices, file names, raw batches, ...).
        prepare: Turns an item into a :class:`Batch` (or an ``(inputs, loss_labels)`` pair).
        depth: How many prepared batches may wait; 2 is double buffering.
    """

    def __init__(
        self,
        source: Iterable[Any],
        prepare: Callable[[Any], Any] | None = None,
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1; got {depth}")
        self.source = source
        self.prepare = prepare or (lambda item: item)
        self.depth = depth
        self.stats = PipelineStats()

    def __iter__(self) -> Iterator[Batch]:
        prepared: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def produce() -> None:
            try:
                for item in self.source:
                    start = time.perf_counter()
                    batch = _as_batch(self.prepare(item))
                    self.stats.prepare_spans.append((start, time.perf_counter()))
                    while not stop.is_set():
                        try:
                            prepared.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                prepared.put(_DONE)
            except BaseException as error:
                prepared.put(error)

        worker = threading.Thread(target=produce, name="traingraph-input", daemon=True)
        worker.start()
        try:
            while True:
                batch = prepared.get()
                if batch is _DONE:
                    return
                if isinstance(batch, BaseException):
                    raise batch
                yield batch
        finally:
            stop.set()
            worker.join()

    def run(self, graph: Executes, max_in_flight: int = 2) -> list[Any]:
        """Execute every batch on ``graph`` asynchronously, ``max_in_flight`` at most at a time.

        Returns:
            The results in batch order.
        """
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1; got {max_in_flight}")
        slots = threading.BoundedSemaphore(max_in_flight)
        lock = threading.Lock()
        in_flight = 0
        futures: list[Future[Any]] = []
        self.stats = PipelineStats()

        def finished(index: int, start: float) -> Callable[[Any, BaseException | None], None]:
            def callback(result: Any, error: BaseException | None) -> None:
                nonlocal in_flight
                with lock:
                    in_flight -= 1
                    self.stats.step_spans[index] = (start, time.perf_counter())
                slots.release()

            return callback

        for index, batch in enumerate(self):
            slots.acquire()
            with lock:
                in_flight += 1
                self.stats.max_in_flight = max(self.stats.max_in_flight, in_flight)
                start = time.perf_counter()
                self.stats.step_spans.append((start, start))
            kwargs = {"asynchronous": True, "on_complete": finished(index, start)}
            if batch.loss_labels is not None:
                kwargs["loss_labels"] = batch.loss_labels
            if batch.loss_label_weights is not None:
                kwargs["loss_label_weights"] = batch.loss_label_weights
            futures.append(graph.execute(batch.inputs, **kwargs))
        return [f.result() for f in futures]


def _as_batch(value: Any) -> Batch:
    if isinstance(value, Batch):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3):
        return Batch(*value)
    if isinstance(value, Mapping):
        return Batch(value)
    raise TypeError(
        "prepare must return a Batch, an (inputs, loss_labels[, loss_label_weights]) tuple or a"
        f" mapping of inputs; got {type(value).__name__}"
    )
