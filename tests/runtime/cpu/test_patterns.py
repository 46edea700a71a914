"""The forward-side kernel candidates as onnxscript rewriter patterns
(runtime/cpu/patterns.py): each rule's matches and non-matches on small graphs, the nodes
other kernels took, and on LeNet, ResNet-8, the Transformer benchmark model and an exported
GELU MLP the native kernels built from the rules' matches."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from benchmarks import models as benchmark_models
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from gradcheck import adamw_artifacts
from torch_models import export, seeded
from traingraph.runtime.cpu import kernels, patterns
from traingraph.runtime.cpu.kernels.direct_conv import DirectConv
from traingraph.runtime.cpu.kernels.gelu import Gelu
from traingraph.runtime.cpu.native import AVAILABLE

FLOAT = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(name, FLOAT, None) for name in outputs],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _found(model, family, taken=frozenset(), read=frozenset()):
    return [(m.rule, sorted(m.nodes)) for m in patterns.find(model, family, taken, read).matches]


# -- the first Conv ------------------------------------------------------------------------


def _conv_model(*, channels=1, relu_readers=1, weight_initializer=False, **attributes):
    """x [N, C, 8, 8] -> Conv(w [4, C, 3, 3], b) -> Relu, the Conv's output read by
    ``relu_readers`` - 1 Identities too; pads 1 unless given (None: none)."""
    attributes = {"pads": [1, 1, 1, 1]} | attributes
    attributes = {name: value for name, value in attributes.items() if value is not None}
    inputs = [("x", ["N", channels, 8, 8]), ("w", [4, channels, 3, 3]), ("b", [4])]
    initializers = []
    if weight_initializer:
        inputs.pop(1)
        w = np.zeros((4, channels, 3, 3), np.float32)
        initializers.append(numpy_helper.from_array(w, "w"))
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], **attributes),
        helper.make_node("Relu", ["c"], ["r"]),
    ]
    nodes += [helper.make_node("Identity", ["c"], [f"i{k}"]) for k in range(1, relu_readers)]
    outputs = ["r"] + [f"i{k}" for k in range(1, relu_readers)]
    return _model(nodes, inputs, outputs, initializers)


def test_conv_relu_matches_a_first_conv_and_the_relu_that_alone_reads_it():
    model = _conv_model()
    ((match),) = patterns.find(model, patterns.FIRST_CONV).matches
    assert match.rule == "conv_relu" and match.nodes == {0, 1} and match.anchor == 0
    assert [match.name(v) for v in ("x", "w", "conv", "relu")] == ["x", "w", "c", "r"]
    conv = match.values["conv"].producer()
    assert patterns.conv_pads(conv) == (1, 1, 1, 1)
    # uneven pads and VALID are pads too
    assert patterns.conv_pads(
        patterns.find(_conv_model(pads=[0, 1, 2, 0]), patterns.FIRST_CONV).matches[0]
        .values["conv"].producer()
    ) == (0, 1, 2, 0)  # fmt: skip
    assert _found(_conv_model(auto_pad="VALID", pads=None), patterns.FIRST_CONV) == [
        ("conv_relu", [0, 1])
    ]


def test_conv_matches_the_conv_alone_where_the_relu_is_not_its_only_reader():
    assert _found(_conv_model(relu_readers=2), patterns.FIRST_CONV) == [("conv", [0])]
    # or where another kernel took the Relu; a Conv another kernel took stays
    assert _found(_conv_model(), patterns.FIRST_CONV, taken={1}) == [("conv", [0])]
    assert _found(_conv_model(), patterns.FIRST_CONV, taken={0}) == []
    # a Conv whose output the graph returns
    model = _conv_model()
    model.graph.output.append(helper.make_tensor_value_info("c", FLOAT, None))
    assert _found(model, patterns.FIRST_CONV) == [("conv", [0])]


@pytest.mark.parametrize(
    "options",
    [
        {"channels": patterns.DIRECT_CONV_CHANNELS + 1},
        {"strides": [2, 2]},
        {"dilations": [2, 2]},
        {"auto_pad": "SAME_UPPER", "pads": None},
        {"kernel_shape": [5, 5]},
        {"pads": [1, 1, -1, 1]},
        {"weight_initializer": True},  # the Conv reads a value the graph does not take in
    ],
    ids=[
        "channels", "strided", "dilated", "same-pads", "kernel-shape", "negative-pad",
        "initializer",
    ],  # fmt: skip
)
def test_first_conv_rules_leave_convs_the_kernel_does_not_compute(options):
    assert _found(_conv_model(**options), patterns.FIRST_CONV) == []


def test_a_grouped_conv_is_left():
    model = _conv_model(channels=2)
    model.graph.input[1].CopyFrom(helper.make_tensor_value_info("w", FLOAT, [4, 1, 3, 3]))
    model.graph.node[0].attribute.append(helper.make_attribute("group", 2))
    assert _found(model, patterns.FIRST_CONV) == []


# -- the exact GELU ------------------------------------------------------------------------


def _gelu_nodes(*, divided, half_first, swapped):
    """The five nodes of a GELU of ``a``, writing ``y``; ``swapped`` puts each product's and
    sum's inputs the other way round."""

    def pair(x, y):
        return [y, x] if swapped else [x, y]

    scale = helper.make_node("Div", ["a", "root2"], ["d"]) if divided else helper.make_node(
        "Mul", pair("a", "root_half"), ["d"]
    )
    nodes = [
        scale,
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", pair("e", "one"), ["p"]),
    ]
    if half_first:
        nodes += [
            helper.make_node("Mul", pair("a", "half"), ["h"]),
            helper.make_node("Mul", pair("h", "p"), ["y"]),
        ]
    else:
        nodes += [
            helper.make_node("Mul", pair("a", "p"), ["t"]),
            helper.make_node("Mul", pair("t", "half"), ["y"]),
        ]
    return nodes


