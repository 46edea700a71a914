"""The fused optimizer updates (the CPU's native kernel, the GPU's CUDA kernel) give the
optimizer graph's numbers bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest

from traingraph import optim
from traingraph.optim import build_optimizer_model, init_state
from traingraph.runtime.optimizer import fused
from traingraph.runtime.optimizer.fused import fused_update

# Lengths that are not multiples of any vector width, a scalar, and one under a vector.
SHAPES = {"w": (7, 5), "b": (5,), "odd": (1031,), "m": (3, 67), "s": ()}
STEPS = 4
NATIVE = pytest.mark.skipif(
    not fused.AVAILABLE,
    reason="traingraph.runtime._fusedc was not built (no C compiler at install time); the"
    " runtime then runs the optimizer graph (test_fallback_to_the_graph_without_the_extension)",
)
OPTIMIZERS = [
    pytest.param(optim.AdamW(lr=1e-2, weight_decay=0.01), id="adamw"),
    pytest.param(
        optim.AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0), id="adamw-no-decay"
    ),
    pytest.param(optim.SGD(lr=0.05), id="sgd"),
    pytest.param(optim.SGD(lr=0.05, weight_decay=1e-2), id="sgd-decay"),
    pytest.param(optim.SGD(lr=0.05, momentum=0.9), id="sgd-momentum"),
    pytest.param(optim.SGD(lr=0.05, momentum=0.9, nesterov=True), id="sgd-nesterov"),
    pytest.param(
        optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        id="sgd-nesterov-decay",
    ),
    pytest.param(optim.SGD(lr=0.05, momentum=0.5, dampening=0.3), id="sgd-dampening"),
    pytest.param(
        optim.SGD(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=1e-2),
        id="sgd-dampening-decay",
    ),
]


def _graph_steps(optimizer, params, grads, lr, steps=STEPS):
    """Run the optimizer graph ``steps`` times; the final parameters and slots."""
    proto = build_optimizer_model(optimizer, params)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    state = init_state(optimizer, params)
    params = dict(params)
    for step in range(1, steps + 1):
        feeds = {"learning_rate": np.array(lr, np.float32), "step": np.array(step, np.int64)}
        feeds.update(params)
        feeds.update({f"{n}_grad": grads[step - 1][n] for n in params})
        feeds.update(state)
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        params = {n: outputs[f"{n}_out"] for n in params}
        state = {n: outputs[f"{n}_out"] for n in state}
    return params, state


def _fused_steps(optimizer, params, grads, lr, threads=None):
    update = fused_update(optimizer.name, optimizer.hyperparameters, threads=threads)
    assert update is not None
    state = init_state(optimizer, params)
    params = {n: p.copy() for n, p in params.items()}
    for step in range(1, STEPS + 1):
        for name in params:
            slots = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")}
            update(params[name], grads[step - 1][name], slots, lr=lr, step=step)
    return params, state


def _problem(seed=0, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
    grads = [
        {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()} for _ in range(STEPS)
    ]
    return params, grads


def _assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name, strict=True)


@NATIVE
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_matches_optimizer_graph(optimizer, dtype):
    params, grads = _problem(dtype=dtype)
    # The graph takes the learning rate in float32; the runtime passes it rounded so.
    lr = float(np.float32(optimizer.lr))
    expected_params, expected_state = _graph_steps(optimizer, params, grads, lr)
    got_params, got_state = _fused_steps(optimizer, params, grads, lr)
    _assert_same(got_params, expected_params)
    _assert_same(got_state, expected_state)


@NATIVE
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_threads_on_a_flat_block_match_the_graph(optimizer, threads):
    """One call over 203,531 elements (odd; shared by 3 threads in aligned ranges) equals the
    optimizer graph, step by step, zeros included."""
    params, grads = _problem(2, shapes={"flat": (203_531,)})
    params["flat"][::7] = 0.0
    grads[1]["flat"][::5] = 0.0
    lr = float(np.float32(optimizer.lr))
    expected, expected_state = _graph_steps(optimizer, params, grads, lr)
    got, got_state = _fused_steps(optimizer, params, grads, lr, threads)
    _assert_same(got, expected)
    _assert_same(got_state, expected_state)


@NATIVE
def test_flat_blocks_equal_per_parameter_updates():
    params, grads = _problem(1)
    update = fused_update("adamw", optim.AdamW(lr=1e-2).hyperparameters)
    assert update is not None
    per_param = {n: p.copy() for n, p in params.items()}
    slots = {n: (np.zeros_like(p), np.zeros_like(p)) for n, p in params.items()}
    flat = np.concatenate([p.ravel() for p in params.values()])
    flat_m, flat_v = np.zeros_like(flat), np.zeros_like(flat)
    for step in range(1, STEPS + 1):
        for name, p in per_param.items():
            m, v = slots[name]
            update(p, grads[step - 1][name], {"exp_avg": m, "exp_avg_sq": v}, lr=1e-2, step=step)
        flat_grad = np.concatenate([grads[step - 1][n].ravel() for n in params])
        update(flat, flat_grad, {"exp_avg": flat_m, "exp_avg_sq": flat_v}, lr=1e-2, step=step)
    np.testing.assert_array_equal(flat, np.concatenate([p.ravel() for p in per_param.values()]))


def test_fallback_to_the_graph_without_the_extension(tmp_path):
    """Where the extension is missing, there is no fused update and the Optimizer runs the
    optimizer graph, with the same numbers as the fused update here."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["traingraph.runtime._fusedc"] = None  # the import now fails
        import numpy as np
        from traingraph.runtime.optimizer import fused
        assert not fused.AVAILABLE and fused.fused_update("adamw", {}) is None
        from traingraph.runtime.optimizer import OptimizerUpdate
        from traingraph.runtime.session import SessionConfig
        from traingraph.runtime.state import TrainingState
        from traingraph.runtime.device import parse_device
        from traingraph.checkpoint import CheckpointData
        from traingraph import optim
        from traingraph.optim import ParamInfo, build_optimizer_model
        rng = np.random.default_rng(0)
        params = {"w": rng.standard_normal((4, 3)).astype(np.float32),
                  "b": rng.standard_normal(3).astype(np.float32)}
        data = CheckpointData(parameters=dict(params), requires_grad={"w": True, "b": True},
                              optimizer_state={}, learning_rate=0.1)
        state = TrainingState(data, parse_device("cpu"), set())
        infos = [ParamInfo(n, p.shape, p.dtype) for n, p in params.items()]
        model = build_optimizer_model(optim.AdamW(lr=0.1), infos)
        update = OptimizerUpdate(model, state, ["w", "b"], SessionConfig())
        for name, value in params.items():
            state.grads.write(name, np.full_like(value, 0.5))
        update.apply()
        print({n: state.read(n).tolist() for n in params})
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    grads = [{n: np.full_like(p, 0.5) for n, p in params.items()}]
    expected, _ = _graph_steps(optim.AdamW(lr=0.1), params, grads, 0.1, steps=1)
    assert run.stdout.strip() == str({n: v.tolist() for n, v in expected.items()})


