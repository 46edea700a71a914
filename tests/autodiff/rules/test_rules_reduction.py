import numpy as np
import pytest
import torch

from gradcheck import (
    add_weighted_sum_loss,
    check_model_gradient,
    check_op_gradient,
    compare_with_torch,
    make_op_model,
    session,
)
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)

SHAPE = (2, 3, 4)


def r(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.uniform(0.5, 1.5, shape)


def _prod(x, dims, keepdim):
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, dim=d, keepdim=keepdim)
    return x


# op -> (torch reduction(x, dims, keepdim), torch elementwise part for a reduction over no axis)
REDUCE = {
    "ReduceSum": (lambda x, d, k: x.sum(dim=d, keepdim=k), lambda x: x),
    "ReduceMean": (lambda x, d, k: x.mean(dim=d, keepdim=k), lambda x: x),
    "ReduceMax": (lambda x, d, k: torch.amax(x, dim=d, keepdim=k), lambda x: x),
    "ReduceMin": (lambda x, d, k: torch.amin(x, dim=d, keepdim=k), lambda x: x),
    "ReduceSumSquare": (lambda x, d, k: (x * x).sum(dim=d, keepdim=k), lambda x: x * x),
    "ReduceL1": (lambda x, d, k: x.abs().sum(dim=d, keepdim=k), torch.abs),
    "ReduceL2": (lambda x, d, k: torch.linalg.vector_norm(x, 2, dim=d, keepdim=k), torch.abs),
    "ReduceLogSumExp": (lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k), lambda x: x),
    "ReduceProd": (_prod, lambda x: x),
    "ReduceLogSum": (lambda x, d, k: torch.log(x.sum(dim=d, keepdim=k)), torch.log),
}


def _data(op, shape=SHAPE):
    return positive(*shape) if op == "ReduceLogSum" else r(*shape)


def _axes_as_input(op, opset):
    return op == "ReduceSum" or opset >= 18


def _node(op, opset, axes, keepdims, **attrs):
    """Inputs, attributes and constant inputs of a Reduce* node in the form of ``opset``."""
    attrs = {"keepdims": keepdims, **attrs}
    if _axes_as_input(op, opset):
        inputs = {"axes": None if axes is None else np.array(axes, dtype=np.int64)}
        return inputs, attrs, ["axes"]
    if axes is not None:
        attrs["axes"] = axes
    return {}, attrs, []


AXES = [None, [1], [-1], [0, -1]]


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("opset", [13, 17, 18, 26])
@pytest.mark.parametrize("axes", AXES, ids=str)
@pytest.mark.parametrize("keepdims", [1, 0])
def test_reduce(op, opset, axes, keepdims):
    x = _data(op)
    extra, attrs, const = _node(op, opset, axes, keepdims)
    dims = tuple(range(x.ndim)) if axes is None else tuple(axes)
    fn = REDUCE[op][0]
    check_op_gradient(
        op,
        {"x": x, **extra},
        attrs,
        const_inputs=const,
        opset=opset,
        # Both forms of dynamic shapes for every op and axes, spread over the opsets.
        dynamic="batch" if opset in (13, 18) else "all",
        torch_fn=lambda t: fn(t, dims, bool(keepdims)),
    )


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("opset", [18, 26])
@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_empty_axes_noop(op, opset, dynamic):
    """Empty axes with noop_with_empty_axes=1 reduce over no axis: only the elementwise part."""
    check_op_gradient(
        op,
        {"x": _data(op), "axes": np.array([], dtype=np.int64)},
        {"noop_with_empty_axes": 1},
        const_inputs=["axes"],
        opset=opset,
        dynamic=dynamic,
        torch_fn=REDUCE[op][1],
    )


def test_reduce_sum_noop_opset13():
    check_op_gradient(
        "ReduceSum",
        {"x": r(*SHAPE), "axes": np.array([], dtype=np.int64)},
        {"noop_with_empty_axes": 1, "keepdims": 0},
        const_inputs=["axes"],
        opset=13,
        torch_fn=lambda t: t,
    )


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceProd"])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_empty_axes_input_reduces_all(op, keepdims):
    check_op_gradient(
        op,
        {"x": r(*SHAPE), "axes": np.array([], dtype=np.int64)},
        {"keepdims": keepdims},
        const_inputs=["axes"],
        opset=18,
        dynamic="all",
        torch_fn=lambda t: REDUCE[op][0](t, tuple(range(t.dim())), bool(keepdims)),
    )


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceProd", "ReduceL2"])
@pytest.mark.parametrize("opset", [17, 18])
def test_float32_dynamic(op, opset):
    # float32 so that the constants and casts of the rules are checked against the model dtype;
    # central differences in float32 round at ~1e-7 * |loss| / eps, hence the step and tolerances.
    x = r(3, 4).astype(np.float32)
    extra, attrs, const = _node(op, opset, [1], 0)
    check_op_gradient(
        op,
        {"x": x, **extra},
        attrs,
        const_inputs=const,
        opset=opset,
        dynamic="all",
        torch_fn=lambda t: REDUCE[op][0](t, (1,), False),
        eps=1e-3,
        rtol=2e-3,
        atol=5e-4,
    )