def _constants(**overrides):
    values = {"root2": math.sqrt(2), "root_half": math.sqrt(0.5), "one": 1.0, "half": 0.5}
    values |= overrides
    return [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in values.items()]


def _gelu_model(
    *, divided=True, half_first=False, swapped=False, mask=None, readers=(), **constants
):
    """A GELU of ``a`` [N, 16] writing ``y`` (times ``mask`` of the given shape, writing ``z``,
    where given), with an Identity reading each value of ``readers`` too."""
    nodes = _gelu_nodes(divided=divided, half_first=half_first, swapped=swapped)
    inputs = [("a", ["N", 16])]
    outputs = ["y"]
    if mask is not None:
        nodes.append(helper.make_node("Mul", ["y", "mask"], ["z"]))
        inputs.append(("mask", mask))
        outputs = ["z"]
    for k, value in enumerate(readers):
        nodes.append(helper.make_node("Identity", [value], [f"read{k}"]))
        outputs.append(f"read{k}")
    return _model(nodes, inputs, outputs, _constants(**constants))


def _gelu_rule(divided, half_first, masked=False):
    return (
        f"{'masked_' if masked else ''}gelu{'_half_first' if half_first else ''}"
        f"_{'divided' if divided else 'scaled'}"
    )


@pytest.mark.parametrize("swapped", [False, True], ids=["in-order", "swapped"])
@pytest.mark.parametrize("half_first", [False, True], ids=["half-last", "half-first"])
@pytest.mark.parametrize("divided", [True, False], ids=["divided", "scaled"])
def test_each_gelu_form_is_matched(divided, half_first, swapped):
    model = _gelu_model(divided=divided, half_first=half_first, swapped=swapped)
    ((match),) = patterns.find(model, patterns.GELU).matches
    assert match.rule == _gelu_rule(divided, half_first)
    assert match.nodes == set(range(5)) and match.anchor == 1
    assert (match.name("a"), match.name("gelu"), match.name("masked")) == ("a", "y", None)


@pytest.mark.parametrize(
    "change",
    [
        {"half": 0.6},
        {"one": 2.0},
        {"root2": math.sqrt(3)},
        {"readers": ("e",)},  # the Erf has another reader
        {"readers": ("t",)},  # the product the half halves has another reader
    ],
    ids=["half", "one", "scale", "erf-read", "product-read"],
)
def test_a_gelu_with_other_constants_or_readers_is_left(change):
    assert _found(_gelu_model(**change), patterns.GELU) == []
    # the readers of values a GELU's gradient reads are not the rules' concern
    assert _found(_gelu_model(readers=("a", "p", "d")), patterns.GELU) == [
        (_gelu_rule(True, False), [0, 1, 2, 3, 4])
    ]


