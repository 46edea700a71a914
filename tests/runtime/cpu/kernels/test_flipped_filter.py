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
