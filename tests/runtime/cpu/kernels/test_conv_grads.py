"""Conv weight gradients from the native kernel: the kernel against PyTorch, the split of a
training model, and Module's train steps with and without it."""

from __future__ import annotations

import logging
import multiprocessing

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from gradcheck import assert_same_training
from torch_models import export, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime import session
from traingraph.runtime.cpu import segments, verify
from traingraph.runtime.cpu.kernels import col2im, conv_grads
from traingraph.runtime.rewrites import specialize
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    not conv_grads.AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

# (batch, channels, height, width, filters, kernel, strides, pads, dilations, group)
GEOMETRIES = [
    pytest.param((4, 3, 9, 9, 5, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="3x3"),
    pytest.param((3, 4, 11, 7, 6, (3, 2), (2, 1), (2, 0), (1, 1), 1), id="non-square-stride"),
    pytest.param((2, 5, 13, 12, 4, (3, 3), (3, 2), (1, 2), (1, 1), 1), id="stride-3x2"),
    pytest.param((3, 2, 12, 12, 3, (3, 3), (1, 1), (2, 2), (2, 2), 1), id="dilated"),
    pytest.param((2, 4, 10, 10, 6, (3, 3), (2, 2), (1, 1), (2, 1), 2), id="groups-dilated"),
    pytest.param((3, 6, 8, 8, 6, (3, 3), (1, 1), (1, 1), (1, 1), 6), id="depthwise"),
    # depthwise: 16 channels to a vector (40: a last vector of 8), the input rows of a band of
    # output rows transposed into a buffer; planes needing several bands, any kernel
    pytest.param((3, 40, 4, 4, 40, (5, 5), (1, 1), (2, 2), (1, 1), 40), id="depthwise-5x5-4x4"),
    pytest.param((2, 32, 9, 9, 32, (5, 5), (2, 2), (2, 2), (1, 1), 32), id="depthwise-5x5-s2"),
    pytest.param((2, 20, 64, 64, 20, (3, 3), (1, 1), (1, 1), (1, 1), 20), id="depthwise-bands"),
    pytest.param((2, 17, 50, 37, 17, (5, 5), (2, 2), (2, 2), (1, 1), 17), id="depthwise-bands-s2"),
    pytest.param((2, 16, 6, 6, 16, (7, 7), (1, 1), (3, 3), (1, 1), 16), id="depthwise-7x7"),
    pytest.param((3, 18, 11, 9, 18, (3, 3), (1, 1), (2, 2), (2, 2), 18), id="depthwise-dilated"),
    pytest.param((2, 24, 10, 10, 24, (3, 3), (3, 3), (0, 0), (1, 1), 24), id="depthwise-stride-3"),
    pytest.param((2, 16, 8, 8, 16, (1, 9), (1, 1), (0, 4), (1, 1), 16), id="depthwise-1x9"),
    pytest.param((2, 33, 7, 7, 33, (1, 1), (1, 1), (0, 0), (1, 1), 33), id="depthwise-1x1"),
    pytest.param((5, 8, 16, 16, 4, (1, 1), (2, 2), (0, 0), (1, 1), 1), id="1x1-stride-2"),
    pytest.param((2, 1, 28, 28, 6, (5, 5), (1, 1), (0, 0), (1, 1), 1), id="5x5"),
    pytest.param((1, 3, 7, 7, 17, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="batch-1"),
    pytest.param((6, 2, 5, 5, 3, (5, 5), (1, 1), (4, 4), (1, 1), 1), id="pads-beyond-kernel"),
    pytest.param((2, 3, 40, 40, 9, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="chunk-of-one"),
    # along a column stride of 2, rows are split into their phases in vectors of 16
    pytest.param((3, 4, 40, 37, 5, (3, 3), (2, 2), (1, 1), (1, 1), 1), id="stride-2-wide"),
    pytest.param((2, 3, 35, 70, 4, (5, 5), (1, 2), (3, 2), (1, 1), 1), id="stride-2-padded"),
    pytest.param((2, 4, 12, 66, 6, (3, 3), (2, 2), (1, 0), (1, 2), 2), id="stride-2-grouped"),
    # the edges of the 4 x 4 blocks of sums: 3 filters left over, 2 taps in all
    pytest.param((4, 2, 6, 6, 7, (1, 1), (1, 1), (0, 0), (1, 1), 1), id="edge-blocks"),
    # 3 x 3, strides 1 and pads 1 over 8+ channels and filters, height and width multiples of
    # 4: by Winograd's F(4 x 4, 3 x 3), rows of 8, 4, 2 tiles packed into a vector, rows of 16
    # and 32 tiles; channel counts that leave part of the last 16 of the final transform
    pytest.param((3, 16, 32, 32, 16, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-32-wide"),
    pytest.param((5, 9, 16, 16, 11, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-16-wide"),
    pytest.param((3, 64, 8, 8, 64, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-8-wide"),
    pytest.param((1, 12, 12, 64, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-64-wide"),
    pytest.param((2, 8, 8, 128, 10, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-128-wide"),
    pytest.param((2, 20, 20, 32, 17, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-20-rows"),
    pytest.param((7, 8, 4, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="winograd-4-rows"),
    # small planes and 16 filters or more per kernel position: one product by Gemm
    pytest.param((4, 8, 4, 4, 144, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="small-plane-3x3"),
    pytest.param((2, 4, 7, 7, 150, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="small-plane-7x7"),
    pytest.param((3, 16, 7, 7, 144, (3, 3), (2, 2), (1, 1), (1, 1), 1), id="small-plane-stride-2"),
    pytest.param((2, 4, 4, 4, 145, (3, 3), (1, 1), (2, 2), (2, 2), 1), id="small-plane-dilated"),
    pytest.param((5, 32, 5, 3, 24, (1, 1), (1, 1), (0, 0), (1, 1), 1), id="small-plane-1x1"),
    pytest.param((4, 8, 4, 4, 32, (3, 3), (1, 1), (1, 1), (1, 1), 1), id="few-filters-3x3"),
    # a squeeze-and-excitation block's 1 x 1 Convs on 1 x 1 planes: x and dy in one product
    pytest.param((32, 96, 1, 1, 6, (1, 1), (1, 1), (0, 0), (1, 1), 1), id="squeeze-excite-few"),
    pytest.param((32, 24, 1, 1, 144, (1, 1), (1, 1), (0, 0), (1, 1), 1), id="squeeze-excite"),
]


def _torch_weight_grad(x, dy, shape, strides, pads, dilations, group):
    return torch.nn.grad.conv2d_weight(
        torch.from_numpy(x.astype(np.float64)),
        shape,
        torch.from_numpy(dy.astype(np.float64)),
        stride=strides,
        padding=pads,
        dilation=dilations,
        groups=group,
    ).numpy()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_kernel_matches_torch(geometry, threads):
    n, c, h, w, m, kernel, strides, pads, dilations, group = geometry
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    y = nn.functional.conv2d(
        torch.from_numpy(x),
        torch.zeros(m, c // group, *kernel),
        stride=strides,
        padding=pads,
        dilation=dilations,
        groups=group,
    )
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    shape = (m, c // group, *kernel)
    dw = np.full(shape, np.nan, np.float32)  # every element is written
    grad = conv_grads.WeightGrad("w_grad", "w", "x", "dy", strides, pads, pads, dilations, group)
    conv_grads.compute([grad], {"x": x, "dy": dy}, {"w_grad": dw}, threads)
    expected = _torch_weight_grad(x, dy, shape, strides, pads, dilations, group)
    np.testing.assert_allclose(dw, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("geometry", [p for p in GEOMETRIES if p.values[0][-1] == 1])
def test_product_form_matches_torch(geometry, threads):
    """The product form computes every one-group geometry, not only the small planes that
    compute() gives it."""
    n, c, h, w, m, kernel, strides, pads, dilations, _ = geometry
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    y = nn.functional.conv2d(
        torch.from_numpy(x), torch.zeros(m, c, *kernel), stride=strides, padding=pads,
        dilation=dilations,
    )  # fmt: skip
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    shape = (m, c, *kernel)
    grad = conv_grads.WeightGrad("w_grad", "w", "x", "dy", strides, pads, pads, dilations, 1)
    dw = np.full(shape, np.nan, np.float32)
    conv_grads.product_weight_grad(x, dy, grad, dw, threads)
    expected = _torch_weight_grad(x, dy, shape, strides, pads, dilations, 1)
    np.testing.assert_allclose(dw, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    strided = np.full((*shape[:3], 2 * shape[3]), np.nan, np.float32)[..., ::2]
    conv_grads.product_weight_grad(x, dy, grad, strided, threads)
    np.testing.assert_array_equal(strided, dw)


def test_small_planes_take_the_product_form():
    def grad(group=1, strides=(1, 1)):
        return conv_grads.WeightGrad("g", "w", "x", "dy", strides, (1, 1), (1, 1), (1, 1), group)

    assert conv_grads.by_product(grad(), (16, 512, 4, 4), (3, 3))  # 144 values
    assert conv_grads.by_product(grad(), (16, 1024, 7, 7), (1, 1))  # 49
    assert conv_grads.by_product(grad(), (16, 128, 14, 14), (1, 1))  # 196
    assert conv_grads.by_product(grad(), (16, 256, 7, 7), (3, 3))  # 441 values, 49 positions
    assert not conv_grads.by_product(grad(), (16, 128, 8, 8), (3, 3))  # 576, 64
    assert not conv_grads.by_product(grad(), (32, 40, 16, 16), (1, 1))  # 256
    assert conv_grads.by_product(grad(strides=(2, 2)), (16, 256, 14, 14), (3, 3))  # 196
    assert not conv_grads.by_product(grad(strides=(2, 2)), (16, 128, 16, 16), (3, 3))  # 256
    assert not conv_grads.by_product(grad(strides=(2, 2)), (16, 512, 28, 28), (1, 1))
    assert not conv_grads.by_product(grad(), (16, 32, 7, 7), (3, 3))  # 32 filters for 9 taps
    assert conv_grads.by_product(grad(), (16, 32, 7, 7), (1, 1))
    assert not conv_grads.by_product(grad(group=4), (16, 512, 4, 4), (3, 3))
    # 1 x 1 on 1 x 1 planes, unpadded: a product of x and dy as they are, even of 6 filters
    unpadded = conv_grads.WeightGrad("g", "w", "x", "dy", (1, 1), (0, 0), (0, 0), (1, 1), 1)
    assert conv_grads.by_product(unpadded, (32, 6, 1, 1), (1, 1))
    assert not conv_grads.by_product(grad(), (32, 6, 1, 1), (1, 1))  # padded: not that product


def _unfold_reference(x, kernel, grid, strides, pads, dilations):
    """The unfold position by position: row (c, i, j), column (n, oh, ow)."""
    n, c, h, w = x.shape
    cols = np.zeros((c, *kernel, n, *grid), np.float32)
    for i, j, a, b in np.ndindex(*kernel, *grid):
        ih = a * strides[0] - pads[0] + i * dilations[0]
        iw = b * strides[1] - pads[1] + j * dilations[1]
        if 0 <= ih < h and 0 <= iw < w:
            cols[:, i, j, :, a, b] = x[:, :, ih, iw].T
    return cols.reshape(c * kernel[0] * kernel[1], n * grid[0] * grid[1])


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("geometry", [p for p in GEOMETRIES if p.values[0][-1] == 1])
def test_unfold_copies_every_value_bit_for_bit(geometry, threads):
    n, c, h, w, _, kernel, strides, pads, dilations, _ = geometry
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32)
    x.reshape(-1)[rng.choice(x.size, min(x.size, 12), replace=False)] = np.resize(specials, 12)[
        : min(x.size, 12)
    ]
    grid = tuple(
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip((h, w), kernel, strides, pads, dilations)
    )
    cols = np.full((c * kernel[0] * kernel[1], n * grid[0] * grid[1]), 7.0, np.float32)
    conv_grads.NATIVE.unfold(x, cols, kernel, grid, strides, pads, dilations, threads)
    expected = _unfold_reference(x, kernel, grid, strides, pads, dilations)
    assert cols.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()


def test_unfold_refuses_columns_of_another_shape():
    x = np.zeros((2, 3, 5, 5), np.float32)
    with pytest.raises(ValueError, match=r"cols must be \[C \* KH \* KW, N \* OH \* OW\]"):
        conv_grads.NATIVE.unfold(x, np.zeros((27, 49), np.float32), (3, 3), (5, 5), (1, 1),
                                 (1, 1), (1, 1), 1)  # fmt: skip
    with pytest.raises(ValueError, match="is not C-contiguous"):
        cols = np.zeros((27, 100), np.float32)[:, ::2]
        conv_grads.NATIVE.unfold(x, cols, (3, 3), (5, 5), (1, 1), (1, 1), (1, 1), 1)


def test_kernel_computes_several_convolutions_in_one_call():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 10, 10)).astype(np.float32)
    dy1 = rng.standard_normal((4, 5, 10, 10)).astype(np.float32)
    dy2 = rng.standard_normal((4, 2, 5, 5)).astype(np.float32)
    grads = [
        conv_grads.WeightGrad("a", "wa", "x", "dy1", (1, 1), (1, 1), (1, 1), (1, 1), 1),
        conv_grads.WeightGrad("b", "wb", "x", "dy2", (2, 2), (0, 0), (0, 0), (1, 1), 1),
    ]
    targets = {"a": np.empty((5, 3, 3, 3), np.float32), "b": np.empty((2, 3, 1, 1), np.float32)}
    conv_grads.compute(grads, {"x": x, "dy1": dy1, "dy2": dy2}, targets, 2)
    np.testing.assert_allclose(
        targets["a"],
        _torch_weight_grad(x, dy1, (5, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(
        targets["b"], _torch_weight_grad(x, dy2, (2, 3, 1, 1), (2, 2), (0, 0), (1, 1), 1), rtol=1e-4
    )


def test_kernel_refuses_arrays_it_cannot_take():
    x = np.zeros((2, 3, 6, 6), np.float32)
    dy = np.zeros((2, 4, 6, 6), np.float32)
    grad = conv_grads.WeightGrad("g", "w", "x", "dy", (1, 1), (1, 1), (1, 1), (1, 1), 1)

    def run(x=x, dy=dy, dw=None):
        dw = np.zeros((4, 3, 3, 3), np.float32) if dw is None else dw
        conv_grads.compute([grad], {"x": x, "dy": dy}, {"g": dw}, 2)

    with pytest.raises(ValueError, match="dw is not float32"):
        run(dw=np.zeros((4, 3, 3, 3)))
    with pytest.raises(ValueError, match="x is not C-contiguous"):
        big = np.zeros((2, 3, 24, 48), np.float32)[..., ::2]  # the native sums' plane
        run(x=big, dy=np.zeros((2, 4, 24, 24), np.float32))
    read_only = np.zeros((4, 3, 3, 3), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="dw is read-only"):
        run(dw=read_only)
    with pytest.raises(ValueError, match="do not form a convolution"):
        run(dw=np.zeros((5, 3, 3, 3), np.float32))
    with pytest.raises(ValueError, match="not the input and output of its Conv"):
        run(dy=np.zeros((2, 4, 9, 6), np.float32))
    with pytest.raises(ValueError, match="not the input and output of its Conv"):
        run(dy=np.zeros((3, 4, 6, 6), np.float32))


class ConvNet(nn.Module):
    """Convolutions of several geometries: on the data input, strided, dilated, grouped, 1x1,
    with and without bias, and one weight used twice (its gradient is a sum of two)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.point = nn.Conv2d(8, 6, 1)
        self.shared = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(self.down(h))
        h = torch.relu(self.dilated(h))
        h = self.point(h)
        h = self.shared(torch.relu(self.shared(h)))
        return self.fc(h.mean(dim=(2, 3)))


def _artifacts(tmp_path, dtype=torch.float32):
    model = seeded(ConvNet).to(dtype)
    onnx_model = export(model, torch.zeros(2, 3, 12, 12, dtype=dtype), training=True)
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=tmp_path,
    )
    return tmp_path


def _module(directory, native: bool, specialize: bool = True):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(native_conv_grads=native, specialize=specialize)
    module = Module(
        directory / "training_model.onnx",
        state,
        directory / "eval_model.onnx",
        session_config=config,
    )
    return state, module, Optimizer(directory / "optimizer_model.onnx", module)


def test_split_takes_each_single_conv_weight_gradient(tmp_path):
    directory = _artifacts(tmp_path)
    model = onnx.load(directory / "training_model.onnx")
    split, grads = conv_grads.split_weight_grads(model)
    assert sorted(g.param for g in grads) == [
        "dilated.weight",
        "down.weight",
        "point.weight",
        "stem.weight",
    ]  # not shared.weight: two Convs read it
    by_param = {g.param: g for g in grads}
    assert by_param["stem.weight"].x == "x"  # the model's input
    assert by_param["down.weight"].strides == (2, 2)
    assert by_param["dilated.weight"].dilations == (2, 2)
    assert by_param["dilated.weight"].group == 2
    onnx.checker.check_model(split, full_check=True)
    outputs = {o.name for o in split.graph.output}
    assert not outputs & {g.output for g in grads}
    assert {g.dy for g in grads} <= outputs
    assert len(split.graph.node) < len(model.graph.node)


class PatchNet(nn.Module):
    """A ViT-style patch embedding (16 x 16 windows, stride 16) and a strided 3 x 3 Conv."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 16, stride=16)
        self.conv = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(torch.relu(self.patch(x))).mean(dim=(2, 3)))


def test_split_leaves_strides_beyond_the_kernel_to_the_graph(tmp_path, caplog):
    onnx_model = export(seeded(PatchNet), torch.zeros(2, 3, 64, 64), training=True)
    artifacts.generate_artifacts(
        onnx_model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        _, grads = conv_grads.split_weight_grads(onnx.load(tmp_path / "training_model.onnx"))
    assert [g.param for g in grads] == ["conv.weight"]  # 256 stride phases: not the kernel's
    assert "dropped" not in caplog.text  # not a candidate refused at its check: none at all
    assert conv_grads.MAX_STRIDE_PHASES < 16 * 16


def test_split_leaves_models_without_a_float32_conv_alone(tmp_path):
    directory = _artifacts(tmp_path, torch.float64)
    model = onnx.load(directory / "training_model.onnx")
    split, grads = conv_grads.split_weight_grads(model)
    assert grads == [] and split is model


def test_module_with_native_gradients_trains_as_the_graph_does(tmp_path, monkeypatch):
    # The reference runs the training model as written; the other computes the weight
    # gradients natively and runs the CPU rewrite (the strided Conv's input gradient as columns
    # that native kernels add into the image, each checked against its nodes).
    directory = _artifacts(tmp_path)
    rewritten = []

    def for_cpu(source):
        rewritten.append(new := specialize.for_cpu(source))
        return new

    monkeypatch.setattr(session, "for_cpu", for_cpu)
    runs = {}
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 12, 12)).astype(np.float32), rng.integers(0, 5, n))
        for n in (8, 8, 3, 8)  # a smaller batch, as the last of an epoch
    ]
    for native in (True, False):
        rewritten.clear()
        state, module, opt = _module(directory, native, specialize=native)
        assert bool(module.step.gradients.weight_grads) == native
        assert bool(rewritten) == native
        if native:
            plan = getattr(module.step.runner, "_plan", segments.Plan([]))
            assert any(isinstance(k, col2im.Col2ImSum) for k in plan.all_kernels)
        losses, grads = [], []
        for step, (x, y) in enumerate(batches):
            losses.append(float(module(x, y)))
            if step == 1:  # two steps without a reset: the gradients add up
                losses.append(float(module(x, y)))
            grads.append(
                {n: p.grad.copy() for n, p in state.parameters.items() if p.grad is not None}
            )
            opt.step()
            module.lazy_reset_grad()
        module.eval()
        losses.append(float(module(*batches[0])))
        runs[native] = losses, grads, {n: p.data.copy() for n, p in state.parameters.items()}
    assert_same_training(runs[True], runs[False], one_scale=True)


def test_module_gradients_match_torch(tmp_path):
    directory = _artifacts(tmp_path)
    state, module, _ = _module(directory, True)
    assert len(module.step.gradients.weight_grads) == 4
    model = seeded(ConvNet)
    model.train()
    with torch.no_grad():  # the export's tracing pass moved the running statistics
        model.bn.running_mean.copy_(torch.from_numpy(state.parameters["bn.running_mean"].data))
        model.bn.running_var.copy_(torch.from_numpy(state.parameters["bn.running_var"].data))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 3, 12, 12)).astype(np.float32)
    y = rng.integers(0, 5, 6)
    loss = module(x, y)
    expected = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    for name, param in model.named_parameters():
        got = state.parameters[name].grad
        want = param.grad.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6 * scale)


def _sum_of_weight_grad(threads: int) -> np.ndarray:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
    dy = rng.standard_normal((6, 5, 8, 8)).astype(np.float32)
    grad = conv_grads.WeightGrad("o", "w", "x", "dy", (1, 1), (1, 1), (1, 1), (1, 1), 1)
    dw = np.zeros((5, 3, 3, 3), np.float32)
    conv_grads.compute([grad], {"x": x, "dy": dy}, {"o": dw}, threads)
    return dw


def _in_forked_child(queue) -> None:
    queue.put([_sum_of_weight_grad(t) for t in (2, 3)])


def test_kernel_threads_grow_and_survive_fork():
    one = _sum_of_weight_grad(1)
    for threads in (2, 4, 2):  # more workers than before, then fewer
        np.testing.assert_allclose(_sum_of_weight_grad(threads), one, rtol=1e-5, atol=1e-5)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_forked_child, args=(queue,))
    child.start()
    results = queue.get(timeout=60)  # the child starts its own workers
    child.join(timeout=60)
    assert child.exitcode == 0
    for result in results:
        np.testing.assert_allclose(result, one, rtol=1e-5, atol=1e-5)


def _graph_weight_grad(x, dy, shape, strides, pads, dilations, group):
    """The weight gradient as traingraph's training graph computes it, on onnxruntime."""
    import onnx_ir as ir
    import onnxruntime as ort

    from traingraph.autodiff.engine import differentiate

    def value(name, array_shape):
        return ir.Value(
            name=name, shape=ir.Shape(list(array_shape)), type=ir.TensorType(ir.DataType.FLOAT)
        )

    xv, wv = value("x", x.shape), value("w", shape)
    conv = ir.node(
        "Conv", [xv, wv], attributes={"strides": list(strides), "pads": [*pads, *pads],
        "dilations": list(dilations), "group": group}, num_outputs=1,
    )  # fmt: skip
    y = conv.outputs[0]
    y.name, y.shape, y.type = "y", ir.Shape(list(dy.shape)), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([xv, wv], [y], nodes=[conv], opset_imports={"": 17})
    result = differentiate(graph, 17, [wv], loss=None, user_gradients=[y])
    grad = result.grads["w"]
    if result.user_grad_inputs["y"] not in graph.inputs:
        graph.inputs.append(result.user_grad_inputs["y"])
    graph.outputs.clear()
    graph.outputs.append(grad)
    proto = ir.to_proto(ir.Model(graph, ir_version=10))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "w": np.zeros(shape, np.float32), result.user_grad_inputs["y"].name: dy}
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_kernel_propagates_nan_and_inf_as_the_graph_does(geometry):
    n, c, h, w, m, kernel, strides, pads, dilations, group = geometry
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    y = nn.functional.conv2d(
        torch.from_numpy(x), torch.zeros(m, c // group, *kernel), stride=strides,
        padding=pads, dilation=dilations, groups=group,
    )  # fmt: skip
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    shape = (m, c // group, *kernel)
    poisoned = verify.with_non_finite({"x": x, "dy": dy})
    geometry = (strides, pads, dilations, group)
    grad = conv_grads.WeightGrad("w_grad", "w", "x", "dy", strides, pads, pads, dilations, group)
    one_inf, one_nan, gated = x.copy(), dy.copy(), dy.copy()
    one_inf[-1, -1, h // 2, w // 2] = np.inf  # read by every kernel offset, as a rule
    one_nan[0, 0, 0, 0] = np.nan
    gated[:, :, : dy.shape[2] // 2 + 1] = 0.0  # an infinity read only against zero gradients
    zero_rows = x.copy()
    zero_rows[0, 0, 0, 0] = np.inf
    cases = (
        poisoned,
        {"x": poisoned["x"], "dy": dy},
        {"x": x, "dy": poisoned["dy"]},
        {"x": one_inf, "dy": dy},
        {"x": x, "dy": one_nan},
        {"x": zero_rows, "dy": gated},
    )
    for feeds in cases:
        dw = np.full(shape, 7.0, np.float32)
        conv_grads.compute([grad], feeds, {"w_grad": dw}, 2)
        expected = _graph_weight_grad(feeds["x"], feeds["dy"], shape, *geometry)
        if feeds is poisoned:
            assert not np.isfinite(expected).all()
        np.testing.assert_array_equal(np.isnan(dw), np.isnan(expected))
        np.testing.assert_array_equal(np.isposinf(dw), np.isposinf(expected))
        np.testing.assert_array_equal(np.isneginf(dw), np.isneginf(expected))
        assert verify.same_values(dw, expected)
