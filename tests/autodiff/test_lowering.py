"""The training-mode BatchNormalization lowering against onnxruntime's native training kernel."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from gradcheck import add_weighted_sum_loss, check_model_gradient, make_op_model, session
from torch_models import export
from traingraph.autodiff import build_gradient_graph
from traingraph.autodiff.lowering import (
    is_training_batch_norm,
    lower_training_batch_norm,
    split_sequences,
)
from traingraph.errors import ModelError
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program

rng = np.random.default_rng(0)

SHAPES = [(5, 3), (4, 3, 5), (3, 2, 3, 4), (2, 2, 3, 2, 2)]


def bn_inputs(shape, dtype=np.float64):
    c = shape[1]
    return {
        "x": (rng.standard_normal(shape) * 2 + 1).astype(dtype),
        "scale": rng.standard_normal(c).astype(dtype),
        "bias": rng.standard_normal(c).astype(dtype),
        "mean": rng.standard_normal(c).astype(dtype),
        "var": rng.uniform(0.5, 2.0, c).astype(dtype),
    }


def lowered(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    m = ir.from_proto(model)
    assert lower_training_batch_norm(m.graph, opset)
    assert not any(is_training_batch_norm(n) for n in m.graph)
    proto = ir.to_proto(m)
    onnx.checker.check_model(proto, full_check=True)
    return proto


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opset", [14, 15, 17, 26])
def test_lowered_outputs_equal_the_native_node(shape, opset):
    inputs = bn_inputs(shape)
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1, "momentum": 0.7, "epsilon": 1e-3},
        num_outputs=3, opset=opset, dynamic="batch",
    )
    expected = session(model).run(None, inputs)
    got = session(lowered(model, opset)).run(None, inputs)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


def test_lowered_defaults_and_float32():
    """Without epsilon / momentum attributes the spec's defaults (1e-5, 0.9) apply."""
    inputs = bn_inputs((8, 4, 6, 6), np.float32)
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, num_outputs=3, opset=17
    )
    expected = session(model).run(None, inputs)
    got = session(lowered(model, 17)).run(None, inputs)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_lowered_running_stats_follow_the_spec():
    """running = momentum * running + (1 - momentum) * batch statistic (biased variance)."""
    inputs = bn_inputs((4, 3, 5))
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1, "momentum": 0.8},
        num_outputs=3, opset=15,
    )
    _, running_mean, running_var = session(lowered(model, 15)).run(None, inputs)
    x, momentum = inputs["x"], float(np.float32(0.8))  # attributes are float32
    for running, previous, batch in (
        (running_mean, inputs["mean"], x.mean(axis=(0, 2))),
        (running_var, inputs["var"], x.var(axis=(0, 2))),
    ):
        np.testing.assert_allclose(
            running, momentum * previous + (1 - momentum) * batch, rtol=1e-12
        )


def test_only_used_outputs_are_replaced_and_names_kept():
    inputs = bn_inputs((4, 3, 2, 2))
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, num_outputs=3, opset=15
    )
    del model.graph.output[1:]
    proto = lowered(model, 15)
    assert [o.name for o in proto.graph.output] == ["y0"]
    np.testing.assert_allclose(
        session(proto).run(None, inputs)[0], session(model).run(None, inputs)[0], rtol=1e-12
    )


def test_inference_batch_norm_is_left_alone():
    inputs = bn_inputs((4, 3, 2))
    model = make_op_model("BatchNormalization", inputs, {"training_mode": 0}, opset=15)
    m = ir.from_proto(model)
    assert not lower_training_batch_norm(m.graph, 15)
    assert [n.op_type for n in m.graph] == ["BatchNormalization"]


def test_unknown_rank_is_refused():
    inputs = bn_inputs((4, 3, 2))
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, num_outputs=3, opset=15
    )
    m = ir.from_proto(model)
    m.graph.inputs[0].shape = None
    with pytest.raises(ModelError, match="rank"):
        lower_training_batch_norm(m.graph, 15)


