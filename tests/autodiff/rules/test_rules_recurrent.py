"""LSTM and GRU gradients (backpropagation through time).

onnxruntime's LSTM and GRU kernels are float32 only, so the checks run in float32 with a large
finite-difference step and looser tolerances.
"""


import collections

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from gradcheck import (
    add_weighted_sum_loss,
    check_model_gradient,
    compare_with_torch,
    make_op_model,
    numeric_gradient,
    session,
)
from traingraph.autodiff import build_gradient_graph
from traingraph.autodiff.context import GradContext
from traingraph.autodiff.rules.recurrent import unroll
from traingraph.errors import GradientNotImplementedError
from traingraph.ir.builder import OpBuilder

F32 = {"eps": 1e-2, "rtol": 5e-3, "atol": 1e-3}
SEQ, BATCH, INPUT, HIDDEN = 3, 2, 3, 2
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
INPUT_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def rnn_inputs(op, direction="forward", *, bias=True, h0=False, c0=False, peepholes=False,
               layout=0, seq_lens=False, seed=0):
    """The node's inputs by name, in ONNX order (None where absent)."""
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    g = GATES[op]

    def r(*shape):
        return (0.6 * rng.standard_normal(shape)).astype(np.float32)

    x_shape = (SEQ, BATCH, INPUT) if layout == 0 else (BATCH, SEQ, INPUT)
    state_shape = (d, BATCH, HIDDEN) if layout == 0 else (BATCH, d, HIDDEN)
    inputs = {
        "X": r(*x_shape),
        "W": r(d, g * HIDDEN, INPUT),
        "R": r(d, g * HIDDEN, HIDDEN),
        "B": r(d, 2 * g * HIDDEN) if bias else None,
        "sequence_lens": np.full(BATCH, SEQ, np.int32) if seq_lens else None,
        "initial_h": r(*state_shape) if h0 else None,
        "initial_c": r(*state_shape) if c0 else None,
        "P": r(d, 3 * HIDDEN) if peepholes else None,
    }
    if op != "LSTM":
        del inputs["initial_c"], inputs["P"]
    return inputs


def _symbolic_batch(model, layout):
    """Make the batch dimension of X and the initial states symbolic and re-infer shapes."""
    batch_axis = {"X": 1 - layout, "initial_h": 1 - layout, "initial_c": 1 - layout}
    for vi in model.graph.input:
        if vi.name in batch_axis:
            dim = vi.type.tensor_type.shape.dim[batch_axis[vi.name]]
            dim.ClearField("dim_value")
            dim.dim_param = "batch"
    model.graph.ClearField("value_info")
    for out in model.graph.output:
        out.ClearField("type")
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _reorder(w, order):
    chunks = w.chunk(len(order), 0)
    return torch.cat([chunks[k] for k in order])


def torch_rnn(op, names, attrs):
    """``torch.nn.LSTM`` / ``torch.nn.GRU`` loaded with the ONNX weights (torch's gate orders:
    LSTM ifgo, GRU rzn; a reverse-only ONNX node is torch's forward pass on the flipped
    sequence)."""
    direction = attrs.get("direction", "forward")
    layout = attrs.get("layout", 0)
    order = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}[op]

    def fn(*tensors):
        t = dict(zip(names, tensors))
        x = t["X"].transpose(0, 1) if layout else t["X"]
        if direction == "reverse":
            x = x.flip(0)
        d = 2 if direction == "bidirectional" else 1
        module = getattr(torch.nn, op)(INPUT, HIDDEN, bias="B" in t, bidirectional=d == 2)
        params = {}
        for k in range(d):
            suffix = "_reverse" if k else ""
            params[f"weight_ih_l0{suffix}"] = _reorder(t["W"][k], order)
            params[f"weight_hh_l0{suffix}"] = _reorder(t["R"][k], order)
            if "B" in t:
                w_bias, r_bias = t["B"][k].chunk(2)
                params[f"bias_ih_l0{suffix}"] = _reorder(w_bias, order)
                params[f"bias_hh_l0{suffix}"] = _reorder(r_bias, order)
        states = []
        for name in ("initial_h", "initial_c") if op == "LSTM" else ("initial_h",):
            s = t.get(name)
            if s is not None and layout:
                s = s.transpose(0, 1)
            states.append(s if s is not None else torch.zeros(d, x.shape[1], HIDDEN))
        state = tuple(states) if op == "LSTM" else states[0]
        y, finals = torch.func.functional_call(module, params, (x, state))
        y = y.view(SEQ, -1, d, HIDDEN).permute(0, 2, 1, 3)
        if direction == "reverse":
            y = y.flip(0)
        finals = finals if op == "LSTM" else (finals,)
        if layout:
            y = y.permute(2, 0, 1, 3)
            finals = tuple(f.transpose(0, 1) for f in finals)
        return (y, *finals)

    return fn


