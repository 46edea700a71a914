"""Named tensors that stay on a device between steps.

On the CPU a :class:`TensorStore` is one contiguous numpy block with a view (and a zero-copy
OrtValue) per tensor, so parameters can be read or written as one flat buffer and bound to
onnxruntime without copies. On a GPU each tensor is an OrtValue in device memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnxruntime as ort

from traingraph.errors import ModelError
from traingraph.runtime.device import Device

Spec = tuple[tuple[int, ...], np.dtype]


class TensorStore:
    """Tensors by name on ``device``, allocated once.

    Args:
        device: Where the tensors live.
        specs: Name -> (shape, dtype), in order.
        values: Optional initial values (zeros otherwise).
    """

    def __init__(
        self,
        device: Device,
        specs: Mapping[str, Spec],
        values: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.device = device
        self.specs = {n: (tuple(s), np.dtype(d)) for n, (s, d) in specs.items()}
        self._ortvalues: dict[str, ort.OrtValue] = {}
        self._views: dict[str, np.ndarray] = {}
        self.flat: np.ndarray | None = None
        dtypes = {d for _, d in self.specs.values()}
        if device.kind == "cpu" and len(dtypes) <= 1:
            dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
            sizes = [int(np.prod(s)) for s, _ in self.specs.values()]
            self.flat = np.zeros(sum(sizes), dtype=dtype)
            offset = 0
            for (name, (shape, _)), size in zip(self.specs.items(), sizes):
                view = self.flat[offset : offset + size].reshape(shape)
                self._views[name] = view
                self._ortvalues[name] = ort.OrtValue.ortvalue_from_numpy(view)
                offset += size
        else:
            for name, (shape, dtype) in self.specs.items():
                if device.kind == "cpu":
                    view = np.zeros(shape, dtype)
                    self._views[name] = view
                    self._ortvalues[name] = ort.OrtValue.ortvalue_from_numpy(view)
                else:
                    self._ortvalues[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                        list(shape), dtype, device.ort_device_type, device.index
                    )
        if values is not None:
            for name, array in values.items():
                self.write(name, array)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * d.itemsize for s, d in self.specs.values())

    @property
    def size(self) -> int:
        """Number of elements over all tensors."""
        return sum(int(np.prod(s)) for s, _ in self.specs.values())

    def ortvalue(self, name: str) -> ort.OrtValue:
        return self._ortvalues[name]

    def view(self, name: str) -> np.ndarray | None:
        """The host view of ``name`` (CPU only; None on other devices)."""
        return self._views.get(name)

    def host_view(self, name: str) -> np.ndarray:
        """The in-place host view of ``name``; only CPU tensors have one."""
        view = self._views.get(name)
        if view is None:
            raise ModelError(f"tensor {name!r} lives on {self.device}; it has no host view")
        return view

    def read(self, name: str) -> np.ndarray:
        """A host copy of ``name``."""
        view = self._views.get(name)
        return np.array(view, copy=True) if view is not None else self._ortvalues[name].numpy()

    def write(self, name: str, array: np.ndarray) -> None:
        """Copy ``array`` into ``name`` (shape and dtype must match; dtype is converted)."""
        if name not in self.specs:
            raise ModelError(f"unknown tensor {name!r}; expected one of {list(self.specs)[:10]}")
        shape, dtype = self.specs[name]
        array = np.asarray(array)
        if tuple(array.shape) != shape:
            raise ModelError(
                f"tensor {name!r} has shape {list(shape)}; got an array of shape"
                f" {list(array.shape)}"
            )
        view = self._views.get(name)
        if view is not None:
            np.copyto(
                view, array, casting="same_kind" if array.dtype.kind == dtype.kind else "unsafe"
            )
        else:
            self._ortvalues[name].update_inplace(np.ascontiguousarray(array, dtype=dtype))

    def read_flat(self) -> np.ndarray:
        """All tensors, flattened and concatenated in order (a copy)."""
        if self.flat is not None:
            return self.flat.copy()
        if not self.specs:
            return np.zeros(0, np.float32)
        return np.concatenate([self.read(n).reshape(-1) for n in self.specs])

    def write_flat(self, buffer: np.ndarray) -> None:
        """Set all tensors from one flat buffer of :attr:`size` elements."""
        buffer = np.asarray(buffer).reshape(-1)
        if buffer.size != self.size:
            raise ModelError(
                f"the buffer holds {buffer.size} elements, but the parameters need {self.size};"
                " get the expected size from get_parameters_size()"
            )
        offset = 0
        for name, (shape, _) in self.specs.items():
            n = int(np.prod(shape))
            self.write(name, buffer[offset : offset + n].reshape(shape))
            offset += n

    def like(self) -> TensorStore:
        """A new store with the same specs (zeros)."""
        return TensorStore(self.device, self.specs)


class PingPong:
    """Two stores of the same tensors: a graph reads ``cur`` and writes ``alt``; then swap."""

    def __init__(self, store: TensorStore) -> None:
        self.cur = store
        self.alt = store.like()

    def swap(self) -> None:
        self.cur, self.alt = self.alt, self.cur
