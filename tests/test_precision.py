"""Mixed precision: the autocast pass, loss scaling in the train graph, the dynamic loss scaler.

These run on the CPU: onnxruntime's CPU provider has float16 MatMul/Gemm/Add/Relu/Conv kernels
(and no bfloat16 ones, so bfloat16 graphs are checked for structure here and trained in
tests/runtime/cuda/test_gpu.py). The float16-vs-float32 loss curves on the GPU are there too.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from torch_models import MLP, export, seeded
from traingraph import artifacts, losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import ModelError
from traingraph.precision import GRADS_FINITE, LOSS_SCALE, autocast, low_precision_type
from traingraph.program import build_program
from traingraph.runtime.amp import DynamicLossScaler

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model)
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {v.name: v.type.tensor_type.elem_type for v in values}


def _mlp_program(precision: str | None):
    model = export(seeded(MLP), torch.zeros(2, 20), training=True)
    return build_program(
        model, loss=losses.CrossEntropyLoss(), optimizer=optim.AdamW(lr=1e-2),
        mixed_precision=precision,
    )


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_train_graph_computes_gemm_in_low_precision_with_float32_gradients(precision) -> None:
    program = _mlp_program(precision)
    model = program.train_model
    onnx.checker.check_model(model, full_check=True)
    low = low_precision_type(precision).value
    types = _types(model)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    forward = [n for n in gemms if not n.name.startswith("grad")]
    assert forward and all(types[i] == low for n in forward for i in n.input)
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    outputs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert inputs["fc1.weight"] == F32 and outputs["loss"] == F32
    if precision == "fp16":  # float16's range needs loss scaling; bfloat16's does not
        assert inputs[LOSS_SCALE] == F32 and outputs[GRADS_FINITE] == TensorProto.BOOL
    else:
        assert LOSS_SCALE not in inputs and GRADS_FINITE not in outputs
    assert all(outputs[f"{p}_grad"] == F32 for p in program.trainable)
    softmax = next(n for n in model.graph.node if n.op_type == "LogSoftmax")
    assert types[softmax.input[0]] == F32  # the loss stays in float32
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["traingraph.mixed_precision"] == precision
    assert LOSS_SCALE not in {i.name for i in program.eval_model.graph.input}


def test_follow_ops_cast_weights_down_and_promote_activations() -> None:
    """``Add(MatMul(x, w), b)`` runs in float16 (the bias is cast); ``Add(h, x)`` with ``x`` a
    float32 activation is promoted to float32; ReduceMean always gets float32."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Add", ["r", "x"], ["res"]),
        helper.make_node("ReduceMean", ["r"], ["mean"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F32, ["n", 4])],
        [helper.make_tensor_value_info("res", F32, ["n", 4]),
         helper.make_tensor_value_info("mean", F32, [])],
        [helper.make_tensor("w", F32, [4, 4], np.eye(4).ravel().tolist()),
         helper.make_tensor("b", F32, [4], [1.0] * 4)],
    )
    model = ir.from_proto(
        onnx.shape_inference.infer_shapes(
            helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
        )
    )
    assert autocast(model.graph, 17, ir.DataType.FLOAT16) == 4  # x, w, b down; r up
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    by_output = {n.output[0]: n for n in proto.graph.node}
    types = _types(proto)
    assert types["h"] == F16 and types["r"] == F16 and types["res"] == F32
    assert types[by_output["mean"].input[0]] == F32
    assert [o.name for o in proto.graph.output] == ["res", "mean"]
    assert all(o.type.tensor_type.elem_type == F32 for o in proto.graph.output)
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    res, mean = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x})
    r = np.maximum(x + 1, 0)
    np.testing.assert_allclose(res, r + x, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(mean, r.mean(), rtol=1e-3)


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ModelError, match="expected 'fp16' or 'bf16'"):
        low_precision_type("fp8")


def test_scaler_backs_off_on_overflow_and_grows_after_the_interval() -> None:
    scaler = DynamicLossScaler(scale=8.0, growth_interval=3)
    assert scaler.update(False) is False and scaler.scale == 4.0 and scaler.skipped_steps == 1
    assert all(scaler.update(True) for _ in range(2)) and scaler.scale == 4.0
    assert scaler.update(True) and scaler.scale == 8.0 and scaler.good_steps == 0
    scaler.update(True)
    scaler.update(False)
    assert scaler.good_steps == 0 and scaler.scale == 4.0
    assert DynamicLossScaler().scale == 2.0**16