def check_rnn(op, inputs, attrs, *, opset=17, symbolic_batch=True, compare_torch=True, used=None):
    """Finite differences (and torch when it has the variant) on every float input, of a loss
    on the outputs at positions ``used`` (default: all of them)."""
    attrs = {"hidden_size": HIDDEN, **attrs}
    num_outputs = 3 if op == "LSTM" else 2
    model = make_op_model(
        op, inputs, attrs, const_inputs=["sequence_lens"], num_outputs=num_outputs,
        opset=opset, dynamic="none",
    )
    if symbolic_batch:
        model = _symbolic_batch(model, attrs.get("layout", 0))
    data = {k: v for k, v in inputs.items() if v is not None and k != "sequence_lens"}
    outs = session(model).run(None, data)
    used = range(num_outputs) if used is None else used
    out_names = [f"y{k}" for k in used]
    loss_model = add_weighted_sum_loss(model, out_names, [outs[k] for k in used])
    rng = np.random.default_rng(1)
    weights = {f"w_{n}": rng.uniform(0.5, 1.5, o.shape).astype(np.float32)
               for n, o in zip(out_names, (outs[k] for k in used))}
    wrt = list(data)
    analytic = check_model_gradient(loss_model, {**data, **weights}, wrt, **F32)
    if compare_torch:
        fn = torch_rnn(op, list(data), attrs)
        compare_with_torch(
            lambda *t: [fn(*t)[k] for k in used], data, wrt, analytic, weights, out_names,
            rtol=F32["rtol"], atol=F32["atol"],
        )


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("states", [(False, False), (True, True), (True, False)])
def test_lstm(direction, bias, states):
    inputs = rnn_inputs("LSTM", direction, bias=bias, h0=states[0], c0=states[1])
    check_rnn("LSTM", inputs, {"direction": direction})


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru(direction, bias, h0, linear_before_reset):
    inputs = rnn_inputs("GRU", direction, bias=bias, h0=h0)
    check_rnn(
        "GRU", inputs, {"direction": direction, "linear_before_reset": linear_before_reset},
        # torch's GRU is ONNX's linear_before_reset=1; the other variant has no torch twin.
        compare_torch=bool(linear_before_reset),
    )


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("h0", [True, False])
def test_rnn(direction, bias, h0):
    inputs = rnn_inputs("RNN", direction, bias=bias, h0=h0)
    check_rnn("RNN", inputs, {"direction": direction})


@pytest.mark.parametrize("direction", ["reverse", "bidirectional"])
@pytest.mark.parametrize("used", [(0,), (1,)])
def test_rnn_gradient_of_some_outputs(direction, used):
    inputs = rnn_inputs("RNN", direction, h0=True)
    check_rnn("RNN", inputs, {"direction": direction}, used=used)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("used", [(0,), (1,), (2,), (1, 2)])
def test_lstm_gradient_of_some_outputs(direction, used):
    # Gradients reach the steps through Y alone (a tagger), or through the final states alone.
    inputs = rnn_inputs("LSTM", direction, h0=True, c0=True)
    check_rnn("LSTM", inputs, {"direction": direction}, used=used)


