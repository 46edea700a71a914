"""The gradient of a MaxPool of any window (runtime/cpu/kernels/max_pool.py): the native kernel
against onnxruntime's MaxPool positions and ScatterElements bit for bit (ties, NaN and
infinities included), which graphs it takes, and Module's train steps against the graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from torch_models import export, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu.kernels import max_pool
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

GEOMETRIES = {
    # x's shape, and the MaxPool's attributes
    "resnet-stem": ([2, 3, 9, 10], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4}),
    "overlapping": ([1, 2, 7, 7], {"kernel_shape": [3, 3], "strides": [1, 1]}),
    "uneven-pads": (
        [2, 2, 8, 7],
        {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 1]},
    ),
    "dilated": ([2, 3, 9, 8], {"kernel_shape": [2, 2], "strides": [2, 1], "dilations": [2, 3]}),
    "tiling": ([2, 4, 6, 6], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    # ceil mode (SqueezeNet's pools): a last window over the end of the input
    "ceil-mode": ([2, 3, 14, 13], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "ceil-mode-padded": (
        [1, 2, 8, 8],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4, "ceil_mode": 1},
    ),
}


def _scatter_graph(shape: list[int], attrs: dict, pooled: list[int]) -> onnx.ModelProto:
    """The autodiff rule's form: MaxPool positions, ScatterElements(add) into zeros."""
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["z"]),
        helper.make_node("Reshape", ["z", "flat"], ["zf"]),
        helper.make_node("Reshape", ["i", "flat"], ["if"]),
        helper.make_node("Reshape", ["g", "flat"], ["gf"]),
        helper.make_node("ScatterElements", ["zf", "if", "gf"], ["d"], axis=0, reduction="add"),
        helper.make_node("Reshape", ["d", "s"], ["dx"]),
    ]
    graph = helper.make_graph(
        nodes, "max_pool_grad",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, pooled)],
        [helper.make_tensor_value_info("dx", onnx.TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array([-1], np.int64), "flat")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _pooled(shape: list[int], attrs: dict) -> list[int]:
    """The MaxPool's output shape, from onnx's shape inference."""
    pool = helper.make_model(
        helper.make_graph(
            [helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "pool",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    output = onnx.shape_inference.infer_shapes(pool).graph.output[0]
    return [d.dim_value for d in output.type.tensor_type.shape.dim]


def _draws(rng: np.random.Generator, shape: list[int], non_finite: bool) -> np.ndarray:
    """Values with many ties (small integers), and where ``non_finite``, NaN and infinities."""
    x = rng.integers(-3, 4, shape).astype(np.float32)
    if non_finite:
        flat = x.reshape(-1)
        flat[::7], flat[3::11], flat[5::13] = np.nan, np.inf, -np.inf
    return x


@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_kernel_is_the_scatter_bit_for_bit(geometry, threads, non_finite):
    shape, attrs = GEOMETRIES[geometry]
    pooled = _pooled(shape, attrs)
    rng = np.random.default_rng(0)
    x = _draws(rng, shape, non_finite)
    g = rng.standard_normal(pooled).astype(np.float32)
    if non_finite:
        g.reshape(-1)[::5] = np.inf
    session = ort.InferenceSession(
        _scatter_graph(shape, attrs, pooled).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    (want,) = session.run(None, {"x": x, "g": g})
    got = np.full(shape, 7.0, np.float32)
    kernel, pads = tuple(attrs["kernel_shape"]), tuple(attrs.get("pads", [0] * 4)[:2])
    strides, dilations = tuple(attrs["strides"]), tuple(attrs.get("dilations", [1, 1]))
    NATIVE.max_pool_grad(x, g, got, kernel, strides, pads, dilations, threads)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_kernel_refuses_windows_without_elements_and_shapes_that_do_not_fit():
    x, g = np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 1, 6, 6), np.float32)
    with pytest.raises(ValueError, match="hold no element of x"):
        NATIVE.max_pool_grad(x, g, np.zeros_like(x), (1, 1), (1, 1), (1, 1), (1, 1), 1)
    with pytest.raises(ValueError, match=r"expected dx of x's shape"):
        NATIVE.max_pool_grad(x, g, np.zeros((1, 1, 4, 3), np.float32), (1, 1), (1, 1), (0, 0),
                             (1, 1), 1)  # fmt: skip


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_the_scatter_is_taken_with_every_node_of_it(geometry):
    shape, attrs = GEOMETRIES[geometry]
    model = _scatter_graph(shape, attrs, _pooled(shape, attrs))
    found = max_pool.split_max_pool_scatters(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    assert (kernel.x, kernel.g, kernel.out) == ("x", "g", "dx")
    assert nodes == set(range(len(model.graph.node)))


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4, "storage_order": 1},
        {"kernel_shape": [1, 1], "strides": [1, 1], "pads": [1] * 4},  # empty border windows
        # onnx's shape inference keeps a last window that starts in the end pads (4 of them
        # over 7), which onnxruntime drops
        {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1] * 4, "ceil_mode": 1},
    ],
    ids=["column-major-positions", "empty-windows", "ceil-window-in-end-pads"],
)
def test_positions_the_kernel_does_not_give_stay(attrs):
    shape = [1, 2, 7, 7]
    model = _scatter_graph(shape, attrs, _pooled(shape, attrs))
    assert max_pool.split_max_pool_scatters(model) == []


class StemNet(nn.Module):
    """A Conv-BN-Relu-MaxPool stem of overlapping padded windows (ResNet's), then a Conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )  # fmt: skip
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(self.stem(x))).mean(dim=(2, 3)))


def test_a_resnet_stem_gradient_is_taken_from_the_training_model(tmp_path):
    artifacts.generate_artifacts(
        export(seeded(StemNet), torch.zeros(2, 3, 12, 12), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    found = max_pool.split_max_pool_scatters(model)
    assert len(found) == 1
    ops = sorted(model.graph.node[i].op_type for i in found[0][1])
    assert ops.count("ScatterElements") == 1 and ops.count("MaxPool") == 1
