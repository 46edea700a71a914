"""generate_artifacts: what it writes and what the files hold."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from gradcheck import assert_default_domain_only
from torch_models import MLP, SmallCNN, classification_data, export, seeded
from traingraph import artifacts, losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import ModelError
from traingraph.ir import model as ir_model
from traingraph.ir.model import max_ir_version, max_supported_opset


def _dims(value_info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("opt", list(artifacts.OptimType))
def test_files_are_standard_onnx_with_dynamic_batch(tmp_path, opt):
    model = export(seeded(SmallCNN), torch.zeros(2, 1, 8, 8), training=True)
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=opt,
        artifact_directory=tmp_path,
        prefix="cnn_",
        nominal_checkpoint=True,
    )
    for name in ("training_model", "eval_model", "optimizer_model"):
        m = onnx.load(tmp_path / f"cnn_{name}.onnx")
        onnx.checker.check_model(m, full_check=True)
        assert_default_domain_only(m)
        assert m.ir_version <= max_ir_version()
        assert all(o.version <= max_supported_opset() for o in m.opset_import if o.domain == "")
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for name in ("training_model", "eval_model"):
        m = onnx.load(tmp_path / f"cnn_{name}.onnx")
        x = next(i for i in m.graph.input if i.name == "x")
        assert isinstance(_dims(x)[0], str), "the batch dimension must be symbolic"
    assert (tmp_path / "cnn_checkpoint").is_file()
    assert (tmp_path / "cnn_nominal_checkpoint").is_file()


def test_eval_model_runs_dropout_and_batchnorm_in_inference_mode(tmp_path):
    model = export(seeded(SmallCNN, dropout=0.5), torch.zeros(2, 1, 8, 8), training=True)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path
    )
    ev = onnx.load(tmp_path / "eval_model.onnx")
    for node in ev.graph.node:
        if node.op_type == "BatchNormalization":
            assert len(node.output) == 1
            assert all(a.i == 0 for a in node.attribute if a.name == "training_mode")
        if node.op_type == "Dropout":
            assert len(node.input) < 3 or not node.input[2]  # no training_mode input
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx").eval()
    x = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = np.arange(4, dtype=np.int64)
    np.testing.assert_array_equal(module(x, y), module(x, y))


def test_frozen_params_and_additional_outputs(tmp_path):
    model = export(seeded(MLP), torch.zeros(2, 20))
    program = artifacts.generate_artifacts(
        model,
        requires_grad=["fc2.weight", "fc2.bias"],
        frozen_params=["fc1.weight", "fc1.bias"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.SGD,
        artifact_directory=tmp_path,
        additional_output_names=["logits"],
    )
    assert program.trainable == ["fc2.weight", "fc2.bias"]
    train = onnx.load(tmp_path / "training_model.onnx")
    outputs = [o.name for o in train.graph.output]
    assert outputs[:2] == ["loss", "logits"]
    assert "fc1.weight_grad" not in outputs and "fc2.weight_grad" in outputs
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    assert not state.parameters["fc1.weight"].requires_grad
    module = Module(tmp_path / "training_model.onnx", state)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    before = state.parameters["fc1.weight"].data
    x, y = classification_data(8, 20, 5)
    loss, logits = module(x, y)
    assert logits.shape == (8, 5) and np.ndim(loss) == 0
    opt.step()
    np.testing.assert_array_equal(state.parameters["fc1.weight"].data, before)
    assert state.parameters["fc1.weight"].grad is None


def test_custom_loss_over_two_outputs(tmp_path):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 8)
            self.cls = torch.nn.Linear(8, 3)
            self.reg = torch.nn.Linear(8, 1)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.cls(h), self.reg(h)

    torch.manual_seed(0)
    net = TwoHeads()
    import io

    buffer = io.BytesIO()
    torch.onnx.export(
        net,
        (torch.zeros(2, 6),),
        buffer,
        input_names=["x"],
        output_names=["logits", "value"],
        dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}, "value": {0: "n"}},
        dynamo=False,
    )
    ce, mse = losses.CrossEntropyLoss(), losses.MSELoss()

    def both(b, outputs, labels):
        return b.Add(ce.build(b, outputs[:1], labels[:1]), mse.build(b, outputs[1:], labels[1:]))

    custom = losses.CustomLoss(
        both,
        labels=[
            losses.LabelSpec("labels", ir.DataType.INT64, ir.Shape(["n"])),
            losses.LabelSpec("target", ir.DataType.FLOAT, ir.Shape(["n", 1])),
        ],
    )
    artifacts.generate_artifacts(
        onnx.load_from_string(buffer.getvalue()),
        loss=custom,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    y = rng.integers(0, 3, 5).astype(np.int64)
    t = rng.standard_normal((5, 1)).astype(np.float32)
    loss = module(x, y, t)
    logits, value = net(torch.tensor(x))
    expected = torch.nn.functional.cross_entropy(
        logits, torch.tensor(y)
    ) + torch.nn.functional.mse_loss(value, torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    np.testing.assert_allclose(
        state.parameters["body.weight"].grad, net.body.weight.grad.numpy(), rtol=1e-4, atol=1e-6
    )


def test_large_models_use_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(ir_model, "EXTERNAL_DATA_THRESHOLD", 1000)
    model = export(seeded(MLP), torch.zeros(2, 20))
    path = tmp_path / "big.onnx"
    ir_model.save(model, path)
    assert (tmp_path / "big.onnx.data").is_file()
    reloaded = onnx.load(path)
    onnx.checker.check_model(str(path))
    x = np.ones((2, 20), np.float32)
    ref = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort.InferenceSession(str(path)).run(None, {"x": x})[0], ref)
    assert len(reloaded.graph.initializer) == 4


def test_ort_format_checkpoint_round_trip_through_the_api(tmp_path):
    model = export(seeded(MLP), torch.zeros(2, 20))
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=tmp_path,
        checkpoint_format="ort",
    )
    with open(tmp_path / "checkpoint", "rb") as f:
        assert f.read(8)[4:8] == b"ODTC"
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    x, y = classification_data(8, 20, 5)
    module(x, y)
    opt.step()
    CheckpointState.save_checkpoint(
        state, tmp_path / "ort.ckpt", include_optimizer_state=True, format="ort"
    )
    again = CheckpointState.load_checkpoint(tmp_path / "ort.ckpt")
    for name, _ in state.parameters:
        np.testing.assert_array_equal(again.parameters[name].data, state.parameters[name].data)


def test_bad_arguments_raise_model_errors(tmp_path):
    model = export(seeded(MLP), torch.zeros(2, 20))
    with pytest.raises(ModelError, match="not an initializer"):
        artifacts.generate_artifacts(
            model, requires_grad=["nope"], loss="MSELoss", artifact_directory=tmp_path
        )
    with pytest.raises(ModelError, match="LossType"):
        artifacts.generate_artifacts(model, loss="FancyLoss", artifact_directory=tmp_path)
    with pytest.raises(ModelError, match="OptimType"):
        artifacts.generate_artifacts(
            model, loss="MSELoss", optimizer="Lion", artifact_directory=tmp_path
        )
    with pytest.raises(ModelError, match="must be a scalar"):
        artifacts.generate_artifacts(model, artifact_directory=tmp_path)