@pytest.mark.parametrize("direction", ["reverse", "bidirectional"])
@pytest.mark.parametrize("used", [(0,), (1,)])
@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_gradient_of_some_outputs(direction, used, linear_before_reset):
    inputs = rnn_inputs("GRU", direction, h0=True)
    attrs = {"direction": direction, "linear_before_reset": linear_before_reset}
    check_rnn("GRU", inputs, attrs, used=used, compare_torch=bool(linear_before_reset))


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("used", [(0,), (0, 1)])
@pytest.mark.parametrize("op,lbr", [("LSTM", None), ("GRU", 1), ("GRU", 0), ("RNN", None)])
def test_float64(op, lbr, direction, layout, used):
    # onnxruntime's LSTM, GRU and RNN are float32-only and reject layout=1: onnx's reference
    # evaluator runs the gradient graph in float64, checked against torch.autograd in float64
    # (finite differences for GRU's linear_before_reset=0, which torch lacks).
    check_float64(op, lbr, direction, layout, used)


def test_float64_lstm_of_unknown_input_size():
    # The weight gradients of an input size known only at run time take two Gemms.
    check_float64("LSTM", None, "bidirectional", 0, (0,), symbolic_input=True)


def _gradient_op_counts(op, lbr, direction):
    """The op types, counted, of the gradient graph of one ``op`` node (``direction``, with an
    initial state; GRU's ``linear_before_reset`` ``lbr``) under a weighted-sum loss."""
    inputs = rnn_inputs(op, direction, h0=True)
    attrs = {"hidden_size": HIDDEN, "direction": direction}
    if lbr is not None:
        attrs["linear_before_reset"] = lbr
    model = make_op_model(op, inputs, attrs, num_outputs=2, dynamic="none")
    data = {k: v for k, v in inputs.items() if v is not None}
    outs = session(model).run(None, data)
    loss_model = add_weighted_sum_loss(model, ["y0"], outs[:1])
    grad_model = build_gradient_graph(loss_model, wrt=list(data), loss="loss")
    return collections.Counter(n.op_type for n in grad_model.graph.node)


@pytest.mark.parametrize(
    "op,lbr,per_step", [("LSTM", None, 2), ("GRU", 1, 2), ("GRU", 0, 3), ("RNN", None, 2)]
)
def test_directions_share_each_steps_ops(op, lbr, per_step):
    # Both directions of a bidirectional node run each step as one op of each kind: the
    # recurrence MatMuls are per step as many as one direction needs (forward and backward),
    # plus the same fixed count over all steps as a single direction.
    def matmuls(direction):
        ops = _gradient_op_counts(op, lbr, direction)
        return ops["MatMul"] + ops["Gemm"]

    forward, bidirectional = matmuls("forward"), matmuls("bidirectional")
    assert forward == bidirectional
    assert forward >= per_step * SEQ


@pytest.mark.parametrize("op,lbr", [("LSTM", None), ("GRU", 1), ("GRU", 0), ("RNN", None)])
def test_reverse_direction_reordered_by_gathers(op, lbr):
    # A bidirectional node's gradient takes its reverse direction's input rows, hidden states
    # and their gradients between time order and step order by one Gather each, and sums the
    # directions' input gradients by one Slice a direction: it holds as many Concat, Split and
    # ReduceSum nodes over all steps as a forward node's.
    forward = _gradient_op_counts(op, lbr, "forward")
    bidirectional = _gradient_op_counts(op, lbr, "bidirectional")
    for op_type in ("Concat", "Split", "ReduceSum"):
        assert bidirectional[op_type] == forward[op_type], op_type
    assert (forward["Gather"], bidirectional["Gather"]) == (0, 3)
    assert bidirectional["Slice"] - forward["Slice"] == 2


