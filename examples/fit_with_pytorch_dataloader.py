"""Feed the fit loop from a PyTorch DataLoader (any iterable of numpy-convertible batches works).

Run: python examples/fit_with_pytorch_dataloader.py

The artifacts come from traingraph's demo CNN (an ONNX model); the data comes through
torch.utils.data with augmentation done in PyTorch. The fit loop converts tensors with .numpy().
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from traingraph import artifacts, optim
from traingraph.datasets import load_digits
from traingraph.demo import digits_cnn
from traingraph.fit import EarlyStopping, MetricsWriter, ModelCheckpoint, Trainer, accuracy, fit


class NoisyDigits(Dataset):
    """The embedded digits with a little Gaussian noise added to each training image."""

    def __init__(self, split: str, noise: float) -> None:
        images, labels = load_digits(split)
        self.images, self.labels = torch.from_numpy(images), torch.from_numpy(labels)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.noise:
            image = (image + self.noise * torch.randn_like(image)).clamp(0, 1)
        return image, self.labels[i]


def main(out: Path) -> None:
    artifacts.generate_artifacts(
        digits_cnn(seed=0),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=5e-3),
        artifact_directory=out / "artifacts",
        additional_output_names=["logits"],
    )
    torch.manual_seed(0)
    train = DataLoader(NoisyDigits("train", noise=0.05), batch_size=32, shuffle=True)
    test = DataLoader(NoisyDigits("test", noise=0.0), batch_size=256)

    trainer = Trainer.from_artifacts(out / "artifacts")
    state = fit(
        trainer,
        train,
        epochs=8,
        val_data=test,
        metrics={"accuracy": accuracy},
        callbacks=[
            ModelCheckpoint(out / "checkpoint"),
            MetricsWriter(out),
            EarlyStopping("val_accuracy", mode="max", patience=3),
        ],
    )
    print(f"best validation accuracy: {max(r['val_accuracy'] for r in state.history):.2%}")
    print(f"metrics written to {out / 'metrics.json'} and {out / 'metrics.csv'}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
