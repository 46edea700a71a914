"""Small datasets embedded in the package, for demos and tests (no network access).

Example:
    >>> from traingraph.datasets import load_digits
    >>> x_train, y_train = load_digits("train")
    >>> x_train.shape, x_train.dtype, y_train.dtype
    ((1438, 1, 8, 8), dtype('float32'), dtype('int64'))
"""

from __future__ import annotations

from importlib import resources

import numpy as np

from traingraph.errors import ModelError

__all__ = ["load_digits"]

_DIGITS_RESOURCE = "data/digits.npz"
_PIXEL_MAX = 16.0
_SPLITS = (None, "train", "test")


def _read_digits() -> tuple[np.ndarray, np.ndarray]:
    """Reads the raw arrays: images uint8 [1797, 8, 8] in 0..16 and labels uint8 [1797]."""
    with resources.files("traingraph").joinpath(_DIGITS_RESOURCE).open("rb") as f, np.load(
        f, allow_pickle=False
    ) as npz:
        return npz["images"], npz["labels"]


def _stratified_test_mask(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Marks ``round(n_c * test_fraction)`` random samples of each class ``c`` as test samples.

    Every class keeps at least one sample on each side of the split.
    """
    rng = np.random.default_rng(seed)
    mask = np.zeros(labels.shape[0], dtype=bool)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        n_test = min(max(round(members.size * test_fraction), 1), members.size - 1)
        mask[rng.permutation(members)[:n_test]] = True
    return mask


def load_digits(
    split: str | None = None, test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Loads the 8x8 handwritten digits (1,797 images, 10 classes).

    The data is the UCI "Optical Recognition of Handwritten Digits" test set (CC BY 4.0), stored in
    the package; see ``traingraph/data/README.md`` for its source and citation. The split is
    stratified: each class contributes ``round(n_c * test_fraction)`` randomly chosen images to the
    test set (at least one, and at least one left for training), chosen with
    ``numpy.random.default_rng(seed)``. The same arguments always give the same split; within a
    split, images keep the order of the stored data.

    Args:
        split: ``None`` for all 1,797 images, ``"train"`` or ``"test"`` for one side of the split.
        test_fraction: Fraction of each class that goes to the test set, in (0, 1).
        seed: Seed of the split.

    Returns:
        ``(images, labels)``: images float32 ``[N, 1, 8, 8]`` scaled to [0, 1] (pixel / 16), labels
        int64 ``[N]`` in 0..9.

    Raises:
        ModelError: ``split`` or ``test_fraction`` is out of range.
    """
    if split not in _SPLITS:
        raise ModelError(
            f"load_digits: split={split!r} is not supported; expected None (all images), 'train' or"
            " 'test'."
        )
    if not 0.0 < test_fraction < 1.0:
        raise ModelError(
            f"load_digits: test_fraction={test_fraction!r} is out of range; expected a number"
            " strictly between 0 and 1, for example 0.2."
        )
    images, labels = _read_digits()
    if split is not None:
        test = _stratified_test_mask(labels, test_fraction, seed)
        keep = test if split == "test" else ~test
        images, labels = images[keep], labels[keep]
    x = (images.astype(np.float32) / np.float32(_PIXEL_MAX))[:, None, :, :]
    return x, labels.astype(np.int64)
