"""Models whose exports hold sequences of tensors (the dynamo exporter's ``split``)."""

from __future__ import annotations

import copy

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")

import traingraph  # noqa: E402
from gradcheck import adamw_artifacts, assert_trains_as_torch_adamw, train_steps  # noqa: E402
from traingraph.api import CheckpointState, Module, Optimizer  # noqa: E402
from traingraph.ir.model import load_ir  # noqa: E402


class SplitHeads(torch.nn.Module):
    """GPT-2's attention projection: one Linear split into three equal parts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 12)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.fc(x).split(4, dim=-1)
        return self.out(a * b + c)


def _export() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    module = SplitHeads()
    return module, traingraph.from_torch(module, torch.randn(2, 6), exporter="dynamo")


def test_sequence_outputs_keep_a_sequence_type_after_shape_inference() -> None:
    _, model = _export()
    m = load_ir(model)
    splits = [n for n in m.graph if n.op_type == "SplitToSequence"]
    assert splits, "the dynamo exporter no longer writes SplitToSequence for split"
    for node in splits:
        assert isinstance(node.outputs[0].type, ir.SequenceType)


def test_a_split_into_a_sequence_trains_as_torch(tmp_path) -> None:
    module, model = _export()
    reference = copy.deepcopy(module)
    directory = adamw_artifacts(tmp_path, model, lr=0.01)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    train = Module(directory / "training_model.onnx", state)
    optimizer = Optimizer(directory / "optimizer_model.onnx", train)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4).astype(np.int64))
        for _ in range(3)
    ]
    got = train_steps(train, optimizer, state, batches)
    assert_trains_as_torch_adamw(got, reference, batches, lr=0.01)
