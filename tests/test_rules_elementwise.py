import numpy as np
import pytest
import torch
from gradcheck import check_op_gradient

rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape)


BINARY = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Div": torch.div,
}


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
@pytest.mark.parametrize(
    "shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (2, 3))]
)
def test_binary_broadcast(op, dynamic, shapes):
    a, b = r(*shapes[0]), r(*shapes[1])
    if op == "Div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    check_op_gradient(op, {"a": a, "b": b}, dynamic=dynamic, torch_fn=BINARY[op])


UNARY = {
    "Neg": (torch.neg, None),
    "Relu": (torch.relu, None),
    "Exp": (torch.exp, None),
    "Log": (torch.log, "positive"),
    "Tanh": (torch.tanh, None),
    "Sigmoid": (torch.sigmoid, None),
    "Identity": (lambda x: x, None),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op):
    fn, domain = UNARY[op]
    x = r(2, 3, 4)
    if domain == "positive":
        x = np.abs(x) + 0.5
    check_op_gradient(op, {"x": x}, torch_fn=fn)
