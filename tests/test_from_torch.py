"""traingraph.from_torch: train-mode export with torch names, dynamic batch and its own check."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
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
    program = artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    assert sorted(program.trainable) == sorted(n for n, _ in net.named_parameters())
    assert not program.requires_grad["bn.running_mean"]
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
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


class MobileBlockCNN(nn.Module):
    """A MobileNetV3-like small CNN: Conv-BN-Hardswish stem, a depthwise Conv-BN block with
    squeeze-excitation, and a Dropout classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.Hardswish())  # fmt: skip
        self.depthwise = nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.ReLU(),
                                nn.Conv2d(4, 8, 1), nn.Hardsigmoid())  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(8, 16), nn.Hardswish(), nn.Dropout(0.2, inplace=True), nn.Linear(16, 4)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        h = nn.functional.relu(self.bn(self.depthwise(h)))
        h = h * self.se(h)
        return self.classifier(h.mean(dim=(2, 3)))


def _warnings_of(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_eval_mode_export_warns_naming_nodes(exporter, tmp_path):
    net = _seeded(MobileBlockCNN).eval()
    path = tmp_path / "eval.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(2, 3, 16, 16),), path, input_names=["images"],
                          output_names=["logits"], dynamo=exporter == "dynamo",
                          **({"dynamic_shapes": ({0: torch.export.Dim("batch")},)}
                             if exporter == "dynamo" else
                             {"dynamic_axes": {"images": {0: "batch"}, "logits": {0: "batch"}},
                              "opset_version": 17}))  # fmt: skip
    model = onnx.load(path)
    assert not _nodes(model, "BatchNormalization") and not _nodes(model, "Dropout")
    messages = _warnings_of(lambda: artifacts.generate_artifacts(
        str(path), loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path / "a"))
    joined = "\n".join(messages)
    assert "eval-mode export" in joined or "generated by the exporter" in joined, joined
    assert "from_torch" in joined
    generated = [i.name for i in model.graph.initializer if i.name.startswith(("onnx::", "val_"))]
    named = [n for n in generated if f"'{n}'" in joined]
    assert named or "batch_norm" in joined or "'bn'" in joined, joined


def test_inference_batchnorm_warns_and_from_torch_models_do_not(tmp_path):
    net = _seeded(BatchNormCNN).eval()
    path = tmp_path / "eval.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(2, 3, 8, 8),), path, dynamo=False, opset_version=17,
                          do_constant_folding=False,
                          training=torch.onnx.TrainingMode.PRESERVE)  # fmt: skip
    messages = _warnings_of(lambda: artifacts.generate_artifacts(
        str(path), loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "a"))
    assert any("inference mode" in m and "BatchNormalization" in m for m in messages), messages
    (bn,) = _nodes(onnx.load(path), "BatchNormalization")
    assert any(f"'{bn.name}'" in m for m in messages), messages

    model = traingraph.from_torch(net, torch.randn(4, 3, 8, 8))
    assert _warnings_of(lambda: artifacts.generate_artifacts(
        model, loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "b")) == []


def test_info_prints_the_warnings(tmp_path):
    from click.testing import CliRunner

    from traingraph.cli import cli

    net = _seeded(MobileBlockCNN).eval()
    path = tmp_path / "eval.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(2, 3, 16, 16),), path, dynamo=False,
                          opset_version=17)  # fmt: skip
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "from_torch" in result.output
    clean = tmp_path / "clean.onnx"
    traingraph.from_torch(_seeded(MobileBlockCNN), torch.randn(4, 3, 16, 16), path=clean)
    result = CliRunner().invoke(cli, ["info", str(clean)])
    assert result.exit_code == 0 and "warning:" not in result.output, result.output


class DataDependentBranch(nn.Module):
    """A branch on a tensor's value: the dynamo exporter refuses it, tracing takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def test_dynamo_failure_falls_back_to_torchscript_with_a_warning():
    x = torch.rand(2, 4)
    caught: list[onnx.ModelProto] = []
    messages = _warnings_of(lambda: caught.append(traingraph.from_torch(DataDependentBranch(), x)))
    assert any("dynamo exporter failed" in m and "TorchScript" in m.replace("torchscript",
               "TorchScript") for m in messages), messages  # fmt: skip
    assert {i.name for i in caught[0].graph.initializer} == {"fc.weight", "fc.bias"}
    with pytest.raises(ModelError, match="dynamo exporter failed"):
        traingraph.from_torch(DataDependentBranch(), x, exporter="dynamo")


class CountsCalls(nn.Module):
    """A forward that depends on how often it ran: no export can match it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * self.calls


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_forward_mismatch_is_an_error_naming_the_output(exporter):
    with pytest.raises(ModelError, match=r"differs .*output: max abs difference"):
        traingraph.from_torch(CountsCalls(), torch.randn(2, 4), exporter=exporter,
                              dynamic_axes=None)  # fmt: skip


