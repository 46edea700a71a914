"""Transposes moved and merged (traingraph.ir.transposes): fewer copies, the same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from traingraph.ir.transposes import (
    compose_views,
    move_transposes,
    transposed_products,
)

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(proto)


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ops(m: ir.Model, op: str) -> int:
    return sum(n.op_type == op for n in m.graph)


def _rewritten(proto: onnx.ModelProto, rewrite) -> tuple[ir.Model, onnx.ModelProto]:
    m = ir.from_proto(proto)
    rewrite(m.graph)
    out = ir.to_proto(m)
    onnx.checker.check_model(out, full_check=True)
    return m, out


def _attention_input_projection(batch_dim: int | str = 3):
    """torch's MultiheadAttention(batch_first=True) up to the heads of q, k and v, as its
    TorchScript export writes it: the batch moved behind the sequence, the packed projection,
    q, k and v split along a new axis, each split into heads moved in front."""
    n, length, e, heads = 3, 5, 8, 2
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node("MatMul", ["xt", "w"], ["proj"]),
        helper.make_node("Add", ["b", "proj"], ["biased"]),
        helper.make_node("Reshape", ["biased", "s_split"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "zero"], ["u"]),
        helper.make_node("Transpose", ["u"], ["packed"], perm=[3, 1, 2, 0, 4]),
        helper.make_node("Squeeze", ["packed", "minus2"], ["qkv"]),
    ]
    outputs = []
    for i, name in enumerate("qkv"):
        nodes += [
            helper.make_node("Gather", ["qkv", f"i{i}"], [f"{name}0"], axis=0),
            helper.make_node("Reshape", [f"{name}0", "s_heads"], [f"{name}1"]),
            helper.make_node("Transpose", [f"{name}1"], [f"{name}2"], perm=[1, 0, 2]),
            helper.make_node("Reshape", [f"{name}2", "s_batch"], [name]),
        ]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    inits = [
        numpy_helper.from_array(RNG.standard_normal((e, 3 * e)).astype(np.float32), "w"),
        numpy_helper.from_array(RNG.standard_normal(3 * e).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([length, n, 3, e], np.int64), "s_split"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-2], np.int64), "minus2"),
        numpy_helper.from_array(np.array([length, n * heads, e // heads], np.int64), "s_heads"),
        numpy_helper.from_array(np.array([n, heads, length, e // heads], np.int64), "s_batch"),
    ] + [numpy_helper.from_array(np.array(i, np.int64), f"i{i}") for i in range(3)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, length, e])
    proto = _model(nodes, [x], outputs, inits)
    return proto, {"x": RNG.standard_normal((n, length, e)).astype(np.float32)}


@pytest.mark.parametrize("batch_dim", [3, "batch"])
def test_attention_projection_copies_once_per_head_split(batch_dim):
    """Five copies (the batch moved, q/k/v packed, each of them moved into heads) become three,
    with the same values; a symbolic batch is determined by the Reshapes' static shapes."""
    proto, feeds = _attention_input_projection(batch_dim)
    m, out = _rewritten(proto, lambda g: move_transposes(g, 18))
    assert _ops(ir.from_proto(proto), "Transpose") == 5
    assert _ops(m, "Transpose") == 3 and _ops(m, "Gather") == 0 and _ops(m, "Split") == 1
    for a, b in zip(_run(proto, feeds), _run(out, feeds)):
        np.testing.assert_array_equal(a, b)


def test_names_kept_stay():
    """A value a caller reads by name is neither removed nor moved through."""
    proto, feeds = _attention_input_projection()
    m, out = _rewritten(proto, lambda g: move_transposes(g, 18, keep={"proj"}))
    assert "proj" in {v.name for n in m.graph for v in n.outputs}
    producer = next(n for n in m.graph if n.outputs[0].name == "proj")
    assert producer.op_type == "MatMul" and producer.inputs[0].name == "xt"
    for a, b in zip(_run(proto, feeds), _run(out, feeds)):
        np.testing.assert_array_equal(a, b)


def _attention_output(transpose_weight: bool):
    """The end of torch's attention: heads moved behind the sequence, merged with the batch
    for a Gemm, split again and the batch moved back in front."""
    n, heads, length, d, e = 2, 3, 4, 5, 15
    nodes = [
        helper.make_node("Transpose", ["h"], ["ht"], perm=[2, 0, 1, 3]),
        helper.make_node("Reshape", ["ht", "s_rows"], ["rows"]),
        helper.make_node("Gemm", ["rows", "w", "b"], ["y"], transB=int(transpose_weight)),
        helper.make_node("Reshape", ["y", "s_back"], ["yb"]),
        helper.make_node("Transpose", ["yb"], ["out"], perm=[1, 0, 2]),
    ]
    w = RNG.standard_normal((e, e)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(RNG.standard_normal(e).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([length * n, e], np.int64), "s_rows"),
        numpy_helper.from_array(np.array([length, n, e], np.int64), "s_back"),
    ]
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, [n, heads, length, d])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    proto = _model(nodes, [h], [out], inits)
    return proto, {"h": RNG.standard_normal((n, heads, length, d)).astype(np.float32)}


