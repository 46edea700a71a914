"""The graph API lowers training-mode BatchNormalization in every phase model it runs.

onnxruntime's CUDA kernel refuses ``BatchNormalization`` with ``training_mode=1`` from opset 14
on, so the forward, gradient and full models of a compiled :class:`traingraph.TrainingGraph`
hold only its inference form (with the batch statistics computed from ReduceMean). Training
must still match ``torch.nn`` step for step, phase by phase, and the memory plan must still work.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import traingraph as tg
from traingraph import layers as L
from traingraph.graph import init

STEPS = 3
BATCH = 16
LR = 0.1


def _trainer(seed: int = 0) -> tg.TrainingGraph:
    """A CNN with a BatchNorm2d after its conv and a BatchNorm1d after its hidden Linear."""
    init.manual_seed(seed)
    g = tg.Graph("bncnn")
    x = g.input("x", shape=[None, 1, 8, 8])
    h = L.Conv2d(1, 4, kernel_size=3, padding=1, name="conv")(x)
    h = L.MaxPool2d(2)(L.ReLU()(L.BatchNorm2d(4, name="bn2d")(h)))
    h = L.Flatten()(h)
    h = L.ReLU()(L.BatchNorm1d(8, momentum=0.2, name="bn1d")(L.Linear(64, 8, name="fc1")(h)))
    g.output("logits", L.Linear(8, 10, name="fc2")(h))
    train = tg.TrainingGraph([g], loss=tg.losses.CrossEntropyLoss(), optimizer=tg.optim.SGD(LR))
    train.add_inputs({"x": x}, loss_labels={"y": tg.TensorSpec([None], "int64")})
    return train.compile("cpu")


class _TorchCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.bn2d = torch.nn.BatchNorm2d(4)
        self.fc1 = torch.nn.Linear(64, 8)
        self.bn1d = torch.nn.BatchNorm1d(8, momentum=0.2)
        self.fc2 = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.bn2d(self.conv(x))), 2)
        return self.fc2(torch.relu(self.bn1d(self.fc1(h.flatten(1)))))


@pytest.fixture(scope="module")
def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((BATCH, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, BATCH))
        for _ in range(STEPS)
    ]


def _training_batch_norms(model: onnx.ModelProto) -> list[str]:
    return [
        node.name
        for node in model.graph.node
        if node.op_type == "BatchNormalization"
        and any(a.name == "training_mode" and a.i for a in node.attribute)
    ]


def test_no_phase_model_holds_a_training_mode_batch_norm() -> None:
    phases = _trainer()._program.phases
    for name, model in (
        ("forward", phases.forward),
        ("gradient", phases.gradient),
        ("full", phases.full),
    ):
        assert _training_batch_norms(model) == [], name
        onnx.checker.check_model(model, full_check=True)
    # The inference-mode BatchNormalizations that replace the two layers sit in the forward phase.
    ops = [node.op_type for node in phases.forward.graph.node]
    assert ops.count("BatchNormalization") == 2
    assert "BatchNormalization" not in [node.op_type for node in phases.gradient.graph.node]


def test_training_matches_torch(batches) -> None:
    train = _trainer()
    module = _TorchCNN().train()
    state = {n: torch.from_numpy(v.copy()) for n, v in train.get_parameters().items()}
    module.load_state_dict(state, strict=False)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    params = dict(module.named_parameters())
    for x, y in batches:
        loss = train.execute({"x": x}, loss_labels={"y": y}).loss
        opt.zero_grad()
        logits = module(torch.from_numpy(x))
        expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        expected.backward()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
        for name, p in params.items():
            # Conv and Linear biases right before a BatchNorm get a gradient that is zero up to
            # rounding; atol covers those.
            np.testing.assert_allclose(
                train.gradient_data(name), p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
            )
        opt.step()
    ours = train.get_parameters()
    # The BatchNorm layers update running_var with the unbiased batch variance, as torch does.
    expected_state = {n: v.numpy() for n, v in module.state_dict().items()}
    for name, value in ours.items():
        np.testing.assert_allclose(value, expected_state[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_phases_one_by_one_equal_execute(batches) -> None:
    whole, phased = _trainer(), _trainer()
    for x, y in batches:
        result = whole.execute({"x": x}, loss_labels={"y": y})
        forward = phased.execute_forward({"x": x}, loss_labels={"y": y})
        phased.execute_gradient()
        phased.execute_optimizer_update()
        np.testing.assert_array_equal(forward.loss, result.loss)
        np.testing.assert_array_equal(forward.outputs["logits"], result.outputs["logits"])
    expected = whole.get_parameters()
    for name, value in phased.get_parameters().items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_memory_plan_covers_the_lowered_forward(batches) -> None:
    train = _trainer()
    x, y = batches[0]
    train.execute({"x": x}, loss_labels={"y": y})
    plan = train.memory_plan(BATCH)
    assert train.device_memory_size == plan.total > 0
    assert plan.forward_peak > 0 and plan.saved > 0 and plan.gradient_peak > 0
    # A larger batch needs more bytes.
    assert train.memory_plan(2 * BATCH).total > plan.total