def _check_against_torch_only(op, x, axes, keepdims, opset):
    """Gradient of ``op`` against torch.autograd, for points where the function has a kink
    (ties) and central differences measure a one-sided mix rather than torch's convention."""
    extra, attrs, const = _node(op, opset, axes, keepdims)
    inputs = {"x": x, **extra}
    model = make_op_model(op, inputs, attrs, const_inputs=const, opset=opset)
    y = session(model).run(None, {"x": x})[0]
    loss_model = add_weighted_sum_loss(model, ["y0"], [y])
    weights = {"w_y0": rng.uniform(0.5, 1.5, y.shape)}
    analytic = check_model_gradient(
        loss_model, {"x": x, **weights}, ["x"], finite_differences=False
    )
    dims = tuple(range(x.ndim)) if axes is None else tuple(axes)
    fn = REDUCE[op][0]
    compare_with_torch(
        lambda t: fn(t, dims, bool(keepdims)), {"x": x}, ["x"], analytic, weights, ["y0"],
        rtol=1e-12, atol=1e-12,
    )
    return analytic["x"], weights["w_y0"]


TIES = np.array(
    [
        [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, 5.0, 4.0, 5.0]],
        [[0.0, 0.0, -2.0, 0.0], [7.0, 1.0, 7.0, 7.0], [3.0, -3.0, 3.0, -3.0]],
    ]
)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("axes", [None, [-1], [0], [0, 2]], ids=str)
@pytest.mark.parametrize("opset", [17, 18])
def test_extremum_ties_split_evenly(op, axes, opset):
    grad, w = _check_against_torch_only(op, TIES, axes, 0, opset)
    if axes == [-1]:
        # Each slice's gradient is shared evenly by its tied extrema.
        best = TIES.max(axis=-1) if op == "ReduceMax" else TIES.min(axis=-1)
        is_best = best[..., None] == TIES
        expected = is_best * (w / is_best.sum(axis=-1))[..., None]
        np.testing.assert_allclose(grad, expected, rtol=1e-12)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_extremum_two_way_tie_matches_finite_differences(op):
    # With exactly two tied extrema, central differences also split the gradient in halves.
    x = np.array([[1.0, 4.0, 4.0], [-2.0, 0.5, -2.0]])
    check_op_gradient(
        op, {"x": x}, {"axes": [1], "keepdims": 0}, opset=17,
        torch_fn=lambda t: REDUCE[op][0](t, (1,), False),
    )


PROD_WITH_ZEROS = np.array(
    [
        [[1.5, 0.0, -2.0, 0.5], [0.0, 3.0, 0.0, 1.1], [0.7, -1.2, 2.0, 0.9]],
        [[0.0, 0.0, 0.0, 2.0], [1.3, 0.0, -0.4, 2.5], [-0.6, 1.7, 0.8, 1.9]],
    ]
)


@pytest.mark.parametrize("axes", [[-1], [1], [0, 2], None], ids=str)
@pytest.mark.parametrize("opset", [13, 18])
def test_prod_with_zeros(axes, opset):
    """Slices with no zero, one zero, two zeros and three zeros (the product is polynomial,
    so central differences are exact there too)."""
    extra, attrs, const = _node("ReduceProd", opset, axes, 1)
    dims = tuple(range(3)) if axes is None else tuple(axes)
    check_op_gradient(
        "ReduceProd", {"x": PROD_WITH_ZEROS, **extra}, attrs, const_inputs=const, opset=opset,
        dynamic="all", torch_fn=lambda t: _prod(t, dims, True),
    )


def test_prod_one_zero_gradient_values():
    x = np.array([[2.0, 0.0, 3.0], [0.0, 0.0, 5.0]])
    grad, w = _check_against_torch_only("ReduceProd", x, [1], 0, 18)
    np.testing.assert_allclose(grad[0], [0.0, 6.0 * w[0], 0.0])
    np.testing.assert_array_equal(grad[1], [0.0, 0.0, 0.0])


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_l2_zero_norm_has_zero_gradient(opset, keepdims):
    x = r(3, 4)
    x[1] = 0.0
    extra, attrs, const = _node("ReduceL2", opset, [1], keepdims)
    grad = check_op_gradient(
        "ReduceL2", {"x": x, **extra}, attrs, const_inputs=const, opset=opset,
        torch_fn=lambda t: torch.linalg.vector_norm(t, 2, dim=1, keepdim=bool(keepdims)),
    )["x"]
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(grad[1], 0.0)


def test_log_sum_exp_is_stable_for_large_inputs():
    x = 800.0 + r(3, 5)
    grad = check_op_gradient(
        "ReduceLogSumExp", {"x": x}, {"axes": [1], "keepdims": 0}, opset=17,
        torch_fn=lambda t: torch.logsumexp(t, dim=1), eps=1e-5, atol=1e-5,
    )["x"]
    assert np.all(np.isfinite(grad))


def test_run_time_axes_are_unsupported():
    model = make_op_model(
        "ReduceMean", {"x": r(*SHAPE), "axes": np.array([1], dtype=np.int64)}, opset=18
    )
    with pytest.raises(GradientNotImplementedError, match="axes input is computed at run time"):
        build_gradient_graph(model, wrt=["x"], loss="y0")
