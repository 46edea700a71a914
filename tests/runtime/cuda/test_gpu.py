"""Training on NVIDIA GPUs through onnxruntime's CUDA execution provider.

The CUDA tests need onnxruntime-gpu and a GPU; CI has neither, so they are skipped there (the
reason names what is missing). CPU and GPU must give the same loss curve within TF32/fp32
tolerance: onnxruntime runs float32 MatMul/Gemm/Conv on TensorFloat-32 tensor cores by
default, whose products keep about 10 bits of mantissa.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import traingraph as tg
from torch_models import (
    MLP,
    RecurrentClassifier,
    ResidualNet,
    SmallCNN,
    classification_data,
    export,
    seeded,
    train_curve,
)
from traingraph import artifacts, optim
from traingraph import layers as L
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import DeviceError
from traingraph.graph import init
from traingraph.runtime.cuda import dropout_from_noise, noise_model, with_static_inputs
from traingraph.runtime.device import Device, parse_device
from traingraph.runtime.session import SessionConfig

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="needs a CUDA GPU and onnxruntime-gpu (the installed onnxruntime offers"
    f" {ort.get_available_providers()})",
)
STEPS = 20
BATCH = 32
# TF32 products (10-bit mantissa) against float32 ones, over 20 optimizer steps.
RTOL, ATOL = 2e-3, 1e-4
# AdamW normalizes each update to about lr (1e-2): where a gradient is near zero, TF32 rounding
# can flip its sign, so a parameter may move by up to lr per step in the other direction.
PARAM_ATOL = 2e-2


def _static_export(model: torch.nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """``model`` in training mode with every shape fixed, as a CUDA graph needs."""
    buffer = io.BytesIO()
    torch.onnx.export(
        model, (example,), buffer, input_names=["x"], output_names=["logits"], opset_version=17,
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue())


def _artifacts(directory, model: onnx.ModelProto, precision: str | None = None) -> None:
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2, weight_decay=0.01),
        artifact_directory=directory,
        mixed_precision=precision,
    )


def _open(directory, device: str) -> tuple[CheckpointState, Module, Optimizer]:
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx", state, directory / "eval_model.onnx", device=device
    )
    return state, module, Optimizer(directory / "optimizer_model.onnx", module)


def _batches(shape: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((BATCH, *shape)).astype(np.float32), rng.integers(0, 5, BATCH))
        for _ in range(STEPS)
    ]


def _curve(directory, device: str, batches) -> tuple[list[float], dict[str, np.ndarray]]:
    return train_curve(directory, batches, device)


def test_cuda_without_provider_names_the_fix(monkeypatch) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(DeviceError, match=r"onnxruntime-gpu|traingraph\[gpu\]"):
        parse_device("cuda:0")


@pytest.mark.parametrize("model_kind", ["mlp", "cnn", "lstm", "gru"])
@pytest.mark.gpu
@needs_cuda
def test_cpu_and_cuda_give_the_same_loss_curve(tmp_path, model_kind) -> None:
    if model_kind == "mlp":
        model, shape = export(seeded(MLP), torch.zeros(2, 20), training=True), (20,)
    elif model_kind in ("lstm", "gru"):
        # The recurrent nodes are written step by step in the training graph.
        net = seeded(RecurrentClassifier, gru=model_kind == "gru")
        model, shape = export(net, torch.zeros(2, 6, 8), training=True), (6, 8)
    else:
        model = export(seeded(SmallCNN, classes=5), torch.zeros(2, 1, 8, 8), training=True)
        shape = (1, 8, 8)
    _artifacts(tmp_path, model)
    batches = _batches(shape)
    cpu_losses, cpu_params = _curve(tmp_path, "cpu", batches)
    gpu_losses, gpu_params = _curve(tmp_path, "cuda", batches)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=RTOL, atol=ATOL)
    if model_kind in ("mlp", "cnn"):  # the recurrent models see 20 random batches once each
        assert gpu_losses[-1] < gpu_losses[0]
    for name, value in cpu_params.items():
        if name in ("conv.bias", "bn.running_mean"):
            # BatchNorm subtracts the batch mean right after the conv, so the bias's exact
            # gradient is 0 and AdamW moves it by the sign of rounding noise, different on each
            # device; the running mean carries that bias.
            continue
        np.testing.assert_allclose(
            gpu_params[name], value, rtol=1e-2, atol=PARAM_ATOL, err_msg=name
        )


@pytest.mark.gpu
@needs_cuda
def test_training_state_stays_on_the_gpu(tmp_path) -> None:
    _artifacts(tmp_path, export(seeded(MLP), torch.zeros(2, 20), training=True))
    state, module, opt = _open(tmp_path, "cuda:0")
    for x, y in _batches((20,))[:3]:
        module(x, y)
        opt.step()
        module.lazy_reset_grad()
    runtime = state._runtime
    assert runtime is not None and runtime.optimizer_slots is not None
    stores = [runtime.trainable.cur, runtime.trainable.alt, runtime.grads,
              runtime.optimizer_slots.cur, runtime.optimizer_slots.alt]
    for store in stores:
        for name in store:
            assert store.ortvalue(name).device_name().lower() == "cuda", name
    assert state.parameters["fc1.weight"].grad is not None


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_share_one_aligned_block() -> None:
    from traingraph.runtime.tensors import TensorStore

    values = {"w": np.arange(15, dtype=np.float32).reshape(3, 5), "b": np.ones(7, np.float32)}
    store = TensorStore(parse_device("cuda"), {n: (v.shape, v.dtype) for n, v in values.items()},
                        values)  # fmt: skip
    # 256-byte boundaries: 64 float32 elements per tensor here, the padding left at zero.
    assert store.offsets == {"w": 0, "b": 64} and store.flat_size == 128
    assert store.ortvalue("b").data_ptr() - store.ortvalue("w").data_ptr() == 256
    block = store.block(0, store.flat_size).numpy()
    np.testing.assert_array_equal(block[:15], values["w"].reshape(-1))
    np.testing.assert_array_equal(block[64:71], values["b"])
    assert not block[15:64].any() and not block[71:].any()
    for name, value in values.items():
        np.testing.assert_array_equal(store.read(name), value)


@pytest.mark.gpu
@needs_cuda
def test_cuda_optimizer_updates_the_blocks_as_one_vector(tmp_path) -> None:
    _artifacts(tmp_path, export(seeded(MLP), torch.zeros(2, 20), training=True))
    batches = _batches((20,))[:5]
    results = {}
    for fused in (True, False):
        state, module, _ = _open(tmp_path, "cuda")
        opt = Optimizer(tmp_path / "optimizer_model.onnx", module, fused=fused)
        assert (opt.update.flat is not None) == fused
        for x, y in batches:
            module(x, y)
            opt.step()
            module.lazy_reset_grad()
        # Its own session runs the update after the training graph: all of it in place.
        held = module.step.state.held_bytes()
        assert held["parameters"] == held["gradients"]
        results[fused] = {n: p.data for n, p in state.parameters.items()}
    for name, value in results[False].items():
        np.testing.assert_allclose(results[True][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _graph_step_and_cpu_curve(tmp_path, model=MLP, shape=(20,)):
    """A CudaGraphStep on the static ``model`` (inputs of ``shape`` a sample), its state, the
    batches, and the CPU curve over them."""
    from traingraph.runtime.cuda import CudaGraphStep

    _artifacts(tmp_path, _static_export(seeded(model), torch.zeros(BATCH, *shape)))
    batches = _batches(shape)
    cpu_losses, cpu_params = _curve(tmp_path, "cpu", batches)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, device="cuda")
    step = CudaGraphStep(module, tmp_path / "optimizer_model.onnx")
    return step, state, batches, cpu_losses, cpu_params


def _assert_parameters_follow(state: CheckpointState, expected: dict[str, np.ndarray]) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(
            state.parameters[name].data, value, rtol=1e-2, atol=PARAM_ATOL, err_msg=name
        )


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_step_matches_the_cpu_curve(tmp_path) -> None:
    step, state, batches, cpu_losses, cpu_params = _graph_step_and_cpu_curve(tmp_path)
    losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
    np.testing.assert_allclose(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    assert step.optimizer.get_learning_rate() == pytest.approx(1e-2)
    _assert_parameters_follow(state, cpu_params)
    with pytest.raises(tg.errors.ModelError, match="captured for"):
        step(batches[0][0][:8], batches[0][1][:8])


class SqueezeExcite(torch.nn.Module):
    """Conv, BatchNorm and a squeeze-and-excitation gate (the channel means through a bottleneck
    scale the channels), as in MobileNetV3 and EfficientNet: the input of the gate reaches the
    loss through its means and elementwise, so its gradient sums an unexpanded (broadcast) part."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.squeeze = torch.nn.Linear(16, 4)
        self.excite = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        gate = torch.sigmoid(self.excite(torch.relu(self.squeeze(h.mean((2, 3))))))
        h = h * gate[:, :, None, None]
        return self.head(h.mean((2, 3)))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_step_captures_a_squeeze_and_excitation_model(tmp_path) -> None:
    step, state, batches, cpu_losses, cpu_params = _graph_step_and_cpu_curve(
        tmp_path, SqueezeExcite, (3, 8, 8)
    )
    losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
    np.testing.assert_allclose(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < losses[0]
    cpu_params.pop("conv.bias")  # BatchNorm takes out its exact gradient (see above)
    cpu_params.pop("bn.running_mean")
    _assert_parameters_follow(state, cpu_params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", [True, False], ids=["cuda-kernel", "captured-graph"])
def test_cuda_graph_step_writes_a_large_state_in_place(tmp_path, monkeypatch, kernel) -> None:
    # Above IN_PLACE_BYTES the update writes the parameters and slots over themselves: the
    # optimizer's CUDA kernel queued after the captured step, or (where the kernel is not
    # there) the optimizer's own captured graph, whose capture's repeated runs leave no trace.
    from traingraph.runtime import cuda
    from traingraph.runtime.optimizer import update

    monkeypatch.setattr(cuda, "IN_PLACE_BYTES", 0)
    if not kernel:
        monkeypatch.setattr(update, "device_update", lambda *args, **kwargs: None)
    step, state, batches, cpu_losses, cpu_params = _graph_step_and_cpu_curve(tmp_path)
    losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
    np.testing.assert_allclose(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    _assert_parameters_follow(state, cpu_params)
    held = step.step.state
    assert (step.optimizer_update.device_kernel is not None) == kernel
    assert (step._optim is None) == kernel and step._kernel == kernel
    assert step._in_place.parameters and step._in_place.slots
    assert len(held.trainable.allocated) == 1 and len(held.optimizer_slots.allocated) == 1
    assert step.optimizer_update.state.step == len(batches)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernel_updates_a_model_with_running_statistics_in_place(tmp_path, monkeypatch):
    """With BatchNorm's running statistics the captured step alternates between two buffer
    layouts; the kernel, outside the capture, writes the parameters and momenta once."""
    from traingraph.runtime import cuda

    monkeypatch.setattr(cuda, "IN_PLACE_BYTES", 0)
    step, state, batches, cpu_losses, cpu_params = _graph_step_and_cpu_curve(
        tmp_path, SqueezeExcite, (3, 8, 8)
    )
    losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
    np.testing.assert_allclose(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    cpu_params.pop("conv.bias")  # see test_cuda_graph_step_captures_a_squeeze_and_excitation_model
    cpu_params.pop("bn.running_mean")
    _assert_parameters_follow(state, cpu_params)
    held = step.step.state
    assert step._kernel and step._optim is None and len(step._graphs) == 2
    assert len(held.trainable.allocated) == 1 and len(held.optimizer_slots.allocated) == 1


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernel_update_equals_the_graph_update_through_module(tmp_path, monkeypatch) -> None:
    """``Optimizer.step()`` on a CUDA module runs the optimizer's CUDA kernel; the parameters
    after five steps equal, bit for bit, those of the same steps with the optimizer graph."""
    from traingraph.runtime.optimizer import update

    _artifacts(tmp_path, export(seeded(MLP), torch.zeros(2, 20), training=True))
    batches = _batches((20,))[:5]
    results = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(update, "device_update", lambda *args, **kwargs: None)
        state, module, opt = _open(tmp_path, "cuda")
        assert (opt.update.device_kernel is not None) == kernel
        for x, y in batches:
            module(x, y)
            opt.step()
            module.lazy_reset_grad()
        assert opt.update.state.step == len(batches)
        results[kernel] = {n: p.data for n, p in state.parameters.items()}
    for name, value in results[False].items():
        np.testing.assert_array_equal(results[True][name], value, err_msg=name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", [True, False], ids=["cuda-kernel", "captured-graph"])
def test_cuda_graph_step_in_place_skips_a_step_of_infinite_gradients(tmp_path, monkeypatch, kernel):
    from traingraph.runtime import cuda
    from traingraph.runtime.optimizer import update

    monkeypatch.setattr(cuda, "IN_PLACE_BYTES", 0)
    if not kernel:
        monkeypatch.setattr(update, "device_update", lambda *args, **kwargs: None)
    module, _, _ = _fp16_graph_step_skipping_an_infinite_step(tmp_path)
    scaler = module.loss_scaler
    assert scaler is not None and scaler.skipped_steps == 1


@pytest.mark.gpu
@needs_cuda
def test_host_decided_fp16_step_updates_with_the_cuda_kernel(tmp_path, monkeypatch):
    """A mixed-precision step too large to decide the loss scale on the GPU runs the kernel
    (above KERNEL_BYTES) after the host has read the finite flag, and skips it otherwise."""
    from traingraph.runtime import cuda

    monkeypatch.setattr(cuda, "DEVICE_SCALING_LIMIT", 0)
    monkeypatch.setattr(cuda, "KERNEL_BYTES", 0)
    module, step, _ = _fp16_graph_step_skipping_an_infinite_step(tmp_path)
    assert step._kernel and step._optim is None and step._counters is None
    assert module.loss_scaler is not None and module.loss_scaler.skipped_steps == 1


def _fp16_graph_step_skipping_an_infinite_step(tmp_path):  # type: ignore[no-untyped-def]
    """A CudaGraphStep of the fp16 MLP that follows the Module's curve, then takes a batch
    with an inf: the step is not counted and the parameters stay. Returns the module, the step
    and the batches."""
    from traingraph.runtime.cuda import CudaGraphStep

    _artifacts(tmp_path, _static_export(seeded(MLP), torch.zeros(BATCH, 20)), "fp16")
    batches = _batches((20,))
    reference, _ = _curve(tmp_path, "cuda", batches)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, device="cuda")
    step = CudaGraphStep(module, tmp_path / "optimizer_model.onnx")
    losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
    np.testing.assert_allclose(losses, reference, rtol=RTOL, atol=ATOL)
    x, y = batches[0]
    x = x.copy()
    x[0, 0] = np.inf
    before = {n: module.step.state.read(n) for n in module.step.trainable}
    step(x, y)
    assert step.optimizer_update.state.step == STEPS
    for name, value in before.items():
        np.testing.assert_array_equal(module.step.state.read(name), value, err_msg=name)
    return module, step, batches


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_step_copies_batches_asynchronously(tmp_path) -> None:
    # Steps that fetch nothing leave no host sync between a batch's copy and its kernels but
    # the stream they share; the parameters must still follow the CPU curve.
    step, state, batches, _, cpu_params = _graph_step_and_cpu_curve(tmp_path)
    for x, y in batches:
        step(x, y)
    assert type(step._feeds).__name__ == "StagedInputs", "batches should be staged"
    _assert_parameters_follow(state, cpu_params)


@pytest.mark.gpu
@needs_cuda
def test_staged_inputs_land_on_the_device() -> None:
    from traingraph.runtime.cuda.cudart import StagedInputs, shared_stream

    device = parse_device("cuda")
    stream = shared_stream(device.index)
    assert stream is not None, "the CUDA runtime library should load where the provider runs"
    specs = {"a": ((3, 5), np.dtype(np.float32)), "i": ((), np.dtype(np.int64))}
    feeds = StagedInputs(device, specs, stream)
    assert feeds.ortvalue("i").data_ptr() - feeds.ortvalue("a").data_ptr() == 256
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    for k in range(3):
        if k < 2:
            a = rng.standard_normal((3, 5)).astype(np.float32)
            feeds.write_all({"a": a, "i": np.array(k, np.int64)})
        else:
            feeds.write_all({"i": np.array(k, np.int64)})  # "a" keeps its value
        # A synchronous read on the legacy stream does not wait for a non-blocking stream.
        feeds.wait()
        np.testing.assert_array_equal(feeds.ortvalue("a").numpy(), a)
        assert int(feeds.ortvalue("i").numpy()) == k



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch_norm", [False, True], ids=["plain", "batch_norm"])
def test_training_graph_compiles_for_cuda(batch_norm: bool) -> None:
    # With BatchNorm the phase models hold its lowered form, which the CUDA provider runs.
    curves = {}
    rng = np.random.default_rng(0)
    data = [
        (rng.standard_normal((16, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 16))
        for _ in range(5)
    ]
    for device in ("cpu", "cuda"):
        init.manual_seed(0)
        g = tg.Graph("cnn")
        x = g.input("x", shape=[None, 1, 8, 8])
        h = L.Conv2d(1, 8, kernel_size=3, padding=1)(x)
        if batch_norm:
            h = L.BatchNorm2d(8)(h)
        h = L.MaxPool2d(2)(L.ReLU()(h))
        g.output("logits", L.Linear(8 * 4 * 4, 10)(L.Flatten()(h)))
        train = tg.TrainingGraph([g], loss=tg.losses.CrossEntropyLoss(),
                                 optimizer=tg.optim.AdamW(lr=1e-2))
        train.add_inputs({"x": x}, loss_labels={"y": tg.TensorSpec([None], "int64")})
        train.compile(device)
        curves[device] = [float(train.execute({"x": xb}, loss_labels={"y": yb}).loss)
                          for xb, yb in data]
    np.testing.assert_allclose(curves["cuda"], curves["cpu"], rtol=RTOL, atol=ATOL)


@pytest.mark.gpu
@needs_cuda
def test_cli_trains_on_cuda(tmp_path) -> None:
    x, y = classification_data(256, 20, 5)
    onnx.save(export(seeded(MLP), torch.zeros(2, 20), training=True), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "train.npz", x=x, y=y)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "traingraph", "train", str(tmp_path / "mlp.onnx"),
         "--data", str(tmp_path / "train.npz"), "--epochs", "1", "--device", "cuda",
         "--out", str(tmp_path / "run")],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cuda" in result.stdout + result.stderr


def test_session_config_gives_the_cuda_provider_options() -> None:
    config = SessionConfig(
        tf32=False, cudnn_conv_algo_search="HEURISTIC", gpu_mem_limit=2**30,
        arena_extend_strategy="kNextPowerOfTwo", cuda_extra={"do_copy_in_default_stream": "1"},
    )
    providers = Device("cuda", 1).providers(config.cuda_options())
    assert providers == [
        ("CUDAExecutionProvider", {
            "enable_cuda_graph": "0", "use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC",
            "arena_extend_strategy": "kNextPowerOfTwo", "gpu_mem_limit": str(2**30),
            "do_copy_in_default_stream": "1", "device_id": "1",
        }),
        "CPUExecutionProvider",
    ]
    assert SessionConfig().cuda_options()["arena_extend_strategy"] == "kSameAsRequested"
    captured = Device("cuda").providers(SessionConfig(cuda_graph=True).cuda_options())
    assert len(captured) == 1  # a captured graph runs every node on the GPU
    assert Device("cpu").providers(config.cuda_options()) == ["CPUExecutionProvider"]


def test_the_memory_pattern_defaults_to_on_for_cpu_and_off_for_cuda() -> None:
    assert SessionConfig().memory_pattern_on("cpu")
    assert not SessionConfig().memory_pattern_on("cuda")
    assert SessionConfig(memory_pattern=True).memory_pattern_on("cuda")
    assert not SessionConfig(memory_pattern=False).memory_pattern_on("cpu")


_HELD = """
import json, sys
import numpy as np, onnxruntime as ort, torch
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.session import SessionConfig
ort.preload_dlls()
torch.cuda.init()
free_before, _ = torch.cuda.mem_get_info()
directory, pattern = sys.argv[1], json.loads(sys.argv[2])
state = CheckpointState.load_checkpoint(directory + "/checkpoint")
module = Module(directory + "/training_model.onnx", state, device="cuda",
                session_config=SessionConfig(memory_pattern=pattern))
opt = Optimizer(directory + "/optimizer_model.onnx", module)
module.train()
rng = np.random.default_rng(0)
losses = []
for _ in range(4):
    x = rng.standard_normal((256, 3, 64, 64)).astype(np.float32)
    losses.append(float(module(x, rng.integers(0, 5, 256))))
    opt.step()
    module.lazy_reset_grad()
free_after, _ = torch.cuda.mem_get_info()
print(json.dumps({"held": free_before - free_after, "losses": losses}))
"""


@pytest.mark.gpu
@needs_cuda
def test_cuda_sessions_hold_less_without_the_memory_pattern(tmp_path) -> None:
    # With the pattern, onnxruntime allocates a block for the second run's values on top of the
    # arena the first run grew, which the arena keeps.
    _artifacts(tmp_path, export(seeded(ResidualNet), torch.zeros(2, 3, 64, 64), training=True))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for pattern in (None, True):
        done = subprocess.run(
            [sys.executable, "-c", _HELD, str(tmp_path), json.dumps(pattern)],
            check=False, capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        runs[pattern] = json.loads(done.stdout.strip().splitlines()[-1])
    # cuDNN picks its algorithms in each process anew: the same losses up to their rounding
    np.testing.assert_allclose(runs[None]["losses"], runs[True]["losses"], rtol=1e-5)
    assert runs[None]["held"] < 0.8 * runs[True]["held"], runs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"cudnn_conv_algo_search": "FAST"}, "cudnn_conv_algo_search"),
     ({"arena_extend_strategy": "grow"}, "arena_extend_strategy"),
     ({"gpu_mem_limit": 0}, "gpu_mem_limit")],
)
def test_session_config_refuses_unknown_cuda_options(kwargs, match) -> None:
    with pytest.raises(tg.errors.ModelError, match=match):
        SessionConfig(**kwargs).cuda_options()


@pytest.mark.parametrize("chunk", [16, 5])
def test_fused_step_model_runs_the_optimizer_on_the_concatenated_gradients(chunk: int) -> None:
    # Gradients at offsets 0 and 8 of a 16-element block: the fused model pads between them
    # with zeros, writes that vector out chunk by chunk, and the optimizer part updates each
    # chunk of the block. Chunks of 5 split b's gradient and both paddings.
    from onnx import TensorProto, helper

    from traingraph.optim.model import ParamInfo, build_optimizer_model
    from traingraph.runtime.cuda import FUSED_PREFIX, fuse_step_model
    from traingraph.runtime.optimizer import FlatLayout

    f32 = TensorProto.FLOAT
    train = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0),
                helper.make_node("Mul", ["a", "a"], ["a_grad"]),
                helper.make_node("Neg", ["b"], ["b_grad"]),
            ],
            "train",
            [
                helper.make_tensor_value_info("a", f32, [3]),
                helper.make_tensor_value_info("b", f32, [2, 2]),
            ],
            [
                helper.make_tensor_value_info("loss", f32, []),
                helper.make_tensor_value_info("a_grad", f32, [3]),
                helper.make_tensor_value_info("b_grad", f32, [2, 2]),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=10,
    )
    sgd = optim.SGD(lr=0.1, momentum=0.9)
    layout = FlatLayout("flat", 16, {"momentum_buffer": (0, 16)}, chunk=chunk)
    assert len(layout.chunks) == (1 if chunk == 16 else 4)
    f32_dtype = np.dtype(np.float32)
    chunks = [ParamInfo(n, (stop - start,), f32_dtype) for n, start, stop in layout.chunks]
    optimizer = build_optimizer_model(sgd, chunks)
    fused = fuse_step_model(
        train, optimizer, layout, {"a": (0, ((3,), f32_dtype)), "b": (8, ((2, 2), f32_dtype))}
    )
    assert fused is not None
    onnx.checker.check_model(fused, full_check=True)

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(3).astype(np.float32), rng.standard_normal((2, 2)).astype(np.float32)
    flat = rng.standard_normal(16).astype(np.float32)
    momentum = rng.standard_normal(16).astype(np.float32)
    scalars = {"learning_rate": np.array(0.1, np.float32), "step": np.array(3, np.int64)}
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"a": a, "b": b} | {FUSED_PREFIX + n: v for n, v in scalars.items()}
    for name, start, stop in layout.chunks:
        feeds[f"{FUSED_PREFIX}{name}"] = flat[start:stop]
        feeds[f"{FUSED_PREFIX}{name}.momentum_buffer"] = momentum[start:stop]
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert "a_grad" not in got and "b_grad" not in got
    assert float(got["loss"]) == pytest.approx(float(a.sum()))

    def joined(suffix: str) -> np.ndarray:
        return np.concatenate([got[f"{FUSED_PREFIX}{n}{suffix}"] for n, _, _ in layout.chunks])

    grad = np.zeros(16, np.float32)
    grad[:3], grad[8:12] = a * a, -b.reshape(-1)
    np.testing.assert_array_equal(joined("_grad"), grad)
    whole = build_optimizer_model(sgd, [ParamInfo("flat", (16,), f32_dtype)])
    alone = ort.InferenceSession(whole.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in alone.get_outputs()]
    inputs = {"flat": flat, "flat_grad": grad, "flat.momentum_buffer": momentum, **scalars}
    want = dict(zip(names, alone.run(None, inputs)))
    np.testing.assert_array_equal(joined("_out"), want["flat_out"])
    np.testing.assert_array_equal(joined(".momentum_buffer_out"), want["flat.momentum_buffer_out"])


