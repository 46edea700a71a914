"""The fused CPU optimizer updates give the optimizer graph's numbers, on both backends."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime as ort
import pytest

from traingraph import optim
from traingraph.optim import build_optimizer_model, init_state
from traingraph.runtime import fused
from traingraph.runtime.fused import adamw_step, fused_update, sgd_step

# Lengths that are not multiples of any vector width, a scalar, and one under a vector.
SHAPES = {"w": (7, 5), "b": (5,), "odd": (1031,), "m": (3, 67), "s": ()}
STEPS = 4
NATIVE = pytest.mark.skipif(
    fused.BACKEND != "native",
    reason="traingraph.runtime._fusedc was not built (no C compiler at install time)",
)
BACKENDS = [pytest.param("native", marks=NATIVE), "numpy"]
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


def _graph_steps(optimizer, params, grads, lr):
    """Run the optimizer graph ``STEPS`` times; the final parameters and slots."""
    proto = build_optimizer_model(optimizer, params)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    state = init_state(optimizer, params)
    params = dict(params)
    for step in range(1, STEPS + 1):
        feeds = {"learning_rate": np.array(lr, np.float32), "step": np.array(step, np.int64)}
        feeds.update(params)
        feeds.update({f"{n}_grad": grads[step - 1][n] for n in params})
        feeds.update(state)
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        params = {n: outputs[f"{n}_out"] for n in params}
        state = {n: outputs[f"{n}_out"] for n in state}
    return params, state


def _fused_steps(optimizer, params, grads, lr, backend, threads=None):
    update = fused_update(
        optimizer.name, optimizer.hyperparameters, backend=backend, threads=threads
    )
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_matches_optimizer_graph(optimizer, backend, dtype):
    params, grads = _problem(dtype=dtype)
    # The graph takes the learning rate in float32; the runtime passes it rounded so.
    lr = float(np.float32(optimizer.lr))
    expected_params, expected_state = _graph_steps(optimizer, params, grads, lr)
    got_params, got_state = _fused_steps(optimizer, params, grads, lr, backend)
    _assert_same(got_params, expected_params)
    _assert_same(got_state, expected_state)


@NATIVE
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_native_equals_numpy_on_a_flat_block(optimizer, threads):
    """One native call over 203,531 elements (odd; shared by 3 threads in aligned ranges)
    equals the numpy update, step by step."""
    params, grads = _problem(2, shapes={"flat": (203_531,)})
    params["flat"][::7] = 0.0
    grads[1]["flat"][::5] = 0.0
    lr = float(np.float32(optimizer.lr))
    native, state_n = _fused_steps(optimizer, params, grads, lr, "native", threads)
    numpy, state_p = _fused_steps(optimizer, params, grads, lr, "numpy")
    _assert_same(native, numpy)
    _assert_same(state_n, state_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_blocks_equal_per_parameter_updates(backend):
    params, grads = _problem(1)
    update = fused_update("adamw", optim.AdamW(lr=1e-2).hyperparameters, backend=backend)
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


@NATIVE
@pytest.mark.parametrize(
    "make",
    [lambda a: a.astype(np.float16), lambda a: a[::2]],
    ids=["float16", "strided"],
)
def test_native_update_hands_other_arrays_to_numpy(make):
    """Arrays the kernel does not take (float16, non-contiguous) go to the numpy code."""
    rng = np.random.default_rng(3)
    base = [rng.standard_normal(64).astype(np.float32) for _ in range(3)]
    hyperparameters = optim.SGD(lr=0.1, momentum=0.9).hyperparameters
    results = []
    for backend in ("native", "numpy"):
        p, g, buf = (make(a) for a in base)
        update = fused_update("sgd", hyperparameters, backend=backend)
        assert update is not None
        for step in (1, 2):
            update(p, g, {"momentum_buffer": buf}, lr=0.1, step=step)
        results.append((p, buf))
    for got, expected in zip(*results):
        np.testing.assert_array_equal(got, expected, strict=True)


def test_fallback_to_numpy_without_the_extension():
    """Where the extension is missing, the numpy backend is used and gives the same numbers."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["traingraph.runtime._fusedc"] = None  # the import now fails
        import numpy as np
        from traingraph.runtime import fused
        assert fused.BACKEND == "numpy", fused.BACKEND
        p, g = np.ones(5, np.float32), np.full(5, 0.5, np.float32)
        m, v = np.zeros_like(p), np.zeros_like(p)
        fused.fused_update("adamw", {})(p, g, {"exp_avg": m, "exp_avg_sq": v}, lr=0.1, step=1)
        print(p.tolist())
        try:
            fused.fused_update("adamw", {}, backend="native")
        except ValueError as error:
            print(error)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    p, g = np.ones(5, np.float32), np.full(5, 0.5, np.float32)
    adamw_step(p, g, np.zeros_like(p), np.zeros_like(p), lr=0.1, step=1)
    printed_params, message = run.stdout.splitlines()
    assert printed_params == str(p.tolist())
    assert "native backend is not available" in message


@pytest.mark.parametrize(
    "optimizer",
    [optim.AdamW(amsgrad=True), optim.AdamW(clip_grad_norm=1.0), optim.Adam(), optim.RMSProp()],
    ids=["amsgrad", "clipping", "adam", "rmsprop"],
)
def test_no_fused_form_falls_back_to_the_graph(optimizer):
    assert fused_update(optimizer.name, optimizer.hyperparameters) is None


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be 'native' or 'numpy'; got 'c'"):
        fused_update("sgd", {}, backend="c")


def test_mismatched_arrays_are_rejected():
    p = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="exp_avg_sq has shape"):
        adamw_step(p, p.copy(), p.copy(), np.zeros(4, np.float32), lr=0.1, step=1)
    with pytest.raises(ValueError, match="needs the momentum_buffer"):
        sgd_step(p, p.copy(), None, lr=0.1, step=1, momentum=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_update_rejects_mismatched_arrays(backend):
    p = np.zeros(3, np.float32)
    adamw = fused_update("adamw", {}, backend=backend)
    sgd = fused_update("sgd", {"momentum": 0.9}, backend=backend)
    assert adamw is not None and sgd is not None
    with pytest.raises(ValueError, match=r"exp_avg_sq has shape \(4,\)"):
        adamw(p, p.copy(), {"exp_avg": p.copy(), "exp_avg_sq": np.zeros(4, np.float32)},
              lr=0.1, step=1)  # fmt: skip
    with pytest.raises(ValueError, match="needs the momentum_buffer slot; got None"):
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
