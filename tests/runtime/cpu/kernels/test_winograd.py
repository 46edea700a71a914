"""3 x 3 convolutions of stride 1 by Winograd's F(2 x 2, 3 x 3) and F(4 x 4, 3 x 3)
(runtime/cpu/kernels/winograd.py): the kernel against torch, which Convs of a residual network it
takes
(forward and input gradient, with the Sum of a residual block's two gradient paths), and
Module's train steps against the graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from gradcheck import artifact_steps, assert_same_training
from torch_models import export, export_dynamo, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import graph_match, segments, verify
from traingraph.runtime.cpu.kernels import conv_grads, winograd
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

NO_WINOGRAD = "winograd"

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

GEOMETRIES = {
    # (N, C, K, H, W). F(2 x 2, 3 x 3): tile rows of 16 k tiles take whole vectors, rows of 8
    # and 4 tiles are packed two and four to a vector, other widths go through the column
    # arrays. F(4 x 4, 3 x 3): rows of 16 k tiles, and rows of 8, 4 and 2 tiles packed.
    "32-wide": (2, 16, 16, 32, 32),
    "64-wide": (1, 4, 8, 12, 64),
    "128-wide": (1, 3, 5, 8, 128),
    "16-wide": (3, 5, 6, 16, 16),
    "8-wide": (5, 6, 4, 8, 8),
    "10-wide": (2, 3, 5, 6, 10),
    "2-wide": (3, 7, 9, 4, 2),
    "48-wide": (2, 3, 4, 12, 48),
    "large-block": (2, 40, 24, 14, 14),
    "large-block-4": (2, 40, 24, 16, 16),
    "deep": (3, 64, 64, 8, 8),
    # odd sides: computed over the plane one larger, zeros there
    "7x7": (3, 20, 12, 7, 7),
    "odd-height": (2, 5, 7, 5, 8),
    "odd-width": (2, 5, 7, 6, 9),
    "1x1-plane": (2, 4, 3, 1, 1),
    "13x13-deep": (2, 64, 48, 13, 13),
}


def takes_four(h: int, w: int) -> bool:
    """Whether F(4 x 4, 3 x 3) takes an image of h x w (what conv_winograd's docstring says)."""
    return h % 4 == 0 and w % 4 == 0 and (w in (8, 16, 32) or w % 64 == 0)


KERNEL_CASES = [
    (geometry, tile)
    for geometry, (_, _, _, h, w) in GEOMETRIES.items()
    for tile in (0, 2, 4)
    if tile != 4 or takes_four(h, w)
]


@pytest.mark.parametrize(("geometry", "tile"), KERNEL_CASES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("bias", "addend"), [(False, False), (True, True), (False, True)])
def test_kernel_matches_torch(geometry, tile, threads, bias, addend):
    n, c, k, h, w = GEOMETRIES[geometry]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((k, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32) if bias else None
    other = rng.standard_normal((n, k, h, w)).astype(np.float32) if addend else None
    y = np.full((n, k, h, w), np.nan, np.float32)
    NATIVE.conv_winograd(x, weight, b, other, y, threads, tile)
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x).double(),
        torch.from_numpy(weight).double(),
        None if b is None else torch.from_numpy(b).double(),
        padding=1,
    ).numpy()
    if other is not None:
        want = want + other
    scale = np.abs(want).max()
    assert np.abs(y - want).max() <= 2e-6 * scale * np.sqrt(c)


@pytest.mark.parametrize(("geometry", "tile"), KERNEL_CASES)
def test_flipped_filters_are_the_transposed_and_turned_parameter(geometry, tile):
    """With ``flipped``, the kernel reads a Conv's parameter ``[C, K, 3, 3]`` in place of the
    input gradient's filters: the same outputs, bit for bit, as the filters written out."""
    n, c, k, h, w = GEOMETRIES[geometry]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    parameter = rng.standard_normal((c, k, 3, 3)).astype(np.float32)
    filters = np.ascontiguousarray(parameter.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    want, got = (np.full((n, k, h, w), np.nan, np.float32) for _ in range(2))
    NATIVE.conv_winograd(x, filters, None, None, want, 2, tile)
    NATIVE.conv_winograd(x, parameter, None, None, got, 2, tile, True)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"\(\[C, K, 3, 3\] flipped\)"):
        NATIVE.conv_winograd(x, np.zeros((c + 1, k, 3, 3), np.float32), None, None, got, 1,
                             tile, True)  # fmt: skip


