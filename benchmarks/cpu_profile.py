"""Where a CPU train step's time goes: onnxruntime segments against the native kernels.

Trains a torchvision classifier (random weights, 10 classes, SGD with momentum, cross-entropy)
with traingraph and with torch eager, alternating step by step in one process, and prints the
median step times, then one traingraph step broken down: each onnxruntime segment run and each
native kernel class (wall time, summed over the timed steps), and with ``--ort-ops`` the
onnxruntime op types that take the most time in the segments (onnxruntime's profiler).

Run from the repository root::

    python benchmarks/cpu_profile.py --model resnet18 --batch 16 --size 112 --threads 2

With ``--only traingraph`` or ``--only torch`` one side runs, and the peak RSS printed is its
own (with ``--artifacts``, written by an earlier run, the export is not in it either).
``--zoo NAME`` profiles traingraph alone on a model of the zoo set (``traingraph bench --zoo``'s
cache entry and first batch, written there on first use) instead of a torchvision classifier.
``--weight-grads`` also times each native Conv weight gradient by its shapes (ms per step, and
GFLOP/s of its multiply-adds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import glob
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from traingraph import from_torch, losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.artifacts import generate_artifacts
from traingraph.runtime.cpu import segments
from traingraph.runtime.session import BoundRunner, SessionConfig
from zoo.torchvision_import import torchvision_models

CLASSES = 10


def build(name: str, batch: int, size: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = getattr(torchvision_models(), name)(num_classes=CLASSES).train()
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, CLASSES, (batch,))
    return model, images, labels


def write_artifacts(model: torch.nn.Module, images: torch.Tensor, directory: Path) -> None:
    proto = from_torch(copy.deepcopy(model), (images,), input_names=["input"],
                       output_names=["output"])  # fmt: skip
    generate_artifacts(
        proto,
        requires_grad=[n for n, p in model.named_parameters() if p.requires_grad],
        loss=losses.CrossEntropyLoss(),
        optimizer=optim.SGD(lr=1e-3, momentum=0.9),
        artifact_directory=directory,
    )


def zoo_artifacts(name: str, directory: Path) -> tuple[Any, ...]:
    """Write the artifacts of the zoo model ``name`` (``benchmarks/zoo.py``) into ``directory``
    from the benchmark's cache entry (written on first use); its first batch."""
    from traingraph.bench import ZOO_MODELS, prepare_models

    if name not in ZOO_MODELS:
        raise SystemExit(f"--zoo {name!r}: expected one of {', '.join(ZOO_MODELS)}")
    bench_dir = Path(__file__).resolve().parent
    cache = bench_dir / ".envs" / "cache"
    entry = cache / name
    if not (entry / "meta.json").exists():
        prepare_models(bench_dir, cache, [name], None)
    sys.path.insert(0, str(bench_dir / "peers"))
    from common import load_entry
    from traingraph_runner import write_artifacts as write_entry

    meta, _, data = load_entry(entry)
    if not (directory / "training_model.onnx").exists():
        write_entry(entry, meta, directory)
    return data["x"][0], data["y"][0]


def load(directory: Path, config: SessionConfig) -> tuple[Module, Optimizer]:
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, session_config=config)
    return module, Optimizer(directory / "optimizer_model.onnx", module)


