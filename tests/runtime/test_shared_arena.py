"""CPU sessions sharing onnxruntime's process-wide arena (``SessionConfig.shared_arena``): a
segmented step's sessions, and two Modules stepped in turn in one process, compute what
sessions with arenas of their own compute, and the graph as written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gradcheck import assert_same_training
from torch_models import ResidualNet, export, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.native import AVAILABLE
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def _directory(tmp_path):
    model = seeded(ResidualNet)
    artifacts.generate_artifacts(
        export(model, torch.zeros(4, 3, 10, 10), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    return model, tmp_path


class _Trainer:
    """A Module and its Optimizer on the artifacts, recording losses and gradients."""

    def __init__(self, directory, config: SessionConfig) -> None:
        self.state = CheckpointState.load_checkpoint(directory / "checkpoint")
        self.module = Module(directory / "training_model.onnx", self.state, session_config=config)
        self.optimizer = Optimizer(directory / "optimizer_model.onnx", self.module)
        self.losses: list[float] = []
        self.grads: list[dict[str, np.ndarray]] = []

    def step(self, x: np.ndarray, y: np.ndarray) -> None:
        self.losses.append(float(self.module(x, y)))
        parameters = self.state.parameters.items()
        self.grads.append({n: p.grad.copy() for n, p in parameters if p.grad is not None})
        self.optimizer.step()
        self.module.lazy_reset_grad()

    def result(self):
        params = {n: p.data.copy() for n, p in self.state.parameters.items()}
        return self.losses, self.grads, params


def _env_allocators(session) -> bool:
    """Whether ``session`` was created to allocate from the process-wide allocators."""
    try:
        entry = session.get_session_options().get_session_config_entry(
            "session.use_env_allocators"
        )
    except RuntimeError:  # onnxruntime raises for an entry never set
        return False
    return entry == "1"


def _sessions(module: Module) -> list:
    runner = module.step.runner
    assert isinstance(runner, segments.SegmentedRunner)
    return [r.session for r in runner._runners if r is not None]


def test_two_modules_on_the_shared_arena_train_as_with_their_own(tmp_path):
    torch_model, directory = _directory(tmp_path)
    shared = [_Trainer(directory, SessionConfig()) for _ in range(2)]
    own = _Trainer(directory, SessionConfig(shared_arena=False))
    graph = _Trainer(
        directory, SessionConfig(shared_arena=False, native_segments=False, native_conv_grads=False)
    )
    for trainer in shared:
        sessions = _sessions(trainer.module)
        assert len(sessions) > 1
        assert all(_env_allocators(s) for s in sessions)
    assert not any(_env_allocators(s) for s in _sessions(own.module))
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((n, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, n))
        for n in (4, 4, 3, 4)  # a new batch size reallocates the values between segments
    ]
    for x, y in batches:  # each step of one Module between steps of the others
        for trainer in (*shared, own, graph):
            trainer.step(x, y)

    first, second = (trainer.result() for trainer in shared)
    reference = own.result()
    for got in (first, second):  # the same kernels in the same order: the same numbers
        np.testing.assert_array_equal(got[0], reference[0])
        for step, expected in zip(got[1], reference[1]):
            for name in expected:
                np.testing.assert_array_equal(step[name], expected[name], err_msg=name)
        for name in reference[2]:
            np.testing.assert_array_equal(got[2][name], reference[2][name], err_msg=name)
    assert_same_training(first, graph.result(), one_scale=True)

    # and the first step against torch.autograd in float64
    x, y = batches[0]
    model64 = torch_model.double().train()
    loss = nn.functional.cross_entropy(model64(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(first[0][0], loss.item(), rtol=1e-5)
    scale = max(p.grad.abs().max().item() for p in model64.parameters())
    for name, param in model64.named_parameters():
        np.testing.assert_allclose(
            first[1][0][name], param.grad.numpy(), rtol=1e-3, atol=1e-5 * scale, err_msg=name
        )
