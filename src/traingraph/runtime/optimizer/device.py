"""The optimizer update as one CUDA kernel over the state's flat blocks.

On a GPU the flat optimizer graph runs each of its elementwise ops as a kernel over each chunk
of the parameters (AdamW: 16 ops, each reading and writing whole chunks). The kernels of
``runtime/cuda/optimizer.cu`` apply the same ops in the same order per element in one pass
over the blocks, in place, as the CPU's fused update does
(:func:`~traingraph.runtime.optimizer.fused.fused_update`, which documents the formulas): the
same numbers bit for bit, about a fifth of the memory traffic, no second copy of the state.
The coefficients are computed here in float64 (the bias corrections with C's ``pow`` and
``sqrt``, as the graph computes them in float64) and rounded to the parameters' dtype.

:func:`device_update` gives the update where the kernels compile for the device (NVRTC and
the CUDA driver load, :mod:`traingraph.runtime.cuda.kernels`) and the optimizer has a one-pass
form; else None, and the runtime runs the graph.

Example:
    >>> update = device_update("adamw", hyperparameters, spans, device_index=0)
    >>> update(blocks, size, np.dtype(np.float32), lr=1e-3, step=1, stream=stream.handle)
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from traingraph.runtime.optimizer.fused import runs, undecayed_spans

SOURCE = "optimizer.cu"
"""The CUDA source of the kernels (in :mod:`traingraph.runtime.cuda`)."""

_SGD_PLAIN, _SGD_MOMENTUM, _SGD_NESTEROV, _SGD_DAMPENED, _SGD_FIRST_DAMPENED = range(5)
_SUFFIX = {
    np.dtype(np.float32): ("f32", ctypes.c_float),
    np.dtype(np.float64): ("f64", ctypes.c_double),
}


class DeviceUpdate:
    """One optimizer step in place over device blocks; see :func:`device_update`.

    Args:
        name: ``"adamw"`` or ``"sgd"``.
        hyperparameters: The optimizer's hyperparameters.
        undecayed: The spans of the flat block without weight decay.
        source: The compiled kernels.
    """

    def __init__(
        self,
        name: str,
        hyperparameters: Mapping[str, Any],
        undecayed: list[tuple[int, int]],
        source: Any,
    ) -> None:
        self.name = name
        self.hyperparameters = dict(hyperparameters)
        momentum = self.hyperparameters.get("momentum", 0.0) > 0
        self.slot_kinds: tuple[str, ...] = (
            ("exp_avg", "exp_avg_sq") if name == "adamw"
            else ("momentum_buffer",) if momentum else ()
        )  # fmt: skip
        """The slot kinds the update reads and writes."""
        self._undecayed = undecayed
        self._source = source

    def __call__(
        self,
        blocks: Mapping[str, int],
        size: int,
        dtype: np.dtype,
        *,
        lr: float,
        step: int,
        stream: int,
    ) -> None:
        """Queue the update of ``size`` elements on ``stream``.

        Args:
            blocks: Device addresses of the blocks: ``"param"``, ``"grad"`` and each slot kind
                (``"exp_avg"``, ``"exp_avg_sq"`` or ``"momentum_buffer"``).
            size: Elements of each block.
            dtype: Their dtype (float32 or float64).
            lr: The learning rate.
            step: The 1-based number of this step.
            stream: The ``cudaStream_t`` address the update is queued on.
        """
        suffix, scalar = _SUFFIX[np.dtype(dtype)]
        itemsize = np.dtype(dtype).itemsize
        h = self.hyperparameters
        weight_decay = h.get("weight_decay", 0.01 if self.name == "adamw" else 0.0)
        for start, stop, decay in runs(size, self._undecayed, weight_decay):
            coefficients: tuple[float, ...]
            if self.name == "adamw":
                b1, b2 = h.get("betas", (0.9, 0.999))
                coefficients = (
                    1.0 - b1, b2, 1.0 - b2, 1.0 - math.pow(b1, step),
                    math.sqrt(1.0 - math.pow(b2, step)), h.get("eps", 1e-8), decay, -lr,
                )  # fmt: skip
                flags = [ctypes.c_int(decay != 0)]
                kinds = ["param", "grad", "exp_avg", "exp_avg_sq"]
            else:
                momentum, dampening = h.get("momentum", 0.0), h.get("dampening", 0.0)
                mode = (
                    _SGD_PLAIN if momentum <= 0
                    else _SGD_NESTEROV if h.get("nesterov", False)
                    else _SGD_MOMENTUM if dampening == 0
                    else _SGD_FIRST_DAMPENED if step == 1
                    else _SGD_DAMPENED
                )  # fmt: skip
                coefficients = (decay, momentum, 1.0 - dampening, -lr)
                flags = [ctypes.c_int(decay != 0), ctypes.c_int(mode)]
                kinds = ["param", "grad", "momentum_buffer"]
            scalars = [scalar(c) for c in coefficients]
            starts = [blocks[k] + start * itemsize if k in blocks else 0 for k in kinds]
            # 16-byte vectors where every block is aligned so, then the elements left one by one
            width = 16 // itemsize if all(a % 16 == 0 for a in starts) else 1
            vectors = (stop - start) // width if width > 1 else 0
            for kernel, first, count in (
                (f"{self.name}_{suffix}_vec", 0, vectors),
                (f"{self.name}_{suffix}", vectors * width, stop - start - vectors * width),
            ):
                if count <= 0:
                    continue
                pointers = [ctypes.c_void_p(a + first * itemsize if a else 0) for a in starts]
                args = [*pointers, ctypes.c_longlong(count), *scalars, *flags]
                self._source.launch(kernel, count, args, stream)

def device_update(
    name: str,
    hyperparameters: Mapping[str, Any],
    spans: Mapping[str, tuple[int, int]] | None,
    *,
    device_index: int,
) -> DeviceUpdate | None:
    """The one-kernel update of optimizer ``name`` on CUDA device ``device_index``, or None
    where it has no one-pass form (:func:`~traingraph.runtime.optimizer.fused.undecayed_spans`)
    or the kernels cannot be compiled there.

    Args:
        name: The optimizer's name (``"adamw"``, ``"sgd"``, ...).
        hyperparameters: Its hyperparameters.
        spans: Each parameter's ``(start, stop)`` in the flat block (needed where some are left
            out of the weight decay).
        device_index: The CUDA device.
    """
    undecayed = undecayed_spans(name, hyperparameters, spans)
    if undecayed is None:
        return None
    from traingraph.runtime.cuda import kernels

    source = kernels.load(SOURCE, device_index)
    if source is None:
        return None
    return DeviceUpdate(name, hyperparameters, undecayed, source)


__all__ = ["DeviceUpdate", "SOURCE", "device_update"]
