"""The input gradient of a strided depthwise Conv computed natively: the kernel against
onnxruntime's ConvTranspose over strides, pads, kernel sizes and output paddings (with NaN and
infinities), found in the graph the Conv rule writes, and Module's steps with and without it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from gradcheck import adamw_artifacts, artifact_steps, assert_same_training
from torch_models import export, seeded
from traingraph.runtime.cpu import native
from traingraph.runtime.cpu.kernels import depthwise

pytestmark = pytest.mark.skipif(
    native.NATIVE is None or not hasattr(native.NATIVE, "depthwise_conv_transpose"),
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def _transpose_session(c: int, k: tuple[int, int], strides, pads, output_padding):
    node = helper.make_node(
        "ConvTranspose", ["dy", "w"], ["dx"], group=c, kernel_shape=list(k),
        strides=list(strides), pads=list(pads), output_padding=list(output_padding),
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "dwt",
        [helper.make_tensor_value_info("dy", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])  # fmt: skip


GEOMETRIES = [
    # (channels, output gradient size, kernel, strides, pads (t, l, b, r), output padding)
    (6, (5, 7), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    (5, (4, 4), (5, 5), (2, 2), (2, 2, 2, 2), (1, 0)),
    (3, (6, 5), (4, 2), (2, 3), (0, 1, 1, 0), (0, 2)),
    (4, (3, 9), (3, 5), (3, 1), (2, 0, 0, 2), (2, 0)),
    (7, (2, 33), (3, 3), (1, 2), (1, 1, 1, 1), (0, 1)),  # rows past 16 and 32 columns
    (4, (6, 6), (3, 3), (2, 2), (3, 4, 0, 1), (0, 0)),  # pads past the kernel
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_onnxruntime_with_non_finite_values(geometry, threads):
    c, (oh, ow), k, strides, pads, output_padding = geometry
    session = _transpose_session(c, k, strides, pads, output_padding)
    rng = np.random.default_rng(0)
    for special in (None, "dy", "w"):
        dy = rng.standard_normal((3, c, oh, ow)).astype(np.float32)
        w = rng.standard_normal((c, 1, *k)).astype(np.float32)
        if special == "dy":
            dy.reshape(-1)[[1, 17, 40]] = [np.nan, np.inf, -np.inf]
        elif special == "w":  # a channel whose filter is not finite is summed tap by tap
            w[1, 0, 0, 0], w[2, 0, -1, -1] = np.inf, np.nan
        want = session.run(None, {"dy": dy, "w": w})[0]
        got = np.full_like(want, 7.0)
        native.NATIVE.depthwise_conv_transpose(dy, w, got, strides, pads[:2], threads)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_mismatched_shapes():
    dy = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"w \[3, 2, 3, 3\]"):
        native.NATIVE.depthwise_conv_transpose(
            dy, np.zeros((3, 2, 3, 3), np.float32), np.zeros((2, 3, 8, 8), np.float32),
            (2, 2), (1, 1), 1,
        )  # fmt: skip


class Net(nn.Module):
    """A pointwise Conv, a depthwise Conv of stride 2, pooling and a Linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.point = nn.Conv2d(3, 8, 1)
        self.depth = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depth(torch.relu(self.point(x)))
        return self.head(y.mean((2, 3)))


def test_the_rules_conv_transpose_is_found_and_module_trains_as_the_graph(tmp_path):
    directory = adamw_artifacts(tmp_path, export(seeded(Net), torch.zeros(2, 3, 9, 9)))
    model = onnx.load(directory / "training_model.onnx")
    found = depthwise.split_depthwise_conv_transposes(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    assert kernel.strides == (2, 2) and kernel.pads == (1, 1) and kernel.size == (9, 9)
    assert [model.graph.node[i].op_type for i in nodes] == ["ConvTranspose"]
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 9, 9)).astype(np.float32), rng.integers(0, 3, n))
        for n in (4, 4, 2)  # the batch changes: the kernel's output follows it
    ]
    got = artifact_steps(directory, batches, depthwise.DepthwiseConvTranspose)
    expected = artifact_steps(
        directory, batches, depthwise.DepthwiseConvTranspose, without="depthwise_conv_transpose"
    )
    assert_same_training(got, expected)
