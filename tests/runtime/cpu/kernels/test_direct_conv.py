"""First convolutions computed directly before the first segment
(runtime/cpu/kernels/direct_conv.py): the
kernel against torch, which Convs it takes, the plan, and Module's train steps against the
graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from gradcheck import artifact_steps, assert_same_training
from torch_models import export, export_dynamo, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import direct_conv
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

NO_DIRECT_CONVS = "direct_conv"

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

GEOMETRIES = {
    # batch, channels, height, width, filters, kernel, pads (top, left, bottom, right)
    "lenet-first": (64, 1, 28, 28, 6, (5, 5), (2, 2, 2, 2)),
    "rgb-stem": (4, 3, 32, 32, 16, (3, 3), (1, 1, 1, 1)),
    "wide-uneven": (3, 2, 7, 40, 11, (3, 2), (0, 1, 2, 0)),
    "unpadded-small": (2, 1, 5, 5, 9, (5, 5), (0, 0, 0, 0)),
    "7x7-many-filters": (1, 4, 17, 33, 17, (7, 7), (3, 3, 3, 3)),
    "1x1": (5, 3, 9, 9, 3, (1, 1), (0, 0, 0, 0)),
    "one-column": (2, 2, 6, 1, 4, (3, 1), (1, 0, 1, 0)),
    "end-pads-beyond-kernel": (2, 1, 5, 6, 3, (3, 3), (0, 2, 5, 4)),
    "channels-in-runs": (2, 37, 6, 9, 10, (3, 3), (1, 1, 1, 1)),
}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("relu", [False, True])
def test_kernel_matches_torch(geometry, threads, relu):
    n, c, h, w, m, (kh, kw), (top, left, bottom, right) = geometry
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((m, c, kh, kw)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32) if threads != 3 else None
    padded = torch.nn.functional.pad(torch.from_numpy(x), (left, right, top, bottom))
    want = torch.nn.functional.conv2d(
        padded, torch.from_numpy(weight), None if bias is None else torch.from_numpy(bias)
    )
    want = (torch.relu(want) if relu else want).numpy()
    y = np.full(want.shape, np.nan, np.float32)
    NATIVE.conv_direct(x, weight, bias, y, (top, left), relu, threads)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("channels", [512, 2048])
def test_channel_sums_stay_as_accurate_as_onnxruntimes_conv(channels):
    """The sums over many channels (the direct sums the Winograd kernel falls back to on a NaN
    or an Inf) stay within onnxruntime's Conv's distance from the exact sums: a relative rms
    of 3.6e-7 (512 channels) and 3.7e-7 (2048) here, where one float32 run over the channels
    is at 8.0e-7 and 1.5e-6."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, channels, 2, 2)).astype(np.float32)
    weight = (rng.standard_normal((64, channels, 3, 3)) / np.sqrt(9 * channels)).astype(np.float32)
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x).double(), torch.from_numpy(weight).double(), padding=1
    ).numpy()
    y = np.full(want.shape, np.nan, np.float32)
    NATIVE.conv_direct(x, weight, None, y, (1, 1), False, 2)
    assert float(np.sqrt(np.mean((y - want) ** 2) / np.mean(want**2))) <= 4e-7


def test_kernel_refuses_arrays_it_cannot_take():
    native = NATIVE
    x, w = np.zeros((2, 1, 8, 8), np.float32), np.zeros((3, 1, 3, 3), np.float32)
    y = np.zeros((2, 3, 6, 6), np.float32)
    with pytest.raises(ValueError, match=r"w \[3, 2, 3, 3\].*y must be \[N, M, OH, OW\]"):
        native.conv_direct(x, np.zeros((3, 2, 3, 3), np.float32), None, y, (0, 0), False, 1)
    with pytest.raises(ValueError, match="argument 3: y is not float32"):
        native.conv_direct(x, w, None, y.astype(np.float64), (0, 0), False, 1)
    with pytest.raises(ValueError, match="argument 3: y is read-only"):
        y.flags.writeable = False
        native.conv_direct(x, w, None, y, (0, 0), False, 1)
    y = np.zeros((2, 3, 6, 6), np.float32)
    with pytest.raises(ValueError, match="pads >= 0"):
        native.conv_direct(x, w, None, y, (-1, 0), False, 1)
    with pytest.raises(ValueError, match=r"b \[M\]"):
        native.conv_direct(x, w, np.zeros(4, np.float32), y, (0, 0), False, 1)
    with pytest.raises(ValueError, match="argument 0: x is not 4-D"):
        native.conv_direct(x[0], w, None, y, (0, 0), False, 1)