@pytest.mark.parametrize(
    "kwargs", [{"scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.5},
               {"growth_interval": 0}],
)
def test_scaler_refuses_bad_settings(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DynamicLossScaler(**kwargs)


def _train(directory, batches, *, inject_at: int | None = None):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    losses_ = []
    for i, (x, y) in enumerate(batches):
        if i == inject_at:
            x = x.copy()
            x[0, 0] = np.inf
        losses_.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    return state, module, np.array(losses_)


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((32, 20)).astype(np.float32), rng.integers(0, 5, 32))
        for _ in range(n)
    ]


def _artifacts(directory, precision: str | None) -> None:
    artifacts.generate_artifacts(
        export(seeded(MLP), torch.zeros(2, 20), training=True),
        loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=directory, mixed_precision=precision,
    )


def test_fp16_training_on_the_cpu_follows_the_float32_curve(tmp_path) -> None:
    batches = _batches(20)
    curves = {}
    for precision in (None, "fp16"):
        _artifacts(tmp_path / str(precision), precision)
        state, module, curves[precision] = _train(tmp_path / str(precision), batches)
        assert module.input_names() == ["x", "labels"] and module.output_names() == ["loss"]
        assert state.parameters["fc1.weight"].data.dtype == np.float32
    # float16 rounds the Gemm inputs to 11 significant bits (relative error <= 2**-11).
    np.testing.assert_allclose(curves["fp16"], curves[None], rtol=1e-2, atol=1e-2)
    assert curves["fp16"][-1] < curves["fp16"][0]


def test_a_non_finite_step_is_skipped_and_the_scale_backs_off(tmp_path) -> None:
    _artifacts(tmp_path, "fp16")
    batches = _batches(3)
    state, module, _ = _train(tmp_path, batches[:1])
    before = {n: p.data for n, p in state.parameters.items()}
    runtime = state._runtime
    assert runtime is not None and runtime.optimizer_slots is not None
    slots = {n: runtime.optimizer_slots.cur.read(n) for n in runtime.optimizer_slots.cur}
    step = runtime.step
    scaler = module.loss_scaler
    assert scaler is not None and scaler.scale == 2.0**16
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    x, y = batches[1]
    x = x.copy()
    x[0, 0] = np.inf
    module(x, y)
    opt.step()
    module.lazy_reset_grad()
    assert scaler.scale == 2.0**15 and scaler.skipped_steps == 1 and runtime.step == step
    for name, value in before.items():
        np.testing.assert_array_equal(state.parameters[name].data, value, err_msg=name)
    for name, value in slots.items():
        np.testing.assert_array_equal(runtime.optimizer_slots.cur.read(name), value)
    module(*batches[2])
    opt.step()
    assert runtime.step == step + 1 and scaler.good_steps == 1
    assert not np.array_equal(state.parameters["fc1.weight"].data, before["fc1.weight"])


def test_fp16_batch_norm_keeps_float32_statistics_and_gradients_close_to_float64(tmp_path):
    """In a float16 program a BatchNormalization after a float16 Conv reads and writes float16
    activations while its statistics, running statistics and sums stay float32; every
    parameter's gradient is within 1e-3 (relative to its largest element) of PyTorch's in
    float64 (float16 rounds each activation to 2**-11), and the evaluation model runs. (The
    CPU provider computes some float16 ops through float32; the float16 loss curve of this
    model on the GPU is in tests/runtime/cuda/test_gpu.py.)"""
    from torch_models import ResidualNet

    model = export(seeded(ResidualNet), torch.zeros(2, 3, 8, 8), training=True)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path, mixed_precision="fp16",
    )  # fmt: skip
    train = onnx.load(tmp_path / "training_model.onnx")
    types = _types(train)
    norms = [n for n in train.graph.node if n.op_type == "BatchNormalization"]
    assert len(norms) == 4
    assert all(types[n.input[0]] == F16 and types[n.output[0]] == F16 for n in norms)
    assert all(types[n.input[i]] == F16 for n in norms for i in (1, 2, 3, 4))
    assert {types[n.output[0]] for n in train.graph.node if n.op_type == "Relu"} == {F16}
    running = [o.name for o in train.graph.output if "running" in o.name]
    assert running and all(types[name] == F32 for name in running)

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 3, 8, 8)) * 3 + 1).astype(np.float32)
    y = rng.integers(0, 5, 16)
    reference = seeded(ResidualNet).double().train()
    torch.nn.functional.cross_entropy(
        reference(torch.tensor(x, dtype=torch.float64)), torch.tensor(y)
    ).backward()
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(
        tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx"
    )
    module(x, y)
    for name, param in reference.named_parameters():
        want = param.grad.numpy()
        got = state.parameters[name].grad
        assert got is not None and got.dtype == np.float32
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < 1e-3, (name, error)
    module.eval()
    assert np.isfinite(float(module(x, y)))
