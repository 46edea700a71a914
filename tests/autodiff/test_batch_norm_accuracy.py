"""BatchNormalization's training gradient at float32 accuracy where the batch statistics are
ill-conditioned: few values per channel whose mean is large against their spread.

``x - mean`` uses the mean rounded to float32, which shifts every centered value of a channel
by the same amount; the gradient rule takes that shift out (see
``traingraph.autodiff.rules.normalization._batch_norm_training_grads``), and the native CPU
kernel computes the same gradient with the values centered before they are scaled. Both are
checked against float64 on channels of 8 values (batch 2, 2x2 maps, as in the last stages of a
CNN at a small image size) and of 128, with means 300 to 2000 times their spread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import add_weighted_sum_loss, make_op_model, session
from traingraph.autodiff import build_gradient_graph
from traingraph.runtime.cpu.native import NATIVE

# Largest error of dx, dscale and dbias, relative to each one's largest float64 magnitude.
# Measured: 4e-8 to 1.2e-7 in every case; with the rounding of the mean not taken out, the
# ill-conditioned cases gave 1.8e-6 to 1.5e-5 (dx) and 2.3e-5 to 5.2e-5 (dscale) for the
# graph, 1.6e-6 to 1.4e-5 (dx) for the native kernel.
RTOL = 1e-6
# The sum of dx over a channel is 0 in exact arithmetic; bound relative to dx's largest value.
# Measured: 1e-7 to 8e-7; before, 2.5e-5 to 9.3e-4 in the ill-conditioned cases.
SUM_RTOL = 3e-6

CASES = [  # (shape, mean, spread)
    ((2, 16, 2, 2), 0.0, 1.0),
    ((2, 16, 2, 2), 3.0, 0.01),
    ((2, 16, 8, 8), 20.0, 0.01),
    ((2, 16, 8, 8), 3.0, 0.001),
]


def _inputs(shape: tuple[int, ...], mean: float, spread: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = shape[1]
    offsets = mean * rng.uniform(0.5, 1.5, (1, c, 1, 1))
    return {
        "x": (offsets + spread * rng.standard_normal(shape)).astype(np.float32),
        "dy": rng.standard_normal(shape).astype(np.float32),
        "scale": rng.uniform(0.5, 2.0, c).astype(np.float32),
    }


def _float64(x: np.ndarray, dy: np.ndarray, scale: np.ndarray) -> list[np.ndarray]:
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in
         {"x": x, "scale": scale, "bias": np.zeros_like(scale)}.items()}  # fmt: skip
    out = F.batch_norm(t["x"], None, None, t["scale"], t["bias"], training=True)
    (out * torch.tensor(dy, dtype=torch.float64)).sum().backward()
    return [t[k].grad.numpy() for k in ("x", "scale", "bias")]  # type: ignore[union-attr]


def _check(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for name, value, ref in zip(("dx", "dscale", "dbias"), got, expected):
        error = np.abs(value.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert error <= RTOL, f"{name} is {error:.3g} (relative) off float64; expected {RTOL}"
    dx, ref = got[0].astype(np.float64), expected[0]
    channel_sum = np.abs(dx.sum(axis=(0, 2, 3))).max() / np.abs(ref).max()
    assert channel_sum <= SUM_RTOL, f"dx sums to {channel_sum:.3g} over a channel, not 0"


@pytest.mark.parametrize(("shape", "mean", "spread"), CASES)
def test_graph_gradient_is_float32_accurate(shape, mean, spread) -> None:
    inputs = _inputs(shape, mean, spread, seed=1)
    c = shape[1]
    op_inputs = {
        "x": inputs["x"], "scale": inputs["scale"], "bias": np.zeros(c, np.float32),
        "mean": np.zeros(c, np.float32), "var": np.ones(c, np.float32),
    }  # fmt: skip
    model = make_op_model(
        "BatchNormalization", op_inputs, {"training_mode": 1}, const_inputs=["mean", "var"],
        num_outputs=3, opset=17,
    )
    feeds = {k: op_inputs[k] for k in ("x", "scale", "bias")}
    grad_model = build_gradient_graph(
        add_weighted_sum_loss(model, ["y0"], [inputs["dy"]]),
        wrt=["x", "scale", "bias"], loss="loss",
    )  # fmt: skip
    got = session(grad_model).run(
        ["x_grad", "scale_grad", "bias_grad"], {**feeds, "w_y0": inputs["dy"]}
    )
    _check(got, _float64(inputs["x"], inputs["dy"], inputs["scale"]))


@pytest.mark.skipif(NATIVE is None, reason="the native extension is not built")
@pytest.mark.parametrize(("shape", "mean", "spread"), CASES)
def test_native_kernel_is_float32_accurate(shape, mean, spread) -> None:
    inputs = _inputs(shape, mean, spread, seed=2)
    x, dy, scale = inputs["x"], inputs["dy"], inputs["scale"]
    dx, dscale, dbias = np.empty_like(x), np.empty_like(scale), np.empty_like(scale)
    assert NATIVE is not None
    NATIVE.batch_norm_grad(x, dy, None, scale, dx, dscale, dbias, 1e-5, 1)
    _check([dx, dscale, dbias], _float64(x, dy, scale))
