"""Constant values derived from static shapes (traingraph.ir.fold)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from traingraph.ir.fold import Dim, constant_value, partial_value
from traingraph.ir.model import load_ir
from traingraph.ir.transposes import compose_transposes, compose_views


def _graph(shape):
    """``x[shape]`` -> Shape -> Gather(-1) -> Div(3) -> Mul(2), as torch's ``chunk`` exports."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "last"], ["d"], axis=0),
        helper.make_node("Div", ["d", "three"], ["q"]),
        helper.make_node("Mul", ["q", "two"], ["m"]),
        helper.make_node("Unsqueeze", ["m", "zero"], ["u"]),
        helper.make_node("Concat", ["u", "u"], ["c"], axis=0),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Shape", ["x"], ["tail"], start=-2),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("last", -1), ("three", 3), ("two", 2), ("zero", [0]))
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in "mcn"]
    outputs.append(helper.make_tensor_value_info("tail", TensorProto.INT64, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs, inits
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return {v.name: v for v in model.graph.outputs}


def test_shape_arithmetic_on_static_dims_folds():
    values = _graph([4, 6, 9])
    assert constant_value(values["m"]).tolist() == 6
    assert constant_value(values["c"]).tolist() == [6, 6]
    assert constant_value(values["n"]).tolist() == 216
    assert constant_value(values["tail"]).tolist() == [6, 9]


def test_dynamic_dims_stay_unknown_unless_not_used():
    values = _graph(["batch", 6, 9])
    assert constant_value(values["m"]).tolist() == 6  # only the static last dim is read
    assert constant_value(values["n"]) is None
    assert constant_value(values["tail"]).tolist() == [6, 9]
    values = _graph([4, 6, "features"])
    assert constant_value(values["m"]) is None
    assert constant_value(values["c"]) is None


CONSTANT_FORMS = [
    ({"value": numpy_helper.from_array(np.array([[1.5, 2.0]], np.float32))}, [[1.5, 2.0]],
     np.float32),
    ({"value_float": 0.25}, 0.25, np.float32),
    ({"value_floats": [1.0, -2.0]}, [1.0, -2.0], np.float32),
    ({"value_int": 7}, 7, np.int64),
    ({"value_ints": [-1, -2]}, [-1, -2], np.int64),
    ({"value_string": "abc"}, "abc", object),
    ({"value_strings": ["a", "bc"]}, ["a", "bc"], object),
    ({"sparse_value": helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([5.0, 7.0], np.float32), "v"),
        numpy_helper.from_array(np.array([1, 3], np.int64), "i"), [2, 2])},
     [[0.0, 5.0], [0.0, 7.0]], np.float32),
    ({"sparse_value": helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([4], np.int64), "v"),
        numpy_helper.from_array(np.array([[1, 0]], np.int64), "i"), [2, 2])},
     [[0, 0], [4, 0]], np.int64),
]  # fmt: skip


@pytest.mark.parametrize(("attrs", "expected", "dtype"), CONSTANT_FORMS)
def test_constant_in_every_attribute_form(attrs, expected, dtype):
    """Each attribute form of Constant folds; sparse tensors are made dense when loaded."""
    node = helper.make_node("Constant", [], ["c"], **attrs)
    graph = helper.make_graph([node], "g", [], [onnx.ValueInfoProto(name="c")])
    model = load_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    value = constant_value(model.graph.outputs[0])
    assert value is not None and value.dtype == dtype
    assert value.tolist() == expected


