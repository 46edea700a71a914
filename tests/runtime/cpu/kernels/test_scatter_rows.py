"""The row scatter-add of an embedding's gradient as one native pass: found in the graphs the
Gather rule writes (and in hand-written ones of the same meaning), bit for bit onnxruntime's
ScatterElements (repeated and negative indices, NaN, infinities, signed zeros, one thread and
two), an index out of range refused as onnxruntime refuses it, and Module's train steps of an
embedding equal with the kernel and without."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from gradcheck import adamw_artifacts, artifact_steps
from torch_models import export, seeded
from traingraph.runtime.cpu import native
from traingraph.runtime.cpu.kernels import scatter_rows

pytestmark = pytest.mark.skipif(
    native.NATIVE is None or not hasattr(native.NATIVE, "scatter_add_rows"),
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

D, R, M = 300, 260, 97  # 78000 elements: both threads take rows; R is no multiple of 16
NAN2 = np.array([0xFFC00123], np.uint32).view(np.float32)[0]  # another sign and payload


def _scatter_model(table: str, index: str = "unsqueeze", shape: str = "of_updates"):
    """ScatterElements(axis=0, add) of ``rows`` ``[M, R]`` at rows ``index`` into a table:
    ``table`` "zeros" (Expand of 0.0 to the input ``dims``), "constant_zeros" (to a
    constant ``[D, R]``), "fill" (ConstantOfShape of 0.0) or "data" (the input ``data``);
    the indices an Expand of ``Unsqueeze(index, [1])`` ("unsqueeze") or of
    ``Reshape(index, [-1, 1])`` ("column"), to ``Shape(rows)`` or to a constant
    ("constant")."""
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    if index == "unsqueeze":
        axes = helper.make_tensor("", i64, [1], [1])
        nodes = [
            helper.make_node("Constant", [], ["axes"], value=axes),
            helper.make_node("Unsqueeze", ["index", "axes"], ["column"]),
        ]
    else:
        to = helper.make_tensor("", i64, [2], [-1, 1])
        nodes = [
            helper.make_node("Constant", [], ["to"], value=to),
            helper.make_node("Reshape", ["index", "to"], ["column"]),
        ]
    if shape == "of_updates":
        nodes.append(helper.make_node("Shape", ["rows"], ["target"]))
    else:
        value = helper.make_tensor("", i64, [2], [M, R])
        nodes.append(helper.make_node("Constant", [], ["target"], value=value))
    nodes.append(helper.make_node("Expand", ["column", "target"], ["positions"]))
    inputs = [
        helper.make_tensor_value_info("index", i64, ["m"]),
        helper.make_tensor_value_info("rows", f32, [M if shape == "constant" else "m", R]),
    ]
    zero = helper.make_tensor("", f32, [], [0.0])
    if table == "data":
        inputs.append(helper.make_tensor_value_info("data", f32, [D, R]))
    elif table == "fill":
        inputs.append(helper.make_tensor_value_info("dims", i64, [2]))
        fill = helper.make_tensor("", f32, [1], [0.0])
        nodes.append(helper.make_node("ConstantOfShape", ["dims"], ["data"], value=fill))
    else:
        if table == "zeros":
            inputs.append(helper.make_tensor_value_info("dims", i64, [2]))
        else:
            dims = helper.make_tensor("", i64, [2], [D, R])
            nodes.append(helper.make_node("Constant", [], ["dims"], value=dims))
        nodes.append(helper.make_node("Constant", [], ["zero"], value=zero))
        nodes.append(helper.make_node("Expand", ["zero", "dims"], ["data"]))
    nodes.append(
        helper.make_node(
            "ScatterElements", ["data", "positions", "rows"], ["out"], axis=0, reduction="add"
        )
    )
    out = helper.make_tensor_value_info("out", f32, [D, R])
    graph = helper.make_graph(nodes, "scatter", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Repeated and negative indices; NaN (two kinds), infinities that meet in one sum, a
    column of negative zeros, in the rows and the data."""
    rng = np.random.default_rng(seed)
    index = rng.integers(-D, D, M)
    index[:4] = [5, 5 - D, 5, -1]  # row 5 three times, one of them negative; the last row
    index[4:8] = [D - 1, 0, 0, 150]  # row 150: the second thread's first
    rows = rng.standard_normal((M, R), dtype=np.float32) * 4
    rows[0, :3], rows[1, :3], rows[2, :3] = [np.inf, np.nan, NAN2], [-np.inf, NAN2, 1], [1, 2, 3]
    rows[5, 10], rows[6, 10] = np.nan, NAN2
    rows[3, 4] = rows[4, 4] = np.inf  # into the last row twice
    rows[:, 20] = -0.0
    data = rng.standard_normal((D, R), dtype=np.float32)
    data[5, 3], data[0, 10], data[150, 7] = NAN2, np.nan, -np.inf
    data[:, 20] = -0.0
    names = {i.name for i in model.graph.input}
    feeds = {"index": index, "rows": rows, "data": data, "dims": np.array([D, R], np.int64)}
    return {name: value for name, value in feeds.items() if name in names}


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


FORMS = [
    ("zeros", "unsqueeze", "of_updates"),
    ("constant_zeros", "unsqueeze", "of_updates"),
    ("fill", "unsqueeze", "of_updates"),
    ("data", "unsqueeze", "of_updates"),
    ("zeros", "column", "constant"),
    ("data", "column", "of_updates"),
]


