"""Strided convolutions' input gradients finished natively (runtime/cpu/kernels/col2im.py): the
kernel
against onnxruntime's Col2Im, the match on a residual block and on an unpadded stride-1 Conv,
and Module's train steps against the graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from gradcheck import artifact_steps, assert_same_training
from torch_models import export, residual_artifacts, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import batch_norm, col2im, conv_grads
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE

NO_COLUMN_SUMS = "col2im"

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def _onnxruntime_col2im(cols, image, kernel, strides, pads, dilations):
    graph = helper.make_graph(
        [helper.make_node("Col2Im", ["cols", "image", "block"], ["y"], strides=strides,
                          pads=pads, dilations=dilations)],
        "col2im",
        [helper.make_tensor_value_info("cols", TensorProto.FLOAT, list(cols.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(image, np.int64), "image"),
         numpy_helper.from_array(np.array(kernel, np.int64), "block")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"cols": cols})[0]


GEOMETRIES = {
    # image, kernel, strides, pads (begin, end), dilations
    "resnet-strided": ((16, 16), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    "shortcut-1x1": ((16, 16), (1, 1), (2, 2), (0, 0, 0, 0), (1, 1)),
    "lenet-5x5": ((12, 12), (5, 5), (1, 1), (0, 0, 0, 0), (1, 1)),
    "padded-stride-1": ((9, 7), (3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    "odd-width": ((11, 13), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    "wide-rows": ((40, 70), (3, 3), (2, 2), (1, 1, 0, 0), (1, 1)),
    "stride-3": ((11, 9), (3, 2), (3, 2), (1, 0, 2, 1), (2, 1)),
    "uneven": ((7, 13), (3, 3), (1, 3), (2, 1, 0, 2), (1, 2)),
}


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_onnxruntime(geometry, threads):
    (h, w), (kh, kw), (s0, s1), pads, (d0, d1) = geometry
    oh = (h + pads[0] + pads[2] - d0 * (kh - 1) - 1) // s0 + 1
    ow = (w + pads[1] + pads[3] - d1 * (kw - 1) - 1) // s1 + 1
    rng = np.random.default_rng(0)
    n, c = 3, 5
    cols = rng.standard_normal((n, c * kh * kw, oh * ow)).astype(np.float32)
    want = _onnxruntime_col2im(cols, (h, w), (kh, kw), (s0, s1), pads, (d0, d1))
    term = (cols, (kh, kw), (oh, ow), (s0, s1), pads[:2], (d0, d1))
    out = np.full((n, c, h, w), np.nan, np.float32)
    NATIVE.col2im_sum(out, [term], [], None, threads)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)

    # with two addends, a second term and the Relu mask of a gate
    a, b, gate = (rng.standard_normal(out.shape).astype(np.float32) for _ in range(3))
    gate[0, 0, 0, :2] = 0.0  # not above 0: masked
    NATIVE.col2im_sum(out, [term, term], [a, b], gate, threads)
    np.testing.assert_allclose(out, np.where(gate > 0, a + b + 2 * want, 0), rtol=1e-5, atol=1e-5)


def test_kernel_refuses_arrays_it_cannot_take():
    kernel = NATIVE.col2im_sum
    out = np.zeros((2, 3, 8, 8), np.float32)
    cols = np.zeros((2, 3 * 9, 16), np.float32)
    term = (cols, (3, 3), (4, 4), (2, 2), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"cols \[2, 27, 16\] with kernel \(3, 3\), grid \(4, 5\)"):
        kernel(out, [(cols, (3, 3), (4, 5), (2, 2), (1, 1), (1, 1))], [], None, 1)
    with pytest.raises(ValueError, match=r"addend \[2, 3, 8, 7\] does not have out's shape"):
        kernel(out, [term], [np.zeros((2, 3, 8, 7), np.float32)], None, 1)
    with pytest.raises(ValueError, match="gate is not float32"):
        kernel(out, [term], [], np.zeros(out.shape), 1)
    with pytest.raises(ValueError, match="out is read-only"):
        readonly = out.copy()
        readonly.flags.writeable = False
        kernel(readonly, [term], [], None, 1)
    with pytest.raises(TypeError):
        kernel(out, [(cols, (3, 3))], [], None, 1)


def test_a_strided_block_is_finished_with_its_sum(tmp_path):
    model = onnx.load(residual_artifacts(tmp_path) / "training_model.onnx")
    written, found = col2im.split_col2ims(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    # the block's input gradient: its two strided Convs' ConvTransposes (3x3 and the 1x1
    # shortcut), their Sum, the stem Relu's mask product (with the mask's Cast and Greater)
    replaced = sorted(written.graph.node[i].op_type for i in nodes)
    assert replaced == ["Cast", "ConvTranspose", "ConvTranspose", "Greater", "Mul", "Sum"]
    assert sorted(t.kernel for t in kernel.terms) == [(1, 1), (3, 3)]
    assert all(t.strides == (2, 2) for t in kernel.terms)
    assert kernel.addends == () and kernel.gate is not None
    assert (kernel.channels, kernel.image) == (8, (10, 10))
    producers = {o: n for n in written.graph.node for o in n.output}
    assert all(producers[t.columns].op_type == "MatMul" for t in kernel.terms)
    # the columns are written after the model's nodes, which keep their places
    assert written.graph.node[: len(model.graph.node)] == model.graph.node[:]
    assert len(written.graph.node) == len(model.graph.node) + 5 * len(kernel.terms)

    # with the BatchNorm kernels, the stem's takes the Relu mask (it reads it anyway)
    planned, kernels = segments.find_kernels(model, [])
    (kernel, nodes), = [(k, n) for k, n in kernels if isinstance(k, col2im.Col2ImSum)]
    assert sorted(planned.graph.node[i].op_type for i in nodes) == [
        "ConvTranspose", "ConvTranspose", "Sum"
    ]  # fmt: skip
    assert kernel.gate is None
    stem = [
        k for k, _ in kernels if isinstance(k, batch_norm.BatchNormGrad) and k.scale == "bn.weight"
    ]
    assert len(stem) == 1 and stem[0].dy == kernel.out and stem[0].y is not None
    plan = segments.plan_segments(planned, kernels)
    order = [k for ks in plan.kernels for k in ks]
    assert order.index(kernel) == order.index(stem[0]) - 1
    for segment in plan.segments:
        assert not any(n.op_type in ("ConvTranspose", "Col2Im") for n in segment.model.graph.node)


def test_module_trains_the_residual_block_as_the_graph_does(tmp_path):
    directory = residual_artifacts(tmp_path)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, n))
        for n in (4, 4, 3)  # the batch changes: the kernel's image follows it
    ]
    got = artifact_steps(directory, batches, col2im.Col2ImSum)
    expected = artifact_steps(directory, batches, col2im.Col2ImSum, without=NO_COLUMN_SUMS)
    assert_same_training(got, expected, one_scale=True)


class PoolNet(nn.Module):
    """LeNet's shape: an unpadded 5x5 Conv after a max-pooled one, whose input gradient is a
    ConvTranspose (its input has more positions than its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 5), nn.Conv2d(4, 6, 5)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def test_an_unpadded_conv_input_gradient_is_finished_alone(tmp_path):
    artifacts.generate_artifacts(
        export(seeded(PoolNet), torch.zeros(2, 1, 20, 20), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-3),
        artifact_directory=tmp_path,
    )
    model, grads = conv_grads.split_weight_grads(onnx.load(tmp_path / "training_model.onnx"))
    _, found = col2im.split_col2ims(model)
    assert len(found) == 1
    kernel, _ = found[0]
    assert [t.kernel for t in kernel.terms] == [(5, 5)] and [t.strides for t in kernel.terms] == [
        (1, 1)
    ]
    assert kernel.addends == ()
    rng = np.random.default_rng(2)
    batches = [
        (rng.standard_normal((n, 1, 20, 20)).astype(np.float32), rng.integers(0, 3, n))
        for n in (2, 5, 5)
    ]
    got = artifact_steps(tmp_path, batches, col2im.Col2ImSum)
    expected = artifact_steps(tmp_path, batches, col2im.Col2ImSum, without=NO_COLUMN_SUMS)
    assert_same_training(got, expected, one_scale=True)


def test_convtransposes_the_kernel_cannot_finish_stay():
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("ConvTranspose", ["g", "w", "b"], ["with_bias"], strides=[2, 2]),
         helper.make_node("ConvTranspose", ["g", "w"], ["padded_out"], strides=[2, 2],
                          output_padding=[1, 1])],
        "g",
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 4, 5, 5])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
         for n in ("with_bias", "padded_out")],
        [weight, bias],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    _, found = col2im.split_col2ims(model)
    # a bias is left to the graph; the one with output padding is finished (its Col2Im fits)
    assert [(k.out, k.image) for k, _ in found] == [("padded_out", (12, 12))]


def test_a_failed_segment_runs_the_graph_without_the_columns():
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["unread"]), helper.make_node("Abs", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph)
    assert [n.op_type for n in segments._without_unread(model).graph.node] == ["Abs"]
    assert len(model.graph.node) == 2  # the model given is left as it was
