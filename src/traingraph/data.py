"""Batching numpy arrays: deterministic per-epoch shuffling that a resumed run can reproduce.

Example:
    >>> from traingraph.data import Batches
    >>> batches = Batches((x, y), batch_size=32, seed=0)
    >>> for xb, yb in batches.epoch(3, start=10):  # epoch 3 from its 11th batch
    ...     ...
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from traingraph.errors import DataError, ModelError, SizeLimitError, TraingraphError
from traingraph.limits import check_elements

__all__ = ["Batches", "load_npz", "split_arrays"]


class Batches:
    """Mini-batches over arrays that share their first dimension.

    The order of epoch ``e`` is ``numpy.random.default_rng((seed, e)).permutation(n)``, so any
    epoch, and any batch within it, can be produced again without replaying the ones before:
    this is what lets an interrupted training run continue exactly where it stopped.

    Args:
        arrays: The arrays of one sample set, e.g. ``(images, labels)``.
        batch_size: Samples per batch.
        shuffle: Shuffle each epoch (otherwise batches follow the stored order).
        seed: Seed of the shuffling.
        drop_last: Drop the last batch when it is smaller than ``batch_size``.

    Iterating a ``Batches`` object directly yields epoch 0, then epoch 1 on the next iteration,
    and so on; :meth:`epoch` yields a given epoch.
    """

    def __init__(
        self,
        arrays: Sequence[np.ndarray],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(arrays, np.ndarray) or not arrays:
            raise ModelError(
                "Batches needs a non-empty sequence of arrays, e.g. Batches((x, y), 32); got"
                f" {type(arrays).__name__}"
            )
        self.arrays = tuple(np.asarray(a) for a in arrays)
        sizes = {a.shape[0] if a.ndim else None for a in self.arrays}
        if len(sizes) != 1 or None in sizes:
            raise ModelError(
                "the arrays must share their first (sample) dimension; got shapes"
                f" {[list(a.shape) for a in self.arrays]}"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ModelError(f"batch_size must be a positive int, got {batch_size!r}")
        self.size = int(self.arrays[0].shape[0])
        if self.size == 0:
            raise ModelError("the arrays hold no samples; pass at least one sample")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._next_epoch = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.size, self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices of ``epoch``, in the order they are batched."""
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng((self.seed, epoch)).permutation(self.size)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[np.ndarray, ...]]:
        """Yield the batches of ``epoch``, beginning with batch number ``start`` (0-based)."""
        order = self.order(epoch)
        for i in range(start, len(self)):
            index = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield tuple(a[index] for a in self.arrays)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        return self.epoch(epoch)


def split_arrays(
    arrays: Sequence[np.ndarray], fraction: float, seed: int = 0
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Split arrays into ``(rest, held_out)``: a random ``fraction`` of the samples is held out.

    The held-out samples keep their stored order, and so do the others.

    Raises:
        DataError: ``fraction`` is not in (0, 1), an array has no sample dimension, the arrays
            differ in their number of samples, or there are too few samples to split.
    """
    if not 0.0 < fraction < 1.0:
        raise DataError(
            f"the validation fraction must be strictly between 0 and 1, got {fraction!r}"
        )
    arrays = [np.asarray(a) for a in arrays]
    n = _sample_count(arrays)
    count = min(max(round(n * fraction), 1), n - 1)
    if count < 1:
        raise DataError(f"cannot hold out samples from a set of {n}; pass more data")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng(seed).permutation(n)[:count]] = True
    return tuple(a[~held] for a in arrays), tuple(a[held] for a in arrays)


def _sample_count(arrays: Sequence[np.ndarray]) -> int:
    """The arrays' shared first dimension; raises if they have none or differ."""
    if not arrays:
        raise DataError("no arrays given; pass the arrays of one sample set, e.g. (x, y)")
    shapes = [list(a.shape) for a in arrays]
    if any(a.ndim == 0 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
        raise DataError(
            f"the arrays must share their first (sample) dimension; got shapes {shapes}. Save"
            " one entry per sample in each array (e.g. images of shape (n, ...) and labels of"
            " shape (n,))"
        )
    return int(arrays[0].shape[0])


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read every array of a ``.npz`` file (saved with ``numpy.savez``; no pickled objects).

    Each array's declared shape and dtype are checked before it is read: object arrays are
    refused, and so are arrays over :func:`traingraph.limits.max_tensor_elements` or larger
    than the data the file holds for them.

    Raises:
        DataError: The file is missing, not a ``.npz`` file, corrupt, or holds object arrays.
        SizeLimitError: An array declares more elements than the limit.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"data file {str(file)!r} does not exist; pass a .npz file saved with numpy.savez"
        )
    fix = "save the arrays with numpy.savez(path, x=..., y=...)"
    if not zipfile.is_zipfile(file):
        raise DataError(f"{str(file)!r} is not a .npz file (it is not a zip archive); {fix}")
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                _check_npy_header(file, archive, info)
        with np.load(file, allow_pickle=False) as loaded:
            return {k: loaded[k] for k in loaded.files}
    except TraingraphError:
        raise
    except MemoryError as exc:
        raise SizeLimitError(
            f"{str(file)!r} holds arrays too large for this machine's memory ({exc}); pass a"
            " smaller data set"
        ) from exc
    except Exception as exc:
        raise DataError(
            f"{str(file)!r} is not a readable .npz file ({type(exc).__name__}: {exc}); the file"
            f" is corrupt or was not written by numpy.savez: {fix}"
        ) from exc


def _check_npy_header(file: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Reads one member's .npy header and checks its dtype and size before its data is read."""
    where = f"data file {str(file)!r}: array {info.filename.removesuffix('.npy')!r}"
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    if dtype.hasobject:
        raise DataError(
            f"{where} holds Python objects (dtype {dtype}), which traingraph does not load (it"
            " would run pickled code); save numeric arrays with numpy.savez"
        )
    count = check_elements(where, "the array", list(shape))
    if count * dtype.itemsize > info.file_size:
        raise DataError(
            f"{where} declares shape {list(shape)} of {dtype} ({count * dtype.itemsize} bytes)"
            f" but the file holds {info.file_size} bytes for it; the file is truncated or"
            " corrupt: write it again with numpy.savez"
        )
