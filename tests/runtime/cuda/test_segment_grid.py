"""How the BatchNorm kernels of the segmented CUDA step share a channel's values among blocks
(runtime/cuda/segments.py); no GPU needed."""

from __future__ import annotations

import pytest

from traingraph.runtime.cuda import segments


@pytest.mark.parametrize("values", [1, 49, 2047, 2048, 3136, 200704, 802816, 1 << 24])
@pytest.mark.parametrize("channels", [1, 64, 256, 2048])
def test_the_parts_of_a_channel_cover_it_once(values, channels):
    parts, part = segments._parts(values, channels, 132)
    assert parts >= 1 and part >= 1
    assert (parts - 1) * part < values <= parts * part  # no empty block, every value in one
    assert parts == 1 or part >= segments._PART // 2
    assert parts <= -(-4 * 132 // channels)  # about four blocks a multiprocessor in all


def test_the_grid_and_sizes_of_an_activation():
    grid, sizes = segments._geometry((64, 256, 56, 56), 132)
    parts, part = segments._parts(64 * 56 * 56, 256, 132)
    assert grid == (parts, 256)
    assert [v.value for v in sizes] == [64, 256, 56 * 56, part]
    kernel = segments.CudaBatchNormGrad("x", "s", "dy", 1e-5, "dx", "ds", "db")
    assert kernel.workspace({"x": (64, 256, 56, 56)}, 132) == parts * 256 * 4
    forward = segments.CudaBatchNormForward("x", "s", "b", None, "m", "v", "y", 1e-5, True)
    assert forward.workspace({"x": (64, 256, 56, 56)}, 132) == parts * 256 * 2
    with pytest.raises(ValueError, match=r"\[N, C, ...\]"):
        segments._geometry((8,), 132)


class _Recording:
    """A compiled source that records the launches queued on it."""

    multiprocessors = 132

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, int], list[object], int]] = []

    def launch_grid(self, name, grid, args, stream):
        self.launches.append((name, grid, [getattr(a, "value", a) for a in args], stream))


_NAMES = ["x", "scale", "bias", "r", "y", "m", "v", "dy", "relu", "dx", "ds", "db"]
_ADDRESSES = {name: 4096 * (k + 1) for k, name in enumerate(_NAMES)}


def test_the_forward_kernels_are_queued_with_their_values_in_order():
    source = _Recording()
    kernel = segments.CudaBatchNormForward(
        "x", "scale", "bias", "r", "m", "v", "y", 1e-3, True, relu_nan=False
    )
    shape = (8, 16, 10, 10)
    kernel.queue(source, _ADDRESSES.__getitem__, {"x": shape}, 99, 7)
    grid, sizes = segments._geometry(shape, 132)
    sizes = [v.value for v in sizes]
    a = _ADDRESSES
    assert source.launches == [
        ("bn_forward_sums", grid, [a["x"], 99, *sizes], 7),
        (
            "bn_forward_apply", grid,
            [a["x"], a["scale"], a["bias"], a["r"], a["y"], a["m"], a["v"], 99, *sizes, 1e-3, 1, 0],
            7,
        ),
    ]  # fmt: skip


def test_the_gradient_kernels_are_queued_with_their_values_in_order():
    a = _ADDRESSES
    shape = (8, 16, 10, 10)
    grid, sizes = segments._geometry(shape, 132)
    sizes = [v.value for v in sizes]
    source = _Recording()
    grad = segments.CudaBatchNormGrad("x", "scale", "dy", 1e-5, "dx", "ds", "db", y="relu")
    grad.queue(source, a.__getitem__, {"x": shape}, 99, 7)
    assert source.launches == [
        ("bn_grad_sums", grid, [a["x"], a["dy"], a["relu"], 99, *sizes], 7),
        (
            "bn_grad_apply", grid,
            [a["x"], a["dy"], a["relu"], a["scale"], a["dx"], a["ds"], a["db"], 99, *sizes, 1e-5],
            7,
        ),
    ]  # fmt: skip
    # without dx (a first layer): no scale and no dx, nor a Relu's output
    source = _Recording()
    first = segments.CudaBatchNormGrad("x", "scale", "dy", 1e-5, None, "ds", "db")
    first.queue(source, a.__getitem__, {"x": shape}, 99, 7)
    assert source.launches[1][2][:7] == [a["x"], a["dy"], None, None, None, a["ds"], a["db"]]
