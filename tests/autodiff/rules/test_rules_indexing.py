import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from gradcheck import check_model_gradient, check_op_gradient, session
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)
DYNAMIC = ["none", "batch", "all"]


def r(*shape):
    return rng.standard_normal(shape)


def ints(*values):
    return np.array(values, dtype=np.int64)


def take(positions):
    """A torch function that reads ``t`` at the flat ``positions`` (the reference selection)."""
    index = torch.tensor(np.ascontiguousarray(positions, dtype=np.int64))
    return lambda t, *_: torch.take(t, index)


def iota(shape):
    return np.arange(int(np.prod(shape))).reshape(shape)


# ------------------------------------------------------------------------------------ Slice
SLICES = [
    # starts, ends, axes, steps, numpy index of a (3, 5, 4) array
    ((1,), (3,), (0,), None, np.s_[1:3]),
    ((0, -1), (5, -4), (1, 2), (2, -1), np.s_[:, 0:5:2, -1:-4:-1]),
    ((-100,), (100,), (2,), (3,), np.s_[:, :, ::3]),
    ((-1, 4), (-1000, -1000), (0, 1), (-2, -2), np.s_[::-2, 4::-2]),
    ((1, 1, 1), (3, 4, 3), None, None, np.s_[1:3, 1:4, 1:3]),
    ((2,), (2,), (-1,), None, np.s_[:, :, 2:2]),
    ((-3, 0), (100, -1), (-1, 1), (1, 1), np.s_[:, 0:4, 1:4]),
    ((0, 1), (2**63 - 1, 2**63 - 1), (1, 2), (2, 2), np.s_[:, 0::2, 1::2]),
    ((1, -4), (5, 3), (1, 2), (3, 2), np.s_[:, 1:5:3, -4:3:2]),
]


@pytest.mark.parametrize("case", range(len(SLICES)))
@pytest.mark.parametrize(("opset", "dynamic"), [(13, "none"), (18, "batch"), (18, "all")])
def test_slice(case, opset, dynamic):
    starts, ends, axes, steps, index = SLICES[case]
    x = r(3, 5, 4)
    inputs = {"x": x, "starts": ints(*starts), "ends": ints(*ends)}
    inputs["axes"] = None if axes is None else ints(*axes)
    inputs["steps"] = None if steps is None else ints(*steps)
    check_op_gradient(
        "Slice", inputs, const_inputs=["starts", "ends", "axes", "steps"], opset=opset,
        dynamic=dynamic, torch_fn=take(iota(x.shape)[index]),
    )


def test_unit_step_slice_gradient_is_one_pad():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    bounds = [numpy_helper.from_array(ints(*v), n) for n, v in
              (("starts", (4,)), ("ends", (-4,)), ("axes", (-1,)))]
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], initializer=bounds),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    grad = build_gradient_graph(model, ["x"])
    ops = {n.op_type for n in grad.graph.node}
    assert "Pad" in ops and "ScatterElements" not in ops


