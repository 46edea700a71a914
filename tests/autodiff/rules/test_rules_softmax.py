"""Gradients of Softmax and LogSoftmax against finite differences and torch."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from gradcheck import check_model_gradient, check_op_gradient
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
