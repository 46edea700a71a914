"""PyTorch eager: the benchmark model in ``torch.nn``, ``torch.optim`` (foreach AdamW / SGD).

Config keys: ``threads`` (``torch.set_num_threads``; 0 leaves torch's default; ``--threads``
sets it too), ``compile``
(wrap the model in ``torch.compile``; ``torch_compile.py`` sets it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from common import load_entry, parse_args, report, timed_loop  # noqa: E402


def run(system: str, argv: list[str] | None = None, compile_model: bool = False) -> None:
    """Time ``system`` (eager, or ``torch.compile`` with ``compile_model``) on one entry."""
    args = parse_args(argv)
    start = time.perf_counter()
    import torch

    from benchmarks import models

    config = json.loads(args.config)
    threads = int(config.get("threads") or args.threads)
    if threads:
        torch.set_num_threads(threads)
    meta, weights, data = load_entry(args.entry)
    module = models.build(meta["name"], dropout=meta["dropout"])
    module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    module.train()
    optimizer = models.torch_optimizer(meta["name"], module.parameters())
    forward = torch.compile(module) if compile_model else module

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(forward(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        return loss.item()

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args)
    report(system, meta, times, losses, setup, config=config, threads=torch.get_num_threads())


if __name__ == "__main__":
    run("torch_eager")