def test_flipped_filters_with_a_nan_are_summed_as_the_conv():
    """A NaN in the parameter read flipped: the direct sums of the turned filters, as the
    graph's Conv of the Slice of the Transpose gives them."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    parameter = rng.standard_normal((4, 5, 3, 3)).astype(np.float32)
    parameter[1, 2, 0, 1] = np.nan
    kernel = winograd.WinogradConv("x", "w", None, None, "y", flipped=True)
    out: dict[str, np.ndarray] = {}
    kernel.compute({"x": x, "w": parameter}, out, 2)
    filters = parameter.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1].astype(np.float64)
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x).double(), torch.from_numpy(filters.copy()), padding=1
    ).numpy()
    np.testing.assert_array_equal(np.isnan(out["y"]), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(out["y"][finite], want[finite], rtol=1e-5, atol=1e-5)


def _relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


@pytest.mark.parametrize("channels", [512, 2048])
@pytest.mark.parametrize("flipped", [False, True], ids=["forward", "flipped"])
def test_channel_sums_stay_as_accurate_as_a_conv_over_many_channels(channels, flipped):
    """The sums over many channels (ResNet-50's layer4: 512 channels of 2 x 2) stay near
    onnxruntime's Conv's distance from the exact sums: it is at a relative rms of 3.7e-7 (512
    channels) and 3.9e-7 (2048) here, one float32 run over the channels at 8.3e-7 and 1.6e-6."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, channels, 2, 2)).astype(np.float32)
    weight = (rng.standard_normal((channels, channels, 3, 3)) / np.sqrt(9 * channels)).astype(
        np.float32
    )
    filters = weight.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1] if flipped else weight
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x).double(), torch.from_numpy(filters.copy()).double(), padding=1
    ).numpy()
    y = np.full(want.shape, np.nan, np.float32)
    NATIVE.conv_winograd(x, weight, None, None, y, 2, 2, flipped)
    assert _relative_rms(y, want) <= 5e-7


def test_kernel_refuses_arrays_it_cannot_take():
    native = NATIVE
    x, w = np.zeros((2, 3, 6, 6), np.float32), np.zeros((4, 3, 3, 3), np.float32)
    y = np.zeros((2, 4, 6, 6), np.float32)
    with pytest.raises(ValueError, match=r"are not one 3 x 3 convolution of pads 1"):
        native.conv_winograd(np.zeros((2, 3, 5, 6), np.float32), w, None, None,
                             np.zeros((2, 4, 5, 5), np.float32), 1)  # fmt: skip
    with pytest.raises(ValueError, match=r"w \[4, 3, 5, 5\]"):
        native.conv_winograd(x, np.zeros((4, 3, 5, 5), np.float32), None, None, y, 1)
    with pytest.raises(ValueError, match=r"b \[K\] and addend y's shape"):
        native.conv_winograd(x, w, None, np.zeros((2, 4, 6, 4), np.float32), y, 1)
    with pytest.raises(ValueError, match=r"b \[K\]"):
        native.conv_winograd(x, w, np.zeros(3, np.float32), None, y, 1)
    cases = [(4, (2, 3, 6, 8)), (4, (2, 3, 8, 12)), (3, (2, 3, 8, 8)), (4, (2, 3, 7, 8))]
    for tile, shape in cases:
        with pytest.raises(ValueError, match=rf"tile {tile} over a height {shape[2]} and width"):
            native.conv_winograd(np.zeros(shape, np.float32), w, None, None,
                                 np.zeros((2, 4, *shape[2:]), np.float32), 1, tile)  # fmt: skip
    with pytest.raises(TypeError, match="argument 0: x must be a numpy array"):
        native.conv_winograd([1.0], w, None, None, y, 1)
    with pytest.raises(ValueError, match="argument 4: y is read-only"):
        y.flags.writeable = False
        native.conv_winograd(x, w, None, None, y, 1)


