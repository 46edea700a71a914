"""The model zoo: a correctness table against PyTorch, and the zoo set of ``traingraph bench``.

Run as a script, it prints the correctness table. For each zoo model
(``tests/zoo/cases.py``) and exporter, it runs what the zoo test checks
(:func:`zoo.harness.run_case`: export through ``traingraph.from_torch``, artifacts, gradients
against float64 torch, 20 optimizer steps against ``torch.optim``, the inference model against
the eval graph) and then times the train step (forward, backward, optimizer update) of
traingraph and of torch eager in float32, in alternating runs, and prints one row per model:

- grad err: the largest parameter-gradient distance from float64 torch, relative to that
  gradient's norm, of traingraph and (in parentheses) of torch float32;
- curve err: the largest relative distance of the loss from torch float64's over the steps, of
  traingraph and (in parentheses) of torch float32; then ``ok``, or ``FAIL`` where a check
  of the zoo test fails;
- ms/step: medians of the alternating runs, traingraph, torch eager, and torch's time over
  traingraph's (above 1: traingraph is faster);
- load s: the time ``Module(...)`` takes on the artifacts.

The zoo set (:data:`BENCH_MODELS`) is what ``traingraph bench --zoo`` runs against every peer:
models people train, at realistic small-batch CPU settings, built in code with a fixed seed (no
download). Their dropout probabilities are 0, so that every system's losses can be compared.
:func:`prepare_entry` writes one model's cache entry (``benchmarks/models.py`` describes the
format): the ONNX export through ``traingraph.from_torch`` (TorchScript exporter, opset 17, the
batch fixed), which traingraph and onnxruntime-training read, and a ``torch.export`` program of
the model with its loss (``program.pt2``), which ExecuTorch lowers.

Usage:
    python benchmarks/zoo.py                       # the default (fast) zoo, both exporters
    python benchmarks/zoo.py --slow                # with the large models
    python benchmarks/zoo.py --models resnet18 unet --exporters dynamo --repeats 9
    traingraph bench --zoo                          # the zoo set against every peer
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

if TYPE_CHECKING:
    from zoo.harness import CaseReport

# ------------------------------------------------------------------ the zoo set of the benchmark
SEED = 0
BATCHES = 4
"""Distinct batches in a zoo entry's data file; the steps cycle through them."""
OPSET = 17
LR = 1e-3
MOMENTUM = 0.9
WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class BenchModel:
    """One model of the zoo set: how to build it, its batch, its data and its optimizer.

    Attributes:
        name: The model's name on the command line and in the cache.
        build: The torch module (called after ``torch.manual_seed(SEED)``); its output is one
            tensor of logits ``(N, C)`` or ``(N, C, T)``, trained with cross-entropy.
        batch: The batch size.
        input_shape: One sample's input shape (float32 images, or int64 token ids).
        classes: The number of classes (or tags, or vocabulary entries) of the logits.
        labels: ``"class"`` (one per sample), ``"tag"`` (one per token) or ``"next"`` (the
            next token at each position but the last).
        optimizer: ``"sgd"`` (with momentum) or ``"adamw"``.
        description: One line for the table.
    """

    name: str
    build: Callable[[], Any]
    batch: int
    input_shape: tuple[int, ...]
    classes: int
    labels: str
    optimizer: str
    description: str

    @property
    def tokens(self) -> bool:
        """Whether the input is token ids (int64) rather than images (float32)."""
        return len(self.input_shape) == 1


def zero_dropout(model: Any) -> Any:
    """Set every Dropout's and StochasticDepth's probability to 0 (losses stay comparable)."""
    for module in model.modules():
        if hasattr(module, "p") and type(module).__name__ in (
            "Dropout",
            "Dropout1d",
            "Dropout2d",
            "StochasticDepth",
        ):
            module.p = 0.0
    return model


