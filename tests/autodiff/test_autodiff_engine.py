"""The autodiff engine as a whole: accumulation, pruning, options, naming, errors and opsets.

Each model is small and written with ``onnx.helper``; its gradients run through onnxruntime and
are compared with ``torch.autograd`` on the same computation (float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import traingraph
from gradcheck import assert_default_domain_only, session
from traingraph.autodiff import build_gradient_graph
from traingraph.ir.model import MIN_OPSET, max_ir_version, max_supported_opset

D = TensorProto.DOUBLE
rng = np.random.default_rng(0)


def r(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: dict[str, Sequence[Any]],
    outputs: Sequence[str],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    extra_opsets: Sequence[onnx.OperatorSetIdProto] = (),
) -> onnx.ModelProto:
    """A float64 model; ``inputs`` maps names to shapes (str dims are symbolic)."""
    graph = helper.make_graph(
        list(nodes),
        "m",
        [helper.make_tensor_value_info(n, D, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, D, None) for n in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
        ir_version=max_ir_version(),
    )


def run_gradients(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], **kwargs: Any
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Differentiate ``model``, check the result is valid standard ONNX and run it."""
    grad_model = build_gradient_graph(model, **kwargs)
    onnx.checker.check_model(grad_model, full_check=True)
    assert_default_domain_only(grad_model)
    outs = session(grad_model).run(None, feeds)
    return grad_model, dict(zip([o.name for o in grad_model.graph.output], outs))


def torch_grads(fn: Any, feeds: dict[str, np.ndarray], wrt: Sequence[str]) -> dict[str, np.ndarray]:
    """Gradients of the scalar ``fn(**tensors)`` by torch.autograd."""
    tensors = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    loss = fn(**tensors)
    grads = torch.autograd.grad(loss, [tensors[k] for k in wrt], allow_unused=True)
    return {
        k: np.zeros_like(feeds[k]) if g is None else g.numpy() for k, g in zip(wrt, grads)
    }


