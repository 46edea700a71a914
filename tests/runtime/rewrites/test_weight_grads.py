"""The weight gradients taken as one exchanged Conv compute what the tagged nodes compute."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from torch_models import export
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program
from traingraph.runtime.rewrites import weight_grads
from traingraph.runtime.rewrites.specialize import for_cuda

BATCH = 4


@pytest.fixture(autouse=True)
def _small_weights_qualify(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's Convs are small; the weight size rule has its own test."""
    monkeypatch.setattr(weight_grads, "MIN_WEIGHT", 1)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),  # stride 1
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2),  # stride 2, the last rows out of every window
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 6, 3, stride=2, padding=1),  # stride 2, padded
        torch.nn.ReLU(),
        torch.nn.Conv2d(6, 4, 1),  # 1 x 1: stays
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 2 * 2, 5),
    )


def _program():  # type: ignore[no-untyped-def]
    program = build_program(export(_net(), torch.zeros(2, 3, 9, 9)), loss=CrossEntropyLoss())
    train = program.train_model
    for value in train.graph.input:  # the batch fixed, as a CUDA-graph step fixes it
        if value.name in program.input_names:
            value.type.tensor_type.shape.dim[0].dim_value = BATCH
    return program, train


def _exchanged(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Conv" and n.name.endswith("_exchanged") for n in model.graph.node)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    source = model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_weight_gradients_of_larger_kernels_become_exchanged_convs() -> None:
    program, train = _program()
    rewritten = onnx.load_from_string(for_cuda(train.SerializeToString()))
    assert _exchanged(train) == 0 and _exchanged(rewritten) == 3
    tagged = [n for n in rewritten.graph.node if weight_grads.KERNEL in str(n.metadata_props)]
    assert tagged, "the 1 x 1 Conv's weight gradient keeps its tagged form"
    rng = np.random.default_rng(0)
    feeds = dict(program.parameters)
    x = rng.standard_normal((BATCH, 3, 9, 9)).astype(np.float32)
    feeds.update(zip(program.input_names, (x, rng.integers(0, 5, BATCH).astype(np.int64))))
    names = [o.name for o in train.graph.output]
    for name, expected, got in zip(names, _run(train, feeds), _run(rewritten, feeds)):
        # The same sums, added in another order.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def _ir(model: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(model)


def _exchanged_in(model: ir.Model) -> int:
    return sum(n.op_type == "Conv" and (n.name or "").endswith("_exchanged") for n in model.graph)


def test_nothing_changes_without_static_shapes() -> None:
    program = build_program(export(_net(), torch.zeros(2, 3, 9, 9)), loss=CrossEntropyLoss())
    train = program.train_model
    model = _ir(train)
    assert not weight_grads.WeightGradsAsConvs()(model).modified
    assert [n.op_type for n in model.graph] == [n.op_type for n in train.graph.node]


def test_large_outputs_keep_the_unfold() -> None:
    _, train = _program()
    model = _ir(onnx.shape_inference.infer_shapes(train))
    values = [*model.graph.inputs, *(v for n in model.graph for v in n.outputs)]
    for value in values:
        dims = value.shape.dims if value.shape is not None else ()
        if len(dims) == 4 and dims[2] == 9:
            value.shape = ir.Shape([dims[0], dims[1], 100, 100])
    # The first Conv's output gradient now has 100 x 100 positions: it keeps its form; the
    # other two still qualify.
    assert weight_grads.WeightGradsAsConvs()(model).modified
    assert _exchanged_in(model) == 2


def test_small_weights_keep_the_unfold(monkeypatch: pytest.MonkeyPatch) -> None:
    _, train = _program()
    # The weights hold 8 * 3 * 9 = 216, 8 * 8 * 9 = 576 and 6 * 8 * 9 = 432 elements.
    monkeypatch.setattr(weight_grads, "MIN_WEIGHT", 433)
    model = _ir(onnx.shape_inference.infer_shapes(train))
    assert weight_grads.WeightGradsAsConvs()(model).modified
    assert _exchanged_in(model) == 1


def test_a_region_that_reads_another_value_stays() -> None:
    """A tagged region whose outside input is not the Conv's output gradient (another pass
    rewrote it: here it reads the gradient flattened to another shape) keeps its form."""
    _, train = _program()
    model = _ir(onnx.shape_inference.infer_shapes(train))
    nodes = weight_grads._tagged_regions(model.graph)["/0/Conv"]
    made = {v for n in nodes for v in n.outputs}
    reader, index = next(
        (n, i) for n in nodes for i, v in enumerate(n.inputs)
        if v is not None and v not in made and v.name != "x" and not weight_grads._is_constant(v)
    )  # fmt: skip
    grad = reader.inputs[index]
    target = ir.Value(name="flat_target", const_value=ir.tensor(np.array([BATCH, 8, 81, 1])))
    target.shape, target.dtype = ir.Shape([4]), ir.DataType.INT64
    model.graph.register_initializer(target)
    flat = ir.node("Reshape", [grad, target], name="flat")
    flat.outputs[0].shape = ir.Shape([BATCH, 8, 81, 1])
    model.graph.insert_before(reader, flat)
    reader.replace_input_with(index, flat.outputs[0])
    weight_grads.WeightGradsAsConvs()(model)
    assert _exchanged_in(model) == 2  # the other two Convs that qualify
