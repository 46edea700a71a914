"""A/B of a CPU train step in one process: two artifact sets and two builds of ``_convc``.

Loads artifacts ``A`` and ``B`` of the same model (for example written before and after a
change to the autodiff), runs ``A`` with the ``_convc`` extension at ``--a-ext`` (a built
``_convc*.so`` of another checkout) and without the native kernels ``--a-without``, ``B``
with the installed extension and every kernel, and torch eager, in turn, step by step;
prints the median ms per step of each. Every ``traingraph.runtime`` module
that holds the extension as ``NATIVE`` gets the one of the side that runs.

    python benchmarks/ab_step.py --model resnet18 --a ART_A --a-ext OLD/_convc.so --b ART_B
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_profile

from traingraph import runtime
from traingraph.runtime.cpu import kernels, native
from traingraph.runtime.session import SessionConfig


def load_extension(path: Path) -> ModuleType:
    """The extension module at ``path``, loaded beside the installed one."""
    spec = importlib.util.spec_from_file_location("traingraph.runtime._convc", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no extension module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def holders() -> list[ModuleType]:
    """The loaded ``traingraph.runtime`` modules that hold the extension as ``NATIVE``."""
    prefix = runtime.__name__ + "."
    return [
        m for name, m in list(sys.modules.items())
        if name.startswith(prefix) and getattr(m, "NATIVE", None) is native.NATIVE
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--a", type=Path, required=True, help="artifacts of side A")
    parser.add_argument("--a-ext", type=Path, help="_convc build of side A (default: installed)")
    parser.add_argument(
        "--a-without", nargs="*", default=[], help="native kernels side A runs without"
    )
    parser.add_argument("--b", type=Path, required=True, help="artifacts of side B")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, images, labels = cpu_profile.build(args.model, args.batch, args.size)
    config = SessionConfig(intra_op_threads=args.threads)
    without = set(args.a_without)
    config_a = SessionConfig(
        intra_op_threads=args.threads,
        native_kernels=[k for k in kernels.names() if k not in without] if without else None,
    )
    new = native.NATIVE
    old = load_extension(args.a_ext) if args.a_ext else new
    targets = holders()

    def use(ext: ModuleType | None) -> None:
        for m in targets:
            m.NATIVE = ext  # type: ignore[attr-defined]

    sides = {}
    for name, folder, ext, side_config in (
        ("A", args.a, old, config_a),
        ("B", args.b, new, config),
    ):
        use(ext)  # the kernels are checked at load with their side's build
        module, optimizer = cpu_profile.load(folder, side_config)
        sides[name] = (module, optimizer, ext)
    eager = copy.deepcopy(model)
    sgd = torch.optim.SGD(eager.parameters(), lr=1e-3, momentum=0.9)

    def traingraph_step(name: str) -> Callable[[], None]:
        module, optimizer, ext = sides[name]
        fed = dict(zip(module.input_names(), (images.numpy(), labels.numpy())))

        def step() -> None:
            use(ext)
            module.lazy_reset_grad()
            module(fed)
            optimizer.step()

        return step

    def torch_step() -> None:
        sgd.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(eager(images), labels).backward()
        sgd.step()

    runs = {"A": traingraph_step("A"), "B": traingraph_step("B"), "torch eager": torch_step}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()
    for _ in range(args.repeats):
        for k, run in runs.items():
            start = time.perf_counter()
            run()
            times[k].append((time.perf_counter() - start) * 1e3)
    print(f"{args.model} batch {args.batch} {args.size}x{args.size}, {args.threads} threads")
    for k, v in times.items():
        print(f"  {k}: {statistics.median(v):.1f} ms/step (median of {len(v)})")
    torch_ms = statistics.median(times["torch eager"])
    for k in ("A", "B"):
        print(f"  torch / {k}: {torch_ms / statistics.median(times[k]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