def _resize_sizes_graph():
    """The sizes torch's ``interpolate(x, size=y.shape[-2:])`` exports with a dynamic batch:
    ``Concat(Shape(x)[:2], Cast(Concat(Unsqueeze(Gather(Shape(y), 2)), ...)))``, and a few
    values that read the batch dimension."""
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Slice", ["sx", "zero", "two", "zero"], ["head"]),
        helper.make_node("Shape", ["y"], ["sy"]),
        helper.make_node("Gather", ["sy", "i2"], ["h"], axis=0),
        helper.make_node("Gather", ["sy", "i3"], ["w"], axis=0),
        helper.make_node("Unsqueeze", ["h", "zero"], ["h1"]),
        helper.make_node("Unsqueeze", ["w", "zero"], ["w1"]),
        helper.make_node("Concat", ["h1", "w1"], ["hw"], axis=0),
        helper.make_node("Cast", ["hw"], ["hw64"], to=TensorProto.INT64),
        helper.make_node("Concat", ["head", "hw64"], ["sizes"], axis=0),
        helper.make_node("Slice", ["sy", "two", "four"], ["tail"]),
        helper.make_node("Mul", ["tail", "tail"], ["area"]),
        helper.make_node("Mul", ["sizes", "two"], ["doubled"]),
        helper.make_node("Gather", ["sx", "zero_scalar"], ["batch"], axis=0),
        helper.make_node("Concat", ["area", "hw"], ["flat"], axis=0),
        helper.make_node("Reshape", ["flat", "shape22"], ["square"]),
        helper.make_node("Shape", ["x"], ["size_tail"], start=1),
        helper.make_node("Reshape", ["size_tail", "minus_one"], ["reshaped"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("zero", [0]), ("two", [2]), ("four", [4]), ("i2", 2), ("i3", 3),
                     ("zero_scalar", 0), ("shape22", [2, 2]), ("minus_one", [-1]))
    ]  # fmt: skip
    outputs = ["sizes", "tail", "area", "doubled", "batch", "square", "reshaped"]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5, 8, 6])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in outputs], inits,
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    return model.graph, {v.name: v for v in model.graph.outputs}


def test_shapes_fold_per_dimension():
    """A Shape of a tensor with a dynamic batch still gives its static dimensions: what reads
    only those is constant, what reads the batch is not, and never guessed."""
    graph, values = _resize_sizes_graph()
    x = graph.inputs[0]
    sizes = partial_value(values["sizes"])
    assert sizes is not None and sizes[1:] == [3, 8, 6]
    assert isinstance(sizes[0], Dim) and sizes[0].is_dim_of(x, 0)
    assert not sizes[0].is_dim_of(x, 1) and not sizes[0].is_dim_of(graph.inputs[1], 0)
    assert constant_value(values["sizes"]) is None
    assert constant_value(values["tail"]).tolist() == [8, 6]
    assert constant_value(values["area"]).tolist() == [64, 36]
    assert partial_value(values["doubled"]) == [None, 6, 16, 12]
    assert constant_value(values["batch"]) is None
    assert constant_value(values["square"]).tolist() == [[64, 36], [8, 6]]
    assert constant_value(values["reshaped"]).tolist() == [3, 4, 4]


