"""traingraph.onnxblock: onnxruntime-training's block API over traingraph's autodiff, losses and
optimizers, checked against torch (float64 references)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from traingraph import artifacts, onnxblock
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import ModelError
from traingraph.ir.model import max_ir_version

N, D, H = 5, 4, 3


def _two_head_model(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x (N, D) -> out1 = x @ w1.T + b1 (N, H), out2 = x @ w2.T (N, 2)."""
    params = {
        "w1": rng.standard_normal((H, D)).astype(np.float32),
        "b1": rng.standard_normal(H).astype(np.float32),
        "w2": rng.standard_normal((2, D)).astype(np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["out1"], transB=1),
            helper.make_node("Gemm", ["x", "w2"], ["out2"], transB=1),
        ],
        "two_heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        [
            helper.make_tensor_value_info("out1", TensorProto.FLOAT, ["batch", H]),
            helper.make_tensor_value_info("out2", TensorProto.FLOAT, ["batch", 2]),
        ],
        [numpy_helper.from_array(a, n) for n, a in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, params


def _torch_reference(params, x, t1, t2, w=0.3):
    """The custom loss of :class:`_WeightedLosses` and its parameter gradients, in float64."""
    p = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()}
    x64 = torch.tensor(x, dtype=torch.float64)
    out1 = x64 @ p["w1"].T + p["b1"]
    out2 = x64 @ p["w2"].T
    loss = w * torch.nn.functional.mse_loss(
        out1, torch.tensor(t1, dtype=torch.float64)
    ) + torch.nn.functional.binary_cross_entropy_with_logits(
        out2, torch.tensor(t2, dtype=torch.float64)
    )
    loss.backward()
    return loss.item(), {n: v.grad.numpy() for n, v in p.items()}


class _WeightedLosses(onnxblock.Block):
    """A custom loss over two outputs, written as onnxruntime users write one."""

    def __init__(self, weight: float = 0.3) -> None:
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()
        self.bce = onnxblock.loss.BCEWithLogitsLoss()
        self.weight = onnxblock.blocks.Constant(weight)
        self.mul = onnxblock.blocks.Mul()
        self.add = onnxblock.blocks.Add()

    def build(self, out1: str, out2: str) -> str:
        mse = self.mul(self.weight(), self.mse(out1, target_name="t1"))
        return self.add(mse, self.bce(out2, target_name="t2"))


def _data(rng: np.random.Generator):
    x = rng.standard_normal((N, D)).astype(np.float32)
    t1 = rng.standard_normal((N, H)).astype(np.float32)
    t2 = rng.uniform(0, 1, (N, 2)).astype(np.float32)
    return x, t1, t2


