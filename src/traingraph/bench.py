"""``traingraph bench``: training-step time of traingraph against its peers, in one run.

Each system runs in its own process (and, where its packages conflict, its own virtual
environment) through a runner script in ``benchmarks/peers/``; the runners read the same
cached ONNX export, weights and data (``benchmarks/models.py``) and print their step times,
losses and peak memory as JSON. The orchestrator interleaves the systems (``--rounds``
times, in a rotated order), pools the step times and prints, per model, the median step
time, peak resident memory, achieved GFLOP/s, the ratio of each system's median to
traingraph's, and the compute limit: the model's FLOPs divided by this machine's measured
sgemm peak.

Example:
    $ traingraph bench --models mlp lenet --rounds 2 --json results.json
    $ python benchmarks/run.py --setup-envs   # create the peers' virtual environments
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "BENCH-RESULT "
DEFAULT_MODELS = ("mlp", "lenet", "resnet8", "transformer")
ORT_PACKAGES = ("onnxruntime-training-cpu==1.19.2", "onnx", "torch==2.13.0", "numpy<2")
JAX_PACKAGES = ("jax", "jaxlib")
# (environment variable, pre-built environment checked first, directory under benchmarks/.envs)
ENVIRONMENTS = {
    "ort_training": ("TRAINGRAPH_BENCH_ORT_PYTHON", Path("/work/venvs/ortt"), "ortt"),
    "jax_jit": ("TRAINGRAPH_BENCH_JAX_PYTHON", None, "jax"),
}


@dataclass(frozen=True)
class System:
    """One benchmarked system: a runner script and its options."""

    label: str
    script: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_traingraph(self) -> bool:
        return self.script == "traingraph_runner.py"


PEERS = (
    System("torch_eager", "torch_eager.py"),
    System("torch_compile", "torch_compile.py"),
    System("ort_training", "ort_training.py"),
    System("jax_jit", "jax_jit.py"),
)
REFERENCE = System("traingraph", "traingraph_runner.py")


def traingraph_systems(sweep: bool) -> list[System]:
    """traingraph's default session, spinning on, the optimizer graph instead of the fused
    update, and with ``sweep`` every optimization level with 1 and 2 threads."""
    systems = [
        REFERENCE,
        System("traingraph spin", "traingraph_runner.py", {"allow_spinning": True}),
        System("traingraph graph-opt", "traingraph_runner.py", {"graph_optimizer": True}),
    ]
    if sweep:
        for level in ("disable", "basic", "extended", "all"):
            for threads in (1, 2):
                systems.append(
                    System(
                        f"traingraph {level} t{threads}",
                        "traingraph_runner.py",
                        {"optimization": level, "intra_op_threads": threads},
                    )
                )
    return systems


def default_bench_dir() -> Path:
    """``benchmarks/`` of the source checkout this package runs from, else of the cwd."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if (here / "peers").is_dir() else Path.cwd() / "benchmarks"