def test_symbolic_dims_of_one_name_are_the_same_length():
    """ONNX gives dimensions of one symbolic name one length, so a Dim read from another tensor
    with the same batch name is that tensor's batch length too."""
    _, values = _resize_sizes_graph()
    other = ir.Value(name="z", shape=ir.Shape(["batch", 3]), type=ir.TensorType(ir.DataType.FLOAT))
    unnamed = ir.Value(name="u", shape=ir.Shape([None, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    sizes = partial_value(values["sizes"])
    assert isinstance(sizes[0], Dim)
    assert sizes[0].is_dim_of(other, 0)
    assert not sizes[0].is_dim_of(unnamed, 0)
    made_up = ir.Value(name="m", shape=ir.Shape(["unk__0", 2]))
    assert not Dim(made_up, 0).is_dim_of(ir.Value(name="n", shape=ir.Shape(["unk__0"])), 0)


def _chunk_model() -> onnx.ModelProto:
    """``x[:, :Shape(x)[1] // 2 * 1]`` as torch's TorchScript exporter writes ``chunk``, then
    ``Mul(bias, Cast(Shape(x)[2]))``: the first is a shape computation, the second reads a
    float initializer (a parameter) and must stay."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["c"], axis=0),
        helper.make_node("Add", ["c", "one1"], ["c1"]),
        helper.make_node("Div", ["c1", "two"], ["half"]),
        helper.make_node("Mul", ["half", "one1"], ["end"]),
        helper.make_node("Slice", ["x", "zero1", "end", "one1"], ["piece"]),
        helper.make_node("Gather", ["s", "last"], ["n"], axis=0),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["bias", "nf"], ["scaled"]),
        helper.make_node("Add", ["piece", "scaled"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("one", 1), ("one1", [1]), ("two", [2]), ("zero1", [0]), ("last", 2))
    ] + [numpy_helper.from_array(np.array([0.5, -1.0, 2.0, 0.25], np.float32), "bias")]
    graph = helper.make_graph(
        nodes, "chunk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_computations_fold_so_that_shapes_infer():
    """Loading folds the chunk's bounds (read from static dims) into a Constant, so shape
    inference gives the Slice's output shape; the parameter's product stays a computation, and
    the model computes the same at every batch size."""
    import onnxruntime as ort

    proto = _chunk_model()
    m = load_ir(proto)
    values = {o.name: o for node in m.graph for o in node.outputs}
    assert values["piece"].shape == ir.Shape(["batch", 3, 4])
    assert values["end"].producer().op_type == "Constant"
    assert values["scaled"].producer().op_type == "Mul" and "bias" in m.graph.initializers
    folded = ort.InferenceSession(ir.to_proto(m).SerializeToString())
    original = ort.InferenceSession(proto.SerializeToString())
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 6, 4)).astype(np.float32)
        expected = original.run(None, {"x": x})[0]
        np.testing.assert_array_equal(folded.run(None, {"x": x})[0], expected)


def test_unflatten_target_folds_through_mod_and_computed_constants():
    """torch's TorchScript exporter writes ``x.unflatten(-1, (3, 4))`` as a Reshape to
    ``Concat(Slice(Shape(x), 0, (-1 + 2) mod 2), Concat(Unsqueeze(3), Unsqueeze(4)))``: a
    ``Mod`` of the dimension and a constant part computed from Constants. Both fold, so the
    Reshape's output shape is inferred; the model computes the same."""
    import onnxruntime as ort

    def const(name, value):
        array = np.array(value, np.int64)
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        const("minus_one", [-1]), const("rank", [2]), const("zero", [0]),
        helper.make_node("Add", ["minus_one", "rank"], ["sum"]),
        helper.make_node("Mod", ["sum", "rank"], ["kept"]),
        helper.make_node("Slice", ["shape", "zero", "kept"], ["lead"]),
        const("three", 3), const("four", 4),
        helper.make_node("Unsqueeze", ["three", "zero"], ["three_1"]),
        helper.make_node("Unsqueeze", ["four", "zero"], ["four_1"]),
        helper.make_node("Concat", ["three_1", "four_1"], ["tail"], axis=0),
        helper.make_node("Concat", ["lead", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m = load_ir(proto)
    values = {o.name: o for node in m.graph for o in node.outputs}
    assert values["y"].shape == ir.Shape([5, 3, 4])
    assert values["target"].producer().op_type == "Constant"
    x = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    run = [
        ort.InferenceSession(p.SerializeToString()).run(None, {"x": x})[0]
        for p in (proto, ir.to_proto(m))
    ]
    np.testing.assert_array_equal(run[0], run[1])


@pytest.mark.parametrize("fmod, expected", [(0, [1, 2, 0, 1]), (1, [-2, -1, 0, 1])])
def test_integer_mod_folds_with_the_sign_of_its_operands(fmod, expected):
    """``[-5, -4, 3, 4] mod x.shape[1]`` (3): the divisor's sign, or the dividend's with fmod."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
        helper.make_node("Mod", ["values", "d"], ["m"], fmod=fmod),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([-5, -4, 3, 4], np.int64), "values"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("m", TensorProto.INT64, None)], inits,
    )  # fmt: skip
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert constant_value(model.graph.outputs[0]).tolist() == expected


def _biased_model(bias_nodes, bias_inits=(), op="Conv"):
    """``y = op(x, w, b)`` with ``b`` computed by ``bias_nodes`` (or an initializer)."""
    if op == "Conv":
        x_shape, w_shape, y_shape = [2, 3, 5, 5], [4, 3, 3, 3], [2, 4, 3, 3]
    else:  # Gemm
        x_shape, w_shape, y_shape = [2, 3], [4, 3], [2, 4]
    attrs = {"transB": 1} if op == "Gemm" else {}
    nodes = [*bias_nodes, helper.make_node(op, ["x", "w", "b"], ["y"], **attrs)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(np.random.default_rng(0).normal(size=w_shape).astype(np.float32),
                                 "w"), *bias_inits],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _zero_fill(value=0.0):
    """The dynamo exporter's bias of a Conv without one: ``Expand(CastLike(c, x), [4])``."""
    return [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
            np.array(value, np.float32))),
        helper.make_node("CastLike", ["c", "x"], ["c_like"]),
        helper.make_node("Shape", ["w"], ["s"], start=0, end=1),
        helper.make_node("Expand", ["c_like", "s"], ["b"]),
    ]  # fmt: skip


def _outputs(proto, x):
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("op", ["Conv", "Gemm"])
def test_zero_bias_from_constants_is_dropped_and_outputs_stay(op):
    proto = _biased_model(_zero_fill(), op=op)
    m = load_ir(proto)
    (node,) = [n for n in m.graph if n.op_type == op]
    assert len(node.inputs) == 2
    assert [n.op_type for n in m.graph] == [op]  # the fill's nodes went with it
    x = np.random.default_rng(1).normal(size=m.graph.inputs[0].shape.numpy()).astype(np.float32)
    x.flat[0], x.flat[1] = np.nan, np.inf
    expected = _outputs(proto, x)
    got = _outputs(ir.to_proto(m), x)
    # onnxruntime's Conv may add a bias inside its accumulation: a unit in the last place
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)  # NaN, inf where they were


def test_nonzero_and_initializer_biases_stay():
    m = load_ir(_biased_model(_zero_fill(0.5)))
    assert len([n for n in m.graph if n.op_type == "Conv"][0].inputs) == 3
    # a zero initializer may be a parameter, which training moves away from zero
    zeros = numpy_helper.from_array(np.zeros(4, np.float32), "b")
    m = load_ir(_biased_model([], [zeros]))
    assert len([n for n in m.graph if n.op_type == "Conv"][0].inputs) == 3


def _transposes_model(outer_perm, graph_output=False):
    """x -> Transpose([1, 2, 0]) -> t, read by Relu and by a second Transpose(``outer_perm``)."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 2, 0]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Transpose", ["t"], ["u"], **({"perm": outer_perm} if outer_perm else {})),
        helper.make_node("Neg", ["u"], ["n"]),
    ]
    outputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ("r", "n")]
    if graph_output:
        outputs.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])], outputs
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("outer_perm", "graph_output", "expected_perm"),
    [
        ([2, 0, 1], False, None),  # cancels: the Neg reads x
        ([2, 0, 1], True, [0, 1, 2]),  # cancels, but u is an output: an identity Transpose
        ([1, 0, 2], False, [2, 1, 0]),
        (None, False, [0, 2, 1]),  # no perm: the axes reversed
    ],
)
def test_a_transpose_of_a_transpose_reads_the_first_ones_input(
    outer_perm, graph_output, expected_perm
):
    proto = onnx.shape_inference.infer_shapes(_transposes_model(outer_perm, graph_output))
    m = ir.from_proto(proto)
    compose_transposes(m.graph)
    transposes = [n for n in m.graph if n.op_type == "Transpose"]
    assert transposes[0].outputs[0].name == "t"  # the Relu still reads the first
    if expected_perm is None:
        assert len(transposes) == 1
        assert [n for n in m.graph if n.op_type == "Neg"][0].inputs[0].name == "x"
    else:
        assert transposes[1].inputs[0].name == "x"
        assert list(transposes[1].attributes["perm"].as_ints()) == expected_perm
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    x[0, 1, 2], x[1, 0, 3] = np.nan, -np.inf
    expected = _run_all(proto, x)
    got = _run_all(ir.to_proto(m), x)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)


def test_a_transpose_read_only_by_another_goes():
    proto = _transposes_model([2, 0, 1])
    del proto.graph.node[1]  # the Relu
    del proto.graph.output[0]
    m = ir.from_proto(proto)
    removed = compose_transposes(m.graph)
    assert [n.op_type for n in removed] == ["Transpose", "Transpose"]
    assert [n.op_type for n in m.graph] == ["Neg"]


def _run_all(proto, x):
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {"x": x})))


def test_training_graph_of_a_linear_reads_its_weight_untransposed(tmp_path):
    """torch exports ``nn.Linear`` as ``MatMul(x, Transpose(W))``; the input gradient's
    ``Transpose`` of that reads ``W`` itself."""
    torch = pytest.importorskip("torch")
    from traingraph import artifacts, from_torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    exported = from_torch(model, torch.randn(4, 2, 6), exporter="torchscript")  # MatMuls
    program = artifacts.generate_artifacts(
        exported, loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path
    )
    graph = program.train_model.graph
    assert sum(n.op_type == "Transpose" for n in exported.graph.node) == 2
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type == "Transpose":
            source = producer.get(node.input[0])
            assert source is None or source.op_type != "Transpose", node.name


def _transpose_reshape_chain(dims, first, target, second, extra_reader=False):
    """``x[dims] -> Transpose(first) -> Reshape(target) -> Transpose(second) -> y`` (the
    Reshape's output also a graph output where ``extra_reader``), shapes inferred."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=first),
        helper.make_node("Reshape", ["t", "target"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=second),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)], outputs,
        [numpy_helper.from_array(np.array(target, np.int64), "target")],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(proto)


ONE_COPY = ["Reshape", "Transpose", "Reshape"]


@pytest.mark.parametrize(
    "dims, first, target, second, ops",
    [
        # torchvision's attention: heads split from the batch, then moved
        ([50, 48, 64], [1, 0, 2], [16, 3, 50, 64], [0, 2, 1, 3], ONE_COPY),
        ([16, 3, 64, 50], [0, 1, 3, 2], [48, 50, 64], [1, 0, 2], ONE_COPY),
        # the two permutations undo each other around the split: no copy at all
        ([1, 50, 16, 3, 192], [3, 1, 2, 0, 4], [3, 800, 192], [1, 0, 2], ["Reshape"]),
        ([4, 6], [1, 0], [2, 3, 4], [2, 0, 1], ["Reshape"]),
    ],
)
def test_transpose_reshape_transpose_is_one_copy(dims, first, target, second, ops):
    """A Transpose, a Reshape that splits or merges axes and a Transpose are written as one
    Transpose between Reshapes (or none), and the output is the same, element for element."""
    import onnxruntime as ort

    proto = _transpose_reshape_chain(dims, first, target, second)
    m = ir.from_proto(proto)
    forward = set(m.graph)
    assert compose_views(m.graph, forward) == 1
    assert [n.op_type for n in m.graph if n.op_type != "Constant"] == ops
    assert forward == set(m.graph) and "target" not in m.graph.initializers
    inferred = onnx.shape_inference.infer_shapes(ir.to_proto(m), strict_mode=True).graph
    dims_of = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
               for v in [*inferred.value_info, *inferred.output]}  # fmt: skip
    for node in m.graph:
        if node.op_type != "Constant":  # the values written carry their shapes
            assert list(node.outputs[0].shape) == dims_of[node.outputs[0].name]
    x = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    run = [
        ort.InferenceSession(p.SerializeToString()).run(None, {"x": x})[0]
        for p in (proto, ir.to_proto(m))
    ]
    assert run[0].shape == run[1].shape
    np.testing.assert_array_equal(run[0], run[1])


@pytest.mark.parametrize(
    "dims, first, target, second, extra_reader",
    [
        ([6, 4], [1, 0], [3, 8], [1, 0], False),  # 4 x 6 -> 3 x 8 neither splits nor merges
        ([50, 48, 64], [1, 0, 2], [16, 3, 50, 64], [0, 2, 1, 3], True),  # r is read elsewhere
    ],
)
def test_transpose_reshape_transpose_stays_where_it_is_not_a_split(
    dims, first, target, second, extra_reader
):
    m = ir.from_proto(_transpose_reshape_chain(dims, first, target, second, extra_reader))
    assert compose_views(m.graph, set()) == 0
    assert [n.op_type for n in m.graph] == ["Transpose", "Reshape", "Transpose"]


def test_slices_that_keep_everything_become_identities():
    """A Slice from 0 to INT64_MAX (through a Cast, as the dynamo exporter writes ``x[:, 1:]``'s
    first axis) or over a static axis' whole length is an Identity keeping its output's name;
    one that drops an element, steps or reverses stays, and the outputs are the same."""
    big = np.iinfo(np.int64).max
    slices = [  # input, output, starts, ends, axes, steps
        ("x", "a", [0], [big], [0], None),  # the dynamic batch axis, whole
        ("a", "b", [-4], [4], [2], [1]),  # the static last axis, whole
        ("b", "c", [1], [big], [1], None),  # drops the first row
        ("c", "d", [0], [3], [0], None),  # may drop rows of the dynamic axis
        ("d", "e", [0], [big], [2], [2]),  # steps
        ("e", "f", [-1], [-big], [1], [-1]),  # reverses
    ]
    nodes, inits = [helper.make_node("Cast", ["zero"], ["zero64"], to=TensorProto.INT64)], []
    inits.append(numpy_helper.from_array(np.array([0], np.int32), "zero"))
    for i, (src, dst, starts, ends, axes, steps) in enumerate(slices):
        names = ["zero64" if starts == [0] else f"s{i}", f"e{i}", f"a{i}"]
        if starts != [0]:
            inits.append(numpy_helper.from_array(np.array(starts, np.int64), f"s{i}"))
        inits += [numpy_helper.from_array(np.array(v, np.int64), n)
                  for n, v in ((f"e{i}", ends), (f"a{i}", axes))]  # fmt: skip
        if steps is not None:
            inits.append(numpy_helper.from_array(np.array(steps, np.int64), f"p{i}"))
            names.append(f"p{i}")
        nodes.append(helper.make_node("Slice", [src, *names], [dst], name=dst))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "bf"], inits,
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m = load_ir(proto)
    kinds = {n.name: n.op_type for n in m.graph if n.op_type not in ("Cast", "Constant")}
    assert kinds == dict(zip("abcdef", ["Identity"] * 2 + ["Slice"] * 4))
    assert [v.name for v in m.graph.outputs] == ["b", "f"]
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    x[0, 0, 0] = np.nan
    runs = [
        ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x}
        )
        for p in (proto, ir.to_proto(m))
    ]
    for got, expected in zip(*runs):
        np.testing.assert_array_equal(got, expected)