def test_custom_loss_block_trains_as_torch(tmp_path):
    rng = np.random.default_rng(0)
    model, params = _two_head_model(rng)
    artifacts.generate_artifacts(
        model,
        requires_grad=list(params),
        loss=_WeightedLosses(),
        optimizer=onnxblock.optim.AdamW(weight_decay=0.1),
        artifact_directory=tmp_path,
    )
    training = onnx.load(tmp_path / "training_model.onnx")
    onnx.checker.check_model(training, full_check=True)
    assert {n.domain for n in training.graph.node} <= {"", "ai.onnx"}
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, t1, t2 = _data(rng)
    loss = module(x, t1, t2)
    expected_loss, expected_grads = _torch_reference(params, x, t1, t2)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for name, grad in expected_grads.items():
        np.testing.assert_allclose(state.parameters[name].grad, grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(module.eval()(x, t1, t2), expected_loss, rtol=1e-5)


def test_training_block_accumulates_gradients_as_onnxruntime_lays_them_out():
    rng = np.random.default_rng(1)
    model, params = _two_head_model(rng)

    class Training(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = _WeightedLosses()

        def build(self, out1, out2):
            return self.loss(out1, out2)

    block = Training()
    for name in ("w1", "b1"):
        block.requires_grad(name)
    block.requires_grad("w2", False)
    with onnxblock.base(model):
        loss_name = block("out1", "out2")
    training, evaluation = block.to_model_proto()
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == ["w1", "b1"] and [t.name for t in frozen] == ["w2"]
    inputs = [i.name for i in training.graph.input]
    assert inputs == ["x", "t1", "t2", "w1", "b1", "w2"] + [
        "w1_grad.accumulation.buffer",
        "b1_grad.accumulation.buffer",
        "lazy_reset_grad",
    ]
    outputs = [o.name for o in training.graph.output]
    assert outputs == [loss_name, "w1_grad.accumulation.out", "b1_grad.accumulation.out"]
    onnx.checker.check_model(training, full_check=True)
    assert {n.domain for n in training.graph.node} <= {"", "ai.onnx"}

    x, t1, t2 = _data(rng)
    expected_loss, expected_grads = _torch_reference(params, x, t1, t2)
    buffers = {f"{n}_grad.accumulation.buffer": np.ones_like(params[n]) for n in ("w1", "b1")}
    feeds = {"x": x, "t1": t1, "t2": t2, **params, **buffers}
    session = ort.InferenceSession(training.SerializeToString())
    for reset, offset in ((True, 0.0), (False, 1.0)):
        loss, g_w1, g_b1 = session.run(None, {**feeds, "lazy_reset_grad": np.array([reset])})
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
        np.testing.assert_allclose(g_w1, expected_grads["w1"] + offset, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(g_b1, expected_grads["b1"] + offset, rtol=1e-4, atol=1e-6)
    evaluated = ort.InferenceSession(evaluation.SerializeToString()).run(
        None, {"x": x, "t1": t1, "t2": t2, **params}
    )
    np.testing.assert_allclose(evaluated[0], expected_loss, rtol=1e-5)


@pytest.mark.parametrize(
    ("make", "torch_loss", "labels"),
    [
        (onnxblock.loss.MSELoss, torch.nn.functional.mse_loss, "float"),
        (onnxblock.loss.L1Loss, torch.nn.functional.l1_loss, "float"),
        (
            onnxblock.loss.BCEWithLogitsLoss,
            torch.nn.functional.binary_cross_entropy_with_logits,
            "float",
        ),
        (onnxblock.loss.CrossEntropyLoss, torch.nn.functional.cross_entropy, "classes"),
    ],
)
def test_forward_block_losses_equal_torch(make, torch_loss, labels):
    rng = np.random.default_rng(2)
    model, params = _two_head_model(rng)

    class Forward(onnxblock.ForwardBlock):
        def __init__(self):
            super().__init__()
            self.loss = make()

        def build(self, name):
            return self.loss(name)

    block = Forward()
    with onnxblock.base(model):
        block("out1")
    forward = block.to_model_proto()
    x = rng.standard_normal((N, D)).astype(np.float32)
    if labels == "float":
        target = rng.uniform(0, 1, (N, H)).astype(np.float32)
    else:
        target = rng.integers(0, H, N).astype(np.int64)
    [label_input] = [i for i in forward.graph.input if i.name not in ("x",)]
    [loss] = ort.InferenceSession(forward.SerializeToString()).run(
        None, {"x": x, label_input.name: target}
    )
    out1 = torch.tensor(x, dtype=torch.float64) @ torch.tensor(params["w1"], dtype=torch.float64).T
    out1 = out1 + torch.tensor(params["b1"], dtype=torch.float64)
    expected = torch_loss(out1, torch.tensor(target if labels == "classes" else target * 1.0))
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)


def _run_optimizer_block(block, params, grads, step=1, lr=0.01):
    class Training(onnxblock.TrainingBlock):
        def build(self, name):
            return onnxblock.loss.MSELoss()(name)

    training = Training()
    for name in params:
        training.requires_grad(name)
    model, _ = _two_head_model(np.random.default_rng(3))
    with onnxblock.base(model):
        training("out1")
    with onnxblock.empty_base() as accessor:
        flag = block(training.parameters())
        optimizer_model = accessor.model
    assert block.to_model_proto() is optimizer_model
    onnx.checker.check_model(optimizer_model, full_check=True)
    session = ort.InferenceSession(optimizer_model.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    feeds = {"learning_rate": np.array([lr], np.float32), "params": list(params.values())}
    feeds["gradients"] = list(grads.values())
    if "step" in names:
        feeds["step"] = np.array([step], np.int64)
    for name in names:
        feeds.setdefault(name, [np.zeros_like(p) for p in params.values()])
    outputs = session.run(None, feeds)
    assert [o.name for o in session.get_outputs()][0] == flag
    return outputs


def test_adamw_block_steps_as_torch_with_clipping():
    rng = np.random.default_rng(4)
    _, params = _two_head_model(rng)
    params = {n: params[n] for n in ("w1", "b1", "w2")}
    grads = {n: 3 * rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}
    block = onnxblock.optim.AdamW(weight_decay=0.1, clip_grad=onnxblock.optim.ClipGradNorm(1.0))
    flag, new_params, first, second = _run_optimizer_block(block, params, grads)
    assert flag.tolist() == [True]
    tensors = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params.values()]
    for t, g in zip(tensors, grads.values()):
        t.grad = torch.tensor(g, dtype=torch.float64)
    torch.nn.utils.clip_grad_norm_(tensors, 1.0)
    reference = torch.optim.AdamW(tensors, lr=0.01, eps=1e-6, weight_decay=0.1)
    reference.step()
    for got, t in zip(new_params, tensors):
        np.testing.assert_allclose(got, t.detach().numpy(), rtol=1e-5, atol=1e-6)
    for got, t in zip(first, tensors):
        np.testing.assert_allclose(got, reference.state[t]["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_block_clips_a_sequence_as_torch():
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (4,), (2, 2, 2))]
    base = onnx.ModelProto()
    base.ir_version = onnx.IR_VERSION  # lowered to what onnxruntime loads where it is newer
    base.graph.name = "clip"
    base.opset_import.append(helper.make_opsetid("", 17))
    base.graph.input.append(
        helper.make_tensor_sequence_value_info("gradients", TensorProto.FLOAT, None)
    )

    class Clip(onnxblock.ForwardBlock):
        def __init__(self):
            super().__init__()
            self.clip = onnxblock.optim.ClipGradNorm(0.5)

        def build(self, name):
            return self.clip(name)

    block = Clip()
    with onnxblock.base(base):
        block("gradients")
    assert block.to_model_proto().ir_version <= max_ir_version()
    [clipped] = ort.InferenceSession(block.to_model_proto().SerializeToString()).run(
        None, {"gradients": grads}
    )
    tensors = [torch.zeros(g.shape, dtype=torch.float64, requires_grad=True) for g in grads]
    for t, g in zip(tensors, grads):
        t.grad = torch.tensor(g, dtype=torch.float64)
    torch.nn.utils.clip_grad_norm_(tensors, 0.5)
    for got, t in zip(clipped, tensors):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_generate_artifacts_takes_an_onnxblock_optimizer(tmp_path):
    model, params = _two_head_model(np.random.default_rng(6))
    artifacts.generate_artifacts(
        model,
        loss_input_names=["out1"],
        loss=artifacts.LossType.MSELoss,
        optimizer=onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(2.0)),
        artifact_directory=tmp_path,
    )
    meta = {p.key: p.value for p in onnx.load(tmp_path / "optimizer_model.onnx").metadata_props}
    assert meta["traingraph.optimizer"] == "sgd"
    assert '"clip_grad_norm": 2.0' in meta["traingraph.hyperparameters"]

    class NotAnOptimizer(onnxblock.Block):
        def build(self, parameters):
            return "x"

    with pytest.raises(ModelError, match="not one of onnxblock.optim's"):
        artifacts.generate_artifacts(
            model, loss=artifacts.LossType.MSELoss, optimizer=NotAnOptimizer(),
            artifact_directory=tmp_path, loss_input_names=["out1"],
        )  # fmt: skip


def test_parameters_checkpoint_and_errors(tmp_path):
    model, params = _two_head_model(np.random.default_rng(7))

    class Training(onnxblock.TrainingBlock):
        def build(self, name):
            return onnxblock.loss.L1Loss()(name)

    block = Training()
    with pytest.raises(RuntimeError, match="Please build the training model first"):
        block.parameters()
    with pytest.raises(RuntimeError, match="no base model is set"):
        block("out1")
    block.requires_grad("w1")
    block.requires_grad("b1")
    with onnxblock.base(model):
        block("out1")
        with pytest.raises(RuntimeError, match="do not nest"), onnxblock.empty_base():
            pass
    path = tmp_path / "checkpoint"
    onnxblock.save_checkpoint(block.parameters(), path)
    state = CheckpointState.load_checkpoint(path)
    assert len(state.parameters) == 2
    assert state.parameters["w1"].requires_grad and state.parameters["b1"].requires_grad
    zeros = onnx.ModelProto()
    zeros.CopyFrom(model)
    for t in zeros.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(np.zeros_like(params[t.name]), t.name))
    onnxblock.load_checkpoint_to_model(path, zeros)
    loaded = {t.name: numpy_helper.to_array(t) for t in zeros.graph.initializer}
    np.testing.assert_array_equal(loaded["w1"], params["w1"])
    np.testing.assert_array_equal(loaded["w2"], 0)

    onnx.save(model, tmp_path / "model.onnx")
    from_path = Training()
    from_path.requires_grad("w1")
    from_path.requires_grad("b1")
    with onnxblock.base(tmp_path / "model.onnx"):
        from_path("out1")
    assert from_path.to_model_proto()[0] == block.to_model_proto()[0]

    bad = Training()
    bad.requires_grad("nope")
    with (
        pytest.raises(ModelError, match="neither initializers nor graph inputs"),
        onnxblock.base(model),
    ):
        bad("out1")


