"""Gradients of elementwise ops, activations and selections against finite differences and torch.

onnxruntime has no float64 kernel for Erf, Elu, Selu, Celu, Softplus, Softsign, HardSigmoid,
HardSwish, Gelu and Mean; those ops are checked in float32 with the looser ``F32`` tolerances
(a float32 loss carries about 1e-7 relative rounding error, which a difference quotient with a
small step magnifies: a step of 1e-2 keeps that under 1e-4 while the truncation error of the
central difference stays near 1e-5; test points stay further than the step from any kink).
"""

from functools import reduce

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from gradcheck import (
    add_weighted_sum_loss,
    check_model_gradient,
    check_op_gradient,
    make_op_model,
    session,
)
from traingraph.autodiff import build_gradient_graph, differentiate
from traingraph.errors import GradientNotImplementedError
from traingraph.ir.model import max_ir_version

rng = np.random.default_rng(0)

F32 = {"eps": 1e-2, "rtol": 2e-3, "atol": 3e-4}
DYNAMIC = ["none", "batch", "all"]


def r(*shape):
    return rng.standard_normal(shape)


def away(*shape, gap=0.2):
    """Random values at least ``gap`` away from 0 (clear of the kinks of Relu-like ops)."""
    x = r(*shape)
    return np.sign(x) * (np.abs(x) + gap)


def grid(lo, hi, shape=(2, 3, 4)):
    """Evenly spread values in [lo, hi], shuffled; none is 0 for a symmetric range."""
    values = np.linspace(lo, hi, int(np.prod(shape)))
    return rng.permutation(values).reshape(shape)


# --------------------------------------------------------------------------- binary arithmetic

BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}
BROADCASTS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (2, 3))]


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("shapes", BROADCASTS)
def test_binary_broadcast(op, dynamic, shapes):
    a, b = r(*shapes[0]), r(*shapes[1])
    if op == "Div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    check_op_gradient(op, {"a": a, "b": b}, dynamic=dynamic, torch_fn=BINARY[op])


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("opset", [13, 14, 26])
def test_binary_opsets(op, opset):
    a, b = r(2, 3), away(3)
    check_op_gradient(op, {"a": a, "b": b}, opset=opset, torch_fn=BINARY[op])


def scalar_loss_model(nodes, inputs, opset=17):
    """A model of ``nodes`` whose last node writes the scalar ``loss``; ``inputs`` are
    ``(name, TensorProto type, shape)``."""
    graph = helper.make_graph(
        nodes,
        "model",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("loss", inputs[0][1], [])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=max_ir_version()
    )


