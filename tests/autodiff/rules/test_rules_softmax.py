"""Gradients of Softmax and LogSoftmax against finite differences and torch."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from gradcheck import check_model_gradient, check_op_gradient, session
from traingraph.ir.model import max_ir_version

rng = np.random.default_rng(0)

OPS = {"Softmax": torch.softmax, "LogSoftmax": torch.log_softmax}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("opset", [13, 17, 26])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_axes_and_opsets(op, opset, axis):
    x = rng.standard_normal((2, 3, 4))
    attrs = {} if axis is None else {"axis": axis}
    dim = -1 if axis is None else axis
    check_op_gradient(
        op, {"x": x}, attrs, opset=opset, torch_fn=lambda t: OPS[op](t, dim=dim)
    )


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dynamic", ["batch", "all"])
@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("axis", [0, -1])
def test_dynamic_shapes(op, dynamic, opset, axis):
    x = rng.standard_normal((3, 5))
    check_op_gradient(
        op, {"x": x}, {"axis": axis}, opset=opset, dynamic=dynamic,
        torch_fn=lambda t: OPS[op](t, dim=axis),
    )


@pytest.mark.parametrize("op", sorted(OPS))
def test_large_logits_stay_finite(op):
    """Logits of magnitude 1e3 overflow a naive exp; the output-based rules stay exact."""
    x = rng.standard_normal((2, 4)) * 3 + np.array([[1000.0], [-1000.0]])
    check_op_gradient(op, {"x": x}, torch_fn=lambda t: OPS[op](t, dim=-1))


def test_cross_entropy_through_log_softmax():
    """A classifier head: loss = -sum(onehot * LogSoftmax(z)), z = x * w (w broadcast over rows)."""
    x, w = rng.standard_normal((4, 5)), rng.standard_normal((5,))
    onehot = np.eye(5)[rng.integers(0, 5, size=4)]
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["z"]),
            helper.make_node("LogSoftmax", ["z"], ["logp"], axis=-1),
            helper.make_node("Mul", ["logp", "onehot"], ["picked"]),
            helper.make_node("ReduceSum", ["picked"], ["total"], keepdims=0),
            helper.make_node("Neg", ["total"], ["loss"]),
        ],
        "ce",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 5]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [5]),
            helper.make_tensor_value_info("onehot", TensorProto.DOUBLE, ["batch", 5]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )
    got = check_model_gradient(model, {"x": x, "w": w, "onehot": onehot}, ["x", "w"])
    wt = torch.tensor(w, requires_grad=True)
    loss = -(torch.log_softmax(torch.tensor(x) * wt, dim=-1) * torch.tensor(onehot)).sum()
    loss.backward()
    np.testing.assert_allclose(got["w"], wt.grad.numpy(), rtol=1e-6, atol=1e-9)


def _attention_probabilities(dtype=TensorProto.DOUBLE):
    """``loss = sum(Where(IsNaN(y), 0, y) * w)``, ``y = Softmax(x)``: the form of a boolean-masked
    ``scaled_dot_product_attention`` exported by torch.onnx."""
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["y"], axis=-1),
            helper.make_node("IsNaN", ["y"], ["empty"]),
            helper.make_node("Where", ["empty", "zero", "y"], ["z"]),
            helper.make_node("Mul", ["z", "w"], ["zw"]),
            helper.make_node("ReduceSum", ["zw"], ["loss"], keepdims=0),
        ],
        "sdpa",
        [
            helper.make_tensor_value_info("x", dtype, ["batch", 3, 4]),
            helper.make_tensor_value_info("w", dtype, [3, 4]),
        ],
        [helper.make_tensor_value_info("loss", dtype, [])],
        [helper.make_tensor("zero", dtype, [], [0.0])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )


def test_softmax_of_masked_attention_reads_the_zeroed_probabilities(monkeypatch):
    """The gradient reads ``Where(IsNaN(y), 0, y)`` and not ``y``; its values are the general
    form's bit for bit (NaN rows included) and float64 torch's."""
    import traingraph.autodiff.rules.softmax as rules
    from traingraph.autodiff import build_gradient_graph

    x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 4))
    x[0, 1] = -np.inf  # a row its mask empties
    x[1, 2, :2] = -np.inf
    feeds = {"x": x, "w": w}
    model = _attention_probabilities()
    grad_model = build_gradient_graph(model, wrt=["x", "w"], loss="loss")
    readers = [n.op_type for n in grad_model.graph.node if "y" in n.input]
    assert sorted(readers) == ["IsNaN", "Where"]
    got = session(grad_model).run(["x_grad", "w_grad"], feeds)

    monkeypatch.setattr(rules, "_nan_rows_zeroed", lambda g, y: None)
    general = build_gradient_graph(model, wrt=["x", "w"], loss="loss")
    assert any("y" in n.input and n.op_type == "Mul" for n in general.graph.node)
    expected = session(general).run(["x_grad", "w_grad"], feeds)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, e)
    assert np.isnan(got[0][0, 1]).all() and np.isfinite(got[0][1]).all()

    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = torch.softmax(xt, dim=-1)
    (torch.where(torch.isnan(y), 0.0, y) * wt).sum().backward()
    np.testing.assert_allclose(got[0], xt.grad.numpy(), rtol=1e-12, atol=1e-14, equal_nan=True)
    np.testing.assert_allclose(got[1], wt.grad.numpy(), rtol=1e-12, atol=1e-14)
