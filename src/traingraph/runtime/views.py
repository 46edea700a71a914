"""OrtValues that view part of another OrtValue's memory, on any device.

onnxruntime's Python API allocates every OrtValue it creates, except through DLPack: an
``OrtValue.from_dlpack`` tensor uses the memory the capsule points at. :func:`view` builds such
a capsule by hand for a range of a device buffer, so a flat block of device memory can be bound
as many tensors (one per parameter) and as one vector (for an update of all of them at once).

The capsule's ``DLManagedTensor`` and its shape live in one block from ``PyMem_RawMalloc``, and
its deleter is ``PyMem_RawFree``, so onnxruntime frees the block itself, without the GIL, when
the view is released. A view does not own the memory it points at: the Python wrapper it is
returned in keeps the viewed OrtValue alive.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

# DLPack's device types, and its type codes by numpy kind.
_DL_CPU, _DL_CUDA = 1, 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}
_DL_BOOL = 6
_CAPSULE_NAME = b"dltensor"


def _takes_bool_flag() -> bool:
    """Whether ``OrtValue.from_dlpack`` is the older ``(capsule, is_bool_tensor)`` form.

    onnxruntime up to 1.31 reads a bool tensor as uint8 unless told; from 1.32 it takes only
    the capsule and reads DLPack's own bool type code.
    """
    doc = ort.capi._pybind_state.OrtValue.from_dlpack.__doc__ or ""
    return "is_bool_tensor" in doc or "arg1" in doc


_BOOL_FLAG = _takes_bool_flag()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_api = ctypes.pythonapi
_api.PyMem_RawMalloc.restype = ctypes.c_void_p
_api.PyMem_RawMalloc.argtypes = [ctypes.c_size_t]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_RAW_FREE = ctypes.cast(_api.PyMem_RawFree, ctypes.c_void_p).value


def view(
    base: ort.OrtValue,
    offset: int,
    shape: Sequence[int],
    dtype: np.dtype | type,
    device_id: int = 0,
) -> ort.OrtValue:
    """An OrtValue of ``shape`` over ``base``'s memory, starting ``offset`` elements in.

    Args:
        base: A tensor OrtValue on the CPU or a CUDA device.
        offset: Where the view starts, in elements of ``dtype``.
        shape: The view's shape; it must fit in ``base`` from ``offset``.
        dtype: The element type of the view.
        device_id: The index of ``base``'s CUDA device.

    Raises:
        ValueError: The view does not fit, or ``base`` is on a device DLPack has no code for.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    available = base.tensor_size_in_bytes() // dtype.itemsize
    if offset < 0 or offset + count > available:
        raise ValueError(
            f"a view of shape {list(shape)} at element {offset} needs {offset + count} elements;"
            f" the buffer holds {available}"
        )
    device = base.device_name().lower()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"views of {device!r} memory are not supported; expected cpu or cuda")
    if dtype.kind not in _DL_CODES:
        raise ValueError(f"views of dtype {dtype} are not supported")
    ndim = len(shape)
    size = ctypes.sizeof(_DLManagedTensor) + 8 * max(ndim, 1)
    block = _api.PyMem_RawMalloc(size)
    if not block:
        raise MemoryError("could not allocate a tensor view")
    managed = _DLManagedTensor.from_address(block)
    dims = (ctypes.c_int64 * max(ndim, 1)).from_address(block + ctypes.sizeof(_DLManagedTensor))
    for i, d in enumerate(shape):
        dims[i] = int(d)
    t = managed.dl_tensor
    t.data = base.data_ptr() + offset * dtype.itemsize
    t.device = _DLDevice(_DL_CUDA if device == "cuda" else _DL_CPU, device_id)
    t.ndim = ndim
    code = _DL_BOOL if dtype.kind == "b" and not _BOOL_FLAG else _DL_CODES[dtype.kind]
    t.dtype = _DLDataType(code, dtype.itemsize * 8, 1)
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = None
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _RAW_FREE
    capsule = _api.PyCapsule_New(block, _CAPSULE_NAME, None)
    from_dlpack = ort.capi._pybind_state.OrtValue.from_dlpack
    c_value = from_dlpack(capsule, dtype.kind == "b") if _BOOL_FLAG else from_dlpack(capsule)
    return ort.OrtValue(c_value, base)