def sum_gradients(op, inputs, wrt, attrs=None, opset=17):
    """The gradients of ``sum(op(*inputs))`` with respect to ``wrt``, run by onnxruntime."""
    model = make_op_model(op, inputs, attrs, opset=opset, dynamic="none")
    model.graph.node.append(helper.make_node("ReduceSum", ["y0"], ["loss"], keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    grad = session(build_gradient_graph(model, wrt, loss="loss"))
    return grad.run([f"{x}_grad" for x in wrt], inputs)


def test_mul_same_input_twice():
    """``x * x``: both input slots are the same tensor; their gradients add up to 2 x."""
    x = r(2, 3)
    model = scalar_loss_model(
        [
            helper.make_node("Mul", ["x", "x"], ["y"]),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ],
        [("x", TensorProto.DOUBLE, ["n", 3])],
    )
    got = check_model_gradient(model, {"x": x}, ["x"])
    np.testing.assert_allclose(got["x"], 2 * x)


# --------------------------------------------------------------------------- Pow


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("shapes", BROADCASTS)
def test_pow_base_and_exponent(dynamic, shapes):
    a = np.abs(r(*shapes[0])) + 0.3
    p = r(*shapes[1])
    check_op_gradient("Pow", {"a": a, "p": p}, dynamic=dynamic, torch_fn=torch.pow)


@pytest.mark.parametrize("opset", [13, 15, 26])
def test_pow_opsets(opset):
    a, p = np.abs(r(2, 3)) + 0.3, r(3)
    check_op_gradient("Pow", {"a": a, "p": p}, opset=opset, torch_fn=torch.pow)


@pytest.mark.parametrize(
    "exponent, base",
    [
        (2.0, "any"),
        (3.0, "any"),
        (-1.0, "any"),
        (0.0, "any"),
        (0.5, "positive"),
        (-1.5, "positive"),
        ([1.0, 2.0, 0.0, -2.0], "any"),
    ],
)
def test_pow_constant_exponent(exponent, base):
    a = away(3, 4, gap=0.3)
    if base == "positive":
        a = np.abs(a)
    p = np.asarray(exponent, dtype=np.float64)
    check_op_gradient(
        "Pow", {"a": a, "p": p}, const_inputs=["p"],
        torch_fn=lambda t: torch.pow(t, torch.tensor(p)),
    )


@pytest.mark.parametrize("const", [False, True])
def test_pow_integer_exponent_negative_base(const):
    """An int64 exponent carries no gradient; the base's is p a^(p-1), also for a < 0."""
    a = away(2, 4, gap=0.3)
    p = np.array([3, 2, 0, 1], dtype=np.int64)
    check_op_gradient(
        "Pow",
        {"a": a, "p": p},
        const_inputs=["p"] if const else [],
        torch_fn=(lambda t: torch.pow(t, torch.tensor(p))) if const else torch.pow,
    )


def test_pow_float64_exponent_of_float32_base():
    """The exponent's gradient comes back in the exponent's own dtype."""
    a = (np.abs(r(3, 4)) + 0.3).astype(np.float32)
    p = r(4)
    got = check_op_gradient("Pow", {"a": a, "p": p}, torch_fn=torch.pow, **F32)
    assert got["a"].dtype == np.float32
    assert got["p"].dtype == np.float64


def test_pow_base_zero():
    """At a = 0 with p > 0 the exponent's gradient is 0 (not 0 * log 0), as in torch."""
    a = np.array([[0.0, 0.5, 2.0], [1.5, 0.0, 0.7]])
    p = np.array([1.5, 2.5, 0.5])
    got = check_op_gradient("Pow", {"a": a, "p": p}, wrt=["p"], torch_fn=torch.pow)
    assert np.all(np.isfinite(got["p"]))


def test_pow_zero_exponent_at_zero_base():
    """d(a^0)/da at a = 0 is 0, not 0 * 0^-1 = nan (torch's rule)."""
    a = np.array([0.0, 1.0, -2.0])
    p = np.array([0.0, 0.0, 0.0])
    (da,) = sum_gradients("Pow", {"a": a, "p": p}, ["a"])
    np.testing.assert_array_equal(da, [0.0, 0.0, 0.0])


# --------------------------------------------------------------------------- unary math

UNARY = {
    "Neg": (torch.neg, "any"),
    "Abs": (torch.abs, "away"),
    "Sqrt": (torch.sqrt, "positive"),
    "Reciprocal": (torch.reciprocal, "away"),
    "Exp": (torch.exp, "any"),
    "Log": (torch.log, "positive"),
    "Sin": (torch.sin, "any"),
    "Cos": (torch.cos, "any"),
    "Tanh": (torch.tanh, "any"),
    "Sigmoid": (torch.sigmoid, "any"),
    "Relu": (torch.relu, "away"),
    "LeakyRelu": (F.leaky_relu, "away"),
    "Mish": (F.mish, "any"),
    "Identity": (lambda x: x, "any"),
}


def unary_input(domain, shape=(2, 3, 4)):
    if domain == "positive":
        return np.abs(r(*shape)) + 0.5
    if domain == "away":
        return away(*shape)
    return r(*shape)


@pytest.mark.parametrize("op", sorted(UNARY))
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_unary(op, dynamic):
    """At opset 18, where every op of the table (Mish included) exists."""
    fn, domain = UNARY[op]
    check_op_gradient(op, {"x": unary_input(domain)}, opset=18, dynamic=dynamic, torch_fn=fn)


# Ops run by onnxruntime in float32 only: (torch function, input domain).
UNARY_F32 = {
    "Erf": (torch.erf, "any"),
    "Elu": (F.elu, "away"),
    "Selu": (torch.selu, "away"),
    "Celu": (F.celu, "away"),
    "Softplus": (F.softplus, "any"),
    "Softsign": (F.softsign, "away"),
    "HardSwish": (F.hardswish, "hardswish"),
}


@pytest.mark.parametrize("op", sorted(UNARY_F32))
@pytest.mark.parametrize(
    "opset, dynamic", [(14, "none"), (14, "batch"), (14, "all"), (22, "batch"), (26, "all")]
)
def test_unary_float32(op, opset, dynamic):
    """Opset 14 is the first with HardSwish; opset 22 gave most of these ops new versions."""
    fn, domain = UNARY_F32[op]
    x = grid(-4.5, 4.5) if domain == "hardswish" else unary_input(domain)
    check_op_gradient(
        op, {"x": x.astype(np.float32)}, opset=opset, dynamic=dynamic, torch_fn=fn, **F32
    )


def test_mish_wide_range():
    """Mish's gradient stays accurate where exp(x) overflows or underflows."""
    x = np.array([-800.0, -40.0, -12.0, -3.0, -0.5, 0.0, 0.4, 3.0, 15.0, 40.0, 800.0])
    (got,) = sum_gradients("Mish", {"x": x}, ["x"], opset=18)
    t = torch.tensor(x, requires_grad=True)
    F.mish(t).sum().backward()
    # onnxruntime's float64 Sigmoid is exact to ~1e-16 absolute, not relative (it gives 0 at -40).
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-15)
    # A central difference of a loss of size 800 carries ~1e-7 of rounding.
    check_op_gradient("Mish", {"x": x}, opset=18, torch_fn=F.mish, atol=2e-7)


@pytest.mark.parametrize("opset", [13, 14, 16, 26])
@pytest.mark.parametrize("op", ["Relu", "Sigmoid", "Identity", "Neg", "Abs"])
def test_unary_opsets(op, opset):
    fn, domain = UNARY[op]
    check_op_gradient(op, {"x": unary_input(domain, (3, 4))}, opset=opset, torch_fn=fn)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_relu_kink_and_signed_zeros_match_torch(dtype):
    """At ``x = 0`` (either sign) and below, the gradient is 0, as in torch; above, ``g``."""
    x = np.array([-2.0, -0.0, 0.0, 1e-30, 3.0, -1e-30], dtype=dtype)
    g = np.array([1.5, 2.0, -3.0, -4.0, 5.0, 6.0], dtype=dtype)
    model = make_op_model("Relu", {"x": x}, dynamic="none")
    weighted = add_weighted_sum_loss(model, ["y0"], [x])
    (got,) = session(build_gradient_graph(weighted, ["x"], loss="loss")).run(
        ["x_grad"], {"x": x, "w_y0": g}
    )
    t = torch.tensor(x, requires_grad=True)
    (torch.relu(t) * torch.tensor(g)).sum().backward()
    np.testing.assert_array_equal(got, t.grad.numpy())


# --------------------------------------------------------------------------- attributes


@pytest.mark.parametrize("alpha", [0.01, 0.2, -0.5])
def test_leaky_relu_alpha(alpha):
    check_op_gradient(
        "LeakyRelu", {"x": away(3, 4)}, {"alpha": alpha}, opset=16,
        torch_fn=lambda t: F.leaky_relu(t, alpha),
    )


@pytest.mark.parametrize("opset", [13, 16, 26])
def test_leaky_relu_opsets(opset):
    """onnxruntime runs LeakyRelu in float64 at opsets 16 to 18 only: float32 elsewhere."""
    x = away(3, 4).astype(np.float32)
    check_op_gradient(
        "LeakyRelu", {"x": x}, {"alpha": 0.1}, opset=opset,
        torch_fn=lambda t: F.leaky_relu(t, 0.1), **F32,
    )


@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_elu_alpha(alpha):
    x = away(3, 4).astype(np.float32)
    check_op_gradient(
        "Elu", {"x": x}, {"alpha": alpha}, torch_fn=lambda t: F.elu(t, alpha), **F32
    )


@pytest.mark.parametrize("alpha, gamma", [(1.6732632, 1.050701), (1.0, 2.0), (0.5, 0.8)])
def test_selu_alpha_gamma(alpha, gamma):
    x = away(3, 4).astype(np.float32)
    check_op_gradient(
        "Selu", {"x": x}, {"alpha": alpha, "gamma": gamma},
        torch_fn=lambda t: gamma * F.elu(t, alpha), **F32,
    )


@pytest.mark.parametrize("alpha", [1.0, 0.5, 3.0])
def test_celu_alpha(alpha):
    x = away(3, 4).astype(np.float32)
    check_op_gradient(
        "Celu", {"x": x}, {"alpha": alpha}, torch_fn=lambda t: F.celu(t, alpha), **F32
    )


@pytest.mark.parametrize(
    "alpha, beta", [(0.2, 0.5), (1 / 6, 0.5), (0.5, 0.1), (-0.3, 0.6)]
)
def test_hard_sigmoid(alpha, beta):
    """Values stay clear of the two corners, where alpha x + beta is 0 or 1."""
    x = grid(-5.0, 5.0)
    corners = np.array([-beta / alpha, (1 - beta) / alpha])
    x = x[np.abs(x[..., None] - corners).min(-1) > 0.05].reshape(-1, 1).astype(np.float32)
    attrs = {"alpha": alpha, "beta": beta}
    if (alpha, beta) == (1 / 6, 0.5):
        fn = F.hardsigmoid
    else:
        def fn(t):
            return torch.clamp(alpha * t + beta, 0.0, 1.0)
    check_op_gradient("HardSigmoid", {"x": x}, attrs, torch_fn=fn, **F32)


@pytest.mark.parametrize("opset", [20, 26])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_gelu(opset, approximate, dynamic):
    x = grid(-5.0, 5.0).astype(np.float32)
    check_op_gradient(
        "Gelu", {"x": x}, {"approximate": approximate}, opset=opset, dynamic=dynamic,
        torch_fn=lambda t: F.gelu(t, approximate=approximate), **F32,
    )


def test_gelu_unknown_mode_is_refused():
    x = np.ones((2, 3), np.float32)
    model = make_op_model("Gelu", {"x": x}, {"approximate": "erf"}, opset=20)
    with pytest.raises(GradientNotImplementedError, match="approximate='erf'"):
        build_gradient_graph(model, ["x"], loss="y0")


def prelu_torch(t, s):
    return torch.where(t > 0, t, s * t)


@pytest.mark.parametrize("slope_shape", [(2, 3, 4, 2), (2,), (1,), (3, 1, 1), (4, 1)])
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_prelu_slope_broadcast(slope_shape, dynamic):
    x, s = away(2, 3, 4, 2), r(*slope_shape)
    check_op_gradient(
        "PRelu", {"x": x, "s": s}, opset=16, dynamic=dynamic, torch_fn=prelu_torch
    )


@pytest.mark.parametrize("opset", [13, 16, 26])
def test_prelu_matches_torch_channel_slope(opset):
    """ONNX's per-channel slope of shape (C, 1, 1) is torch.nn.functional.prelu's weight (C,).

    onnxruntime runs PRelu in float64 at opsets 16 to 18 only: float32 elsewhere.
    """
    x, s = away(2, 3, 2, 2), r(3, 1, 1)
    tol = {}
    if not 16 <= opset <= 18:
        x, s, tol = x.astype(np.float32), s.astype(np.float32), F32
    check_op_gradient(
        "PRelu", {"x": x, "s": s}, opset=opset,
        torch_fn=lambda t, w: F.prelu(t, w.reshape(-1)), **tol,
    )


# --------------------------------------------------------------------------- Clip


def clip_input(shape=(3, 4)):
    """Values at least 0.1 away from the bounds -0.5 and 0.6 used below."""
    x = grid(-2.0, 2.0, shape)
    x[np.abs(x + 0.5) < 0.1] += 0.25
    x[np.abs(x - 0.6) < 0.1] += 0.25
    return x


@pytest.mark.parametrize("bounds", ["none", "min", "max", "both"])
@pytest.mark.parametrize("const", [False, True])
@pytest.mark.parametrize("opset", [13, 26])
def test_clip(bounds, const, opset):
    x = clip_input()
    lo = np.array(-0.5) if bounds in ("min", "both") else None
    hi = np.array(0.6) if bounds in ("max", "both") else None
    inputs = {"x": x, "min": lo, "max": hi}
    given = [k for k, v in inputs.items() if v is not None]

    def fn(*tensors):
        named = dict(zip(given if not const else ["x"], tensors))
        if lo is None and hi is None:
            return named["x"]
        return torch.clamp(
            named["x"],
            named.get("min", None if lo is None else torch.tensor(lo)),
            named.get("max", None if hi is None else torch.tensor(hi)),
        )

    check_op_gradient(
        "Clip", inputs, opset=opset, const_inputs=["min", "max"] if const else [], torch_fn=fn
    )


@pytest.mark.parametrize("dynamic", ["batch", "all"])
def test_clip_dynamic(dynamic):
    x = clip_input((4, 3))
    check_op_gradient(
        "Clip", {"x": x, "min": np.array(-0.5), "max": np.array(0.6)}, dynamic=dynamic,
        torch_fn=torch.clamp,
    )


def test_clip_min_above_max():
    """min > max makes every output max: the whole gradient goes to max, as in torch.clamp."""
    got = check_op_gradient(
        "Clip", {"x": clip_input(), "min": np.array(0.7), "max": np.array(-0.4)},
        torch_fn=torch.clamp,
    )
    assert np.all(got["x"] == 0.0)
    assert got["min"] == 0.0


# --------------------------------------------------------------------------- Max, Min


EXTREMA = {"Max": torch.maximum, "Min": torch.minimum}
VARIADIC_SHAPES = [[(3, 4)], [(3, 4), (3, 4)], [(2, 3, 4), (4,), (3, 1)], [(1,), (2, 3), (2, 1)]]


@pytest.mark.parametrize("op", sorted(EXTREMA))
@pytest.mark.parametrize("shapes", VARIADIC_SHAPES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_max_min_variadic(op, shapes, dynamic):
    """Random inputs: no ties."""
    inputs = {f"x{i}": r(*shape) for i, shape in enumerate(shapes)}
    check_op_gradient(
        op, inputs, dynamic=dynamic, torch_fn=lambda *ts: reduce(EXTREMA[op], ts)
    )


@pytest.mark.parametrize("op", sorted(EXTREMA))
@pytest.mark.parametrize("opset", [13, 26])
def test_max_min_opsets(op, opset):
    check_op_gradient(
        op, {"a": r(2, 3), "b": r(3)}, opset=opset, torch_fn=EXTREMA[op]
    )


@pytest.mark.parametrize("op", sorted(EXTREMA))
def test_max_min_two_way_ties_split_evenly(op):
    """Tied inputs each receive g / 2, like torch.maximum / torch.minimum (and the central
    difference, which also sees half a slope at a tie)."""
    a = r(3, 4)
    b = np.where(rng.random((3, 4)) < 0.5, a, r(3, 4))
    check_op_gradient(op, {"a": a, "b": b}, torch_fn=EXTREMA[op])


def test_max_three_way_tie_splits_in_thirds():
    """Where k inputs tie for the maximum, each receives g / k."""
    x, c = np.array([[1.0, 2.0], [3.0, -1.0]]), np.array([1.0, 0.0])
    ga, gb, gc = sum_gradients("Max", {"a": x, "b": x, "c": c}, ["a", "b", "c"])
    np.testing.assert_allclose(ga, [[1 / 3, 1 / 2], [1 / 2, 0.0]])
    np.testing.assert_allclose(gb, ga)
    np.testing.assert_allclose(gc, [1 / 3, 1.0])


# --------------------------------------------------------------------------- Sum, Mean, Where


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_sum_variadic(shapes, dynamic):
    inputs = {f"x{i}": r(*shape) for i, shape in enumerate(shapes)}
    check_op_gradient(
        "Sum", inputs, dynamic=dynamic, torch_fn=lambda *ts: reduce(torch.add, ts)
    )


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_mean_variadic(shapes, dynamic):
    inputs = {f"x{i}": r(*shape).astype(np.float32) for i, shape in enumerate(shapes)}
    check_op_gradient(
        "Mean", inputs, dynamic=dynamic,
        torch_fn=lambda *ts: reduce(torch.add, ts) / len(ts), **F32,
    )


@pytest.mark.parametrize(
    "shapes", [((3, 4), (3, 4), (3, 4)), ((2, 1, 4), (3, 1), (1,)), ((4,), (2, 3, 1), (3, 4))]
)
@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("opset", [13, 16])
def test_where(shapes, dynamic, opset):
    cond = rng.random(shapes[0]) < 0.5
    check_op_gradient(
        "Where", {"c": cond, "a": r(*shapes[1]), "b": r(*shapes[2])}, opset=opset,
        dynamic=dynamic, torch_fn=torch.where,
    )


# --------------------------------------------------------------------------- Cast, CastLike


@pytest.mark.parametrize(
    "src, dst, to",
    [
        (np.float64, torch.float32, TensorProto.FLOAT),
        (np.float32, torch.float64, TensorProto.DOUBLE),
        (np.float64, torch.float64, TensorProto.DOUBLE),
    ],
)
@pytest.mark.parametrize("opset", [13, 19, 21, 26])
def test_cast_between_floats(src, dst, to, opset):
    """A float32 end makes the loss or the step float32: float32 tolerances for those."""
    x = r(3, 4).astype(src)
    tol = {} if src == np.float64 and to == TensorProto.DOUBLE else F32
    check_op_gradient(
        "Cast", {"x": x}, {"to": to}, opset=opset, torch_fn=lambda t: t.to(dst), **tol
    )


@pytest.mark.parametrize("opset", [15, 26])
def test_cast_like(opset):
    x, like = r(3, 4).astype(np.float32), np.zeros((1,), np.float64)
    check_op_gradient(
        "CastLike", {"x": x, "like": like}, opset=opset, wrt=["x"],
        torch_fn=lambda t, _: t.to(torch.float64), **F32,
    )


def test_cast_to_integer_gives_no_gradient():
    """loss = sum(w x) + sum(Cast(Cast(x, int64), double)): only the first term has a gradient."""
    model = scalar_loss_model(
        [
            helper.make_node("Mul", ["x", "w"], ["wx"]),
            helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
            helper.make_node("Cast", ["xi"], ["xf"], to=TensorProto.DOUBLE),
            helper.make_node("Add", ["wx", "xf"], ["s"]),
            helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
        ],
        [("x", TensorProto.DOUBLE, ["n", 4]), ("w", TensorProto.DOUBLE, [4])],
    )
    x, w = away(3, 4) * 3 + 0.37, r(4)
    got = check_model_gradient(model, {"x": x, "w": w}, ["x", "w"])
    np.testing.assert_allclose(got["x"], np.broadcast_to(w, x.shape))


# --------------------------------------------------------------------------- non-differentiable ops


@pytest.mark.parametrize("opset", [13, 22])
def test_rounding_ops_give_zero_gradient(opset):
    """Floor, Ceil, Round and Sign count as constants: loss = sum(w x + sum_k op_k(x)) has the
    gradient w, and the model differentiates without a missing-rule error."""
    ops = ["Floor", "Ceil", "Round", "Sign"]
    nodes = [helper.make_node("Mul", ["x", "w"], ["wx"])]
    nodes += [helper.make_node(op, ["x"], [f"{op}_y"]) for op in ops]
    nodes += [
        helper.make_node("Sum", ["wx"] + [f"{op}_y" for op in ops], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
    ]
    model = scalar_loss_model(
        nodes, [("x", TensorProto.DOUBLE, ["n", 4]), ("w", TensorProto.DOUBLE, [4])], opset
    )
    x = rng.uniform(-3, 3, (3, 4))
    x[np.abs(x - np.round(x)) < 0.1] += 0.2
    x[np.abs(np.abs(x - np.floor(x)) - 0.5) < 0.1] += 0.2
    w = r(4)
    got = check_model_gradient(model, {"x": x, "w": w}, ["x"])
    np.testing.assert_allclose(got["x"], np.broadcast_to(w, x.shape))
    onnx.checker.check_model(build_gradient_graph(model, ["x"]), full_check=True)


# --------------------------------------------------------------------------- unknown dtypes


def test_rules_on_values_of_unknown_dtype():
    """Where shape inference left the intermediate dtypes unknown, the constants the rules
    emit take the dtype of the values at run time (float32 here, not numpy's float64)."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("LeakyRelu", ["s"], ["l"], alpha=0.3),
        helper.make_node("Tanh", ["l"], ["t"]),
        helper.make_node("Sub", ["t", "x"], ["d"]),
        helper.make_node("Relu", ["d"], ["r"]),
        helper.make_node("Mish", ["r"], ["m"]),
        helper.make_node("Softmax", ["m"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss_all"], keepdims=0),
        helper.make_node("Mul", ["loss_all", "x"], ["scaled"]),
        helper.make_node("ReduceSum", ["scaled"], ["loss"], keepdims=0),
    ]
    model = scalar_loss_model(nodes, [("x", TensorProto.FLOAT, [2, 3])], opset=18)
    m = ir.from_proto(model)
    for node in m.graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.type, value.shape = None, None
    result = differentiate(m.graph, 18, [m.graph.inputs[0]], loss=m.graph.outputs[0])
    grad = result.grads["x"]
    grad.name = "x_grad"
    m.graph.outputs.append(grad)
    x = (r(2, 3) * 0.5).astype(np.float32)
    (got,) = session(ir.to_proto(m)).run(["x_grad"], {"x": x})
    t = torch.tensor(x, requires_grad=True)
    d = torch.relu(torch.tanh(F.leaky_relu(torch.sigmoid(t), 0.3)) - t)
    (torch.softmax(F.mish(d), -1).sum() * t).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-6)


def _random_broadcast_pair(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast together: a random output shape, each side dropping leading
    dimensions and setting random dimensions to 1."""
    out = tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(1, 5)))

    def side() -> tuple[int, ...]:
        keep = out[rng.integers(0, len(out)) :] if rng.random() < 0.5 else out
        return tuple(1 if rng.random() < 0.4 else d for d in keep) or (1,)

    return side(), side()


@pytest.mark.parametrize("seed", range(12))
def test_randomized_broadcast_shapes(seed):
    rng = np.random.default_rng(100 + seed)
    sa, sb = _random_broadcast_pair(rng)
    op = ["Add", "Sub", "Mul", "Div"][seed % 4]
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    if op == "Div":
        b = np.sign(b) * (np.abs(b) + 0.5)
    dynamic = ["none", "batch", "all"][seed % 3]
    check_op_gradient(op, {"a": a, "b": b}, dynamic=dynamic, torch_fn=BINARY[op])
