"""The products' register blocks for 16 vector registers (AVX2) and for 32 (AVX-512): the
Winograd and direct convolutions and the weight gradients compute the same bits either way, so
a machine's choice (``_convc._set_narrow_blocks``) changes their speed, not their results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def both_blocks(compute):
    """``compute()`` with the narrow blocks and with the wide ones, the machine's choice
    restored after."""
    previous = NATIVE._set_narrow_blocks(True)
    try:
        narrow = compute()
        NATIVE._set_narrow_blocks(False)
        wide = compute()
    finally:
        NATIVE._set_narrow_blocks(None)
    assert previous in (True, False)
    return narrow, wide


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n", "c", "k", "h", "w", "tile"),
    [
        (2, 16, 16, 32, 32, 2),  # whole vectors of tiles
        (2, 70, 13, 14, 14, 2),  # channels past one run, filters past one block, odd edges
        (3, 5, 6, 16, 16, 4),  # F(4 x 4, 3 x 3)
        (2, 9, 7, 6, 10, 0),  # the kernel's own choice, column arrays
    ],
)
def test_winograd_convolutions_are_the_same_bits(n, c, k, h, w, tile, threads):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(k).astype(np.float32)
    x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]

    def compute():
        y = np.full((n, k, h, w), 7.0, np.float32)
        NATIVE.conv_winograd(x, weight, bias, None, y, threads, tile)
        return y

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)
    want = (
        torch.nn.functional.conv2d(
            torch.from_numpy(x[1:]).double(), torch.from_numpy(weight).double(), padding=1
        ).numpy()
        + bias[:, None, None]
    )
    assert np.abs(narrow[1:] - want).max() <= 2e-6 * np.abs(want).max() * np.sqrt(c)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize(
    ("n", "c", "h", "w", "m", "kernel", "pads"),
    [
        (2, 3, 20, 40, 16, (7, 7), (3, 3, 3, 3)),  # columns past 32, filters in whole blocks
        (3, 1, 9, 13, 7, (5, 5), (2, 1, 0, 2)),  # part of a block, part of a vector
        (1, 4, 6, 50, 11, (3, 3), (1, 1, 1, 1)),
    ],
)
def test_direct_convolutions_are_the_same_bits(n, c, h, w, m, kernel, pads, relu):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((m, c, *kernel)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    x[0, 0, 1, :3] = [np.nan, np.inf, -np.inf]
    top, left, bottom, right = pads
    oh, ow = h + top + bottom - kernel[0] + 1, w + left + right - kernel[1] + 1

    def compute():
        y = np.full((n, m, oh, ow), 7.0, np.float32)
        NATIVE.conv_direct(x, weight, bias, y, (top, left), relu, 2)
        return y

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n", "c", "h", "w", "m", "kernel", "strides", "pads"),
    [
        (4, 6, 9, 9, 7, (3, 3), (1, 1), (1, 1)),  # 4 x 4 blocks and their edges
        (3, 5, 11, 7, 6, (3, 2), (2, 1), (2, 0)),
        (2, 9, 13, 12, 10, (3, 3), (3, 2), (1, 2)),
        (5, 8, 16, 16, 4, (1, 1), (2, 2), (0, 0)),
    ],
)
def test_weight_gradients_are_the_same_bits(n, c, h, w, m, kernel, strides, pads, threads):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    x[0, 0, 0, :2] = [np.nan, np.inf]
    oh = (h + 2 * pads[0] - kernel[0]) // strides[0] + 1
    ow = (w + 2 * pads[1] - kernel[1]) // strides[1] + 1
    dy = rng.standard_normal((n, m, oh, ow)).astype(np.float32)
    grad = conv_grads.WeightGrad("w_grad", "w", "x", "dy", strides, pads, pads, (1, 1), 1)

    def compute():
        dw = np.full((m, c, *kernel), 7.0, np.float32)
        conv_grads.compute([grad], {"x": x, "dy": dy}, {"w_grad": dw}, threads)
        return dw

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)
    assert np.isnan(narrow[:, 0]).any()  # the NaN reaches the sums it is part of
    finite = rng.standard_normal((n, c, h, w)).astype(np.float32)
    x[...] = finite
    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)
    want = torch.nn.grad.conv2d_weight(
        torch.from_numpy(finite).double(),
        (m, c, *kernel),
        torch.from_numpy(dy).double(),
        stride=strides,
        padding=pads,
    ).numpy()
    np.testing.assert_allclose(narrow, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("tanh", [False, True])
@pytest.mark.parametrize("gradient", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_gelu_is_the_same_bits_in_either_vector_width(tanh, gradient, masked):
    rng = np.random.default_rng(4)
    size = 70_003  # past one thread's share, and a tail shorter than a vector
    a = (rng.standard_normal(size) * 6).astype(np.float32)
    a[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e20, -1e20, 3e-39]
    g = rng.standard_normal(size).astype(np.float32) if gradient else None
    mask = (rng.random(size) < 0.8).astype(np.float32) * 1.25 if masked else None

    def compute():
        out = np.full(size, 7.0, np.float32)
        NATIVE.gelu(a, g, out, 2, mask, tanh)
        return out

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)


def _specials(rng, shape, scale):
    """Normal values times ``scale`` with NaN, infinities, zeros and a subnormal among them."""
    v = (rng.standard_normal(shape) * scale).astype(np.float32)
    flat = v.reshape(-1)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e-39, -1e30]
    flat[: len(specials)] = specials[: flat.size]
    return v


def test_silu_gradient_is_the_same_bits_in_either_vector_width():
    rng = np.random.default_rng(5)
    x, g = _specials(rng, 70_001, 12), _specials(rng, 70_001, 1)

    def compute():
        out = np.full(x.shape, 7.0, np.float32)
        NATIVE.silu_grad(x, g, out, 2)
        return out

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)


@pytest.mark.parametrize("width", [0, 5])  # whole tensors, and a column block of wider ones
def test_lstm_cells_are_the_same_bits_in_either_vector_width(width):
    rng = np.random.default_rng(6)
    directions, hidden, n = 2, 12, 5
    stride = 3 * n if width else n
    block = hidden * n
    mm = _specials(rng, (directions, 4 * hidden, n), 4)
    piece = _specials(rng, (directions, 4 * hidden, stride), 4)
    c_prev = _specials(rng, (directions, hidden, n), 2)
    dy, dc_next, f_next = (_specials(rng, (directions, hidden, n), 1) for _ in range(3))
    mm_back = _specials(rng, (directions, hidden, n), 1)
    offset = (n, stride) if width else ()

    def compute():
        outs = [np.full(a.shape, 7.0, np.float32) for a in (c_prev, c_prev, mm, c_prev, c_prev)]
        h, c, slope, through, f = outs
        NATIVE.lstm_cell(mm, piece, c_prev, h, c, slope, through, f, block, 2, *offset, 0)
        dc = np.full(c_prev.shape, 7.0, np.float32)
        dgates = np.full(mm.shape, 7.0, np.float32)
        columns = np.full(piece.shape, 7.0, np.float32) if width else None
        NATIVE.lstm_cell_grad(
            mm_back, dy, dc_next, f_next, through, slope, dc, dgates, columns, block,
            n, stride, 0, 2,
        )  # fmt: skip
        return [*outs, dc, dgates] + ([columns] if width else [])

    narrow, wide = both_blocks(compute)
    for a, b in zip(narrow, wide):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("plane", [(7, 7), (4, 9), (16, 16)])  # with and without a tail
def test_batch_norms_are_the_same_bits_in_either_vector_width(relu, plane):
    rng = np.random.default_rng(7)
    shape = (3, 5, *plane)
    x = _specials(rng, shape, 3) + 2.0
    x[1:, 1:] = np.abs(x[1:, 1:])  # finite channels too
    x[1:, 1:][~np.isfinite(x[1:, 1:])] = 1.0
    dy = _specials(rng, shape, 1)
    scale, bias = _specials(rng, 5, 1), _specials(rng, 5, 1)
    addend = rng.standard_normal(shape).astype(np.float32)

    def compute():
        y = np.full(shape, 7.0, np.float32)
        mean, var = np.full(5, 7.0, np.float32), np.full(5, 7.0, np.float32)
        NATIVE.batch_norm_forward(x, scale, bias, addend, y, mean, var, 1e-5, relu, 2)
        dx = np.full(shape, 7.0, np.float32)
        dscale, dbias = np.full(5, 7.0, np.float32), np.full(5, 7.0, np.float32)
        NATIVE.batch_norm_grad(x, dy, y if relu else None, scale, dx, dscale, dbias, 1e-5, 2)
        return y, mean, var, dx, dscale, dbias

    narrow, wide = both_blocks(compute)
    for a, b in zip(narrow, wide):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("c", "size", "kernel", "stride"),
    [(40, 9, 3, 1), (24, 12, 5, 2), (16, 8, 7, 1), (33, 7, 1, 1), (18, 10, 3, 2)],
)
def test_depthwise_weight_gradients_are_the_same_bits(c, size, kernel, stride):
    rng = np.random.default_rng(8)
    x = _specials(rng, (3, c, size, size), 1)
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    dy = rng.standard_normal((3, c, out, out)).astype(np.float32)
    grad = conv_grads.WeightGrad(
        "w_grad", "w", "x", "dy", (stride, stride), (pad, pad), (pad, pad), (1, 1), c
    )

    def compute():
        dw = np.full((c, 1, kernel, kernel), 7.0, np.float32)
        conv_grads.compute([grad], {"x": x, "dy": dy}, {"w_grad": dw}, 2)
        return dw

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow, wide)


@pytest.mark.parametrize("d", [192, 77, 8])  # whole vectors, a tail, no vector
def test_layer_norm_gradients_are_the_same_bits_in_either_vector_width(d):
    rng = np.random.default_rng(9)
    x = _specials(rng, (150, d), 2) + 1.0
    dy = _specials(rng, (150, d), 1)
    scale = rng.standard_normal(d).astype(np.float32)

    def compute():
        dx = np.full(x.shape, 7.0, np.float32)
        dscale, dbias = np.full(d, 7.0, np.float32), np.full(d, 7.0, np.float32)
        NATIVE.layer_norm_grad(x, dy, scale, dx, dscale, dbias, 1e-5, 2)
        return dx, dscale, dbias

    narrow, wide = both_blocks(compute)
    for a, b in zip(narrow, wide):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("dims", "perm"),
    [([64, 48, 9], [1, 0, 2]), ([40, 33], [1, 0]), ([3, 16, 2, 16, 9], [0, 2, 4, 3, 1])],
)
def test_transposed_copies_are_the_same_bits_in_either_vector_width(dims, perm):
    rng = np.random.default_rng(10)
    src = _specials(rng, int(np.prod(dims)), 1)
    want = np.ascontiguousarray(src.reshape(dims).transpose(perm)).reshape(-1)

    def compute():
        dst = np.full(src.size, 7.0, np.float32)
        NATIVE.permute(src, dst, dims, perm, 2)
        return dst

    narrow, wide = both_blocks(compute)
    np.testing.assert_array_equal(narrow.view(np.int32), want.view(np.int32))
    np.testing.assert_array_equal(wide.view(np.int32), want.view(np.int32))


def test_dense_weight_gradients_stay_in_the_graph_without_avx512(tmp_path, monkeypatch):
    """Where the CPU lacks AVX-512 the kernel takes only depthwise weight gradients (the
    graph's form in onnxruntime is as fast for dense ones there); with AVX-512 all of them."""
    from torch import nn

    from torch_models import export, seeded
    from traingraph import artifacts, optim
    from traingraph.api import CheckpointState, Module

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Conv2d(3, 16, 3, padding=1)
            self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.fc = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(self.depthwise(torch.relu(self.dense(x))).mean(dim=(2, 3)))

    artifacts.generate_artifacts(
        export(seeded(Net), torch.zeros(2, 3, 12, 12), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    monkeypatch.setattr(conv_grads, "DENSE_ON_NARROW", False)
    taken = {}
    for narrow in (True, False):
        NATIVE._set_narrow_blocks(narrow)
        try:
            state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
            module = Module(tmp_path / "training_model.onnx", state)
            plan = module.step.runner._plan
            taken[narrow] = sorted(
                kernel.grad.param
                for kernel in plan.all_kernels
                if isinstance(kernel, conv_grads.WeightGradKernel)
            )
        finally:
            NATIVE._set_narrow_blocks(None)
    assert taken[True] == ["depthwise.weight"]
    assert taken[False] == ["dense.weight", "depthwise.weight"]
