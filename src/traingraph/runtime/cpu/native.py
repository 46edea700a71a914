"""The C extension ``traingraph.runtime._convc`` that holds the native CPU kernels, and the
output buffers its kernels write.

The extension is built at install time where a C compiler exists; :data:`NATIVE` is None (and
:data:`AVAILABLE` False) where it was not, and every kernel is then left to the graph.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from traingraph.runtime.device import physical_cores


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._convc")
    except ImportError:  # built at install time only where a C compiler exists
        return None


NATIVE = _load_native()

Arrays = Mapping[str, np.ndarray]
"""Arrays by name: what a kernel's ``compute`` reads."""
Outputs = dict[str, np.ndarray]
"""Arrays by name that a kernel's ``compute`` writes (in place where one is given)."""

AVAILABLE: bool = NATIVE is not None
"""Whether the native kernel was built at install time."""


def default_threads(intra_op_threads: int) -> int:
    """The kernels' thread count: onnxruntime's intra-op count, one per physical core when 0."""
    return intra_op_threads if intra_op_threads > 0 else physical_cores()


class OneOutput:
    """Mixed into the dataclass of a kernel that writes one value, its field ``out``."""

    out: str

    @property
    def outputs(self) -> list[str]:
        return [self.out]


@dataclass(frozen=True)
class NormalizationGrad:
    """The gradient of one normalization that a native kernel computes.

    Attributes:
        x: The normalization's input.
        scale: Its scale.
        dy: The gradient of its output.
        epsilon: Its epsilon.
        dx: The gradient of ``x`` the graph computes (None where nothing reads it).
        dscale: The scale's gradient (a model output, or a value the graph reads where the
            scale is computed), or None.
        dbias: The model output of the bias's gradient, or None where the graph does not
            compute it (a constant bias).
    """

    x: str
    scale: str
    dy: str
    epsilon: float
    dx: str | None
    dscale: str | None
    dbias: str | None

    @property
    def outputs(self) -> list[str]:
        return [n for n in (self.dx, self.dscale, self.dbias) if n]

    def run_native(
        self,
        function: str,
        inputs: Sequence[np.ndarray | None],
        out: dict[str, np.ndarray],
        features: tuple[int, ...],
        epsilon: float,
        threads: int,
    ) -> None:
        """Call the extension's ``function`` on ``inputs`` (``x`` first), the outputs and
        ``epsilon``: ``dx`` of ``x``'s shape and the others of the ``features``' shape (channels,
        or the normalized axis), written in place where ``out`` has arrays of those shapes and
        allocated there where not."""
        x = inputs[0]
        assert NATIVE is not None and x is not None
        for name, shape in ((self.dx, x.shape), (self.dscale, features), (self.dbias, features)):
            if name:
                output_array(out, name, shape)
        targets = [out[name] if name else None for name in (self.dx, self.dscale)]
        # the kernels sum dy on their way: into scratch where the bias's gradient is not asked
        dbias = out[self.dbias] if self.dbias else np.empty(features, np.float32)
        getattr(NATIVE, function)(*inputs, *targets, dbias, epsilon, threads)


def output_array(out: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``out[name]`` where it has ``shape`` (a native kernel writes it in place), else a new
    float32 array put there."""
    target = out.get(name)
    if target is None or target.shape != tuple(shape):
        target = out[name] = np.empty(shape, np.float32)
    return target