@pytest.mark.parametrize("opset", [15, 26])
def test_lowered_gradient_graph_equals_the_native_one(opset):
    """Lowering the forward nodes of a gradient graph changes no gradient."""
    inputs = bn_inputs((6, 3, 4, 4))
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, const_inputs=["mean", "var"],
        num_outputs=3, opset=opset, dynamic="batch",
    )
    feeds = {k: inputs[k] for k in ("x", "scale", "bias")}
    y = session(model).run(["y0"], feeds)[0]
    feeds["w_y0"] = rng.standard_normal(y.shape)
    loss_model = add_weighted_sum_loss(model, ["y0"], [y])
    names = ["x_grad", "scale_grad", "bias_grad"]
    grad_model = build_gradient_graph(loss_model, wrt=["x", "scale", "bias"], loss="loss")
    expected = session(grad_model).run(names, feeds)
    got = session(lowered(grad_model, opset)).run(names, feeds)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("opset", [17, 18])
def test_forward_and_backward_statistics_merge_in_onnxruntime(opset, tmp_path):
    """After lowering, onnxruntime's common-subexpression pass keeps one copy of the batch
    statistics for the forward node and its gradient (axes as attribute and as input)."""
    inputs = bn_inputs((6, 3, 4, 4), np.float32)
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, const_inputs=["mean", "var"],
        num_outputs=3, opset=opset, dynamic="batch",
    )
    loss_model = add_weighted_sum_loss(model, ["y0"], [inputs["x"]])
    grad_model = lowered(build_gradient_graph(loss_model, wrt=["x"], loss="loss"), opset)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(
        grad_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    optimized = onnx.load(options.optimized_model_filepath)
    # mean and variance for the forward node and again for its gradient, and the gradient's
    # mean of the centred input (the float32 mean's rounding, taken out of dx and dscale)
    assert sum(n.op_type == "ReduceMean" for n in grad_model.graph.node) == 5
    assert sum(n.op_type == "ReduceMean" for n in optimized.graph.node) == 3


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.bn = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_train_graph_has_no_training_mode_batch_norm():
    """build_program lowers the train graph, which then matches torch one step later."""
    torch.manual_seed(0)
    net = _ConvBN()
    program = build_program(
        export(net, torch.zeros(2, 1, 6, 6), training=True), loss=CrossEntropyLoss()
    )
    train = program.train_model
    assert not any(is_training_batch_norm(n) for n in ir.from_proto(train).graph)
    onnx.checker.check_model(train, full_check=True)
    x = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 5, 4).astype(np.int64)
    feeds = {n: v for n, v in program.parameters.items()}
    feeds.update(dict(zip(program.input_names, (x, labels))))
    sess = session(train)
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    with torch.no_grad():
        net.bn.running_mean.copy_(torch.tensor(program.parameters["bn.running_mean"]))
        net.bn.running_var.copy_(torch.tensor(program.parameters["bn.running_var"]))
    net.train()
    loss = torch.nn.functional.cross_entropy(net(torch.tensor(x)), torch.tensor(labels))
    loss.backward()
    np.testing.assert_allclose(outputs["loss"], loss.item(), rtol=1e-5)
    for name, p in net.named_parameters():
        np.testing.assert_allclose(
            outputs[f"{name}_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name
        )
    np.testing.assert_allclose(
        outputs["bn.running_mean_updated"], net.bn.running_mean.numpy(), rtol=1e-5, atol=1e-6
    )


def _batch_norm_stack(momenta: list[float], channels: list[int]) -> onnx.ModelProto:
    """float32 BatchNorms in training mode, one after another (1x1 convs change the channels), with
    every running statistic a graph output."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, outputs = [], [], []
    current, c_in = "x", 2
    for i, (momentum, c) in enumerate(zip(momenta, channels)):
        w = rng.standard_normal((c, c_in, 1, 1)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [current, f"w{i}"], [f"c{i}"]))
        for name, value in (("s", rng.standard_normal(c)), ("b", rng.standard_normal(c)),
                            ("m", rng.standard_normal(c)), ("v", rng.uniform(0.5, 2, c))):
            inits.append(numpy_helper.from_array(np.float32(value), f"{name}{i}"))  # fmt: skip
        nodes.append(helper.make_node(
            "BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"],
            [f"y{i}", f"rm{i}", f"rv{i}"], training_mode=1, momentum=momentum,
        ))  # fmt: skip
        outputs += [f"rm{i}", f"rv{i}"]
        current, c_in = f"y{i}", c
    graph = helper.make_graph(
        nodes, "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, 3, 3])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, None)]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def test_running_statistics_of_one_momentum_update_as_one_vector():
    model = _batch_norm_stack([0.9, 0.9, 0.7, 0.9], [3, 5, 4, 2])
    x = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    expected = session(model).run(None, {"x": x})
    result = lowered(model, 17)
    # Momentum 0.9: three layers' means and variances in one Split; momentum 0.7 on its own.
    splits = sorted(len(n.output) for n in result.graph.node if n.op_type == "Split")
    assert splits == [2, 6]
    got = session(result).run(None, {"x": x})
    assert [o.name for o in result.graph.output] == [o.name for o in model.graph.output]
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def _split_to_sequence_model(split, positions, keepdims=1, axis=1):
    """``SplitToSequence(x, split)`` along ``axis`` (of 5) read by ``SequenceAt`` at
    ``positions``, each piece weighted into ``loss``; ``x`` has a dynamic batch."""
    nodes = [helper.make_node(
        "SplitToSequence", ["x"] + (["split"] if split is not None else []), ["seq"],
        axis=axis, keepdims=keepdims,
    )]  # fmt: skip
    terms = []
    for k in range(len(positions)):
        nodes += [
            helper.make_node("SequenceAt", ["seq", f"p{k}"], [f"piece{k}"]),
            helper.make_node("Mul", [f"piece{k}", f"piece{k}"], [f"sq{k}"]),
            helper.make_node("ReduceSum", [f"sq{k}"], [f"s{k}"], keepdims=0),
            helper.make_node("Mul", [f"s{k}", f"c{k}"], [f"t{k}"]),
        ]
        terms.append(f"t{k}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    inits = [
        numpy_helper.from_array(np.array(p, np.int64), f"p{k}") for k, p in enumerate(positions)
    ]
    inits += [numpy_helper.from_array(np.array(k + 1.0), f"c{k}") for k in range(len(positions))]
    if split is not None:
        inits.append(numpy_helper.from_array(np.array(split, np.int64), "split"))
    graph = helper.make_graph(
        nodes, "split_to_sequence",
        [helper.make_tensor_value_info(
            "x", TensorProto.DOUBLE, ["batch", 5, 2] if axis in (1, -2) else ["batch", 2, 5]
        )],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    ("split", "positions", "keepdims"),
    [([2, 3], [0, -1], 1), (2, [0, 2, 1], 1), (None, [4, 0], 0), ([1, 4], [1], 1)],
)
def test_split_to_sequence_read_at_constant_positions_differentiates(split, positions, keepdims):
    """The dynamo exporter's ``torch.split`` (SplitToSequence -> SequenceAt) becomes Split,
    whose gradient equals finite differences; a piece read twice or never still works."""
    model = _split_to_sequence_model(split, positions, keepdims)
    grad_model = build_gradient_graph(model, wrt=["x"], loss="loss")
    assert not any(n.op_type.startswith("Sequence") for n in grad_model.graph.node)
    check_model_gradient(model, {"x": rng.standard_normal((3, 5, 2))}, ["x"])


@pytest.mark.parametrize("keepdims", [1, 0])
def test_split_to_sequence_along_a_negative_axis_keeps_the_pieces_shapes(keepdims):
    """``torch.chunk(x, n, -1)`` exports with axis=-1: each piece's shape is ``x``'s with the
    last dimension replaced (or dropped), the rank unchanged."""
    split = [2, 3] if keepdims else None
    model = _split_to_sequence_model(split, [0, 1], keepdims, axis=-1)
    m = ir.from_proto(onnx.shape_inference.infer_shapes(model))
    assert split_sequences(m.graph, 18)
    pieces = [n.outputs[0] for n in m.graph if n.op_type == "Mul" and n.inputs[0] is n.inputs[1]]
    want = [["batch", 2, 2], ["batch", 2, 3]] if keepdims else [["batch", 2], ["batch", 2]]
    got = [[d if isinstance(d, int) else d.value for d in p.inputs[0].shape.dims]
           for p in (v.producer() for v in pieces)]  # fmt: skip
    assert got == want
    x = rng.standard_normal((3, 2, 5))
    check_model_gradient(model, {"x": x}, ["x"])


def test_split_to_sequence_with_run_time_positions_stays():
    m = ir.from_proto(_split_to_sequence_model([2, 3], [0]))
    position = m.graph.initializers.pop("p0")
    position.const_value = None
    m.graph.inputs.append(position)
    assert not split_sequences(m.graph, 18)
    assert any(n.op_type == "SplitToSequence" for n in m.graph)
