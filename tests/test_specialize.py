"""The CUDA rewrites of a standard model compute what the model computes (run here on the CPU)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from torch_models import SmallCNN, export, seeded
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program
from traingraph.runtime.specialize import for_cuda

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