def check_float64(op, lbr, direction, layout, used, symbolic_input=False):
    """The float64 gradient check of ``test_float64``; ``symbolic_input`` makes the input size
    of X and W a dimension name."""
    inputs = rnn_inputs(op, direction, h0=True, c0=True, layout=layout)
    inputs = {k: None if v is None else v.astype(np.float64) for k, v in inputs.items()}
    attrs = {"hidden_size": HIDDEN, "direction": direction, "layout": layout}
    if lbr is not None:
        attrs["linear_before_reset"] = lbr
    used = used + (2,) if op == "LSTM" and len(used) > 1 else used
    num_outputs = 3 if op == "LSTM" else 2
    model = make_op_model(op, inputs, attrs, num_outputs=num_outputs, dynamic="none")
    for vi in model.graph.input if symbolic_input else ():
        if vi.name in ("X", "W"):
            vi.type.tensor_type.shape.dim[2].dim_param = "input"
    model = _symbolic_batch(model, layout)
    data = {k: v for k, v in inputs.items() if v is not None}
    outs = ReferenceEvaluator(model).run(None, data)
    out_names = [f"y{k}" for k in used]
    loss_model = add_weighted_sum_loss(model, out_names, [outs[k] for k in used])
    rng = np.random.default_rng(1)
    weights = {f"w_y{k}": rng.uniform(0.5, 1.5, outs[k].shape) for k in used}
    grad_model = build_gradient_graph(loss_model, wrt=list(data), loss="loss")
    onnx.checker.check_model(grad_model, full_check=True)
    feeds = {**data, **weights}
    loss, *grads = ReferenceEvaluator(grad_model).run(["loss", *(f"{x}_grad" for x in data)], feeds)
    got = dict(zip(data, grads))
    # The gradient graph's forward (the node's steps, rebuilt so that the gradient reads their
    # gates) computes the node's outputs.
    expected_loss = ReferenceEvaluator(loss_model).run(["loss"], feeds)[0]
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
    assert op not in {n.op_type for n in grad_model.graph.node}
    if lbr == 0:
        forward = ReferenceEvaluator(loss_model)
        for name in data:
            expected = numeric_gradient(
                lambda f: float(forward.run(["loss"], f)[0]), feeds, name, 1e-6
            )
            np.testing.assert_allclose(got[name], expected, rtol=1e-6, atol=1e-8, err_msg=name)
        return
    fn = torch_rnn(op, list(data), attrs)
    compare_with_torch(
        lambda *t: [fn(*t)[k] for k in used], data, list(data), got, weights, out_names,
        rtol=1e-9, atol=1e-12,
    )  # fmt: skip


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_without_y_output(op):
    # The replaced forward computes the final states alone where the node has no Y.
    inputs = rnn_inputs(op, "bidirectional", h0=True)
    num_outputs = 3 if op == "LSTM" else 2
    model = make_op_model(op, inputs, {"hidden_size": HIDDEN, "direction": "bidirectional"},
                          num_outputs=num_outputs, dynamic="none")  # fmt: skip
    model.graph.node[0].output[0] = ""
    del model.graph.output[0]
    data = {k: v for k, v in inputs.items() if v is not None}
    outs = session(model).run(None, data)
    used = [f"y{k}" for k in range(1, num_outputs)]
    loss_model = add_weighted_sum_loss(model, used, outs)
    rng = np.random.default_rng(1)
    weights = {f"w_{n}": rng.uniform(0.5, 1.5, o.shape).astype(np.float32)
               for n, o in zip(used, outs)}  # fmt: skip
    check_model_gradient(loss_model, {**data, **weights}, list(data), **F32)


def test_lstm_peepholes():
    # torch's LSTM has no peepholes: finite differences only.
    inputs = rnn_inputs("LSTM", "bidirectional", h0=True, c0=True, peepholes=True)
    check_rnn("LSTM", inputs, {"direction": "bidirectional"}, compare_torch=False)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("opset", [13, 26])
