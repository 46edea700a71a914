"""Small PyTorch models exported to ONNX with fixed seeds, shared by the tests."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.session import SessionConfig


class MLP(nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 32, d_out: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class SmallCNN(nn.Module):
    """Conv-BatchNorm-ReLU-MaxPool-Dropout-Linear on 1x8x8 images."""

    def __init__(self, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(h.flatten(1)))


class RecurrentClassifier(nn.Module):
    """A bidirectional LSTM (or GRU) over ``[N, T, features]``, its last step classified."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 5, gru: bool = False):
        super().__init__()
        layer = nn.GRU if gru else nn.LSTM
        self.rnn = layer(features, hidden, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


class ResidualNet(nn.Module):
    """A stem Conv-BN-Relu on the input and a downsampling residual block: two BatchNorms read
    the same output gradient (the block's and its shortcut's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(12)
        self.conv2 = nn.Conv2d(12, 12, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(12)
        self.down = nn.Sequential(nn.Conv2d(8, 12, 1, stride=2, bias=False), nn.BatchNorm2d(12))
        self.fc = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h)))))
        return self.fc(torch.relu(out + self.down(h)).mean(dim=(2, 3)))


def export(
    model: nn.Module,
    example: torch.Tensor,
    *,
    opset: int = 17,
    training: bool = False,
    input_name: str = "x",
    output_name: str = "logits",
) -> onnx.ModelProto:
    """Export ``model`` with a dynamic batch axis (TorchScript exporter)."""
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(
        model,
        (example,),
        buffer,
        input_names=[input_name],
        output_names=[output_name],
        dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
        opset_version=opset,
        training=mode,
        do_constant_folding=False,
        dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue())


def export_dynamo(model: nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """Export ``model`` with a dynamic batch axis (at least 2) with the dynamo exporter."""
    batch = torch.export.Dim("batch", min=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (example,), dynamo=True, verbose=False, input_names=["x"],
            output_names=["logits"], dynamic_shapes={"x": {0: batch}}, opset_version=18,
        )  # fmt: skip
    assert program is not None
    buffer = io.BytesIO()
    onnx.save(program.model_proto, buffer)
    return onnx.load_from_string(buffer.getvalue())


class ChainedNorms(nn.Module):
    """A BatchNorm right after a BatchNorm: the second one's input is the first one's output
    (its input gradient is the first one's output gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)
        self.bn1, self.bn2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn2(self.bn1(self.conv(x)))).mean(dim=(2, 3)))


def seeded(cls: type[nn.Module], seed: int = 0, **kwargs: object) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs)


def classification_data(
    n: int, d_in: int, classes: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    return x, y


def residual_artifacts(directory: Path) -> Path:
    """Training artifacts of :class:`ResidualNet` (SGD with momentum) in ``directory``."""
    artifacts.generate_artifacts(
        export(seeded(ResidualNet), torch.zeros(4, 3, 10, 10), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=directory,
    )
    return directory


def train_curve(
    directory: Path,
    batches: list[tuple[np.ndarray, np.ndarray]],
    device: str = "cpu",
    session_config: SessionConfig | None = None,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train the artifacts in ``directory`` (``checkpoint``, ``training_model.onnx``,
    ``optimizer_model.onnx``) one step per batch: the losses, and the parameters after."""
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx", state, device=device, session_config=session_config
    )
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    module.train()
    losses = []
    for x, y in batches:
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    return losses, {name: p.data.copy() for name, p in state.parameters.items()}