class PlainBlock(nn.Module):
    """A stem, an identity residual block of 3 x 3 Convs (the block's input gradient is the Sum
    of the two paths), a strided Conv and a Conv with a bias and no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.strided = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.head = nn.Conv2d(12, 6, 3, padding=1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(h + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h))))))
        h = torch.relu(self.head(torch.relu(self.strided(h))))
        return self.fc(h.mean(dim=(2, 3)))


def _artifacts(directory, dynamo=False, size=(8, 12)):
    model, example = seeded(PlainBlock), torch.zeros(4, 3, *size)
    onnx_model = (
        export_dynamo(model, example) if dynamo else export(model, example, training=True)
    )
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=directory,
    )
    return directory


def test_the_three_by_three_convs_of_stride_one_are_taken(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    found = winograd.split_winograd_convs(model)
    inputs = {i.name for i in model.graph.input}
    forward = {k.weight: k for k, _ in found if not k.flipped}
    # the stem, the block's two and the head (the strided Conv stays)
    assert set(forward) == {"stem.weight", "conv1.weight", "conv2.weight", "head.weight"}
    assert forward["head.weight"].bias == "head.bias"
    assert forward["conv1.weight"].bias is None
    # input gradients: the Conv of the output gradient with the flipped filters, for the head
    # and the block's Convs (the stem's input gradient is not computed); each reads its
    # parameter in place of the graph's Transpose and Slice of it
    gradients = {k.weight: (k, n) for k, n in found if k.flipped}
    assert set(gradients) == {"conv1.weight", "conv2.weight", "head.weight"}
    summed = [k for k, _ in gradients.values() if k.addend is not None]
    assert [k.weight for k in summed] == ["conv1.weight"]  # adds the identity path's
    ops = sorted(model.graph.node[i].op_type for i in gradients["conv1.weight"][1])
    assert ops == ["Conv", "Slice", "Sum", "Transpose"]
    assert all(k.weight in inputs for k, _ in found)
    # nodes another kernel takes stay in the graph
    conv = next(i for i, node in enumerate(model.graph.node) if node.op_type == "Conv")
    assert conv not in set().union(*(n for _, n in winograd.split_winograd_convs(model, {conv})))


@pytest.mark.parametrize(
    ("attributes", "shape"),
    [
        ({"pads": [1, 1, 1, 1], "strides": [2, 2]}, [2, 3, 8, 8]),
        ({"pads": [0, 0, 0, 0]}, [2, 3, 8, 8]),
        ({"pads": [1, 1, 1, 1], "dilations": [2, 2]}, [2, 3, 8, 8]),
        ({"pads": [1, 1, 1, 1], "group": 3}, [2, 3, 8, 8]),
    ],
    ids=["strided", "unpadded", "dilated", "grouped"],
)
def test_convs_the_kernel_does_not_take_stay(attributes, shape):
    group = attributes.get("group", 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attributes)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [6, 3 // group, 3, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    assert winograd.split_winograd_convs(model) == []
    attributes = {"pads": [1, 1, 1, 1]}
    model.graph.node[0].CopyFrom(helper.make_node("Conv", ["x", "w"], ["y"], **attributes))
    if group == 1:  # the same Conv, made one the kernel takes
        assert len(winograd.split_winograd_convs(model)) == 1


def test_a_bias_of_open_shape_is_checked_at_its_length_and_costs_no_other_conv():
    """A zero bias written as an Expand of a computed shape (as the dynamo exporter does) has
    an open length after inference: the check feeds it at [K] (a Conv's bias is [K]), and a
    match onnxruntime rejects drops only itself."""
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["w"], ["w_rows"], end=1),
            helper.make_node("Expand", ["w_rows", "one"], ["w_shape"]),
            helper.make_node("CastLike", ["zero", "x"], ["zero_like"]),
            helper.make_node("Expand", ["zero_like", "w_shape"], ["b"]),
            helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["y", "w2"], ["z"], pads=[1, 1, 1, 1]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [6, 3, 3, 3]),
            helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4, 6, 3, 3]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    found = winograd.split_winograd_convs(model)
    assert sorted(k.out for k, _ in found) == ["y", "z"]
    # fed at an open length's stand-in, the first Conv fails in onnxruntime; the second stays
    open_shapes = graph_match.inferred_shapes(model)
    assert None in open_shapes["b"]
    g = graph_match.GraphIndex.of(model.graph)
    kept = verify.verified_kernels(model, g, found, open_shapes)
    assert [k.out for k, _ in kept] == ["z"]


def test_the_plan_keeps_no_taken_conv(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    model, grads = conv_grads.split_weight_grads(model)
    model, kernels = segments.find_kernels(model, grads)
    taken = [k for k, _ in kernels if isinstance(k, winograd.WinogradConv)]
    plan = segments.plan_segments(model, kernels)
    outputs = {k.out for k in taken}
    for segment in plan.segments:
        for node in segment.model.graph.node:
            assert not set(node.output) & outputs
    assert [k for k in plan.all_kernels if isinstance(k, winograd.WinogradConv)] != []


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_module_trains_as_the_graph_does(tmp_path, dynamo):
    directory = _artifacts(tmp_path, dynamo)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 8, 12)).astype(np.float32), rng.integers(0, 5, n))
        for n in (4, 4, 3)  # the batch changes: the kernels' outputs follow it
    ]
    got = artifact_steps(directory, batches, winograd.WinogradConv)
    expected = artifact_steps(directory, batches, winograd.WinogradConv, without=NO_WINOGRAD)
    assert_same_training(got, expected, one_scale=True)


class WideOdd(nn.Module):
    """A stem of few channels and a residual 3 x 3 Conv of 128, over an odd plane."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 128, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(128)
        self.conv = nn.Conv2d(128, 128, 3, padding=1)
        self.fc = nn.Linear(128, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(h + self.conv(h))
        return self.fc(h.mean(dim=(2, 3)))


def test_odd_planes_of_many_channels_are_taken_and_train_as_the_graph_does(tmp_path):
    """At 7 x 9 the 128-channel Conv and its input gradient are the kernel's, computed over
    planes one row and column larger; the stem of 3 input channels is not (its transforms
    would outweigh its products). The training is the graph's."""
    artifacts.generate_artifacts(
        export(seeded(WideOdd), torch.zeros(2, 3, 7, 9), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    found = winograd.split_winograd_convs(model)
    assert sorted((k.weight, k.flipped) for k, _ in found) == [
        ("conv.weight", False), ("conv.weight", True)
    ]
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((n, 3, 7, 9)).astype(np.float32), rng.integers(0, 5, n))
        for n in (2, 2, 3)
    ]
    got = artifact_steps(tmp_path, batches, winograd.WinogradConv)
    expected = artifact_steps(tmp_path, batches, winograd.WinogradConv, without=NO_WINOGRAD)
    assert_same_training(got, expected, one_scale=True)
