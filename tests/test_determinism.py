"""The same training run twice gives the same losses and parameters, to the bit, with two
threads: every gradient the runtime computes adds its terms in one order."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

from torch_models import export, seeded, train_curve
from traingraph import artifacts, optim
from traingraph.runtime.session import SessionConfig

VOCAB, WIDTH, CLASSES = 40, 256, 5


class Tagger(nn.Module):
    """Token embeddings (repeated tokens add into one row of the gradient), a LayerNorm, a
    GELU MLP and a mean over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens))
        return self.head(nn.functional.gelu(self.hidden(h)).mean(dim=1))


def test_two_runs_with_two_threads_give_the_same_bits(tmp_path) -> None:
    model = export(seeded(Tagger), torch.zeros(2, 64, dtype=torch.int64), training=True)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=tmp_path,
    )  # fmt: skip
    nodes = onnx.load(tmp_path / "training_model.onnx").graph.node
    assert any(n.op_type == "Gather" for n in nodes)
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, VOCAB, (64, 64)), rng.integers(0, CLASSES, 64)) for _ in range(4)
    ]
    config = SessionConfig(intra_op_threads=2)
    first, second = (train_curve(tmp_path, batches, session_config=config) for _ in range(2))
    assert first[0] == second[0]
    for name, value in first[1].items():
        np.testing.assert_array_equal(value, second[1][name], err_msg=name)