@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("good_steps", [0, 2])
def test_fused_step_model_decides_the_loss_scale_on_the_device(finite: bool, good_steps: int):
    # A mixed-precision step fused with AdamW: where the gradients are finite the update and
    # the step count apply and the scale grows once every growth_interval (3) finite steps in
    # a row; where they are not, every parameter and slot keeps its value bit for bit and the
    # scale backs off. The counters follow DynamicLossScaler.update on the host.
    from onnx import TensorProto, helper

    from traingraph.optim.model import ParamInfo, build_optimizer_model
    from traingraph.precision import GRADS_FINITE, LOSS_SCALE
    from traingraph.runtime.amp import (
        GOOD_STEPS,
        SKIPPED_STEPS,
        STEP_COUNT,
        DynamicLossScaler,
    )
    from traingraph.runtime.cuda import FUSED_PREFIX, fuse_step_model
    from traingraph.runtime.optimizer import FlatLayout

    f32 = TensorProto.FLOAT
    train = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0),
                helper.make_node("Mul", ["a", LOSS_SCALE], ["scaled"]),
                helper.make_node("Div", ["scaled", LOSS_SCALE], ["a_grad"]),
                helper.make_node("Constant", [], ["zero"], value_float=0.0),
                helper.make_node("Mul", ["a_grad", "zero"], ["probe"]),
                helper.make_node("ReduceSum", ["probe"], ["total"], keepdims=0),
                helper.make_node("IsNaN", ["total"], ["nan"]),
                helper.make_node("Not", ["nan"], [GRADS_FINITE]),
            ],
            "train",
            [
                helper.make_tensor_value_info("a", f32, [4]),
                helper.make_tensor_value_info(LOSS_SCALE, f32, []),
            ],
            [
                helper.make_tensor_value_info("loss", f32, []),
                helper.make_tensor_value_info("a_grad", f32, [4]),
                helper.make_tensor_value_info(GRADS_FINITE, TensorProto.BOOL, []),
            ],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=10,
    )
    adamw = optim.AdamW(lr=0.1)
    layout = FlatLayout("flat", 4, {"exp_avg": (0, 4), "exp_avg_sq": (4, 4)})
    f32_dtype = np.dtype(np.float32)
    optimizer = build_optimizer_model(adamw, [ParamInfo("flat", (4,), f32_dtype)])
    scaler = DynamicLossScaler(scale=1024.0, growth_interval=3)
    fused = fuse_step_model(train, optimizer, layout, {"a": (0, ((4,), f32_dtype))}, scaler)
    assert fused is not None
    onnx.checker.check_model(fused, full_check=True)

    rng = np.random.default_rng(1)
    a = rng.standard_normal(4).astype(np.float32)
    if not finite:
        a[2] = np.inf
    params, m, v = (rng.standard_normal(4).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    counters = {
        LOSS_SCALE: np.array(1024.0, np.float32),
        GOOD_STEPS: np.array(float(good_steps), np.float32),
        SKIPPED_STEPS: np.array(5.0, np.float32),
        STEP_COUNT: np.array(7, np.int64),
    }
    feeds = {
        "a": a,
        f"{FUSED_PREFIX}learning_rate": np.array(0.1, np.float32),
        f"{FUSED_PREFIX}flat": params,
        f"{FUSED_PREFIX}flat.exp_avg": m,
        f"{FUSED_PREFIX}flat.exp_avg_sq": v,
        **counters,
    }
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    assert f"{FUSED_PREFIX}step" not in {i.name for i in session.get_inputs()}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    host = DynamicLossScaler(scale=1024.0, growth_interval=3, good_steps=good_steps)
    host.skipped_steps = 5
    assert host.update(finite) == finite
    assert float(got[f"{LOSS_SCALE}_out"]) == host.scale
    assert float(got[f"{GOOD_STEPS}_out"]) == host.good_steps
    assert float(got[f"{SKIPPED_STEPS}_out"]) == host.skipped_steps
    assert int(got[f"{STEP_COUNT}_out"]) == 7 + finite
    outputs = ("flat_out", "flat.exp_avg_out", "flat.exp_avg_sq_out")
    if not finite:
        for name, before in zip(outputs, (params, m, v)):
            np.testing.assert_array_equal(got[f"{FUSED_PREFIX}{name}"], before)
        return
    alone = ort.InferenceSession(optimizer.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {
        "learning_rate": np.array(0.1, np.float32),
        "step": np.array(8, np.int64),
        "flat": params,
        "flat_grad": a,
        "flat.exp_avg": m,
        "flat.exp_avg_sq": v,
    }
    want = dict(zip([o.name for o in alone.get_outputs()], alone.run(None, inputs)))
    for name in outputs:
        np.testing.assert_array_equal(got[f"{FUSED_PREFIX}{name}"], want[name])


def test_device_counters_mirror_the_host_scaler_and_step_count() -> None:
    # GpuCounters on the CPU provider: the host copies read the device's after a step wrote
    # them, and a value the host sets goes to the device before the next step.
    from traingraph.checkpoint import CheckpointData
    from traingraph.precision import LOSS_SCALE
    from traingraph.runtime.amp import GOOD_STEPS, SKIPPED_STEPS, STEP_COUNT, DynamicLossScaler
    from traingraph.runtime.cuda import GpuCounters
    from traingraph.runtime.state import TrainingState

    data = CheckpointData({"w": np.zeros(2, np.float32)}, {"w": True}, {}, optimizer_step=4)
    state = TrainingState(data, parse_device("cpu"))
    scaler = DynamicLossScaler(scale=64.0)
    counters = GpuCounters(state.device, scaler, state)
    counters.push()
    cur = counters.pair.cur
    assert float(cur.read(LOSS_SCALE)) == 64.0 and int(cur.read(STEP_COUNT)) == 4
    # What a step writes to the other copy:
    written = {LOSS_SCALE: 32.0, GOOD_STEPS: 0.0, SKIPPED_STEPS: 1.0, STEP_COUNT: 4}
    counters.pair.alt.write_all({n: np.array(v) for n, v in written.items()})
    counters.advance()
    assert scaler.scale == 32.0 and scaler.skipped_steps == 1 and state.step == 4
    state.step = 10
    scaler.scale = 8.0
    counters.push()
    cur = counters.pair.cur
    assert float(cur.read(LOSS_SCALE)) == 8.0 and int(cur.read(STEP_COUNT)) == 10
    assert float(cur.read(SKIPPED_STEPS)) == 1.0
    assert scaler.update(True) and scaler.good_steps == 1


def test_fused_step_model_concatenates_many_gradients_in_groups() -> None:
    # onnxruntime's CUDA Concat takes at most 32 inputs inside a CUDA graph capture.
    from onnx import TensorProto, helper

    from traingraph.optim.model import ParamInfo, build_optimizer_model
    from traingraph.runtime.cuda import FUSED_PREFIX, fuse_step_model
    from traingraph.runtime.optimizer import FlatLayout

    n = 70
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("Neg", [f"p{i}"], [f"p{i}_grad"]) for i in range(n)]
    inputs = [helper.make_tensor_value_info(f"p{i}", f32, [2]) for i in range(n)]
    outputs = [helper.make_tensor_value_info(f"p{i}_grad", f32, [2]) for i in range(n)]
    train = helper.make_model(
        helper.make_graph(nodes, "train", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=10,
    )
    sgd = optim.SGD(lr=0.1)
    optimizer = build_optimizer_model(sgd, [ParamInfo("flat", (2 * n,), np.dtype(np.float32))])
    grads = {f"p{i}": (2 * i, ((2,), np.dtype(np.float32))) for i in range(n)}
    fused = fuse_step_model(train, optimizer, FlatLayout("flat", 2 * n, {}), grads)
    assert fused is not None
    assert max(len(node.input) for node in fused.graph.node if node.op_type == "Concat") <= 32
    values = np.arange(2 * n, dtype=np.float32)
    feeds = {f"p{i}": values[2 * i : 2 * i + 2] for i in range(n)}
    feeds |= {
        f"{FUSED_PREFIX}flat": values,
        f"{FUSED_PREFIX}learning_rate": np.array(0.1, np.float32),
        f"{FUSED_PREFIX}step": np.array(1, np.int64),
    }
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    (grad,) = session.run([f"{FUSED_PREFIX}flat_grad"], feeds)
    np.testing.assert_array_equal(grad, -values)


def test_captured_dropout_reads_fresh_noise_each_step() -> None:
    """A CUDA graph replays the random seeds it captured, so the step's Dropouts are rewritten
    to read uniform noise that an uncaptured session draws before each replay."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], name="drop"),
         helper.make_node("Relu", ["y"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("m", TensorProto.BOOL, None)],
        [helper.make_tensor("r", TensorProto.FLOAT, [], [0.25]),
         helper.make_tensor("t", TensorProto.BOOL, [], [True])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    rewritten, noise = dropout_from_noise(with_static_inputs(model, {"x": (4, 8)}))
    onnx.checker.check_model(rewritten, full_check=True)
    assert noise == {"drop_noise": ((4, 8), np.dtype(np.float32))}
    assert "Dropout" not in {n.op_type for n in rewritten.graph.node}
    rng = np.random.default_rng(0)
    x, u = rng.standard_normal((4, 8)).astype(np.float32), rng.random((4, 8), np.float32)
    z, mask = ort.InferenceSession(rewritten.SerializeToString()).run(
        None, {"x": x, "drop_noise": u}
    )
    np.testing.assert_array_equal(mask, u >= 0.25)
    np.testing.assert_allclose(z, np.maximum(x * mask / 0.75, 0), rtol=1e-6)
    (drawn,) = ort.InferenceSession(noise_model(noise).SerializeToString()).run(None, {})
    assert drawn.shape == (4, 8) and drawn.min() >= 0 and drawn.max() < 1


class LeNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc = torch.nn.Linear(16 * 5 * 5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


# Low-precision loss curves against float32 ones, 20 AdamW steps. float16 keeps 11 significant
# bits (relative rounding 2**-11 ~ 5e-4) and bfloat16 8 (2**-8 ~ 4e-3) in every Gemm/Conv input;
# AdamW turns each gradient into an update of about lr = 1e-2 whatever its size, so rounding
# that flips a near-zero gradient moves that weight by up to 2 lr, and the curves drift apart
# over the steps by a few times the rounding of one step.
MIXED_ATOL = {"fp16": 2e-2, "bf16": 6e-2}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("model_kind", ["mlp", "lenet", "residual"])
@pytest.mark.gpu
@needs_cuda
def test_mixed_precision_follows_the_float32_curve(tmp_path, model_kind, precision) -> None:
    # "residual" has BatchNorms, which a float16 program runs on float16 activations.
    if model_kind == "mlp":
        model, shape = export(seeded(MLP), torch.zeros(2, 20), training=True), (20,)
    elif model_kind == "residual":
        model = export(seeded(ResidualNet), torch.zeros(2, 3, 8, 8), training=True)
        shape = (3, 8, 8)
    else:
        model, shape = export(seeded(LeNet), torch.zeros(2, 1, 28, 28), training=True), (1, 28, 28)
    batches = _batches(shape)
    _artifacts(tmp_path / "fp32", model)
    _artifacts(tmp_path / precision, model, precision)
    reference, _ = _curve(tmp_path / "fp32", "cuda", batches)
    losses, params = _curve(tmp_path / precision, "cuda", batches)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=MIXED_ATOL[precision])
    assert all(v.dtype == np.float32 for v in params.values())


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_step_trains_in_fp16(tmp_path) -> None:
    module, step, batches = _fp16_graph_step_skipping_an_infinite_step(tmp_path)
    # The fused step decided on the GPU; the host's copies read the device's back.
    assert step._counters is not None
    scaler = module.loss_scaler
    assert scaler is not None and scaler.skipped_steps == 1 and scaler.scale == 2.0**15
    # A scale the host sets is the one the next step uses.
    scaler.scale = 2.0**10
    step(*batches[1])
    assert scaler.scale == 2.0**10 and scaler.good_steps == 1
    assert step.optimizer_update.state.step == STEPS + 1


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_steps_of_two_batch_shapes_share_the_loss_scale(tmp_path) -> None:
    # Two captured fp16 steps of one module (batches of 32 and 16) decide on the same GPU
    # counters: the step count, the skipped step and the scale it halves are seen by both.
    from traingraph.runtime.cuda import CudaGraphStep

    _artifacts(tmp_path, export(seeded(MLP), torch.zeros(2, 20), training=True), "fp16")
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, device="cuda")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    steps = [CudaGraphStep(module, optimizer), CudaGraphStep(module, optimizer)]
    rng = np.random.default_rng(0)
    sizes = [32, 16, 32, 16, 32]
    for i, n in enumerate(sizes):
        x = rng.standard_normal((n, 20)).astype(np.float32)
        if i == 3:
            x[0, 0] = np.inf
        steps[i % 2](x, rng.integers(0, 5, n))
    assert steps[0]._counters is not None and steps[0]._counters is steps[1]._counters
    scaler = module.loss_scaler
    assert scaler is not None and scaler.skipped_steps == 1 and scaler.scale == 2.0**15
    assert scaler.good_steps == 1 and optimizer.update.state.step == 4


def test_static_shapes_fold_into_constants() -> None:
    """Shape and Size of fixed shapes (and the arithmetic on them) become constants, with the
    same outputs; only small shape values are folded, activations never."""
    from onnx import TensorProto, helper

    from traingraph.runtime.cuda.static_shapes import fold_static_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 12])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("Size", ["x"], ["count"]),
        helper.make_node("Cast", ["count"], ["count_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Div", ["total", "count_f"], ["mean"]),
        helper.make_node("Shape", ["x"], ["shape"], end=1),
        helper.make_node("Constant", [], ["minus_one"], value_ints=[-1]),
        helper.make_node("Concat", ["shape", "minus_one"], ["flat"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y, mean])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    static = with_static_inputs(model, {"x": (5, 3, 4)})
    folded = fold_static_shapes(static)
    ops = [n.op_type for n in folded.graph.node]
    assert "Shape" not in ops and "Size" not in ops and "Cast" not in ops
    assert {"ReduceSum", "Div", "Reshape"} <= set(ops)
    feed = {"x": np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)}
    run = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feed
        )
        for m in (static, folded)
    ]
    for before, after in zip(*run):
        np.testing.assert_array_equal(before, after)
    onnx.checker.check_model(folded, full_check=True)


@pytest.mark.parametrize("count", [33, 70, 1100])
def test_wide_concats_are_split_into_groups(count: int) -> None:
    """A Concat of more inputs than a CUDA graph capture takes becomes Concats of at most 32
    inputs each, with the same result."""
    from onnx import TensorProto, helper

    from traingraph.runtime.cuda.static_shapes import CAPTURE_CONCAT_INPUTS, split_wide_concats

    inputs = [
        helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, i % 3 + 1])
        for i in range(count)
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None])
    node = helper.make_node("Concat", [i.name for i in inputs], ["y"], axis=1)
    model = helper.make_model(
        helper.make_graph([node], "g", inputs, [out]), opset_imports=[helper.make_opsetid("", 17)]
    )
    rng = np.random.default_rng(0)
    feed = {
        i.name: rng.standard_normal((2, k % 3 + 1)).astype(np.float32)
        for k, i in enumerate(inputs)
    }
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = before.run(None, feed)[0]
    split = split_wide_concats(model)
    assert all(len(n.input) <= CAPTURE_CONCAT_INPUTS for n in split.graph.node)
    onnx.checker.check_model(split, full_check=True)
    after = ort.InferenceSession(split.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(after.run(None, feed)[0], expected)


def test_dynamic_batch_training_graph_prepared_for_capture(tmp_path) -> None:
    """A residual network exported with a dynamic batch (BatchNorm lowered, a mean over
    computed axes): once its input shapes are fixed, no Shape or Size is left and no Concat
    takes more than 32 inputs, and the graph computes what it computed before."""
    from traingraph.runtime.cuda.static_shapes import CAPTURE_CONCAT_INPUTS, for_capture

    artifacts.generate_artifacts(
        tg.from_torch(seeded(ResidualNet), torch.zeros(4, 3, 10, 10)),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    train = tmp_path / "training_model.onnx"
    shapes = {"x": (6, 3, 10, 10), "labels": (6,)}
    static, noise = dropout_from_noise(with_static_inputs(train, shapes))
    assert not noise
    prepared = for_capture(static)
    assert not [n.op_type for n in prepared.graph.node if n.op_type in ("Shape", "Size")]
    widths = [len(n.input) for n in prepared.graph.node if n.op_type == "Concat"]
    assert max(widths, default=0) <= CAPTURE_CONCAT_INPUTS
    rng = np.random.default_rng(0)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    params = {n: p.data for n, p in state.parameters.items()}
    feed = {
        "x": rng.standard_normal((6, 3, 10, 10)).astype(np.float32),
        "labels": rng.integers(0, 5, 6),
    }
    session = ort.InferenceSession(str(train), providers=["CPUExecutionProvider"])
    feed.update({i.name: params[i.name] for i in session.get_inputs() if i.name in params})
    names = [o.name for o in session.get_outputs()]
    expected = session.run(names, feed)
    folded = ort.InferenceSession(prepared.SerializeToString(), providers=["CPUExecutionProvider"])
    for name, want, got in zip(names, expected, folded.run(names, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


class _Reparameterized(torch.nn.Module):
    """A VAE's sampling: ``mu + exp(logvar / 2) * randn_like(mu)``, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.mu, self.logvar = torch.nn.Linear(20, 8), torch.nn.Linear(20, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.mu(x), self.logvar(x)
        return self.head(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu))


@pytest.mark.gpu
@needs_cuda
def test_captured_random_draws_are_fresh_at_every_step(tmp_path) -> None:
    """A CUDA graph replays the seeds it captured: the CUDA-graph step's normal draws come
    from noise filled before each replay, so the same batch gives another loss at every step
    (learning rate 0), spread as the draws are."""
    from traingraph.runtime.cuda import CudaGraphStep

    model = tg.from_torch(seeded(_Reparameterized), torch.zeros(BATCH, 20), dynamic_axes=None)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.0),
        artifact_directory=tmp_path,
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, device="cuda")
    step = CudaGraphStep(module, tmp_path / "optimizer_model.onnx")
    x, y = _batches((20,))[0]
    losses = [float(step(x, y, fetch_loss=True)) for _ in range(8)]
    assert len(set(losses)) == len(losses), losses
    cpu_state, cpu_module, _ = _open(tmp_path, "cpu")
    cpu = [float(cpu_module(x, y)) for _ in range(200)]
    assert abs(np.mean(losses) - np.mean(cpu)) < 4 * np.std(cpu), (losses, np.mean(cpu))


