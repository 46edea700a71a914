"""The benchmark models in PyTorch, and the cache every system reads its weights and data from.

Each model is built with a fixed seed, exported once to ONNX (training mode, static shapes:
the batch size is fixed, so every system can plan for it),
and saved with its initial weights (``weights.npz``, torch ``state_dict`` names) and its data
(``data.npz``: ``x`` and ``y`` stacked per batch) under ``<cache>/<model>/``. Every system
loads these files, so all of them start from the same weights and see the same batches.

The zoo set's entries (``benchmarks/zoo.py``, ``traingraph bench --zoo``) have the same files,
the ONNX export made by ``traingraph.from_torch``, and ``program.pt2``, the ``torch.export``
program of the model with its loss, for ExecuTorch. A pinned peer keeps what it builds from an
entry beside it (``peers/common.py``: ``cached_build``).

Example:
    >>> spec = prepare("mlp", Path("/tmp/tg-bench"))
    >>> spec.meta["train_flops"]
    52363264

    $ python benchmarks/models.py mlp lenet --cache /tmp/tg-bench
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
BATCHES = 8  # distinct batches in the data file; steps cycle through them
OPSET = 17


@dataclass(frozen=True)
class ModelInfo:
    """What a benchmark model is and how it is trained."""

    name: str
    batch: int
    input_shape: tuple[int, ...]
    classes: int
    optimizer: str  # "adamw" or "sgd"
    lr: float
    description: str


MODELS: dict[str, ModelInfo] = {
    "mlp": ModelInfo("mlp", 64, (784,), 10, "adamw", 1e-3, "MLP 784-256-10, AdamW"),
    "lenet": ModelInfo(
        "lenet", 64, (1, 28, 28), 10, "sgd", 0.01, "LeNet CNN 1x28x28, SGD momentum 0.9"
    ),
    "resnet8": ModelInfo(
        "resnet8", 32, (3, 32, 32), 10, "adamw", 1e-3, "ResNet-8 3x32x32, BatchNorm, AdamW"
    ),
    "transformer": ModelInfo(
        "transformer",
        16,
        (64, 128),
        10,
        "adamw",
        1e-3,
        "Transformer encoder 2 layers d=128 h=4 seq=64, LayerNorm GELU dropout, AdamW",
    ),
}

WEIGHT_DECAY = 0.01
MOMENTUM = 0.9
DROPOUT = 0.1


def build(name: str, dropout: float = DROPOUT) -> Any:
    """The torch module of benchmark model ``name``, initialized with :data:`SEED`."""
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(784, 256)
            self.fc2 = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    class LeNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
            self.conv2 = nn.Conv2d(6, 16, 5)
            self.fc1 = nn.Linear(16 * 5 * 5, 120)
            self.fc2 = nn.Linear(120, 84)
            self.fc3 = nn.Linear(84, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
            h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
            h = torch.relu(self.fc1(h.flatten(1)))
            return self.fc3(torch.relu(self.fc2(h)))

    class Block(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.down = None
            if stride != 1 or c_in != c_out:
                self.down = nn.Sequential(
                    nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn1(self.conv1(x)))
            h = self.bn2(self.conv2(h))
            return torch.relu(h + (x if self.down is None else self.down(x)))

    class ResNet8(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(16)
            self.layer1 = Block(16, 16, 1)
            self.layer2 = Block(16, 32, 2)
            self.layer3 = Block(32, 64, 2)
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.conv(x)))
            h = self.layer3(self.layer2(self.layer1(h)))
            return self.fc(h.mean(dim=(2, 3)))

    class EncoderLayer(nn.Module):
        """``nn.TransformerEncoderLayer``'s math (post-norm, GELU) with static reshapes."""

        def __init__(self, d: int, heads: int, ff: int, batch: int, seq: int) -> None:
            super().__init__()
            self.shape = (batch, seq, heads, d // heads)
            self.qkv = nn.Linear(d, 3 * d)
            self.out = nn.Linear(d, d)
            self.linear1 = nn.Linear(d, ff)
            self.linear2 = nn.Linear(ff, d)
            self.norm1 = nn.LayerNorm(d)
            self.norm2 = nn.LayerNorm(d)
            self.drop = nn.Dropout(dropout)

        def heads(self, t: torch.Tensor) -> torch.Tensor:
            return t.reshape(self.shape).transpose(1, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, heads, dh = self.shape
            q, k, v = (self.heads(t) for t in self.qkv(x).chunk(3, dim=-1))
            scores = torch.softmax(q @ k.transpose(-2, -1) * dh**-0.5, dim=-1)
            attended = (self.drop(scores) @ v).transpose(1, 2).reshape(batch, seq, heads * dh)
            x = self.norm1(x + self.drop(self.out(attended)))
            hidden = self.drop(nn.functional.gelu(self.linear1(x)))
            return self.norm2(x + self.drop(self.linear2(hidden)))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            info = MODELS["transformer"]
            seq, d = info.input_shape
            self.layers = nn.ModuleList(
                EncoderLayer(d, 4, 4 * d, info.batch, seq) for _ in range(2)
            )
            self.fc = nn.Linear(d, info.classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.fc(x.mean(dim=1))

    classes: dict[str, Callable[[], nn.Module]] = {
        "mlp": MLP,
        "lenet": LeNet,
        "resnet8": ResNet8,
        "transformer": Transformer,
    }
    if name in zoo().BENCH_MODELS:
        return zoo().build(name)
    if name not in classes:
        raise ValueError(
            f"unknown benchmark model {name!r}; expected one of {list(classes)}"
            f" or of the zoo set {list(zoo().BENCH_MODELS)}"
        )
    torch.manual_seed(SEED)
    return classes[name]()


def zoo() -> Any:
    """``benchmarks/zoo.py``, the zoo set's models (imported by its package path, as the test
    package ``zoo`` that it reads from has the same name)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import zoo as module

    return module


def torch_optimizer(name: str, params: Any) -> Any:
    """The torch optimizer of model ``name`` with the benchmark's hyperparameters."""
    import torch

    if name in MODELS:
        kind, lr = MODELS[name].optimizer, MODELS[name].lr
    else:
        kind, lr = zoo().bench_model(name).optimizer, zoo().LR
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, foreach=True)


def make_data(name: str) -> dict[str, np.ndarray]:
    """:data:`BATCHES` batches of inputs ``x`` and integer labels ``y``, from :data:`SEED`."""
    info = MODELS[name]
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((BATCHES, info.batch, *info.input_shape)).astype(np.float32)
    y = rng.integers(0, info.classes, (BATCHES, info.batch)).astype(np.int64)
    return {"x": x, "y": y}


@dataclass
class Prepared:
    """Paths of one model's cache entry and its metadata."""

    directory: Path
    meta: dict[str, Any]

    @property
    def onnx_path(self) -> Path:
        return self.directory / "model.onnx"

    @property
    def weights_path(self) -> Path:
        return self.directory / "weights.npz"

    @property
    def data_path(self) -> Path:
        return self.directory / "data.npz"


def _train_flops(module: Any, x: Any, y: Any) -> int:
    """FLOPs of one forward + backward pass, counted by ``torch.utils.flop_counter``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss = torch.nn.functional.cross_entropy(module(x), y)
        loss.backward()
    module.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def prepare(name: str, cache: Path, dropout: float = DROPOUT) -> Prepared:
    """Write (once) the ONNX export, weights, data and metadata of model ``name``.

    Args:
        name: A key of :data:`MODELS`.
        cache: The cache directory; the entry goes to ``cache/<name>`` (with a ``-nodrop`` suffix
            when ``dropout`` is 0 and the model has dropout).
        dropout: Dropout probability of the Transformer (0 for exact loss comparisons).
    """
    suffix = "-nodrop" if name == "transformer" and dropout == 0 else ""
    directory = Path(cache) / f"{name}{suffix}"
    meta_path = directory / "meta.json"
    if meta_path.is_file():
        return Prepared(directory, json.loads(meta_path.read_text()))
    import onnx
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    info = MODELS[name]
    module = build(name, dropout)
    data = make_data(name)
    np.savez(directory / "data.npz", **data)
    np.savez(
        directory / "weights.npz",
        **{k: v.detach().numpy() for k, v in module.state_dict().items()},
    )
    module.train()
    example = torch.from_numpy(data["x"][0])
    buffer = io.BytesIO()
    torch.onnx.export(
        module,
        (example,),
        buffer,
        input_names=["x"],
        output_names=["logits"],
        opset_version=OPSET,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        dynamo=False,
    )
    exported = onnx.shape_inference.infer_shapes(
        onnx.load_from_string(buffer.getvalue()), data_prop=True
    )
    onnx.save(exported, directory / "model.onnx")
    flops = _train_flops(module, example, torch.from_numpy(data["y"][0]))
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    meta = {
        "name": name,
        "description": info.description,
        "batch": info.batch,
        "optimizer": info.optimizer,
        "lr": info.lr,
        "weight_decay": WEIGHT_DECAY,
        "momentum": MOMENTUM,
        "dropout": dropout if name == "transformer" else 0.0,
        "trainable": trainable,
        "parameters": int(sum(p.numel() for p in module.parameters())),
        "train_flops": flops,
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return Prepared(directory, meta)


def load(directory: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(meta, weights, data)`` of a prepared cache entry."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    with np.load(directory / "weights.npz") as w:
        weights = {k: w[k] for k in w.files}
    with np.load(directory / "data.npz") as d:
        data = {k: d[k] for k in d.files}
    return meta, weights, data


def main(argv: list[str] | None = None) -> None:
    """Write the cache entries of the models named on the command line."""
    import argparse

    parser = argparse.ArgumentParser(description="Export the benchmark models once.")
    parser.add_argument("models", nargs="+", choices=[*MODELS, *zoo().BENCH_MODELS])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--dropout", type=float, default=DROPOUT)
    parser.add_argument("--batch", type=int, default=None, help="zoo set: another batch size")
    args = parser.parse_args(argv)
    for name in args.models:
        if name in MODELS:
            prepare(name, args.cache, args.dropout)
        else:
            zoo().prepare_entry(name, args.cache, args.batch)


if __name__ == "__main__":
    main()