def test_lost_parameter_is_an_error_naming_it(monkeypatch):
    from traingraph import torch_export

    lift = torch_export._constants_to_nodes
    # An exporter that folds fc2.weight into a constant, as optimizing exporters do.
    monkeypatch.setattr(torch_export, "_constants_to_nodes",
                        lambda graph, names: lift(graph, names - {"fc2.weight"}))  # fmt: skip
    net = nn.Sequential()
    net.add_module("fc1", nn.Linear(4, 8))
    net.add_module("fc2", nn.Linear(8, 2))
    with pytest.raises(ModelError, match=r"lost 1 of 4 trainable parameters \(fc2.weight\)"):
        traingraph.from_torch(net, torch.randn(2, 4))


@pytest.mark.slow
def test_mobilenet_v3_small_exported_as_the_readme_shows_learns(tmp_path):
    from zoo.torchvision_import import torchvision_models

    torch.manual_seed(0)
    net = torchvision_models().mobilenet_v3_small(num_classes=10)
    artifacts.generate_artifacts(
        traingraph.from_torch(net, torch.zeros(4, 3, 32, 32)),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-3),
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int64)
    losses = []
    for _ in range(12):
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_readme_snippet_runs(tmp_path):
    """The README's bring-your-own snippet as a new user copies it (slow: 8 epochs in a fresh
    interpreter; examples/bring_your_own_pytorch_model.py runs the same steps by default)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Bring your own PyTorch model") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet is not None, "the README's bring-your-own section has no python block"
    result = subprocess.run([sys.executable, "-c", snippet.group(1)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    accuracy = [float(a) for a in re.findall(r"val_accuracy (\d\.\d+)", result.stdout)]
    assert accuracy and accuracy[-1] > 0.9, result.stdout
    assert (tmp_path / "model_trained.onnx").is_file()


class TiedLM(nn.Module):
    """An output projection that shares the token embedding's weight."""

    def __init__(self, vocab: int = 30, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.embed(ids).mean(dim=1))))


def _assert_float64_gradients(state: CheckpointState, reference: nn.Module) -> None:
    """Each parameter's gradient in ``state`` is the one backward gave ``reference`` (float64)."""
    for name, param in reference.named_parameters():
        got = state.parameters[name].grad.reshape(param.shape)
        np.testing.assert_allclose(got, param.grad.numpy(), rtol=1e-4, atol=1e-7, err_msg=name)


def _mse_sgd_module(model: onnx.ModelProto, directory: Path) -> tuple[CheckpointState, Module]:
    """The checkpoint state and Module of ``model``'s artifacts (MSE loss, SGD at 0.5)."""
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.MSELoss, optimizer=optim.SGD(lr=0.5),
        artifact_directory=directory,
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    return state, Module(directory / "training_model.onnx", state)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_tied_parameter_is_one_initializer_that_trains_as_in_torch(exporter, tmp_path):
    net = _seeded(TiedLM)
    reference = copy.deepcopy(net)
    model = traingraph.from_torch(net, torch.randint(0, 30, (4, 6)), exporter=exporter)
    assert sorted(i.name for i in model.graph.initializer) == sorted(
        ["embed.weight", "mix.weight", "mix.bias"]
    )
    state, module = _mse_sgd_module(model, tmp_path)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(0, 30, (5, 6)).astype(np.int64)
        target = rng.standard_normal((5, 30)).astype(np.float32)
        loss = module(ids, target)
        opt.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        expected = nn.functional.mse_loss(reference(torch.tensor(ids)), torch.tensor(target))
        expected.backward()
        torch_opt.step()
        np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    np.testing.assert_allclose(
        state.parameters["embed.weight"].data, reference.embed.weight.detach().numpy(), atol=1e-6
    )


class PaddedTiedLM(nn.Module):
    """An embedding with a padding row whose weight the output layer shares."""

    def __init__(self, scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8, padding_idx=0, scale_grad_by_freq=scale_grad_by_freq)
        with torch.no_grad():
            self.embed.weight[0] = 0.5  # a padding row need not be zeros
        self.mix = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(ids).mean(dim=1)))
        return hidden @ self.embed.weight.t()