class _Warped(torch.nn.Module):
    """An affine warp of each 4 x 5 input (``affine_grid`` and ``grid_sample``), then a
    classifier: GridSample's standard-op gradient on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = torch.nn.Linear(20, 6)
        with torch.no_grad():
            self.theta.weight.mul_(0.1)
            self.theta.bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 1.0, 0.0]))
        self.head = torch.nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = x.view(-1, 1, 4, 5)
        grid = torch.nn.functional.affine_grid(
            self.theta(x).view(-1, 2, 3), list(image.shape), align_corners=False
        )
        warped = torch.nn.functional.grid_sample(image, grid, padding_mode="reflection")
        return self.head(warped.flatten(1))


@pytest.mark.gpu
@needs_cuda
def test_grid_sample_bags_and_aggregations_train_on_the_gpu_as_on_the_cpu(tmp_path) -> None:
    """GridSample (through its standard-op form), nn.EmbeddingBag (lookups and a product with
    the bags' span matrix) and graph aggregations (scatter_reduce mean as sums over counts,
    amax as a ScatterElements max) in a CUDA-graph step: the CPU's loss curve."""
    from traingraph.runtime.cuda import CudaGraphStep

    class Aggregate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.message = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(20, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.message(x.view(-1, 5, 4))
            sources, targets = torch.tensor([0, 1, 2, 3, 4, 2]), torch.tensor([1, 0, 3, 3, 0, 1])
            index = targets.view(1, -1, 1).expand(h.shape[0], -1, 4)
            mean = h.scatter_reduce(1, index, h[:, sources], "mean", include_self=False)
            top = h.scatter_reduce(1, index, h[:, sources], "amax")
            return self.head((mean + top).flatten(1))

    class Bags(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(50, 16, mode="mean")
            self.head = torch.nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ids = (x.abs() * 10).long().clamp(0, 49).flatten()
            offsets = torch.arange(0, ids.shape[0], 20, device=ids.device)
            return self.head(self.bag(ids, offsets))

    nets = (("warp", seeded(_Warped)), ("bags", seeded(Bags)), ("aggregate", seeded(Aggregate)))
    for name, net in nets:
        directory = tmp_path / name
        model = tg.from_torch(net, torch.randn(BATCH, 20), dynamic_axes=None, exporter="dynamo")
        _artifacts(directory, model)
        batches = _batches((20,))[:8]
        cpu_losses, _ = _curve(directory, "cpu", batches)
        state = CheckpointState.load_checkpoint(directory / "checkpoint")
        module = Module(directory / "training_model.onnx", state, device="cuda")
        step = CudaGraphStep(module, directory / "optimizer_model.onnx")
        losses = [float(step(x, y, fetch_loss=True)) for x, y in batches]
        np.testing.assert_allclose(losses, cpu_losses[: len(losses)], rtol=RTOL, atol=ATOL)