def assert_grads(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for k, e in expected.items():
        np.testing.assert_allclose(got[f"{k}_grad"], e, rtol=1e-10, atol=1e-12, err_msg=k)


def test_fan_out_accumulates() -> None:
    # x feeds three nodes: y = sum(x * w + tanh(x) - exp(x))
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"]),
        helper.make_node("Tanh", ["x"], ["b"]),
        helper.make_node("Exp", ["x"], ["c"]),
        helper.make_node("Add", ["a", "b"], ["ab"]),
        helper.make_node("Sub", ["ab", "c"], ["abc"]),
        helper.make_node("ReduceSum", ["abc"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": ["n", 3], "w": [3]}, ["loss"])
    feeds = {"x": r(4, 3), "w": r(3)}
    _, got = run_gradients(model, feeds, wrt=["x", "w"])
    expected = torch_grads(
        lambda x, w: (x * w + torch.tanh(x) - torch.exp(x)).sum(), feeds, ["x", "w"]
    )
    assert_grads(got, expected)


def _slices_of_x(bounds: Sequence[tuple[int, int]]) -> tuple[onnx.ModelProto, list[str]]:
    """loss = sum_i sum(tanh(x[:, b_i:e_i]) * (i + 1)) over static x[2, 6] (an 'n' batch)."""
    nodes, terms, consts = [], [], {}
    for i, (begin, end) in enumerate(bounds):
        consts[f"b{i}"] = np.array([begin], np.int64)
        consts[f"e{i}"] = np.array([end], np.int64)
        consts[f"k{i}"] = np.array(float(i + 1))
        nodes += [
            helper.make_node("Slice", ["x", f"b{i}", f"e{i}", "axis"], [f"s{i}"]),
            helper.make_node("Tanh", [f"s{i}"], [f"t{i}"]),
            helper.make_node("Mul", [f"t{i}", f"k{i}"], [f"m{i}"]),
            helper.make_node("ReduceSum", [f"m{i}"], [f"r{i}"], keepdims=0),
        ]
        terms.append(f"r{i}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    consts["axis"] = np.array([1], np.int64)
    return make_model(nodes, {"x": ["n", 6]}, ["loss"], initializers=consts), terms


@pytest.mark.parametrize(
    ("bounds", "joined"),
    [
        ([(2, 4), (0, 2), (4, 6)], True),  # pieces in any order that tile the axis: one Concat
        ([(0, 3), (3, 6)], True),
        ([(0, 3), (2, 6)], False),  # overlapping pieces: padded and summed
        ([(0, 2), (3, 6)], False),  # a gap: padded and summed
    ],
)
def test_slices_that_tile_an_axis_join_with_concat(
    bounds: list[tuple[int, int]], joined: bool
) -> None:
    model, _ = _slices_of_x(bounds)
    feeds = {"x": r(2, 6)}
    grad_model, got = run_gradients(model, feeds, wrt=["x"])
    ops = [n.op_type for n in grad_model.graph.node]
    assert ("Concat" in ops and "Pad" not in ops) == joined, ops
    assert joined or "Sum" in ops

    def fn(x: torch.Tensor) -> torch.Tensor:
        return sum(torch.tanh(x[:, b:e]).sum() * (i + 1) for i, (b, e) in enumerate(bounds))

    assert_grads(got, torch_grads(fn, feeds, ["x"]))


@pytest.mark.parametrize("also_elementwise", [True, False])
def test_expanded_gradients_of_a_sum_stay_unexpanded(also_elementwise: bool) -> None:
    """A squeeze-and-excitation block: x reaches the loss through its channel means and sums
    (ReduceMean and ReduceSum, whose gradients are Expands to x's shape) and, with
    ``also_elementwise``, elementwise. The Sum of x's gradients takes the Expands' inputs and
    broadcasts them; where every part is an Expand, one keeps x's shape."""
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
        helper.make_node("ReduceSum", ["x", "axes"], ["pool"], keepdims=1),
        helper.make_node("Mul", ["mean", "w"], ["scaled"]),
        helper.make_node("Sigmoid", ["scaled"], ["gate"]),
        helper.make_node("Mul", ["pool", "gate"], ["gated"]),
    ]
    if also_elementwise:
        nodes += [
            helper.make_node("Mul", ["x", "gate"], ["excited"]),
            helper.make_node("Tanh", ["excited"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["a"], keepdims=0),
            helper.make_node("ReduceSum", ["gated"], ["b"], keepdims=0),
            helper.make_node("Add", ["a", "b"], ["loss"]),
        ]
    else:
        nodes.append(helper.make_node("ReduceSum", ["gated"], ["loss"], keepdims=0))
    model = make_model(nodes, {"x": [2, 3, 4, 5], "w": [3, 1, 1]}, ["loss"], opset=18)
    model.graph.initializer.append(axes)
    feeds = {"x": r(2, 3, 4, 5), "w": r(3, 1, 1)}
    grad_model, got = run_gradients(model, feeds, wrt=["x", "w"])
    expanded = {o for n in grad_model.graph.node if n.op_type == "Expand" for o in n.output}
    sums = [n for n in grad_model.graph.node if n.op_type == "Sum"]
    expected = 0 if also_elementwise else 1
    assert sums and all(sum(i in expanded for i in n.input) == expected for n in sums)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(x.mean((2, 3), keepdim=True) * w)
        loss = (x.sum((2, 3), keepdim=True) * gate).sum()
        return loss + torch.tanh(x * gate).sum() if also_elementwise else loss

    assert_grads(got, torch_grads(fn, feeds, ["x", "w"]))


def test_shape_subgraph_and_integer_paths_carry_no_gradient() -> None:
    # h = x * w; t = Reshape(h, Concat(Shape(h)[0:1], [-1])); an integer path through Cast(int64)
    # and a bool path through Greater both feed the loss as constants.
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Shape", ["h"], ["h_shape"]),
        helper.make_node("Gather", ["h_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["h", "new_shape"], ["flat"]),
        helper.make_node("Cast", ["flat"], ["flat_int"], to=TensorProto.INT64),
        helper.make_node("Cast", ["flat_int"], ["flat_rounded"], to=TensorProto.DOUBLE),
        helper.make_node("Greater", ["flat", "zero_f"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["mask"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["flat", "flat_rounded"], ["p"]),
        helper.make_node("Mul", ["p", "mask"], ["q"]),
        helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0),
    ]
    inits = {
        "zero": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
        "zero_f": np.array(0.0),
    }
    model = make_model(nodes, {"x": ["n", 2, 3], "w": [3]}, ["loss"], inits)
    feeds = {"x": 3 * r(4, 2, 3), "w": r(3)}
    grad_model, got = run_gradients(model, feeds, wrt=["x", "w"])

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        flat = (x * w).reshape(x.shape[0], -1)
        rounded = flat.long().double()
        return (flat * rounded * (flat > 0).double()).sum()

    assert_grads(got, torch_grads(fn, feeds, ["x", "w"]))
    grad_ops = {n.op_type for n in grad_model.graph.node[len(model.graph.node) :]}
    assert "Gather" not in grad_ops, "the integer shape path must not be differentiated"


def test_stop_gradient_on_intermediate() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Mul", ["t", "h"], ["u"]),
        helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": ["n", 3], "w": [3]}, ["loss"])
    feeds = {"x": r(4, 3), "w": r(3)}
    _, got = run_gradients(model, feeds, wrt=["x", "w"], stop_gradients=["t"])

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x * w
        return (torch.tanh(h).detach() * h).sum()

    assert_grads(got, torch_grads(fn, feeds, ["x", "w"]))


def test_user_gradient_on_intermediate() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Sigmoid", ["h"], ["s"]),
        helper.make_node("Mul", ["s", "s"], ["u"]),
        helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": ["n", 3], "w": [3]}, ["loss"])
    feeds = {"x": r(4, 3), "w": r(3)}
    user_grad = r(4, 3)
    grad_model, got = run_gradients(
        model, {**feeds, "s_user_grad": user_grad}, wrt=["x", "w"], user_gradients=["s"]
    )
    extra = next(i for i in grad_model.graph.input if i.name == "s_user_grad")
    assert extra.type.tensor_type.elem_type == D

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(x * w)
        return (s * s).sum() + (s * torch.tensor(user_grad)).sum()

    assert_grads(got, torch_grads(fn, feeds, ["x", "w"]))


def test_wrt_graph_input_and_intermediate() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": ["n", 3]}, ["loss"], {"w": r(3)})
    x = r(4, 3)
    _, got = run_gradients(model, {"x": x}, wrt=["x", "h"])
    h = x * numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(got["h_grad"], 1 - np.tanh(h) ** 2, rtol=1e-12)
    np.testing.assert_allclose(
        got["x_grad"], (1 - np.tanh(h) ** 2) * numpy_helper.to_array(model.graph.initializer[0])
    )


def test_defaults_wrt_float_initializers_and_first_output() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
        helper.make_node("ReduceSum", ["y", "axes"], ["loss"], keepdims=0),
        helper.make_node("Exp", ["y"], ["other"]),
    ]
    inits = {"w": r(3), "b": r(3), "axes": np.array([0, 1], np.int64)}
    model = make_model(nodes, {"x": ["n", 3]}, ["loss", "other"], inits)
    x = r(4, 3)
    grad_model, got = run_gradients(model, {"x": x})
    assert [o.name for o in grad_model.graph.output] == ["loss", "other", "w_grad", "b_grad"]
    np.testing.assert_allclose(got["w_grad"], x.sum(0))
    np.testing.assert_allclose(got["b_grad"], np.full(3, 4.0))


def test_outputs_follow_wrt_order() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": [2, 3]}, ["y", "loss"], {"w": r(3), "b": r(3)})
    grad_model, got = run_gradients(model, {"x": r(2, 3)}, wrt=["b", "x", "w"], loss="loss")
    names = [o.name for o in grad_model.graph.output]
    assert names == ["y", "loss", "b_grad", "x_grad", "w_grad"]
    assert got["b_grad"].shape == (3,) and got["x_grad"].shape == (2, 3)


def test_unused_parameter_gets_zeros() -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, {"x": ["n", 3]}, ["loss"], {"w": r(3), "unused": r(2, 5)})
    _, got = run_gradients(model, {"x": r(4, 3)})
    np.testing.assert_array_equal(got["unused_grad"], np.zeros((2, 5)))


def _custom_op_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Mystery", ["h"], ["m"], domain="example.custom", name="mystery_node"),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    return make_model(
        nodes, {"x": [2, 3]}, ["loss"], {"w": r(3)},
        extra_opsets=[helper.make_opsetid("example.custom", 1)],
    )


def _loop_model() -> onnx.ModelProto:
    # Two iterations of acc = acc * w, the body capturing w from the outer graph.
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Mul", ["acc_in", "w"], ["acc_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", D, [3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", D, [3]),
        ],
    )
    nodes = [
        helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body, name="the_loop"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    inits = {"w": r(3), "trips": np.array(2, np.int64)}
    return make_model(nodes, {"x": [3]}, ["loss"], inits)


def _unknown_rank_model() -> onnx.ModelProto:
    # The custom op's output has no known rank, which GatherElements' rule needs: the error
    # names the op without a rule upstream, not the GatherElements it starved.
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Mystery", ["h"], ["m"], domain="example.custom", name="mystery_node"),
        helper.make_node("GatherElements", ["m", "idx"], ["g"], axis=1, name="gather"),
        helper.make_node("ReduceSum", ["g"], ["loss"], keepdims=0),
    ]
    return make_model(
        nodes, {"x": [2, 3]}, ["loss"], {"w": r(3), "idx": np.zeros((2, 1), np.int64)},
        extra_opsets=[helper.make_opsetid("example.custom", 1)],
    )