def _gelu_tanh_model(*, powered, half_at, swapped, exponent=3.0, **overrides):
    """The tanh GELU of ``a`` [N, 16] writing ``y``: the cube as a Pow (``powered``) or two
    products, the half taken of ``a``, of the product or of ``1 + tanh`` (``half_at``)."""

    def pair(x, y):
        return [y, x] if swapped else [x, y]

    mul = helper.make_node
    if powered:
        cube = [mul("Pow", ["a", "three"], ["cube"])]
    else:
        cube = [mul("Mul", pair("a", "a"), ["sq"]), mul("Mul", pair("a", "sq"), ["cube"])]
    nodes = cube + [
        mul("Mul", pair("cube", "k"), ["kc"]),
        mul("Add", pair("a", "kc"), ["s"]),
        mul("Mul", pair("s", "c"), ["u"]),
        mul("Tanh", ["u"], ["t"]),
        mul("Add", pair("t", "one"), ["p"]),
    ]
    nodes += {
        "first": [mul("Mul", pair("a", "half"), ["h"]), mul("Mul", pair("h", "p"), ["y"])],
        "last": [mul("Mul", pair("a", "p"), ["q"]), mul("Mul", pair("q", "half"), ["y"])],
        "inner": [mul("Mul", pair("half", "p"), ["h"]), mul("Mul", pair("a", "h"), ["y"])],
    }[half_at]
    values = {"k": 0.044715, "c": math.sqrt(2 / math.pi), "one": 1.0, "half": 0.5} | overrides
    constants = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in values.items()]
    constants.append(numpy_helper.from_array(np.array(exponent, np.float32), "three"))
    return _model(nodes, [("a", ["N", 16])], ["y"], constants)


@pytest.mark.parametrize("swapped", [False, True], ids=["in-order", "swapped"])
@pytest.mark.parametrize("half_at", ["first", "last", "inner"])
@pytest.mark.parametrize("powered", [True, False], ids=["pow", "products"])
def test_each_tanh_gelu_form_is_matched(powered, half_at, swapped):
    model = _gelu_tanh_model(powered=powered, half_at=half_at, swapped=swapped)
    ((match),) = patterns.find(model, patterns.GELU_TANH).matches
    cube = "_pow" if powered else "_products"
    assert match.rule == f"gelu_tanh_half_{half_at}{cube}"
    assert match.nodes == set(range(len(model.graph.node)))
    assert (match.name("a"), match.name("gelu"), match.name("masked")) == ("a", "y", None)


@pytest.mark.parametrize(
    "change",
    [{"k": 0.05}, {"c": 0.8}, {"one": 2.0}, {"half": 0.25}, {"exponent": 2.0}],
    ids=["k", "c", "one", "half", "square"],
)
def test_a_tanh_gelu_with_other_constants_is_left(change):
    model = _gelu_tanh_model(powered=True, half_at="first", swapped=False, **change)
    assert _found(model, patterns.GELU_TANH) == []


@pytest.mark.parametrize("half_first", [False, True], ids=["half-last", "half-first"])
def test_masked_gelu_takes_the_mask_product_of_the_outputs_shape(half_first):
    model = _gelu_model(half_first=half_first, mask=["N", 16])
    ((match),) = patterns.find(model, patterns.GELU).matches
    assert match.rule == _gelu_rule(True, half_first, masked=True)
    assert match.nodes == set(range(6))
    assert (match.name("mask"), match.name("masked")) == ("mask", "z")
    # a factor that broadcasts stays a node of its own
    assert _found(_gelu_model(half_first=half_first, mask=[1, 16]), patterns.GELU) == [
        (_gelu_rule(True, half_first), [0, 1, 2, 3, 4])
    ]


def test_masked_gelu_needs_the_mask_product_to_be_the_only_reader():
    plain = [(_gelu_rule(True, False), [0, 1, 2, 3, 4])]
    model = _gelu_model(mask=["N", 16], readers=("y",))
    assert _found(model, patterns.GELU) == plain
    # a reader another kernel took (a Dropout mask's reading of the shape) does not count,
    # unless that kernel reads the GELU's output itself
    assert _found(model, patterns.GELU, taken={6}) == [
        (_gelu_rule(True, False, masked=True), [0, 1, 2, 3, 4, 5])
    ]
    assert _found(model, patterns.GELU, taken={6}, read={"y"}) == plain
    # and no node of a match is another kernel's
    assert _found(model, patterns.GELU, taken={2}) == []


def test_the_rules_see_only_the_neighbourhood_of_their_anchors():
    # a GELU behind a long chain: the values from outside come from outside, the matched
    # nodes keep their indices in the model
    chain = [helper.make_node("Neg", [f"n{k}"], [f"n{k + 1}"]) for k in range(12)]
    gelu = _gelu_model()
    for node in gelu.graph.node:
        node.input[:] = ["n12" if v == "a" else v for v in node.input]
    nodes = chain + list(gelu.graph.node)
    model = _model(nodes, [("n0", ["N", 16])], ["y"], _constants())
    assert _found(model, patterns.GELU) == [(_gelu_rule(True, False), list(range(12, 17)))]


