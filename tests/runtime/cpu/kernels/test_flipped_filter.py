"""The flipped filters of Convs' input gradients (runtime/cpu/kernels/flipped_filter.py): which
ones the kernel takes, its copy against onnxruntime's Transpose and Slice bit for bit (NaN and
infinities included), and Module's train steps against the graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from gradcheck import artifact_steps, assert_same_training
from torch_models import export, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import verify
from traingraph.runtime.cpu.kernels import flipped_filter, winograd
from traingraph.runtime.cpu.kernels.permutes import FilterReorder
from traingraph.runtime.cpu.native import AVAILABLE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


class OddNet(nn.Module):
    """A 3 x 3 Conv of dilations 2 and pads 2, whose input gradient (the same Conv of the
    flipped filters) is left to onnxruntime (the Winograd kernel takes dilations 1), then one
    of dilations 1 and pads 1 (the Winograd kernel's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.odd = nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False)
        self.down = nn.Conv2d(8, 12, 2, stride=1)
        self.even = nn.Conv2d(12, 6, 3, padding=1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.odd(torch.relu(self.stem(x))))
        h = torch.relu(self.even(torch.relu(self.down(h))))
        return self.fc(h.mean(dim=(2, 3)))


def _artifacts(directory):
    artifacts.generate_artifacts(
        export(seeded(OddNet), torch.zeros(4, 3, 7, 7), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=directory,
    )
    return directory


def test_the_flips_left_to_onnxruntime_are_taken(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    taken = set().union(*(nodes for _, nodes in winograd.split_winograd_convs(model)))
    found = flipped_filter.split_flipped_filters(model, taken)
    # the dilated Conv's input gradient (the stem's is not computed; Winograd reads the other
    # one's parameter in place)
    assert [k.weight for k, _ in found] == ["odd.weight"]
    kernel, nodes = found[0]
    assert sorted(model.graph.node[i].op_type for i in nodes) == ["Slice", "Transpose"]
    assert flipped_filter.split_flipped_filters(model, taken | nodes) == []


def test_the_copy_is_the_graphs_bit_for_bit(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    found = flipped_filter.split_flipped_filters(model)  # the even Conv's flip too, here
    kernel, nodes = next((k, n) for k, n in found if k.weight == "odd.weight")
    weight = np.random.default_rng(0).standard_normal((8, 8, 3, 3)).astype(np.float32)
    weight.flat[[3, 40, 77, 100]] = [np.nan, np.inf, -np.inf, -0.0]
    (want,) = verify.run_subgraph(
        model, [model.graph.node[i] for i in sorted(nodes)], {kernel.weight: weight}, [kernel.out]
    )
    out: dict[str, np.ndarray] = {}
    kernel.compute({kernel.weight: weight}, out, 1)
    np.testing.assert_array_equal(out[kernel.out].view(np.int32), want.view(np.int32))


def test_module_trains_as_the_graph_does(tmp_path):
    directory = _artifacts(tmp_path)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 3, 7, 7)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    kind = flipped_filter.FlippedFilter
    got = artifact_steps(directory, batches, kind)
    expected = artifact_steps(directory, batches, kind, without="flipped_filter")
    assert_same_training(got, expected, one_scale=True)


@pytest.mark.parametrize(
    ("dims", "perm"),
    [
        ([3, 16, 2, 16, 9], [0, 2, 4, 3, 1]),  # onnxruntime's blocks of 16 channels
        ([6, 8, 4, 8, 9], [0, 2, 4, 3, 1]),  # of 8
        ([48, 4, 8, 3, 3], [1, 0, 3, 4, 2]),  # the taps split
        ([48, 32, 9], [1, 0, 2]),
        ([1536, 9], [1, 0]),  # a part across the two channel axes: two copies
        ([48, 288], [1, 0]),  # across the output channels and the taps
    ],
)
def test_a_flipped_filter_and_its_reorder_are_one_copy_bit_for_bit(dims, perm):
    """``FlippedReorder`` writes what the flip and then the reorder write, NaN, infinities and
    -0 included; one strided copy where each part of ``dims`` lies in one axis of the flipped
    filters, two otherwise."""
    k, c = 32, 48
    weight = np.random.default_rng(3).standard_normal((k, c, 3, 3)).astype(np.float32)
    weight.flat[[3, 77, 500, 901]] = [np.nan, np.inf, -np.inf, -0.0]
    flipped: dict[str, np.ndarray] = {}
    flipped_filter.FlippedFilter("w", "f").compute({"w": weight}, flipped, 2)
    want = np.ascontiguousarray(flipped["f"].reshape(dims).transpose(perm))
    composed = flipped_filter.composed_layout(dims, perm, k, c)
    assert (composed is not None) == (dims[0] not in (1536,) and dims[-1] != 288)
    reorder = FilterReorder("f", "o", tuple(dims), tuple(perm), want.shape)
    kernel = flipped_filter.FlippedReorder("w", reorder)
    for threads in (1, 2):
        out: dict[str, np.ndarray] = {}
        kernel.compute({"w": weight}, out, threads)
        np.testing.assert_array_equal(out["o"].view(np.int32), want.view(np.int32))


class SmallPlaneNet(nn.Module):
    """A residual 3 x 3 Conv of 32 channels over a 5 x 5 plane: its input gradient is left to
    onnxruntime's blocked Conv, whose filter is the flipped parameter reordered."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.conv = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(h + self.bn(self.conv(h)))
        return self.fc(h.mean(dim=(2, 3)))


def test_module_with_the_flip_and_reorder_in_one_copy_trains_as_the_graph_does(tmp_path):
    artifacts.generate_artifacts(
        export(seeded(SmallPlaneNet), torch.zeros(4, 3, 5, 5), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 3, 5, 5)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    from gradcheck import train_steps
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.runtime.cpu import kernels
    from traingraph.runtime.session import SessionConfig

    def run(config: SessionConfig) -> tuple[tuple, list]:
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, session_config=config)
        steps = list(getattr(module.step.runner, "_steps", []))
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
        return train_steps(module, optimizer, state, batches), steps

    got, steps = run(SessionConfig())
    if not any(isinstance(s, flipped_filter.FlippedReorder) for s in steps):
        pytest.skip("onnxruntime's blocked layout of this filter is not a reorder here")
    assert not any(isinstance(s, flipped_filter.FlippedFilter) for s in steps)
    chosen = set(kernels.names()) - {"flipped_filter"}
    expected, steps = run(SessionConfig(native_kernels=chosen))
    assert not any(isinstance(s, flipped_filter.FlippedReorder) for s in steps)
    assert_same_training(got, expected, one_scale=True)