@pytest.mark.parametrize(
    "optimizer",
    [optim.AdamW(amsgrad=True), optim.AdamW(clip_grad_norm=1.0), optim.Adam(), optim.RMSProp()],
    ids=["amsgrad", "clipping", "adam", "rmsprop"],
)
def test_no_fused_form_falls_back_to_the_graph(optimizer):
    assert fused_update(optimizer.name, optimizer.hyperparameters) is None


@NATIVE
def test_fused_update_rejects_mismatched_arrays():
    p = np.zeros(3, np.float32)
    adamw = fused_update("adamw", {})
    sgd = fused_update("sgd", {"momentum": 0.9})
    assert adamw is not None and sgd is not None
    with pytest.raises(ValueError, match=r"exp_avg_sq has shape \(4,\)"):
        adamw(p, p.copy(), {"exp_avg": p.copy(), "exp_avg_sq": np.zeros(4, np.float32)},
              lr=0.1, step=1)  # fmt: skip
    with pytest.raises(ValueError, match="needs the momentum_buffer slot"):
        sgd(p, p.copy(), {}, lr=0.1, step=1)


@NATIVE
def test_native_kernel_errors_name_what_was_received():
    native = fused._native
    assert native is not None
    p = np.zeros((2, 3), np.float32)
    hyper = (0.1, 1, 0.9, 0.999, 1e-8, 0.0)
    cases = [
        ((p, p.copy(), p.copy(), np.zeros((3, 2), np.float32)), ValueError,
         r"adamw: exp_avg_sq has shape \(3, 2\) and dtype float32, but param has shape \(2, 3\)"),
        ((p, p.astype(np.float64), p.copy(), p.copy()), ValueError,
         "grad has shape .* and dtype float64, but param has .* dtype float32"),
        ((p, p.copy(), np.zeros((2, 6), np.float32)[:, ::2], p.copy()), native.UnsupportedArray,
         "adamw: exp_avg is not C-contiguous"),
        ((p.astype(np.int32), p, p, p), native.UnsupportedArray,
         "adamw: param has element format 'i' of 4 bytes; the native update takes float32"),
        ((p, [0.0] * 6, p, p), native.UnsupportedArray,
         "adamw: grad must be an array with the buffer protocol .*; got list"),
    ]  # fmt: skip
    read_only = p.copy()
    read_only.flags.writeable = False
    cases.append(((read_only, p, p, p), ValueError, "adamw: param is read-only"))
    for arrays, error, message in cases:
        with pytest.raises(error, match=message):
            native.adamw(*arrays, *hyper)
    # A read-only gradient is fine: it is only read.
    native.adamw(p, read_only, p.copy(), p.copy(), *hyper)
    with pytest.raises(ValueError, match="adamw: step is the 1-based number of this step; got 0"):
        native.adamw(p, p.copy(), p.copy(), p.copy(), 0.1, 0, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(ValueError, match="sgd: momentum > 0 needs the momentum_buffer slot"):
        native.sgd(p, p.copy(), None, 0.1, 1, 0.9, 0.0, False, 0.0)
    assert issubclass(native.UnsupportedArray, TypeError)


@NATIVE
@pytest.mark.parametrize("fused_form", [True, False], ids=["fused", "graph"])
def test_bytes_held_by_the_state(fused_form):
    """Both forms write the parameters and slots in place (the fused kernel itself, the graph
    through outputs bound over its inputs, as no other node reads them): the state holds one
    copy of the parameters, the gradients and each slot kind, and the numbers are the same."""
    from traingraph.checkpoint import CheckpointData
    from traingraph.optim import ParamInfo
    from traingraph.program import describe_optimizer
    from traingraph.runtime.device import parse_device
    from traingraph.runtime.optimizer import InPlace, OptimizerUpdate
    from traingraph.runtime.session import SessionConfig
    from traingraph.runtime.state import TrainingState

    params, grads = _problem(2, shapes={"w": (7, 5), "b": (5,), "odd": (1031,)})
    optimizer = optim.SGD(lr=0.05, momentum=0.9)
    nbytes = sum(p.nbytes for p in params.values())
    data = CheckpointData(
        parameters=dict(params),
        requires_grad=dict.fromkeys(params, True),
        optimizer_state={},
        learning_rate=0.05,
    )
    state = TrainingState(data, parse_device("cpu"), set())
    infos = [ParamInfo(n, p.shape, p.dtype) for n, p in params.items()]
    model = build_optimizer_model(optimizer, infos)
    describe_optimizer(model, optimizer, infos)
    update = OptimizerUpdate(model, state, list(params), SessionConfig(), fused=fused_form)
    assert (update.blocks is not None) == fused_form
    assert update.in_place == (InPlace() if fused_form else InPlace(True, True))
    copies = 1
    for step in range(STEPS):
        state.grads.write_all(grads[step])
        update.apply()
        assert state.held_bytes() == {
            "parameters": copies * nbytes,
            "buffers": 0,
            "fixed": 0,
            "gradients": nbytes,
            "gradient_scratch": 0,
            "optimizer_slots": copies * nbytes,
        }
    expected, _ = _graph_steps(optimizer, params, grads, 0.05)
    for name, value in expected.items():
        np.testing.assert_array_equal(state.read(name), value)


@NATIVE
def test_resumed_slots_are_held_once_and_continue_the_run():
    """Slots resumed from a checkpoint are written into the state's slot block, which then
    holds them alone; the update continues the uninterrupted run bit for bit."""
    from traingraph.checkpoint import CheckpointData
    from traingraph.optim import ParamInfo
    from traingraph.program import describe_optimizer
    from traingraph.runtime.device import parse_device
    from traingraph.runtime.optimizer import OptimizerUpdate
    from traingraph.runtime.session import SessionConfig
    from traingraph.runtime.state import TrainingState

    params, grads = _problem(3, shapes={"w": (7, 5), "b": (5,)})
    optimizer = optim.AdamW(lr=1e-2, weight_decay=0.01)
    infos = [ParamInfo(n, p.shape, p.dtype) for n, p in params.items()]
    model = build_optimizer_model(optimizer, infos)
    describe_optimizer(model, optimizer, infos)
    expected, _ = _graph_steps(optimizer, params, grads, 1e-2)
    after_two, slots = _graph_steps(optimizer, params, grads, 1e-2, steps=2)
    data = CheckpointData(
        parameters=dict(after_two),
        requires_grad=dict.fromkeys(params, True),
        optimizer_state={
            n: {k: slots[f"{n}.{k}"] for k in ("exp_avg", "exp_avg_sq")} for n in params
        },
        optimizer_step=2,
        learning_rate=1e-2,
    )
    state = TrainingState(data, parse_device("cpu"), set())
    update = OptimizerUpdate(model, state, list(params), SessionConfig())
    assert state.pending_slot_values == {}
    assert state.held_bytes()["optimizer_slots"] == 2 * sum(p.nbytes for p in params.values())
    for step in range(2, STEPS):
        state.grads.write_all(grads[step])
        update.apply()
    for name, value in expected.items():
        np.testing.assert_array_equal(state.read(name), value)


def test_an_output_overwrites_its_input_only_where_every_other_reader_runs_first():
    from onnx import TensorProto, helper

    from traingraph.runtime.optimizer.update import overwritable

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["a", "g"], ["t"]),
        helper.make_node("Add", ["a", "t"], ["a_out"]),  # reads a where it writes: yes
        helper.make_node("Neg", ["b"], ["other"]),  # reads b, does not lead to b_out: no
        helper.make_node("Add", ["b", "g"], ["b_out"]),
        helper.make_node("Mul", ["c", "g"], ["c_out"]),  # c broadcast against its output: no
        helper.make_node("Identity", ["d"], ["d_out"]),  # a copy, not elementwise math: no
        helper.make_node("Mul", ["e", "g"], ["u"]),
        helper.make_node("Neg", ["u"], ["e_out"]),  # e read only by an ancestor: yes
    ]
    vector = [helper.make_tensor_value_info(n, f32, [4]) for n in ("a", "b", "d", "e", "g")]
    outs = [helper.make_tensor_value_info(f"{n}_out", f32, [4]) for n in "abcde"]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "update",
            [*vector, helper.make_tensor_value_info("c", f32, [1])],
            [*outs, helper.make_tensor_value_info("other", f32, [4])],
        )
    )
    assert overwritable(model, {n: f"{n}_out" for n in "abcde"}) == {"a", "e"}


HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
CUDA = pytest.mark.skipif(
    not HAS_CUDA,
    reason="needs a CUDA GPU and onnxruntime-gpu (the installed onnxruntime offers"
    f" {ort.get_available_providers()})",
)


def _device_steps(optimizer, params, grads, lr, spans=None):
    """Run the CUDA kernel over the concatenated ``params`` ``STEPS`` times; the final
    parameters and slots, split back per parameter (named as the graph names them)."""
    from traingraph.runtime.cuda import kernels
    from traingraph.runtime.cuda.cudart import shared_stream
    from traingraph.runtime.optimizer.device import SOURCE, device_update

    update = device_update(optimizer.name, optimizer.hyperparameters, spans, device_index=0)
    assert update is not None, kernels.unavailable_reason(SOURCE, 0)
    stream = shared_stream(0)
    assert stream is not None
    names = list(params)
    flat = np.concatenate([params[n].ravel() for n in names])
    on_device = {"param": ort.OrtValue.ortvalue_from_numpy(flat, "cuda", 0)}
    for kind in update.slot_kinds:
        on_device[kind] = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(flat), "cuda", 0)
    for step in range(1, STEPS + 1):
        g = np.concatenate([grads[step - 1][n].ravel() for n in names])
        on_device["grad"] = ort.OrtValue.ortvalue_from_numpy(g, "cuda", 0)
        addresses = {k: v.data_ptr() for k, v in on_device.items()}
        update(addresses, flat.size, flat.dtype, lr=lr, step=step, stream=stream.handle)
        stream.synchronize()

    def split(vector):
        parts, at = {}, 0
        for n in names:
            parts[n] = vector[at : at + params[n].size].reshape(params[n].shape)
            at += params[n].size
        return parts

    got = split(on_device["param"].numpy())
    slots = {}
    for kind in update.slot_kinds:
        slots.update({f"{n}.{kind}": v for n, v in split(on_device[kind].numpy()).items()})
    return got, slots


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cuda_kernel_matches_optimizer_graph(optimizer, dtype):
    """The kernel over 203,531 elements (more than one block per thread of the grid) equals
    the optimizer graph run by onnxruntime on the CPU, step by step, with zeros, infinities and
    NaN among the gradients."""
    params, grads = _problem(3, dtype=dtype, shapes={"flat": (203_531,)})
    params["flat"][::7] = 0.0
    grads[1]["flat"][::5] = 0.0
    grads[2]["flat"][[3, 11, 101]] = [np.inf, -np.inf, np.nan]
    lr = float(np.float32(optimizer.lr))
    expected, expected_state = _graph_steps(optimizer, params, grads, lr)
    got, got_state = _device_steps(optimizer, params, grads, lr)
    _assert_same(got, expected)
    _assert_same(got_state, expected_state)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_cuda_kernel_leaves_the_named_parameters_out_of_the_weight_decay(name):
    """With ``no_decay``, the kernel runs over the decayed and undecayed spans in turn, as the
    per-parameter graph decays some parameters and not others."""
    make = optim.AdamW if name == "adamw" else optim.SGD
    extra = {} if name == "adamw" else {"momentum": 0.9}
    optimizer = make(lr=1e-2, weight_decay=0.1, no_decay=["bias"], **extra)
    shapes = {"a.weight": (9, 31), "a.bias": (31,), "b.bias": (7,), "b.weight": (7, 3)}
    params, grads = _problem(4, shapes=shapes)
    spans, at = {}, 0
    for n, p in params.items():
        spans[n] = (at, at + p.size)
        at += p.size
    lr = float(np.float32(optimizer.lr))
    expected, expected_state = _graph_steps(optimizer, params, grads, lr)
    got, got_state = _device_steps(optimizer, params, grads, lr, spans)
    _assert_same(got, expected)
    _assert_same(got_state, expected_state)


def test_no_cuda_kernel_without_the_cuda_libraries(monkeypatch):
    """Where the CUDA driver or NVRTC cannot be loaded there is no kernel, and the reason says
    which library is missing (the runtime then runs the optimizer graph)."""
    from traingraph.runtime.cuda import kernels
    from traingraph.runtime.optimizer.device import SOURCE, device_update

    monkeypatch.setattr(kernels, "_driver", lambda: None)
    kernels.load.cache_clear()
    try:
        assert device_update("adamw", {}, None, device_index=0) is None
        assert "CUDA driver" in (kernels.unavailable_reason(SOURCE, 0) or "")
    finally:
        kernels.load.cache_clear()
    assert device_update("adam", {}, None, device_index=0) is None  # no one-pass form
