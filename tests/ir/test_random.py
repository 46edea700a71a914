"""Training-mode Dropout lowered to a counter-based hash (traingraph.ir.random)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from traingraph.program import build_program

SHAPE = (64, 1024)


def _model(ratios):
    """``x -> Dropout(r0) -> ... `` one Dropout per ratio, each output also a graph output."""
    nodes, outputs, inits = [], [], []
    source = "x"
    for i, ratio in enumerate(ratios):
        inits.append(numpy_helper.from_array(np.array(ratio, np.float32), f"r{i}"))
        nodes.append(helper.make_node("Dropout", [source, f"r{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, SHAPE))
        source = f"y{i}"
    nodes.append(helper.make_node("ReduceSum", [source], ["total"], keepdims=0))
    outputs.insert(0, helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    inits.append(numpy_helper.from_array(np.ones(SHAPE, np.float32), "w"))
    nodes.insert(0, helper.make_node("Mul", ["x0", "w"], ["x"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, SHAPE)], outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _train_session(ratios):
    program = build_program(
        _model(ratios), requires_grad=["w"],
        additional_output_names=[f"y{i}" for i in range(len(ratios))],
        loss_input_names=["total"],
    )
    ops = {n.op_type for n in program.train_model.graph.node}
    return program, ops, ort.InferenceSession(
        program.train_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )


def _run(session, x):
    feeds = {"x0": x, "w": np.ones(SHAPE, np.float32)}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def test_training_dropout_is_lowered_to_standard_ops():
    _, ops, _ = _train_session([0.1])
    assert "Dropout" not in ops
    assert {"RandomUniform", "Range", "BitShift", "Less"} <= ops


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_masks_keep_the_right_fraction_independently(ratio):
    _, _, session = _train_session([ratio])
    x = np.full(SHAPE, 2.0, np.float32)
    y = _run(session, x)["y0"]
    kept = y != 0
    keep = 1.0 - ratio
    n = kept.size
    assert abs(kept.mean() - keep) < 5 * np.sqrt(keep * (1 - keep) / n)
    np.testing.assert_allclose(y[kept], np.float32(2.0) * np.float32(1.0 / keep), rtol=1e-6)
    for a, b in ((kept[:, :-1], kept[:, 1:]), (kept[:-1], kept[1:])):  # neighbours
        both = (a & b).mean()
        assert abs(both - keep**2) < 5 * np.sqrt(keep**2 * (1 - keep**2) / a.size)


def test_each_step_and_each_dropout_draws_new_masks():
    _, _, session = _train_session([0.5, 0.5])
    x = np.ones(SHAPE, np.float32)
    first, second = _run(session, x), _run(session, x)
    assert not np.array_equal(first["y0"] != 0, second["y0"] != 0)
    m0 = first["y0"] != 0
    m1_given_m0 = (first["y1"] != 0)[m0]
    assert abs(m1_given_m0.mean() - 0.5) < 0.02  # the second mask is not the first


def test_gradient_is_output_gradient_times_mask():
    _, _, session = _train_session([0.25])
    out = _run(session, np.ones(SHAPE, np.float32))
    y, grad = out["y0"], out["w_grad"]
    np.testing.assert_array_equal(grad, y)  # d(sum y)/dw = mask / (1 - p) for x0 = 1


def test_dropout_whose_mask_is_read_stays_a_dropout():
    model = _model([0.3])
    node = next(n for n in model.graph.node if n.op_type == "Dropout")
    node.output.append("mask")
    model.graph.output.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, SHAPE))
    program = build_program(model, requires_grad=["w"], loss_input_names=["total"])
    assert "Dropout" in {n.op_type for n in program.train_model.graph.node}
    onnx.checker.check_model(program.train_model, full_check=True)


def test_lowered_dropout_runs_under_cuda_graph_rewrites():
    """For a captured CUDA step, the seed draw becomes an input filled outside the capture
    (``dropout_from_noise``), and the shifts become divisions (the CUDA provider has no
    BitShift); the masks then follow the fed noise exactly."""
    from traingraph.runtime.cuda import dropout_from_noise, with_static_inputs
    from traingraph.runtime.rewrites.specialize import for_cuda

    program, _, _ = _train_session([0.5])
    static = with_static_inputs(program.train_model, {"x0": SHAPE})
    rewritten, noise = dropout_from_noise(static)
    rewritten = onnx.load_from_string(for_cuda(rewritten.SerializeToString()))
    ops = {n.op_type for n in rewritten.graph.node}
    assert not {"RandomUniform", "BitShift", "Dropout"} & ops
    (name, (shape, _)), = noise.items()
    session = ort.InferenceSession(rewritten.SerializeToString())
    feeds = {"x0": np.ones(SHAPE, np.float32), "w": np.ones(SHAPE, np.float32)}
    outputs = [o.name for o in session.get_outputs()]

    def mask(u):
        return session.run(None, {**feeds, name: np.full(shape, u, np.float32)})[
            outputs.index("y0")
        ] != 0

    assert np.array_equal(mask(0.25), mask(0.25))
    assert not np.array_equal(mask(0.25), mask(0.75))
    assert abs(mask(0.75).mean() - 0.5) < 0.01


def test_random_draws_read_noise_filled_outside_a_cuda_graph():
    """A captured CUDA step replays the seeds it captured: a VAE's ``RandomNormalLike`` (and
    the other draws) read uniform noise inputs instead, filled outside the capture, and
    compute the same distributions from them (normal ones by Box-Muller)."""
    from traingraph.errors import ModelError
    from traingraph.runtime.cuda import dropout_from_noise

    shape = [4096]
    nodes = [
        helper.make_node("RandomNormalLike", ["x"], ["normal"], mean=2.0, scale=3.0),
        helper.make_node("RandomUniformLike", ["x"], ["uniform"], low=-1.0, high=3.0),
        helper.make_node("RandomNormal", [], ["fixed"], shape=shape, dtype=TensorProto.DOUBLE),
        helper.make_node("Bernoulli", ["p"], ["coin"]),
    ]
    graph = helper.make_graph(
        nodes, "draws",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "p")],
        [helper.make_tensor_value_info("normal", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("uniform", TensorProto.FLOAT, shape),
         helper.make_tensor_value_info("fixed", TensorProto.DOUBLE, shape),
         helper.make_tensor_value_info("coin", TensorProto.FLOAT, shape)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten, noise = dropout_from_noise(model)
    assert not {n.op_type for n in rewritten.graph.node} & {n.op_type for n in nodes}
    assert len(noise) == 6 and all(spec == ((4096,), np.float32) for spec in noise.values())
    rng = np.random.default_rng(0)
    fed = {name: rng.random(spec[0], dtype=np.float32) for name, spec in noise.items()}
    p = np.linspace(0, 1, 4096, dtype=np.float32)
    session = ort.InferenceSession(rewritten.SerializeToString())
    feeds = {"x": np.zeros(shape, np.float32), "p": p, **fed}
    normal, uniform, fixed, coin = session.run(None, feeds)
    assert fixed.dtype == np.float64 and coin.dtype == np.float32
    for values, mean, std in ((normal, 2.0, 3.0), (fixed, 0.0, 1.0)):
        assert abs(values.mean() - mean) < 4 * std / 64 and abs(values.std() - std) < 0.1 * std
    assert uniform.min() >= -1.0 and uniform.max() < 3.0 and abs(uniform.mean() - 1.0) < 0.1
    (coin_noise,) = [v for k, v in fed.items() if k.startswith(nodes[3].name or "coin")]
    np.testing.assert_array_equal(coin, (coin_noise < p).astype(np.float32))
    with pytest.raises(ModelError, match="same samples at every step"):
        sampled = helper.make_node("Multinomial", ["x2"], ["s"], sample_size=2)
        graph = helper.make_graph(
            [sampled], "m", [helper.make_tensor_value_info("x2", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("s", TensorProto.INT32, [2, 2])],
        )  # fmt: skip
        dropout_from_noise(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