def test_strided_slice_gradient_interleaves_zeros_without_a_scatter():
    """Swin's patch merging, ``x[:, 0::2, 1::2, :]`` with a dynamic batch: each strided axis
    is an Unsqueeze, a Pad and a Reshape, and one Pad places the result."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 7, 8, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    bounds = [numpy_helper.from_array(ints(*v), n) for n, v in
              (("starts", (0, 1)), ("ends", (2**63 - 1, 2**63 - 1)), ("axes", (1, 2)),
               ("steps", (2, 2)))]  # fmt: skip
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], initializer=bounds),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    ops = [n.op_type for n in build_gradient_graph(model, ["x"]).graph.node]
    assert "ScatterElements" not in ops and "Range" not in ops
    data = r(2, 7, 8, 3)
    inputs = {"x": data, "starts": ints(0, 1), "ends": ints(2**63 - 1, 2**63 - 1),
              "axes": ints(1, 2), "steps": ints(2, 2)}  # fmt: skip
    check_op_gradient(
        "Slice", inputs, const_inputs=["starts", "ends", "axes", "steps"], opset=18,
        dynamic="batch", torch_fn=take(iota(data.shape)[:, 0::2, 1::2]),
    )  # fmt: skip


def test_slice_bounds_computed_at_run_time():
    x = r(4, 6)
    inputs = {"x": x, "starts": ints(-1, 1), "ends": ints(0, 5), "axes": ints(0, 1),
              "steps": ints(-1, 2)}
    check_op_gradient(
        "Slice", inputs, wrt=["x"], dynamic="all", torch_fn=take(iota(x.shape)[-1:0:-1, 1:5:2]),
    )


@pytest.mark.parametrize(
    ("starts", "ends"),
    [((-1, 1), (100, -2)), ((0, -9), (2, 9)), ((3, 2), (1, 5))],
    ids=["negative and past the end", "clamped", "empty"],
)
def test_unit_step_slice_with_run_time_bounds_is_a_pad(starts, ends):
    """Bounds known only when the step runs (or lengths only then): the pads are computed
    then, resolved and clamped as Slice does, and an empty slice pads to zeros."""
    x = r(4, 6)
    index = tuple(slice(s, e) for s, e in zip(starts, ends))  # numpy resolves them as Slice
    inputs = {"x": x, "starts": ints(*starts), "ends": ints(*ends), "axes": ints(0, 1)}
    check_op_gradient(
        "Slice", inputs, wrt=["x"], const_inputs=["axes"], dynamic="all",
        torch_fn=take(iota(x.shape)[index]),
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6]),
         *[helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in ("starts", "ends")]],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(ints(0, 1), "axes")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    ops = {n.op_type for n in build_gradient_graph(model, ["x"]).graph.node}
    assert "Pad" in ops and "ScatterElements" not in ops


# ----------------------------------------------------------------------------------- Gather
GATHERS = [
    # data shape, axis, indices
    ((5, 3), 0, ints(0, 4, 4, -1, 2)),
    ((3, 5, 2), 1, np.array([[1, -2], [1, 1], [0, 4]], dtype=np.int64)),
    ((3, 4), -1, np.array(2, dtype=np.int64)),
    ((2, 3, 4), 2, ints(-1, 0, -1)),
    ((4, 3), 0, np.array([[3, 3], [-1, 0]], dtype=np.int32)),
    # one position or a run of neighbouring ones: the gradient is a Pad where the axis is static
    ((3, 4, 2), 0, np.array(1, dtype=np.int64)),
    ((2, 6, 3), 1, ints(2, 3, 4)),
    ((2, 5), -1, ints(-3, -2, -1)),
    ((4, 3), 0, ints(3, 2)),
]


@pytest.mark.parametrize("case", range(len(GATHERS)))
@pytest.mark.parametrize(
    ("opset", "dynamic"), [(13, "none"), (15, "all"), (16, "batch"), (18, "all")]
)
def test_gather(case, opset, dynamic):
    shape, axis, indices = GATHERS[case]
    x = r(*shape)
    positions = np.take(iota(shape), indices, axis=axis)
    check_op_gradient(
        "Gather", {"x": x, "indices": indices}, {"axis": axis}, const_inputs=["indices"],
        opset=opset, dynamic=dynamic, torch_fn=take(positions),
    )


@pytest.mark.parametrize(
    ("shape", "axis", "indices"),
    [((3, "n", 8), 0, np.array(0, dtype=np.int64)), (("n", 5), 1, ints(1, 2))],
)
def test_gradient_of_a_constant_position_or_run_is_one_pad(shape, axis, indices):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], [numpy_helper.from_array(indices, "i")]),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    ops = {n.op_type for n in build_gradient_graph(model, ["x"]).graph.node}
    assert "Pad" in ops and not ops & {"ScatterND", "ScatterElements", "MatMul"}, ops


def _embedding_gradient(rows, width, index_shape):
    """The gradient graph (output ``x_grad``) of ``Gather(x [rows, width], i) * w``, ``i`` int64
    of ``index_shape``, ``w`` of the gathered shape, at opset 18."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, index_shape)
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [*index_shape, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Gather", ["x", "i"], ["e"]),
        helper.make_node("Mul", ["e", "w"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x, i, w], [y]), opset_imports=[helper.make_opsetid("", 18)]
    )
    return build_gradient_graph(model, ["x"])


