"""How long ``traingraph.api.Module`` takes to load torchvision models on the CPU.

Each model is exported once with the TorchScript exporter (training mode, opset 17, dynamic
batch, input ``3 x size x size``), its artifacts generated (cross-entropy loss, AdamW) and
cached under ``<cache>/<model>/``. Each timed run is a fresh process that loads
``Module`` + ``Optimizer`` and takes the first training step; the script prints the median of
the runs. ``--save-params`` instead takes three training steps on fixed data and writes the
parameters to an ``.npz`` file, so that two versions of traingraph can be compared exactly.

Example:
    $ python benchmarks/load_time.py resnet50 densenet121 --runs 3
    $ python benchmarks/load_time.py resnet50 --save-params /tmp/resnet50.npz
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 2
CLASSES = 1000


def prepare(name: str, cache: Path, size: int) -> Path:
    """Export ``name`` and generate its artifacts under ``cache`` (once); their directory."""
    out = cache / f"{name}_{size}"
    if (out / "training_model.onnx").is_file():
        return out
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.zoo.torchvision_import import torchvision_models

    from traingraph import artifacts

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = getattr(torchvision_models(), name)(num_classes=CLASSES)
    x = torch.randn(BATCH, 3, size, size)
    path = out / "model.onnx"
    torch.onnx.export(
        model.train(),
        (x,),
        str(path),
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        dynamo=False,
        opset_version=17,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
    )
    artifacts.generate_artifacts(
        str(path),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=out,
    )
    return out


def _batch(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 3, size, size)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int64)
    return x, y


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load_once(directory: Path, size: int, steps: int) -> tuple[float, float, float, object]:
    """Seconds to load Module + Optimizer, CPU seconds of this process (all threads) meanwhile,
    seconds of the first step, and the checkpoint state."""
    from traingraph import api

    start, cpu = time.perf_counter(), _cpu_seconds()
    state = api.CheckpointState.load_checkpoint(directory / "checkpoint")
    module = api.Module(
        directory / "training_model.onnx", state, directory / "eval_model.onnx", device="cpu"
    )
    optimizer = api.Optimizer(directory / "optimizer_model.onnx", module)
    loaded, cpu = time.perf_counter(), _cpu_seconds() - cpu
    for step in range(steps):
        x, y = _batch(size, step)
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        if step == 0:
            first = time.perf_counter()
    return loaded - start, cpu, first - loaded, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="torchvision model names, e.g. resnet50")
    cache = Path(tempfile.gettempdir()) / "traingraph-load-time"
    parser.add_argument("--cache", type=Path, default=cache)
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per model")
    parser.add_argument("--save-params", type=Path, help="write params after 3 steps here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory = prepare(args.models[0], args.cache, args.size)
        load, cpu, step, _ = load_once(directory, args.size, 1)
        print(json.dumps({"load": load, "cpu": cpu, "step": step}))
        return
    if args.save_params is not None:
        directory = prepare(args.models[0], args.cache, args.size)
        *_, state = load_once(directory, args.size, 3)
        params = {name: p.data for name, p in state.parameters.items()}  # type: ignore[attr-defined]
        np.savez(args.save_params, **params)
        print(f"{len(params)} parameters after 3 steps written to {args.save_params}")
        return
    for name in args.models:
        prepare(name, args.cache, args.size)
        runs = []
        for _ in range(args.runs):
            command = [sys.executable, __file__, name, "--child", "--cache", str(args.cache)]
            command += ["--size", str(args.size)]
            result = subprocess.run(command, check=True, capture_output=True, text=True)
            runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
        loads = [r["load"] for r in runs]
        steps = [r["step"] for r in runs]
        cpus = [r["cpu"] for r in runs]
        print(
            f"{name} {args.size}x{args.size}: Module+Optimizer median"
            f" {statistics.median(loads):.2f} s"
            f" (runs {', '.join(f'{v:.2f}' for v in loads)}; CPU time median"
            f" {statistics.median(cpus):.2f} s), first step median {statistics.median(steps):.2f} s"
        )


if __name__ == "__main__":
    main()
