"""GridSample's gradients (through its standard-op form, ``autodiff/grid_sample.py``) against
finite differences and torch.autograd in float64, for every linear and nearest mode, padding
mode and corner alignment, with grid points outside the input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import check_op_gradient, session
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)


def _grid(n, h, w):
    """Grid points over [-1.25, 1.25]: some outside the input on every side."""
    return rng.uniform(-1.25, 1.25, (n, h, w, 2))


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_gradient(mode, padding, align):
    x, grid = rng.standard_normal((2, 3, 5, 4)), _grid(2, 3, 6)
    torch_mode = "bilinear" if mode == "linear" else mode
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_op_gradient(
        "GridSample", {"x": x, "grid": grid}, attrs, opset=20,
        wrt=["x", "grid"] if mode == "linear" else ["x"],
        torch_fn=lambda x, g: F.grid_sample(
            x, g, mode=torch_mode, padding_mode=padding, align_corners=bool(align)
        ),
        rtol=1e-6, atol=1e-8,
    )  # fmt: skip


def test_grid_sample_opset_16_names_and_float32():
    """Opset 16's mode is ``bilinear``; a float32 model differentiates in float32, and its
    forward is onnxruntime's GridSample kernel's."""
    from gradcheck import add_weighted_sum_loss, make_op_model

    x = rng.standard_normal((1, 2, 6, 7)).astype(np.float32)
    grid = _grid(1, 4, 5).astype(np.float32)
    attrs = {"mode": "bilinear", "padding_mode": "reflection", "align_corners": 0}
    model = make_op_model("GridSample", {"x": x, "grid": grid}, attrs, opset=16)
    (y,) = session(model).run(None, {"x": x, "grid": grid})
    weights = rng.uniform(0.5, 1.5, y.shape).astype(np.float32)
    loss_model = add_weighted_sum_loss(model, ["y0"], [y])
    grads = build_gradient_graph(loss_model, wrt=["x", "grid"], loss="loss")
    got = session(grads).run(None, {"x": x, "grid": grid, "w_y0": weights})
    tx, tg = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, grid))
    out = F.grid_sample(tx, tg, padding_mode="reflection", align_corners=False)
    (out * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got[0], (out.detach().numpy() * weights).sum(), rtol=1e-5)
    np.testing.assert_allclose(got[1], tx.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[2], tg.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_cubic_grid_sample_is_reported():
    from gradcheck import add_weighted_sum_loss, make_op_model

    x, grid = rng.standard_normal((1, 1, 4, 4)), _grid(1, 2, 2)
    model = make_op_model("GridSample", {"x": x, "grid": grid}, {"mode": "cubic"}, opset=20)
    (y,) = session(model).run(None, {"x": x, "grid": grid})
    with pytest.raises(GradientNotImplementedError, match="GridSample"):
        build_gradient_graph(add_weighted_sum_loss(model, ["y0"], [y]), wrt=["x"], loss="loss")