def python_for(system: System, bench_dir: Path) -> str | None:
    """The interpreter that runs ``system``, or None when its environment does not exist."""
    if system.label not in ENVIRONMENTS:
        return sys.executable
    variable, prebuilt, local = ENVIRONMENTS[system.label]
    candidates = [os.environ.get(variable)]
    if prebuilt is not None:
        candidates.append(str(prebuilt / "bin" / "python"))
    candidates.append(str(bench_dir / ".envs" / local / "bin" / "python"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def setup_envs(bench_dir: Path) -> None:
    """Create the peers' virtual environments under ``benchmarks/.envs/`` where missing."""
    for label, packages in (("ort_training", ORT_PACKAGES), ("jax_jit", JAX_PACKAGES)):
        system = next(s for s in PEERS if s.label == label)
        found = python_for(system, bench_dir)
        if found is not None:
            print(f"{label}: using {found}")
            continue
        target = bench_dir / ".envs" / ENVIRONMENTS[label][2]
        print(f"{label}: creating {target}")
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        subprocess.run([str(target / "bin" / "pip"), "install", "-q", *packages], check=True)


def sgemm_peak_gflops(n: int = 1024, repeats: int = 10) -> float:
    """The best float32 matrix-multiply rate of this machine (numpy's BLAS), in GFLOP/s."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def prepare_models(
    bench_dir: Path, cache: Path, models: Sequence[str], dropout: float | None
) -> None:
    """Write the cache entries (torch export) in a subprocess, so this process stays small."""
    args = [sys.executable, str(bench_dir / "models.py"), "--cache", str(cache), *models]
    if dropout is not None:
        args += ["--dropout", str(dropout)]
    subprocess.run(args, check=True, cwd=bench_dir.parent)


def entry_name(model: str, dropout: float | None) -> str:
    return f"{model}-nodrop" if model == "transformer" and dropout == 0 else model


def run_system(
    system: System, entry: Path, bench_dir: Path, steps: int, warmup: int, timeout: float
) -> dict[str, Any]:
    """Run one runner subprocess; its JSON result, or ``{"error": ...}``."""
    python = python_for(system, bench_dir)
    if python is None:
        return {"error": "environment missing (run benchmarks/run.py --setup-envs)"}
    command = [
        python,
        str(bench_dir / "peers" / system.script),
        "--entry",
        str(entry),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--config",
        json.dumps(system.config),
    ]
    env = dict(os.environ, PYTHONPATH=str(bench_dir.parent))
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    return {"error": lines[-1][:200] if lines else f"exit status {done.returncode}"}


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's rounds on one model combined: all step times, the highest peak memory."""
    good = [r for r in results if "error" not in r]
    if not good:
        return {"error": results[-1]["error"]}
    times = [t for r in good for t in r["times"]]
    merged = dict(good[-1])
    merged.update(
        times=times,
        median_ms=float(np.median(times) * 1e3),
        peak_rss_mb=max(r["peak_rss_mb"] for r in good),
        rounds=len(good),
    )
    return merged


def loss_agreement(
    rows: dict[str, dict[str, Any]], reference: str = "torch_eager"
) -> dict[str, float]:
    """Per system, the largest relative difference of its per-step losses from ``reference``."""
    ref = rows.get(reference, {})
    if "losses" not in ref:
        return {}
    expected = np.asarray(ref["losses"])
    out = {}
    for label, row in rows.items():
        if "losses" in row and len(row["losses"]) == len(expected):
            got = np.asarray(row["losses"])
            out[label] = float(np.max(np.abs(got - expected) / np.abs(expected)))
    return out


def format_table(report: dict[str, Any]) -> str:
    """The results as Markdown tables, one per model."""
    lines = [
        f"sgemm peak (numpy BLAS, 1024^3 float32): {report['sgemm_gflops']:.1f} GFLOP/s;"
        f" {report['steps']} timed steps after {report['warmup']} warm-up steps,"
        f" {report['rounds']} round(s), load average at start {report['load_average']}",
        "",
    ]
    for model, entry in report["models"].items():
        flops = entry["train_flops"]
        limit_ms = flops / (report["sgemm_gflops"] * 1e9) * 1e3
        lines += [
            f"### {model}: {entry['description']}",
            f"training FLOPs per step (forward + backward): {flops / 1e6:.1f} M;"
            f" compute limit {limit_ms:.3f} ms",
            "",
            "| system | median ms | peak RSS MiB | GFLOP/s | peer / traingraph |"
            " x compute limit | max loss rel. diff vs torch |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = entry["systems"]
        ref = rows.get(REFERENCE.label, {}).get("median_ms")
        agree = loss_agreement(rows)
        for label, row in rows.items():
            if "error" in row:
                lines.append(f"| {label} | failed: {row['error']} | | | | | |")
                continue
            ms = row["median_ms"]
            ratio = f"{ms / ref:.2f}" if ref else "-"
            note = f" ({row['optimizer']})" if row.get("optimizer", "adamw") != "adamw" else ""
            diff = agree.get(label)
            lines.append(
                f"| {label}{note} | {ms:.3f} | {row['peak_rss_mb']:.0f} |"
                f" {flops / (ms * 1e-3) / 1e9:.2f} | {ratio} | {ms / limit_ms:.1f} |"
                f" {'-' if diff is None else f'{diff:.1e}'} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="traingraph bench", description="Benchmark traingraph's training step against peers."
    )
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=DEFAULT_MODELS)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="labels to run (default: traingraph, traingraph spin and all peers)",
    )
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also traingraph at every optimization level with 1 and 2 threads",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="Transformer dropout (0 makes every loss comparable)",
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help="cache directory (default: benchmarks/.envs/cache)"
    )
    parser.add_argument("--bench-dir", type=Path, default=None, help="the benchmarks/ folder")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    parser.add_argument("--json", type=Path, default=None, help="write the full results here")
    parser.add_argument(
        "--setup-envs", action="store_true", help="create the peers' virtual environments and exit"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; returns the report (see :func:`format_table`)."""
    bench_dir = (args.bench_dir or default_bench_dir()).resolve()
    cache = (args.cache or bench_dir / ".envs" / "cache").resolve()
    systems = [*traingraph_systems(args.sweep), *PEERS]
    if args.systems:
        unknown = sorted(set(args.systems) - {s.label for s in systems})
        if unknown:
            raise SystemExit(
                f"unknown systems {unknown}; expected labels from {[s.label for s in systems]}"
            )
        systems = [s for s in systems if s.label in args.systems]
    prepare_models(bench_dir, cache, args.models, args.dropout)
    report: dict[str, Any] = {
        "command": " ".join(["traingraph bench", *sys.argv[1:]]),
        "sgemm_gflops": sgemm_peak_gflops(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "models": {},
    }
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_index in range(args.rounds):
        for model in args.models:
            entry = cache / entry_name(model, args.dropout)
            shift = round_index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                result = run_system(system, entry, bench_dir, args.steps, args.warmup, args.timeout)
                raw.setdefault(model, {}).setdefault(system.label, []).append(result)
                status = result.get("error") or f"{result['median_ms']:.3f} ms"
                print(
                    f"[round {round_index + 1}] {model:12s} {system.label:28s} {status}",
                    file=sys.stderr,
                    flush=True,
                )
    for model in args.models:
        meta = json.loads((cache / entry_name(model, args.dropout) / "meta.json").read_text())
        report["models"][model] = {
            "description": meta["description"],
            "train_flops": meta["train_flops"],
            "systems": {s.label: pooled(raw[model][s.label]) for s in systems},
        }
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``traingraph bench`` and ``benchmarks/run.py``."""
    args = parse_args(argv)
    if args.setup_envs:
        setup_envs((args.bench_dir or default_bench_dir()).resolve())
        return 0
    report = run(args)
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


__all__ = ["main", "run", "sgemm_peak_gflops"]
