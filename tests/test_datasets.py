"""Tests of the embedded 8x8 digits dataset."""

from __future__ import annotations

import numpy as np
import pytest

from traingraph.datasets import load_digits
from traingraph.errors import ModelError

N_IMAGES = 1797
CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def _rows(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """One row per sample (pixels then label), sorted, so that splits compare as multisets."""
    rows = np.concatenate([images.reshape(len(images), -1), labels[:, None]], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def test_full_set_counts_shapes_dtypes_and_range():
    x, y = load_digits()
    assert x.shape == (N_IMAGES, 1, 8, 8)
    assert x.dtype == np.float32
    assert y.shape == (N_IMAGES,)
    assert y.dtype == np.int64
    assert x.min() == 0.0
    assert x.max() == 1.0
    # Pixels are counts 0..16 scaled by 1/16.
    np.testing.assert_array_equal(x * 16, np.round(x * 16))
    assert np.bincount(y).tolist() == CLASS_COUNTS


@pytest.mark.parametrize("test_fraction", [0.2, 0.5, 0.1])
def test_split_is_stratified(test_fraction):
    _, y_test = load_digits("test", test_fraction=test_fraction)
    _, y_train = load_digits("train", test_fraction=test_fraction)
    assert len(y_test) + len(y_train) == N_IMAGES
    expected_test = [round(n * test_fraction) for n in CLASS_COUNTS]
    assert np.bincount(y_test, minlength=10).tolist() == expected_test
    assert np.bincount(y_train, minlength=10).tolist() == [
        n - t for n, t in zip(CLASS_COUNTS, expected_test)
    ]


def test_default_split_sizes():
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    assert x_train.shape == (1438, 1, 8, 8)
    assert x_test.shape == (359, 1, 8, 8)
    assert y_train.dtype == y_test.dtype == np.int64


def test_split_is_deterministic_and_depends_on_seed():
    a = load_digits("test", seed=3)
    b = load_digits("test", seed=3)
    c = load_digits("test", seed=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("seed", [0, 7])
def test_train_and_test_partition_the_full_set(seed):
    x_all, y_all = load_digits()
    x_train, y_train = load_digits("train", seed=seed)
    x_test, y_test = load_digits("test", seed=seed)
    union = _rows(np.concatenate([x_train, x_test]), np.concatenate([y_train, y_test]))
    np.testing.assert_array_equal(union, _rows(x_all, y_all))


def test_tiny_fraction_keeps_every_class_on_both_sides():
    _, y_test = load_digits("test", test_fraction=0.001)
    _, y_train = load_digits("train", test_fraction=0.999)
    assert np.bincount(y_test).tolist() == [1] * 10
    assert np.bincount(y_train).tolist() == [1] * 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "validation"}, "split='validation'"),
        ({"split": "test", "test_fraction": 0.0}, "test_fraction=0.0"),
        ({"split": "train", "test_fraction": 1.5}, "test_fraction=1.5"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ModelError, match=match):
        load_digits(**kwargs)
