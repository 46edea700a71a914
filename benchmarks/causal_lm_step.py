"""A causal language model's training step on the CPU as a user exports it, against torch eager.

The model is a GPT-2 (transformers) with a full-size vocabulary, trained on next-token
cross-entropy over ``logits[:, :-1]``. traingraph's side goes through ``traingraph.from_torch``
with its defaults (the dynamo exporter, a dynamic batch), ``generate_artifacts`` and
``Module`` / ``Optimizer`` with AdamW; torch's side is the same seeded model under
``torch.optim.AdamW``. Each side runs in its own process, alternating ``--rounds`` times; each
prints the median step time over ``--steps`` steps after ``--warmup``, the training graph's
node count, and the last loss. ``--tree`` puts another traingraph source tree first on the
path (an A/B of two commits: run this script once per tree).

    python benchmarks/causal_lm_step.py --rounds 2
    python benchmarks/causal_lm_step.py --tree OLD/src --rounds 2 --skip-torch
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _model(args: argparse.Namespace) -> Any:
    """The seeded GPT-2 LM and a function of it giving ``(N, V, T - 1)`` next-token logits."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo.torchvision_import import torchvision_models

    torchvision_models()  # transformers imports torchvision, whose CUDA ops need not load
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=args.vocab, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
        n_positions=args.sequence, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    gpt = tf.GPT2LMHeadModel(config)

    class NextToken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits[:, :-1].transpose(1, 2)

    ids = torch.randint(0, args.vocab, (args.batch, args.sequence))
    return NextToken(), ids


def _median_ms(step: Any, args: argparse.Namespace) -> tuple[float, float]:
    times, loss = [], 0.0
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup :]) * 1e3, loss


def run_traingraph(args: argparse.Namespace) -> dict[str, Any]:
    if args.tree:
        sys.path.insert(0, args.tree)
    import onnx

    import traingraph
    from traingraph import artifacts, optim
    from traingraph.api import CheckpointState, Module, Optimizer

    net, ids = _model(args)
    with tempfile.TemporaryDirectory() as out:
        model = traingraph.from_torch(net, (ids,), input_names=["ids"])
        artifacts.generate_artifacts(
            model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.AdamW(lr=1e-4),
            artifact_directory=out,
        )  # fmt: skip
        nodes = len(onnx.load(f"{out}/training_model.onnx", load_external_data=False).graph.node)
        state = CheckpointState.load_checkpoint(f"{out}/checkpoint")
        module = Module(f"{out}/training_model.onnx", state)
        optimizer = Optimizer(f"{out}/optimizer_model.onnx", module)
        x = ids.numpy()
        y = x[:, 1:].copy()

        def step() -> float:
            loss = module(x, y)
            optimizer.step()
            module.lazy_reset_grad()
            return float(loss)

        ms, loss = _median_ms(step, args)
    return {"system": "traingraph", "tree": traingraph.__file__, "nodes": nodes, "ms": ms,
            "loss": loss}  # fmt: skip


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    net, ids = _model(args)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(net(ids), ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    ms, loss = _median_ms(step, args)
    return {"system": "torch_eager", "threads": torch.get_num_threads(), "ms": ms, "loss": loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", default="", help="a traingraph src directory to import")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--child", choices=["traingraph", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run = run_traingraph if args.child == "traingraph" else run_torch
        print(json.dumps(run(args)))
        return
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
    systems = ["traingraph"] + ([] if args.skip_torch else ["torch"])
    for _ in range(args.rounds):
        for system in systems:
            command = [sys.executable, __file__, *forwarded, "--child", system]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            print(result.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