@pytest.mark.parametrize(
    ("make", "op", "node", "wrt"),
    [
        (_custom_op_model, "example.custom::Mystery", "mystery_node", ["w"]),
        (_unknown_rank_model, "example.custom::Mystery", "mystery_node", ["w"]),
        (_loop_model, "Loop", "the_loop", ["x"]),
        # w reaches the loop only as a value its body captures.
        (_loop_model, "Loop", "the_loop", ["w"]),
    ],
)
def test_op_without_rule_raises(make: Any, op: str, node: str, wrt: list[str]) -> None:
    with pytest.raises(traingraph.GradientNotImplementedError) as info:
        build_gradient_graph(make(), wrt=wrt)
    message = str(info.value)
    assert op in message and repr(node) in message and "opset 17" in message
    assert "Supported ops" in message and "Mul" in message
    assert info.value.op_type == op.rsplit("::", maxsplit=1)[-1] and info.value.node_name == node


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"wrt": ["nope"]}, "wrt tensor 'nope'"),
        ({"loss": "nope"}, "loss 'nope'"),
        ({"stop_gradients": ["nope"]}, "stop_gradients tensor 'nope'"),
        ({"user_gradients": ["nope"]}, "user_gradients tensor 'nope'"),
        ({"wrt": ["axes"]}, "only floating-point"),
        ({"wrt": ["ww"]}, r"did you mean one of \['w'"),
        ({"wrt": ["w", "w"]}, "'w' twice"),
        ({"wrt": ["x"]}, "already has a tensor named x_grad"),
    ],
)
def test_bad_names_raise_model_error(kwargs: dict[str, Any], match: str) -> None:
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("ReduceSum", ["h", "axes"], ["loss"], keepdims=0),
        helper.make_node("Neg", ["x"], ["x_grad"]),
    ]
    model = make_model(nodes, {"x": [2, 3]}, ["loss"], {"w": r(3), "axes": np.array([1])})
    with pytest.raises(traingraph.ModelError, match=match):
        build_gradient_graph(model, **kwargs)