def _classifier(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from zoo.torchvision_import import torchvision_models

        return getattr(torchvision_models(), name)(num_classes=10)

    return build


def _vit_tiny() -> Any:
    """ViT-Tiny's configuration (patch 16, 12 layers, 3 heads, width 192, MLP 768)."""
    from zoo.torchvision_import import torchvision_models

    vit = torchvision_models().vision_transformer
    return vit.VisionTransformer(
        image_size=112,
        patch_size=16,
        num_layers=12,
        num_heads=3,
        hidden_dim=192,
        mlp_dim=768,
        num_classes=10,
    )


def _transformers() -> Any:
    from zoo.torchvision_import import torchvision_models

    torchvision_models()  # transformers imports torchvision
    import transformers

    return transformers


class Logits(nn.Module):
    """A Hugging Face model as a module of ``input_ids`` returning its logits ``(N, C)``, or
    with ``next_token`` the next-token logits ``(N, V, T - 1)``."""

    def __init__(self, model: nn.Module, next_token: bool) -> None:
        super().__init__()
        self.model = model
        self.next_token = next_token

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return logits[:, :-1].transpose(1, 2) if self.next_token else logits


def _bert_mini() -> Any:
    """BERT-mini (4 layers, width 256, 4 heads, BERT's vocabulary) classifying sequences."""
    tf = _transformers()
    config = tf.BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return Logits(tf.BertForSequenceClassification(config), next_token=False)


def _gpt2_stack() -> Any:
    """GPT-2 small's decoder layers (width 768, 12 heads), 2 of them, as a language model
    over a vocabulary of 2048 tokens (the head tied to the embedding)."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=2048,
        n_positions=128,
        n_embd=768,
        n_layer=2,
        n_head=12,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Logits(tf.GPT2LMHeadModel(config), next_token=True)


class LSTMTagger(nn.Module):
    """Embeddings (5000 x 128), a two-layer bidirectional LSTM of width 256, and a linear
    layer to 17 tags at every token: logits ``(N, 17, T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True, bidirectional=True)
        self.tags = nn.Linear(512, 17)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.tags(out).transpose(1, 2)


def _lstm_tagger() -> nn.Module:
    return LSTMTagger()


BENCH_MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel(
            "resnet18", _classifier("resnet18"), 16, (3, 112, 112), 10, "class", "sgd",
            "torchvision resnet18, 3x112x112, SGD momentum",
        ),
        BenchModel(
            "resnet50", _classifier("resnet50"), 16, (3, 112, 112), 10, "class", "sgd",
            "torchvision resnet50, 3x112x112, SGD momentum",
        ),
        BenchModel(
            "mobilenet_v3_small", _classifier("mobilenet_v3_small"), 32, (3, 128, 128), 10,
            "class", "sgd", "torchvision mobilenet_v3_small, 3x128x128, SGD momentum",
        ),
        BenchModel(
            "efficientnet_b0", _classifier("efficientnet_b0"), 32, (3, 128, 128), 10, "class",
            "sgd", "torchvision efficientnet_b0, 3x128x128, SGD momentum",
        ),
        BenchModel(
            "vit_tiny", _vit_tiny, 16, (3, 112, 112), 10, "class", "adamw",
            "ViT-Tiny (torchvision VisionTransformer: 12 layers, width 192, 3 heads, patch 16),"
            " 3x112x112, AdamW",
        ),
        BenchModel(
            "bert_mini", _bert_mini, 16, (128,), 2, "class", "adamw",
            "BERT-mini (transformers: 4 layers, width 256, 4 heads, vocabulary 30522) sequence"
            " classifier, sequence 128, AdamW",
        ),
        BenchModel(
            "gpt2_stack", _gpt2_stack, 4, (128,), 2048, "next", "adamw",
            "2 GPT-2-small decoder layers (transformers: width 768, 12 heads), vocabulary 2048,"
            " next-token loss, sequence 128, AdamW",
        ),
        BenchModel(
            "lstm_tagger", _lstm_tagger, 32, (64,), 17, "tag", "sgd",
            "LSTM tagger (embedding 128, 2-layer bidirectional LSTM 256, 17 tags),"
            " sequence 64, SGD momentum",
        ),
    )
}  # fmt: skip
"""The zoo set, cheapest last."""


def bench_model(name: str) -> BenchModel:
    """The zoo set's model ``name`` (a key of :data:`BENCH_MODELS`)."""
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {list(BENCH_MODELS)}")
    return BENCH_MODELS[name]


def build(name: str) -> Any:
    """The torch module of zoo model ``name`` in train mode, seeded with :data:`SEED`, its
    dropout probabilities at 0."""
    torch.manual_seed(SEED)
    return zero_dropout(bench_model(name).build()).train()


def make_data(model: BenchModel, batch: int) -> dict[str, np.ndarray]:
    """:data:`BATCHES` batches of inputs ``x`` and labels ``y`` of ``batch`` samples each."""
    rng = np.random.default_rng(SEED)
    shape = (BATCHES, batch, *model.input_shape)
    if model.tokens:
        x = rng.integers(0, model.classes if model.labels == "next" else 1000, shape)
        if model.labels == "next":
            return {"x": x, "y": x[:, :, 1:].copy()}
        label_shape = shape if model.labels == "tag" else shape[:2]
        return {"x": x, "y": rng.integers(0, model.classes, label_shape)}
    x = rng.standard_normal(shape, dtype=np.float32)
    return {"x": x, "y": rng.integers(0, model.classes, shape[:2])}


def entry_name(name: str, batch: int | None) -> str:
    """The cache entry of zoo model ``name``, with a suffix where the batch is not its own."""
    return name if batch is None or batch == bench_model(name).batch else f"{name}-b{batch}"


