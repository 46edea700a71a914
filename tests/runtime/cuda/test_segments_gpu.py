"""The CUDA graph step cut around traingraph's BatchNorm kernels (``runtime.cuda.segments``).

GPU tests: they need onnxruntime-gpu, NVRTC and a GPU, which CI lacks (skipped there, the
reason names what is missing).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from test_gpu import BATCH, _artifacts, _batches, _static_export

from torch_models import ResidualNet, seeded
from traingraph.api import CheckpointState, Module
from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="needs a CUDA GPU and onnxruntime-gpu (the installed onnxruntime offers"
        f" {ort.get_available_providers()})",
    ),
]


def _kernels_or_skip():
    from traingraph.runtime.cuda import kernels, segments

    if kernels.load(segments.SOURCE, 0) is None:
        reason = kernels.unavailable_reason(segments.SOURCE, 0)
        pytest.skip(f"the CUDA kernels do not load: {reason}")
    return segments


def _forward64(x, scale, bias, addend, eps, relu):
    axes = (0, *range(2, x.ndim))
    x64 = x.astype(np.float64)
    mean = x64.mean(axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = (x64 - mean) / np.sqrt(var + eps) * scale.reshape(shape) + bias.reshape(shape)
    if addend is not None:
        y = y + addend
    return (np.maximum(y, 0) if relu else y), mean, var


def _grad64(x, dy, y, scale, eps):
    axes = (0, *range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    g = dy.astype(np.float64) * (y > 0) if y is not None else dy.astype(np.float64)
    x64 = x.astype(np.float64)
    m = np.prod([x.shape[a] for a in axes])
    mean = x64.mean(axes, keepdims=True)
    xc = x64 - mean
    rstd = 1 / np.sqrt((xc**2).mean(axes, keepdims=True) + eps)
    dbias = g.sum(axes)
    dscale = (g * xc).sum(axes) * rstd.ravel()
    dx = scale.reshape(shape) * rstd * (
        g - dbias.reshape(shape) / m - xc * rstd * dscale.reshape(shape) / m
    )
    return dx, dscale, dbias


@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (64, 8, 28, 28), (2, 16, 1, 1), (3, 5, 40)])
@pytest.mark.parametrize("addend", [False, True])
def test_forward_kernel_matches_float64(shape, addend) -> None:
    segments = _kernels_or_skip()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 2).astype(np.float32)
    scale, bias = (rng.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
    r = rng.standard_normal(shape).astype(np.float32) if addend else None
    kernel = segments.CudaBatchNormForward(
        "x", "scale", "bias", "r" if addend else None, "mean", "var", "y", 1e-5, relu=addend
    )
    values = {"x": x, "scale": scale, "bias": bias} | ({"r": r} if addend else {})
    out: dict[str, np.ndarray] = {}
    kernel.compute(values, out, 1)
    y, mean, var = _forward64(x, scale, bias, r, 1e-5, addend)
    np.testing.assert_allclose(out["y"], y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["mean"].ravel(), mean.ravel(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["var"].ravel(), var.ravel(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(4, 3, 5, 7), (64, 8, 28, 28), (2, 16, 1, 1)])
@pytest.mark.parametrize("relu", [False, True])
def test_grad_kernel_matches_float64(shape, relu) -> None:
    segments = _kernels_or_skip()
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    y = np.maximum(rng.standard_normal(shape), 0).astype(np.float32) if relu else None
    scale = rng.standard_normal(shape[1]).astype(np.float32)
    kernel = segments.CudaBatchNormGrad(
        "x", "scale", "dy", 1e-5, "dx", "dscale", "dbias", y="y" if relu else None
    )
    values = {"x": x, "dy": dy, "scale": scale} | ({"y": y} if relu else {})
    out: dict[str, np.ndarray] = {}
    kernel.compute(values, out, 1)
    dx, dscale, dbias = _grad64(x, dy, y, scale, 1e-5)
    # dx = a (g - mean(g) - ...): float32 rounding is relative to its terms, a g (with two values
    # a channel, dx is all cancellation)
    axes = (0, *range(2, x.ndim))
    terms = np.abs(scale).max() / np.sqrt(x.astype(np.float64).var(axes).min() + 1e-5)
    np.testing.assert_allclose(out["dx"], dx, rtol=1e-4, atol=1e-6 * terms * np.abs(dy).max())
    np.testing.assert_allclose(out["dscale"], dscale, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["dbias"], dbias, rtol=1e-4, atol=1e-4)


def test_kernels_carry_non_finite_values_where_the_graph_does() -> None:
    segments = _kernels_or_skip()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    x[1, 2, 3, 3] = np.nan  # channel 2's statistics are NaN, the others stay finite
    kernel = segments.CudaBatchNormForward("x", "s", "b", None, "m", "v", "y", 1e-5, relu=False)
    out: dict[str, np.ndarray] = {}
    kernel.compute({"x": x, "s": np.ones(3, np.float32), "b": np.zeros(3, np.float32)}, out, 1)
    assert np.isnan(out["y"][:, 2]).all() and np.isfinite(out["y"][:, :2]).all()
    assert np.isnan(out["m"].ravel()[2]) and np.isfinite(out["m"].ravel()[:2]).all()
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dy[0, 0, 0, 0] = np.inf
    grad = segments.CudaBatchNormGrad("x", "s", "dy", 1e-5, "dx", "ds", "db")
    got: dict[str, np.ndarray] = {}
    x[1, 2, 3, 3] = 0.5
    grad.compute({"x": x, "dy": dy, "s": np.ones(3, np.float32)}, got, 1)
    assert np.isinf(got["db"][0]) and np.isfinite(got["db"][1:]).all()
    assert np.isfinite(got["dx"][:, 1:]).all()


def _residual_artifacts(tmp_path):
    _artifacts(tmp_path, _static_export(seeded(ResidualNet), torch.zeros(BATCH, 3, 8, 8)))
    return _batches((3, 8, 8))


def _graph_step(tmp_path, config: SessionConfig | None = None):
    from traingraph.runtime.cuda import CudaGraphStep

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(
        tmp_path / "training_model.onnx", state, device="cuda", session_config=config
    )
    return CudaGraphStep(module, tmp_path / "optimizer_model.onnx"), state


def test_the_step_is_cut_around_the_kernels_and_follows_the_uncut_step(tmp_path) -> None:
    segments = _kernels_or_skip()
    batches = _residual_artifacts(tmp_path)
    model = onnx.load(tmp_path / "training_model.onnx")
    found = segments.find_device_kernels(model, Device("cuda", 0))
    kinds = sorted({type(kernel).__name__ for kernel, _ in found})
    assert kinds == ["CudaBatchNormForward", "CudaBatchNormGrad"], found

    cut, cut_state = _graph_step(tmp_path, SessionConfig(cuda_segments=True))
    whole, whole_state = _graph_step(tmp_path)
    cut_losses = [float(cut(x, y, fetch_loss=True)) for x, y in batches]
    whole_losses = [float(whole(x, y, fetch_loss=True)) for x, y in batches]
    assert isinstance(cut._train, segments.SegmentedCudaSession)
    assert not isinstance(whole._train, segments.SegmentedCudaSession)
    assert len(cut._graphs) == 2  # the running statistics' two buffer layouts
    np.testing.assert_allclose(cut_losses, whole_losses, rtol=2e-3, atol=1e-4)
    assert cut_losses[-1] < cut_losses[0]
    for name, value in whole_state.parameters.items():
        np.testing.assert_allclose(
            cut_state.parameters[name].data, value.data, rtol=1e-2, atol=2e-2, err_msg=name
        )
