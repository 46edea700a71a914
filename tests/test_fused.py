"""The fused CPU optimizer updates give the optimizer graph's numbers."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from traingraph import optim
from traingraph.optim import build_optimizer_model, init_state
from traingraph.runtime.fused import adamw_step, fused_update, sgd_step

SHAPES = {"w": (7, 5), "b": (5,)}
STEPS = 4


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


def _fused_steps(optimizer, params, grads, lr):
    update = fused_update(optimizer.name, optimizer.hyperparameters)
    assert update is not None
    state = init_state(optimizer, params)
    params = {n: p.copy() for n, p in params.items()}
    for step in range(1, STEPS + 1):
        for name in params:
            slots = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")}
            update(params[name], grads[step - 1][name], slots, lr=lr, step=step)
    return params, state


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    return params, grads


@pytest.mark.parametrize(
    "optimizer",
    [
        optim.AdamW(lr=1e-2, weight_decay=0.01),
        optim.AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
        optim.SGD(lr=0.05),
        optim.SGD(lr=0.05, momentum=0.9),
        optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        optim.SGD(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=1e-2),
    ],
    ids=["adamw", "adamw-no-decay", "sgd", "sgd-momentum", "sgd-nesterov-decay", "sgd-dampening"],
)
def test_fused_matches_optimizer_graph(optimizer):
    params, grads = _problem()
    expected_params, expected_state = _graph_steps(optimizer, params, grads, optimizer.lr)
    got_params, got_state = _fused_steps(optimizer, params, grads, optimizer.lr)
    for name in params:
        np.testing.assert_array_equal(got_params[name], expected_params[name], err_msg=name)
    for name in expected_state:
        np.testing.assert_array_equal(got_state[name], expected_state[name], err_msg=name)


def test_flat_blocks_equal_per_parameter_updates():
    params, grads = _problem(1)
    per_param = {n: p.copy() for n, p in params.items()}
    slots = {n: (np.zeros_like(p), np.zeros_like(p)) for n, p in params.items()}
    flat = np.concatenate([p.ravel() for p in params.values()])
    flat_m, flat_v = np.zeros_like(flat), np.zeros_like(flat)
    for step in range(1, STEPS + 1):
        for name, p in per_param.items():
            adamw_step(p, grads[step - 1][name], *slots[name], lr=1e-2, step=step)
        flat_grad = np.concatenate([grads[step - 1][n].ravel() for n in params])
        adamw_step(flat, flat_grad, flat_m, flat_v, lr=1e-2, step=step)
    np.testing.assert_array_equal(flat, np.concatenate([p.ravel() for p in per_param.values()]))


@pytest.mark.parametrize(
    "optimizer",
    [optim.AdamW(amsgrad=True), optim.AdamW(clip_grad_norm=1.0), optim.Adam(), optim.RMSProp()],
    ids=["amsgrad", "clipping", "adam", "rmsprop"],
)
def test_no_fused_form_falls_back_to_the_graph(optimizer):
    assert fused_update(optimizer.name, optimizer.hyperparameters) is None


def test_mismatched_arrays_are_rejected():
    p = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="exp_avg_sq has shape"):
        adamw_step(p, p.copy(), p.copy(), np.zeros(4, np.float32), lr=0.1, step=1)
    with pytest.raises(ValueError, match="needs the momentum_buffer"):
        sgd_step(p, p.copy(), None, lr=0.1, step=1, momentum=0.9)