def test_opset_out_of_range_raises_model_error() -> None:
    model = make_model([helper.make_node("Neg", ["x"], ["y"])], {"x": [2]}, ["y"], opset=12)
    with pytest.raises(traingraph.ModelError, match="opset 12"):
        build_gradient_graph(model, wrt=["x"])


def _mlp(opset: int) -> onnx.ModelProto:
    """loss = sum_n mean_j((relu(x @ w1 + b1) @ w2 - t)^2) with a dynamic batch.

    ReduceMean takes its axes as an attribute before opset 18 and as an input from 18 on.
    """
    if opset >= 18:
        mean = helper.make_node("ReduceMean", ["sq", "axis1"], ["per_row"], keepdims=0)
    else:
        mean = helper.make_node("ReduceMean", ["sq"], ["per_row"], axes=[1], keepdims=0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["xw"]),
        helper.make_node("Add", ["xw", "b1"], ["z"]),
        helper.make_node("Relu", ["z"], ["a"]),
        helper.make_node("MatMul", ["a", "w2"], ["y"]),
        helper.make_node("Sub", ["y", "t"], ["e"]),
        helper.make_node("Mul", ["e", "e"], ["sq"]),
        mean,
        helper.make_node("ReduceSum", ["per_row"], ["loss"], keepdims=0),
    ]
    inits = {"w1": r(3, 5), "b1": r(5), "w2": r(5, 2)}
    if opset >= 18:
        inits["axis1"] = np.array([1], np.int64)
    return make_model(nodes, {"x": ["n", 3], "t": ["n", 2]}, ["loss"], inits, opset=opset)