def prepare_entry(name: str, cache: Path, batch: int | None = None) -> Path:
    """Write (once) the cache entry of zoo model ``name`` and return its directory.

    Args:
        name: A key of :data:`BENCH_MODELS`.
        cache: The cache directory.
        batch: The batch size (None: the model's own); a smaller one makes quick tests.
    """
    directory = Path(cache) / entry_name(name, batch)
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        return directory
    import onnx
    from torch.utils.flop_counter import FlopCounterMode

    from traingraph import from_torch

    info = bench_model(name)
    size = batch or info.batch
    directory.mkdir(parents=True, exist_ok=True)
    module = build(name)
    data = make_data(info, size)
    np.savez(directory / "data.npz", **data)
    weights = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    np.savez(directory / "weights.npz", **weights)
    x, y = torch.from_numpy(data["x"][0]), torch.from_numpy(data["y"][0])
    proto = from_torch(
        module,
        (x,),
        dynamic_axes=None,
        exporter="torchscript",
        opset=OPSET,
        input_names=["x"],
        output_names=["logits"],
    )
    onnx.save(proto, directory / "model.onnx")
    torch.export.save(
        torch.export.export(WithLoss(module), (x, y), strict=False), directory / "program.pt2"
    )
    counter = FlopCounterMode(display=False)
    recurrent: list[int] = []  # the counter does not see the fused LSTM/GRU kernels
    hooks = [
        m.register_forward_hook(lambda m, args, out: recurrent.append(_recurrent_flops(m, args[0])))
        for m in module.modules()
        if isinstance(m, torch.nn.RNNBase)
    ]
    with counter, torch.no_grad():
        module(x)
    for hook in hooks:
        hook.remove()
    meta = {
        "name": name,
        "zoo": True,
        "description": f"{info.description}, batch {size}",
        "batch": size,
        "optimizer": info.optimizer,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "momentum": MOMENTUM,
        "dropout": 0.0,
        "trainable": [n for n, p in module.named_parameters() if p.requires_grad],
        "parameters": int(sum(p.numel() for p in module.parameters())),
        # backward as twice the forward: the counter's formula for the backward of grouped
        # Convs ignores the groups (33x too many for mobilenet_v3_small)
        "train_flops": 3 * (int(counter.get_total_flops()) + sum(recurrent)),
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return directory


class WithLoss(nn.Module):
    """A model and its cross-entropy loss: ``forward(x, y)`` returns the loss alone, as
    ExecuTorch's training export takes it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)


def _row(report: CaseReport) -> str:
    tg, t32, _ = report.gradients.worst()
    curve = report.curve
    ok = not report.problems()
    assert report.step_ms is not None
    ours, eager = report.step_ms
    return (
        f"{report.case:<30} {report.exporter:<12} {tg:8.1e} ({t32:7.1e}) "
        f"{max(curve.errors()):8.1e} ({max(curve.torch32_errors()):7.1e}) "
        f"{'ok' if ok else 'FAIL':<5}{ours:9.1f} {eager:9.1f} {eager / ours:6.2f}x"
        f" {report.load_s:7.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    """The correctness table of the zoo's test cases (see the module's docstring)."""
    from zoo.cases import CASES
    from zoo.harness import EXPORTERS, run_case

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", action="store_true", help="include the large models")
    parser.add_argument("--models", nargs="*", help="only these cases (by name)")
    parser.add_argument(
        "--exporters", nargs="*", default=list(EXPORTERS), choices=EXPORTERS, help="exporters"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="alternating timing runs per model (5 steps each)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads of traingraph and torch (0: defaults)"
    )
    args = parser.parse_args(argv)
    cases = [
        c
        for c in CASES
        if (args.slow or not c.slow) and (not args.models or c.name in args.models)
    ]
    if not cases:
        parser.error(f"no case matches; the cases are {[c.name for c in CASES]}")
    print(
        f"{'model':<30} {'exporter':<12} {'grad err (torch32)':<19}"
        f" {'curve err (torch32)':<19} {'':<5}{'tg ms':>9} {'torch ms':>9} {'ratio':>7}"
        f" {'load s':>7}"
    )
    failed = False
    for case in cases:
        for exporter in args.exporters:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        report = run_case(
                            case, exporter, Path(tmp), args.threads, args.repeats
                        )
                except Exception as error:  # a failing model is a row, not the end of the table
                    failed = True
                    message = str(error).splitlines()[0][:120] if str(error) else ""
                    name = type(error).__name__
                    print(f"{case.name:<30} {exporter:<12} error: {name}: {message}")
                    continue
            print(_row(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


def _recurrent_flops(rnn: Any, x: Any) -> int:
    """Forward multiply-add FLOPs of an ``nn.LSTM``/``nn.GRU``/``nn.RNN`` on input ``x``: each
    step of each layer and direction multiplies [x_t, h_{t-1}] by the gates' weights."""
    gates = {"LSTM": 4, "GRU": 3}.get(rnn.mode, 1)
    steps = x.shape[1] if rnn.batch_first else x.shape[0]
    batch = x.shape[0] if rnn.batch_first else x.shape[1]
    directions = 2 if rnn.bidirectional else 1
    total = 0
    for layer in range(rnn.num_layers):
        inputs = rnn.input_size if layer == 0 else rnn.hidden_size * directions
        total += 2 * steps * batch * gates * rnn.hidden_size * (inputs + rnn.hidden_size)
    return total * directions
