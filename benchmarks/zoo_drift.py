"""How far PyTorch eager's float32 losses drift from its float64 ones on a zoo model.

The zoo benchmark (``traingraph bench --zoo``) checks each system's losses against eager's
float32 ones over the first steps; where a model's training amplifies rounding (resnet50 at
batch 16, SGD with momentum, from its random initialization), float32 itself drifts from the
exact losses by as much. This trains the cached model (``benchmarks/.envs/cache``, the same
weights, batches and optimizer as the benchmark) in float32 and in float64 with eager PyTorch
and prints the losses and their relative difference per step.

Usage:
    python benchmarks/zoo_drift.py resnet50 [--steps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent))

from common import load_entry  # noqa: E402

from benchmarks import models  # noqa: E402


def losses(name: str, dtype: torch.dtype, steps: int) -> np.ndarray:
    """The losses of ``steps`` eager steps of the cached zoo model ``name`` in ``dtype``."""
    meta, weights, data = load_entry(HERE / ".envs" / "cache" / name)
    module = models.build(meta["name"], dropout=meta["dropout"])
    module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    module = module.to(dtype).train()
    optimizer = models.torch_optimizer(meta["name"], module.parameters())
    x, y = data["x"], data["y"]
    seen = []
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        inputs = torch.from_numpy(x[i % len(x)])
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        loss = torch.nn.functional.cross_entropy(module(inputs), torch.from_numpy(y[i % len(y)]))
        loss.backward()
        optimizer.step()
        seen.append(float(loss.detach()))
    return np.array(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo model with a cache entry (e.g. resnet50)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch's threads; 0: default")
    args = parser.parse_args(argv)
    if not (HERE / ".envs" / "cache" / args.model / "meta.json").exists():
        raise SystemExit(f"no cache entry for {args.model!r}: run traingraph bench --zoo first")
    if args.threads:
        torch.set_num_threads(args.threads)
    single = losses(args.model, torch.float32, args.steps)
    double = losses(args.model, torch.float64, args.steps)
    print("| step | float32 | float64 | relative difference |")
    print("|---|---|---|---|")
    for step, (a, b) in enumerate(zip(single, double), 1):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(b):.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
