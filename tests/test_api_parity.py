"""traingraph.api behaves as onnxruntime-training's API: checkpoint state views, OrtValues in and
out, nominal checkpoints, string inputs, session options and ORT-format artifacts."""

from __future__ import annotations

import inspect

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from test_onnxblock import string_classifier
from traingraph import artifacts, onnxblock
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import CheckpointError, ModelError

N, D, H, C = 6, 4, 5, 3


def _mlp(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    params = {
        "w1": rng.standard_normal((H, D)).astype(np.float32),
        "b1": rng.standard_normal(H).astype(np.float32),
        "w2": rng.standard_normal((C, H)).astype(np.float32),
        "b2": rng.standard_normal(C).astype(np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"], transB=1),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", C])],
        [numpy_helper.from_array(a, n) for n, a in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, params


@pytest.fixture
def setup(tmp_path):
    rng = np.random.default_rng(0)
    model, params = _mlp(rng)
    artifacts.generate_artifacts(
        model,
        requires_grad=["w2", "b2"],
        frozen_params=["w1", "b1"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=tmp_path,
        nominal_checkpoint=True,
    )
    x = rng.standard_normal((N, D)).astype(np.float32)
    y = rng.integers(0, C, N).astype(np.int64)
    return tmp_path, params, x, y


def _torch_loss_and_grads(params, x, y):
    p = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()}
    h = torch.relu(torch.tensor(x, dtype=torch.float64) @ p["w1"].T + p["b1"])
    loss = torch.nn.functional.cross_entropy(h @ p["w2"].T + p["b2"], torch.tensor(y))
    loss.backward()
    return loss.item(), {n: v.grad.numpy() for n, v in p.items()}


def test_state_parameters_are_pairs_settable_with_zero_grads(setup):
    directory, params, x, y = setup
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    assert len(state.parameters) == 4 and "w1" in state.parameters
    assert [name for name, _ in state.parameters] == ["w1", "b1", "w2", "b2"]
    for name, parameter in state.parameters:
        assert parameter.name == name
        np.testing.assert_array_equal(parameter.data, params[name])
        if name in ("w1", "b1"):
            assert parameter.requires_grad is False and parameter.grad is None
        else:
            assert parameter.requires_grad is True
            np.testing.assert_array_equal(parameter.grad, np.zeros_like(params[name]))
    loss = module(x, y)
    expected_loss, expected_grads = _torch_loss_and_grads(params, x, y)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(state.parameters["w2"].grad, expected_grads["w2"], rtol=1e-4)
    state.parameters["w1"] = np.ones_like(params["w1"])
    np.testing.assert_array_equal(state.parameters["w1"].data, 1.0)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        state.parameters["nope"] = np.ones(3)


def test_properties_iterate_as_pairs(setup):
    directory, *_ = setup
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    state.properties["epoch"] = 3
    state.properties["tag"] = "run"
    assert list(state.properties) == [("epoch", 3), ("tag", "run")]
    assert "epoch" in state.properties and len(state.properties) == 2
    assert state.properties.get("missing", 7) == 7
    CheckpointState.save_checkpoint(state, directory / "saved")
    assert dict(CheckpointState.load_checkpoint(directory / "saved").properties.items()) == {
        "epoch": 3,
        "tag": "run",
    }


def test_ortvalues_in_ortvalues_out(setup):
    directory, params, x, y = setup
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    feeds = [ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y)]
    first = module(*feeds)
    second = module(*feeds)  # a later call must not overwrite the values returned before
    expected_loss, _ = _torch_loss_and_grads(params, x, y)
    assert isinstance(first, ort.OrtValue) and isinstance(second, ort.OrtValue)
    np.testing.assert_allclose(first.numpy(), expected_loss, rtol=1e-5)
    np.testing.assert_allclose(second.numpy(), expected_loss, rtol=1e-5)
    evaluated = module.eval()(*feeds)
    assert isinstance(evaluated, ort.OrtValue)
    assert isinstance(module(x, y), np.ndarray)  # numpy in, numpy out