def string_classifier() -> onnx.ModelProto:
    """A ForwardBlock model of a string input ``text`` [1, 4]: Cast to float, then Linear(4, 2)."""

    class Classifier(onnxblock.ForwardBlock):
        def __init__(self):
            super().__init__()
            self.cast = onnxblock.blocks.Cast(to=TensorProto.FLOAT)
            self.linear = onnxblock.blocks.Linear(4, 2)

        def build(self, name):
            return self.linear(self.cast(name))

    block = Classifier()
    with onnxblock.empty_base() as accessor:
        accessor.model.graph.input.append(
            helper.make_tensor_value_info("text", TensorProto.STRING, [1, 4])
        )
        block("text")
    return block.to_model_proto()


def test_string_input_through_cast_and_linear():
    forward = string_classifier()
    weights = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    [out] = ort.InferenceSession(forward.SerializeToString()).run(
        None, {"text": np.array([["1", "2", "3", "4"]])}
    )
    weight, bias = weights["linear.weight"], weights["linear.bias"]
    x = np.arange(1, 5, dtype=np.float64)
    expected = x @ weight.T.astype(np.float64) + bias
    # A float32 sum in any order lies within a few ulps of the sum of its terms' magnitudes.
    scale = np.abs(x) @ np.abs(weight.T.astype(np.float64)) + np.abs(bias)
    np.testing.assert_array_less(np.abs(out[0] - expected), 8 * np.finfo(np.float32).eps * scale)


