"""Bring your own PyTorch model: export it with from_torch, generate artifacts, train, export.

Run: python examples/bring_your_own_pytorch_model.py [OUT_DIR]

PyTorch is used only to define and export the model; training runs on onnxruntime.
``traingraph.from_torch`` exports the module in train mode (its BatchNorm trains on batch
statistics and updates its running statistics, its Dropout stays), names every parameter as
``named_parameters()`` does and checks the ONNX forward against the module's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

import traingraph
from traingraph import artifacts, optim
from traingraph.data import Batches
from traingraph.datasets import load_digits
from traingraph.fit import ModelCheckpoint, Trainer, accuracy, fit


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(16 * 4 * 4, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.max_pool2d(torch.relu(self.bn(self.conv(images))), 2))


def main(out: Path) -> float:
    # 1. Export the PyTorch model for training (train mode, torch names, dynamic batch).
    torch.manual_seed(0)
    model_path = out / "cnn.onnx"
    net = DigitsCNN()
    traingraph.from_torch(
        net,
        torch.randn(2, 1, 8, 8),
        path=model_path,
        input_names=["images"],
        output_names=["logits"],
    )

    # 2. Generate the training artifacts (the same call as onnxruntime.training.artifacts).
    artifacts.generate_artifacts(
        str(model_path),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=3e-3),
        artifact_directory=out / "artifacts",
        additional_output_names=["logits"],  # lets the fit loop report accuracy
    )

    # 3. Train with the fit loop.
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    trainer = Trainer.from_artifacts(out / "artifacts")
    state = fit(
        trainer,
        Batches((x_train, y_train), batch_size=32, seed=0),
        epochs=8,
        val_data=[(x_test, y_test)],
        metrics={"accuracy": accuracy},
        callbacks=[ModelCheckpoint(out / "checkpoint")],
    )

    # 4. Export the trained inference model and run it with plain onnxruntime.
    trainer.export(out / "cnn_trained.onnx", ["logits"])
    session = ort.InferenceSession(out / "cnn_trained.onnx", providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x_test})
    test_accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    assert abs(test_accuracy - state.history[-1]["val_accuracy"]) < 1e-6
    print(f"test accuracy of {out / 'cnn_trained.onnx'}: {test_accuracy:.2%}")
    return test_accuracy


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