@pytest.mark.parametrize("transpose_weight", [True, False])
def test_attention_output_moves_once(transpose_weight):
    """The Gemm between Reshapes becomes a MatMul and an Add on the unmerged axes, the
    Transpose after it moves up to the one before, and the two merge into one."""
    proto, feeds = _attention_output(transpose_weight)
    m, out = _rewritten(proto, lambda g: move_transposes(g, 18))
    activations = [n for n in m.graph if n.op_type == "Transpose" and n.inputs[0].name != "w"]
    assert len(activations) == 1 and _ops(m, "Gemm") == 0
    np.testing.assert_allclose(_run(out, feeds)[0], _run(proto, feeds)[0], rtol=1e-6, atol=1e-6)


def test_transpose_of_a_product_swaps_its_operands():
    """``Transpose(Gemm(A, B))`` (a weight gradient) is one Gemm of the swapped operands."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [6, 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [6, 3])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [3, 5])
    nodes = [
        helper.make_node("Gemm", ["a", "b"], ["g"], transA=1),
        helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 0]),
        helper.make_node("MatMul", ["gt", "d"], ["p"]),
        helper.make_node("Transpose", ["p"], ["pt"], perm=[1, 0]),
    ]
    d = helper.make_tensor_value_info("d", TensorProto.FLOAT, [4, 5])
    outs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, None) for v in ("gt", "pt")]
    proto = _model(nodes, [a, b, c, d], outs)
    m, out = _rewritten(proto, transposed_products)
    assert _ops(m, "Transpose") == 0 and _ops(m, "Gemm") == 2 and _ops(m, "MatMul") == 0
    feeds = {k: RNG.standard_normal(s).astype(np.float32) for k, s in
             (("a", (6, 4)), ("b", (6, 3)), ("c", (3, 5)), ("d", (4, 5)))}  # fmt: skip
    for x, y in zip(_run(proto, feeds), _run(out, feeds)):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)


def test_view_chain_without_a_common_refinement_stays():
    """A Reshape that neither splits nor merges the axes around it keeps its two copies."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
        helper.make_node("Reshape", ["t", "s"], ["r"]),
        helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    proto = _model(nodes, [x], [y], [numpy_helper.from_array(np.array([3, 8], np.int64), "s")])
    m = ir.from_proto(proto)
    assert compose_views(m.graph) == 0 and move_transposes(m.graph, 18) == 0
    assert [n.op_type for n in m.graph] == ["Transpose", "Reshape", "Transpose"]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_torch_attention_trains_the_same_with_fewer_copies(exporter, tmp_path, monkeypatch):
    """``nn.MultiheadAttention(batch_first=True)`` exported with a dynamic batch: the training
    and eval graphs copy fewer activations, and the losses and gradients are those of the graphs
    without the moves (up to the order of the rows in the weights' gradient sums)."""
    torch = pytest.importorskip("torch")

    from traingraph import from_torch, losses, program
    from traingraph.api import CheckpointState, Module
    from traingraph.artifacts import generate_artifacts

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(32)
            self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
            self.head = torch.nn.Linear(32, 5)

        def forward(self, x):
            h = self.norm(x)
            a, _ = self.attention(h, h, h, need_weights=False)
            return self.head((x + a).mean(1))

    torch.manual_seed(0)
    model = Block()
    proto = from_torch(model, (torch.randn(3, 7, 32),), exporter=exporter, input_names=["x"])
    trained = [n for n, _ in model.named_parameters()]
    x = RNG.standard_normal((4, 7, 32)).astype(np.float32)  # another batch size than exported
    labels = np.array([0, 3, 1, 4], np.int64)

    def build(folder):
        generate_artifacts(proto, requires_grad=trained, loss=losses.CrossEntropyLoss(),
                           artifact_directory=folder)  # fmt: skip
        copies = []
        for name in ("training_model.onnx", "eval_model.onnx"):
            graph = onnx.load(folder / name).graph
            params = {i.name for i in graph.input}
            copies.append(sum(n.op_type == "Transpose" and n.input[0] not in params
                              for n in graph.node))  # fmt: skip
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        module = Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
        module.eval()
        evaluated = float(module(x, labels))
        module.train()
        loss = float(module(x, labels))
        return copies, (loss, evaluated), {n: state.parameters[n].grad for n in trained}

    moved = build(tmp_path / "moved")
    monkeypatch.setattr(program, "move_transposes", lambda graph, opset, keep=(): 0)
    plain = build(tmp_path / "plain")
    assert all(m < p for m, p in zip(moved[0], plain[0]))  # training and eval graphs
    assert moved[1] == pytest.approx(plain[1], rel=1e-6)
    for name in trained:
        scale = np.linalg.norm(plain[2][name]) + 1e-12
        assert np.linalg.norm(moved[2][name] - plain[2][name]) / scale < 1e-5, name