def test_nothing_is_matched_in_a_model_with_subgraphs():
    """A node holding a subgraph may read any value there, unseen by the index."""
    model = _gelu_model(readers=("a",))
    branch = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["branch_out"])],  # reads the GELU's product
        "branch",
        [],
        [helper.make_tensor_value_info("branch_out", FLOAT, None)],
    )
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    model.graph.node.append(
        helper.make_node("If", ["flag"], ["chosen"], then_branch=branch, else_branch=branch)
    )
    model.graph.output.append(helper.make_tensor_value_info("chosen", FLOAT, None))
    assert _found(model, patterns.GELU) == []


def test_threads_match_at_once():
    """Modules built in several threads at once (Flower's simulation) each match with their
    own rules: a rule's matcher holds the state of the match under way."""
    models = [_gelu_model(half_first=k % 2 == 1, mask=["N", 16]) for k in range(4)]
    want = [_found(model, patterns.GELU) for model in models]
    got: dict[int, list[object]] = {}

    def run(k: int) -> None:
        got[k] = [_found(models[k], patterns.GELU) for _ in range(20)]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(got[k] == [want[k]] * 20 for k in range(4))


# -- on real models: the kernels are the rules' matches ------------------------------------


def _kernel_matches(model, kind):
    _, found = kernels.find(model, [])
    ours = [(kernel, nodes) for kernel, nodes in found if isinstance(kernel, kind)]
    others = [(kernel, nodes) for kernel, nodes in found if not isinstance(kernel, kind)]
    return ours, set().union(*(nodes for _, nodes in others)), {
        v for kernel, _ in others for v in kernel.inputs
    }


def _benchmark_training_model(name, directory):
    prepared = benchmark_models.prepare(name, directory / "export")
    return onnx.load(
        adamw_artifacts(directory, onnx.load(prepared.onnx_path)) / "training_model.onnx"
    )


needs_native = pytest.mark.skipif(
    not AVAILABLE, reason="traingraph.runtime._convc was not built (no C compiler at install time)"
)


@needs_native
@pytest.mark.parametrize(
    ("name", "rule", "out"),
    [("lenet", "conv_relu", "/Relu_output_0"), ("resnet8", "conv", "/conv/Conv_output_0")],
)
def test_first_conv_kernels_are_the_rules_matches(tmp_path: Path, name, rule, out):
    """LeNet's first Conv and its Relu; ResNet-8's first Conv, which a BatchNorm reads."""
    model = _benchmark_training_model(name, tmp_path)
    found, taken, _ = _kernel_matches(model, DirectConv)
    matches = patterns.find(model, patterns.FIRST_CONV, taken).matches
    assert [m.rule for m in matches] == [rule]
    assert [nodes for _, nodes in found] == [set(matches[0].nodes)]
    ((kernel, _),) = found
    assert kernel.out == out and kernel.relu == (rule == "conv_relu") and kernel.x == "x"


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _assert_gelu_kernels_are_the_rules_matches(model, rule, count):
    found, taken, read = _kernel_matches(model, Gelu)
    matches = patterns.find(model, patterns.GELU, taken, read).matches
    assert [m.rule for m in matches] == [rule] * count
    forward = [(k, nodes) for k, nodes in found if k.g is None]
    gradient = [k for k, _ in found if k.g is not None]
    assert sorted(map(sorted, (nodes for _, nodes in forward))) == sorted(
        sorted(m.nodes) for m in matches
    )
    assert len(gradient) == count  # each GELU's gradient, found from its matched nodes
    assert {(k.a, k.mask) for k, _ in forward} == {(k.a, k.mask) for k in gradient}
    assert {(m.name("a"), m.name("mask")) for m in matches} == {(k.a, k.mask) for k, _ in forward}


@needs_native
def test_gelu_kernels_of_an_exported_mlp_are_the_rules_matches(tmp_path: Path):
    directory = adamw_artifacts(tmp_path, export(seeded(GeluMLP), torch.zeros(2, 6)))
    model = onnx.load(directory / "training_model.onnx")
    _assert_gelu_kernels_are_the_rules_matches(model, "gelu_divided", 1)


@needs_native
@pytest.mark.slow
def test_gelu_kernels_of_the_transformer_benchmark_are_the_rules_matches(tmp_path: Path):
    """Two encoder layers, each a GELU with a Dropout after it: the masked rule."""
    model = _benchmark_training_model("transformer", tmp_path)
    _assert_gelu_kernels_are_the_rules_matches(model, "masked_gelu_divided", 2)
