"""Data-parallel scaling: traingraph.distributed against PyTorch DistributedDataParallel.

Each configuration runs in N fresh processes with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); the batch per process stays fixed (weak scaling).
Reported: steps/s, samples/s over all processes, and the scaling efficiency
``samples/s(N) / (N * samples/s(1))`` of the same system. Every process started gets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
(NVLink multicast off).

``cpu``: the demo CNN (traingraph.demo) on the CPU through gloo, one thread per process, per
process ``--batch`` samples of 8x8 digits, AdamW; ``traingraph`` (api.Module, Optimizer and
DataParallel) against ``ddp`` (the same network in torch.nn, DistributedDataParallel)::

    python benchmarks/scaling.py cpu --processes 1,2 --markdown scaling_cpu.md

``gpu``: one GPU per process through NCCL: ResNet-50 at 64 images per GPU and BERT-base at 32
sequences of 128 tokens per GPU (the models, batches and artifacts of
:mod:`benchmarks.gpu_zoo`), fp32 (TF32 allowed everywhere) and bf16 (traingraph's
``mixed_precision="bf16"`` artifacts, torch under ``autocast``). Systems: ``traingraph_graph``
(:func:`traingraph.distributed.cuda_graph_step`), ``traingraph`` (Module, Optimizer and
DataParallel) and ``ddp``::

    python benchmarks/scaling.py gpu --gpus 1,2,4,8 --models resnet50:64,bert:32 \\
        --precisions fp32,bf16 --systems traingraph_graph,traingraph,ddp --markdown scaling.md

Each run takes ``--warmup`` steps, then times ``--repeats`` runs of ``--steps`` steps (every
process synchronizes its device at the end of a run; rank 0's median is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CPU_SYSTEMS = ("traingraph", "ddp")
GPU_SYSTEMS = ("traingraph_graph", "traingraph", "ddp")
Step = Callable[[], None]


# ------------------------------------------------------------------------------------ workers
def _demo_torch() -> Any:
    """The demo CNN in torch.nn (the layers of :func:`traingraph.demo.digits_cnn`)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def _cpu_batches(batch: int, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(rank)
    return [
        (
            rng.standard_normal((batch, 1, 8, 8), dtype=np.float32),
            rng.integers(0, 10, batch, dtype=np.int64),
        )
        for _ in range(4)
    ]


def _traingraph_cpu(spec: dict[str, Any]) -> Step:
    from traingraph import distributed
    from traingraph.fit import Trainer
    from traingraph.runtime.session import SessionConfig

    trainer = Trainer.from_artifacts(
        spec["artifacts"], session_config=SessionConfig(intra_op_threads=1)
    )
    replica = distributed.DataParallel(trainer.module, trainer.optimizer)
    batches = _cpu_batches(spec["batch"], replica.rank)
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        trainer.module(x, y)
        trainer.optimizer.step()
        trainer.module.lazy_reset_grad()

    return step


def _ddp(model: Any, device: str, lr: float, optimizer: str, precision: str) -> Any:
    """``model`` on ``device`` in DistributedDataParallel, its optimizer and autocast dtype."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = model.to(device)
    model.train()
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    wrapped = DistributedDataParallel(model, device_ids=ids)
    params = wrapped.parameters()
    opt = (
        torch.optim.SGD(params, lr=lr, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    )
    dtype = torch.bfloat16 if precision == "bf16" else None
    return wrapped, opt, dtype


def _ddp_cpu(spec: dict[str, Any]) -> Step:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model, opt, _ = _ddp(_demo_torch(), "cpu", 1e-2, "adamw", "fp32")
    batches = [
        (torch.from_numpy(x), torch.from_numpy(y))
        for x, y in _cpu_batches(spec["batch"], dist.get_rank())
    ]
    count = [0]

    def step() -> None:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _gpu_batches(spec: dict[str, Any], rank: int) -> list[tuple[dict[str, np.ndarray], Any]]:
    from benchmarks import gpu_zoo

    data = gpu_zoo.batches(spec["model"], spec["batch"], spec["small"])
    return data[rank % len(data) :] + data[: rank % len(data)]


def _traingraph_zoo(spec: dict[str, Any], device: str) -> Step:
    from benchmarks import gpu_zoo
    from traingraph import distributed
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.checkpoint import load_checkpoint_data, save_checkpoint_data
    from traingraph.runtime.session import SessionConfig

    small, name = spec["small"], spec["model"]
    directory = gpu_zoo.artifact_dir(Path(spec["cache"]), name, small, spec["precision"])
    data = load_checkpoint_data(directory / "nominal_checkpoint")
    weights = {k: v.detach().numpy() for k, v in gpu_zoo.build(name, small).state_dict().items()}
    data.parameters = {p: np.ascontiguousarray(weights[p]) for p in data.parameters}
    data.nominal = False
    checkpoint = Path(tempfile.mkdtemp(prefix="tg-scaling-")) / "checkpoint"
    save_checkpoint_data(data, checkpoint)
    state = CheckpointState.load_checkpoint(checkpoint)
    config = SessionConfig(**spec.get("session_config", {}))
    module = Module(directory / "training_model.onnx", state, device=device, session_config=config)
    names = module.input_names()
    batches = _gpu_batches(spec, int(os.environ.get("RANK", "0")))
    arrays = [[*(inputs[n] for n in names[:-1]), labels] for inputs, labels in batches]
    count = [0]
    if spec["system"] == "traingraph_graph":
        graph_step = distributed.cuda_graph_step(module, directory / "optimizer_model.onnx")

        def captured() -> None:
            graph_step(*arrays[count[0] % len(arrays)])
            count[0] += 1

        return captured
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    distributed.DataParallel(module, optimizer)

    def step() -> None:
        module(*arrays[count[0] % len(arrays)])
        optimizer.step()
        module.lazy_reset_grad()
        count[0] += 1

    return step


def _ddp_zoo(spec: dict[str, Any], device: str) -> Step:
    import torch

    from benchmarks import gpu_zoo

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    info = gpu_zoo.MODELS[spec["model"]]
    model = gpu_zoo.build(spec["model"], spec["small"])
    wrapped, opt, dtype = _ddp(model, device, info.lr, info.optimizer, spec["precision"])
    batches = _gpu_batches(spec, int(os.environ.get("RANK", "0")))
    count = [0]

    def step() -> None:
        inputs, labels = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad(set_to_none=True)
        args = [torch.from_numpy(a).to(device, non_blocking=True) for a in inputs.values()]
        target = torch.from_numpy(labels).to(device, non_blocking=True)
        kind = "cuda" if device.startswith("cuda") else "cpu"
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(wrapped(*args), target)
        loss.backward()
        opt.step()

    return step


def worker(spec: dict[str, Any], out: Path) -> None:
    """One process of a run: build the system, time it, and (rank 0) write the result."""
    import torch
    import torch.distributed as dist

    from traingraph import distributed

    torch.set_num_threads(spec.get("threads", 1) if spec["device"] == "cpu" else 4)
    distributed.init_process_group()
    device = str(distributed.local_device(spec["device"]))
    builders: dict[str, Callable[[], Step]] = {
        "demo:traingraph": lambda: _traingraph_cpu(spec),
        "demo:ddp": lambda: _ddp_cpu(spec),
        "zoo:traingraph": lambda: _traingraph_zoo(spec, device),
        "zoo:traingraph_graph": lambda: _traingraph_zoo(spec, device),
        "zoo:ddp": lambda: _ddp_zoo(spec, device),
    }
    step = builders[f"{spec['workload']}:{spec['system']}"]()

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)
        flag = torch.zeros(1, device=device)
        dist.all_reduce(flag)

    for _ in range(spec["warmup"]):
        step()
    sync()
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        for _ in range(spec["steps"]):
            step()
        sync()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        seconds = statistics.median(times) / spec["steps"]
        world = dist.get_world_size()
        result = {
            **{k: spec[k] for k in ("system", "model", "precision", "batch", "device")},
            "processes": world,
            "steps_per_second": 1 / seconds,
            "samples_per_second": world * spec["batch"] / seconds,
            "runs_ms_per_step": [1000 * t / spec["steps"] for t in times],
        }
        out.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(spec: dict[str, Any], processes: int, timeout: float) -> dict[str, Any]:
    """Run ``spec`` in ``processes`` fresh processes; rank 0's result, or the error."""
    with tempfile.TemporaryDirectory(prefix="tg-scaling-") as folder:
        out = Path(folder) / "result.json"
        env = {
            **os.environ,
            **NO_MULTICAST,
            "WORLD_SIZE": str(processes),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": str(spec.get("threads", 1)),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        command = [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)]
        children = [
            subprocess.Popen(
                [*command, str(out)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(processes)
        ]
        logs, deadline = [], time.monotonic() + timeout
        try:
            for child in children:
                logs.append(child.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            logs.append(f"timed out after {timeout:.0f} s")
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        if out.is_file():
            return dict(json.loads(out.read_text()))
        tail = " | ".join(line for log in logs for line in log.strip().splitlines()[-3:])
        return {**spec, "processes": processes, "error": tail[-1500:]}


def with_efficiency(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``efficiency`` against the same configuration's 1-process row."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["system"], r["model"], r["precision"], r["batch"])

    single = {key(r): r for r in rows if r["processes"] == 1 and "error" not in r}
    for row in rows:
        base = single.get(key(row))
        if base is not None and "error" not in row:
            row["efficiency"] = row["samples_per_second"] / (
                row["processes"] * base["samples_per_second"]
            )
    return rows


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"{title}\n",
        "| model | precision | batch/process | system | processes | steps/s | samples/s |"
        " efficiency |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['precision']} | {r['batch']} | {r['system']} |"
                f" {r['processes']} | failed: {r['error'][:120]} | | |"
            )
            continue
        efficiency = f"{100 * r['efficiency']:.0f}%" if "efficiency" in r else "-"
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['batch']} | {r['system']} |"
            f" {r['processes']} | {r['steps_per_second']:.1f} | {r['samples_per_second']:,.0f} |"
            f" {efficiency} |"
        )
    return "\n".join(lines) + "\n"


def _counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def run_cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    from traingraph import artifacts, demo, optim

    folder = Path(tempfile.mkdtemp(prefix="tg-scaling-demo-"))
    artifacts.generate_artifacts(
        demo.digits_cnn(seed=0),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=folder,
    )
    rows = []
    for repeat in range(args.rounds):  # rounds alternate the configurations (a noisy machine)
        for processes in _counts(args.processes):
            for system in args.systems.split(","):
                spec = {
                    "workload": "demo", "device": "cpu", "system": system, "model": "demo_cnn",
                    "precision": "fp32", "batch": args.batch, "artifacts": str(folder),
                    "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                    "threads": 1,
                }  # fmt: skip
                row = launch(spec, processes, args.timeout)
                row["round"] = repeat
                print(json.dumps(row), flush=True)
                rows.append(row)
    return _median_rounds(rows)


def _median_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration: the median over rounds of its throughput."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["model"], r["precision"], r["batch"],
                           r["processes"]), []).append(r)  # fmt: skip
    merged = []
    for members in groups.values():
        good = [m for m in members if "error" not in m]
        if not good:
            merged.append(members[0])
            continue
        row = dict(good[0])
        for field in ("steps_per_second", "samples_per_second"):
            row[field] = statistics.median(m[field] for m in good)
        row["rounds"] = len(good)
        merged.append(row)
    return with_efficiency(merged)


def run_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import gpu_zoo

    cache = Path(args.cache)
    models = [(m.split(":")[0], int(m.split(":")[1])) for m in args.models.split(",")]
    precisions = args.precisions.split(",")
    for name, _ in models:
        gpu_zoo.prepare(name, args.small, precisions, cache)
    rows = []
    for name, batch in models:
        for precision in precisions:
            for system in args.systems.split(","):
                for processes in _counts(args.gpus):
                    spec = {
                        "workload": "zoo", "device": args.device, "system": system, "model": name,
                        "precision": precision, "batch": batch, "small": args.small,
                        "cache": str(cache), "warmup": args.warmup, "steps": args.steps,
                        "repeats": args.repeats,
                        "session_config": json.loads(args.tg_config),
                    }  # fmt: skip
                    row = launch(spec, processes, args.timeout)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return with_efficiency(rows)


def _machine(args: argparse.Namespace) -> str:
    if args.where == "gpu" and args.device == "cuda":
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"the CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        sys.path[:0] = [str(ROOT), str(ROOT / "src")]
        worker(json.loads(argv[1]), Path(argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="where", required=True)
    cpu = sub.add_parser("cpu", help="the demo CNN on the CPU (gloo)")
    cpu.add_argument("--processes", default="1,2")
    cpu.add_argument("--systems", default=",".join(CPU_SYSTEMS))
    cpu.add_argument("--batch", type=int, default=64, help="samples per process")
    cpu.add_argument("--warmup", type=int, default=20)
    cpu.add_argument("--steps", type=int, default=100)
    cpu.add_argument("--repeats", type=int, default=5)
    cpu.add_argument("--rounds", type=int, default=3)
    gpu = sub.add_parser("gpu", help="ResNet-50 and BERT-base, one GPU per process (NCCL)")
    gpu.add_argument("--gpus", default="1,2,4,8")
    gpu.add_argument("--models", default="resnet50:64,bert:32")
    gpu.add_argument("--precisions", default="fp32,bf16")
    gpu.add_argument("--systems", default=",".join(GPU_SYSTEMS))
    gpu.add_argument("--small", action="store_true", help="tiny model configurations")
    gpu.add_argument("--device", default="cuda", help="cuda (one GPU per process), or cpu to try")
    gpu.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "tg-gpu-zoo"))
    gpu.add_argument("--tg-config", default="{}", help="traingraph SessionConfig fields (JSON)")
    gpu.add_argument("--warmup", type=int, default=10)
    gpu.add_argument("--steps", type=int, default=30)
    gpu.add_argument("--repeats", type=int, default=3)
    for p in (cpu, gpu):
        p.add_argument("--timeout", type=float, default=900, help="seconds per run")
        p.add_argument("--out", help="JSON file of the rows")
        p.add_argument("--markdown", help="Markdown file of the table")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    rows = run_cpu(args) if args.where == "cpu" else run_gpu(args)
    title = (
        f"Data-parallel scaling on {_machine(args)}: samples/s over all processes;"
        " efficiency = samples/s(N) / (N x samples/s(1))"
    )
    table = markdown(rows, title)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