class Timers:
    """Wall time per label, summed while :attr:`on`."""

    def __init__(self) -> None:
        self.total: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.on = False

    @contextlib.contextmanager
    def timing(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.on:
                self.total[label] += time.perf_counter() - start
                self.calls[label] += 1


WEIGHT_GRAD_FLOPS: dict[str, float] = {}
"""The multiply-add FLOPs of each weight gradient label that :func:`instrument` timed."""


def instrument(timers: Timers, weight_grads: bool = False) -> None:
    """Time every segment run and every native kernel call (with ``weight_grads``, each Conv
    weight gradient by its shapes too)."""
    run_kernel = segments.SegmentedRunner._run_kernel
    bound_run = BoundRunner.run
    if weight_grads:
        from traingraph.runtime.cpu.kernels import conv_grads

        compute = conv_grads.WeightGradKernel.compute

        def timed_grad(self: Any, values: Any, out: Any, threads: int) -> None:
            g = self.grad
            x, dy = values[g.x].shape, values[g.route.y if g.route else g.dy].shape
            label = f"wgrad x{list(x)} dy{list(dy)} k{list(g.kernel or ())} s{g.strides} g{g.group}"
            taps = math.prod(g.kernel or (1,))
            WEIGHT_GRAD_FLOPS[label] = 2.0 * math.prod(dy) * x[1] // g.group * taps
            with timers.timing(label):
                compute(self, values, out, threads)

        conv_grads.WeightGradKernel.compute = timed_grad  # type: ignore[method-assign]

    def timed_kernel(self: Any, kernel: Any, *args: Any) -> None:
        with timers.timing(f"kernel {type(kernel).__name__}"):
            run_kernel(self, kernel, *args)

    def timed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with timers.timing("onnxruntime segments"):
            return bound_run(self, *args, **kwargs)

    segments.SegmentedRunner._run_kernel = timed_kernel  # type: ignore[method-assign]
    BoundRunner.run = timed_run  # type: ignore[method-assign]


def ort_ops(
    directory: str, steps: int, by_node: bool = False, shapes_of: str | None = None
) -> list[tuple[str, float, int]]:
    """Per op type (or node, with ``by_node``; or, for the op type ``shapes_of``, its input
    shapes) in the profiles under ``directory``: ms per step and runs per step."""
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for path in glob.glob(os.path.join(directory, "onnxruntime_profile_*.json")):
        with open(path) as f:
            events = json.load(f)
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                op = event.get("args", {}).get("op_name", "?")
                if by_node:
                    op = f"{op} {event['name'].removesuffix('_kernel_time')}"
                elif shapes_of is not None:
                    if op != shapes_of:
                        continue
                    shapes = [list(d.values())[0] for d in event["args"]["input_type_shape"]]
                    op = " ".join("x".join(map(str, shape)) for shape in shapes)
                total[op] += event["dur"]
                count[op] += 1
    return [(op, us / 1e3 / steps, count[op] // steps) for op, us in total.most_common()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--zoo", help="a model of the zoo set instead (traingraph alone)")
    parser.add_argument(
        "--weight-grads", action="store_true", help="time each Conv weight gradient by shapes"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs")
    parser.add_argument("--steps", type=int, default=3, help="steps per run")
    parser.add_argument("--ort-ops", action="store_true", help="onnxruntime's profile by op")
    parser.add_argument("--op-shapes", metavar="OP", help="with --ort-ops: OP's time by shapes")
    parser.add_argument(
        "--only", choices=["traingraph", "torch"], help="run one side (its peak RSS alone)"
    )
    parser.add_argument(
        "--artifacts", type=Path, help="a folder for the artifacts, reused where they exist"
    )
    parser.add_argument("--top-nodes", type=int, default=0, help="with --ort-ops: slowest nodes")
    parser.add_argument(
        "--no-arena", action="store_true", help="onnxruntime sessions without the memory arena"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.zoo:
        args.only, args.model = "traingraph", args.zoo
        model = images = labels = None
    else:
        model, images, labels = build(args.model, args.batch, args.size)
    timers = Timers()
    instrument(timers, args.weight_grads)
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # the profiles land here
        try:

            def traingraph_steps() -> None:
                for _ in range(args.steps):
                    module.lazy_reset_grad()
                    with timers.timing("forward+backward"):
                        module(fed)
                    with timers.timing("optimizer"):
                        optimizer.step()

            def torch_steps() -> None:
                for _ in range(args.steps):
                    sgd.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(eager(images), labels).backward()
                    sgd.step()

            runs: list[tuple[str, Callable[[], None], list[float]]] = []
            if args.only != "torch":
                folder = args.artifacts or Path(tmp)
                if args.zoo:
                    batch = zoo_artifacts(args.zoo, folder)
                elif not (folder / "training_model.onnx").exists():
                    write_artifacts(model, images, folder)
                config = SessionConfig(
                    intra_op_threads=args.threads,
                    profile=args.ort_ops,
                    memory_arena=not args.no_arena,
                )
                module, optimizer = load(folder, config)
                if not args.zoo:
                    batch = (images.numpy(), labels.numpy())
                fed = dict(zip(module.input_names(), batch))
                runs.append(("traingraph", traingraph_steps, []))
            if args.only != "traingraph":
                eager = copy.deepcopy(model)
                sgd = torch.optim.SGD(eager.parameters(), lr=1e-3, momentum=0.9)
                runs.append(("torch eager", torch_steps, []))
            del model

            for _, run, _ in runs:
                run()
            timers.on = True
            usage = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(args.repeats):
                for _, run, times in runs:
                    start = time.perf_counter()
                    run()
                    times.append((time.perf_counter() - start) * 1e3 / args.steps)
            timers.on = False
            steps = args.repeats * args.steps
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults = (after.ru_minflt - usage.ru_minflt) / steps / len(runs)
            system_ms = (after.ru_stime - usage.ru_stime) * 1e3 / steps / len(runs)
            size = f"{args.size}x{args.size}"
            if args.zoo:
                print(f"zoo model {args.zoo}, {args.threads} threads")
            else:
                print(f"{args.model} batch {args.batch} {size}, {args.threads} threads")
            for name, _, times in runs:
                print(f"  {name}: {statistics.median(times):.1f} ms/step (median of {len(times)})")
            if len(runs) == 2:
                ratio = statistics.median(runs[1][2]) / statistics.median(runs[0][2])
                print(f"  torch / traingraph: {ratio:.2f}")
            print(f"  per step: {faults:.0f} page faults, {system_ms:.1f} ms in the kernel")
            print("  traingraph step, ms per step (mean):")
            for label, seconds in timers.total.most_common():
                if label.startswith("wgrad "):
                    continue
                calls = timers.calls[label] // steps
                print(f"    {label:40s} {seconds * 1e3 / steps:8.1f}  ({calls} calls)")
            if args.weight_grads:
                print("  Conv weight gradients by shapes, ms per step (GFLOP/s):")
                for label, seconds in timers.total.most_common():
                    if label.startswith("wgrad "):
                        calls = timers.calls[label]
                        rate = WEIGHT_GRAD_FLOPS[label] * calls / seconds / 1e9
                        print(f"    {label[6:]:70s} {seconds * 1e3 / steps:7.2f}  ({rate:.0f})")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"  peak RSS of the process: {rss:.0f} MiB")
            if args.ort_ops and args.only != "torch":
                del module, optimizer  # ends the sessions, which writes the profiles
                import gc

                gc.collect()
                print("  onnxruntime ops, ms per step (includes the warm-up step):")
                for op, ms, n in ort_ops(tmp, steps + args.steps)[:20]:
                    print(f"    {op:30s} {ms:8.1f}  ({n} nodes)")
                if args.top_nodes:
                    print("  slowest onnxruntime nodes, ms per step:")
                    for node, ms, _ in ort_ops(tmp, steps + args.steps, True)[: args.top_nodes]:
                        print(f"    {node:70s} {ms:8.1f}")
                if args.op_shapes:
                    print(f"  {args.op_shapes} by input shapes, ms per step:")
                    by_shape = ort_ops(tmp, steps + args.steps, shapes_of=args.op_shapes)
                    for shapes, ms, n in by_shape[:30]:
                        print(f"    {shapes:70s} {ms:8.1f}  ({n} runs)")
        finally:
            os.chdir(cwd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
