"""Sums over the leading axes (runtime/cpu/kernels/batch_sum.py): the graph's ReduceSum, bit for
bit, and taken only where its slices are large."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from traingraph.runtime.cpu.kernels.batch_sum import BatchSum, split_batch_sums

FLOAT = onnx.TensorProto.FLOAT


def _reduce_model(shape, axes, keepdims=1, opset=17, batch=None):
    """``y = ReduceSum(x, axes)`` (axes an input from opset 13, else an attribute)."""
    dims = [batch or shape[0], *shape[1:]] if batch else list(shape)
    if opset >= 13:
        node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=keepdims)
        inits = [helper.make_tensor("axes", onnx.TensorProto.INT64, [len(axes)], axes)]
    else:
        node = helper.make_node("ReduceSum", ["x"], ["y"], axes=axes, keepdims=keepdims)
        inits = []
    graph = helper.make_graph(
        [node], "sum", [helper.make_tensor_value_info("x", FLOAT, dims)],
        [helper.make_tensor_value_info("y", FLOAT, None)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


CASES = {
    "weight-grad": ([16, 1, 1152, 128], [0], 1),
    "two-axes": ([4, 3, 64, 64], [0, 1], 0),
    "negative-axis": ([6, 4096], [-2], 1),
    "one-sample": ([1, 8, 32, 32], [0], 1),
    "many-rows": ([512, 8192], [0], 0),
    "many-rows-two-axes": ([32, 16, 4096], [0, 1], 1),
}


@pytest.mark.parametrize("non_finite", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_is_the_graphs_reduce_sum_bit_for_bit(case, non_finite):
    shape, axes, keepdims = CASES[case]
    model = _reduce_model(shape, axes, keepdims)
    found = split_batch_sums(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    assert nodes == {0} and kernel.leading == len(axes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32) * 100
    if non_finite:
        flat = x.reshape(-1)
        flat[::97], flat[5::101], flat[7::103] = np.nan, np.inf, -np.inf
    (want,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    out: dict[str, np.ndarray] = {}
    kernel.compute({"x": x}, out, 1)
    assert out["y"].shape == want.shape
    _assert_same(out["y"], want)
    # written in place where the buffer is given
    buffer = np.full(want.shape, 7.0, np.float32)
    kernel.compute({"x": x}, {"y": buffer}, 1)
    _assert_same(buffer, want)


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """The same bits, but for the sign and payload of a NaN (an Inf minus an Inf makes x86's
    default NaN, which the next add may carry or replace by its other operand's NaN, as the
    order of the operands decides)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))


def test_an_opset_11_reduce_sum_with_axes_as_an_attribute_is_taken():
    model = _reduce_model([8, 64, 64], [0], 0, opset=11)
    assert [k for k, _ in split_batch_sums(model)] == [BatchSum("x", 1, False, "y")]


def test_a_dynamic_batch_is_summed_whatever_its_size():
    model = _reduce_model([16, 64, 64], [0], 1, batch="batch")
    ((kernel, _),) = split_batch_sums(model)
    for n in (3, 0):
        x = np.arange(n * 64 * 64, dtype=np.float32).reshape(n, 64, 64)
        out: dict[str, np.ndarray] = {}
        kernel.compute({"x": x}, out, 1)
        np.testing.assert_array_equal(out["y"], x.sum(0, keepdims=True))


@pytest.mark.parametrize(
    "shape, axes",
    [
        ([16, 64, 64], [1]),  # not the leading axes
        ([16, 64, 64], [0, 2]),
        ([16, 64, 64], [0, 1, 2]),  # every axis
        ([2048, 256], [0]),  # slices below LEAST_SLICE (a bias's gradient)
    ],
)
def test_other_reduce_sums_stay(shape, axes):
    assert split_batch_sums(_reduce_model(shape, axes)) == []


def test_a_reduce_sum_without_axes_stays():
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"])], "sum",
        [helper.make_tensor_value_info("x", FLOAT, [16, 64, 64])],
        [helper.make_tensor_value_info("y", FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert split_batch_sums(model) == []