def test_training_block_artifacts_train_with_the_api_as_torch(tmp_path):
    """The onnxblock flow without generate_artifacts: TrainingBlock, onnxblock.optim.AdamW and
    save_checkpoint, then traingraph.api's Module and Optimizer, against torch over two steps."""
    rng = np.random.default_rng(8)
    model, params = _two_head_model(rng)

    class Training(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = _WeightedLosses()

        def build(self, out1, out2):
            return self.loss(out1, out2)

    block = Training()
    for name in params:
        block.requires_grad(name)
    with onnxblock.base(model):
        block("out1", "out2")
    training, evaluation = block.to_model_proto()
    optimizer_block = onnxblock.optim.AdamW(weight_decay=0.1)
    with onnxblock.empty_base():
        optimizer_block(block.parameters())
    for name, proto in (("training", training), ("eval", evaluation)):
        onnx.save(proto, tmp_path / f"{name}.onnx")
    onnx.save(optimizer_block.to_model_proto(), tmp_path / "optimizer.onnx")
    onnxblock.save_checkpoint(block.parameters(), tmp_path / "checkpoint")

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training.onnx", state, tmp_path / "eval.onnx")
    optimizer = Optimizer(tmp_path / "optimizer.onnx", module)
    optimizer.set_learning_rate(0.05)
    assert module.input_names() == ["x", "t1", "t2"]

    tensors = {
        n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()
    }
    reference = torch.optim.AdamW(tensors.values(), lr=0.05, eps=1e-6, weight_decay=0.1)
    for _ in range(2):
        x, t1, t2 = _data(rng)
        loss = module(x, t1, t2)
        optimizer.step()
        module.lazy_reset_grad()
        reference.zero_grad()
        x64 = torch.tensor(x, dtype=torch.float64)
        expected = 0.3 * torch.nn.functional.mse_loss(
            x64 @ tensors["w1"].T + tensors["b1"], torch.tensor(t1, dtype=torch.float64)
        ) + torch.nn.functional.binary_cross_entropy_with_logits(
            x64 @ tensors["w2"].T, torch.tensor(t2, dtype=torch.float64)
        )
        expected.backward()
        reference.step()
        np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, tensor in tensors.items():
        np.testing.assert_allclose(
            state.parameters[name].data, tensor.detach().numpy(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("block, reduce", [("ReduceMean", np.mean), ("ReduceSum", np.sum)])
def test_reduce_blocks_keep_dims_as_asked(block, reduce, keepdims):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, D)).astype(np.float32)
    reduce_block = getattr(onnxblock.blocks, block)(keepdims=keepdims)
    with onnxblock.empty_base() as accessor:
        accessor.model.graph.input.append(
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])
        )
        out = reduce_block("x")
        accessor.model.graph.output.append(helper.make_empty_tensor_value_info(out))
        model = accessor.model
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x})
    want = reduce(x.astype(np.float64), keepdims=keepdims)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_block_takes_a_relative_temp_file_name_and_infers_shapes_on_base():
    block = onnxblock.blocks.Abs()
    with pytest.raises(RuntimeError, match="absolute path"):
        onnxblock.blocks.PassThrough(temp_file_name="/abs/temp.onnx")
    onnxblock.blocks.PassThrough(temp_file_name="model_temp.onnx")
    with pytest.raises(RuntimeError, match="no base model"):
        block.infer_shapes_on_base()
    model, _ = _two_head_model(np.random.default_rng(0))
    with onnxblock.base(model) as accessor:
        out = block("out1")
        inferred = block.infer_shapes_on_base()
        assert inferred is not accessor.model
    info = {v.name: v for v in inferred.graph.value_info}
    dims = [d.dim_param or d.dim_value for d in info[out].type.tensor_type.shape.dim]
    assert dims == ["batch", H]


