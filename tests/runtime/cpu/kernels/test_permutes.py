"""Gathers that permute axes: found from their positions and run as one native copy.

Every case compares the native copy with numpy's transpose (or onnxruntime's Gather of the
same positions), element for element, with NaN and infinities in the source.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn

from traingraph.runtime.cpu.kernels import conv_grads, permutes
from traingraph.runtime.cpu.kernels.permutes import as_permutation
from traingraph.runtime.rewrites import nchwc

rng = np.random.default_rng(0)


def _poisoned(shape: tuple[int, ...]) -> np.ndarray:
    values = rng.standard_normal(shape).astype(np.float32)
    flat = values.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
    places = rng.choice(flat.size, size=min(flat.size, 8), replace=False)
    flat[places] = np.resize(specials, places.size)
    return values


@pytest.mark.parametrize(
    ("dims", "perm"),
    [
        ([4, 16, 2, 16, 3, 3], [0, 2, 4, 5, 3, 1]),  # OIhw16i16o
        ([4, 16, 3, 7, 7], [0, 2, 3, 4, 1]),  # OIhw16o, a 3-channel input
        ([2, 8, 1, 3, 3], [0, 2, 3, 4, 1]),  # depthwise, blocks of 8
        ([5, 7], [1, 0]),
        ([3, 4, 5], [0, 1, 2]),
    ],
)
def test_blocked_layouts_are_found_and_copied(dims: list[int], perm: list[int]) -> None:
    size = int(np.prod(dims))
    positions = np.arange(size).reshape(dims).transpose(perm)
    found = as_permutation(positions, size)
    assert found is not None
    got_dims, got_perm = found
    copied = np.arange(size).reshape(got_dims).transpose(got_perm)  # axes may be merged
    assert np.array_equal(copied.reshape(-1), positions.reshape(-1))
    src = _poisoned((size,))
    want = src.reshape(dims).transpose(perm)
    for threads in (1, 3):
        dst = np.full(want.shape, 7.0, np.float32)
        permutes.permute(src, dst, got_dims, got_perm, threads)
        np.testing.assert_array_equal(dst, want)  # NaN where NaN, same infinities


def test_every_permutation_of_four_axes() -> None:
    dims = [2, 3, 4, 5]
    for perm in itertools.permutations(range(4)):
        positions = np.arange(120).reshape(dims).transpose(perm)
        found = as_permutation(positions, 120)
        assert found is not None, perm
        copied = np.arange(120).reshape(found[0]).transpose(found[1])
        assert np.array_equal(copied.reshape(-1), positions.reshape(-1))


@pytest.mark.parametrize("reversed_axes", [(), (0,), (2,), (1, 3), (0, 1, 2, 3)])
@pytest.mark.parametrize("native", [True, False])
def test_axes_read_back_to_front(
    reversed_axes: tuple[int, ...], native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not native:
        monkeypatch.setattr(conv_grads, "NATIVE", None)
    elif conv_grads.NATIVE is None:
        pytest.skip("traingraph.runtime._convc was not built (no C compiler at install time)")
    rng = np.random.default_rng(0)
    src = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    src[1, 2, 3, 4], src[0, 0, 0, 1] = np.nan, -np.inf
    flips = tuple(slice(None, None, -1 if a in reversed_axes else 1) for a in range(4))
    for perm in ([1, 0, 2, 3], [3, 1, 0, 2]):
        want = src[flips].transpose(perm)
        dst = np.zeros(want.shape, np.float32)
        permutes.permute(src, dst, list(src.shape), perm, 2, reversed_axes)
        np.testing.assert_array_equal(dst, want)
    if native:
        with pytest.raises(ValueError, match="distinct axes"):
            conv_grads.NATIVE.permute(src, dst, list(src.shape), [0, 1, 2, 3], 1, (4,))


@pytest.mark.parametrize(
    ("dims", "perm"),
    [
        ([2048, 512], [1, 0]),  # ResNet-50's widest 1 x 1 filter, channels swapped
        ([37, 45], [1, 0]),  # partial tiles on both axes
        ([16, 16], [1, 0]),  # one tile
        ([3, 40, 50, 2], [0, 3, 2, 1]),  # rows of 3, the tiles' axis in the middle
        ([2, 33, 17, 5], [3, 1, 0, 2]),
        ([64, 9, 128], [2, 1, 0]),  # a filter's spatial axis between its channels
        ([4, 64, 48], [2, 0, 1]),
    ],
)
@pytest.mark.parametrize("reversed_axes", [(), (0,), (1,)])
def test_transposes_are_copied_in_tiles(
    dims: list[int], perm: list[int], reversed_axes: tuple[int, ...]
) -> None:
    if conv_grads.NATIVE is None:
        pytest.skip("traingraph.runtime._convc was not built (no C compiler at install time)")
    src = _poisoned(tuple(dims))
    flips = tuple(slice(None, None, -1 if a in reversed_axes else 1) for a in range(len(dims)))
    want = src[flips].transpose(perm)
    for threads in (1, 2, 3):
        dst = np.full(want.shape, 7.0, np.float32)
        permutes.permute(src, dst, dims, perm, threads, reversed_axes)
        np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize(
    "positions",
    [
        np.array([0, 1, 1, 2]),  # a repeat
        np.array([1, 2, 3, 0]),  # a rotation, not a transpose
        np.concatenate([np.arange(16).reshape(4, 4).T.reshape(-1)[:15], [15]])[::-1],
        np.arange(1, 9),  # not from 0
    ],
)
def test_other_gathers_are_not_permutations(positions: np.ndarray) -> None:
    assert as_permutation(positions, positions.size) is None


def test_sizes_must_match() -> None:
    assert as_permutation(np.arange(6), 8) is None
    if conv_grads.NATIVE is not None:
        with pytest.raises(ValueError, match="prod"):
            conv_grads.NATIVE.permute(
                np.zeros(6, np.float32), np.zeros(8, np.float32), [2, 3], [1, 0], 1
            )


@pytest.mark.parametrize(
    ("channels", "filters", "kernel", "group"),
    [(32, 64, 3, 1), (3, 64, 7, 1), (32, 32, 3, 32)],
)
def test_the_blocked_conv_filters_are_reordered_by_a_transpose(
    channels: int, filters: int, kernel: int, group: int
) -> None:
    """onnxruntime's own blocked filter layouts, as nchwc learns them, for channel counts that
    are multiples of the block, are permutations: the graph reorders the filter with a
    Transpose, which onnxruntime runs to the same values as the Gather of the learned
    positions, NaN, infinities and a negative zero included; the native copy agrees too."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, channels, 14, 14])
    w_shape = [filters, channels // group, kernel, kernel]
    w = helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, w_shape)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=group)
    model = helper.make_model(
        helper.make_graph([conv], "g", [x, w], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    shapes = {"x": [2, channels, 14, 14], "w": w_shape}
    if not nchwc.convs_as_nchwc(model, shapes):  # type: ignore[arg-type]
        pytest.skip("onnxruntime does not block this geometry on this CPU")
    assert not [n for n in model.graph.node if n.op_type == "Gather"]
    moved = next(n.output[0] for n in model.graph.node if n.op_type == "Transpose")
    reordered = next(
        n.output[0] for n in model.graph.node if n.op_type == "Reshape" and moved in n.input
    )
    form = nchwc.form_for(conv, shapes, model.opset_import)  # type: ignore[arg-type]
    assert form is not None
    size = int(np.prod(w_shape))
    (reorder,) = [p for p in form.gathers.values() if isinstance(p, nchwc._Reorder)]
    # kept as the reorder it is, not as positions
    positions = np.arange(1, size + 1).reshape(reorder.dims).transpose(reorder.perm)
    positions = positions.reshape(reorder.shape)
    weight = _poisoned(tuple(w_shape))
    wanted = weight.reshape(-1)[positions - 1]
    got = ort.InferenceSession(
        _reorder_model(model, reordered).SerializeToString(), providers=["CPUExecutionProvider"]
    ).run([reordered], {"w": weight})[0]
    np.testing.assert_array_equal(got, wanted)
    assert np.array_equal(np.signbit(got), np.signbit(wanted))
    found = as_permutation(positions - 1, size)  # the form's positions count from 1
    assert found is not None
    dst = np.empty(positions.shape, np.float32)
    permutes.permute(weight.reshape(-1), dst, *found, 2)
    np.testing.assert_array_equal(dst, wanted)


def _reorder_model(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """The nodes of ``model`` that compute ``output`` from the filter ``w``, as a model."""
    producers = {o: n for n in model.graph.node for o in n.output}
    initializers = {t.name: t for t in model.graph.initializer}
    nodes, used, todo = [], set(), [output]
    while todo:
        name = todo.pop()
        node = producers.get(name)
        if node is None or id(node) in used:
            continue
        used.add(id(node))
        nodes.append(node)
        todo.extend(v for v in node.input if v)
    nodes.sort(key=lambda n: list(model.graph.node).index(n))
    needed = {v for n in nodes for v in n.input}
    graph = helper.make_graph(
        nodes,
        "reorder",
        [helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)],
        [t for name, t in initializers.items() if name in needed],
    )
    return helper.make_model(graph, opset_imports=list(model.opset_import))


def _blocked_conv_segment() -> onnx.ModelProto:
    """A Conv of 32 channels to 32 with its filter an input, as a segment of a training step
    holds it, rewritten for the CPU (the filter reordered into onnxruntime's blocks)."""
    from traingraph.runtime.rewrites.specialize import for_cpu

    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])
    graph = helper.make_graph(
        [conv], "segment",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 32, 9, 9]),
         helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [32, 32, 3, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = for_cpu(model.SerializeToString())
    assert isinstance(rewritten, bytes)
    return onnx.load_from_string(rewritten)


@pytest.mark.skipif(conv_grads.NATIVE is None, reason="the native kernels were not built")
def test_filter_reorders_leave_the_segment_and_give_its_values():
    segment = _blocked_conv_segment()
    split, reorders = permutes.split_filter_reorders(segment)
    if not reorders:
        pytest.skip("onnxruntime's blocked layout of this filter is not a reorder here")
    assert [r.src for r in reorders] == ["w"]
    assert not any(n.op_type == "Transpose" for n in split.graph.node)
    feeds = {"x": _poisoned((2, 32, 9, 9)), "w": rng.standard_normal((32, 32, 3, 3))}
    feeds["w"] = feeds["w"].astype(np.float32)
    feeds["w"].flat[5], feeds["w"].flat[40] = np.inf, np.nan
    out: dict[str, np.ndarray] = {}
    for reorder in reorders:
        reorder.compute(feeds, out, 2)
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (segment, split)
    ]
    (want,) = sessions[0].run(None, feeds)
    (got,) = sessions[1].run(None, {**feeds, **out})
    np.testing.assert_array_equal(got, want)  # the same filter: the same Conv, bit for bit
    assert permutes.split_filter_reorders(segment, {reorders[0].out})[1] == reorders[1:]


