"""CPU train steps of vision models users train, traingraph against torch eager in one process.

Each model (``tv:NAME`` from torchvision, ``timm:NAME`` from timm where it is importable) is
built with a fixed seed and its dropout and drop-path probabilities at 0, exported with
:func:`traingraph.from_torch`, and trained with SGD (momentum 0.9) and cross-entropy on one
fixed batch by traingraph's ``Module`` and by torch eager in turn, one step each; the median
ms per step of each, their ratio (eager / traingraph, above 1 where traingraph is faster) and
the first and last losses of both are printed.

Between the two systems' steps the process sleeps ``--pause`` seconds (default 0.02): PyTorch's
OpenMP workers (libgomp) spin for several milliseconds after each parallel region before they
sleep, and on a machine of few cores they take them from whatever runs next in the process.
``--pause 0`` measures that too (on two cores it adds 4-5 ms to a traingraph step that follows
a torch step).

``--without KERNEL`` (repeatable) adds a third system to the turns: traingraph on the same
artifacts without those native kernels (``SessionConfig(native_kernels=...)``), so a kernel is
measured against the graph it replaces in one process, and the table gains its ms per step
and the ratio (without / with, above 1 where the kernels pay).

Run from the repository root (timm's own directory with ``--timm-path`` where it is installed
with ``pip install --no-deps --target DIR timm``)::

    python benchmarks/vision_models.py --batch 8 --size 96 --steps 10 \
        tv:squeezenet1_1 tv:mobilenet_v2 timm:poolformer_s12 timm:densenet121
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_profile import load, write_artifacts  # noqa: E402  (after the path)

CLASSES = 10


def build(spec: str) -> Any:
    """The seeded torch model ``spec`` in train mode, without dropout or drop paths."""
    from zoo.torchvision_import import torchvision_models  # on the path with cpu_profile

    source, name = spec.split(":", 1)
    torch.manual_seed(0)
    vision = torchvision_models()  # timm imports torchvision too
    if source == "tv":
        model = getattr(vision, name)(num_classes=CLASSES)
    elif source == "timm":
        import timm

        model = timm.create_model(name, num_classes=CLASSES, pretrained=False, drop_rate=0.0)
    else:
        raise SystemExit(f"model {spec!r}: expected tv:NAME or timm:NAME")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "drop_prob"):
            module.drop_prob = 0.0
        if type(module).__name__ == "StochasticDepth":  # torchvision's
            module.p = 0.0
    return model.train()


def run(spec: str, batch: int, size: int, steps: int, pause: float, without: frozenset[str]) -> str:
    """One model's row of the table."""
    from traingraph.runtime.cpu import kernels
    from traingraph.runtime.session import SessionConfig

    model = build(spec)
    torch.manual_seed(1)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, CLASSES, (batch,))
    directory = Path(tempfile.mkdtemp())
    write_artifacts(model, x, directory)  # SGD with momentum, cross-entropy
    steppers = {"traingraph": load(directory, SessionConfig())}
    if without:
        others = frozenset(kernels.names()) - without
        steppers["without"] = load(directory, SessionConfig(native_kernels=others))
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss()
    images, labels = x.numpy(), y.numpy().astype(np.int64)

    def traingraph_step(name: str) -> float:
        module, optimizer = steppers[name]
        loss = module(images, labels)
        optimizer.step()
        module.lazy_reset_grad()
        return float(np.asarray(loss))

    def eager_step(name: str) -> float:
        torch_optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        torch_optimizer.step()
        return float(loss.detach())

    systems = [(name, traingraph_step) for name in steppers] + [("eager", eager_step)]
    times: dict[str, list[float]] = {name: [] for name, _ in systems}
    losses_seen: dict[str, list[float]] = {name: [] for name, _ in systems}
    for i in range(steps + 2):
        for name, step in systems if i % 2 == 0 else systems[::-1]:
            start = time.perf_counter()
            losses_seen[name].append(step(name))
            if i >= 2:
                times[name].append(time.perf_counter() - start)
            time.sleep(pause)
    ms = {name: statistics.median(times[name]) * 1e3 for name in times}
    ours, eager = ms["traingraph"], ms["eager"]
    a, b = losses_seen["traingraph"], losses_seen["eager"]
    row = (
        f"| {spec} | {ours:.1f} | {eager:.1f} | {eager / ours:.2f} | {a[0]:.5f} / {b[0]:.5f}"
        f" | {a[-1]:.4f} / {b[-1]:.4f} |"
    )
    if "without" in ms:
        row += f" {ms['without']:.1f} | {ms['without'] / ours:.2f} |"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="tv:NAME or timm:NAME")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after 2")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads; 0: its default")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between systems")
    parser.add_argument("--timm-path", help="a directory timm is installed in")
    parser.add_argument(
        "--without", action="append", default=[], metavar="KERNEL",
        help="also time traingraph without this native kernel (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.timm_path:
        sys.path.insert(0, args.timm_path)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {args.batch}, {args.size} x {args.size}, torch threads {torch.get_num_threads()}")
    header = "| model | traingraph ms | eager ms | eager / traingraph | first losses | last losses"
    header += " |"
    rule = "|---|---|---|---|---|---|"
    if args.without:
        header += f" without {', '.join(args.without)} ms | without / with |"
        rule += "---|---|"
    print(header)
    print(rule)
    without = frozenset(args.without)
    for spec in args.models:
        try:
            print(run(spec, args.batch, args.size, args.steps, args.pause, without), flush=True)
        except Exception as error:  # one model's failure does not end the table
            print(f"| {spec} | failed: {type(error).__name__}: {str(error)[:200]} | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
