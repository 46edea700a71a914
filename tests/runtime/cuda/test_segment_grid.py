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
