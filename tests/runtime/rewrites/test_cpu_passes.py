"""for_cpu on whole training graphs: every rewrite of cpu_passes applied in one pass (the
column sums as MatMuls, the ConvTransposes as Col2Im after a conversion to opset 18, the Convs
in the blocked layout), with the outputs of the original model."""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from benchmarks import models as benchmark_models
from torch import nn

from torch_models import export
from traingraph.losses import CrossEntropyLoss
from traingraph.program import TrainingProgram, build_program
from traingraph.runtime.rewrites import conv_transpose, nchwc
from traingraph.runtime.rewrites.specialize import for_cpu, static_shapes, transposed_geometry

BLOCKED = platform.machine().lower() in ("x86_64", "amd64")  # onnxruntime's NCHWc kernels


def _strided() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 5),
    )  # fmt: skip


def _grouped_dilated() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=2, dilation=2, groups=2), nn.ReLU(),
        nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4), nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2, dilation=2, padding=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    )  # fmt: skip


CASES = {
    "lenet": (lambda: benchmark_models.build("lenet"), (4, 1, 28, 28), 10),
    "resnet8": (lambda: benchmark_models.build("resnet8"), (4, 3, 32, 32), 10),
    "strided": (_strided, (6, 2, 8, 8), 5),
    "grouped-dilated": (_grouped_dilated, (4, 8, 16, 16), 5),
}


def _program(case: str) -> tuple[TrainingProgram, dict[str, np.ndarray]]:
    build, shape, classes = CASES[case]
    torch.manual_seed(0)
    program = build_program(export(build(), torch.zeros(*shape), training=True),
                            loss=CrossEntropyLoss())  # fmt: skip
    rng = np.random.default_rng(0)
    feeds = dict(program.parameters)
    x = rng.standard_normal(shape).astype(np.float32)
    feeds.update(zip(program.input_names, (x, rng.integers(0, classes, shape[0]))))
    names = {i.name for i in program.train_model.graph.input}
    return program, {k: v for k, v in feeds.items() if k in names}


def _run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def _col2im_count(model: onnx.ModelProto) -> int:
    """How many ConvTransposes of ``model`` (opset 17 here) become Col2Im."""
    shapes, types = static_shapes(onnx.shape_inference.infer_shapes(model).graph)
    return sum(
        transposed_geometry(n, shapes) is not None and types[n.input[0]] == onnx.TensorProto.FLOAT
        for n in model.graph.node
    )


@pytest.mark.parametrize("case", list(CASES))
def test_training_graph_rewritten_for_the_cpu_computes_the_same(case: str) -> None:
    program, feeds = _program(case)
    train = program.train_model
    assert max(o.version for o in train.opset_import if o.domain == "") == 17
    source = train.SerializeToString()
    rewritten = for_cpu(source)
    assert isinstance(rewritten, bytes) and rewritten is not source
    model = onnx.load_from_string(rewritten)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    expected_col2im = _col2im_count(train)
    assert expected_col2im >= 1
    assert ops.count(("", "Col2Im")) == expected_col2im
    transposes = [n for n in train.graph.node if n.op_type == "ConvTranspose"]
    assert ops.count(("", "ConvTranspose")) == len(transposes) - expected_col2im
    assert {o.domain: o.version for o in model.opset_import}[""] == conv_transpose.COL2IM_OPSET
    assert (nchwc.DOMAIN, "Conv") in ops or not BLOCKED
    for name, want, got in zip(
        [o.name for o in train.graph.output], _run(source, feeds), _run(rewritten, feeds)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
