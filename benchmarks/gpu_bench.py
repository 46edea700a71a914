"""GPU training benchmark: traingraph on onnxruntime's CUDA provider against PyTorch, one process.

Every system trains the benchmark models of :mod:`benchmarks.models` (same weights, same
batches) on the same GPU:

- ``traingraph``: :class:`traingraph.api.Module` and :class:`~traingraph.api.Optimizer` with
  ``device="cuda"`` (IOBinding; parameters, gradients and optimizer state stay on the GPU; the
  API returns the loss to the host every step).
- ``traingraph_graph``: :class:`traingraph.runtime.cuda.CudaGraphStep`, the same graphs captured
  as CUDA graphs (one copy of each batch in, the loss left on the GPU).
- ``traingraph_graph_fp16`` / ``traingraph_graph_bf16``: the CUDA graph step on artifacts
  generated with ``mixed_precision="fp16"`` / ``"bf16"`` (float32 master weights, dynamic loss
  scaling).
- ``torch_eager``: ``torch.nn`` and ``torch.optim`` (foreach AdamW / SGD).
- ``torch_compile``: ``torch.compile(model, mode="reduce-overhead")`` (inductor with CUDA
  graphs); the optimizer stays eager, as in the CPU benchmark.

Each system first runs :data:`CURVE_STEPS` steps and reads every loss (the loss curves, which
include compilation and capture), then times ``--steps`` steps ``--repeats`` times without
reading the loss, synchronizing at the end. A step copies its batch from host memory in every
system.

Usage (on a machine with a GPU, onnxruntime-gpu and CUDA PyTorch)::

    python3 benchmarks/gpu_bench.py --out results.json --markdown results.md

``--zoo`` runs the realistic models instead (ResNet-50, ViT-B/16, BERT-base, GPT-2 small in
float32 and mixed precision, against torch eager and ``torch.compile``): see
:mod:`benchmarks.gpu_zoo` for its options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import models  # noqa: E402

CURVE_STEPS = 20
SYSTEMS = (
    "traingraph",
    "traingraph_graph",
    "traingraph_graph_fp16",
    "traingraph_graph_bf16",
    "torch_eager",
    "torch_compile",
)
FP32_SYSTEMS = ("traingraph", "traingraph_graph")
# (model, batch): the benchmark batch sizes, then larger batches reported in samples/s.
CONFIGS = (
    ("mlp", 64),
    ("lenet", 64),
    ("resnet8", 32),
    ("transformer", 16),
    ("resnet8", 256),
    ("transformer", 128),
)


@contextlib.contextmanager
def batch_size(name: str, batch: int) -> Iterator[None]:
    """Build and prepare model ``name`` at ``batch`` (the models' shapes are static)."""
    info = models.MODELS[name]
    models.MODELS[name] = dataclasses.replace(info, batch=batch)
    try:
        yield
    finally:
        models.MODELS[name] = info


Step = Callable[[np.ndarray, np.ndarray, bool], float | None]


def traingraph_step(
    entry: models.Prepared, device: str, cuda_graph: bool, precision: str | None = None
) -> Step:
    """A traingraph training step on ``device`` (through :class:`CudaGraphStep` if asked), in
    float32 or the mixed ``precision``."""
    from benchmarks.peers.traingraph_runner import write_artifacts
    from traingraph.api import CheckpointState, Module, Optimizer

    directory = Path(tempfile.mkdtemp(prefix="tg-gpu-"))
    write_artifacts(entry.directory, entry.meta, directory, mixed_precision=precision)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, device=device)
    module.train()
    if cuda_graph:
        from traingraph.runtime.cuda import CudaGraphStep

        graph_step = CudaGraphStep(module, directory / "optimizer_model.onnx")

        def captured(x: np.ndarray, y: np.ndarray, fetch: bool) -> float | None:
            loss = graph_step(x, y, fetch_loss=fetch)
            return None if loss is None else float(loss)

        return captured
    opt = Optimizer(directory / "optimizer_model.onnx", module)

    def step(x: np.ndarray, y: np.ndarray, fetch: bool) -> float | None:
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        return float(loss) if fetch else None

    return step


