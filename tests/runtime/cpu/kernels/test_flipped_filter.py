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


def _flipped(weight: np.ndarray, group: int) -> np.ndarray:
    """The flipped filters of ``weight`` ``[K, C / group, kh, kw]`` as numpy writes them."""
    k, cg, kh, kw = weight.shape
    grouped = weight.reshape(group, k // group, cg, kh, kw).transpose(0, 2, 1, 3, 4)
    return grouped.reshape(group * cg, k // group, kh, kw)[:, :, ::-1, ::-1]


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


def _artifacts(directory, net=None, side=7):
    """The artifacts of ``net`` (an :class:`OddNet` where None) on ``side`` x ``side`` images."""
    artifacts.generate_artifacts(
        export(seeded(net or OddNet), torch.zeros(4, 3, side, side), training=True),
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


@pytest.mark.parametrize("grouped", [False, True])
def test_module_trains_as_the_graph_does(tmp_path, grouped):
    """With the flips of OddNet's Convs, and of GroupedNet's grouped ones."""
    side = 6 if grouped else 7
    directory = _artifacts(tmp_path, GroupedNet if grouped else None, side)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 3, side, side)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    # a flip alone, or one copy with the blocked reorder after it where onnxruntime's blocks
    # (8 channels with AVX2, 16 with AVX-512) take the Conv that reads it
    kind = (flipped_filter.FlippedFilter, flipped_filter.FlippedReorder)
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
        ([1536, 9], [1, 0]),  # a part across the two channel axes
        ([48, 288], [1, 0]),  # across the output channels and the taps
        ([32, 48, 9], [1, 0, 2]),  # parts that overlap the channel axes: two copies
    ],
)
def test_a_flipped_filter_and_its_reorder_are_one_copy_bit_for_bit(dims, perm):
    """``FlippedReorder`` writes what the flip and then the reorder write, NaN, infinities and
    -0 included; one strided copy where each part of ``dims`` is whole parts of the flipped
    filters' axes, two otherwise."""
    k, c = 32, 48
    weight = np.random.default_rng(3).standard_normal((k, c, 3, 3)).astype(np.float32)
    weight.flat[[3, 77, 500, 901]] = [np.nan, np.inf, -np.inf, -0.0]
    want = np.ascontiguousarray(_flipped(weight, 1).reshape(dims).transpose(perm))
    composed = flipped_filter.composed_layout(dims, perm, weight.shape)
    assert (composed is not None) == (dims[0] != 32)
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


@pytest.mark.parametrize(
    ("shape", "group"),
    [((32, 48, 3, 3), 1), ((64, 16, 3, 3), 4), ((24, 8, 5, 5), 3), ((12, 1, 3, 3), 12),
     ((16, 4, 1, 3), 2), ((16, 4, 3, 1), 4), ((8, 8, 2, 2), 1)],
)  # fmt: skip
def test_grouped_and_rectangular_flips_bit_for_bit(shape, group):
    """``FlippedFilter`` of any 2-D kernel and any groups against numpy, NaN, infinities and -0
    included, on one and two threads."""
    weight = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    weight.flat[[0, 7, 11, 30]] = [np.nan, np.inf, -np.inf, -0.0]
    want = np.ascontiguousarray(_flipped(weight, group))
    for threads in (1, 2):
        out: dict[str, np.ndarray] = {}
        flipped_filter.FlippedFilter("w", "f", group).compute({"w": weight}, out, threads)
        np.testing.assert_array_equal(out["f"].view(np.int32), want.view(np.int32))


def test_a_grouped_flip_and_its_blocked_reorder_are_one_copy_bit_for_bit():
    """64 filters in 4 groups of 16 channels each, the flipped filters ``[64, 16, 3, 3]`` cut
    into onnxruntime's blocks of 8 channels and filters: one strided copy of the parameter."""
    weight = np.random.default_rng(6).standard_normal((64, 16, 3, 3)).astype(np.float32)
    weight.flat[[1, 99, 1000]] = [np.nan, np.inf, -0.0]
    dims, perm = [8, 8, 2, 8, 9], [0, 2, 4, 3, 1]
    want = np.ascontiguousarray(_flipped(weight, 4).reshape(dims).transpose(perm))
    assert flipped_filter.composed_layout(dims, perm, weight.shape, 4) is not None
    reorder = FilterReorder("f", "o", tuple(dims), tuple(perm), want.shape)
    out: dict[str, np.ndarray] = {}
    flipped_filter.FlippedReorder("w", reorder, 4).compute({"w": weight}, out, 2)
    np.testing.assert_array_equal(out["o"].view(np.int32), want.view(np.int32))


class GroupedNet(nn.Module):
    """Grouped Convs of strides 1 (RegNet's and ResNeXt's 3 x 3, a 5 x 5 and a 1 x 3) of at
    least 8 channels a group, whose input gradients are Convs of grouped flipped filters."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.grouped = nn.Conv2d(32, 32, 3, padding=1, groups=4, bias=False)
        self.wide = nn.Conv2d(32, 48, 5, padding=2, groups=2)
        self.row = nn.Conv2d(48, 48, (1, 3), padding=(0, 1), groups=3)
        self.fc = nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.grouped(torch.relu(self.stem(x))))
        h = torch.relu(self.row(torch.relu(self.wide(h))))
        return self.fc(h.mean(dim=(2, 3)))


def test_grouped_flips_are_taken_and_copied_as_the_graph_does(tmp_path):
    model = onnx.load(_artifacts(tmp_path, GroupedNet, 6) / "training_model.onnx")
    found = flipped_filter.split_flipped_filters(model)
    groups = {k.weight: k.group for k, _ in found}
    assert groups == {"grouped.weight": 4, "wide.weight": 2, "row.weight": 3}
    rng = np.random.default_rng(0)
    for kernel, nodes in found:
        ops = sorted(model.graph.node[i].op_type for i in nodes)
        assert ops == ["Reshape", "Reshape", "Slice", "Transpose"]
        shape = next(
            [d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input
            if i.name == kernel.weight
        )
        weight = rng.standard_normal(shape).astype(np.float32)
        weight.flat[[0, 5]] = [np.nan, -np.inf]
        subgraph = [model.graph.node[i] for i in sorted(nodes)]
        (want,) = verify.run_subgraph(model, subgraph, {kernel.weight: weight}, [kernel.out])
        out: dict[str, np.ndarray] = {}
        kernel.compute({kernel.weight: weight}, out, 2)
        np.testing.assert_array_equal(out[kernel.out].view(np.int32), want.view(np.int32))
