"""The data-parallel CUDA-graph step: the captured training graph, one all-reduce of the flat
gradient block on the device (NCCL), then the update: the optimizer's CUDA kernel in place where
it compiles, else the captured optimizer graph."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from traingraph.distributed import DEFAULT_BUCKET_BYTES, DataParallel

if TYPE_CHECKING:
    from traingraph.api import Module
    from traingraph.runtime.cuda import CudaGraphStep
    from traingraph.runtime.tensors import TensorStore

__all__ = ["cuda_graph_step"]


class AveragingSession:
    """An onnxruntime session of the optimizer graph whose runs first average the gradients."""

    def __init__(self, session: Any, replica: DataParallel, grads: Callable[[], Any]) -> None:
        self._session = session
        self._replica = replica
        self._grads = grads

    def run_with_iobinding(self, binding: Any, options: Any = None) -> Any:
        self._replica.average_gradients(self._grads(), True)
        return self._session.run_with_iobinding(binding, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class AgreedFinite:
    """The ``grads_finite`` flag of a step with a loss scaler, read as the processes' verdict.

    Reading it averages the gradients with every process's flag in one all-reduce (the
    gradients are averaged whether or not they are finite, so every process joins it), and
    returns whether all of them were finite: the loss scalers of all processes then skip or
    apply the same updates and keep the same scale.
    """

    def __init__(self, store: Any, replica: DataParallel, grads: Callable[[], Any]) -> None:
        self._store = store
        self._replica = replica
        self._grads = grads

    def read(self, name: str) -> np.ndarray:
        local = bool(self._store.read(name))
        return np.array(self._replica.average_gradients(self._grads(), local))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def cuda_graph_step(
    module: Module, optimizer_uri: str | os.PathLike, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> CudaGraphStep:
    """A :class:`~traingraph.runtime.cuda.CudaGraphStep` of data-parallel training: the
    captured training graph, the gradients averaged over the processes (NCCL, on the device
    block), then the update: the optimizer's CUDA kernel, in place
    (:mod:`traingraph.runtime.optimizer.device`), or where it does not compile the captured
    optimizer graph, which writes the state's second copy. Its :class:`DataParallel` is
    ``step.replica`` (rank 0's parameters are broadcast when it is made).

    With a loss scaler (fp16 mixed precision), the average happens where the step reads the
    training graph's ``grads_finite`` flag, and carries every process's flag: all processes
    skip an update where any of them saw an inf or NaN gradient, and their loss scales stay
    equal.

    Example:
        >>> step = distributed.cuda_graph_step(module, "artifacts/optimizer_model.onnx")
        >>> for batch in batches:
        ...     step(*step.replica.shard(batch))
    """
    from traingraph.api import Optimizer
    from traingraph.runtime.cuda import CudaGraphStep

    class DataParallelCudaGraphStep(CudaGraphStep):
        replica: DataParallel
        writes_in_place = False  # no captured in-place optimizer graph: it keeps both copies
        kernel_always = True  # the optimizer's kernel, uncaptured, updates in place

        def _fused_model(self, static: Any) -> None:
            return None  # the update waits for the average

        def _capture_sessions(self, arrays: Mapping[str, np.ndarray]) -> None:
            super()._capture_sessions(arrays)
            state = self.step.state
            if self.step.loss_scaler is None:
                if self._optim is not None:
                    self._optim = AveragingSession(self._optim, self.replica, lambda: state.grads)
            elif not isinstance(self._finite, AgreedFinite):
                agreed = AgreedFinite(self._finite, self.replica, lambda: state.grads)
                self._finite = cast("TensorStore", agreed)

        def _before_kernel_update(self) -> None:
            if self.step.loss_scaler is None:  # else reading the finite flag averaged them
                self.replica.average_gradients(self.step.state.grads, True)

    optimizer = Optimizer(optimizer_uri, module)
    step = DataParallelCudaGraphStep(module, optimizer)
    step.replica = DataParallel(module, optimizer, bucket_bytes=bucket_bytes)
    return step
