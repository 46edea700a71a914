"""Compare session settings of traingraph's CPU step in one process, in alternating chunks.

Every ``SessionConfig`` given (as JSON) gets its own ``Module`` and ``Optimizer`` on the same
artifacts, weights and batches. They then take turns, ``--steps`` steps each, in an order that
reverses every chunk, for ``--chunks`` chunks. Each chunk's median (after its first 2 steps) is
one sample, so a slow phase of the machine falls on neighbouring samples of every setting alike;
the report gives each setting's median over chunks, its quartiles, and the median of the per-chunk
ratios to the first setting.

The models come from the benchmark's cache (``--cache``, by default ``benchmarks/.envs/cache``,
written by ``benchmarks/run.py`` or here on first use).

Usage:
    python benchmarks/session_ab.py resnet8 '{"allow_spinning": false}' '{}' [--chunks 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

from common import load_entry  # noqa: E402
from traingraph_runner import write_artifacts  # noqa: E402


def alternate(
    steppers: list[tuple[Any, Any]], x: np.ndarray, y: np.ndarray, chunks: int, steps: int
) -> np.ndarray:
    """Train steps of each ``(module, optimizer)`` in turn, ``steps`` at a time, in an order
    that reverses every chunk: ``[stepper, chunk]`` medians in ms (each chunk's first 2 steps
    left out)."""
    samples = np.zeros((len(steppers), chunks))
    for chunk in range(chunks):
        order = range(len(steppers)) if chunk % 2 == 0 else reversed(range(len(steppers)))
        for index in order:
            module, opt = steppers[index]
            times = []
            for step in range(steps):
                start = time.perf_counter()
                module(x[step % len(x)], y[step % len(y)])
                opt.step()
                module.lazy_reset_grad()
                times.append(time.perf_counter() - start)
            samples[index, chunk] = np.median(times[2:]) * 1e3
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["mlp", "lenet", "resnet8", "transformer"])
    parser.add_argument("configs", nargs="+", help="SessionConfig fields as JSON objects")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=12, help="steps per chunk")
    parser.add_argument(
        "--cache", type=Path, default=HERE / ".envs" / "cache", help="benchmark model cache"
    )
    args = parser.parse_args(argv)

    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.bench import prepare_models
    from traingraph.runtime.session import SessionConfig

    cache = args.cache
    if not (cache / args.model / "meta.json").exists():
        prepare_models(HERE, cache, [args.model], None)
    meta, _, data = load_entry(cache / args.model)
    configs = [json.loads(text) for text in args.configs]
    steppers = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_artifacts(cache / args.model, meta, directory)
        for config in configs:
            state = CheckpointState.load_checkpoint(directory / "checkpoint")
            module = Module(
                directory / "training_model.onnx", state, session_config=SessionConfig(**config)
            )
            module.train()
            steppers.append((module, Optimizer(directory / "optimizer_model.onnx", module)))

    samples = alternate(steppers, data["x"], data["y"], args.chunks, args.steps)
    print(f"{args.model}: {args.chunks} chunks of {args.steps} steps, ms per step")
    for index, text in enumerate(args.configs):
        q1, median, q3 = np.percentile(samples[index], [25, 50, 75])
        ratio = np.median(samples[index] / samples[0])
        print(
            f"  {text:40s} median {median:8.3f}  quartiles {q1:.3f}-{q3:.3f}  vs first {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