def _swap_segment(reshape_first: bool) -> onnx.ModelProto:
    """An input gradient's filter use as a segment holds it: ``Transpose(w, [1, 0, 2, 3])``
    read by a 1 x 1 Conv, or (``reshape_first``) a transposed convolution's filter as a
    product's operand, ``Transpose(Reshape(w, [O, I, 1]), [1, 0, 2])``, read by a MatMul."""
    w = helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [48, 32, 1, 1])
    if reshape_first:
        shape = onnx.numpy_helper.from_array(np.array([48, 32, 1], np.int64), "shape")
        flat = onnx.numpy_helper.from_array(np.array([32, 48], np.int64), "flat")
        nodes = [
            helper.make_node("Reshape", ["w", "shape"], ["w3"]),
            helper.make_node("Transpose", ["w3"], ["wt"], perm=[1, 0, 2]),
            helper.make_node("Reshape", ["wt", "flat"], ["wm"]),
            helper.make_node("MatMul", ["x", "wm"], ["y"]),
        ]
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [5, 32])
        initializers = [shape, flat]
    else:
        nodes = [
            helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0, 2, 3]),
            helper.make_node("Conv", ["x", "wt"], ["y"]),
        ]
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 48, 3, 3])
        initializers = []
    graph = helper.make_graph(
        nodes, "segment", [x, w],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], initializers,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(conv_grads.NATIVE is None, reason="the native kernels were not built")
