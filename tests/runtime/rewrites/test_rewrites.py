"""The provider rewrite rules of traingraph.runtime.rewrites, each on a small model before and
after, run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from traingraph.runtime import rewrites


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "rule",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.op_type != "Constant"]


def _masked_product(
    extra_use: bool = False, compare: str = "Greater", swap: bool = False
) -> onnx.ModelProto:
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    product = ["c", "g"] if swap else ["g", "c"]
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node(compare, ["x", "zero"], ["m"]),
        helper.make_node("Cast", ["m"], ["c"], to=TensorProto.FLOAT),
        helper.make_node("Mul", product, ["y"]),
    ]
    outputs = [("y", TensorProto.FLOAT, [2, 3])]
    if extra_use:
        nodes.append(helper.make_node("Neg", ["c"], ["n"]))
        outputs.append(("n", TensorProto.FLOAT, [2, 3]))
    inputs = [("x", TensorProto.FLOAT, [2, 3]), ("g", TensorProto.FLOAT, [2, 3])]
    return _model(nodes, inputs, outputs)


def test_mask_as_where_is_the_product_where_the_gradient_is_finite():
    feeds = {
        "x": np.array([[1, -1, np.nan], [0, 2, -3]], np.float32),
        "g": np.array([[1, 2, 3], [4, 5, 6]], np.float32),
    }
    for swap in (False, True):
        model = _masked_product(swap=swap)
        rewritten = rewrites.apply(model, [rewrites.MASK_AS_WHERE])
        assert rewritten is not None and _ops(rewritten) == ["Greater", "Where"]
        onnx.checker.check_model(rewritten, full_check=True)
        np.testing.assert_array_equal(_run(rewritten, feeds)[0], _run(model, feeds)[0])
    # where the mask is off, an infinite gradient gives 0 (the product gives NaN)
    feeds["g"][0, 1] = np.inf
    got = _run(rewrites.apply(_masked_product(), [rewrites.MASK_AS_WHERE]), feeds)[0]
    assert got[0, 1] == 0 and np.isnan(_run(_masked_product(), feeds)[0][0, 1])


def test_mask_as_where_leaves_casts_read_elsewhere_and_non_boolean_sources():
    assert rewrites.apply(_masked_product(extra_use=True), [rewrites.MASK_AS_WHERE]) is None
    assert rewrites.apply(_masked_product(compare="Sub"), [rewrites.MASK_AS_WHERE]) is None


def _shift(direction: str, constant: bool = True) -> onnx.ModelProto:
    amount = helper.make_tensor("k", TensorProto.UINT64, [], [3])
    nodes = [helper.make_node("BitShift", ["n", "k"], ["s"], direction=direction)]
    inputs = [("n", TensorProto.UINT64, [4])]
    if constant:
        nodes.insert(0, helper.make_node("Constant", [], ["k"], value=amount))
    else:
        inputs.append(("k", TensorProto.UINT64, []))
    return _model(nodes, inputs, [("s", TensorProto.UINT64, [4])])


def test_shift_as_division_divides_by_the_power_of_two():
    feeds = {"n": np.array([8, 17, 100, 2**63 + 5], np.uint64)}
    model = _shift("RIGHT")
    rewritten = rewrites.apply(model, [rewrites.SHIFT_AS_DIVISION])
    assert rewritten is not None and _ops(rewritten) == ["Div"]
    onnx.checker.check_model(rewritten, full_check=True)
    np.testing.assert_array_equal(_run(rewritten, feeds)[0], _run(model, feeds)[0])


def test_shift_as_division_leaves_left_shifts_and_shifts_by_a_variable():
    assert rewrites.apply(_shift("LEFT"), [rewrites.SHIFT_AS_DIVISION]) is None
    assert rewrites.apply(_shift("RIGHT", constant=False), [rewrites.SHIFT_AS_DIVISION]) is None


def _column_sum(shape: list, opset: int) -> onnx.ModelProto:
    if opset >= 13:
        axes = helper.make_tensor("axes", TensorProto.INT64, [2], [1, 0])
        nodes = [
            helper.make_node("Constant", [], ["axes"], value=axes),
            helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
        ]
    else:
        nodes = [helper.make_node("ReduceSum", ["x"], ["s"], axes=[1, 0], keepdims=0)]
    model = _model(nodes, [("x", TensorProto.FLOAT, shape)], [("s", TensorProto.FLOAT, None)])
    model.opset_import[0].version = opset
    return onnx.shape_inference.infer_shapes(model)


def test_column_sums_as_matmul_sums_the_rows_with_one_product():
    x = np.random.default_rng(0).standard_normal((6, 5, 80)).astype(np.float32)
    for opset in (11, 17):
        model = _column_sum([6, 5, 80], opset)
        rewritten = rewrites.apply(model, rewrites.CPU_RULES)
        assert rewritten is not None and _ops(rewritten) == ["Reshape", "MatMul", "Reshape"]
        (got,), (want,) = _run(rewritten, {"x": x}), _run(model, {"x": x})
        assert got.shape == want.shape == (80,)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    x[0, 0, 3] = np.nan
    rewritten = rewrites.apply(_column_sum([6, 5, 80], 17), rewrites.CPU_RULES)
    assert np.isnan(_run(rewritten, {"x": x})[0][3])


def test_column_sums_as_matmul_leaves_dynamic_and_narrow_sums():
    assert rewrites.apply(_column_sum(["n", 5, 80], 17), rewrites.CPU_RULES) is None
    assert rewrites.apply(_column_sum([6, 5, 8], 17), rewrites.CPU_RULES) is None


def _reduction(
    op: str, axes: list[int], by_attribute: bool, keepdims: int = 0
) -> onnx.ModelProto:
    if by_attribute:
        nodes = [helper.make_node(op, ["x"], ["r"], axes=axes, keepdims=keepdims)]
    else:
        tensor = helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)
        nodes = [
            helper.make_node("Constant", [], ["axes"], value=tensor),
            helper.make_node(op, ["x", "axes"], ["r"], keepdims=keepdims),
        ]
    x = ("x", TensorProto.FLOAT, [2, 3, 4, 5])
    model = _model(nodes, [x], [("r", TensorProto.FLOAT, None)])
    # Axes became an input at opset 13 (ReduceSum) and 18 (ReduceMean).
    opsets = {("ReduceSum", True): 11, ("ReduceMean", False): 18}
    model.opset_import[0].version = opsets.get((op, by_attribute), 17)
    return model


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize(
    ("axes", "runs"), [([3, 0, 1], 2), ([0, 2, 3], 2), ([0, 2], 2), ([1, 3], 2), ([0, 1, 3], 2)]
)
def test_reductions_over_runs_reduce_each_run_in_turn(axes, runs, keepdims):
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    x[1, 2, 0, 0] = np.inf
    for op in ("ReduceSum", "ReduceMean"):
        for by_attribute in (True, False):
            model = _reduction(op, axes, by_attribute, keepdims)
            rewritten = rewrites.apply(model, rewrites.REDUCTIONS_OVER_RUNS)
            assert rewritten is not None and _ops(rewritten) == [op] * runs
            (got,), (want,) = _run(rewritten, {"x": x}), _run(model, {"x": x})
            expected = x.astype(np.float64).sum(axis=tuple(axes), keepdims=bool(keepdims))
            if op == "ReduceMean":
                expected /= np.prod([x.shape[a] for a in axes])
            assert got.shape == want.shape == expected.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_reductions_over_runs_leave_one_run_and_negative_axes():
    for axes in ([1, 2], [0], [-1, 0]):
        for by_attribute in (True, False):
            model = _reduction("ReduceSum", axes, by_attribute)
            assert rewrites.apply(model, rewrites.REDUCTIONS_OVER_RUNS) is None


def _grouped(weight: np.ndarray, bias: bool = False, **attrs: object) -> onnx.ModelProto:
    groups = weight.shape[0] // 2
    tensors = [helper.make_tensor("w", TensorProto.FLOAT, weight.shape, weight.ravel())]
    inputs = ["x", "w"]
    if bias:
        tensors.append(helper.make_tensor("b", TensorProto.FLOAT, [weight.shape[0]],
                                          np.ones(weight.shape[0])))  # fmt: skip
        inputs.append("b")
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in tensors]
    nodes.append(helper.make_node("Conv", inputs, ["y"], group=groups, **attrs))
    x = ("x", TensorProto.FLOAT, [2, groups, 5, 5])
    return _model(nodes, [x], [("y", TensorProto.FLOAT, None)])


def test_shared_filters_as_batch_is_one_conv_over_the_batch():
    rng = np.random.default_rng(0)
    model = _grouped(np.tile(rng.standard_normal((2, 1, 3, 3)), (3, 1, 1, 1)), pads=[1, 0, 1, 0])
    rewritten = rewrites.apply(model, rewrites.CUDA_FOLD_RULES)
    assert rewritten is not None and _ops(rewritten) == ["Reshape", "Conv", "Reshape"]
    assert all(a.name != "group" for n in rewritten.graph.node for a in n.attribute)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    x[0, 1, 2, 2] = np.nan
    (got,), (want,) = _run(rewritten, {"x": x}), _run(model, {"x": x})
    np.testing.assert_array_equal(got, want)


def test_shared_filters_as_batch_leaves_biases_padding_modes_and_distinct_filters():
    rng = np.random.default_rng(0)
    shared = np.tile(rng.standard_normal((2, 1, 3, 3)), (3, 1, 1, 1))
    assert rewrites.apply(_grouped(shared, bias=True), rewrites.CUDA_FOLD_RULES) is None
    same = _grouped(shared, auto_pad="SAME_UPPER")
    assert rewrites.apply(same, rewrites.CUDA_FOLD_RULES) is None
    distinct = _grouped(rng.standard_normal((6, 1, 3, 3)))
    assert rewrites.apply(distinct, rewrites.CUDA_FOLD_RULES) is None


def _scatter_model(reduction: str, index_depth: int = 1) -> onnx.ModelProto:
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["y"], reduction=reduction)
    shape = [50, 256] if index_depth == 1 else [50, 4, 64]
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [4096, index_depth]),
         helper.make_tensor_value_info("upd", TensorProto.FLOAT, [4096, *shape[index_depth:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_scatter_of_rows_with_a_reduction_becomes_scatter_elements_and_keeps_every_update():
    # onnxruntime's CPU ScatterND adds rows from two threads without ordering them and loses
    # some where the indices repeat a row; the rewritten form applies every update, in order.
    from traingraph.runtime.rewrites.specialize import for_cpu

    model = _scatter_model("add")
    rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
    assert "ScatterND" not in _ops(rewritten) and "ScatterElements" in _ops(rewritten)
    rng = np.random.default_rng(0)
    feeds = {
        "data": rng.standard_normal((50, 256)).astype(np.float32),
        "idx": rng.integers(-50, 50, (4096, 1)),
        "upd": rng.standard_normal((4096, 256)).astype(np.float32),
    }
    expected = feeds["data"].astype(np.float64)
    np.add.at(expected, feeds["idx"][:, 0], feeds["upd"].astype(np.float64))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(
        rewritten.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    results = [session.run(None, feeds)[0] for _ in range(8)]
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(result, results[0])


def test_scatters_without_a_reduction_or_of_elements_stay():
    from traingraph.runtime.rewrites.specialize import for_cpu

    for model in (_scatter_model("none"), _scatter_model("add", index_depth=2)):
        source = model.SerializeToString()
        assert "ScatterND" in _ops(onnx.load_from_string(for_cpu(source)))


def _one_row_scatter(index: int, reduction: str = "add") -> onnx.ModelProto:
    """``scatter_add_rows`` of the Gather gradient for one index: ``g`` ``[n, 5]`` added into
    row ``index mod D`` of zeros ``[D, n * 5]``, the depth read from ``x`` ``[D, n, 5]`` at run
    time (shape inference leaves the scattered values' shapes open)."""

    def ints(name: str, *values: int) -> onnx.NodeProto:
        tensor = helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
        return helper.make_node("Constant", [], [name], value=tensor)

    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    nodes = [
        helper.make_node("Constant", [], ["index"], value=helper.make_tensor(
            "index", TensorProto.INT64, [], [index])),
        helper.make_node("Constant", [], ["zero"], value=zero),
        ints("minus_one", -1), ints("one", 1), ints("begin", 0), ints("end", 1), ints("axis", 0),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Gather", ["x_shape", "zero_i"], ["depth_scalar"]),
        helper.make_node("Mod", ["index", "depth_scalar"], ["wrapped"]),
        helper.make_node("Reshape", ["wrapped", "minus_one"], ["flat"]),
        helper.make_node("Shape", ["flat"], ["count"]),
        helper.make_node("Concat", ["count", "minus_one"], ["rows_shape"], axis=0),
        helper.make_node("Reshape", ["g", "rows_shape"], ["rows"]),
        helper.make_node("Slice", ["x_shape", "begin", "end", "axis"], ["depth"]),
        helper.make_node("Shape", ["rows"], ["width"], start=1, end=2),
        helper.make_node("Concat", ["depth", "width"], ["table_shape"], axis=0),
        helper.make_node("Expand", ["zero", "table_shape"], ["table"]),
        helper.make_node("Unsqueeze", ["flat", "one"], ["column"]),
        helper.make_node("Shape", ["rows"], ["rows_dims"]),
        helper.make_node("Expand", ["column", "rows_dims"], ["positions"]),
        helper.make_node(
            "ScatterElements", ["table", "positions", "rows"], ["y"], axis=0, reduction=reduction
        ),
    ]
    graph = helper.make_graph(
        nodes, "one_row",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["d", "n", 5]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("zero_i", TensorProto.INT64, [], [0])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_one_row_scatter_into_zeros_becomes_a_where_with_the_same_values():
    # a Gather of one position (qkv[0] of an exported attention) has this gradient where the
    # axis is not static; onnxruntime's ScatterElements walks the row on one thread
    from traingraph.runtime.rewrites.specialize import for_cpu

    rng = np.random.default_rng(0)
    g = rng.standard_normal((7, 5)).astype(np.float32)
    g.reshape(-1)[:5] = [np.nan, np.inf, -np.inf, -0.0, 0.0]
    x = np.zeros((3, 7, 5), np.float32)
    for index in (0, 2, -1, -3):
        for reduction in ("add", "none"):
            model = _one_row_scatter(index, reduction)
            rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
            assert "ScatterElements" not in _ops(rewritten) and "Where" in _ops(rewritten)
            assert "Expand" not in _ops(rewritten)  # the table is not filled any more
            onnx.checker.check_model(rewritten, full_check=True)
            for threads in (1, 2):
                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                sessions = [
                    ort.InferenceSession(m.SerializeToString(), options,
                                         providers=["CPUExecutionProvider"])
                    for m in (model, rewritten)
                ]  # fmt: skip
                want, got = (s.run(None, {"x": x, "g": g})[0] for s in sessions)
                assert got.shape == want.shape == (3, 35)
                assert np.array_equal(got, want, equal_nan=True)
                assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 as the scatter


def test_scatters_of_several_rows_or_other_tables_stay():
    from traingraph.runtime.rewrites.specialize import for_cpu

    several = _one_row_scatter(1)
    flat = next(n for n in several.graph.node if n.output[0] == "flat")
    flat.input[0] = "indices"  # two indices: their rows go to one table row each
    several.graph.node.insert(0, helper.make_node(
        "Constant", [], ["indices"],
        value=helper.make_tensor("indices", TensorProto.INT64, [2], [0, 1])))  # fmt: skip
    multiplied = _one_row_scatter(1, "mul")
    for model in (several, multiplied):
        rewritten = for_cpu(model.SerializeToString())
        assert "ScatterElements" in _ops(onnx.load_from_string(rewritten))


def _expanded_sum(op_type: str, first: bool, target: list[int]) -> onnx.ModelProto:
    """``op_type(a, Expand(b, Shape(x)))`` (the Expand first where ``first``): a global average
    pool's gradient added to the pooled input's other gradient."""
    nodes = [
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Expand", ["b", "x_shape"], ["e"]),
        helper.make_node(op_type, ["e", "a"] if first else ["a", "e"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "expanded",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4, 5]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3, 1, 1]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, target)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_expanded_addend_of_the_same_shape_becomes_a_broadcasting_add():
    from traingraph.runtime.rewrites.specialize import for_cpu

    rng = np.random.default_rng(0)
    feeds = {
        "a": rng.standard_normal((2, 3, 4, 5)).astype(np.float32),
        "b": rng.standard_normal((2, 3, 1, 1)).astype(np.float32),
        "x": np.zeros((2, 3, 4, 5), np.float32),
    }
    feeds["a"].reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    feeds["b"].reshape(-1)[1:4] = [-np.inf, -0.0, np.nan]
    for op_type in ("Sum", "Add"):
        for first in (True, False):
            model = _expanded_sum(op_type, first, [2, 3, 4, 5])
            rewritten = onnx.load_from_string(for_cpu(model.SerializeToString()))
            assert _ops(rewritten) == ["Add"]
            want, got = _run(model, feeds)[0], _run(rewritten, feeds)[0]
            assert got.shape == want.shape == (2, 3, 4, 5)
            assert np.array_equal(got, want, equal_nan=True)
            assert np.array_equal(np.signbit(got), np.signbit(want))


def test_an_expand_past_the_addends_shape_stays():
    from traingraph.runtime.rewrites.specialize import for_cpu

    model = _expanded_sum("Sum", False, [3, 2, 3, 4, 5])  # a rank the sum takes from it
    source = model.SerializeToString()
    assert "Expand" in _ops(onnx.load_from_string(for_cpu(source)))
