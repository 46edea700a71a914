"""The kernels' matrix products by one-op onnxruntime sessions: each call multiplies the arrays
it is given, whether they are the ones the call before bound or others (a chain of products
rebinds only what changed)."""

from __future__ import annotations

import numpy as np
import pytest

from traingraph.runtime.cpu.kernels.products import Product


def test_each_call_multiplies_the_arrays_it_is_given() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 6, 5)).astype(np.float32)
    states = [rng.standard_normal((2, 5, 3)).astype(np.float32) for _ in range(2)]
    out = np.empty((2, 6, 3), np.float32)
    product = Product("MatMul", 2)
    for k in range(4):  # the operands alternate between two buffers, as a recurrence's do
        b = states[k % 2]
        b += 1.0  # new values at the same address
        product(a, b, out)
        np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    wider = rng.standard_normal((2, 5, 4)).astype(np.float32)  # another shape
    other = np.empty((2, 6, 4), np.float32)
    product(a, wider, other)
    np.testing.assert_allclose(other, a @ wider, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        product(a, wider[:, :, ::2], out)
