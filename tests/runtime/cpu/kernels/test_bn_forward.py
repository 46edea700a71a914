"""Training-mode BatchNormalization forward passes run natively between segments
(runtime/cpu/kernels/bn_forward.py): the kernel against torch, the matches in a residual network,
the plan,
and Module's train steps (with the running statistics) against the graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from gradcheck import artifact_steps, assert_same_training
from torch_models import ChainedNorms, export, residual_artifacts, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import bn_forward, conv_grads
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

NO_BN_FORWARDS = "batch_norm_forward"

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def test_one_long_plane_is_normalized_as_accurately_as_many_short_ones():
    """A BatchNorm over one sample of 4608 values a channel (a standardized 3 x 3 filter of 512
    channels): the kernel's float32 lane sums are added into double sums every 256 values, so
    the output is within float32 rounding of float64 (4.3e-6 off where a plane was summed
    whole in the lanes; onnxruntime's ReduceMean graph: 1.0e-6)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 512, 4608)) * 0.05 + 0.01).astype(np.float32)
    ones, zeros = np.ones(512, np.float32), np.zeros(512, np.float32)
    y, mean, var = np.empty_like(x), np.empty(512, np.float32), np.empty(512, np.float32)
    NATIVE.batch_norm_forward(x, ones, zeros, None, y, mean, var, 1e-5, False, 2)
    exact = x.astype(np.float64)
    centered = exact - exact.mean(axis=(0, 2), keepdims=True)
    variance = (centered**2).mean(axis=(0, 2), keepdims=True)
    assert np.abs(y - centered / np.sqrt(variance + 1e-5)).max() < 2e-6
    assert np.abs(var - variance.reshape(-1)).max() < 1e-6 * variance.max()


@pytest.mark.parametrize(
    "shape", [(8, 16, 9, 11), (5, 3, 40), (7, 6), (2, 4, 1, 1), (4, 6, 2, 2), (8, 5, 3, 3)]
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("addend", [False, True])
def test_kernel_matches_torch(shape, threads, relu, addend):
    rng = np.random.default_rng(0)
    channels = shape[1]
    # statistics away from zero: the variance is taken around a large mean
    x = (rng.standard_normal(shape) * 3 + 50).astype(np.float32)
    scale = rng.standard_normal(channels).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    other = rng.standard_normal(shape).astype(np.float32) if addend else None
    y = np.full(shape, np.nan, np.float32)
    mean, var = np.full(channels, np.nan, np.float32), np.full(channels, np.nan, np.float32)
    NATIVE.batch_norm_forward(x, scale, bias, other, y, mean, var, 1e-5, relu, threads)
    xt = torch.from_numpy(x).double()
    axes = [0, *range(2, x.ndim)]
    want = torch.nn.functional.batch_norm(
        xt, None, None, torch.from_numpy(scale).double(), torch.from_numpy(bias).double(),
        training=True, eps=1e-5,
    )  # fmt: skip
    if other is not None:
        want = want + torch.from_numpy(other).double()
    want = torch.relu(want) if relu else want
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mean, xt.mean(axes).numpy(), rtol=1e-6)
    np.testing.assert_allclose(var, xt.var(axes, unbiased=False).numpy(), rtol=1e-4)


def test_relu_keeps_the_bits_onnxruntime_keeps():
    """The Relu after the BatchNorm on every kind of float: onnxruntime's max(v, 0) with NaN
    kept, bit for bit (a NaN of either sign and its payload stay; -0 and negative values give
    +0). A constant channel normalizes to 0, so the output is relu(0 + addend)."""
    special = np.array(
        [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.5, -2.5],
        np.float32,
    )
    payload = np.array([0x7FC01234, 0xFFC04321, 0x7F800001, 0xFF800001], np.uint32).view(np.float32)
    rng = np.random.default_rng(5)
    values = np.concatenate([special, payload, rng.standard_normal(48).astype(np.float32)])
    addend = np.resize(values, (2, 3, 4, 8))  # 32 lanes a plane: the vector loop and its lanes
    x = np.zeros(addend.shape, np.float32)
    y = np.empty(addend.shape, np.float32)
    mean, var = np.empty(3, np.float32), np.empty(3, np.float32)
    scale, bias = np.ones(3, np.float32), np.zeros(3, np.float32)
    NATIVE.batch_norm_forward(x, scale, bias, addend, y, mean, var, 1e-5, True, 1)
    v = np.float32(0.0) + addend
    want = np.where((v > 0) | np.isnan(v), v, np.float32(0.0))
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


def test_kernel_refuses_arrays_it_cannot_take():
    native = NATIVE
    x, c = np.zeros((2, 3, 4), np.float32), np.zeros(3, np.float32)
    y, m, v = np.zeros_like(x), np.zeros(3, np.float32), np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"scale, bias, mean and var the shape \[C\]"):
        native.batch_norm_forward(x, np.zeros(4, np.float32), c, None, y, m, v, 1e-5, False, 1)
    with pytest.raises(ValueError, match=r"x, addend and y must have one shape"):
        native.batch_norm_forward(x, c, c, np.zeros((2, 3, 5), np.float32), y, m, v, 1e-5,
                                  False, 1)  # fmt: skip
    with pytest.raises(ValueError, match="argument 4: y is read-only"):
        y.flags.writeable = False
        native.batch_norm_forward(x, c, c, None, y, m, v, 1e-5, False, 1)
    with pytest.raises(ValueError, match="x has no elements per channel"):
        empty = np.zeros((0, 3, 4), np.float32)
        native.batch_norm_forward(empty, c, c, None, empty.copy(), m, v, 1e-5, False, 1)


