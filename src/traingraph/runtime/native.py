"""The C extension ``traingraph.runtime._convc`` that holds the native CPU kernels, and the
output buffers its kernels write.

The extension is built at install time where a C compiler exists; :data:`NATIVE` is None (and
:data:`AVAILABLE` False) where it was not, and every kernel is then left to the graph.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from traingraph.runtime.device import physical_cores


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._convc")
    except ImportError:  # built at install time only where a C compiler exists
        return None


NATIVE = _load_native()

AVAILABLE: bool = NATIVE is not None
"""Whether the native kernel was built at install time."""


def default_threads(intra_op_threads: int) -> int:
    """The kernels' thread count: onnxruntime's intra-op count, one per physical core when 0."""
    return intra_op_threads if intra_op_threads > 0 else physical_cores()


class NormalizationGradOutputs:
    """What a normalization's gradient kernel writes (``dx`` and ``dscale`` where not None,
    ``dbias``); mixed into the kernels' dataclasses that have those fields."""

    dx: str | None
    dscale: str | None
    dbias: str

    @property
    def outputs(self) -> list[str]:
        return [n for n in (self.dx, self.dscale, self.dbias) if n]

    def output_arrays(
        self, out: dict[str, np.ndarray], x: tuple[int, ...], features: tuple[int, ...]
    ) -> None:
        """Arrays in ``out`` for the outputs: ``dx`` of ``x``'s shape, the others of the shape
        of the ``features`` (channels, or the normalized axis)."""
        for name, shape in ((self.dx, x), (self.dscale, features), (self.dbias, features)):
            if name:
                output_array(out, name, shape)


def output_array(out: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``out[name]`` where it has ``shape`` (a native kernel writes it in place), else a new
    float32 array put there."""
    target = out.get(name)
    if target is None or target.shape != tuple(shape):
        target = out[name] = np.empty(shape, np.float32)
    return target