@pytest.mark.parametrize(
    ("exporter", "scale_grad_by_freq"),
    [*((e, False) for e in EXPORTERS), ("dynamo", True)],  # TorchScript refuses the scaling
)
def test_embedding_padding_row_gets_no_gradient_from_its_lookups(
    exporter, scale_grad_by_freq, tmp_path
):
    """torch gives the padding row of a lookup no gradient and, with scale_grad_by_freq, divides
    each lookup's gradient by its row's count in the batch (the export's Gather says neither);
    the tied output layer's use of the same rows is unscaled. Against float64 torch."""
    net = _seeded(PaddedTiedLM, scale_grad_by_freq=scale_grad_by_freq)
    ids = torch.tensor([[1, 2, 0, 0, 0, 2], [3, 4, 5, 6, 7, 0], [0, 8, 2, 0, 10, 11]])
    model = traingraph.from_torch(copy.deepcopy(net), ids, exporter=exporter)
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.random.default_rng(0).standard_normal((3, 30)).astype(np.float32)
    module(ids.numpy(), target)
    reference = copy.deepcopy(net).double()
    nn.functional.mse_loss(reference(ids), torch.tensor(target, dtype=torch.float64)).backward()
    _assert_float64_gradients(state, reference)
    lookups_only = copy.deepcopy(net).double()
    lookups_only.embed(ids).sum().backward()
    assert not lookups_only.embed.weight.grad[0].any()  # what the test relies on torch doing
    assert reference.embed.weight.grad[0].abs().sum() > 0  # the output layer's share


class Bags(nn.Module):
    """An ``nn.EmbeddingBag`` over a flat input with offsets (and per-sample weights)."""

    def __init__(self, **bag) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, **bag)
        self.fc = nn.Linear(8, 5)

    def forward(self, ids, offsets, weights=None):
        return self.fc(self.bag(ids, offsets, weights))

    def by_lookups(self, ids, offsets):
        """The sum mode's forward through ``F.embedding`` over every lookup at once, then a sum
        per bag: torch's documented gradient scaling by frequency (its CPU embedding_bag kernel
        scales rows looked up once by another row's count)."""
        rows = nn.functional.embedding(
            ids, self.bag.weight, self.bag.padding_idx, scale_grad_by_freq=True
        )
        members = ids != (-1 if self.bag.padding_idx is None else self.bag.padding_idx)
        ends = [*offsets[1:].tolist(), len(ids)]
        bags = [rows[s:e][members[s:e]].sum(0) for s, e in zip(offsets.tolist(), ends)]
        return self.fc(torch.stack(bags))


_BAG_IDS = torch.tensor([4, 0, 4, 7, 0, 0, 9, 2, 2, 2, 11, 0, 5])
"""Lookups with padding (0) and repeated rows; the offsets below make an empty bag, a bag of
padding only and bags that repeat a row."""


@pytest.mark.parametrize(
    ("exporter", "bag", "offsets", "weighted"),
    [
        ("dynamo", {"mode": "mean"}, [0, 3, 3, 6, 10], False),
        ("torchscript", {"mode": "mean", "padding_idx": 0}, [0, 3, 3, 4, 6, 10], False),
        ("dynamo", {"mode": "max", "padding_idx": 0}, [0, 3, 3, 4, 6, 10], False),
        ("torchscript", {"mode": "max"}, [0, 3, 3, 6, 10], False),
        ("dynamo", {"mode": "sum", "include_last_offset": True}, [0, 3, 3, 6, 10, 13], True),
        ("dynamo", {"mode": "sum", "scale_grad_by_freq": True, "padding_idx": 0},
         [0, 3, 3, 6, 10], False),
    ],
)  # fmt: skip
def test_embedding_bag_trains_as_in_torch(exporter, bag, offsets, weighted, tmp_path):
    """Both exporters write an EmbeddingBag as a Loop, which nothing differentiates: it exports
    as lookups and reductions with torch's values (padding counted in no bag, empty bags zero,
    per-sample weights, the last offset included) and gradients, against float64 torch."""
    net = _seeded(Bags, **bag)
    inputs = [_BAG_IDS, torch.tensor(offsets)]
    if weighted:
        inputs.append(torch.linspace(-1.0, 2.0, len(_BAG_IDS)))
    model = traingraph.from_torch(copy.deepcopy(net), tuple(inputs), exporter=exporter)
    assert not [n.op_type for n in model.graph.node if n.op_type == "Loop"]
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.random.default_rng(0).standard_normal((len(offsets) - weighted, 5))
    loss = module(*(t.numpy() for t in inputs), target.astype(np.float32))
    reference = copy.deepcopy(net).double()
    doubled = [t.double() if t.is_floating_point() else t for t in inputs]
    forward = reference.by_lookups if bag.get("scale_grad_by_freq") else reference
    expected = nn.functional.mse_loss(forward(*doubled), torch.tensor(target))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    _assert_float64_gradients(state, reference)


def test_embedding_bag_with_max_norm_is_an_error_naming_the_fix():
    with pytest.raises(ModelError, match="set max_norm=None"):
        traingraph.from_torch(Bags(max_norm=1.0), (_BAG_IDS, torch.tensor([0, 3])))


def test_batch_axes_of_another_size_get_their_own_names():
    model = traingraph.from_torch(Bags(), (_BAG_IDS, torch.tensor([0, 3, 3, 6])))
    dims = {
        v.name: v.type.tensor_type.shape.dim[0].dim_param
        for v in [*model.graph.input, *model.graph.output]
    }
    assert dims == {"ids": "batch", "offsets": "offsets_dim0", "output": "output_dim0"}


