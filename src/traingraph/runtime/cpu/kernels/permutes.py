"""Gathers that only permute a tensor's axes, run as one native strided copy.

onnxruntime's blocked (NCHWc) convolution kernels read the filter in channel blocks, and the
training graph reorders each filter on every step with a ``Gather`` of its positions
(:mod:`traingraph.runtime.rewrites.nchwc`). Where the channel counts are multiples of the block, the
positions are a permutation of the filter's axes split into blocks: ``dst =
src.reshape(dims).transpose(perm)``. :func:`as_permutation` finds ``dims`` and ``perm`` from
the positions (checked element by element), and :func:`permute` writes them with the native
kernel ``_convc.permute``, contiguous runs copied at memory speed where onnxruntime's Gather
reads one indexed element at a time. The values are copied, so the result is the Gather's,
NaN and infinities included.

Example:
    >>> import numpy as np
    >>> positions = np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1)
    >>> as_permutation(positions, 24)  # axes 0 and 1 stay together: one axis of 6
    ([6, 4], [1, 0])
"""

from __future__ import annotations

import math

import numpy as np

from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.rewrites.nchwc import as_permutation

__all__ = ["as_permutation", "permute"]


def permute(
    src: np.ndarray, dst: np.ndarray, dims: list[int], perm: list[int], threads: int
) -> None:
    """Write ``src.reshape(dims).transpose(perm)`` into ``dst`` (float32, C-contiguous, of
    ``prod(dims)`` elements each) with the native kernel, or numpy where it is not built.

    Raises:
        ValueError: Where the sizes or the permutation do not fit (from the native kernel).
    """
    native = conv_grads.NATIVE
    if native is not None and hasattr(native, "permute"):
        native.permute(src, dst, dims, perm, threads)
        return
    if src.size != math.prod(dims) or dst.size != src.size:
        raise ValueError(
            f"permute: src has {src.size} and dst {dst.size} elements; dims {dims} give"
            f" {math.prod(dims)}: both must hold prod(dims)"
        )
    dst.reshape(-1)[:] = src.reshape(dims).transpose(perm).reshape(-1)