def test_gradient_of_repeated_rows_adds_every_update_with_two_threads():
    # An embedding's gradient: 4096 rows added into 50. onnxruntime's CPU ScatterND with
    # reduction="add" loses some of them when two threads add into one row; the rule's
    # ScatterElements keeps every update, in one order.
    import onnxruntime as ort

    rows, width, count = 50, 256, 4096
    grad = _embedding_gradient(rows, width, [count])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(
        grad.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {
        "x": r(rows, width).astype(np.float32),
        "i": rng.integers(0, rows, count),
        "w": r(count, width).astype(np.float32),
    }
    expected = np.zeros((rows, width))
    np.add.at(expected, feeds["i"], feeds["w"].astype(np.float64))
    results = [session.run(["x_grad"], feeds)[0] for _ in range(8)]
    for result in results:
        np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize("rows", [2, 8, 9])
def test_gradient_of_a_small_table_adds_each_update_into_its_own_row(rows):
    # Up to SMALL_TABLE_ROWS rows (a token-type table) the rule selects with Where and sums;
    # from 9 on it scatters. Either way a NaN update reaches its own row only.
    import onnxruntime as ort

    from traingraph.autodiff.rules.indexing import SMALL_TABLE_ROWS

    width, count = 16, 300
    grad = _embedding_gradient(rows, width, [3, count // 3])
    ops = {n.op_type for n in grad.graph.node}
    assert ("ScatterElements" not in ops) == (rows <= SMALL_TABLE_ROWS)
    index = rng.integers(0, rows, (3, count // 3))
    index[0, 0], index[1, 0] = rows - 1, -1  # a negative index counts from the end
    weights = r(3, count // 3, width).astype(np.float32)
    weights[0, 0, 3] = np.nan  # row rows - 1, column 3
    session = ort.InferenceSession(grad.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": r(rows, width).astype(np.float32), "i": index, "w": weights}
    (got,) = session.run(["x_grad"], feeds)
    expected = np.zeros((rows, width))
    np.add.at(expected, index.reshape(-1) % rows, weights.reshape(-1, width).astype(np.float64))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(got).sum() == 1
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_against_index_select(opset):
    x, indices = r(6, 3), ints(1, 5, 1, 0)
    check_op_gradient(
        "Gather", {"x": x, "indices": indices}, {"axis": 0}, wrt=["x"], opset=opset,
        dynamic="all", torch_fn=lambda t, i: torch.index_select(t, 0, i),
    )


# --------------------------------------------------------------------------- GatherElements
@pytest.mark.parametrize(
    ("opset", "dynamic"), [(13, "none"), (13, "all"), (16, "batch"), (16, "all")]
)
@pytest.mark.parametrize(
    ("shape", "axis", "index_shape"),
    [((3, 4), 0, (5, 4)), ((3, 4), 1, (3, 6)), ((2, 3, 4), -1, (2, 3, 2)), ((3, 4), 1, (2, 3))],
)
def test_gather_elements(dynamic, opset, shape, axis, index_shape):
    x = r(*shape)
    indices = rng.integers(-shape[axis], shape[axis], size=index_shape)
    check_op_gradient(
        "GatherElements", {"x": x, "indices": indices}, {"axis": axis}, const_inputs=["indices"],
        opset=opset, dynamic=dynamic,
        torch_fn=lambda t: torch.gather(t, axis, torch.tensor(indices % shape[axis])),
    )


def test_gather_elements_against_take_along_dim():
    x = r(3, 4)
    indices = rng.integers(0, 4, size=(3, 7))
    check_op_gradient(
        "GatherElements", {"x": x, "indices": indices}, {"axis": 1}, wrt=["x"], dynamic="all",
        torch_fn=lambda t, i: torch.take_along_dim(t, i, dim=1),
    )


# --------------------------------------------------------------------------------- GatherND
@pytest.mark.parametrize(("opset", "dynamic"), [(13, "all"), (16, "none"), (18, "batch")])
@pytest.mark.parametrize(
    ("shape", "indices", "batch_dims"),
    [
        ((3, 4), np.array([[0, 1], [2, -1], [0, 1]]), 0),
        ((3, 4, 2), np.array([[[1], [-1]], [[1], [0]]]), 0),
        ((4,), np.array([[3], [3], [0]]), 0),
        ((2, 3, 4), np.array([[[1], [1], [2]], [[0], [-1], [2]]]), 1),
        ((2, 3, 4), np.array([[1, 3], [2, 0]]), 1),
        ((2, 2, 3, 2), np.array([[[2], [2]], [[0], [1]]]), 2),
    ],
)
def test_gather_nd(dynamic, opset, shape, indices, batch_dims):
    x = r(*shape)
    positions = _gather_nd_reference(iota(shape), indices, batch_dims)
    check_op_gradient(
        "GatherND", {"x": x, "indices": indices}, {"batch_dims": batch_dims},
        const_inputs=["indices"], opset=opset, dynamic=dynamic, torch_fn=take(positions),
    )


def _gather_nd_reference(data, indices, batch_dims):
    if batch_dims == 0:
        return data[tuple(np.moveaxis(indices, -1, 0))]
    return np.stack([_gather_nd_reference(d, i, batch_dims - 1) for d, i in zip(data, indices)])


def test_gather_nd_against_torch_advanced_indexing():
    x = r(3, 4)
    rows, cols = ints(0, 2, 0), ints(1, 3, 1)
    check_op_gradient(
        "GatherND", {"x": x, "indices": np.stack([rows, cols], axis=-1)}, wrt=["x"],
        dynamic="all", torch_fn=lambda t, i: t[i[:, 0], i[:, 1]],
    )


# ---------------------------------------------------------------------- ScatterElements/ND
@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize(
    ("opset", "reduction"), [(13, None), (16, "none"), (16, "add"), (18, "add")]
)
def test_scatter_elements(dynamic, opset, reduction):
    data, updates = r(4, 3), r(2, 3)
    if reduction == "add":
        indices = np.array([[1, -1, 1], [1, 0, 2]])
    else:
        indices = np.array([[1, -1, 1], [0, 0, 2]])
    attrs = {"axis": 0} if reduction is None else {"axis": 0, "reduction": reduction}
    normal = torch.tensor(indices % 4)
    if reduction == "add":
        torch_fn = lambda d, u: d.scatter_add(0, normal, u)  # noqa: E731
    else:
        torch_fn = lambda d, u: d.scatter(0, normal, u)  # noqa: E731
    check_op_gradient(
        "ScatterElements", {"data": data, "indices": indices, "updates": updates}, attrs,
        const_inputs=["indices"], opset=opset, dynamic=dynamic, torch_fn=torch_fn,
    )


@pytest.mark.parametrize("reduction", ["max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_elements_extremum(reduction, axis):
    """``scatter_reduce`` with ``amax`` / ``amin`` (include_self): against finite differences
    and torch where the values are distinct, and against torch's even sharing where data and
    updates tie."""
    data, updates = r(4, 5), r(4, 5)
    if axis == 0:  # rows 0..3
        indices = np.array([[1, 0, 3, 1, 0], [1, 2, 0, 0, 3], [3, 3, 1, 2, 0], [0, 1, 1, 3, 2]])
    else:  # columns 0..4, four updates per row
        indices = np.array([[1, 0, 3, 1], [1, 2, 0, 4], [3, 3, 1, 2], [0, 1, 4, 4]])
    updates = updates[:, :4] if axis == 1 else updates
    attrs = {"axis": axis, "reduction": reduction}
    normal = torch.tensor(indices)
    torch_reduce = {"max": "amax", "min": "amin"}[reduction]

    def torch_fn(d, u):
        return d.scatter_reduce(axis, normal, u, torch_reduce)

    inputs = {"data": data, "indices": indices, "updates": updates}
    check_op_gradient(
        "ScatterElements", inputs, attrs, const_inputs=["indices"], opset=18, torch_fn=torch_fn
    )
    # ties: an update equal to the data element it lands on, and two equal updates
    tied_data, tied_updates = data.copy(), updates.copy()
    tied_data[1, 0] = tied_updates[0, 0] = tied_updates[1, 0] = 9.0 if reduction == "max" else -9.0
    if axis == 1:
        tied_data[1, 0], tied_updates[1, 0] = tied_data[0, 1], tied_updates[0, 0]
        tied_data[0, 1] = tied_updates[0, 3] = tied_updates[0, 0]
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("ScatterElements", ["data", "indices", "updates"], ["y"], **attrs),
             helper.make_node("Mul", ["y", "w"], ["yw"]),
             helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)],
            "tie", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, a.shape)
                    for n, a in (("data", data), ("updates", updates), ("w", data))],
            [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
            [numpy_helper.from_array(indices, "indices")],
        ), opset_imports=[helper.make_opsetid("", 18)],
    )  # fmt: skip
    weights = r(*data.shape)
    grads = build_gradient_graph(model, wrt=["data", "updates"], loss="loss")
    got = session(grads).run(
        ["data_grad", "updates_grad"], {"data": tied_data, "updates": tied_updates, "w": weights}
    )
    d, u = (torch.tensor(a, requires_grad=True) for a in (tied_data, tied_updates))
    (torch_fn(d, u) * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(got[0], d.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], u.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dynamic", ["none", "all"])
@pytest.mark.parametrize(("opset", "reduction"), [(13, None), (16, "none"), (16, "add")])
@pytest.mark.parametrize("slices", [False, True])
def test_scatter_nd(dynamic, opset, reduction, slices):
    data = r(4, 3)
    if slices:
        indices, updates = np.array([[1], [-1]]), r(2, 3)
    elif reduction == "add":
        indices, updates = np.array([[1, 2], [1, 2], [0, -3]]), r(3)
    else:
        indices, updates = np.array([[1, 2], [3, 0], [0, -3]]), r(3)
    attrs = {} if reduction is None else {"reduction": reduction}
    columns = tuple(torch.tensor(indices[:, k]) for k in range(indices.shape[1]))
    check_op_gradient(
        "ScatterND", {"data": data, "indices": indices, "updates": updates}, attrs,
        const_inputs=["indices"], opset=opset, dynamic=dynamic,
        torch_fn=lambda d, u: torch.index_put(d, columns, u, accumulate=reduction == "add"),
    )


@pytest.mark.parametrize(
    ("op", "reduction"),
    [("ScatterElements", "mul"), ("ScatterND", "mul"), ("ScatterND", "max"), ("ScatterND", "min")],
)
def test_scatter_other_reductions_are_unsupported(op, reduction):
    inputs = {"data": r(3, 2), "indices": np.zeros((1, 1), np.int64), "updates": r(1, 2)}
    if op == "ScatterElements":
        inputs["updates"] = r(1, 1)
    with pytest.raises(GradientNotImplementedError, match=f"reduction='{reduction}'"):
        check_op_gradient(op, inputs, {"reduction": reduction}, const_inputs=["indices"], opset=18)


# -------------------------------------------------------------------------------------- Pad
PADS = [
    # pads (begins then ends), numpy pad widths for a (3, 4) array, crop
    (ints(1, 2, 0, 1), ((1, 0), (2, 1))),
    (ints(0, 2, 2, 3), ((0, 2), (2, 3))),
    (ints(-1, 1, 1, -2), ((0, 1), (1, 0))),
]


def _np_pad_positions(shape, pads, mode):
    """Flat positions read by each output element of Pad in onnxruntime.

    Negative pads crop: after padding in reflect and edge modes, before padding in wrap mode.
    """
    n = len(shape)
    widths = [(max(int(pads[i]), 0), max(int(pads[i + n]), 0)) for i in range(n)]
    positions = iota(shape)

    def crop(a):
        return a[tuple(
            slice(-min(int(pads[i]), 0), a.shape[i] + min(int(pads[i + n]), 0)) for i in range(n)
        )]

    if mode == "wrap":
        return np.pad(crop(positions), widths, mode="wrap")
    return crop(np.pad(positions, widths, mode=mode))


@pytest.mark.parametrize("case", range(len(PADS)))
@pytest.mark.parametrize(("mode", "opset"), [("reflect", 13), ("edge", 18), ("wrap", 19)])
@pytest.mark.parametrize(("const", "dynamic"), [(True, "none"), (True, "batch"), (False, "all")])
def test_pad_reflect_edge_wrap(case, mode, opset, const, dynamic):
    pads, _ = PADS[case]
    x = r(3, 4)
    positions = _np_pad_positions(x.shape, pads, mode)
    check_op_gradient(
        "Pad", {"x": x, "pads": pads}, {"mode": mode}, wrt=["x"],
        const_inputs=["pads"] if const else [], opset=opset, dynamic=dynamic,
        torch_fn=take(positions),
    )


@pytest.mark.parametrize("case", range(len(PADS)))
@pytest.mark.parametrize(("opset", "dynamic"), [(13, "none"), (18, "batch"), (18, "all")])
def test_pad_constant(case, opset, dynamic):
    pads, _ = PADS[case]
    x, value = r(3, 4), np.array(0.7)
    torch_pads = [int(pads[1]), int(pads[3]), int(pads[0]), int(pads[2])]
    check_op_gradient(
        "Pad", {"x": x, "pads": pads, "value": value}, {"mode": "constant"},
        const_inputs=["pads"], opset=opset, dynamic=dynamic,
        torch_fn=lambda t, v: F.pad(t, torch_pads, value=0.0) + _padding_mask(t.shape, pads) * v,
    )


def _padding_mask(shape, pads):
    """1 where the output of a constant Pad holds the pad value, as a torch tensor."""
    inside = F.pad(torch.ones(shape, dtype=torch.float64),
                   [int(pads[1]), int(pads[3]), int(pads[0]), int(pads[2])])
    return 1.0 - inside


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_axes_input(dynamic, mode):
    x = r(2, 3, 4)
    pads, axes = ints(1, 1, 2, -1), ints(-1, 1)
    full = ints(0, 1, 1, 0, -1, 2)
    if mode == "constant":
        torch_fn = lambda t: F.pad(t, [1, 2, 1, -1])  # noqa: E731
    else:
        torch_fn = take(_np_pad_positions(x.shape, full, mode))
    check_op_gradient(
        "Pad", {"x": x, "pads": pads, "value": None, "axes": axes}, {"mode": mode},
        const_inputs=["pads", "axes"], opset=18, dynamic=dynamic, torch_fn=torch_fn,
    )


@pytest.mark.parametrize(("mode", "torch_mode"), [
    ("reflect", "reflect"), ("edge", "replicate"), ("wrap", "circular"),
])
def test_pad_against_torch_modes(mode, torch_mode):
    x = r(2, 3, 4, 5)
    pads = ints(0, 0, 2, 1, 0, 0, 1, 3)
    check_op_gradient(
        "Pad", {"x": x, "pads": pads}, {"mode": mode}, const_inputs=["pads"], opset=19,
        torch_fn=lambda t: F.pad(t, [1, 3, 2, 1], mode=torch_mode),
    )


def test_pad_constant_pads_at_run_time():
    x = r(3, 4)
    check_op_gradient(
        "Pad", {"x": x, "pads": ints(1, -1, 0, 2)}, wrt=["x"], dynamic="all",
        torch_fn=lambda t, p: F.pad(t, [-1, 2, 1, 0]),
    )


# ------------------------------------------------------------------------ Trilu and CumSum
@pytest.mark.parametrize("dynamic", ["none", "all"])
@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -2])
def test_trilu(dynamic, upper, k):
    x = r(2, 4, 5)
    inputs = {"x": x, "k": None if k is None else np.array(k, dtype=np.int64)}
    fn = torch.triu if upper else torch.tril
    check_op_gradient(
        "Trilu", inputs, {"upper": upper}, const_inputs=["k"], dynamic=dynamic, opset=14,
        torch_fn=lambda t: fn(t, diagonal=k or 0),
    )


def _torch_cumsum(t, axis, exclusive, reverse):
    if reverse:
        t = torch.flip(t, [axis])
    out = torch.cumsum(t, axis)
    if exclusive:
        out = out - t
    return torch.flip(out, [axis]) if reverse else out


@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize(
    ("const_axis", "dynamic"), [(True, "none"), (True, "batch"), (False, "all")]
)
def test_cumsum(axis, exclusive, reverse, const_axis, dynamic):
    x = r(3, 4)
    check_op_gradient(
        "CumSum", {"x": x, "axis": np.array(axis, dtype=np.int64)},
        {"exclusive": exclusive, "reverse": reverse}, wrt=["x"],
        const_inputs=["axis"] if const_axis else [], dynamic=dynamic,
        torch_fn=(lambda t: _torch_cumsum(t, axis, exclusive, reverse)) if const_axis
        else (lambda t, a: _torch_cumsum(t, axis, exclusive, reverse)),
    )


# --------------------------------------------------------------------------------------- TopK
@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("axis", [-1, 0])
def test_topk(dynamic, largest, axis):
    x = r(4, 5)
    check_op_gradient(
        "TopK", {"x": x, "k": ints(3)}, {"axis": axis, "largest": largest, "sorted": 1},
        const_inputs=["k"], num_outputs=2, dynamic=dynamic,
        torch_fn=lambda t: torch.topk(t, 3, dim=axis, largest=bool(largest))[0],
    )


def test_topk_unsorted():
    x = r(3, 6)
    got = check_op_gradient(
        "TopK", {"x": x, "k": ints(2)}, {"sorted": 0}, const_inputs=["k"], num_outputs=2,
        used_outputs=[0],
    )
    assert np.count_nonzero(got["x"]) == 6


# ------------------------------------------------------------------------------------- Resize
# onnxruntime's Resize has no float64 kernel, so Resize is checked in float32. Resize is linear
# in its input, so a large finite-difference step is exact up to float32 rounding.
RESIZE_TOL = {"eps": 0.25, "rtol": 1e-3, "atol": 1e-4}


def r32(*shape):
    return r(*shape).astype(np.float32)


def f32(*values):
    return np.array(values, dtype=np.float32)


TORCH_RESIZES = [
    # onnx attributes, scales (H, W), torch interpolate keyword arguments
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
     (2.0, 3.0), {"mode": "nearest"}),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
     (0.5, 0.5), {"mode": "nearest"}),
    ({"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
      "nearest_mode": "round_prefer_ceil"}, (2.0, 1.5), {"mode": "nearest-exact"}),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
     (2.0, 3.0), {"mode": "bilinear", "align_corners": False}),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
     (0.5, 0.5), {"mode": "bilinear", "align_corners": False}),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"},
     (2.0, 1.5), {"mode": "bilinear", "align_corners": True}),
    ({"mode": "cubic", "coordinate_transformation_mode": "pytorch_half_pixel"},
     (2.0, 1.5), {"mode": "bicubic", "align_corners": False}),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"},
     (1.5, 2.0), {"mode": "bicubic", "align_corners": True}),
]