class Reparameterized(nn.Module):
    """A VAE's encoder and decoder: ``z = mu + exp(logvar / 2) * randn_like(mu)``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.dec = nn.Linear(3, 6)

    def forward(self, x, noise=None):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        noise = torch.randn_like(mu) if noise is None else noise
        return self.dec(mu + torch.exp(0.5 * logvar) * noise)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_forward_that_draws_random_numbers_exports_and_trains(exporter, tmp_path):
    """The check compares the exported forward with the module's with every draw at its
    distribution's mean; the training graph draws fresh noise at each step, and its gradients
    for given noise (fed where the draw was) are torch's in float64."""
    net = _seeded(Reparameterized)
    x = torch.randn(5, 6)
    model = traingraph.from_torch(copy.deepcopy(net), x, exporter=exporter)
    draws = [n for n in model.graph.node if n.op_type == "RandomNormalLike"]
    assert len(draws) == 1
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    assert float(module(x.numpy(), target)) != float(module(x.numpy(), target))

    training = onnx.load(tmp_path / "training_model.onnx")
    (draw,) = [n for n in training.graph.node if n.op_type == "RandomNormalLike"]
    training.graph.node.remove(draw)
    training.graph.input.append(
        onnx.helper.make_tensor_value_info(draw.output[0], onnx.TensorProto.FLOAT, [None, 3])
    )
    onnx.save(training, tmp_path / "fed.onnx")
    fed = Module(tmp_path / "fed.onnx", state)
    noise = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    feeds = {"x": x.numpy(), "labels": target, draw.output[0]: noise}
    fed.lazy_reset_grad()
    loss = fed(*(feeds[name] for name in fed.input_names()))
    reference = copy.deepcopy(net).double()
    out = reference(x.double(), torch.tensor(noise, dtype=torch.float64))
    expected = nn.functional.mse_loss(out, torch.tensor(target, dtype=torch.float64))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    _assert_float64_gradients(state, reference)