def test_every_batch_norm_of_a_residual_net_is_taken(tmp_path):
    model = onnx.load(residual_artifacts(tmp_path) / "training_model.onnx")
    found = bn_forward.split_batch_norm_forwards(model)
    assert len(found) == 4  # the stem's, the block's two and the shortcut's
    by_scale = {kernel.scale: (kernel, nodes) for kernel, nodes in found}
    ops = {s: sorted(model.graph.node[i].op_type for i in n) for s, (_, n) in by_scale.items()}
    lowered = ["BatchNormalization", "Mul", "ReduceMean", "ReduceMean", "Sub"]
    assert ops["bn.weight"] == sorted([*lowered, "Relu"])
    assert ops["bn1.weight"] == sorted([*lowered, "Relu"])
    # the block's output Add: one of its two BatchNorms adds the other's output, then the Relu
    stem, block, shortcut = (
        by_scale["bn.weight"][0],
        by_scale["bn2.weight"][0],
        by_scale["down.1.weight"][0],
    )
    fused = [k for k in (block, shortcut) if k.addend is not None]
    plain = [k for k in (block, shortcut) if k.addend is None]
    assert len(fused) == 1 and len(plain) == 1
    assert fused[0].addend == plain[0].out and fused[0].relu and not plain[0].relu
    assert stem.relu and stem.addend is None
    # nodes another kernel takes stay in the graph
    bn_index = next(i for i in by_scale["bn.weight"][1]
                    if model.graph.node[i].op_type == "BatchNormalization")  # fmt: skip
    rest = bn_forward.split_batch_norm_forwards(model, taken={bn_index})
    assert "bn.weight" not in {k.scale for k, _ in rest} and len(rest) == 3


def test_the_forward_is_cut_at_each_kernel(tmp_path):
    model = onnx.load(residual_artifacts(tmp_path) / "training_model.onnx")
    model, grads = conv_grads.split_weight_grads(model)
    model, kernels = segments.find_kernels(model, grads)
    forwards = [k for k, _ in kernels if isinstance(k, bn_forward.BatchNormForward)]
    assert len(forwards) == 4
    plan = segments.plan_segments(model, kernels)
    order = plan.all_kernels
    for kernel in forwards:
        if kernel.addend is not None:  # after the BatchNorm whose output it adds
            (other,) = [k for k in forwards if k.out == kernel.addend]
            assert order.index(other) < order.index(kernel)
    means = {k.mean for k in forwards} | {k.var for k in forwards}
    for segment in plan.segments:
        for node in segment.model.graph.node:
            assert node.op_type != "BatchNormalization"
            # the statistics are read only by the Squeezes before the running statistics
            assert node.op_type == "Squeeze" or not set(node.input) & means
    # those Squeezes are views of the kernels' statistics, taken before the segment that
    # updates the running statistics, not onnxruntime runs of their own between the kernels
    squeezes = [
        k for k, segment in enumerate(plan.segments)
        for node in segment.model.graph.node
        if node.op_type == "Squeeze" and set(node.input) & means
    ]  # fmt: skip
    assert not squeezes
    views = [k for k in order if isinstance(k, segments.ViewStep) and k.source in means]
    assert len(views) == 2 * len(forwards)
    (late,) = {
        k for k, segment in enumerate(plan.segments)
        if {v.out for v in views} & set(segment.inputs)
    }  # fmt: skip
    assert any(n.op_type == "Concat" for n in plan.segments[late].model.graph.node)
    for segment in plan.segments:
        kinds = {n.op_type for n in segment.model.graph.node}
        assert not kinds or not kinds <= {"Squeeze", "Constant"}


def test_module_trains_as_the_graph_does(tmp_path):
    directory = residual_artifacts(tmp_path)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 10, 10)).astype(np.float32) + 2, rng.integers(0, 5, n))
        for n in (4, 4, 3)  # the batch changes: the kernels' outputs follow it
    ]
    got = artifact_steps(directory, batches, bn_forward.BatchNormForward)
    expected = artifact_steps(
        directory, batches, bn_forward.BatchNormForward, without=NO_BN_FORWARDS
    )
    assert {"bn.running_mean", "bn.running_var", "bn2.running_var"} <= set(got[2])
    assert_same_training(got, expected, one_scale=True)


def test_a_batch_norm_reading_another_is_taken_and_trains(tmp_path):
    artifacts.generate_artifacts(
        export(seeded(ChainedNorms), torch.zeros(2, 3, 6, 6), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    found = bn_forward.split_batch_norm_forwards(onnx.load(tmp_path / "training_model.onnx"))
    first, second = sorted((k for k, _ in found), key=lambda k: k.relu)
    assert second.x == first.out and second.relu and not first.relu
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((3, 3, 6, 6)).astype(np.float32), rng.integers(0, 2, 3))
        for _ in range(2)
    ]
    got = artifact_steps(tmp_path, batches, bn_forward.BatchNormForward)
    expected = artifact_steps(
        tmp_path, batches, bn_forward.BatchNormForward, without=NO_BN_FORWARDS
    )
    assert_same_training(got, expected, one_scale=True)