def test_dead_nodes_go_but_random_draws_stay():
    from traingraph.ir.fold import remove_dead_nodes

    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0], name="unread"),
        helper.make_node("RandomUniformLike", ["x"], ["u"], name="draw"),
        helper.make_node("Neg", ["r"], ["y"], name="neg"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    m = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert [n.name for n in remove_dead_nodes(m.graph)] == ["unread"]
    assert [n.name for n in m.graph] == ["relu", "draw", "neg"]


def test_slice_bounds_of_unsqueezed_constants_fold():
    """The TorchScript exporter writes ``y[:, : y.shape[1] // 2]`` as a Slice whose starts,
    axes and steps are ``Unsqueeze(Constant)`` and whose end is read from the shape: all four
    fold, so the Slice's output (and a Resize after it) gets its shape; floating-point
    arithmetic on constants stays as written. The model computes the same."""
    import onnxruntime as ort

    def const(name, value, dtype=np.int64):
        array = np.array(value, dtype)
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))

    nodes = [
        const("zero", 0), const("one", 1), const("two", 2), const("axis0", [0]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["channels"], axis=0),
        helper.make_node("Div", ["channels", "two"], ["half"]),
        helper.make_node("Unsqueeze", ["half", "axis0"], ["ends"]),
        helper.make_node("Unsqueeze", ["zero", "axis0"], ["starts"]),
        helper.make_node("Unsqueeze", ["one", "axis0"], ["axes"]),
        helper.make_node("Unsqueeze", ["one", "axis0"], ["steps"]),
        helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["piece"]),
        const("unit", [1.0, 1.0], np.float32), const("twice", [2.0, 2.0], np.float32),
        helper.make_node("Concat", ["unit", "twice"], ["scales"], axis=0),
        helper.make_node("Resize", ["piece", "", "scales"], ["y"], mode="nearest"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m = load_ir(proto)
    values = {o.name: o for node in m.graph for o in node.outputs}
    for name in ("starts", "ends", "axes", "steps"):
        assert values[name].producer().op_type == "Constant", name
    assert values["scales"].producer().op_type == "Concat"
    assert values["piece"].shape == ir.Shape(["batch", 3, 4, 4])
    x = np.random.default_rng(0).standard_normal((2, 6, 4, 4)).astype(np.float32)
    run = [
        ort.InferenceSession(p.SerializeToString()).run(None, {"x": x})[0]
        for p in (proto, ir.to_proto(m))
    ]
    np.testing.assert_array_equal(run[0], run[1])


def test_resize_sizes_through_ceil_evaluate_for_the_gradient():
    """Hugging Face's MobileViT traced by the TorchScript exporter computes its interpolation
    size as ``Cast(Ceil(2.5) * 2)`` from constants, next to the batch and channels read from
    the shape: with Ceil evaluated, the sizes are known but for the batch (the input's own), so
    the Resize has a gradient; against torch's float64 bilinear interpolation."""
    import torch

    from traingraph.autodiff import build_gradient_graph
    from traingraph.ir.fold import partial_value

    def const(name, value, dtype=np.int64):
        array = np.array(value, dtype)
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array))

    nodes = [
        const("ratio", 2.5, np.float32), const("two", 2.0, np.float32), const("axis0", [0]),
        const("zero", [0]), const("lead", [2]),
        helper.make_node("Ceil", ["ratio"], ["up"]),
        helper.make_node("Mul", ["up", "two"], ["size"]),
        helper.make_node("Cast", ["size"], ["size64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["size64", "axis0"], ["h"]),
        helper.make_node("Unsqueeze", ["size64", "axis0"], ["w"]),
        helper.make_node("Concat", ["h", "w"], ["hw"], axis=0),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "lead", "zero"], ["nc"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear"),
        helper.make_node("Mul", ["y", "w_y"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 5, 5]),
         helper.make_tensor_value_info("w_y", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m = load_ir(proto)
    sizes = next(o for node in m.graph for o in node.outputs if o.name == "sizes")
    assert partial_value(sizes)[1:] == [4, 6, 6]
    grads = build_gradient_graph(proto, wrt=["x"], loss="loss")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    w = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    import onnxruntime as ort

    (got,) = ort.InferenceSession(grads.SerializeToString()).run(["x_grad"], {"x": x, "w_y": w})
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.interpolate(t, size=(6, 6), mode="bilinear", align_corners=False)
    (y * torch.tensor(w, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-5)
