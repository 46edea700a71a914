"""A/B of a zoo model's CPU train step in one process: two artifact sets and torch eager.

``--write DIR`` writes the artifacts of zoo model ``--model`` (``benchmarks/zoo.py``, from its
cache entry) with the traingraph that is imported, so that a second checkout's ``src`` on
``PYTHONPATH`` writes the other side. Without it, the artifacts ``--a`` and ``--b`` (``--a``
again where not given) are loaded with the installed runtime and run with torch eager (the
entry's weights, batches and optimizer) in turn, step by step; the median wall and CPU ms per
step of each are printed, then each side's loss after the same steps. ``--a-without NAMES``
leaves native kernels (``traingraph.runtime.cpu.kernels.names()``) or CPU rewrite rules (their
names in ``traingraph.runtime.rewrites``) out of side A, to time a runtime change on the same
artifacts. With ``--profile``, onnxruntime's time by op type of side B (the profiler's overhead
is in the step times then).

Run from the repository root::

    PYTHONPATH=OLD/src python benchmarks/zoo_ab.py --model lstm_tagger --write A
    python benchmarks/zoo_ab.py --model lstm_tagger --write B
    python benchmarks/zoo_ab.py --model lstm_tagger --a A --b B --threads 1
    python benchmarks/zoo_ab.py --model vit_tiny --a B --a-without one_row_scatter_as_where
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import models
from common import load_entry
from cpu_profile import ort_ops
from traingraph_runner import write_artifacts

CACHE = Path(__file__).resolve().parent / ".envs" / "cache"


def dynamo_export(zoo: Any, name: str, weights: dict, data: dict) -> Any:
    """Zoo model ``name`` with the cached ``weights``, exported by ``traingraph.from_torch``
    with its defaults on the first batch of ``data``."""
    from traingraph import from_torch

    model = zoo.build(name)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    return from_torch(
        model, (torch.from_numpy(data["x"][0]),), input_names=["x"], output_names=["logits"]
    )


def main(argv: list[str] | None = None) -> int:
    zoo = models.zoo()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lstm_tagger", choices=list(zoo.BENCH_MODELS))
    parser.add_argument("--write", type=Path, help="write the artifacts here and exit")
    parser.add_argument(
        "--exporter",
        choices=["cache", "dynamo"],
        default="cache",
        help="with --write: the cached export (TorchScript, opset 17), or the module exported"
        " with traingraph.from_torch's defaults (dynamo, opset 20)",
    )
    parser.add_argument("--a", type=Path, help="artifacts of side A")
    parser.add_argument("--b", type=Path, help="artifacts of side B (default: --a)")
    parser.add_argument(
        "--a-without", default="", help="kernels or CPU rewrite rules left out of side A (a,b)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="timed steps of each side")
    parser.add_argument("--profile", action="store_true", help="onnxruntime's ops of side B")
    parser.add_argument("--top-nodes", type=int, default=0, help="with --profile: slowest nodes")
    args = parser.parse_args(argv)

    entry = zoo.prepare_entry(args.model, CACHE)
    meta, weights, data = load_entry(entry)
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        model = None if args.exporter == "cache" else dynamo_export(zoo, args.model, weights, data)
        write_artifacts(entry, meta, args.write, model)
        return 0
    if args.a is None:
        parser.error("give --a (and --b) artifact folders, or --write")
    args.b = args.b or args.a

    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.runtime import rewrites
    from traingraph.runtime.cpu import kernels
    from traingraph.runtime.session import SessionConfig

    left_out = {name for name in args.a_without.split(",") if name}
    rule_sets = ("CPU_RULES", "SCATTER_RULES")
    rule_names = {r.name for rules in rule_sets for r in getattr(rewrites, rules)}
    unknown = left_out - rule_names - set(kernels.names())
    if unknown:
        parser.error(f"--a-without: {sorted(unknown)} are no kernels or CPU rewrite rules")

    torch.set_num_threads(args.threads)
    batches = [(data["x"][k], data["y"][k]) for k in range(len(data["x"]))]
    profiles = tempfile.TemporaryDirectory()

    def traingraph_side(folder: Path, profile: bool, without: set[str]) -> Callable[[int], float]:
        chosen = set(kernels.names()) - without if without & set(kernels.names()) else None
        config = SessionConfig(
            intra_op_threads=args.threads, profile=profile, native_kernels=chosen
        )
        state = CheckpointState.load_checkpoint(folder / "checkpoint")
        kept = {rules: getattr(rewrites, rules) for rules in rule_sets}
        for rules, given in kept.items():  # the sessions are made (and rewritten) here
            setattr(rewrites, rules, tuple(r for r in given if r.name not in without))
        try:
            module = Module(folder / "training_model.onnx", state, session_config=config)
        finally:
            for rules, given in kept.items():
                setattr(rewrites, rules, given)
        optimizer = Optimizer(folder / "optimizer_model.onnx", module)
        module.train()

        def step(k: int) -> float:
            module.lazy_reset_grad()
            loss = module(*batches[k % len(batches)])
            optimizer.step()
            return float(np.asarray(loss))

        return step

    model = zoo.build(args.model)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    opt = models.torch_optimizer(args.model, model.parameters())
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]

    def torch_step(k: int) -> float:
        x, y = tensors[k % len(tensors)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    folders = args.a.resolve(), args.b.resolve()
    os.chdir(profiles.name)  # the profile lands here
    sides = {
        "A": traingraph_side(folders[0], False, left_out),
        "B": traingraph_side(folders[1], args.profile, set()),
        "torch eager": torch_step,
    }
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, float] = {}
    for k in range(args.repeats + 1):
        for name, step in sides.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[name] = step(k)
            if k:  # the first step warms up
                wall[name].append((time.perf_counter() - start) * 1e3)
                cpu[name].append((time.process_time() - start_cpu) * 1e3)
    print(f"{args.model}: {meta['description']}, {args.threads} thread(s)")
    for name in sides:
        print(
            f"  {name}: {statistics.median(wall[name]):.1f} ms/step, CPU"
            f" {statistics.median(cpu[name]):.1f} (median of {args.repeats});"
            f" loss after {args.repeats + 1} steps {losses[name]:.7g}"
        )
    torch_ms = statistics.median(wall["torch eager"])
    for name in ("A", "B"):
        print(f"  torch / {name}: {torch_ms / statistics.median(wall[name]):.2f}")
    if args.profile:
        del sides  # ends the sessions, which writes the profile
        import gc

        gc.collect()
        print("  onnxruntime ops of B, ms per step:")
        for op, ms, n in ort_ops(profiles.name, args.repeats + 1)[:20]:
            print(f"    {op:30s} {ms:8.1f}  ({n} nodes)")
        if args.top_nodes:
            print(f"  slowest {args.top_nodes} nodes of B, ms per step:")
            for node, ms, n in ort_ops(profiles.name, args.repeats + 1, by_node=True)[
                : args.top_nodes
            ]:
                print(f"    {node:70s} {ms:8.2f}  (x{n})")
    profiles.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
