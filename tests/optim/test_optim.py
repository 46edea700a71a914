"""Every optimizer and option through the optimizer model in onnxruntime, against torch.optim.

Each case runs 20 steps with random gradients from a fixed seed (some change the learning rate
mid-way) and compares the parameters after every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch

from gradcheck import session
from traingraph.optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Optimizer,
    ParamInfo,
    RMSProp,
    build_flat_optimizer_model,
    build_optimizer_model,
    chain,
    clip_by_global_norm,
    flattenable,
    from_hyperparameters,
    init_state,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    state_slots,
    trace,
)

SHAPES = {"fc.weight": (4, 3), "fc.bias": (3,), "scale": ()}
STEPS = 20
LR_CHANGE_STEP = 10


@dataclass
class Case:
    """An optimizer, its torch equivalent and what happens to the gradients before the step."""

    id: str
    ours: Callable[[float], Optimizer]
    reference: Callable[[list[torch.Tensor], float], torch.optim.Optimizer]
    lr: float = 0.05
    new_lr: float | None = None
    grad_scale: float = 1.0
    l1: float = 0.0
    clip_value: float | None = None
    clip_norm_per_tensor: float | None = None
    clip_global_norm: float | None = None


T = torch.optim
CASES = [
    Case("sgd", SGD, T.SGD),
    Case("sgd_momentum", lambda lr: SGD(lr, momentum=0.9),
         lambda p, lr: T.SGD(p, lr, momentum=0.9), new_lr=0.01),
    Case("sgd_dampening", lambda lr: SGD(lr, momentum=0.8, dampening=0.3),
         lambda p, lr: T.SGD(p, lr, momentum=0.8, dampening=0.3)),
    Case("sgd_nesterov", lambda lr: SGD(lr, momentum=0.9, nesterov=True),
         lambda p, lr: T.SGD(p, lr, momentum=0.9, nesterov=True)),
    Case("sgd_weight_decay", lambda lr: SGD(lr, momentum=0.5, weight_decay=0.1),
         lambda p, lr: T.SGD(p, lr, momentum=0.5, weight_decay=0.1)),
    Case("adam", Adam, T.Adam, lr=0.01, new_lr=0.002),
    Case("adam_weight_decay_betas",
         lambda lr: Adam(lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
         lambda p, lr: T.Adam(p, lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), lr=0.01),
    Case("adam_amsgrad", lambda lr: Adam(lr, amsgrad=True),
         lambda p, lr: T.Adam(p, lr, amsgrad=True), lr=0.01),
    Case("adamw", AdamW, T.AdamW, lr=0.01, new_lr=0.03),
    Case("adamw_amsgrad_weight_decay", lambda lr: AdamW(lr, weight_decay=0.2, amsgrad=True),
         lambda p, lr: T.AdamW(p, lr, weight_decay=0.2, amsgrad=True), lr=0.01),
    Case("rmsprop", RMSProp, T.RMSprop, lr=0.01, new_lr=0.001),
    Case("rmsprop_momentum", lambda lr: RMSProp(lr, alpha=0.9, momentum=0.9),
         lambda p, lr: T.RMSprop(p, lr, alpha=0.9, momentum=0.9), lr=0.01),
    Case("rmsprop_centered", lambda lr: RMSProp(lr, centered=True, weight_decay=0.05, eps=1e-6),
         lambda p, lr: T.RMSprop(p, lr, centered=True, weight_decay=0.05, eps=1e-6), lr=0.01),
    Case("rmsprop_centered_momentum", lambda lr: RMSProp(lr, momentum=0.5, centered=True),
         lambda p, lr: T.RMSprop(p, lr, momentum=0.5, centered=True), lr=0.01),
    Case("adagrad", Adagrad, T.Adagrad, lr=0.1),
    Case("adagrad_decay_accumulator",
         lambda lr: Adagrad(lr, lr_decay=0.05, initial_accumulator_value=0.3, weight_decay=0.01),
         lambda p, lr: T.Adagrad(p, lr, lr_decay=0.05, initial_accumulator_value=0.3,
                                 weight_decay=0.01),
         lr=0.1, new_lr=0.3),
    Case("clip_value_sgd", lambda lr: SGD(lr, momentum=0.9, clip_grad_value=0.5),
         lambda p, lr: T.SGD(p, lr, momentum=0.9), clip_value=0.5),
    Case("clip_norm_per_tensor_sgd", lambda lr: SGD(lr, max_grad_norm_per_tensor=0.8),
         T.SGD, grad_scale=2.0, clip_norm_per_tensor=0.8),
    Case("clip_global_norm_sgd", lambda lr: SGD(lr, momentum=0.9, clip_grad_norm=1.0),
         lambda p, lr: T.SGD(p, lr, momentum=0.9), grad_scale=2.0, clip_global_norm=1.0),
    Case("clip_global_norm_adamw", lambda lr: AdamW(lr, clip_grad_norm=1.0),
         T.AdamW, lr=0.01, grad_scale=2.0, clip_global_norm=1.0),
    Case("clip_value_adamw", lambda lr: AdamW(lr, clip_grad_value=0.3),
         T.AdamW, lr=0.01, clip_value=0.3),
    Case("l1_sgd", lambda lr: SGD(lr, momentum=0.9, l1=0.01),
         lambda p, lr: T.SGD(p, lr, momentum=0.9), l1=0.01),
    Case("l1_clip_global_norm_adam", lambda lr: Adam(lr, l1=0.05, clip_grad_norm=1.5),
         T.Adam, lr=0.01, l1=0.05, clip_global_norm=1.5),
    # fine-tuning's parameter groups: no weight decay for biases and normalization weights
    Case("adamw_no_decay", lambda lr: AdamW(lr, weight_decay=0.1, no_decay=["bias", "scale"]),
         lambda p, lr: T.AdamW([{"params": p[:1]}, {"params": p[1:], "weight_decay": 0.0}], lr,
                               weight_decay=0.1), lr=0.01),
    Case("sgd_no_decay", lambda lr: SGD(lr, momentum=0.9, weight_decay=0.05, no_decay=["bias"]),
         lambda p, lr: T.SGD([{"params": [p[0], p[2]]}, {"params": p[1:2], "weight_decay": 0.0}],
                             lr, momentum=0.9, weight_decay=0.05)),
    Case("custom_chain",
         lambda lr: Optimizer("custom", lr, chain(clip_by_global_norm(1.0), trace(0.9),
                                                  scale_by_learning_rate())),
         lambda p, lr: T.SGD(p, lr, momentum=0.9), grad_scale=2.0, clip_global_norm=1.0),
]  # fmt: skip


def as_f32(lr: float) -> float:
    """The learning rate as the optimizer model sees it (a float32 input)."""
    return float(np.float32(lr))


def run_case(case: Case, dtype: type, rtol: float, opset: int = 17) -> None:
    rng = np.random.default_rng(0)
    def draw(scale: float) -> dict[str, np.ndarray]:
        return {n: np.asarray(rng.standard_normal(s) * scale, dtype) for n, s in SHAPES.items()}

    params = draw(1.0)
    grads = [draw(case.grad_scale) for _ in range(STEPS)]
    optimizer = case.ours(case.lr)
    infos = [ParamInfo(n, a.shape, a.dtype) for n, a in params.items()]
    model = build_optimizer_model(optimizer, infos, opset=opset)
    onnx.checker.check_model(model, full_check=True)
    sess = session(model)
    state = init_state(optimizer, params)
    ours = dict(params)

    tensors = [torch.tensor(a, requires_grad=True) for a in params.values()]
    reference = case.reference(tensors, as_f32(case.lr))

    for step in range(1, STEPS + 1):
        lr = case.new_lr if case.new_lr is not None and step > LR_CHANGE_STEP else case.lr
        feeds = {"learning_rate": np.array(lr, np.float32), "step": np.array(step, np.int64)}
        feeds |= ours
        feeds |= {f"{n}_grad": g for n, g in grads[step - 1].items()}
        feeds |= state
        outs = dict(zip([o.name for o in model.graph.output], sess.run(None, feeds)))
        ours = {n: outs[f"{n}_out"] for n in params}
        state = {n: outs[f"{n}_out"] for n in state}

        for group in reference.param_groups:
            group["lr"] = as_f32(lr)
        with torch.no_grad():
            for t, g in zip(tensors, grads[step - 1].values()):
                t.grad = torch.tensor(g) + case.l1 * torch.sign(t)
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_(tensors, case.clip_value)
        if case.clip_norm_per_tensor is not None:
            for t in tensors:
                torch.nn.utils.clip_grad_norm_([t], case.clip_norm_per_tensor)
        if case.clip_global_norm is not None:
            torch.nn.utils.clip_grad_norm_(tensors, case.clip_global_norm)
        reference.step()

        for (name, got), expected in zip(ours.items(), tensors):
            assert got.dtype == dtype and got.shape == SHAPES[name]
            np.testing.assert_allclose(
                got, expected.detach().numpy(), rtol=rtol, atol=rtol * 1e-2,
                err_msg=f"{case.id}: {name} after step {step}",
            )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_optimizer_matches_torch(case: Case) -> None:
    run_case(case, np.float64, rtol=1e-5)


@pytest.mark.parametrize("case_id", ["sgd_momentum", "adam", "adamw", "sgd_nesterov"])
def test_optimizer_matches_torch_float32(case_id: str) -> None:
    run_case(next(c for c in CASES if c.id == case_id), np.float32, rtol=1e-5)


@pytest.mark.parametrize("opset", [13, 18, 26])
@pytest.mark.parametrize("case_id", ["adam_amsgrad", "clip_global_norm_sgd", "rmsprop_centered"])
def test_optimizer_across_opsets(case_id: str, opset: int) -> None:
    run_case(next(c for c in CASES if c.id == case_id), np.float64, rtol=1e-5, opset=opset)


def test_model_inputs_and_outputs() -> None:
    f32 = np.dtype(np.float32)
    infos = [ParamInfo("w", (2, 3), f32), ParamInfo("b", (3,), f32)]
    model = build_optimizer_model(AdamW(amsgrad=True), infos)
    inputs = [i.name for i in model.graph.input]
    slots = [f"{p}.{kind}" for p in "wb" for kind in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
    assert inputs == ["learning_rate", "step", "w", "b", "w_grad", "b_grad", *slots]
    assert [o.name for o in model.graph.output] == ["w_out", "b_out", *(f"{s}_out" for s in slots)]
    lr, step = model.graph.input[:2]
    assert lr.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert step.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert not lr.type.tensor_type.shape.dim and not step.type.tensor_type.shape.dim
    assert {n.domain for n in model.graph.node} <= {""}
    assert model.ir_version <= onnx.IR_VERSION


def test_outputs_are_written_by_the_nodes_that_compute_them() -> None:
    """No ``Identity`` holds a new value apart and copies it into the output at the end: for
    a flat update, each would be a temporary the size of every parameter."""
    f32 = np.dtype(np.float32)
    flat = [ParamInfo("flat", (1000,), f32)]
    for optimizer in (AdamW(), SGD(momentum=0.9), RMSProp()):
        model = build_optimizer_model(optimizer, flat)
        assert not [n for n in model.graph.node if n.op_type == "Identity"], optimizer
        assert [o.name for o in model.graph.output][0] == "flat_out"


def test_state_slots_and_init_state() -> None:
    params = {"w": np.zeros((2, 2), np.float64), "s": np.zeros((), np.float64)}
    optimizer = Adagrad(initial_accumulator_value=0.25)
    slots = state_slots(optimizer, params)
    assert [(s.name, s.param, s.shape, s.init) for s in slots] == [
        ("w.sum", "w", (2, 2), 0.25),
        ("s.sum", "s", (), 0.25),
    ]
    state = init_state(optimizer, params)
    assert list(state) == ["w.sum", "s.sum"]
    np.testing.assert_array_equal(state["w.sum"], np.full((2, 2), 0.25))
    assert state["s.sum"].dtype == np.float64 and state["s.sum"].shape == ()
    assert state_slots(SGD(), params) == []
    assert [s.name for s in state_slots(RMSProp(momentum=0.9, centered=True), params)] == [
        "w.square_avg", "w.grad_avg", "s.square_avg", "s.grad_avg", "w.momentum_buffer",
        "s.momentum_buffer",
    ]  # fmt: skip


def test_no_parameters() -> None:
    model = build_optimizer_model(Adam(), [])
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["learning_rate", "step"]


def test_hyperparameters_are_recorded() -> None:
    opt = AdamW(lr=3e-4, weight_decay=0.1, clip_grad_norm=1.0)
    assert opt.name == "adamw" and opt.lr == 3e-4
    assert opt.hyperparameters == {
        "lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
        "clip_grad_norm": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(lr=-1.0), "learning rate must be non-negative"),
        (lambda: SGD(nesterov=True), "Nesterov momentum needs momentum > 0"),
        (lambda: SGD(momentum=0.9, dampening=0.1, nesterov=True), "dampening == 0"),
        (lambda: Adam(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
        (lambda: AdamW(eps=-1.0), "eps must be non-negative"),
        (lambda: RMSProp(alpha=-0.1), "alpha must be non-negative"),
        (lambda: Adagrad(lr_decay=-1.0), "lr_decay must be non-negative"),
        (lambda: SGD(clip_grad_norm=0.0), "max_norm must be positive"),
        (lambda: SGD(clip_grad_value=-1.0), "max_delta must be positive"),
    ],
)
def test_invalid_arguments(make: Callable[[], Optimizer], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_invalid_models() -> None:
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    with pytest.raises(ValueError, match="one floating-point dtype"):
        build_optimizer_model(SGD(), [ParamInfo("a", (1,), f32), ParamInfo("b", (1,), f64)])
    with pytest.raises(ValueError, match="one floating-point dtype"):
        build_optimizer_model(SGD(), [ParamInfo("a", (1,), np.dtype(np.int64))])
    with pytest.raises(ValueError, match=r"unique; \['a', 'a_grad'\] appear"):
        build_optimizer_model(SGD(), [ParamInfo("a", (1,), f32), ParamInfo("a", (2,), f32)])
    with pytest.raises(ValueError, match=r"unique; \['step'\]"):
        build_optimizer_model(SGD(), [ParamInfo("step", (1,), f32)])
    with pytest.raises(ValueError, match="opset 12 is not supported"):
        build_optimizer_model(SGD(), [ParamInfo("a", (1,), f32)], opset=12)
    twice = chain(scale_by_adam(), scale_by_adam(), scale_by_learning_rate())
    with pytest.raises(ValueError, match="state slot named 'a.exp_avg'"):
        build_optimizer_model(Optimizer("twice", 0.1, twice), [ParamInfo("a", (1,), f32)])


def test_scale_in_a_custom_chain() -> None:
    """``chain(scale(c), scale_by_learning_rate())`` steps by ``-lr * c * g``."""
    optimizer = Optimizer("scaled_sgd", 0.1, chain(scale(0.5), scale_by_learning_rate()))
    model = build_optimizer_model(optimizer, [ParamInfo("w", (3,), np.dtype(np.float64))])
    w, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.25, -1.0])
    feeds = {"learning_rate": np.array(0.25, np.float32), "step": np.array(1, np.int64)}
    (w_out,) = session(model).run(None, feeds | {"w": w, "w_grad": g})
    np.testing.assert_allclose(w_out, w - 0.25 * 0.5 * g, rtol=1e-15)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_flat_model_equals_the_per_parameter_model(case: Case) -> None:
    shapes = {"a.weight": (4, 3), "a.bias": (4,), "b": (2, 3, 2), "c": ()}
    infos = [ParamInfo(n, s, np.dtype(np.float32)) for n, s in shapes.items()]
    optimizer = case.ours(case.lr)
    reference = build_optimizer_model(optimizer, infos)
    if not flattenable(optimizer):
        with pytest.raises(ValueError, match="max_grad_norm_per_tensor"):
            build_flat_optimizer_model(optimizer, infos)
        return
    flat = build_flat_optimizer_model(optimizer, infos)
    onnx.checker.check_model(flat, full_check=True)
    assert [i.name for i in flat.graph.input] == [i.name for i in reference.graph.input]
    assert [o.name for o in flat.graph.output] == [o.name for o in reference.graph.output]
    rng = np.random.default_rng(1)
    feeds = {"learning_rate": np.array(case.lr, np.float32), "step": np.array(3, np.int64)}
    for name, shape in shapes.items():
        feeds[name] = np.asarray(rng.standard_normal(shape), np.float32)
        feeds[f"{name}_grad"] = np.asarray(rng.standard_normal(shape) * case.grad_scale, np.float32)
    for name, value in init_state(optimizer, infos).items():
        feeds[name] = np.asarray(value + np.abs(rng.standard_normal(value.shape)), np.float32)
    expected = session(reference).run(None, feeds)
    got = session(flat).run(None, feeds)
    # Elementwise updates are the same float operations; a global norm is summed in another
    # order, so it agrees to rounding.
    exact = case.clip_global_norm is None
    for name, e, g in zip([o.name for o in flat.graph.output], expected, got):
        if exact:
            np.testing.assert_array_equal(g, e, err_msg=name)
        else:
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7, err_msg=name)
    kernels = {n.op_type for n in flat.graph.node} - {"Constant", "Identity", "Reshape"}
    per_parameter = sum(n.op_type in kernels for n in reference.graph.node)
    assert sum(n.op_type in kernels for n in flat.graph.node) < per_parameter or len(infos) < 4


def test_from_hyperparameters_rebuilds_named_optimizers() -> None:
    for case in CASES:
        optimizer = case.ours(case.lr)
        again = from_hyperparameters(optimizer.name, optimizer.hyperparameters)
        if optimizer.name == "custom":
            assert again is None
            continue
        assert again is not None and again.hyperparameters == optimizer.hyperparameters
    assert from_hyperparameters("adamw", {"lr": 0.1, "unknown": 1}) is None


def test_no_decay_is_recorded_and_keeps_the_update_per_parameter() -> None:
    opt = AdamW(3e-4, weight_decay=0.1, no_decay=("bias", "LayerNorm.weight"))
    assert opt.hyperparameters["no_decay"] == ["bias", "LayerNorm.weight"]
    again = from_hyperparameters(opt.name, opt.hyperparameters)
    assert again is not None and again.hyperparameters == opt.hyperparameters
    assert not flattenable(opt) and flattenable(AdamW(3e-4, no_decay=["bias"], weight_decay=0))
    assert "no_decay" not in AdamW(3e-4).hyperparameters
    with pytest.raises(ValueError, match="no_decay must be a list of strings"):
        AdamW(3e-4, no_decay="bias")


def test_no_decay_trains_as_torch_parameter_groups(tmp_path) -> None:
    """A fine-tuning script's two parameter groups (no weight decay for biases and LayerNorm
    weights) through the artifacts and the default (fused) optimizer step, against torch."""
    from traingraph import artifacts, from_torch
    from traingraph.api import CheckpointState, Module
    from traingraph.api import Optimizer as StepOptimizer

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )
    reference = copy.deepcopy(net)
    artifacts.generate_artifacts(
        from_torch(net, torch.randn(4, 6)), loss=artifacts.LossType.MSELoss,
        optimizer=AdamW(0.05, weight_decay=0.5, no_decay=["bias", "1.weight"]),
        artifact_directory=tmp_path,
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    step = StepOptimizer(tmp_path / "optimizer_model.onnx", module)
    from traingraph.runtime.optimizer.fused import AVAILABLE

    assert (step.update.blocks is not None) == AVAILABLE  # the fused kernel, run by spans
    named = dict(reference.named_parameters())
    excluded = [p for n, p in named.items() if "bias" in n or n == "1.weight"]
    decayed = [p for n, p in named.items() if not ("bias" in n or n == "1.weight")]
    torch_opt = torch.optim.AdamW(
        [{"params": decayed}, {"params": excluded, "weight_decay": 0.0}], lr=0.05,
        weight_decay=0.5,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(5):
        x, y = rng.standard_normal((4, 6)), rng.standard_normal((4, 3))
        module(x.astype(np.float32), y.astype(np.float32))
        step.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        out = reference(torch.tensor(x).float())
        torch.nn.functional.mse_loss(out, torch.tensor(y).float()).backward()
        torch_opt.step()
    for name, param in named.items():
        np.testing.assert_allclose(
            state.parameters[name].data, param.detach().numpy(), rtol=1e-4, atol=1e-5,
            err_msg=name,
        )  # fmt: skip


def test_fused_runs_cover_the_block_with_and_without_decay() -> None:
    from traingraph.runtime.optimizer.fused import runs

    assert runs(10, [], 0.1) == [(0, 10, 0.1)]
    assert runs(10, [(2, 4), (4, 5), (8, 10)], 0.1) == [
        (0, 2, 0.1), (2, 5, 0.0), (5, 8, 0.1), (8, 10, 0.0),
    ]  # fmt: skip
    assert runs(4, [(0, 4)], 0.1) == [(0, 4, 0.0)]