def _conv_model(*, channels=1, strides=(1, 1), weight_initializer=False, relu_readers=1):
    """x [N, C, 8, 8] -> Conv(3x3, pad 1) -> Relu (read by ``relu_readers`` Identities) ->
    ReduceSum; W and b graph inputs unless ``weight_initializer``."""
    weight = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, channels, 3, 3])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, 8, 8])]
    inputs += [weight, helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])]
    initializers = []
    if weight_initializer:
        inputs = [inputs[0], inputs[2]]
        w = np.random.default_rng(0).standard_normal((4, channels, 3, 3)).astype(np.float32)
        initializers = [numpy_helper.from_array(w, "w")]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * 4, strides=list(strides)),
        helper.make_node("Relu", ["c"], ["r"]),
    ]
    nodes += [helper.make_node("Identity", ["c" if k else "r"], [f"i{k}"])
              for k in range(relu_readers)]  # fmt: skip
    nodes += [helper.make_node("Sum", [f"i{k}" for k in range(relu_readers)], ["s"]),
              helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "conv",
        inputs,
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def test_a_first_conv_and_its_relu_are_taken():
    model = _conv_model()
    (kernel, nodes), = direct_conv.split_direct_convs(model)
    assert sorted(model.graph.node[i].op_type for i in nodes) == ["Conv", "Relu"]
    assert kernel.inputs == ["x", "w", "b"] and kernel.out == "r" and kernel.relu
    assert kernel.pads == (1, 1, 1, 1)
    # its output has another reader: the Relu stays in the graph
    (kernel, nodes), = direct_conv.split_direct_convs(_conv_model(relu_readers=2))
    assert kernel.out == "c" and not kernel.relu and len(nodes) == 1
    # nodes another kernel takes stay
    assert direct_conv.split_direct_convs(model, taken={0}) == []
    (kernel, nodes), = direct_conv.split_direct_convs(model, taken={1})
    assert not kernel.relu and nodes == {0}


@pytest.mark.parametrize(
    "options",
    [
        {"channels": direct_conv.MAX_CHANNELS + 1},  # onnxruntime's blocked conv fills vectors
        {"strides": (2, 2)},
        {"weight_initializer": True},  # the kernel reads model inputs only
    ],
    ids=["many-channels", "strided", "initializer-weight"],
)
def test_convs_the_kernel_does_not_take_stay(options):
    assert direct_conv.split_direct_convs(_conv_model(**options)) == []


def test_the_kernel_runs_before_the_first_segment():
    model = _conv_model()
    model, kernels = segments.find_kernels(model, [])
    (kernel,) = [k for k, _ in kernels if isinstance(k, direct_conv.DirectConv)]
    plan = segments.plan_segments(model, kernels)
    assert plan.first == [kernel] and plan.all_kernels[0] is kernel
    assert "r" in plan.segments[0].inputs
    assert not any(n.op_type in ("Conv", "Relu") for n in plan.segments[0].model.graph.node)


class SmallLeNet(nn.Module):
    """LeNet's first layers: a padded 5x5 Conv of one channel, Relu, MaxPool; then a second
    Conv (of more channels than the kernel takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5, padding=2), nn.Conv2d(6, 8, 3)
        self.fc = nn.Linear(8 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_module_trains_as_the_graph_does(tmp_path, dynamo):
    model, example = seeded(SmallLeNet), torch.zeros(2, 1, 16, 16)
    artifacts.generate_artifacts(
        export_dynamo(model, example) if dynamo else export(model, example, training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    found = direct_conv.split_direct_convs(model)
    assert [k.relu for k, _ in found] == [True]
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((n, 1, 16, 16)).astype(np.float32), rng.integers(0, 4, n))
        for n in (3, 3, 5)  # the batch changes: the kernel's output follows it
    ]
    got = artifact_steps(tmp_path, batches, direct_conv.DirectConv)
    expected = artifact_steps(tmp_path, batches, direct_conv.DirectConv, without=NO_DIRECT_CONVS)
    assert_same_training(got, expected, one_scale=True)
