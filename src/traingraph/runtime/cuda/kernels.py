"""CUDA kernels of traingraph's own, compiled at run time for the GPU they run on.

Some work of a training step is one pass over large flat blocks that onnxruntime runs as
many elementwise kernels: the optimizer update takes about 16 per chunk of parameters, each
reading and writing whole chunks. The CUDA C sources beside this module (``*.cu``) do such
work in one kernel. :func:`load` compiles one with NVRTC, the CUDA runtime compiler
(``libnvrtc``, which ships with the CUDA libraries of ``onnxruntime-gpu[cuda]`` and with
PyTorch's CUDA wheels), into a binary for the device's architecture, and
:meth:`CompiledSource.launch` runs its kernels through the CUDA driver (``libcuda``) on a
given stream, in the primary context that onnxruntime and the CUDA runtime use, so they read
and write onnxruntime's device buffers.

The sources are compiled with ``--fmad=false`` and NVRTC's IEEE division and square root, so
a kernel that applies a graph's ops in the graph's order gives the graph's numbers bit for
bit (onnxruntime's elementwise kernels round after every op).

Where either library cannot be loaded or a source does not compile, :func:`load` returns
None (:func:`unavailable_reason` says why) and callers run the graph instead.

Example:
    >>> source = load("optimizer.cu", device_index=0)
    >>> source.launch("sgd_f32", n, [ctypes.c_void_p(p), ...], stream=stream.handle)
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

from traingraph.errors import DeviceError

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
_OPTIONS = (b"--fmad=false", b"--prec-div=true", b"--prec-sqrt=true", b"--ftz=false")
_BLOCK = 256
_ATTR_MULTIPROCESSORS = 16
_ATTR_MAJOR, _ATTR_MINOR = 75, 76
_DRIVER_FUNCTIONS = (
    "cuInit", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuModuleLoadData", "cuModuleGetFunction",
    "cuLaunchKernel",
)  # fmt: skip
_reasons: dict[tuple[str, int], str] = {}


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if not all(hasattr(lib, name) for name in _DRIVER_FUNCTIONS):
        return None
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p,
    ]  # fmt: skip
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuLaunchKernel.argtypes = [
        ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    return lib if lib.cuInit(0) == 0 else None


def _pip_libraries(prefix: str) -> Iterator[Path]:
    """Shared libraries named ``prefix*`` in pip's ``nvidia`` packages (``nvidia/*/lib``)."""
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        if base.is_dir():
            yield from sorted(base.glob(f"*/lib/{prefix}*"), reverse=True)


@functools.cache
def _nvrtc() -> ctypes.CDLL | None:
    for name in (*_NVRTC_NAMES, *map(str, _pip_libraries("libnvrtc.so"))):
        try:
            lib = ctypes.CDLL(name)
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        except (OSError, AttributeError):
            continue
        return lib
    return None


def _driver_check(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(text))
        message = (text.value or b"unknown error").decode()
        raise DeviceError(f"CUDA driver call {call} failed with error {status}: {message}")


