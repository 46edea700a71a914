import numpy as np
import onnx
import pytest
import torch

from gradcheck import check_op_gradient, make_op_model, session
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)


def r(*shape):
    return rng.standard_normal(shape)


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)),
    ((1, 3, 4), (2, 4, 5)),
    ((2, 3, 4), (1, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((4,), (4, 5)),
    ((4,), (2, 4, 5)),
    ((3, 4), (4,)),
    ((2, 3, 4), (4,)),
    ((4,), (4,)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_matmul(shapes, dynamic):
    a, b = r(*shapes[0]), r(*shapes[1])
    check_op_gradient("MatMul", {"a": a, "b": b}, dynamic=dynamic, torch_fn=torch.matmul)


@pytest.mark.parametrize("opset", [13, 26])
@pytest.mark.parametrize("shapes", [((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 6))], ids=str)
def test_matmul_opsets(opset, shapes):
    a, b = r(*shapes[0]), r(*shapes[1])
    check_op_gradient("MatMul", {"a": a, "b": b}, opset=opset, torch_fn=torch.matmul)


def test_matmul_float32():
    # float32: the gradient graph keeps the model's dtype. Central differences in float32 round
    # at ~1e-7 * |loss| / eps; the loss is linear in each operand, so a large step is exact.
    a, b = r(2, 3, 4).astype(np.float32), r(4, 5).astype(np.float32)
    check_op_gradient(
        "MatMul", {"a": a, "b": b}, dynamic="all", torch_fn=torch.matmul,
        eps=1e-1, rtol=2e-3, atol=1e-4,
    )


@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_matmul_weight_gradient_is_one_matrix_product(dynamic):
    """For a [B, T, K] activation times a [K, N] weight, dW is one [B*T, K]^T @ [B*T, N] Gemm
    (no batched MatMul followed by a ReduceSum), and equals that batched form."""
    a, w = r(2, 3, 4), r(4, 5)
    model = make_op_model("MatMul", {"a": a, "w": w}, dynamic=dynamic)
    model.graph.node.append(onnx.helper.make_node("ReduceSum", ["y0"], ["loss"], keepdims=0))
    grad_model = build_gradient_graph(model, wrt=["w"], loss="loss")
    ops = [n.op_type for n in grad_model.graph.node]
    assert ops.count("Gemm") == 1
    assert "MatMul" not in ops[1:]
    assert ops.count("ReduceSum") == 1  # the loss itself
    got = session(grad_model).run(["w_grad"], {"a": a, "w": w})[0]
    g = np.ones((2, 3, 5))
    batched = np.matmul(a.transpose(0, 2, 1), g).sum(axis=0)
    np.testing.assert_allclose(got, batched, rtol=1e-12)


GEMM_C_SHAPES = [None, (), (1,), (5,), (3, 1), (1, 5), (3, 5)]


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", GEMM_C_SHAPES, ids=str)
def test_gemm(trans_a, trans_b, c_shape):
    m, k, n = 3, 4, 5
    a = r(k, m) if trans_a else r(m, k)
    b = r(n, k) if trans_b else r(k, n)
    inputs = {"a": a, "b": b}
    if c_shape is not None:
        inputs["c"] = r(*c_shape)
    alpha, beta = 0.7, -1.3
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}

    def gemm(ta, tb, tc=None):
        y = alpha * (ta.T if trans_a else ta) @ (tb.T if trans_b else tb)
        return y if tc is None else y + beta * tc

    # Every dynamic form, spread over the C shapes.
    dynamic = ["none", "batch", "all"][GEMM_C_SHAPES.index(c_shape) % 3]
    check_op_gradient("Gemm", inputs, attrs, dynamic=dynamic, torch_fn=gemm)


@pytest.mark.parametrize("opset", [13, 26])
def test_gemm_defaults(opset):
    inputs = {"a": r(3, 4), "b": r(4, 5), "c": r(5)}
    check_op_gradient(
        "Gemm", inputs, opset=opset, dynamic="all", torch_fn=lambda a, b, c: a @ b + c
    )


EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bij,jk->bik", [(2, 3, 4), (4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ijk->i", [(2, 3, 4)]),
    ("i,i->", [(4,), (4,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,kl->ik", [(2, 3), (4, 5)]),
    ("bij,jk->bk", [(2, 3, 4), (4, 5)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    ("bQ,QK->Kb", [(2, 3), (3, 4)]),
    ("ij,->ij", [(3, 4), ()]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(1, 3, 4), (5, 4, 2)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 5, 4, 6)]),
    ("...ij,jk->...ik", [(2, 3, 4), (4, 5)]),
    ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
    ("i...j,j->i...", [(2, 3, 4), (4,)]),
    ("...i,...i->...", [(2, 1, 4), (1, 3, 4)]),
]


@pytest.mark.parametrize("equation,shapes", EINSUM, ids=[e for e, _ in EINSUM])
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_einsum(equation, shapes, dynamic):
    names = "abcd"
    inputs = {names[i]: r(*s) for i, s in enumerate(shapes)}
    check_op_gradient(
        "Einsum", inputs, {"equation": equation}, dynamic=dynamic,
        torch_fn=lambda *t: torch.einsum(equation, *t),
    )


@pytest.mark.parametrize("opset", [13, 26])
def test_einsum_opsets(opset):
    check_op_gradient(
        "Einsum", {"a": r(2, 3, 4), "b": r(4, 5)}, {"equation": "bij,jk->bk"}, opset=opset,
        torch_fn=lambda a, b: torch.einsum("bij,jk->bk", a, b),
    )


def test_einsum_diagonal_of_another_operand():
    """A repeated letter in one operand still lets the other operands have gradients."""
    check_op_gradient(
        "Einsum", {"a": r(3, 3), "b": r(3)}, {"equation": "ii,i->i"}, wrt=["b"],
        torch_fn=lambda a, b: torch.einsum("ii,i->i", a, b),
    )


def test_einsum_diagonal_is_unsupported_for_its_operand():
    model = make_op_model("Einsum", {"a": r(3, 3), "b": r(3)}, {"equation": "ii,i->i"})
    with pytest.raises(GradientNotImplementedError, match=r"'ii,i->i'.*repeats a letter"):
        build_gradient_graph(model, wrt=["a"], loss="y0")


def test_einsum_summed_ellipsis_is_unsupported():
    model = make_op_model("Einsum", {"a": r(2, 3, 4)}, {"equation": "...i->i"})
    with pytest.raises(GradientNotImplementedError, match=r"'...i->i' sums over its ellipsis"):
        build_gradient_graph(model, wrt=["a"], loss="y0")