@pytest.mark.parametrize("opset", range(MIN_OPSET, max_supported_opset() + 1))
def test_every_supported_opset(opset: int) -> None:
    model = _mlp(opset)
    feeds = {"x": r(4, 3), "t": r(4, 2)}
    grad_model, got = run_gradients(model, feeds)
    assert {(o.domain, o.version) for o in grad_model.opset_import} == {("", opset)}
    params = {
        i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type == D
    }

    def fn(x: torch.Tensor, t: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
           w2: torch.Tensor) -> torch.Tensor:
        return ((torch.relu(x @ w1 + b1) @ w2 - t) ** 2).mean(1).sum()

    assert_grads(got, torch_grads(fn, {**feeds, **params}, list(params)))


def test_name_output_renames_a_computed_value_once() -> None:
    import onnx_ir as ir

    from traingraph.autodiff.engine import name_output
    from traingraph.ir.builder import OpBuilder

    x = ir.Value(name="x", shape=ir.Shape([3]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 17})
    b = OpBuilder(graph, 17)
    y = b.Neg(x)
    first = name_output(b, y, "y_grad", x, rename=True)
    assert first is y and y.name == "y_grad" and y.producer().op_type == "Neg"
    # The same value exposed again, a graph input, or a call without rename: an Identity each.
    second = name_output(b, y, "z_grad", x, rename=True)
    from_input = name_output(b, x, "x_copy", x, rename=True)
    plain = name_output(b, b.Neg(x), "w_grad", x)
    for out, name in ((second, "z_grad"), (from_input, "x_copy"), (plain, "w_grad")):
        assert out.name == name and out.producer().op_type == "Identity"
    assert x.name == "x"


def test_training_model_gradients_are_written_by_the_nodes_that_compute_them(tmp_path) -> None:
    from torch_models import MLP, export, seeded
    from traingraph import artifacts

    artifacts.generate_artifacts(
        export(seeded(MLP), torch.zeros(2, 20)),
        loss=artifacts.LossType.CrossEntropyLoss,
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    outputs = [o.name for o in model.graph.output]
    assert outputs[0] == "loss" and any(o.endswith("_grad") for o in outputs)
    assert not [o for o in outputs if producers.get(o) == "Identity"], producers
