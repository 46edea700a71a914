"""Named tensors that stay on a device between steps.

A :class:`TensorStore` keeps tensors of one dtype in one flat block with a view per tensor: a
numpy array on the CPU, one device allocation on a GPU. Parameters bind to onnxruntime without
copies, can be read or written as one flat buffer, and can be updated as one vector.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnxruntime as ort

from traingraph.errors import ModelError
from traingraph.runtime.device import Device
from traingraph.runtime.views import view as device_view

Spec = tuple[tuple[int, ...], np.dtype]


class TensorStore:
    """Tensors by name on ``device``, allocated once.

    Tensors of one dtype share one flat block: on the CPU a numpy array with a view (and a
    zero-copy OrtValue) per tensor; on a CUDA device one allocation with an OrtValue view per
    tensor (:func:`~traingraph.runtime.views.view`), each starting on a 256-byte boundary.
    :meth:`block` views a range of the block as one vector, so an update of every tensor can
    run as one kernel over it.

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
        self._blocks: dict[tuple[int, int], ort.OrtValue] = {}
        self.flat: np.ndarray | None = None
        """The CPU block (None on other devices or with mixed dtypes)."""
        self.offsets: dict[str, int] | None = None
        """Where each tensor starts in the block, in elements (None without a block)."""
        self.flat_size = 0
        """The block's length in elements, padding included."""
        self._base: ort.OrtValue | None = None
        dtypes = {d for _, d in self.specs.values()}
        if len(dtypes) <= 1 and device.kind in ("cpu", "cuda"):
            self._allocate_block(dtypes.pop() if dtypes else np.dtype(np.float32))
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

    def _allocate_block(self, dtype: np.dtype) -> None:
        # CUDA kernels load vectors: start every tensor on a 256-byte boundary there.
        align = 1 if self.device.kind == "cpu" else max(1, 256 // dtype.itemsize)
        self.offsets = {}
        for name, (shape, _) in self.specs.items():
            self.offsets[name] = self.flat_size
            size = int(np.prod(shape, dtype=np.int64))
            self.flat_size += -(-size // align) * align
        if self.device.kind == "cpu":
            self.flat = np.zeros(self.flat_size, dtype=dtype)
            for name, (shape, _) in self.specs.items():
                start = self.offsets[name]
                view = self.flat[start : start + int(np.prod(shape))].reshape(shape)
                self._views[name] = view
                self._ortvalues[name] = ort.OrtValue.ortvalue_from_numpy(view)
            return
        base = ort.OrtValue.ortvalue_from_shape_and_type(
            [max(self.flat_size, 1)], dtype, self.device.ort_device_type, self.device.index
        )
        base.update_inplace(np.zeros(max(self.flat_size, 1), dtype))  # padding stays zero
        self._base = base
        for name, (shape, _) in self.specs.items():
            self._ortvalues[name] = device_view(
                base, self.offsets[name], shape, dtype, self.device.index
            )

    def block(self, start: int, stop: int) -> ort.OrtValue:
        """Elements ``[start, stop)`` of the flat block as one 1-D OrtValue (no copy).

        Raises:
            ModelError: The store has no flat block (its tensors have several dtypes).
        """
        if self.offsets is None:
            raise ModelError(
                f"the tensors on {self.device} have dtypes"
                f" {sorted({str(d) for _, d in self.specs.values()})}; a flat block needs one"
            )
        key = (start, stop)
        if key not in self._blocks:
            if self.flat is not None:
                self._blocks[key] = ort.OrtValue.ortvalue_from_numpy(self.flat[start:stop])
            else:
                assert self._base is not None
                dtype = next(iter(self.specs.values()))[1]
                self._blocks[key] = device_view(
                    self._base, start, (stop - start,), dtype, self.device.index
                )
        return self._blocks[key]

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
    def allocated_bytes(self) -> int:
        """Bytes the store allocated: its flat block (padding included), or its tensors."""
        if self.offsets is not None:
            dtype = next(iter(self.specs.values()))[1] if self.specs else np.dtype(np.float32)
            return self.flat_size * dtype.itemsize
        return self.nbytes

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

    def write_all(self, arrays: Mapping[str, np.ndarray]) -> None:
        """:meth:`write` each of ``arrays`` (name -> array)."""
        for name, array in arrays.items():
            self.write(name, array)

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
    """Two stores of the same tensors: a graph reads ``cur`` and writes ``alt``; then swap.

    The second store is allocated when ``alt`` is first used: an update that writes the
    tensors in place (the fused CPU optimizer) never holds it.
    """

    def __init__(self, store: TensorStore) -> None:
        self.cur = store
        self._alt: TensorStore | None = None

    @property
    def alt(self) -> TensorStore:
        """The store a graph writes (allocated, as zeros, on first use)."""
        if self._alt is None:
            self._alt = self.cur.like()
        return self._alt

    @property
    def allocated(self) -> list[TensorStore]:
        """The stores allocated so far: ``cur``, and ``alt`` once it has been used."""
        return [self.cur] if self._alt is None else [self.cur, self._alt]

    def swap(self) -> None:
        self.cur, self._alt = self.alt, self.cur
