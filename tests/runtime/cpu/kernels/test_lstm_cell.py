"""An LSTM's forward and backward steps with each step's gate math in one native pass: the
cells against the float64 formulas (NaN and infinities where they fall), the rule's chains of
steps found in a training model and computed as their nodes compute them, and Module's train
steps equal with the kernels and without."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from gradcheck import adamw_artifacts, artifact_steps, assert_same_training
from torch_models import export, seeded
from traingraph.runtime.cpu import native
from traingraph.runtime.cpu.kernels import lstm_cell

pytestmark = pytest.mark.skipif(
    native.NATIVE is None or not hasattr(native.NATIVE, "lstm_cell"),
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)

STEPS, FEATURES, HIDDEN, CLASSES = 5, 4, 8, 3


class Tagger(nn.Module):
    """A bidirectional LSTM over the sequence, a Linear on its last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class LastState(Tagger):
    """The Linear on the final hidden states alone: no step's output has a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lstm(x)[1][0]
        return self.head(torch.cat([h[0], h[1]], dim=1))


class OneWay(nn.Module):
    """A one-directional LSTM, the mean of its outputs: the direction axis's size (1) is
    where shape inference loses it."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0].mean(1))


class LearnedState(Tagger):
    """Two layers from learned initial states, the final cell states in the output: the
    backward chain's last gates' and cell gradients are read beyond it."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN, num_layers=2, batch_first=True, bidirectional=True)
        self.h0 = nn.Parameter(torch.randn(4, 1, HIDDEN) * 0.1)
        self.c0 = nn.Parameter(torch.randn(4, 1, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        start = (self.h0.expand(-1, n, -1).contiguous(), self.c0.expand(-1, n, -1).contiguous())
        out, (_, c) = self.lstm(x, start)
        return self.head(out[:, -1]) + c.sum(0).sum(-1, keepdim=True)


def _artifacts(tmp_path, module=Tagger):
    return adamw_artifacts(tmp_path, export(seeded(module), torch.zeros(2, STEPS, FEATURES)))


def _graph_values(model, kernel, nodes, values):
    """What the nodes ``nodes`` of ``model`` compute for ``kernel``'s outputs from ``values``."""
    graph = model.graph
    chosen = [graph.node[i] for i in sorted(nodes)]
    read = {v for n in chosen for v in n.input}
    constants = [n for n in graph.node if n.op_type == "Constant" and n.output[0] in read]
    initializers = [t for t in graph.initializer if t.name in read]
    f = onnx.TensorProto.FLOAT
    sub = onnx.helper.make_graph(
        constants + chosen, "steps",
        [onnx.helper.make_tensor_value_info(v, f, None) for v in kernel.inputs],
        [onnx.helper.make_tensor_value_info(v, f, None) for v in kernel.outputs],
        initializer=initializers,
    )  # fmt: skip
    sub_model = onnx.helper.make_model(sub, opset_imports=model.opset_import)
    providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(sub_model.SerializeToString(), providers=providers)
    return dict(zip(kernel.outputs, session.run(kernel.outputs, values)))


def _assert_computed_as_the_graph(model, kernel, nodes, values):
    want = _graph_values(model, kernel, nodes, values)
    out: dict[str, np.ndarray] = {}
    kernel.compute(values, out, 2)
    for name in kernel.outputs:
        assert np.array_equal(np.isnan(out[name]), np.isnan(want[name])), name
        assert np.array_equal(np.isinf(out[name]), np.isinf(want[name])), name
        finite = np.isfinite(want[name])
        np.testing.assert_allclose(out[name][finite], want[name][finite], atol=2e-6, err_msg=name)


def _cell_reference(mm, piece, c_prev):
    """The cell's outputs in float64: h, c, slope, through, f."""
    gates = mm.astype(np.float64) + piece
    with np.errstate(over="ignore", invalid="ignore"):
        i, o, f = (1 / (1 + np.exp(-gates[:, k * HIDDEN:(k + 1) * HIDDEN])) for k in range(3))
        g = np.tanh(gates[:, 3 * HIDDEN:])
        fc, ig = f * c_prev, i * g
        c = fc + ig
        h = o * np.tanh(c)
        slope = np.concatenate([ig * (1 - i), h * (1 - o), fc * (1 - f), i - ig * g], axis=1)
        return h, c, slope, o - h * np.tanh(c), f