def test_base_reads_external_data_from_model_path(tmp_path):
    rng = np.random.default_rng(3)
    model, params = _two_head_model(rng)
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="model.data", size_threshold=0)
    bare = onnx.load(path, load_external_data=False)

    class Scaled(onnxblock.ForwardBlock):
        def __init__(self) -> None:
            super().__init__()
            self.mul = onnxblock.blocks.Mul()
            self.two = onnxblock.blocks.Constant(2.0)

        def build(self, name: str) -> str:
            return self.mul(self.two(), name)

    block = Scaled()
    with onnxblock.base(bare, str(path)) as accessor:
        assert accessor.has_path and accessor.path == str(path)
        block("out1")
    forward = block.to_model_proto()
    x = rng.standard_normal((N, D)).astype(np.float32)
    sess = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x})
    want = 2.0 * (x.astype(np.float64) @ params["w1"].T + params["b1"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert bare.graph.initializer[0].data_location == TensorProto.EXTERNAL  # left as it was

    with onnxblock.base(model) as accessor:
        assert not accessor.has_path
        with pytest.raises(RuntimeError, match="no path"):
            _ = accessor.path
    missing = onnxblock.base(model, tmp_path / "missing.onnx")
    with pytest.raises(FileNotFoundError, match="model_path"), missing:
        pass
