"""The provider rewrites of a standard model compute what the model computes (run on the CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from torch_models import SmallCNN, export, seeded
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program
from traingraph.runtime.rewrites.specialize import FOLD_LIMIT, for_cpu, for_cuda

SHAPE = [3, 4, 5, 6]


def _reduce_model(op: str, axes: list[int], keepdims: int, opset: int) -> onnx.ModelProto:
    axes_as_input = op == "ReduceSum" or opset >= 18
    inputs = ["x", "axes"] if axes_as_input else ["x"]
    attrs = {"keepdims": keepdims} if axes_as_input else {"keepdims": keepdims, "axes": axes}
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)],
        "reduce",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes_as_input else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model: onnx.ModelProto | bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    source = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def _reduced_axes(model: onnx.ModelProto) -> list[list[int]]:
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    initializers.update(
        (n.output[0], numpy_helper.to_array(a.t)) for n in model.graph.node
        if n.op_type == "Constant" for a in n.attribute if a.name == "value"
    )  # fmt: skip
    found = []
    for node in model.graph.node:
        if node.op_type in ("ReduceSum", "ReduceMean"):
            if len(node.input) > 1:
                found.append(sorted(int(a) for a in initializers[node.input[1]]))
            else:
                found += [sorted(a.ints) for a in node.attribute if a.name == "axes"]
    return found


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[0, 2, 3], [0, 2], [3, 0, 1]])
def test_reductions_over_several_runs_become_a_chain(
    op: str, axes: list[int], keepdims: int, opset: int
) -> None:
    model = _reduce_model(op, axes, keepdims, opset)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    rewritten = onnx.load_from_string(for_cuda(model.SerializeToString()))
    for run in _reduced_axes(rewritten):
        assert run == list(range(run[0], run[-1] + 1)), run
    assert len(_reduced_axes(rewritten)) == 2
    (expected,), (got,) = _run(model, {"x": x}), _run(rewritten, {"x": x})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axes", [[1, 2], [0], [2, 3], [-1, 0]])
def test_reductions_over_one_run_or_negative_axes_stay(axes: list[int]) -> None:
    source = _reduce_model("ReduceSum", axes, 0, 17).SerializeToString()
    assert for_cuda(source) is source


def test_batchnorm_training_step_gives_the_same_numbers() -> None:
    model = export(seeded(SmallCNN), torch.zeros(2, 1, 8, 8), training=True)
    program = build_program(model, loss=CrossEntropyLoss())
    train = program.train_model
    rewritten = onnx.load_from_string(for_cuda(train.SerializeToString()))
    original_axes, new_axes = _reduced_axes(train), _reduced_axes(rewritten)
    assert [0, 2, 3] in original_axes and [0, 2, 3] not in new_axes
    rng = np.random.default_rng(0)
    feeds = {}
    for value in train.graph.input:
        dims = [d.dim_value or 6 for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[value.name] = rng.integers(0, 10, dims).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    for name, expected, got in zip(
        [o.name for o in train.graph.output], _run(train, feeds), _run(rewritten, feeds)
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=name)


def _grouped_conv(
    weight: np.ndarray, groups: int, batch: int | str = 3, size: int = 7, **attrs: object
) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=groups, **attrs)],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, groups, size, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight.astype(np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize(
    "attrs", [{"pads": [1, 1, 1, 1]}, {"strides": [2, 1], "dilations": [1, 2]}, {}]
)
def test_shared_filters_over_groups_become_one_conv_over_the_batch(attrs: dict) -> None:
    rng = np.random.default_rng(0)
    filters = rng.standard_normal((4, 1, 3, 2))
    model = _grouped_conv(np.tile(filters, (5, 1, 1, 1)), 5, **attrs)
    rewritten = onnx.load_from_string(for_cuda(model.SerializeToString()))
    convs = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    assert len(convs) == 1 and all(a.name != "group" for a in convs[0].attribute)
    x = rng.standard_normal((3, 5, 7, 6)).astype(np.float32)
    (expected,), (got,) = _run(model, {"x": x}), _run(rewritten, {"x": x})
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("batch", "size"), [("n", 7), (FOLD_LIMIT // (5 * 6) + 1, 1)], ids=["dynamic", "large"]
)
def test_shared_filters_stay_grouped_on_large_or_unknown_inputs(
    batch: int | str, size: int
) -> None:
    filters = np.random.default_rng(0).standard_normal((4, 1, 1, 2))
    source = _grouped_conv(np.tile(filters, (5, 1, 1, 1)), 5, batch, size).SerializeToString()
    assert for_cuda(source) is source


def test_conv_with_filters_that_differ_per_group_stays() -> None:
    weight = np.random.default_rng(0).standard_normal((10, 1, 3, 3))
    source = _grouped_conv(weight, 5).SerializeToString()
    assert for_cuda(source) is source


def test_weight_gradient_unfold_is_rewritten_in_a_training_step() -> None:
    # conv2 has 4 input channels, so its weight gradient unfolds its input with a grouped Conv.
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 3, 3),
        torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 5),
    )  # fmt: skip
    torch.manual_seed(0)
    program = build_program(export(net, torch.zeros(2, 1, 8, 8)), loss=CrossEntropyLoss())
    train = program.train_model
    for value in train.graph.input:  # the batch fixed, as a CUDA-graph step fixes it
        if value.name in program.input_names:
            value.type.tensor_type.shape.dim[0].dim_value = 6
    rewritten = onnx.load_from_string(for_cuda(train.SerializeToString()))

    def grouped(model: onnx.ModelProto) -> int:
        return sum(n.op_type == "Conv" and _groups(n) > 1 for n in model.graph.node)

    assert grouped(train) >= 1 and grouped(rewritten) == 0
    rng = np.random.default_rng(0)
    feeds = dict(program.parameters)
    x = rng.standard_normal((6, 1, 8, 8)).astype(np.float32)
    feeds.update(zip(program.input_names, (x, rng.integers(0, 5, 6).astype(np.int64))))
    for name, expected, got in zip(
        [o.name for o in train.graph.output], _run(train, feeds), _run(rewritten, feeds)
    ):
        # The values are the same; the two Conv forms may group the sums of the next
        # products differently on CPUs with other vector widths.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def _groups(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _mask_model(extra_use: bool) -> onnx.ModelProto:
    """``dx = g * Cast(y > 0)`` (the Relu gradient), and optionally the cast mask as an output."""
    nodes = [
        helper.make_node("Greater", ["y", "zero"], ["active"]),
        helper.make_node("Cast", ["active"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["mask", "g"], ["dx"]),
    ]
    outputs = [helper.make_tensor_value_info("dx", TensorProto.FLOAT, SHAPE)]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(
        nodes, "relu_grad",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("y", "g")],
        outputs, [numpy_helper.from_array(np.zeros((), np.float32), "zero")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_product_with_a_cast_mask_becomes_a_where() -> None:
    model = _mask_model(extra_use=False)
    rewritten = onnx.load_from_string(for_cuda(model.SerializeToString()))
    assert [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"] == [
        "Greater", "Where"
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(SHAPE).astype(np.float32) for n in ("y", "g")}
    np.testing.assert_array_equal(_run(rewritten, feeds)[0], _run(model, feeds)[0])


def test_a_cast_mask_with_other_uses_stays() -> None:
    model = _mask_model(extra_use=True)
    assert for_cuda(model.SerializeToString()) == model.SerializeToString()


def _conv_transpose(
    x_shape: list,
    w_shape: list,
    opset: int,
    bias: bool = False,
    dtype: int = TensorProto.FLOAT,
    **attrs: object,
) -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("x", dtype, x_shape),
        helper.make_tensor_value_info("w", dtype, w_shape),
    ]
    if bias:
        channels = w_shape[1] * int(attrs.get("group", 1))
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [channels]))
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", [i.name for i in inputs], ["y"], **attrs)],
        "conv_transpose",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _random_feeds(model: onnx.ModelProto, batch: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        v.name: rng.standard_normal(
            [d.dim_value or batch for d in v.type.tensor_type.shape.dim]
        ).astype(np.float32)
        for v in model.graph.input
    }


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        # the input gradient of a stride-2 3x3 Conv with pads 1 (ResNet's downsampling)
        (["n", 4, 5, 5], [4, 3, 3, 3], {"strides": [2, 2], "pads": [1, 1, 1, 1],
                                        "output_padding": [1, 1]}),
        # of an unpadded 5x5 Conv (LeNet's second convolution)
        (["n", 4, 6, 6], [4, 3, 5, 5], {}),
        # a 1x1 strided projection, uneven pads and strides, dilations, 1-D and 3-D
        (["n", 6, 4, 4], [6, 2, 1, 1], {"strides": [2, 2]}),
        (["n", 2, 4, 5], [2, 3, 3, 2], {"strides": [3, 2], "pads": [0, 1, 2, 0],
                                        "output_padding": [2, 1]}),
        (["n", 2, 6, 5], [2, 2, 3, 3], {"dilations": [2, 1], "pads": [2, 1, 1, 0]}),
        (["n", 3, 7], [3, 2, 4], {"strides": [2], "pads": [1, 2]}),
        (["n", 2, 3, 4, 3], [2, 2, 2, 3, 2], {"strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]}),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose_becomes_matmul_and_col2im(
    x_shape: list, w_shape: list, attrs: dict, opset: int, bias: bool
) -> None:
    model = _conv_transpose(x_shape, w_shape, opset, bias=bias, **attrs)
    rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
    ops = [n.op_type for n in rewritten.graph.node]
    assert "ConvTranspose" not in ops and "Col2Im" in ops
    assert max(o.version for o in rewritten.opset_import if o.domain == "") == max(opset, 18)
    feeds = _random_feeds(model)
    (expected,), (got,) = _run(model, feeds), _run(rewritten, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "attrs"),
    [
        (["n", 4, 5, 5], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        (["n", 4, 5, 5], {"output_shape": [10, 10], "strides": [2, 2]}),
        (["n", 4, "h", 5], {"strides": [2, 2]}),  # a spatial size only known at run time
        (["n", 4, 5, 5], {"strides": [2, 2], "dilations": [3, 3], "output_padding": [2, 0]}),
        (["n", 4, 5, 5], {"strides": [2, 2], "group": 2}),
    ],
)
def test_conv_transposes_col2im_cannot_take_stay(x_shape: list, attrs: dict) -> None:
    weight = [4, 3 // int(attrs.get("group", 1)) or 1, 3, 3]
    source = _conv_transpose(x_shape, weight, 17, **attrs).SerializeToString()
    assert for_cpu(source) is source


def test_col2im_carries_nans_and_infinities_where_conv_transpose_does() -> None:
    model = _conv_transpose(["n", 4, 5, 5], [4, 3, 3, 3], 18, bias=True, strides=[2, 2],
                            pads=[1, 1, 1, 1])  # fmt: skip
    rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
    assert [n.op_type for n in rewritten.graph.node if n.op_type == "Col2Im"] == ["Col2Im"]
    feeds = _random_feeds(model)
    (g,) = [v.name for v in model.graph.input if v.name not in ("w", "b")]
    feeds[g][0, 1, 2, 2], feeds[g][1, 3, 0, 4] = np.nan, np.inf
    (expected,), (got,) = _run(model, feeds), _run(rewritten, feeds)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_float64_conv_transpose_stays() -> None:
    # onnxruntime's CPU Col2Im has no float64 kernel
    model = _conv_transpose(["n", 4, 5, 5], [4, 3, 3, 3], 17, dtype=TensorProto.DOUBLE,
                            strides=[2, 2])  # fmt: skip
    source = model.SerializeToString()
    assert for_cpu(source) is source


def test_relu_mask_stays_as_written_on_the_cpu() -> None:
    # Cast(Greater(y, 0)) is 0 where y is NaN; Ceil(Clip(y, 0, 1)) would be NaN there
    for extra_use in (False, True):
        source = _mask_model(extra_use).SerializeToString()
        assert for_cpu(source) is source


def test_models_without_conv_transpose_are_not_converted(tmp_path: Path) -> None:
    source = _reduce_model("ReduceMean", [0, 2, 3], 1, 17).SerializeToString()
    assert for_cpu(source) is source
    path = tmp_path / "model.onnx"
    path.write_bytes(source)
    assert for_cpu(str(path)) == str(path)


def test_strided_training_step_gives_the_same_numbers_at_opset_18() -> None:
    # An opset-17 training step with BatchNorm statistics (ReduceMean's axes become an input
    # at 18) and a strided Conv whose input gradient is a ConvTranspose.
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Conv2d(4, 6, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(6 * 4 * 4, 5),
    )  # fmt: skip
    torch.manual_seed(0)
    program = build_program(export(net, torch.zeros(2, 2, 8, 8), training=True),
                            loss=CrossEntropyLoss())  # fmt: skip
    train = program.train_model
    assert "ConvTranspose" in [n.op_type for n in train.graph.node]
    rewritten = onnx.load_from_string(for_cpu(train.SerializeToString()))
    assert "ConvTranspose" not in [n.op_type for n in rewritten.graph.node]
    rng = np.random.default_rng(0)
    feeds = dict(program.parameters)
    x = rng.standard_normal((6, 2, 8, 8)).astype(np.float32)
    feeds.update(zip(program.input_names, (x, rng.integers(0, 5, 6).astype(np.int64))))
    feeds = {i.name: feeds[i.name] for i in train.graph.input}
    for name, expected, got in zip(
        [o.name for o in train.graph.output], _run(train, feeds), _run(rewritten, feeds)
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def _column_sum_model(shape: list, axes: list[int], keepdims: int, opset: int) -> onnx.ModelProto:
    axes_as_input = opset >= 13
    inputs = ["x", "axes"] if axes_as_input else ["x"]
    attrs = {"keepdims": keepdims} if axes_as_input else {"keepdims": keepdims, "axes": axes}
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", inputs, ["y"], **attrs)],
        "column_sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes_as_input else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize(("shape", "axes"), [([8, 16, 64], [0, 1]), ([8, 16, 64], [1, 0]),
                                             ([12, 4, 5, 6], [0]), ([300, 96], [0])])  # fmt: skip
def test_sums_over_the_leading_axes_become_a_matmul_on_the_cpu(
    shape: list, axes: list[int], keepdims: int, opset: int
) -> None:
    # a bias's gradient: onnxruntime's GEMV is about twice as fast as its ReduceSum here
    model = _column_sum_model(shape, axes, keepdims, opset)
    rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
    ops = [n.op_type for n in rewritten.graph.node if n.op_type != "Constant"]
    assert ops == ["Reshape", "MatMul", "Reshape"]
    x = (np.random.default_rng(0).standard_normal(shape) + 3).astype(np.float32)
    (expected,), (got,) = _run(model, {"x": x}), _run(rewritten, {"x": x})
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize(
    ("shape", "axes"),
    [([8, 16, 32], [0, 1]), ([8, 16, 64], [0, 2]), ([8, 16, 64], [1]), ([8, 16, 64], [0, 1, 2]),
     (["n", 16, 64], [0, 1])],
    ids=["few-kept", "not-leading", "middle", "all", "dynamic"],
)  # fmt: skip
def test_sums_the_matmul_does_not_take_stay(shape: list, axes: list[int]) -> None:
    source = _column_sum_model(shape, axes, 1, 17).SerializeToString()
    assert for_cpu(source) is source
