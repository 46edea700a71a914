"""The few CUDA runtime calls that onnxruntime's Python API does not make for us.

A training step copies its batch to the GPU. ``OrtValue.update_inplace`` does that with a
synchronous copy from pageable memory, which waits for the GPU to drain and costs tens of
microseconds per tensor. :class:`StagedCopies` instead copies each input into page-locked
host memory and queues one asynchronous copy of them all on a CUDA stream that the step's
sessions run on (onnxruntime's ``user_compute_stream``), so the copy is ordered before the
step's kernels and the host goes on at once.

The runtime library is the ``libcudart`` that onnxruntime's CUDA provider loaded (found by its
soname once ``onnxruntime.preload_dlls()`` or the provider has loaded it). Where none can be
loaded, :func:`shared_stream` returns None and callers keep the synchronous copies.

Example:
    >>> stream = shared_stream(0)
    >>> feeds = StagedInputs(device, {"x": ((32, 784), np.dtype(np.float32))}, stream)
    >>> feeds.write_all({"x": batch})  # queued on the stream; the host does not wait
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort

from traingraph.errors import DeviceError
from traingraph.runtime.device import Device
from traingraph.runtime.tensors import Spec
from traingraph.runtime.views import view

_LIBRARIES = ("libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so")
_STREAM_NON_BLOCKING = 0x1
_EVENT_DISABLE_TIMING = 0x2
_HOST_TO_DEVICE = 1
_CAPTURE_RELAXED = 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    for name in _LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        return lib
    return None


def _check(status: int, call: str) -> None:
    if status != 0:
        lib = _library()
        text = lib.cudaGetErrorString(status).decode() if lib is not None else "unknown error"
        raise DeviceError(f"CUDA runtime call {call} failed with error {status}: {text}")


class Stream:
    """A non-blocking CUDA stream on one device; ``handle`` is its address, as onnxruntime's
    ``user_compute_stream`` option takes it."""

    def __init__(self, lib: ctypes.CDLL, index: int) -> None:
        handle = ctypes.c_void_p()
        _check(lib.cudaSetDevice(index), "cudaSetDevice")
        _check(
            lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _STREAM_NON_BLOCKING),
            "cudaStreamCreateWithFlags",
        )
        self.handle = int(handle.value or 0)
        self._lib = lib

    def synchronize(self) -> None:
        """Wait until the work queued on the stream is done."""
        status = self._lib.cudaStreamSynchronize(ctypes.c_void_p(self.handle))
        _check(status, "cudaStreamSynchronize")


class CapturedGraph:
    """The work that ``record`` queues on ``stream``, captured into a CUDA graph that
    :meth:`launch` replays there with one call.

    The capture is relaxed (``cudaStreamCaptureModeRelaxed``): calls such as an allocation,
    which may not be queued, are allowed while it lasts. Where ``record`` raises, the capture
    is ended and the error raised; the stream is usable again.

    Raises:
        DeviceError: The work could not be captured (a call waited for the stream, or copied
            to the host); the message is CUDA's.
    """

    def __init__(self, stream: Stream, record: Callable[[], None]) -> None:
        lib = stream._lib
        handle = ctypes.c_void_p(stream.handle)
        _check(lib.cudaStreamBeginCapture(handle, _CAPTURE_RELAXED), "cudaStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        finally:
            status = lib.cudaStreamEndCapture(handle, ctypes.byref(graph))
        _check(status, "cudaStreamEndCapture")
        executable = ctypes.c_void_p()
        try:
            _check(
                lib.cudaGraphInstantiate(ctypes.byref(executable), graph, ctypes.c_ulonglong(0)),
                "cudaGraphInstantiate",
            )
        finally:
            lib.cudaGraphDestroy(graph)
        weakref.finalize(self, lib.cudaGraphExecDestroy, executable)
        self._lib = lib
        self._stream = stream
        self._executable = executable

    def launch(self) -> None:
        """Queue the captured work on the stream."""
        handle = ctypes.c_void_p(self._stream.handle)
        _check(self._lib.cudaGraphLaunch(self._executable, handle), "cudaGraphLaunch")


def synchronize(handle: int) -> None:
    """Wait until the work queued on the stream at address ``handle`` is done (no wait where
    the CUDA runtime cannot be loaded: nothing of traingraph's was queued then)."""
    lib = _library()
    if lib is not None:
        _check(lib.cudaStreamSynchronize(ctypes.c_void_p(handle)), "cudaStreamSynchronize")


@functools.cache
def shared_stream(index: int) -> Stream | None:
    """The stream that traingraph's CUDA graph steps on device ``index`` run on, made once per
    process and kept for its lifetime (sessions hold it by address); None when the CUDA
    runtime library cannot be loaded."""
    lib = _library()
    return None if lib is None else Stream(lib, index)


def _pinned(lib: ctypes.CDLL, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array in page-locked host memory, freed when the array is collected."""
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    pointer = ctypes.c_void_p()
    _check(lib.cudaHostAlloc(ctypes.byref(pointer), ctypes.c_size_t(nbytes), 0), "cudaHostAlloc")
    address = int(pointer.value or 0)
    raw = (ctypes.c_byte * nbytes).from_address(address)
    weakref.finalize(raw, lib.cudaFreeHost, ctypes.c_void_p(address))
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


class StagedInputs:
    """Device tensors that a step reads, written from the host with one asynchronous copy.

    The tensors share one device allocation (each starting on a 256-byte boundary), mirrored
    by one page-locked host buffer. :meth:`write_all` fills the mirror and queues one copy of
    it on ``stream``, so work queued on ``stream`` afterwards sees the new values and the host
    does not wait. Before it overwrites the mirror it waits for the copy it queued the time
    before (long done in a training loop, whose step waits for its own kernels).

    Args:
        device: The CUDA device of the tensors.
        specs: Name -> (shape, dtype), in order.
        stream: The stream the readers of the tensors run on.
    """

    def __init__(self, device: Device, specs: Mapping[str, Spec], stream: Stream) -> None:
        lib = _library()
        assert lib is not None, "a Stream exists only where the runtime library loaded"
        self._lib = lib
        self._stream = ctypes.c_void_p(stream.handle)
        self.specs = {n: (tuple(shape), np.dtype(dtype)) for n, (shape, dtype) in specs.items()}
        offsets, total = {}, 0
        for name, (shape, dtype) in self.specs.items():
            offsets[name] = total
            total += -(-max(1, int(np.prod(shape, dtype=np.int64))) * dtype.itemsize // 256) * 256
        self._nbytes = max(total, 256)
        self._base = ort.OrtValue.ortvalue_from_shape_and_type(
            [self._nbytes], np.uint8, device.ort_device_type, device.index
        )
        self._mirror = _pinned(lib, (self._nbytes,), np.dtype(np.uint8))
        self._mirror[:] = 0
        self._host: dict[str, np.ndarray] = {}
        self._values: dict[str, ort.OrtValue] = {}
        for name, (shape, dtype) in self.specs.items():
            start, count = offsets[name], int(np.prod(shape, dtype=np.int64))
            chunk = self._mirror[start : start + count * dtype.itemsize]
            self._host[name] = chunk.view(dtype).reshape(shape)
            self._values[name] = view(
                self._base, start // dtype.itemsize, shape, dtype, device.index
            )
        event = ctypes.c_void_p()
        _check(lib.cudaSetDevice(device.index), "cudaSetDevice")
        _check(
            lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        self._event = event
        weakref.finalize(self, lib.cudaEventDestroy, event)
        self._pending = False

    def ortvalue(self, name: str) -> ort.OrtValue:
        return self._values[name]

    def wait(self) -> None:
        """Wait until the copy queued last has landed."""
        if self._pending:
            _check(self._lib.cudaEventSynchronize(self._event), "cudaEventSynchronize")
            self._pending = False

    def write_all(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Set the tensors ``arrays`` names (to host arrays of their shapes) and queue the copy;
        the others keep their values."""
        lib = self._lib
        self.wait()
        for name, array in arrays.items():
            np.copyto(self._host[name], array, casting="same_kind")
        _check(
            lib.cudaMemcpyAsync(
                self._base.data_ptr(),
                self._mirror.ctypes.data,
                self._nbytes,
                _HOST_TO_DEVICE,
                self._stream,
            ),
            "cudaMemcpyAsync",
        )
        _check(lib.cudaEventRecord(self._event, self._stream), "cudaEventRecord")
        self._pending = True