def test_nominal_checkpoint_raises_until_loaded(setup):
    directory, params, x, y = setup
    complete = CheckpointState.load_checkpoint(directory / "checkpoint")
    reference = Module(directory / "training_model.onnx", complete)
    state = CheckpointState.load_checkpoint(directory / "nominal_checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    assert "w1" in state.parameters
    with pytest.raises(CheckpointError, match="Please load the parameter states first"):
        state.parameters["w1"]
    with pytest.raises(CheckpointError, match="Please load all the parameter states first"):
        state.parameters["w1"] = params["w1"]
    for call in (
        module.get_contiguous_parameters,
        lambda: module(x, y),
        lambda: module.eval()(x, y),
        optimizer.step,
    ):
        with pytest.raises(CheckpointError, match="Please load the model parameters first"):
            call()
    assert module.get_parameters_size(trainable_only=False) == sum(a.size for a in params.values())
    module.copy_buffer_to_parameters(reference.get_contiguous_parameters(), trainable_only=False)
    module.train()
    np.testing.assert_allclose(module(x, y), reference(x, y), rtol=1e-6)
    optimizer.step()
    np.testing.assert_array_equal(state.parameters["w1"].data, params["w1"])
    assert not np.array_equal(state.parameters["w2"].data, params["w2"])


def test_string_inputs_train(tmp_path):
    model = string_classifier()
    # Seeded small weights in place of the block's unseeded initialization: a loss near 0 is
    # dominated by float32's rounding of the logits, which rtol=1e-5 does not allow.
    rng = np.random.default_rng(0)
    for tensor in model.graph.initializer:
        shape = numpy_helper.to_array(tensor).shape
        value = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.SGD,
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    text, label = np.array([["1.0", "2.0", "3.0", "4.0"]]), np.array([1])
    w = torch.tensor(weights["linear.weight"], dtype=torch.float64, requires_grad=True)
    b = torch.tensor(weights["linear.bias"], dtype=torch.float64, requires_grad=True)
    logits = torch.arange(1.0, 5.0, dtype=torch.float64)[None] @ w.T + b
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(label))
    expected.backward()
    np.testing.assert_allclose(module(text, label), expected.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters["linear.weight"].grad, w.grad.numpy(), rtol=1e-5)
    np.testing.assert_allclose(module.eval()(text, label), expected.item(), rtol=1e-5)


def test_module_takes_onnxruntime_session_options(setup):
    directory, *_ = setup
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    module = Module(directory / "training_model.onnx", state, session_options=options)
    session_options = module.step.runner.session.get_session_options()  # type: ignore[union-attr]
    assert session_options.intra_op_num_threads == 1
    with pytest.raises(TypeError, match="onnxruntime.SessionOptions"):
        Module(directory / "training_model.onnx", state, session_options={"threads": 1})


def test_ort_format_artifacts_load_in_onnxruntime(tmp_path):
    model, _ = _mlp(np.random.default_rng(1))
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=tmp_path,
        ort_format=True,
    )
    for name in ("training_model", "eval_model", "optimizer_model"):
        onnx_inputs = [i.name for i in onnx.load(tmp_path / f"{name}.onnx").graph.input]
        session = ort.InferenceSession(tmp_path / f"{name}.ort")
        assert [i.name for i in session.get_inputs()] == onnx_inputs


def test_custom_op_library_must_exist(tmp_path):
    model, _ = _mlp(np.random.default_rng(2))
    with pytest.raises(ModelError, match="custom_op_library .* does not exist"):
        artifacts.generate_artifacts(
            model,
            loss=artifacts.LossType.CrossEntropyLoss,
            artifact_directory=tmp_path,
            custom_op_library=str(tmp_path / "missing.so"),
        )
    library = onnxblock.custom_op_library(tmp_path / "missing.so")
    with pytest.raises(FileNotFoundError, match="does not exist"), library:
        pass


def test_generate_artifacts_takes_onnxruntimes_positional_order(tmp_path):
    """onnxruntime-training 1.19's parameters, in its order, may be passed by position."""
    onnxruntime_order = [
        "model",
        "requires_grad",
        "frozen_params",
        "loss",
        "optimizer",
        "artifact_directory",
        "prefix",
        "ort_format",
        "custom_op_library",
        "additional_output_names",
        "nominal_checkpoint",
        "loss_input_names",
    ]
    parameters = inspect.signature(artifacts.generate_artifacts).parameters
    positional = [
        name for name, p in parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == onnxruntime_order
    rng = np.random.default_rng(4)
    model, params = _mlp(rng)
    artifacts.generate_artifacts(
        model,
        ["w2", "b2"],
        ["w1", "b1"],
        artifacts.LossType.CrossEntropyLoss,
        artifacts.OptimType.SGD,
        tmp_path,
        "p_",
        False,
        None,
        ["h"],
        True,
        ["logits"],
    )
    assert (tmp_path / "p_nominal_checkpoint").is_file()
    assert not list(tmp_path.glob("*.ort"))
    state = CheckpointState.load_checkpoint(tmp_path / "p_checkpoint")
    module = Module(tmp_path / "p_training_model.onnx", state, tmp_path / "p_eval_model.onnx")
    x = rng.standard_normal((N, D)).astype(np.float32)
    y = rng.integers(0, C, N).astype(np.int64)
    loss, h = module(x, y)
    torch_loss, _ = _torch_loss_and_grads(params, x, y)
    np.testing.assert_allclose(loss, torch_loss, rtol=1e-5)
    want_h = x.astype(np.float64) @ params["w1"].T + params["b1"]
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