@pytest.mark.parametrize("reshape_first", [False, True], ids=["swap", "reshaped-swap"])
def test_a_filters_swapped_axes_leave_the_segment(reshape_first):
    segment = _swap_segment(reshape_first)
    split, reorders = permutes.split_filter_reorders(segment)
    assert [r.src for r in reorders] == ["w"]
    assert {n.op_type for n in split.graph.node} == ({"MatMul"} if reshape_first else {"Conv"})
    x_shape = [5, 32] if reshape_first else [2, 48, 3, 3]
    feeds = {"x": _poisoned(tuple(x_shape)), "w": _poisoned((48, 32, 1, 1))}
    out: dict[str, np.ndarray] = {}
    reorders[0].compute(feeds, out, 2)
    want_w = feeds["w"].reshape(48, 32).T
    np.testing.assert_array_equal(out[reorders[0].out].reshape(32, 48), want_w)
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (segment, split)
    ]
    (want,) = sessions[0].run(None, feeds)
    (got,) = sessions[1].run(None, {**feeds, **out})
    np.testing.assert_array_equal(got, want)
    # a chain that only reshapes stays, as does one whose result another segment writes
    only_reshapes = _swap_segment(True)
    only_reshapes.graph.node[1].CopyFrom(helper.make_node("Identity", ["w3"], ["wt"]))
    assert permutes.split_filter_reorders(only_reshapes)[1] == []
    assert permutes.split_filter_reorders(segment, {reorders[0].out})[1] == []