@pytest.mark.parametrize("threads", [1, 2])
def test_cell_computes_the_gate_math(threads):
    rng = np.random.default_rng(0)
    mm = (rng.standard_normal((2, 4 * HIDDEN, 16)) * 3).astype(np.float32)
    piece = rng.standard_normal(mm.shape).astype(np.float32)
    c_prev = rng.standard_normal((2, HIDDEN, 16)).astype(np.float32)
    mm[0, :4, 0] = [np.nan, np.inf, -np.inf, 30.0]  # into i, the Sigmoid's ends
    mm[1, 3 * HIDDEN:3 * HIDDEN + 4, 1] = [np.inf, -np.inf, 1e-9, -0.01]  # into g, Tanh's
    c_prev[1, 5, 2] = np.inf
    outs = [np.empty(s, np.float32) for s in [c_prev.shape] * 2 + [mm.shape] + [c_prev.shape] * 2]
    native.NATIVE.lstm_cell(mm, piece, c_prev, *outs, HIDDEN * 16, threads)
    for got, want in zip(outs, _cell_reference(mm, piece, c_prev)):
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=2e-7)
    with pytest.raises(ValueError, match="slope has"):
        native.NATIVE.lstm_cell(mm, piece, c_prev, outs[0], outs[1], outs[0], outs[3], outs[4],
                                HIDDEN * 16, 1)  # fmt: skip


def test_cell_reads_its_piece_among_every_steps_columns():
    rng = np.random.default_rng(1)
    mm = rng.standard_normal((2, 4 * HIDDEN, 5)).astype(np.float32)
    projection = rng.standard_normal((2, 4 * HIDDEN, 3 * 5)).astype(np.float32)
    c_prev = rng.standard_normal((2, HIDDEN, 5)).astype(np.float32)
    shapes = [c_prev.shape] * 2 + [mm.shape] + [c_prev.shape] * 2
    strided, whole = ([np.empty(s, np.float32) for s in shapes] for _ in range(2))
    native.NATIVE.lstm_cell(mm, projection, c_prev, *strided, HIDDEN * 5, 2, 5, 15, 5)
    piece = np.ascontiguousarray(projection[:, :, 5:10])
    native.NATIVE.lstm_cell(mm, piece, c_prev, *whole, HIDDEN * 5, 2)
    for got, want in zip(strided, whole):
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="piece has"):
        native.NATIVE.lstm_cell(mm, projection, c_prev, *strided, HIDDEN * 5, 2, 5, 15, 15)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_dy", [True, False])
def test_backward_cell_computes_the_gradient_math(threads, with_dy):
    rng = np.random.default_rng(2)
    width = 1024  # 2 x HIDDEN x 1024 elements: above the size from which threads share them
    mm, dy, dc_next, f_next, through = (
        rng.standard_normal((2, HIDDEN, width)).astype(np.float32) for _ in range(5)
    )
    slope = rng.standard_normal((2, 4 * HIDDEN, width)).astype(np.float32)
    mm[0, 1, :3] = [np.nan, np.inf, -np.inf]
    f_next[1, 2, 4] = np.inf
    dc = np.empty_like(mm)
    dgates = np.empty_like(slope)
    columns = np.zeros((2, 4 * HIDDEN, 3 * width), np.float32)
    native.NATIVE.lstm_cell_grad(
        mm, dy if with_dy else None, dc_next, f_next, through, slope, dc, dgates, columns,
        HIDDEN * width, width, 3 * width, 2 * width, threads,
    )  # fmt: skip
    with np.errstate(invalid="ignore"):
        dh = mm.astype(np.float64) + (dy if with_dy else 0)
        want_dc = dh * through + dc_next.astype(np.float64) * f_next
        want = np.concatenate([want_dc, dh, want_dc, want_dc], axis=1) * slope
    for got, expected in ((dc, want_dc), (dgates, want), (columns[:, :, 2 * width :], want)):
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-6)
    assert not columns[:, :, : 2 * width].any()
    with pytest.raises(ValueError, match="columns has"):
        native.NATIVE.lstm_cell_grad(
            mm, dy, dc_next, f_next, through, slope, dc, dgates, columns, HIDDEN * width,
            width, 2 * width, width, 1,
        )  # fmt: skip


