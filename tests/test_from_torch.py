"""traingraph.from_torch: train-mode export with torch names, dynamic batch and its own check."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import traingraph
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import ModelError

EXPORTERS = ["dynamo", "torchscript"]


class BatchNormCNN(nn.Module):
    """Conv-BatchNorm-ReLU-Dropout-Linear on 3x8x8 images."""

    def __init__(self, dropout: float = 0.25) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(6 * 4 * 4, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.bn(self.conv(images))), 2)
        return self.fc(self.drop(h.flatten(1)))


class TinyEncoder(nn.Module):
    """Token and position embeddings (at a static sequence length), a LayerNorm, attention and
    a classification head."""

    def __init__(self, vocab: int = 40, seq: int = 12, width: int = 16) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        self.register_buffer("position_ids", torch.arange(seq).unsqueeze(0), persistent=False)
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, dropout=0.1, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(self.position_ids[:, : ids.shape[1]])
        h = self.norm(h)
        a, _ = self.attention(h, h, h, need_weights=False)
        return self.head(self.drop(h + a).mean(dim=1))


def _seeded(cls, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs)


def _nodes(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def _attribute(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_cnn_exports_in_train_mode_with_torch_names(exporter):
    net = _seeded(BatchNormCNN).eval()
    before = copy.deepcopy(net.state_dict())
    model = traingraph.from_torch(net, torch.randn(4, 3, 8, 8), exporter=exporter)

    initializers = {i.name: tuple(i.dims) for i in model.graph.initializer}
    expected = {n: tuple(p.shape) for n, p in net.named_parameters()}
    expected.update({f"bn.{s}": (6,) for s in ("running_mean", "running_var")})
    assert initializers == expected
    (bn,) = _nodes(model, "BatchNormalization")
    assert _attribute(bn, "training_mode") == 1
    assert list(bn.input[1:]) == ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    assert len(_nodes(model, "Dropout")) == 1
    # The caller's mode and buffers are as they were.
    assert not net.training and not any(m.training for m in net.modules())
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), name
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 8, 8]
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    onnx.checker.check_model(model, full_check=True)


def test_static_shapes_and_named_axes():
    net = _seeded(BatchNormCNN)
    static = traingraph.from_torch(net, torch.randn(4, 3, 8, 8), dynamic_axes=None,
                                   exporter="torchscript", input_names=["x"])  # fmt: skip
    assert [d.dim_value for d in static.graph.input[0].type.tensor_type.shape.dim] == [4, 3, 8, 8]
    named = traingraph.from_torch(
        net, torch.randn(4, 3, 8, 8), dynamic_axes={"x": {0: "n"}, "y": [0]},
        exporter="torchscript", input_names=["x"], output_names=["y"],
    )  # fmt: skip
    assert named.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "n"
    assert named.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "y_dim0"
    with pytest.raises(ModelError, match="not an input or output"):
        traingraph.from_torch(net, torch.randn(4, 3, 8, 8), dynamic_axes={"z": [0]})


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_cnn_trains_at_another_batch_size_and_updates_running_stats(exporter, tmp_path):
    net = _seeded(BatchNormCNN, dropout=0.0)
    reference = copy.deepcopy(net)
    model = traingraph.from_torch(net, torch.randn(2, 3, 8, 8), exporter=exporter)
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    assert sorted(n for n in state.parameters if state.parameters[n].requires_grad) == sorted(
        n for n, _ in net.named_parameters()
    )
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((7, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 5, 7).astype(np.int64)
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        expected = nn.functional.cross_entropy(reference(torch.tensor(x)), torch.tensor(y))
        expected.backward()
        torch_opt.step()
        np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-4)
    np.testing.assert_allclose(
        state.parameters["bn.running_mean"].data, reference.bn.running_mean.numpy(),
        rtol=1e-4, atol=1e-6,
    )  # fmt: skip
    assert not np.allclose(state.parameters["bn.running_var"].data, 1.0)


def test_generate_artifacts_takes_a_module(tmp_path):
    net = _seeded(TinyEncoder)
    program = artifacts.generate_artifacts(
        net,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=tmp_path,
        example_inputs=torch.randint(0, 40, (2, 12)),
    )
    trainable = {n for n, p in net.named_parameters()}
    assert set(program.trainable) == trainable
    assert (tmp_path / "training_model.onnx").is_file()
    with pytest.raises(ModelError, match="example_inputs"):
        artifacts.generate_artifacts(net, artifact_directory=tmp_path)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_position_embedding_stays_a_parameter(exporter):
    net = _seeded(TinyEncoder)
    model = traingraph.from_torch(net, torch.randint(0, 40, (2, 12)), exporter=exporter)
    initializers = {i.name: tuple(i.dims) for i in model.graph.initializer}
    for name, parameter in net.named_parameters():
        assert initializers[name] == tuple(parameter.shape), name
    float_initializers = {
        i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
    }
    assert float_initializers == {n for n, _ in net.named_parameters()}