@pytest.mark.parametrize(("table", "index", "shape"), FORMS)
def test_found_and_bit_for_bit_onnxruntime(table, index, shape):
    model = _scatter_model(table, index, shape)
    found = scatter_rows.split_scatter_add_rows(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    ops = sorted(model.graph.node[i].op_type for i in nodes)
    shape_op = ["Shape"] if shape == "of_updates" else []
    zeros_op = {"data": [], "fill": ["ConstantOfShape"]}.get(table, ["Expand"])
    column = ["Unsqueeze"] if index == "unsqueeze" else []
    assert ops == sorted(["ScatterElements", "Expand", *shape_op, *zeros_op, *column])
    assert kernel.zeros == (table != "data")
    assert kernel.index == ("index" if index == "unsqueeze" else "column")
    for seed in range(2):
        feeds = _feeds(model, seed)
        want = _ort(model, feeds)
        values = {**feeds, "column": feeds["index"][:, None], "dims": np.array([D, R])}
        for threads in (1, 2):
            target = np.full((D, R), 7.0, np.float32)
            out = {"out": target}
            kernel.compute(values, out, threads)
            assert out["out"] is target  # written in place
            np.testing.assert_array_equal(_bits(target), _bits(want))
        assert np.isnan(want).any() and np.isinf(want).any()
        assert np.signbit(want[:, 20]).any() == (table == "data")  # 0 + -0 is +0


def test_one_index_is_broadcast_to_every_row():
    model = _scatter_model("data")  # Expand makes [1, 1] indices [M, R]
    kernel, _ = scatter_rows.split_scatter_add_rows(model)[0]
    feeds = {**_feeds(model, 0), "index": np.array([3])}
    want = _ort(model, feeds)
    out: dict[str, np.ndarray] = {}
    kernel.compute(feeds, out, 2)
    np.testing.assert_array_equal(_bits(out["out"]), _bits(want))
    assert not np.array_equal(want[3], feeds["data"][3])


@pytest.mark.parametrize("bad", [D, -D - 1])
def test_an_index_out_of_range_fails_as_onnxruntime_does(bad):
    model = _scatter_model("zeros")
    kernel, _ = scatter_rows.split_scatter_add_rows(model)[0]
    feeds = _feeds(model, 0)
    feeds["index"][40] = bad
    with pytest.raises(Exception, match="out of data bounds"):
        _ort(model, feeds)
    with pytest.raises(IndexError, match=rf"index {bad} \(at position 40\).*for {D} rows"):
        kernel.compute(feeds, {}, 2)


def test_shapes_that_the_graph_refuses_are_refused():
    kernel = scatter_rows.ScatterAddRows("i", "u", "out", "dims", zeros=True)
    dims = np.array([4, 3])
    with pytest.raises(ValueError, match=r"index \[2, 2\]"):
        kernel.compute({"i": np.zeros((2, 2), np.int64), "u": np.ones((2, 3), np.float32),
                        "dims": dims}, {}, 1)  # fmt: skip
    with pytest.raises(ValueError, match=r"updates \[2, 4\]"):
        kernel.compute({"i": np.zeros(2, np.int64), "u": np.ones((2, 4), np.float32),
                        "dims": dims}, {}, 1)  # fmt: skip


def test_indices_that_vary_along_a_row_are_left_to_the_graph():
    model = _scatter_model("zeros")
    expand = next(n for n in model.graph.node if n.output[0] == "positions")
    expand.input[0] = "wide"  # [M, R] indices of their own
    model.graph.input.append(helper.make_tensor_value_info("wide", TensorProto.INT64, ["m", R]))
    assert scatter_rows.split_scatter_add_rows(model) == []
    negative_zero = _scatter_model("zeros")
    zero = next(n for n in negative_zero.graph.node if n.output[0] == "zero")
    zero.attribute[0].t.CopyFrom(helper.make_tensor("", TensorProto.FLOAT, [], [-0.0]))
    kernel, nodes = scatter_rows.split_scatter_add_rows(negative_zero)[0]
    assert not kernel.zeros and kernel.table == "data"  # its Expand stays in the graph
    assert "Expand" in [negative_zero.graph.node[i].op_type for i in nodes]  # the indices'


class Tagger(nn.Module):
    """An embedding whose rows repeat within a batch, mean-pooled and classified."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.fc = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x).mean(1))


def test_module_trains_as_the_graph_does(tmp_path):
    example = torch.zeros(2, 6, dtype=torch.int64)
    directory = adamw_artifacts(tmp_path, export(seeded(Tagger), example))
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 8, (n, 6)), rng.integers(0, 3, n)) for n in (5, 5, 3)]
    got = artifact_steps(directory, batches, scatter_rows.ScatterAddRows)
    expected = artifact_steps(
        directory, batches, scatter_rows.ScatterAddRows, without="scatter_add_rows"
    )
    np.testing.assert_array_equal(got[0], expected[0])  # the losses
    for step, reference in zip(got[1], expected[1]):
        assert step.keys() == reference.keys()
        for name in reference:
            np.testing.assert_array_equal(_bits(step[name]), _bits(reference[name]), err_msg=name)


def test_the_load_time_check_drops_a_kernel_that_sums_in_another_order(monkeypatch, caplog):
    """The check feeds valid indices that repeat rows: adding them in reverse order rounds
    the sums otherwise, and the match is dropped."""

    class Reversed:
        @staticmethod
        def scatter_add_rows(index, updates, data, out, threads):
            native.NATIVE.scatter_add_rows(index[::-1].copy(), updates[::-1].copy(), data, out, 1)

    model = _scatter_model("zeros")
    assert len(scatter_rows.split_scatter_add_rows(model)) == 1
    monkeypatch.setattr(scatter_rows, "NATIVE", Reversed)
    assert scatter_rows.split_scatter_add_rows(model) == []
    assert "disagrees with its nodes on finite inputs" in caplog.text