def test_the_rules_steps_are_found_and_computed_as_the_graph(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    found = lstm_cell.split_lstm_forwards(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    # the steps and the Split of the input projection into them
    assert len(kernel.steps) == STEPS and len(nodes) == 19 * STEPS + 1
    assert kernel.projection is not None and kernel.places == tuple(range(STEPS))
    # the chain's nodes alone, on inputs at an initialized LSTM's scale, with a NaN and an
    # infinity in two steps' columns of the projection
    rng = np.random.default_rng(0)
    values = {kernel.r: rng.uniform(-1, 1, (2, 4 * HIDDEN, HIDDEN)).astype(np.float32) / 3}
    for v in kernel.inputs[1:3]:
        values[v] = rng.standard_normal((2, HIDDEN, 3)).astype(np.float32)
    projection = rng.standard_normal((2, 4 * HIDDEN, 3 * STEPS)).astype(np.float32)
    projection[0, 1, 2 * 3] = np.nan
    projection[1, 3 * HIDDEN, 3 * 3 + 2] = np.inf
    values[kernel.projection] = projection
    _assert_computed_as_the_graph(model, kernel, nodes, values)


@pytest.mark.parametrize("module", [Tagger, LastState])
def test_the_rules_backward_steps_are_found_and_computed_as_the_graph(tmp_path, module):
    model = onnx.load(_artifacts(tmp_path, module) / "training_model.onnx")
    found = lstm_cell.split_lstm_backwards(model)
    assert len(found) == 1
    kernel, nodes = found[0]
    # every step but the last in time (the first to run, which reads no MatMul), and the
    # Concat of all steps' gates' gradients
    assert len(kernel.steps) == STEPS - 1
    assert all((s.dy is not None) == (module is Tagger) for s in kernel.steps)
    assert len(nodes) == (7 if module is Tagger else 6) * (STEPS - 1) + 1
    assert kernel.columns is not None and kernel.places == tuple(range(STEPS - 1, -1, -1))
    rng = np.random.default_rng(0)
    values = {
        v: rng.standard_normal((2, HIDDEN, 3)).astype(np.float32) for v in kernel.inputs
    }
    values[kernel.r] = rng.uniform(-1, 1, (2, HIDDEN, 4 * HIDDEN)).astype(np.float32) / 3
    for v in [kernel.steps[0].back] + [s.slope for s in kernel.steps]:
        values[v] = rng.standard_normal((2, 4 * HIDDEN, 3)).astype(np.float32)
    values[kernel.steps[1].slope][0, 1, 0] = np.nan
    values[kernel.steps[2].through][1, 3, 2] = np.inf
    _assert_computed_as_the_graph(model, kernel, nodes, values)


def test_intermediate_values_read_elsewhere_stay_in_the_graph(tmp_path):
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    _, nodes = lstm_cell.split_lstm_forwards(model)[0]
    tanh = next(model.graph.node[i] for i in sorted(nodes) if model.graph.node[i].op_type == "Tanh")
    model.graph.node.append(onnx.helper.make_node("Identity", [tanh.output[0]], ["copy"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("copy", 1, None))
    found = lstm_cell.split_lstm_forwards(model)
    assert all(tanh.output[0] not in k.outputs for k, _ in found)
    assert all(len(k.steps) < STEPS for k, _ in found)


@pytest.mark.parametrize(
    ("module", "kernel", "kind"),
    [
        (Tagger, "lstm_forward", lstm_cell.LstmForward),
        (Tagger, "lstm_backward", lstm_cell.LstmBackward),
        (LastState, "lstm_backward", lstm_cell.LstmBackward),
        (OneWay, "lstm_forward", lstm_cell.LstmForward),
        (OneWay, "lstm_backward", lstm_cell.LstmBackward),
        (LearnedState, "lstm_backward", lstm_cell.LstmBackward),
    ],
)
def test_module_trains_as_the_graph_does(tmp_path, module, kernel, kind):
    directory = _artifacts(tmp_path, module)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, STEPS, FEATURES)).astype(np.float32), rng.integers(0, 3, n))
        for n in (4, 4, 3)  # the batch changes: the kernel's arrays follow it
    ]
    got = artifact_steps(directory, batches, kind)
    expected = artifact_steps(directory, batches, kind, without=kernel)
    assert_same_training(got, expected)


def test_the_recurrence_weights_shape_is_completed_from_one_axis():
    # R^T of a transpose's Reshape to -1 leaves its gates' axis open; R may leave H open
    assert lstm_cell._recurrence_shape([2, 256, None], 1, 4) == (2, 256, 1024)
    assert lstm_cell._recurrence_shape([1, None, 8], 2, 4) == (1, 32, 8)
    assert lstm_cell._recurrence_shape([2, 1024, None], 2, 4) == (2, 1024, 256)
    assert lstm_cell._recurrence_shape([2, None, None], 1, 4) is None
    assert lstm_cell._recurrence_shape([None, 8, 32], 1, 4) is None
    assert lstm_cell._recurrence_shape([2, 8, 30], 1, 4) is None  # not 4H