class CompiledSource:
    """A CUDA source compiled and loaded on one device; :meth:`launch` runs its kernels.

    Args:
        driver: The CUDA driver library.
        context: The device's primary context.
        module: The loaded module.
        multiprocessors: The device's streaming multiprocessors (a launch's grid is a few
            blocks per multiprocessor; kernels loop over what is left).
    """

    def __init__(
        self, driver: ctypes.CDLL, context: ctypes.c_void_p, module: ctypes.c_void_p,
        multiprocessors: int,
    ) -> None:  # fmt: skip
        self._driver = driver
        self._context = context
        self._module = module
        self._functions: dict[str, ctypes.c_void_p] = {}
        self.multiprocessors = max(1, multiprocessors)
        self._max_blocks = self.multiprocessors * 8

    def _function(self, name: str) -> ctypes.c_void_p:
        function = self._functions.get(name)
        if function is None:
            function = ctypes.c_void_p()
            _driver_check(
                self._driver,
                self._driver.cuModuleGetFunction(
                    ctypes.byref(function), self._module, name.encode()
                ),
                f"cuModuleGetFunction({name!r})",
            )
            self._functions[name] = function
        return function

    def launch(
        self, name: str, elements: int, args: Sequence[ctypes._SimpleCData], stream: int
    ) -> None:
        """Queue kernel ``name`` over ``elements`` elements on ``stream`` (a ``cudaStream_t``
        address, as onnxruntime's ``user_compute_stream`` takes it), with ``args`` (ctypes
        values in the kernel's parameter order)."""
        if elements <= 0:
            return
        blocks = min(-(-elements // _BLOCK), self._max_blocks)
        self.launch_grid(name, (blocks, 1), args, stream)

    def launch_grid(
        self,
        name: str,
        grid: tuple[int, int],
        args: Sequence[ctypes._SimpleCData],
        stream: int,
    ) -> None:
        """Queue kernel ``name`` on a ``grid`` of (x, y) blocks of 256 threads, as
        :meth:`launch` does."""
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        lib = self._driver
        _driver_check(lib, lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        _driver_check(
            lib,
            lib.cuLaunchKernel(
                self._function(name), grid[0], grid[1], 1, _BLOCK, 1, 1, 0,
                ctypes.c_void_p(stream), pointers, None,
            ),  # fmt: skip
            f"cuLaunchKernel({name!r})",
        )


def _compile(nvrtc: ctypes.CDLL, source: bytes, name: str, arch: str) -> bytes:
    """The cubin of ``source`` for ``sm_<arch>``; raises RuntimeError with NVRTC's log."""
    program = ctypes.c_void_p()

    def check(status: int, call: str) -> None:
        if status != 0:
            raise RuntimeError(f"{call}: {nvrtc.nvrtcGetErrorString(status).decode()}")

    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        options = (ctypes.c_char_p * (len(_OPTIONS) + 1))(
            f"--gpu-architecture=sm_{arch}".encode(), *_OPTIONS
        )
        status = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if status != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"{name} does not compile for sm_{arch}: {log.value.decode()}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


@functools.cache
def load(source_name: str, device_index: int) -> CompiledSource | None:
    """The CUDA source ``source_name`` (a ``.cu`` file of this package) compiled for device
    ``device_index`` and loaded there, once per process; None where the CUDA driver or NVRTC
    cannot be loaded or the source does not compile for the device (see
    :func:`unavailable_reason`)."""
    driver, nvrtc = _driver(), _nvrtc()
    key = (source_name, device_index)
    if driver is None or nvrtc is None:
        missing = "the CUDA driver (libcuda.so.1)" if driver is None else "NVRTC (libnvrtc)"
        _reasons[key] = f"{missing} could not be loaded"
        return None
    try:
        device, context = ctypes.c_int(), ctypes.c_void_p()
        _driver_check(driver, driver.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        attributes = []
        for attribute in (_ATTR_MAJOR, _ATTR_MINOR, _ATTR_MULTIPROCESSORS):
            value = ctypes.c_int()
            _driver_check(
                driver,
                driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
                "cuDeviceGetAttribute",
            )
            attributes.append(value.value)
        major, minor, multiprocessors = attributes
        _driver_check(
            driver,
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
            "cuDevicePrimaryCtxRetain",
        )
        _driver_check(driver, driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        source = resources.files(__package__).joinpath(source_name).read_bytes()
        cubin = _compile(nvrtc, source, source_name, f"{major}{minor}")
        module = ctypes.c_void_p()
        _driver_check(
            driver, driver.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData"
        )
    except (DeviceError, RuntimeError, OSError, AttributeError) as error:
        # AttributeError: a library without a function used here (an NVRTC older than 11.1)
        _reasons[key] = str(error)
        return None
    return CompiledSource(driver, context, module, multiprocessors)


def unavailable_reason(source_name: str, device_index: int) -> str | None:
    """Why :func:`load` returned None for these arguments (None if it did not)."""
    return _reasons.get((source_name, device_index))


__all__ = ["CompiledSource", "load", "unavailable_reason"]
