"""A/B of traingraph's training step between two source trees (two commits), one process each.

Runs ``benchmarks/peers/traingraph_runner.py`` of this checkout (the same runner, cache entries
and data for both sides) on each benchmark model, once with ``PYTHONPATH=<before>/src`` and
once with ``PYTHONPATH=<after>/src``, alternating the processes (before, after, before, ...)
``--pairs`` times for each model and thread setting. Each tree's C extensions must be built
(``python setup.py build_ext --inplace`` in it). Prints per model the median over the
processes of their median step time, the ratio after / before of those medians, the median of
the ratios within each pair, and the largest relative difference of the losses of every process
from those of the first ``before`` process (the ``after`` processes, and the other ``before``
processes: the run-to-run difference, from dropout masks, say).

    python benchmarks/ab_trees.py --before OLD_TREE --after NEW_TREE --threads 0 1 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from traingraph.bench import DEFAULT_MODELS, RESULT_PREFIX, entry_name, threads_label

BENCH_DIR = Path(__file__).resolve().parent


def run_side(tree: Path, entry: Path, threads: int, steps: int, warmup: int) -> dict[str, Any]:
    """One runner process with ``tree``'s traingraph; its result (``median_ms``, ``losses``)."""
    command = [
        sys.executable,
        str(BENCH_DIR / "peers" / "traingraph_runner.py"),
        "--entry",
        str(entry),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--threads",
        str(threads),
    ]
    path = os.pathsep.join([str(tree / "src"), str(BENCH_DIR.parent)])
    done = subprocess.run(
        command, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path), check=False
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(
        f"the runner with {tree / 'src'} on {entry.name} ended without a result (exit status"
        f" {done.returncode}); its stderr ends with: {done.stderr[-2000:]}"
    )


def relative_difference(reference: np.ndarray, others: list[np.ndarray]) -> float:
    """The largest relative difference of the losses ``others`` from ``reference`` (NaN for
    none)."""
    if not others:
        return float("nan")
    return max(float(np.max(np.abs(o - reference) / np.abs(reference))) for o in others)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of side A")
    parser.add_argument("--after", type=Path, required=True, help="source tree of side B")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--threads", type=int, nargs="+", default=[0], help="0: the default")
    parser.add_argument("--pairs", type=int, default=5, help="before/after processes each")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument(
        "--cache", type=Path, default=BENCH_DIR / ".envs" / "cache", help="cache entries"
    )
    parser.add_argument("--json", type=Path, help="write every process's median here")
    args = parser.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    subprocess.run(
        [sys.executable, str(BENCH_DIR / "models.py"), "--cache", str(args.cache), *args.models],
        check=True,
        cwd=BENCH_DIR.parent,
    )
    rows: dict[str, dict[str, Any]] = {}
    for threads in args.threads:
        for model in args.models:
            entry = args.cache / entry_name(model, None)
            medians: dict[str, list[float]] = {side: [] for side in sides}
            losses: dict[str, list[np.ndarray]] = {side: [] for side in sides}
            for pair in range(args.pairs):
                for side, tree in sides.items():
                    result = run_side(tree, entry, threads, args.steps, args.warmup)
                    medians[side].append(result["median_ms"])
                    losses[side].append(np.asarray(result["losses"]))
                    print(
                        f"{model}, {threads_label(threads)}, pair {pair + 1}: {side}"
                        f" {result['median_ms']:.3f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
            first = losses["before"][0]
            rows[f"{model}, {threads_label(threads)}"] = {
                **medians,
                "loss_rel_diff": relative_difference(first, losses["after"]),
                "loss_rel_diff_within": relative_difference(first, losses["before"][1:]),
            }
    print("| model, threads | before ms | after ms | after / before | pair ratios, median |"
          " loss rel. diff, after | within before |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for key, row in rows.items():
        a, b = statistics.median(row["before"]), statistics.median(row["after"])
        pairs = statistics.median(y / x for x, y in zip(row["before"], row["after"], strict=True))
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a:.3f} | {pairs:.3f} |"
              f" {row['loss_rel_diff']:.1e} | {row['loss_rel_diff_within']:.1e} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"sides": {k: str(v) for k, v in sides.items()},
                                         "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
