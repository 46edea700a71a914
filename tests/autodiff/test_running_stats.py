"""BatchNorm running statistics as PyTorch keeps them, for models PyTorch made.

``torch.nn.BatchNorm*d`` updates ``running_var`` with the unbiased batch variance (``n / (n - 1)``
times the biased one, ``n`` values per channel) and ``running = (1 - m) * running + m * batch``;
the ONNX specification updates it with the biased variance. A model whose producer is PyTorch
(both exporters write ``producer_name = "pytorch"``) and the graph API's BatchNorm layers follow
PyTorch; other models follow the specification; ``build_program(running_stats=...)`` chooses.
Each PyTorch path is run for 20 SGD steps beside ``torch.nn`` with the statistics compared after
every step, through ``Module`` with its native CPU kernels and without them.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import traingraph as tg
from test_exported_gradients import export
from traingraph import artifacts, optim
from traingraph import layers as L
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.errors import ModelError
from traingraph.graph import init
from traingraph.losses import CrossEntropyLoss
from traingraph.program import build_program
from traingraph.runtime.session import SessionConfig

STEPS = 20
BATCH = 4
LR = 0.1
# Few values per channel (64 and 16), where the unbiased variance is 1.6% and 6.7% larger.
BUFFERS = ("bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var")
RTOL, ATOL = 5e-5, 1e-6  # float32 rounding over 20 steps; the biased update is 1e-3 or more off


class Net(nn.Module):
    """Two Conv-BatchNorm-ReLU blocks (torch's default momentum and 0.3) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(6, momentum=0.3)
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.bn2(self.conv2(h))).mean(dim=(2, 3)))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().train()


def _export(exporter: str) -> onnx.ModelProto:
    """``Net`` with a dynamic batch, training-mode BatchNorm kept (dynamo: ``optimize=False``)."""
    return export(_net(), torch.randn(BATCH, 3, 4, 4), exporter, output="logits")


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        ((rng.standard_normal((BATCH, 3, 4, 4)) * 2 + 1).astype(np.float32),
         rng.integers(0, 3, BATCH).astype(np.int64))
        for _ in range(STEPS)
    ]  # fmt: skip


def _torch_steps(reference: nn.Module, batches) -> list[dict[str, np.ndarray]]:
    """The running statistics of ``reference`` after each SGD step on ``batches``."""
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    after = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        state = reference.state_dict()
        after.append({n: state[n].numpy().copy() for n in BUFFERS})
    return after


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def exported(request, tmp_path_factory):
    """The exporter's model and its SGD artifacts."""
    model = _export(request.param)
    assert model.producer_name == "pytorch"
    directory = tmp_path_factory.mktemp(request.param)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=LR),
        artifact_directory=directory,
    )  # fmt: skip
    return request.param, directory


@pytest.mark.parametrize("native", [True, False], ids=["native", "graph"])
def test_exported_model_keeps_torch_running_stats_for_20_steps(exported, native):
    """After every step the running statistics equal torch's to float32 rounding, with the
    Module's native CPU kernels (its defaults) and without them."""
    _, directory = exported
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig() if native else SessionConfig(native_segments=False)
    module = Module(directory / "training_model.onnx", state, session_config=config)
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    reference = _net()
    # Start from the exported values (tracing in training mode may have moved the buffers).
    reference.load_state_dict(
        {n: torch.from_numpy(p.data.copy()) for n, p in state.parameters.items()}, strict=False
    )
    batches = _batches()
    expected = _torch_steps(reference, batches)
    for step, ((x, y), want) in enumerate(zip(batches, expected)):
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        for name in BUFFERS:
            np.testing.assert_allclose(
                state.parameters[name].data, want[name], rtol=RTOL, atol=ATOL,
                err_msg=f"{name} after step {step + 1}",
            )  # fmt: skip


def _running_var_after_one_step(model: onnx.ModelProto, **kwargs) -> np.ndarray:
    """bn2's running variance after one train step of ``build_program(model, **kwargs)``."""
    program = build_program(model, loss=CrossEntropyLoss(), **kwargs)
    session = ort.InferenceSession(
        program.train_model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    x, y = _batches()[0]
    feeds = {i.name: program.parameters.get(i.name) for i in session.get_inputs()}
    feeds.update(dict(zip(program.input_names, (x, y))))
    outputs = [o.name for o in session.get_outputs()]
    (update,) = [n for n in outputs if n.startswith("bn2.running_var")]
    return session.run([update], feeds)[0]


def test_onnx_spec_for_other_producers_and_the_choice_overrides():
    """A model not made by PyTorch gets the specification's biased update; ``running_stats``
    overrides the producer's default either way; another value is refused."""
    model = _export("torchscript")
    torch_like = _running_var_after_one_step(model)
    assert np.array_equal(_running_var_after_one_step(model, running_stats="torch"), torch_like)
    spec_like = _running_var_after_one_step(model, running_stats="onnx")
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.producer_name = "another exporter"
    assert np.array_equal(_running_var_after_one_step(other), spec_like)
    assert np.array_equal(_running_var_after_one_step(other, running_stats="torch"), torch_like)
    # running = (1 - m) * old + m * var; the two differ by m * var / (n - 1), n = 16 for bn2.
    reference = _net()
    with torch.no_grad():
        reference.bn2.running_var.fill_(1.0)
        x = torch.from_numpy(_batches()[0][0])
        reference(x)
        h = reference.conv2(torch.relu(reference.bn1(reference.conv1(x))))
        n = h.numel() // h.shape[1]
        biased = h.var(dim=(0, 2, 3), unbiased=False).numpy()
    initial = onnx.numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "bn2.running_var")
    )
    np.testing.assert_allclose(torch_like - spec_like, 0.3 * biased / (n - 1), rtol=1e-4)
    np.testing.assert_allclose(spec_like, 0.7 * initial + 0.3 * biased, rtol=1e-5, atol=1e-6)
    with pytest.raises(ModelError, match="running_stats is 'pytorch'; expected one of"):
        build_program(model, loss=CrossEntropyLoss(), running_stats="pytorch")


def _graph_api_trainer() -> tg.TrainingGraph:
    """``Net`` in the graph API."""
    init.manual_seed(0)
    g = tg.Graph("net")
    x = g.input("x", shape=[None, 3, 4, 4])
    h = L.Conv2d(3, 4, 3, padding=1, bias=False, name="conv1")(x)
    h = L.ReLU()(L.BatchNorm2d(4, name="bn1")(h))
    h = L.Conv2d(4, 6, 3, stride=2, padding=1, name="conv2")(h)
    h = L.ReLU()(L.BatchNorm2d(6, momentum=0.3, name="bn2")(h))
    h = L.Flatten()(L.GlobalAvgPool()(h))
    g.output("logits", L.Linear(6, 3, name="fc")(h))
    train = tg.TrainingGraph([g], loss=tg.losses.CrossEntropyLoss(), optimizer=tg.optim.SGD(LR))
    train.add_inputs({"x": x}, loss_labels={"y": tg.TensorSpec([None], "int64")})
    return train.compile("cpu")


def test_graph_api_batch_norm_keeps_torch_running_stats_for_20_steps():
    train = _graph_api_trainer()
    reference = _net()
    reference.load_state_dict(
        {n: torch.from_numpy(v.copy()) for n, v in train.get_parameters().items()}, strict=False
    )
    batches = _batches()
    expected = _torch_steps(reference, batches)
    for step, ((x, y), want) in enumerate(zip(batches, expected)):
        train.execute({"x": x}, loss_labels={"y": y})
        got = train.get_parameters()
        for name in BUFFERS:
            np.testing.assert_allclose(
                got[name], want[name], rtol=RTOL, atol=ATOL,
                err_msg=f"{name} after step {step + 1}",
            )  # fmt: skip


def test_onnxblock_training_block_keeps_torch_running_stats():
    """A TrainingBlock over a PyTorch export updates the running statistics as torch does."""
    from traingraph import onnxblock

    model = _export("torchscript")
    names = [t.name for t in model.graph.initializer]
    running = [n for n in names if "running_" in n]
    trained = [n for n in names if n not in running and "num_batches" not in n]

    class Training(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, logits):
            return self.loss(logits)

    block = Training()
    for name in trained:
        block.requires_grad(name)
    for name in running:
        block.requires_grad(name, False)
    with onnxblock.base(model):
        block("logits")
    training, _ = block.to_model_proto()
    params = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    x, y = _batches()[0]
    feeds = {"x": x, "labels": y}
    for value in training.graph.input:
        if value.name in params:
            feeds[value.name] = params[value.name]
        elif value.name.endswith("_grad.accumulation.buffer"):
            feeds[value.name] = np.zeros_like(params[value.name.split("_grad.")[0]])
    feeds["lazy_reset_grad"] = np.array([True])
    wanted = [f"{name}_updated" for name in BUFFERS]
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(BUFFERS, session.run(wanted, feeds)))
    reference = _net()  # from the exported values: the export's trace moved the statistics
    reference.load_state_dict(
        {n: torch.from_numpy(params[n].copy()) for n in reference.state_dict() if n in params},
        strict=False,
    )
    reference(torch.from_numpy(x))
    state = reference.state_dict()
    for name in BUFFERS:
        np.testing.assert_allclose(got[name], state[name].numpy(), rtol=RTOL, atol=ATOL)
