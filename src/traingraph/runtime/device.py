"""Devices: which onnxruntime execution provider runs the graphs, and where tensors live."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort

from traingraph.errors import DeviceError

CUDA_INSTALL_HINT = (
    "Install the GPU build of onnxruntime in place of the CPU one: "
    "pip uninstall -y onnxruntime && pip install 'traingraph[gpu]' "
    "(both wheels provide the module onnxruntime, so only one may be installed)."
)


@dataclass(frozen=True)
class Device:
    """A device that runs graphs: ``Device("cpu")``, ``Device("cuda", 1)``.

    Attributes:
        kind: "cpu" or "cuda".
        index: The GPU's index (0 for the CPU).
    """

    kind: str = "cpu"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def ort_device_type(self) -> str:
        """The device name that onnxruntime's OrtValue and IOBinding use."""
        return self.kind

    def providers(self, cuda_options: Mapping[str, str] | None = None) -> list[Any]:
        """The execution providers (with options) for a session on this device.

        Args:
            cuda_options: CUDA execution provider options (``SessionConfig.cuda_options()``
                gives them), ignored on the CPU. ``device_id`` is this device's index. With
                ``enable_cuda_graph`` on, the CPU provider is left out: a captured graph needs
                every node on the GPU.

        Example:
            >>> Device("cuda", 1).providers({"use_tf32": "0"})
            [('CUDAExecutionProvider', {'use_tf32': '0', 'device_id': '1'}), 'CPUExecutionProvider']
        """
        if self.kind == "cpu":
            return ["CPUExecutionProvider"]
        options = {**(cuda_options or {}), "device_id": str(self.index)}
        cuda = ("CUDAExecutionProvider", options)
        if options.get("enable_cuda_graph") == "1":
            return [cuda]
        return [cuda, "CPUExecutionProvider"]


def parse_device(device: str | Device | None) -> Device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a :class:`Device` -> a checked :class:`Device`.

    Raises:
        DeviceError: For an unknown device name, or CUDA without a CUDA-enabled onnxruntime.
    """
    if device is None:
        return Device()
    if isinstance(device, Device):
        parsed = device
    elif isinstance(device, str):
        text = device.strip().lower()
        kind, _, index = text.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise DeviceError(
                f"unknown device {device!r}; expected 'cpu', 'cuda' or 'cuda:N' (N a GPU index)"
            )
        parsed = Device(kind, int(index) if index else 0)
    else:
        raise DeviceError(
            f"device must be a string or a traingraph Device, got {type(device).__name__}"
        )
    if parsed.kind == "cuda":
        _check_cuda(parsed.index)
    return parsed


@functools.cache
def _preload_cuda() -> None:
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        # A failure here is reported by the provider check, which names what is missing.
        with contextlib.suppress(Exception):
            preload()


def _check_cuda(index: int) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise DeviceError(
            f"device 'cuda:{index}' needs onnxruntime's CUDAExecutionProvider, but the installed"
            f" onnxruntime {ort.__version__} offers {ort.get_available_providers()}. "
            + CUDA_INSTALL_HINT
        )
    _preload_cuda()

@functools.cache
def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on: onnxruntime's default
    intra-op thread count. The usable CPUs where the topology cannot be read."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if cpus is None:
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(
                f"{topology}/core_id"
            ) as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))
