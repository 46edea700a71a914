"""The onnxruntime.training-compatible artifacts and runtime, end to end against PyTorch."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from torch_models import MLP, SmallCNN, classification_data, export, seeded
from traingraph import artifacts, optim
from traingraph.api import (
    CheckpointState,
    ConstantLRScheduler,
    CosineLRScheduler,
    ExponentialLRScheduler,
    LinearLRScheduler,
    Module,
    Optimizer,
    StepLRScheduler,
)
from traingraph.errors import CheckpointError, ModelError
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.device import physical_cores
from traingraph.runtime.session import SessionConfig

STEPS = 50
BATCH = 16


def _torch_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _tg_optimizer(kind: str):
    if kind == "sgd":
        return optim.SGD(lr=0.05, momentum=0.9)
    return optim.AdamW(lr=1e-2, weight_decay=0.01)


def _artifacts(tmp_path, model, kind="adamw", **kwargs):
    onnx_model = export(model, torch.zeros(2, 20))
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=_tg_optimizer(kind),
        artifact_directory=tmp_path,
        **kwargs,
    )
    return tmp_path


def _open(directory, device="cpu"):
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx", state, directory / "eval_model.onnx", device=device
    )
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    return state, module, opt


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_mlp_matches_pytorch_for_50_steps(tmp_path, kind):
    torch_model = seeded(MLP)
    directory = _artifacts(tmp_path, seeded(MLP), kind)
    state, module, opt = _open(directory)
    torch_opt = _torch_optimizer(kind, torch_model.parameters())
    x, y = classification_data(STEPS * BATCH, 20, 5)
    module.train()
    for step in range(STEPS):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        loss = module(xb, yb)
        opt.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        expected = torch.nn.functional.cross_entropy(
            torch_model(torch.tensor(xb)), torch.tensor(yb)
        )
        expected.backward()
        torch_opt.step()
        np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-4, err_msg=f"step {step}")
    for name, p in torch_model.named_parameters():
        np.testing.assert_allclose(
            state.parameters[name].data, p.detach().numpy(), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_fused_flat_update_equals_the_optimizer_graph(tmp_path, kind):
    directory = _artifacts(tmp_path, seeded(MLP), kind)
    fused, graph = (_parameters_after(directory, 10, fused=f) for f in (True, False))
    assert fused[0].update.blocks is not None and graph[0].update.blocks is None
    for name, value in fused[1].items():
        np.testing.assert_array_equal(value, graph[1][name], err_msg=name)


def _parameters_after(
    directory, steps: int, *, fused: bool
) -> tuple[Optimizer, dict[str, np.ndarray]]:
    """The optimizer and the parameters after ``steps`` steps on fixed data."""
    x, y = classification_data(steps * BATCH, 20, 5)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    opt = Optimizer(directory / "optimizer_model.onnx", module, fused=fused)
    for step in range(steps):
        module(x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH])
        opt.step()
        module.lazy_reset_grad()
    return opt, {n: p.data for n, p in state.parameters}


@pytest.mark.parametrize("chunk", [None, 100])
def test_optimizer_without_fused_kernel_runs_one_flat_update(tmp_path, monkeypatch, chunk):
    if chunk is not None:  # chunks of 100 elements: several, some splitting a parameter
        monkeypatch.setattr("traingraph.runtime.optimizer.update.FLAT_CHUNK", chunk)
    onnx_model = export(seeded(MLP), torch.zeros(2, 20))
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.RMSProp(lr=0.01, momentum=0.9, centered=True),
        artifact_directory=tmp_path,
    )
    flat, graph = (_parameters_after(tmp_path, 5, fused=f) for f in (True, False))
    assert flat[0].graph_model.graph.name.endswith("_flat_step")
    assert not graph[0].graph_model.graph.name.endswith("_flat_step")
    # The update reads the parameters, gradients and the three RMSProp slots as five blocks,
    # each in chunks.
    layout = flat[0].update.flat
    chunks = [name for name, _, _ in layout.chunks]
    assert len(chunks) == (1 if chunk is None else -(-layout.size // chunk))
    flat_inputs = [i.name for i in flat[0].graph_model.graph.input]
    assert flat_inputs[: 2 + 2 * len(chunks)] == [
        "learning_rate", "step", *chunks, *(f"{c}_grad" for c in chunks)
    ]  # fmt: skip
    assert sorted(flat_inputs[2 + 2 * len(chunks) :]) == sorted(
        f"{c}.{kind}" for kind in layout.kinds for c in chunks
    )
    assert len(layout.kinds) == 3
    for name, value in flat[1].items():
        np.testing.assert_array_equal(value, graph[1][name], err_msg=name)


def test_flat_update_in_chunks_clips_by_the_norm_of_all_gradients(tmp_path, monkeypatch):
    """With ``clip_grad_norm`` the flat update's chunks share one global norm: the parameters
    follow the per-tensor graph's (the norm summed in another order)."""
    monkeypatch.setattr("traingraph.runtime.optimizer.update.FLAT_CHUNK", 50)
    onnx_model = export(seeded(MLP), torch.zeros(2, 20))
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2, clip_grad_norm=0.05),
        artifact_directory=tmp_path,
    )
    flat, graph = (_parameters_after(tmp_path, 5, fused=f) for f in (True, False))
    assert flat[0].update.flat is not None and len(flat[0].update.flat.chunks) > 1
    assert graph[0].update.flat is None
    for name, value in flat[1].items():
        np.testing.assert_allclose(value, graph[1][name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_returned_outputs_are_not_overwritten_by_the_next_step(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    x, y = classification_data(2 * BATCH, 20, 5)
    _, module, opt = _open(directory)
    first = module(x[:BATCH], y[:BATCH])
    kept = float(first)
    opt.step()
    module.lazy_reset_grad()
    second = module(x[BATCH:], y[BATCH:])
    assert float(first) == kept
    assert float(second) != kept


def test_resume_is_bit_identical(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    x, y = classification_data(20 * BATCH, 20, 5)

    def run(module, opt, steps):
        for step in steps:
            module(x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH])
            opt.step()
            module.lazy_reset_grad()

    state, module, opt = _open(directory)
    run(module, opt, range(20))
    uninterrupted = {n: p.data for n, p in state.parameters}

    state, module, opt = _open(directory)
    run(module, opt, range(10))
    state.properties["epoch"] = 1
    CheckpointState.save_checkpoint(state, tmp_path / "resume.ckpt", include_optimizer_state=True)
    state2 = CheckpointState.load_checkpoint(tmp_path / "resume.ckpt")
    assert state2.properties["epoch"] == 1
    module2 = Module(directory / "training_model.onnx", state2, directory / "eval_model.onnx")
    opt2 = Optimizer(directory / "optimizer_model.onnx", module2)
    run(module2, opt2, range(10, 20))
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(state2.parameters[name].data, value)


def test_gradients_accumulate_until_reset(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    state, module, _ = _open(directory)
    x, y = classification_data(BATCH, 20, 5)
    module(x, y)
    once = state.parameters["fc1.weight"].grad.copy()
    module(x, y)
    np.testing.assert_allclose(state.parameters["fc1.weight"].grad, 2 * once, rtol=1e-6)
    module.lazy_reset_grad()
    module(x, y)
    np.testing.assert_allclose(state.parameters["fc1.weight"].grad, once, rtol=1e-6)


def test_eval_export_and_parameter_buffers(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    state, module, opt = _open(directory)
    x, y = classification_data(BATCH, 20, 5)
    assert module.input_names() == ["x", "labels"]
    assert module.output_names() == ["loss"]
    module(x, y)
    opt.step()
    module.eval()
    eval_loss = module(x, y)
    assert np.isfinite(eval_loss)
    module.train()

    size = module.get_parameters_size()
    assert size == 20 * 32 + 32 + 32 * 5 + 5
    assert module.get_parameters_size(trainable_only=False) == size
    flat = module.get_contiguous_parameters()
    assert isinstance(flat, ort.OrtValue) and flat.numpy().shape == (size,)
    module.copy_buffer_to_parameters(ort.OrtValue.ortvalue_from_numpy(np.zeros(size, np.float32)))
    assert not state.parameters["fc2.bias"].data.any()
    module.copy_buffer_to_parameters(flat)
    np.testing.assert_array_equal(module.get_contiguous_parameters().numpy(), flat.numpy())

    path = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(path, ["logits"])
    exported = onnx.load(path)
    onnx.checker.check_model(exported, full_check=True)
    assert [i.name for i in exported.graph.input] == ["x"]
    logits = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    reference = seeded(MLP)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.tensor(state.parameters[name].data))
        np.testing.assert_allclose(logits, reference(torch.tensor(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_learning_rate_and_schedulers(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    _, module, opt = _open(directory)
    opt.set_learning_rate(0.5)
    assert opt.get_learning_rate() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="learning rate"):
        opt.set_learning_rate(float("nan"))
    scheduler = LinearLRScheduler(opt, warmup_step_count=2, total_step_count=4, initial_lr=1.0)
    assert opt.get_learning_rate() == 0.0
    rates = []
    for _ in range(4):
        scheduler.step()
        rates.append(opt.get_learning_rate())
    assert rates == pytest.approx([0.5, 1.0, 0.5, 0.0])
    for scheduler in (
        CosineLRScheduler(opt, warmup_step_count=1, total_step_count=3, initial_lr=0.2),
        StepLRScheduler(opt, step_size=1, gamma=0.5, initial_lr=0.2),
        ExponentialLRScheduler(opt, gamma=0.5, initial_lr=0.2),
        ConstantLRScheduler(opt, initial_lr=0.2),
    ):
        scheduler.step()
        assert opt.get_learning_rate() == pytest.approx(scheduler.lr_at(1))


def test_inputs_may_be_ortvalues(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    _, module, _ = _open(directory)
    x, y = classification_data(BATCH, 20, 5)
    as_numpy = module(x, y)
    module.lazy_reset_grad()
    as_ortvalues = module(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y))
    assert isinstance(as_ortvalues, ort.OrtValue)  # OrtValues in, OrtValues out
    assert float(as_numpy) == float(as_ortvalues.numpy())


def test_an_output_a_native_kernel_writes_is_returned_and_kept(tmp_path):
    """A model output that a native CPU kernel computes (the last Conv's, by the Winograd
    kernel), asked for as an additional output: returned as an array (an OrtValue for
    OrtValue inputs), equal to the graph's, and not overwritten by the next step."""
    from torch import nn

    from traingraph import from_torch, losses

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 3, 3, padding=1),
    )  # fmt: skip
    x = torch.randn(2, 3, 16, 16)
    artifacts.generate_artifacts(
        from_torch(net, x, output_names=["output"]), loss=losses.MSELoss(),
        optimizer=optim.SGD(lr=0.1), artifact_directory=tmp_path,
        additional_output_names=["output"],
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    kernels = module.step.runner._plan.all_kernels
    assert any("output" in k.outputs for k in kernels)  # else this test tests nothing
    images, target = x.numpy(), np.zeros((2, 3, 16, 16), np.float32)
    loss, output = module(images, target)
    kept = output.copy()
    with torch.no_grad():
        np.testing.assert_allclose(output, net(x).numpy(), rtol=1e-4, atol=1e-5)
    module.lazy_reset_grad()
    as_values = module(*(ort.OrtValue.ortvalue_from_numpy(a) for a in (images, target + 1)))
    assert all(isinstance(v, ort.OrtValue) for v in as_values)
    np.testing.assert_array_equal(as_values[1].numpy(), kept)  # the same weights, no step
    np.testing.assert_array_equal(output, kept)  # the first call's array stays as it was


def test_misuse_raises_clear_errors(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP), nominal_checkpoint=True)
    nominal = CheckpointState.load_checkpoint(directory / "nominal_checkpoint")
    module = Module(directory / "training_model.onnx", nominal)
    x, y = classification_data(BATCH, 20, 5)
    with pytest.raises(CheckpointError, match="nominal"):
        module(x, y)
    real = CheckpointState.load_checkpoint(directory / "checkpoint")
    flat = np.concatenate([p.data.reshape(-1) for _, p in real.parameters])
    module.copy_buffer_to_parameters(flat, trainable_only=False)
    assert np.isfinite(module(x, y))

    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    no_eval = Module(directory / "training_model.onnx", state)
    with pytest.raises(ModelError, match="no eval model"):
        no_eval.eval()
    with pytest.raises(ModelError, match="takes 2"):
        no_eval(x)
    with pytest.raises(ModelError, match="dtype"):
        no_eval(x.astype(np.float64), y)
    with pytest.raises(ModelError, match="shape"):
        no_eval(x[:, :3], y)
    with pytest.raises(ModelError, match="unknown input"):
        no_eval({"x": x, "label": y})
    with pytest.raises(CheckpointError):
        CheckpointState.load_checkpoint(tmp_path / "missing")


def test_batchnorm_cnn_trains_and_updates_running_stats(tmp_path):
    torch_model = seeded(SmallCNN)
    onnx_model = export(seeded(SmallCNN), torch.zeros(2, 1, 8, 8), training=True)
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    state, module, opt = _open(tmp_path)
    # Tracing in training mode ran one forward pass, which moved the exported running stats.
    with torch.no_grad():
        torch_model.bn.running_mean.copy_(torch.tensor(state.parameters["bn.running_mean"].data))
        torch_model.bn.running_var.copy_(torch.tensor(state.parameters["bn.running_var"].data))
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 8).astype(np.int64)
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        expected = torch.nn.functional.cross_entropy(torch_model(torch.tensor(x)), torch.tensor(y))
        expected.backward()
        torch_opt.step()
        np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-4)
    np.testing.assert_allclose(
        state.parameters["bn.running_mean"].data,
        torch_model.bn.running_mean.numpy(),
        rtol=1e-4,
        atol=1e-6,
    )
    module.eval()
    torch_model.eval()
    x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.int64)
    expected = torch.nn.functional.cross_entropy(torch_model(torch.tensor(x)), torch.tensor(y))
    np.testing.assert_allclose(float(module(x, y)), expected.item(), rtol=1e-4)


def test_contiguous_buffer_of_the_wrong_size_is_refused(tmp_path):
    directory = _artifacts(tmp_path, seeded(MLP))
    _, module, _ = _open(directory)
    trainable = module.get_parameters_size()
    with pytest.raises(ModelError, match="elements"):
        module.copy_buffer_to_parameters(np.zeros(trainable + 1, np.float32), trainable_only=False)
    with pytest.raises(ModelError, match="elements"):
        module.copy_buffer_to_parameters(np.zeros(trainable - 1, np.float32))


@pytest.mark.parametrize(
    ("config", "spin", "stop"),
    [
        ({}, "1", "1"),
        ({"spin_between_runs": True}, "1", "0"),
        ({"allow_spinning": False}, "0", "1"),
        ({"extra": {"session.force_spinning_stop": "0"}}, "1", "0"),
    ],
)
def test_workers_spin_within_a_run_and_stop_when_it_returns(config, spin, stop):
    options = SessionConfig(**config).session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == spin
    assert options.get_session_config_entry("session.force_spinning_stop") == stop


def test_thread_counts():
    # onnxruntime's default (one per physical core) unless given; the native kernels use as
    # many (the physical cores, not the hardware threads)
    cores = physical_cores()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= cores <= usable
    assert SessionConfig().session_options().intra_op_num_threads == 0
    assert SessionConfig(intra_op_threads=3).session_options().intra_op_num_threads == 3
    assert conv_grads.default_threads(0) == cores and conv_grads.default_threads(3) == 3
