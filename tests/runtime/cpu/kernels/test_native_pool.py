"""The native kernels' worker pool: every share of a task runs once, whoever runs it.

The caller runs the shares that no worker has claimed yet, so that a worker the scheduler
keeps waiting does not hold up the step. With more threads than CPUs, and thread counts that
change from call to call (workers left without a share), the results must equal one thread's.
"""

from __future__ import annotations

import numpy as np
import pytest

from traingraph.runtime.cpu.kernels import conv_grads

native = conv_grads.NATIVE
pytestmark = pytest.mark.skipif(
    native is None, reason="traingraph.runtime._convc was not built (no C compiler at install time)"
)


def _weight_grads(x: np.ndarray, dy: np.ndarray, threads: int, stride: int) -> np.ndarray:
    assert native is not None
    dw = np.full((dy.shape[1], x.shape[1], 3, 3), np.nan, np.float32)
    native.weight_grads([(x, dy, dw, (stride, stride), (1, 1), (1, 1), 1)], threads)
    return dw


def test_thread_counts_in_turn_give_one_threads_sums() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 5, 9, 9)).astype(np.float32)
    cases = {}
    for stride in (1, 2):
        size = (9 + 2 - 3) // stride + 1
        dy = rng.standard_normal((12, 6, size, size)).astype(np.float32)
        cases[stride] = (dy, _weight_grads(x, dy, 1, stride))
    for threads in (8, 1, 3, 12, 2, 8, 1):  # workers started, left idle, woken again
        for stride, (dy, want) in cases.items():
            got = _weight_grads(x, dy, threads, stride)
            # the per-thread partial sums are added in another order: rounding differs
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_many_tasks_in_a_row_each_complete() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    dy = rng.standard_normal((4, 2, 6, 6)).astype(np.float32)
    want = _weight_grads(x, dy, 1, 1)
    for _ in range(300):
        assert np.isfinite(_weight_grads(x, dy, 4, 1)).all()
    np.testing.assert_allclose(_weight_grads(x, dy, 4, 1), want, rtol=1e-5, atol=1e-5)
