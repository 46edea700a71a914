"""Convs with parameter filters in onnxruntime's blocked (NCHWc) kernels on the CPU
(traingraph.runtime.rewrites.nchwc): the rewrite against the plain Conv, what stays, and Module's
train steps with and without it."""

from __future__ import annotations

import dataclasses
import platform

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from gradcheck import assert_same_training, train_steps
from torch_models import export, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.cpu import kernels
from traingraph.runtime.rewrites import nchwc
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="onnxruntime's NCHWc convolution kernels exist on x86-64 only",
)


def _conv_model(x_shape, w_shape, bias, constant_filter=False, **attrs):
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    infos = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    initializers = []
    if constant_filter:
        w = np.random.default_rng(1).standard_normal(w_shape).astype(np.float32)
        initializers.append(numpy_helper.from_array(w, "w"))
    else:
        infos.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape))
    if bias:
        infos.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, w_shape[:1]))
    graph = helper.make_graph(
        [helper.make_node("Conv", inputs, ["y"], **attrs)], "conv", infos,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _blocked(model):
    """Whether the pass rewrote ``model`` (its shapes inferred), and the model it left."""
    ir_model = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(model))
    modified = nchwc.ConvsAsNchwc()(ir_model).modified
    return modified, ir.serde.serialize_model(ir_model)


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})[0]


@pytest.mark.parametrize(
    "x_shape, w_shape, bias, attrs",
    [
        ((4, 16, 12, 12), (16, 16, 3, 3), False, {"pads": [1, 1, 1, 1]}),
        ((4, 16, 12, 12), (32, 16, 3, 3), True, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
        ((4, 3, 10, 10), (16, 3, 3, 3), True, {"pads": [1, 1, 1, 1]}),
        ((4, 1, 14, 14), (6, 1, 5, 5), True, {}),
        ((4, 6, 9, 9), (16, 6, 5, 5), True, {}),
        ((2, 32, 9, 9), (32, 1, 3, 3), False, {"group": 32, "pads": [1, 1, 1, 1]}),
        ((2, 16, 11, 11), (16, 16, 3, 3), True, {"dilations": [2, 2]}),
        ((None, 16, 8, 8), (16, 16, 3, 3), True, {"pads": [1, 1, 1, 1]}),
    ],
    ids=["3x3", "strided-bias", "rgb", "lenet1", "lenet2", "depthwise", "dilated", "open-batch"],
)
def test_the_blocked_form_computes_the_conv(x_shape, w_shape, bias, attrs):
    model = _conv_model(list(x_shape), list(w_shape), bias, **attrs)
    modified, rewritten = _blocked(model)
    assert modified
    ops = [(n.domain, n.op_type) for n in rewritten.graph.node]
    assert (nchwc.DOMAIN, "Conv") in ops and ("", "Conv") not in ops
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal([d or 3 for d in x_shape]).astype(np.float32),
        "w": rng.standard_normal(w_shape).astype(np.float32),
        "b": rng.standard_normal(w_shape[:1]).astype(np.float32),
    }
    want = _run(model, feeds)
    np.testing.assert_allclose(_run(rewritten, feeds), want, rtol=1e-4, atol=1e-4)
    # new filter values on the next run: the reordering is in the graph
    feeds["w"] = rng.standard_normal(w_shape).astype(np.float32)
    np.testing.assert_allclose(_run(rewritten, feeds), _run(model, feeds), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "w_shape, constant", [((16, 16, 1, 1), False), ((16, 16, 3, 3), True)],
    ids=["pointwise", "constant-filter"],
)  # fmt: skip
def test_pointwise_and_constant_filter_convs_stay(w_shape, constant):
    model = _conv_model([2, 16, 8, 8], list(w_shape), False, constant_filter=constant)
    modified, rewritten = _blocked(model)
    assert not modified
    assert [n.domain for n in rewritten.graph.node] == [""]


def test_a_form_that_does_not_compute_the_conv_is_refused():
    model = _conv_model([2, 16, 8, 8], [16, 16, 3, 3], True, pads=[1, 1, 1, 1])
    conv = model.graph.node[0]
    opsets = list(model.opset_import)
    form = nchwc._learn([2, 16, 8, 8], [16, 16, 3, 3], list(conv.attribute), True, opsets)
    assert form is not None
    assert nchwc._checked(form, [2, 16, 8, 8], [16, 16, 3, 3], conv, True, opsets)
    shuffled = {
        name: np.random.default_rng(0).permutation(p.ravel()).reshape(p.shape)
        for name, p in form.gathers.items()
    }
    wrong = dataclasses.replace(form, gathers=shuffled)
    assert not nchwc._checked(wrong, [2, 16, 8, 8], [16, 16, 3, 3], conv, True, opsets)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.head = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _train(directory, config, batches):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, session_config=config)
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    return train_steps(module, opt, state, batches)


def test_module_trains_the_same_with_blocked_convs(tmp_path, monkeypatch):
    artifacts.generate_artifacts(
        export(seeded(SmallCNN), torch.zeros(4, 3, 16, 16), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    calls = []
    # the 3 x 3 Convs stay in onnxruntime's segments (no Winograd kernel), to be blocked there
    no_winograd = set(kernels.names()) - {"winograd"}
    rewrite = nchwc.ConvsAsNchwc.call

    def recorded(self, model):
        calls.append(rewrite(self, model).modified)
        return ir.passes.PassResult(model, modified=calls[-1])

    monkeypatch.setattr(nchwc.ConvsAsNchwc, "call", recorded)
    blocked = _train(tmp_path, SessionConfig(native_kernels=no_winograd), batches)
    assert any(calls)
    plain = _train(tmp_path, SessionConfig(specialize=False), batches)
    assert_same_training(blocked, plain, one_scale=True)


def test_float64_conv_stays():
    # the blocked kernels are float32 only
    model = _conv_model([2, 16, 8, 8], [16, 16, 3, 3], False, pads=[1, 1, 1, 1])
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    modified, rewritten = _blocked(model)
    assert not modified
    assert [n.domain for n in rewritten.graph.node] == [""]
