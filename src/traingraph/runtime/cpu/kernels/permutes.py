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


def as_permutation(positions: np.ndarray, size: int) -> tuple[list[int], list[int]] | None:
    """``(dims, perm)`` such that ``np.arange(size).reshape(dims).transpose(perm)`` has the
    elements of ``positions`` (0-based, any shape) in order; None where no such pair exists.

    The axes are read from the positions themselves: the innermost run of equal steps, then
    the run of equal steps between such blocks, and so on; each axis's step is its stride in
    the source. The strides sorted must then tile the source (each the next one's times its
    extent), and every position is checked against them.
    """
    flat = np.asarray(positions, np.int64).reshape(-1)
    if flat.size != size or size == 0:
        return None
    extents: list[int] = []
    strides: list[int] = []
    block = 1
    while block < size:
        step = int(flat[block] - flat[0])
        left = size // block
        run = 1
        while run < left and flat[run * block] - flat[0] == run * step:
            run += 1
        while left % run:
            run -= 1
        if run < 2 or step <= 0:
            return None
        extents.append(run)
        strides.append(step)
        block *= run
    if block != size:
        return None
    order = sorted(range(len(strides)), key=lambda a: -strides[a])  # the source's axes
    expected = 1
    for a in reversed(order):
        if strides[a] != expected:
            return None
        expected *= extents[a]
    offsets = np.full(1, int(flat[0]), np.int64)
    for a in reversed(range(len(extents))):  # outermost of dst first
        offsets = np.add.outer(offsets, np.arange(extents[a], dtype=np.int64) * strides[a])
        offsets = offsets.reshape(-1)
    if flat[0] != 0 or not np.array_equal(offsets, flat):
        return None
    dims = [extents[a] for a in order]
    rank = {a: k for k, a in enumerate(order)}
    perm = [rank[a] for a in reversed(range(len(extents)))]
    return dims, perm


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