def test_batch_norm_without_running_statistics_trains_without_warnings(tmp_path):
    """The dynamo exporter writes BatchNorm2d(track_running_stats=False) as an inference-mode
    BatchNormalization over a batch mean and variance it computes itself: no eval-mode export
    warning, no native kernel dropped with one, and torch's float64 gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    x = torch.randn(4, 3, 16, 16)
    model = traingraph.from_torch(copy.deepcopy(net), x, exporter="dynamo")
    target = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, module = _mse_sgd_module(model, tmp_path)
        module(x.numpy(), target)
    reference = copy.deepcopy(net).double()
    nn.functional.mse_loss(reference(x.double()), torch.tensor(target).double()).backward()
    _assert_float64_gradients(state, reference)


class StandardizedConv(nn.Conv2d):
    """A Conv whose filters are standardized per output channel before each use, as BiT's
    ``StdConv2d`` does (``F.batch_norm`` over the filters without running statistics), or
    with a trained gain as the BatchNorm's scale, as NFNets' ``ScaledStdConv2d``."""

    def __init__(self, *args: object, gain: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gain = nn.Parameter(torch.rand(self.out_channels) + 0.5) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.weight.reshape(1, self.out_channels, -1)
        scale = None if self.gain is None else self.gain * 0.5
        weight = nn.functional.batch_norm(flat, None, None, scale, training=True, eps=1e-5)
        return self._conv_forward(x, weight.reshape_as(self.weight), self.bias)


def test_batch_statistics_written_out_are_a_training_batch_norm_in_the_train_graph(tmp_path):
    """A BatchNormalization whose mean and variance the exporter computes from its own input
    (standardized filters; BatchNorm2d(track_running_stats=False)) is a training-mode one in
    the training graph: the native BatchNorm kernels take it (its gradient too where the
    bias is constant and the scale computed), the gradients are torch's in float64, and the
    eval graph still normalizes with the batch's statistics."""
    from traingraph.runtime.cpu.kernels.batch_norm import BatchNormGrad
    from traingraph.runtime.cpu.kernels.bn_forward import BatchNormForward

    torch.manual_seed(0)
    net = nn.Sequential(
        StandardizedConv(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(),
        StandardizedConv(8, 6, 1, gain=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(6, 4),
    )  # fmt: skip
    x = torch.randn(4, 3, 12, 12)
    model = traingraph.from_torch(copy.deepcopy(net), x, exporter="dynamo")
    state, module = _mse_sgd_module(model, tmp_path)
    train = onnx.load(tmp_path / "training_model.onnx")
    norms = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    exported = {v for n in norms for v in n.input[3:]}
    assert len(exported) == 6  # the exporter's means and variances: none left in training
    assert not exported & {v for n in train.graph.node for v in [*n.input, *n.output]}
    kernels = module.step.runner._plan.all_kernels
    assert sum(isinstance(k, BatchNormForward) for k in kernels) == 3
    # the filters' gradients too: without a bias gradient, and with a computed scale's
    grads = [k for k in kernels if isinstance(k, BatchNormGrad)]
    assert len(grads) == 3 and sum(k.dbias is None for k in grads) == 2
    assert sum(k.dscale is not None for k in grads) == 2
    target = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    module(x.numpy(), target)
    reference = copy.deepcopy(net).double()
    nn.functional.mse_loss(reference(x.double()), torch.tensor(target).double()).backward()
    _assert_float64_gradients(state, reference)
    module = Module(
        tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx"
    ).eval()
    eval_loss = module(x.numpy(), target)
    with torch.no_grad():
        expected = nn.functional.mse_loss(net.eval()(x), torch.tensor(target))
    np.testing.assert_allclose(float(eval_loss), expected.item(), rtol=1e-5)


class DropPath(nn.Module):
    """timm's stochastic depth: each sample's branch kept with probability ``1 - drop_prob``
    (scaled by its inverse where ``scale_by_keep``), the identity in eval mode."""

    def __init__(self, drop_prob: float, scale_by_keep: bool = True) -> None:
        super().__init__()
        self.drop_prob, self.scale_by_keep = drop_prob, scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * (mask / keep if self.scale_by_keep else mask)


class StochasticDepth(nn.Module):
    """torchvision's stochastic depth (``torchvision.ops.StochasticDepth``), ``mode="row"``."""

    def __init__(self, p: float, mode: str = "row") -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype).bernoulli_(1 - self.p)
        return x * noise.div_(1 - self.p)


class ResidualDropPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.paths = nn.ModuleList([DropPath(0.3), DropPath(0.2, False), StochasticDepth(0.4)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.paths[0](torch.relu(self.a(x)))
        x = x + self.paths[1](torch.relu(self.b(x)))
        return self.head(x + self.paths[2](x))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_stochastic_depth_is_a_dropout_that_the_eval_graph_drops(exporter, tmp_path):
    """timm's DropPath and torchvision's StochasticDepth draw their masks with bernoulli_,
    random ops that an eval graph would keep; exported as a Dropout of ones they are the
    identity in the eval graph and the inference model, as in torch's eval mode, and the
    modules keep their own forwards."""
    torch.manual_seed(0)
    net = ResidualDropPaths()
    x = torch.randn(6, 8)
    model = traingraph.from_torch(net, x, exporter=exporter)
    ops = {n.op_type for n in model.graph.node}
    assert "Dropout" in ops and not ops & {"Bernoulli", "RandomUniformLike", "RandomUniform"}
    assert all("forward" not in vars(m) for m in net.modules())
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.MSELoss, optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path, additional_output_names=["output"],
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    target = np.zeros((6, 3), np.float32)
    losses_seen = {float(module(x.numpy(), target)[0]) for _ in range(4)}
    assert len(losses_seen) > 1  # the masks are drawn anew each step
    _, output = module.eval()(x.numpy(), target)
    with torch.no_grad():
        expected = net.eval()(x).numpy()
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    session = ort.InferenceSession(str(tmp_path / "inference.onnx"))
    (got,) = session.run(["output"], {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class TrainOnlyMask(nn.Module):
    """A residual branch dropped per sample in train mode by a mask drawn in the forward (no
    stochastic depth module the export knows), the identity in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.branch, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.branch(x))
        if self.training:
            h = h * x.new_empty((x.shape[0], 1)).bernoulli_(0.7) / 0.7
        return self.head(x + h)


def test_an_eval_graph_unlike_the_modules_eval_mode_is_reported():
    """The eval graph keeps random ops that the forward draws only in train mode: from_torch
    warns that it differs from the module's eval mode, and names the way out."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"eval graph of the exported TrainOnlyMask differs"):
        traingraph.from_torch(TrainOnlyMask(), torch.randn(8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stochastic depth modules: no warning
        traingraph.from_torch(ResidualDropPaths(), torch.randn(8, 8))


def test_compiled_and_data_parallel_modules_export_the_module_they_wrap():
    """torch.compile's OptimizedModule and nn.DataParallel take ``*args`` (no dynamic shapes
    for the exporters) and prefix the parameter names: the module inside is exported."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(4, 8)
    for wrapped in (torch.compile(net), nn.DataParallel(net)):
        model = traingraph.from_torch(wrapped, x)
        assert sorted(i.name for i in model.graph.initializer) == sorted(
            n for n, _ in net.named_parameters()
        )


class OptionalInputs(nn.Module):
    """A forward with an optional parameter between two inputs, as Hugging Face models have."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, input_ids, past=None, attention_mask=None, token_type_ids=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.fc(h.sum(1))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_inputs_by_keyword_follow_the_forward_parameters(exporter, tmp_path):
    """A dict of inputs (a tokenizer's output) is passed by keyword: the graph inputs are its
    tensors in the forward's order, a parameter between them that it does not name keeps its
    default, and the model trains as torch does."""
    net = _seeded(OptionalInputs)
    ids = torch.randint(0, 30, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    inputs = {"attention_mask": mask, "input_ids": ids, "token_type_ids": None}
    model = traingraph.from_torch(copy.deepcopy(net), inputs, exporter=exporter)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    loss = module(ids.numpy(), mask.numpy(), target)
    reference = copy.deepcopy(net).double()
    expected = nn.functional.mse_loss(
        reference(ids, attention_mask=mask.double()), torch.tensor(target).double()
    )
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    _assert_float64_gradients(state, reference)


def test_inputs_by_keyword_name_what_the_forward_does_not_take():
    with pytest.raises(ModelError, match=r"\['labels'\] are no parameter") as info:
        traingraph.from_torch(
            OptionalInputs(), {"input_ids": torch.zeros(2, 3, dtype=torch.int64),
                               "labels": torch.zeros(2)},
        )  # fmt: skip
    assert "input_ids, past, attention_mask, token_type_ids" in str(info.value)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_models_past_protobufs_limit_go_through_files(exporter, monkeypatch, tmp_path):
    """Past 2 GiB of tensors protobuf cannot serialize a model: the TorchScript exporter then
    writes a file with external data, and the check's session reads one. Both paths, on a
    small model with the threshold at one byte, give what the in-memory paths give."""
    import traingraph.ir.model as ir_model
    from traingraph import torch_export

    net = _seeded(TiedLM)
    ids = torch.randint(0, 30, (4, 6))
    expected = traingraph.from_torch(copy.deepcopy(net), ids, exporter=exporter)
    monkeypatch.setattr(ir_model, "EXTERNAL_DATA_THRESHOLD", 1)
    monkeypatch.setattr(torch_export, "EXTERNAL_DATA_THRESHOLD", 1)
    got = traingraph.from_torch(copy.deepcopy(net), ids, exporter=exporter)
    for a, b in zip(expected.graph.initializer, got.graph.initializer):
        assert a.name == b.name
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    assert [n.op_type for n in expected.graph.node] == [n.op_type for n in got.graph.node]


def test_a_forward_that_fails_on_the_example_inputs_is_an_error_naming_them():
    with pytest.raises(ModelError, match=r"Linear's forward fails on the example inputs "
                       r"\[\(\(3, 5\), 'torch.float32'\)\]: RuntimeError: mat1 and mat2"):
        traingraph.from_torch(nn.Linear(4, 2), torch.randn(3, 5))


class Aggregation(nn.Module):
    """Graph-network message passing: messages along edges, reduced at their target nodes by
    ``scatter_reduce`` (or ``index_reduce``), as pure-torch GraphSAGE / GIN code writes it."""

    SOURCES = torch.tensor([0, 1, 2, 3, 0, 2, 1, 3, 3, 4])
    TARGETS = torch.tensor([1, 0, 3, 2, 2, 0, 3, 1, 0, 1])  # node 4 receives nothing

    def __init__(self, reduce: str, include_self: bool, by_index: bool = False) -> None:
        super().__init__()
        self.message = nn.Linear(3, 3)
        self.reduce, self.include_self, self.by_index = reduce, include_self, by_index

    def forward(self, nodes):  # (batch, 5 nodes, 3 features)
        h = self.message(nodes)
        messages = h[:, self.SOURCES]
        if self.by_index:
            return h.index_reduce(
                1, self.TARGETS, messages, self.reduce, include_self=self.include_self
            )
        index = self.TARGETS.view(1, -1, 1).expand_as(messages)
        return h.scatter_reduce(1, index, messages, self.reduce, include_self=self.include_self)


@pytest.mark.parametrize(
    ("reduce", "include_self", "by_index"),
    [("mean", True, False), ("mean", False, False), ("amax", False, False),
     ("amin", True, False), ("mean", False, True), ("amax", True, True)],
)  # fmt: skip
def test_scatter_and_index_reductions_train_as_in_torch(reduce, include_self, by_index, tmp_path):
    """The dynamo exporter writes a ``"mean"`` scatter_reduce as another reduction (the check
    saw it) and no exporter converts ``index_reduce``: both export as sums over counts or as
    ``ScatterElements`` max / min, whose gradients share ties as torch does; against float64
    torch."""
    net = _seeded(Aggregation, reduce=reduce, include_self=include_self, by_index=by_index)
    nodes = torch.randn(2, 5, 3)
    model = traingraph.from_torch(copy.deepcopy(net), nodes, exporter="dynamo")
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.random.default_rng(0).standard_normal((2, 5, 3)).astype(np.float32)
    loss = module(nodes.numpy(), target)
    reference = copy.deepcopy(net).double()
    expected = nn.functional.mse_loss(reference(nodes.double()), torch.tensor(target).double())
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    _assert_float64_gradients(state, reference)


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        _, (h, _) = self.rnn(packed)
        return h[-1]


def test_packed_sequences_are_an_error_naming_what_to_do_instead():
    with pytest.raises(ModelError, match=r"no exporter produced.*pack_padded_sequence.*padded"):
        traingraph.from_torch(PackedLSTM(), (torch.randn(3, 5, 4), torch.tensor([5, 3, 2])))


def test_the_checks_tolerance_is_the_callers():
    """The check allows float32 rounding (the defaults); rtol= / atol= set what it allows, and
    a refusal says so."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    traingraph.from_torch(net, x, exporter="dynamo")
    with pytest.raises(ModelError, match=r"allowed: 0 \+ 0 \* largest.*pass larger rtol= / atol="):
        traingraph.from_torch(net, x, exporter="dynamo", rtol=0.0, atol=0.0)


class InlineStochasticDepth(nn.Module):
    """A residual branch dropped per sample, as torchvision's ``stochastic_depth`` draws it
    (``empty().bernoulli_(survival).div_(survival)``: ConvNeXt, Swin and EfficientNet have it
    on by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        survival = 0.8
        noise = torch.empty([x.shape[0], 1], dtype=x.dtype).bernoulli_(survival)
        return self.head(x + torch.relu(self.branch(x)) * noise.div_(survival))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_stochastic_depth_exports_and_drops_samples_at_random(exporter, tmp_path):
    """The exporters write ``bernoulli_(p)`` as ``RandomUniformLike(x) < p``: the check draws
    uniform values at their low end and Bernoulli ones at 1 on both sides, so the export's
    forward keeps every branch where the module's does; training drops them at random."""
    net = _seeded(InlineStochasticDepth)
    x = torch.randn(64, 6)
    model = traingraph.from_torch(copy.deepcopy(net), x, exporter=exporter)
    state, module = _mse_sgd_module(model, tmp_path)
    target = np.zeros((64, 3), np.float32)
    losses = {round(float(module(x.numpy(), target)), 6) for _ in range(6)}
    assert len(losses) > 1


class LossInside(nn.Module):
    """A model that returns its loss: CLIP's contrastive loss over in-batch negatives, or a
    cross-entropy with label smoothing (class weights, an ignored label)."""

    def __init__(self, kind: str, reduction: str = "mean") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12))
        self.kind, self.reduction = kind, reduction

    def forward(self, x, labels):
        out = self.net(x)
        if self.kind == "contrastive":
            image, text = nn.functional.normalize(out[:, :6]), nn.functional.normalize(out[:, 6:])
            logits = image @ text.t() * 14.0
            return nn.functional.cross_entropy(logits, torch.arange(x.shape[0]))
        weight = torch.linspace(0.5, 2.0, 12, dtype=out.dtype)
        return nn.functional.cross_entropy(
            out, labels, weight=weight, ignore_index=3, reduction=self.reduction,
            label_smoothing=0.1,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "reduction", "exporter"),
    [("contrastive", "mean", "dynamo"), ("contrastive", "mean", "torchscript"),
     ("smoothing", "mean", "dynamo"), ("smoothing", "sum", "dynamo"),
     ("smoothing", "mean", "torchscript")],
)  # fmt: skip
def test_losses_inside_the_model_train_as_in_torch(kind, reduction, exporter, tmp_path):
    """A contrastive loss mixes the samples, so the batch repeated twice is not the loss
    repeated: the check asks the module for the repeated batch's. Label smoothing, which the
    dynamo exporter drops and the TorchScript exporter refuses, exports as torch computes it.
    The model's output is the loss (``loss=None``); against float64 torch."""
    net = _seeded(LossInside, kind=kind, reduction=reduction)
    x, labels = torch.randn(6, 8), torch.tensor([1, 3, 11, 0, 3, 7])
    model = traingraph.from_torch(copy.deepcopy(net), (x, labels), exporter=exporter)
    artifacts.generate_artifacts(
        model, loss=None, optimizer=optim.SGD(lr=0.5), artifact_directory=tmp_path
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    feeds = {"x": x.numpy(), "labels": labels.numpy()}  # TorchScript drops an unread input
    loss = module(*(feeds[name] for name in module.input_names()))
    reference = copy.deepcopy(net).double()
    expected = reference(x.double(), labels)
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    _assert_float64_gradients(state, reference)


def test_running_statistics_the_export_drops_are_an_error_naming_them():
    """torch.export drops the running-statistics update of a training InstanceNorm (and the
    TorchScript exporter refuses it with a dynamic batch): the trained model's eval mode would
    read the first values, so from_torch refuses it, and leaves the module's buffers as they
    were."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10),
    )  # fmt: skip
    updated = r"buffers that the train-mode forward updates \(1\.running_mean, 1\.running_var\)"
    with pytest.raises(ModelError, match=updated):
        traingraph.from_torch(net, torch.randn(4, 3, 8, 8))
    assert not net[1].running_mean.any() and net[1].running_var.eq(1).all()


class ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        return self.fc(x), object()


def test_non_tensor_outputs_are_an_error_naming_their_type():
    with pytest.raises(ModelError, match="returns object beside its tensors"):
        traingraph.from_torch(ReturnsAnObject(), torch.randn(2, 4))


def _conv_model(nodes, initializers, producer="pytorch"):
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "conv.weight"], ["c"], name="/conv/Conv"), *nodes],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "conv.weight")]
        + [numpy_helper.from_array(np.ones(1, np.float32), n) for n in initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.producer_name = producer
    return model


def test_export_checks_name_what_they_find_and_nothing_else():
    from onnx import helper

    from traingraph.ir.export_checks import export_warnings

    folded = _conv_model([helper.make_node("Add", ["c", "onnx::Add_7"], ["y"], name="/bn1/Add")],
                         ["onnx::Add_7"])  # fmt: skip
    (lost, generated) = export_warnings(folded)
    assert "'bn1'" in lost and "'onnx::Add_7'" in generated
    # Another producer's names, a LayerNorm model's "norm" and explicit requires_grad say nothing.
    assert export_warnings(folded, requires_grad=["conv.weight"])[1:] == []
    other = _conv_model([helper.make_node("Add", ["c", "bn1_bias"], ["y"], name="bn1")],
                        ["bn1_bias"], producer="traingraph")  # fmt: skip
    assert export_warnings(other) == []
    layer_norm = _conv_model(
        [helper.make_node("LayerNormalization", ["c", "norm.weight"], ["y"], name="/norm/LN")],
        ["norm.weight"],
    )
    assert export_warnings(layer_norm) == []
    batch_norm = [
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.mean", "bn.var"],
                         ["y", "m", "v"], name="/bn/BN", training_mode=mode)
        for mode in (0, 1)
    ]  # fmt: skip
    stats = ["bn.weight", "bn.bias", "bn.mean", "bn.var"]
    (inference,) = export_warnings(_conv_model([batch_norm[0]], stats))
    assert "'/bn/BN'" in inference and "training_mode=0" in inference
    assert export_warnings(_conv_model([batch_norm[1]], stats)) == []


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_dropout_of_zero_raises_no_eval_mode_warning(tmp_path, exporter):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Dropout(p=0.0), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)
    )
    model = traingraph.from_torch(net, torch.randn(2, 3, 6, 6), exporter=exporter)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        artifacts.generate_artifacts(
            model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path
        )


class NextTokenLM(nn.Module):
    """Next-token logits ``(N, V, T - 1)`` of a one-layer model, as a causal LM's loss reads
    them (``logits[:, :-1].transpose(1, 2)``)."""

    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))[:, :-1].transpose(1, 2)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_next_token_logits_train_without_scattering_or_dead_copies(exporter, tmp_path):
    """``logits[:, :-1]`` exports as a Slice of the whole batch axis and one of the sequence:
    the first is an Identity, the second is taken before the head (the rows, not the logits)
    and its gradient is one Pad (not a scatter through an int64 index of every logit), and no
    node computes what nothing reads (the model's Transpose, which the loss reads through).
    The gradients are torch's in float64."""
    net = _seeded(NextTokenLM)
    reference = copy.deepcopy(net).double()
    model = traingraph.from_torch(
        net, torch.randint(0, 50, (4, 6)), exporter=exporter, input_names=["ids"]
    )
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )  # fmt: skip
    train = onnx.load(tmp_path / "training_model.onnx")
    assert [n.name for n in train.graph.node if n.op_type == "Range"] == []
    pads = [n for n in train.graph.node if n.op_type == "Pad" and n.name.startswith("grad/")]
    assert len(pads) == 1
    scatters = [  # the loss's and the embedding's gradients add rows; a Slice's would not
        n.name for n in train.graph.node
        if n.op_type == "ScatterElements" and _attribute(n, "reduction", b"none") != b"add"
    ]  # fmt: skip
    assert scatters == []
    # the loss's gradient adds the label's term into exp(y) * -u: no zeros of the logits' size
    assert not [n for n in train.graph.node if n.op_type == "ConstantOfShape" and "loss" in n.name]
    # the sequence is cut before the head's product, not from the logits
    (cut,) = [n for n in train.graph.node if n.op_type == "Slice" and "grad/" not in n.name]
    producers = {o: n.op_type for n in train.graph.node for o in n.output}
    assert producers[cut.input[0]] == "Tanh"
    read = {i for n in train.graph.node for i in n.input} | {o.name for o in train.graph.output}
    assert [n.name for n in train.graph.node if not set(n.output) & read] == []

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    ids = np.random.default_rng(0).integers(0, 50, (5, 6)).astype(np.int64)
    loss = module(ids, ids[:, 1:].copy())
    expected = nn.functional.cross_entropy(reference(torch.tensor(ids)), torch.tensor(ids[:, 1:]))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(
            state.parameters[name].grad, param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )
