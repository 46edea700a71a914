"""Loading a training model on the CPU does work that grows with its distinct layers, not with
how often a layer repeats: the numeric checks of the native kernels run one onnxruntime
session per kind of kernel and one check per distinct form and shape, and shape inference
runs once per kind, however many blocks the network stacks. Wall time on a shared machine is
noise; these counts are not. ``benchmarks/load_time.py`` times torchvision models."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from torch_models import export, seeded
from traingraph import api, artifacts
from traingraph.runtime import step
from traingraph.runtime.cpu.kernels import batch_norm, conv_grads
from traingraph.runtime.cpu.native import AVAILABLE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + x)


class _Stack(nn.Module):
    """A stem (Conv, BatchNorm, Relu, MaxPool), ``blocks`` identical residual blocks, and a
    classifier."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.blocks = nn.Sequential(*(_Block(8) for _ in range(blocks)))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _artifacts(directory: Path, blocks: int) -> Path:
    model = export(seeded(_Stack, blocks=blocks), torch.zeros(2, 3, 12, 12), training=True)
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=directory,
    )
    return directory


@contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts, while loading: the onnxruntime sessions created other than the step's own (the
    checks'), the shape inferences other than those of the step's sessions (each segment's
    provider rewrite infers its own small model's shapes), and the checks each kernel kind's
    numeric verification computes."""
    counts: Counter[str] = Counter()
    depth = [0]  # > 0 inside the creation of one of the step's sessions

    def counted(key: str, function: Callable[..., Any], *, outside: bool = True) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not outside or not depth[0]:
                counts[key] += 1
            return function(*args, **kwargs)

        return wrapper

    def step_session(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            return create_session(*args, **kwargs)
        finally:
            depth[0] -= 1

    create_session = step.create_session
    monkeypatch.setattr(step, "create_session", step_session)
    monkeypatch.setattr(ort, "InferenceSession", counted("sessions", ort.InferenceSession))
    inference = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counted("inferences", inference))
    bn_compute = batch_norm.BatchNormGrad.compute
    monkeypatch.setattr(batch_norm.BatchNormGrad, "compute", counted("bn checks", bn_compute))
    monkeypatch.setattr(conv_grads, "compute", counted("conv checks", conv_grads.compute))
    yield counts


def _load(directory: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], api.Module]:
    state = api.CheckpointState.load_checkpoint(directory / "checkpoint")
    with monkeypatch.context() as patch, _counting(patch) as counts:
        module = api.Module(directory / "training_model.onnx", state)
    return counts, module


def test_loading_work_does_not_grow_with_repeated_blocks(tmp_path, monkeypatch):
    loads = {}
    for blocks in (2, 5):
        directory = _artifacts(tmp_path / str(blocks), blocks)
        loads[blocks] = _load(directory, monkeypatch)
    (few, small), (many, large) = loads[2], loads[5]
    # every BatchNorm gradient of both networks runs natively: a check of one block decides
    # for the blocks of its form
    matched = [
        sum(isinstance(k, batch_norm.BatchNormGrad) for k in module.step.runner._plan.all_kernels)
        for module in (small, large)
    ]
    assert matched == [1 + 2 * 2, 1 + 2 * 5]
    assert few["bn checks"] > 0 and few["conv checks"] > 0 and few["sessions"] > 0
    for key in ("sessions", "inferences", "bn checks", "conv checks"):
        assert many[key] <= few[key], (key, few, many)
    # the step itself has a session per segment, which grows with the blocks
    assert len(large.step.runner._runners) > len(small.step.runner._runners)