def test_full_sequence_lens_and_static_batch(op, opset):
    inputs = rnn_inputs(op, seq_lens=True, h0=True)
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    explicit = ["Sigmoid", "Tanh", "Tanh"] if op == "LSTM" else ["Sigmoid", "Tanh"]
    check_rnn(op, inputs, {**attrs, "activations": explicit}, opset=opset, symbolic_batch=False)


def _run_unrolled(op, inputs, attrs):
    """The node's outputs rebuilt by ``unroll`` (the node itself removed), run on onnxruntime."""
    num_outputs = 3 if op == "LSTM" else 2
    model = make_op_model(op, inputs, attrs, num_outputs=num_outputs, dynamic="none")
    m = ir.serde.deserialize_model(_symbolic_batch(model, attrs.get("layout", 0)))
    node = next(iter(m.graph))
    ctx = GradContext(OpBuilder(m.graph, 17), node, needs=())
    rebuilt = unroll(ctx, ctx.b, list(node.inputs), [True] * num_outputs)
    m.graph.outputs.clear()
    m.graph.outputs.extend(rebuilt)
    m.graph.remove(node)
    data = {k: v for k, v in inputs.items() if v is not None}
    return model, data, session(ir.serde.serialize_model(m)).run(None, data)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
def test_unrolled_forward_matches_onnx(op, direction, lbr):
    inputs = rnn_inputs(op, direction, h0=True, c0=True, peepholes=True)
    attrs = {"hidden_size": HIDDEN, "direction": direction, "linear_before_reset": lbr}
    if op == "LSTM":
        del attrs["linear_before_reset"]
    model, data, rebuilt = _run_unrolled(op, inputs, attrs)
    for original, copy in zip(session(model).run(None, data), rebuilt):
        np.testing.assert_allclose(copy, original, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_unrolled_batch_first_layout_matches_torch(op, direction):
    # onnxruntime's LSTM / GRU kernels reject layout=1, so the unrolled batch-first forward
    # (whose gradient the engine derives) is checked against torch only.
    inputs = rnn_inputs(op, direction, h0=True, c0=True, layout=1)
    attrs = {"hidden_size": HIDDEN, "direction": direction, "layout": 1}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    _, data, rebuilt = _run_unrolled(op, inputs, attrs)
    with torch.no_grad():
        expected = torch_rnn(op, list(data), attrs)(*(torch.tensor(v) for v in data.values()))
    for copy, want in zip(rebuilt, expected):
        np.testing.assert_allclose(copy, want.numpy(), rtol=1e-5, atol=1e-6)


def _refusal(op, inputs, attrs, match, *, const_inputs=("sequence_lens",), dynamic="none"):
    model = make_op_model(
        op, inputs, {"hidden_size": HIDDEN, **attrs}, const_inputs=const_inputs,
        num_outputs=2, dynamic=dynamic,
    )
    loss_model = add_weighted_sum_loss(model, ["y1"], [np.zeros((1, BATCH, HIDDEN), np.float32)])
    with pytest.raises(GradientNotImplementedError, match=match):
        build_gradient_graph(loss_model, wrt=["W"], loss="loss")


@pytest.mark.parametrize(
    "attrs,match",
    [
        ({"activations": ["Relu", "Tanh", "Tanh"]}, "activations"),
        ({"clip": 2.0}, "clip"),
        ({"input_forget": 1}, "input_forget"),
    ],
)
def test_unsupported_attributes(attrs, match):
    _refusal("LSTM", rnn_inputs("LSTM"), attrs, match)


def test_dynamic_sequence_length_is_refused():
    _refusal("GRU", rnn_inputs("GRU"), {}, "sequence length", dynamic="all")


def test_padded_sequence_lens_is_refused():
    inputs = rnn_inputs("GRU", seq_lens=True)
    inputs["sequence_lens"][0] = SEQ - 1
    _refusal("GRU", inputs, {}, "padded")


def test_run_time_sequence_lens_is_refused():
    _refusal("LSTM", rnn_inputs("LSTM", seq_lens=True), {}, "run time", const_inputs=())