@pytest.mark.skipif(conv_grads.NATIVE is None, reason="the native kernels were not built")
def test_a_transpose_that_a_product_folds_in_stays():
    # attention's K^T: onnxruntime folds a Transpose of the last two axes into the MatMul
    # that reads it, so it is left there; read by another op, it is copied natively
    def segment(reader: str) -> onnx.ModelProto:
        nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1])]
        if reader == "MatMul":
            nodes.append(helper.make_node("MatMul", ["q", "kt"], ["y"]))
        else:
            nodes.append(helper.make_node("Relu", ["kt"], ["y"]))
        graph = helper.make_graph(
            nodes, "attention",
            [helper.make_tensor_value_info("k", onnx.TensorProto.FLOAT, [6, 20, 16]),
             helper.make_tensor_value_info("q", onnx.TensorProto.FLOAT, [6, 20, 16])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        )  # fmt: skip
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    assert permutes.split_filter_reorders(segment("MatMul"))[1] == []
    (copy,) = permutes.split_filter_reorders(segment("Relu"))[1]
    assert (copy.src, copy.shape) == ("k", (6, 16, 20))


def _weight_gradient_segment(
    columns: int, trans_b: bool = False, rows: int | str = 64
) -> onnx.ModelProto:
    """A Linear layer's weight gradient as a segment holds it: ``Gemm(x, dy, transA=1)``
    with ``x`` ``[rows, 48]`` an input and ``dy`` ``[rows, columns]`` computed in the segment
    (``transB``: ``dy`` given as ``[columns, rows]``), and a second Gemm of the same ``x``;
    ``rows`` a name for a dynamic batch."""
    dy_shape = [columns, rows] if trans_b else [rows, columns]
    nodes = [
        helper.make_node("Relu", ["g"], ["dy"]),
        helper.make_node("Gemm", ["x", "dy"], ["dw"], transA=1, transB=int(trans_b)),
        helper.make_node("Gemm", ["x", "dy"], ["dw2"], transA=1, transB=int(trans_b), alpha=0.5),
    ]
    graph = helper.make_graph(
        nodes, "segment",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 48]),
         helper.make_tensor_value_info("g", onnx.TensorProto.FLOAT, dy_shape)],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in ("dw", "dw2")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.skipif(conv_grads.NATIVE is None, reason="the native kernels were not built")
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("rows", [64, "batch"], ids=["static", "dynamic"])
def test_a_weight_gradients_transposed_operand_is_copied_before_the_segment(trans_b, rows):
    columns = permutes.TRANSPOSED_OPERAND_MIN_COLUMNS
    segment = _weight_gradient_segment(columns, trans_b, rows)
    split, copies = permutes.split_transposed_operands(segment)
    assert [c.src for c in copies] == ["x"]
    gemms = [n for n in split.graph.node if n.op_type == "Gemm"]
    assert [n.input[0] for n in gemms] == [copies[0].out] * 2  # one copy for both
    assert not any(a.name == "transA" for n in gemms for a in n.attribute)
    g_shape = (columns, 64) if trans_b else (64, columns)
    feeds = {"x": _poisoned((64, 48)), "g": _poisoned(g_shape)}
    out: dict[str, np.ndarray] = {}
    copies[0].compute(feeds, out, 2)
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (segment, split)
    ]
    want = sessions[0].run(None, feeds)
    got = sessions[1].run(None, {**feeds, **out})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)  # the same products, NaN where NaN
    # narrower products keep their transA; a taken name keeps the Gemms as they are
    assert permutes.split_transposed_operands(_weight_gradient_segment(columns - 1))[1] == []
    with pytest.raises(ValueError, match="expected a matrix"):
        copies[0].compute({"x": np.zeros((2, 3, 4), np.float32)}, {}, 1)
    assert permutes.split_transposed_operands(segment, {copies[0].out})[1] == []


class _BlockedNet(nn.Module):
    """Strided Convs of 16 and 32 channels (left to onnxruntime's blocked kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.down(torch.relu(self.stem(x)))))
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.skipif(conv_grads.NATIVE is None, reason="the native kernels were not built")
def test_module_with_native_filter_reorders_trains_as_the_graph_does(tmp_path):
    from gradcheck import assert_same_training, train_steps
    from torch_models import export, seeded
    from traingraph import artifacts, optim
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.runtime.session import SessionConfig

    artifacts.generate_artifacts(
        export(seeded(_BlockedNet), torch.zeros(4, 3, 10, 10), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    data = np.random.default_rng(0)
    batches = [
        (data.standard_normal((4, 3, 10, 10)).astype(np.float32), data.integers(0, 5, 4))
        for _ in range(3)
    ]

    def steps(config: SessionConfig) -> tuple:
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, session_config=config)
        plan = getattr(module.step.runner, "_steps", [])
        reorders = [s for s in plan if isinstance(s, permutes.FilterReorder)]
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
        return train_steps(module, optimizer, state, batches), reorders

    got, reorders = steps(SessionConfig())
    plain = SessionConfig(native_conv_grads=False, native_segments=False, specialize=False)
    want, _ = steps(plain)
    if not reorders:
        pytest.skip("onnxruntime's blocked layouts of these filters are not reorders here")
    assert_same_training(got, want, one_scale=True)