@pytest.mark.parametrize("case", range(len(TORCH_RESIZES)))
@pytest.mark.parametrize(("opset", "dynamic"), [(13, "none"), (18, "batch")])
def test_resize_scales_against_torch(case, opset, dynamic):
    attrs, (sh, sw), kwargs = TORCH_RESIZES[case]
    x = r32(2, 3, 4, 6)
    check_op_gradient(
        "Resize", {"x": x, "roi": None, "scales": f32(1, 1, sh, sw)}, attrs,
        const_inputs=["scales"], opset=opset, dynamic=dynamic,
        torch_fn=lambda t: F.interpolate(t, scale_factor=(sh, sw), **kwargs), **RESIZE_TOL,
    )


@pytest.mark.parametrize("case", range(len(TORCH_RESIZES)))
def test_resize_sizes_against_torch(case):
    opset = 13 if case % 2 else 18
    attrs, _, kwargs = TORCH_RESIZES[case]
    x = r32(1, 2, 5, 4)
    check_op_gradient(
        "Resize", {"x": x, "roi": None, "scales": None, "sizes": ints(1, 2, 7, 3)}, attrs,
        const_inputs=["sizes"], opset=opset, dynamic="none",
        torch_fn=lambda t: F.interpolate(t, size=(7, 3), **kwargs), **RESIZE_TOL,
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {"mode": "nearest"},
        {"mode": "nearest", "nearest_mode": "ceil", "coordinate_transformation_mode": "asymmetric"},
        {"mode": "nearest", "nearest_mode": "round_prefer_ceil",
         "coordinate_transformation_mode": "align_corners"},
        {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
        {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"},
        {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
        {"mode": "cubic", "coordinate_transformation_mode": "half_pixel_symmetric"},
    ],
)
@pytest.mark.parametrize("scales", [(1.0, 1.0, 2.5, 0.75), (1.0, 1.0, 0.6, 1.7)])
def test_resize_modes(attrs, scales):
    check_op_gradient(
        "Resize", {"x": r32(2, 2, 5, 4), "roi": None, "scales": f32(*scales)}, attrs,
        const_inputs=["scales"], opset=19, dynamic="batch", **RESIZE_TOL,
    )


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_tf_crop_and_resize(mode):
    roi = f32(0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3)
    check_op_gradient(
        "Resize", {"x": r32(1, 2, 5, 4), "roi": roi, "scales": f32(1, 1, 1.6, 1.5)},
        {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize",
         "extrapolation_value": 2.0},
        const_inputs=["roi", "scales"], opset=13, dynamic="none", **RESIZE_TOL,
    )


@pytest.mark.parametrize(
    ("policy", "axes"),
    # onnxruntime 1.31 ignores keep_aspect_ratio_policy on negative axes, so those use [2, 3].
    [("stretch", [-2, 3]), ("not_larger", [2, 3]), ("not_smaller", [2, 3])],
)
@pytest.mark.parametrize("dynamic", ["none", "batch"])
def test_resize_axes_and_aspect_ratio(policy, axes, dynamic):
    check_op_gradient(
        "Resize", {"x": r32(2, 3, 4, 6), "roi": None, "scales": None, "sizes": ints(7, 9)},
        {"mode": "linear", "axes": axes, "keep_aspect_ratio_policy": policy},
        const_inputs=["sizes"], opset=18, dynamic=dynamic, **RESIZE_TOL,
    )


def test_resize_rank3_middle_axis():
    check_op_gradient(
        "Resize", {"x": r32(2, 5, 3), "roi": None, "scales": f32(1, 1.6, 1)},
        {"mode": "linear"}, const_inputs=["scales"], opset=13, **RESIZE_TOL,
    )


def test_resize_upscaling_with_antialias():
    check_op_gradient(
        "Resize", {"x": r32(1, 1, 3, 4), "roi": None, "scales": f32(1, 1, 2, 2)},
        {"mode": "linear", "antialias": 1}, const_inputs=["scales"], opset=18, **RESIZE_TOL,
    )


def test_resize_downscaling_with_antialias_is_unsupported():
    with pytest.raises(GradientNotImplementedError, match="antialias"):
        check_op_gradient(
            "Resize", {"x": r32(1, 1, 4, 4), "roi": None, "scales": f32(1, 1, 0.5, 0.5)},
            {"mode": "linear", "antialias": 1}, const_inputs=["scales"], opset=18, **RESIZE_TOL,
        )


def test_resize_dynamic_spatial_axes_are_unsupported():
    with pytest.raises(GradientNotImplementedError, match="dynamic lengths"):
        check_op_gradient(
            "Resize", {"x": r32(1, 1, 4, 4), "roi": None, "scales": f32(1, 1, 2, 2)},
            {"mode": "linear"}, const_inputs=["scales"], dynamic="all", **RESIZE_TOL,
        )


def test_resize_run_time_scales_are_unsupported():
    with pytest.raises(GradientNotImplementedError, match="scales input is computed at run"):
        check_op_gradient(
            "Resize", {"x": r32(1, 1, 4, 4), "roi": None, "scales": f32(1, 1, 2, 2)},
            {"mode": "linear"}, wrt=["x"], **RESIZE_TOL,
        )


_RESIZED = {True: (7, 5), False: (8, 6)}  # the constant sizes, and y's shape (scales of 2)


def _resize_from_shapes(sizes_from: str) -> onnx.ModelProto:
    """``Resize(x)`` whose sizes or scales are computed from shapes, as torch exports
    ``interpolate(x, size=y.shape[-2:])``, with a dynamic batch; ``loss`` weights the output.

    ``sizes_from``: "constant" (``Concat(Shape(x)[:2], [7, 5])``), "shape" (``Concat(Shape(x)
    [:2], Shape(y)[2:])``, ``y`` 8x6), "scales" (``Concat([1, 1], Shape(y)[2:] / Shape(x)[2:])``
    as floats) or "other batch" (the batch length of ``y``, another tensor).
    """
    head = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Shape", ["y"], ["sy"])]
    if sizes_from == "scales":
        body = [
            helper.make_node("Slice", ["sx", "two", "four"], ["hw_x"]),
            helper.make_node("Slice", ["sy", "two", "four"], ["hw_y"]),
            helper.make_node("Cast", ["hw_x"], ["fx"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["hw_y"], ["fy"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["fy", "fx"], ["ratio"]),
            helper.make_node("Concat", ["ones", "ratio"], ["scales"], axis=0),
            helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="linear"),
        ]
    else:
        source = "sy" if sizes_from == "other batch" else "sx"
        tail = "hw" if sizes_from == "constant" else "hw_y"
        body = [
            helper.make_node("Slice", [source, "zero", "two"], ["lead"]),
            helper.make_node("Slice", ["sy", "two", "four"], ["hw_y"]),
            helper.make_node("Concat", ["lead", tail], ["sizes"], axis=0),
            helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], mode="linear"),
        ]
    tail_nodes = [
        helper.make_node("Mul", ["r", "w"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("zero", [0]), ("two", [2]), ("four", [4]), ("hw", [7, 5]))
    ] + [numpy_helper.from_array(f32(1, 1), "ones")]
    batch = "n" if sizes_from == "other batch" else "batch"
    h, w = _RESIZED[sizes_from == "constant"]
    graph = helper.make_graph(
        head + body + tail_nodes, "resize_from_shapes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 1, 8, 6]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, ["batch", 2, h, w])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("sizes_from", ["constant", "shape", "scales"])
def test_resize_sizes_from_shapes_with_dynamic_batch(sizes_from):
    """Sizes (or scales) that read only static dimensions of shapes fold element by element;
    the batch size is the input's own, so that axis is not resized. The gradient equals finite
    differences and torch's."""
    model = _resize_from_shapes(sizes_from)
    size = _RESIZED[sizes_from == "constant"]
    x, y = r32(2, 2, 4, 3), r32(2, 1, 8, 6)
    w = np.random.default_rng(1).uniform(0.5, 1.5, (2, 2, *size)).astype(np.float32)
    got = check_model_gradient(model, {"x": x, "y": y, "w": w}, ["x"], **RESIZE_TOL)
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    out = F.interpolate(t, size=size, mode="bilinear", align_corners=False)
    (out * torch.tensor(w, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got["x"], t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_resize_sizes_from_another_batch_are_unsupported():
    """A size read from the batch of another tensor is not known to equal the input's batch:
    the rule refuses it (naming the axis) instead of guessing."""
    model = _resize_from_shapes("other batch")
    with pytest.raises(GradientNotImplementedError, match=r"Resize.*opset 18.*sizes of axes \[0\]"):
        build_gradient_graph(model, wrt=["x"], loss="loss")