def torch_step(entry: models.Prepared, device: str, compile_model: bool) -> Step:
    """A PyTorch training step on ``device``, eager or ``torch.compile(mode="reduce-overhead")``."""
    import torch

    meta, weights, _ = models.load(entry.directory)
    module = models.build(meta["name"], dropout=meta["dropout"]).to(device)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    module.train()
    optimizer = models.torch_optimizer(meta["name"], module.parameters())
    forward = torch.compile(module, mode="reduce-overhead") if compile_model else module

    def step(x: np.ndarray, y: np.ndarray, fetch: bool) -> float | None:
        if compile_model:
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        xb = torch.from_numpy(x).to(device, non_blocking=True)
        yb = torch.from_numpy(y).to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(forward(xb), yb)
        loss.backward()
        optimizer.step()
        return loss.item() if fetch else None

    return step


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(
    step: Step, data: dict[str, np.ndarray], steps: int, repeats: int, device: str
) -> dict[str, Any]:
    """Loss curve of the first :data:`CURVE_STEPS` steps, then the median ms/step of the repeats."""
    x, y = data["x"], data["y"]
    losses = []
    for i in range(CURVE_STEPS):
        loss = step(x[i % len(x)], y[i % len(y)], True)
        assert loss is not None
        losses.append(loss)
    runs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for i in range(steps):
            step(x[i % len(x)], y[i % len(y)], False)
        synchronize(device)
        runs.append((time.perf_counter() - start) / steps * 1e3)
    return {"losses": losses, "ms_runs": runs, "ms": float(np.median(runs))}


def run_config(
    name: str, batch: int, systems: list[str], cache: Path, device: str, steps: int, repeats: int
) -> dict[str, Any]:
    with batch_size(name, batch):
        entry = models.prepare(name, cache / f"b{batch}")
        factories: dict[str, Callable[[], Step]] = {
            "traingraph": lambda: traingraph_step(entry, device, cuda_graph=False),
            "traingraph_graph": lambda: traingraph_step(entry, device, cuda_graph=True),
            "traingraph_graph_fp16": lambda: traingraph_step(entry, device, True, "fp16"),
            "traingraph_graph_bf16": lambda: traingraph_step(entry, device, True, "bf16"),
            "torch_eager": lambda: torch_step(entry, device, compile_model=False),
            "torch_compile": lambda: torch_step(entry, device, compile_model=True),
        }
        _, _, data = models.load(entry.directory)
        row: dict[str, Any] = {"model": name, "batch": batch, "systems": {}}
        for system in systems:
            start = time.perf_counter()
            try:
                step = factories[system]()
                result = measure(step, data, steps, repeats, device)
            except Exception as error:  # a failing system is reported, the others still run
                result = {"error": f"{type(error).__name__}: {error}"}
            result["setup_and_curve_s"] = time.perf_counter() - start
            result["samples_per_s"] = batch / result["ms"] * 1e3 if "ms" in result else None
            row["systems"][system] = result
            print(json.dumps({"model": name, "batch": batch, "system": system,
                              **{k: v for k, v in result.items() if k != "losses"}}), flush=True)
    return row


def markdown(rows: list[dict[str, Any]], systems: list[str], device_name: str) -> str:
    """The results table: ms/step and samples/s per system, and the float32 traingraph
    systems' best speed-up."""
    head = ["model", "batch", *systems, "best fp32 traingraph vs eager", "vs torch.compile"]
    lines = [f"Device: {device_name}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["model"], str(row["batch"])]
        results = row["systems"]
        for system in systems:
            r = results.get(system, {})
            cells.append(
                f"{r['ms']:.3f} ms ({r['samples_per_s']:.0f}/s)" if "ms" in r else "failed"
            )
        ours = [results[s]["ms"] for s in FP32_SYSTEMS
                if "ms" in results.get(s, {})]
        for peer in ("torch_eager", "torch_compile"):
            if ours and "ms" in results.get(peer, {}):
                cells.append(f"{results[peer]['ms'] / min(ours):.2f}x")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--zoo" in argv:
        from benchmarks import gpu_zoo

        gpu_zoo.main([a for a in argv if a != "--zoo"])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (or cpu to try the script)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated systems")
    parser.add_argument("--models", default="", help="comma-separated model:batch (default all)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tg-gpu-bench")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; expected some of {list(SYSTEMS)}")
    configs = (
        [(m, int(b)) for m, b in (c.split(":") for c in args.models.split(","))]
        if args.models
        else list(CONFIGS)
    )
    device_name = "cpu"
    if args.device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name()
    rows = [
        run_config(name, batch, systems, args.cache, args.device, args.steps, args.repeats)
        for name, batch in configs
    ]
    table = markdown(rows, systems, device_name)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"device": device_name, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
