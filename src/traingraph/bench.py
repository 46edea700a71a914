"""``traingraph bench``: training-step time of traingraph against its peers, in one run.

Each system runs in its own process (and, where its packages conflict, its own virtual
environment) through a runner script in ``benchmarks/peers/``; the runners read the same
cached ONNX export, weights and data (``benchmarks/models.py``) and print their step times,
losses and peak memory as JSON. The orchestrator starts every system on a model at once and,
after their warm-up, lets them take turns (``--chunk`` timed steps each, in a rotated order), so
that every system meets the same machine conditions; ``--rounds`` repeats this with fresh
processes. It pools the step times and prints, per model, the median step time, peak resident
memory, achieved GFLOP/s, the ratio of each system's median to traingraph's, and the compute
limit: the model's FLOPs divided by this machine's measured sgemm peak.

With ``--zoo`` it runs the zoo set instead (``benchmarks/zoo.py``: resnet18, resnet50,
mobilenet_v3_small, efficientnet_b0, a ViT-Tiny, a BERT-mini, GPT-2-small decoder layers and an
LSTM tagger at realistic small-batch CPU settings) against torch eager, torch.compile,
onnxruntime-training 1.19.2 and ExecuTorch's training module. Every system starts from the same
weights and sees the same batches; the table says, per system, how far its first
:data:`AGREEMENT_STEPS` losses are from torch eager's (only the first loss where its optimizer
differs: onnxruntime-training has no SGD momentum, ExecuTorch no AdamW) and whether that is
within :data:`AGREEMENT_RTOL`. ``--threads 0 1`` runs every model with the libraries' default
thread counts and again with one thread.

The peers whose packages conflict with traingraph's run in virtual environments under
``benchmarks/.envs/`` (or the interpreter named by their environment variable, see
:data:`ENVIRONMENTS`); ``--setup-envs`` creates them with ``python -m venv`` and ``pip``.

Example:
    $ traingraph bench --models mlp lenet --rounds 2 --json results.json
    $ python benchmarks/run.py --setup-envs   # create the peers' virtual environments
    $ traingraph bench --zoo --threads 0 1 --json zoo.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "BENCH-RESULT "
READY = "BENCH-READY"
CHUNK_DONE = "BENCH-CHUNK"
MISSING_ENV = "environment missing (run benchmarks/run.py --setup-envs)"
DEFAULT_MODELS = ("mlp", "lenet", "resnet8", "transformer")
ZOO_MODELS = (
    "resnet18",
    "resnet50",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "vit_tiny",
    "bert_mini",
    "gpt2_stack",
    "lstm_tagger",
)
"""The zoo set (``benchmarks/zoo.py``'s ``BENCH_MODELS``)."""
AGREEMENT_STEPS = 3
"""The first losses of each system that are compared with torch eager's."""
AGREEMENT_RTOL = 1e-3
"""The largest relative distance from torch eager's losses that counts as agreement."""


def _torch_requirement() -> str:
    """The torch of this environment (the CPU build here), for the peers' environments."""
    return f"torch=={importlib.metadata.version('torch')}"


# (environment variable naming the peer's interpreter, its directory under benchmarks/.envs,
#  the packages pip installs there)
ENVIRONMENTS = {
    "ort_training": (
        "TRAINGRAPH_BENCH_ORT_PYTHON",
        "ortt",
        # onnxruntime.training imports torch; onnx 1.16 and numpy 1 are what 1.19.2 was built for
        ("onnxruntime-training-cpu==1.19.2", "onnx==1.16.*", "numpy<2", "{torch}"),
    ),
    "jax_jit": ("TRAINGRAPH_BENCH_JAX_PYTHON", "jax", ("jax", "jaxlib")),
    # executorch's wheel runs with the torch it was built beside; it declares no torch itself
    "executorch": (
        "TRAINGRAPH_BENCH_EXECUTORCH_PYTHON",
        "executorch",
        ("executorch==1.5.1", "{torch}"),
    ),
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
EXECUTORCH = System("executorch", "executorch_runner.py")
ZOO_SYSTEMS = (REFERENCE, *PEERS[:3], EXECUTORCH)
"""The systems of the zoo set (JAX has no import of these models)."""


def traingraph_systems(sweep: bool) -> list[System]:
    """traingraph's default session, one whose worker threads never spin, one running the
    optimizer graph instead of the fused update, and with ``sweep`` every optimization level
    with 1 and 2 threads."""
    systems = [
        REFERENCE,
        System("traingraph no-spin", "traingraph_runner.py", {"allow_spinning": False}),
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
    variable, local, _ = ENVIRONMENTS[system.label]
    candidates = [os.environ.get(variable), str(bench_dir / ".envs" / local / "bin" / "python")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def setup_envs(bench_dir: Path) -> None:
    """Create the peers' virtual environments under ``benchmarks/.envs/`` where missing: for
    each, ``python -m venv benchmarks/.envs/<name>`` and ``pip install`` of its packages
    (:data:`ENVIRONMENTS`), torch pinned to the version of this environment."""
    for label, (_, local, packages) in ENVIRONMENTS.items():
        found = python_for(System(label, ""), bench_dir)
        if found is not None:
            print(f"{label}: using {found}")
            continue
        target = bench_dir / ".envs" / local
        requirements = [p.format(torch=_torch_requirement()) for p in packages]
        print(f"{label}: creating {target}: pip install {' '.join(requirements)}")
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        subprocess.run([str(target / "bin" / "pip"), "install", "-q", *requirements], check=True)


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
    bench_dir: Path,
    cache: Path,
    models: Sequence[str],
    dropout: float | None,
    batch: int | None = None,
) -> None:
    """Write the cache entries (torch export) in a subprocess, so this process stays small;
    ``batch`` replaces the zoo set's batch sizes."""
    args = [sys.executable, str(bench_dir / "models.py"), "--cache", str(cache), *models]
    if dropout is not None:
        args += ["--dropout", str(dropout)]
    if batch is not None:
        args += ["--batch", str(batch)]
    subprocess.run(args, check=True, cwd=bench_dir.parent)


def entry_name(model: str, dropout: float | None, batch: int | None = None) -> str:
    """The cache entry of ``model`` (as ``benchmarks/models.py`` and ``zoo.py`` name it)."""
    if model in ZOO_MODELS:
        return model if batch is None else f"{model}-b{batch}"
    return f"{model}-nodrop" if model == "transformer" and dropout == 0 else model


@dataclass(frozen=True)
class Measurement:
    """What every runner measures: ``steps`` timed steps after ``warmup`` on the model in the
    folder ``entry`` (see :func:`prepare_models`), in turns of ``chunk`` steps where systems
    run side by side, with ``threads`` intra-op threads (0: each runner's default)."""

    entry: Path
    steps: int
    warmup: int
    chunk: int = 0
    threads: int = 0


def _command(python: str, system: System, bench_dir: Path, m: Measurement) -> list[str]:
    return [
        python,
        str(bench_dir / "peers" / system.script),
        "--entry",
        str(m.entry),
        "--steps",
        str(m.steps),
        "--warmup",
        str(m.warmup),
        "--config",
        json.dumps(system.config),
        "--chunk",
        str(m.chunk),
        "--threads",
        str(m.threads),
    ]


def _runner_env(bench_dir: Path) -> dict[str, str]:
    """The runners' environment: the benchmarks' package importable, ahead of the caller's
    ``PYTHONPATH`` (kept, so that a source tree it names is the one timed)."""
    caller = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = [str(bench_dir.parent), *filter(None, caller)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit)\b")
# an onnxruntime message's cause, after the C++ function and the failed check
_CHECK = re.compile(r"^([\w.]+): .*? was false\. (.*)$")


def _error_line(lines: list[str]) -> str:
    """The exception a runner ended with (its last line that names one), made short."""
    errors = [ln.strip() for ln in lines if _EXCEPTION.match(ln.strip())]
    line = errors[-1] if errors else lines[-1].strip()
    check = _CHECK.match(line)
    if check:
        line = f"{check.group(1)}: {check.group(2)}"
    return line[:300]


def _parse_result(stdout_lines: list[str], stderr: str, returncode: int | None) -> dict[str, Any]:
    """A runner's JSON result line, or ``{"error": <the exception it ended with>}``."""
    for line in reversed(stdout_lines):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    lines = [ln for ln in (stderr.splitlines() + stdout_lines) if ln.strip()]
    return {"error": _error_line(lines) if lines else f"exit status {returncode}"}


def run_system(
    system: System, measurement: Measurement, bench_dir: Path, timeout: float
) -> dict[str, Any]:
    """Run one runner subprocess to the end; its JSON result, or ``{"error": ...}``."""
    python = python_for(system, bench_dir)
    if python is None:
        return {"error": MISSING_ENV}
    command = _command(python, system, bench_dir, measurement)
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_runner_env(bench_dir),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    return _parse_result(done.stdout.splitlines(), done.stderr, done.returncode)


class _Runner:
    """A runner subprocess driven chunk by chunk (its ``--chunk`` protocol)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # Closed in finish(); a file, not a pipe, so that a chatty runner never blocks.
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ended = False  # the end of its output was read
        self.stdout: list[str] = []
        self.error: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, marker: str, timeout: float) -> bool:
        """Wait for a ``marker`` line; False (and ``error`` set) if the runner ends or stalls."""
        deadline = time.monotonic() + timeout
        while self.error is None:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.error = f"timed out after {timeout:.0f} s"
                self._process.kill()
                break
            if line is None:
                self._ended = True
                self.error = "ended early"
                break
            self.stdout.append(line)
            if line == marker:
                return True
        return False

    def go(self, timeout: float) -> bool:
        """Run one chunk of timed steps and wait until it is done."""
        assert self._process.stdin is not None
        try:
            self._process.stdin.write("go\n")
            self._process.stdin.flush()
        except OSError:
            self.error = "ended early"
            return False
        return self.expect(CHUNK_DONE, timeout)

    def finish(self, timeout: float) -> dict[str, Any]:
        """Close the runner's input, wait for it to exit and return its result."""
        assert self._process.stdin is not None
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            return {"error": f"timed out after {timeout:.0f} s"}
        while not self._ended and (line := self._lines.get()) is not None:
            self.stdout.append(line)
        self._stderr.seek(0)
        result = _parse_result(self.stdout, self._stderr.read(), self._process.returncode)
        self._stderr.close()
        return result


def run_interleaved(
    systems: Sequence[System],
    measurement: Measurement,
    bench_dir: Path,
    timeout: float,
    pause: float = 0.01,
) -> dict[str, dict[str, Any]]:
    """Run ``systems`` side by side on one model, ``measurement.chunk`` timed steps at a time
    in turn.

    Every runner starts at once and takes its warm-up steps; the timed steps then go round
    the systems chunk by chunk, in an order rotated each time, so that drift in the
    machine's speed falls on all of them alike. Only one system computes at a time; each
    chunk starts ``pause`` seconds after the last one ends, so that threads still spinning
    in the previous system have gone idle.

    Returns:
        Each system's JSON result (or ``{"error": ...}``), by label.
    """
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, _Runner] = {}
    for system in systems:
        python = python_for(system, bench_dir)
        if python is None:
            results[system.label] = {"error": MISSING_ENV}
            continue
        command = _command(python, system, bench_dir, measurement)
        runners[system.label] = _Runner(command, _runner_env(bench_dir))
    for runner in runners.values():
        runner.expect(READY, timeout)
    labels = list(runners)
    for index in range(-(-measurement.steps // measurement.chunk)):
        shift = index % max(1, len(labels))
        for label in labels[shift:] + labels[:shift]:
            if runners[label].error is None:
                time.sleep(pause)
                runners[label].go(timeout)
    for label, runner in runners.items():
        result = runner.finish(timeout)
        if runner.error is not None and "error" not in result:
            result = {"error": runner.error}
        results[label] = result
    return {s.label: results[s.label] for s in systems}


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
    rows: dict[str, dict[str, Any]], reference: str = "torch_eager", steps: int | None = None
) -> dict[str, tuple[float, int]]:
    """Per system, the largest relative difference of its losses from ``reference``'s.

    Args:
        rows: Each system's result, by label.
        reference: The label whose losses are the reference.
        steps: Compare the first ``steps`` losses (None: all of them). A system that reports
            ``optimizer_differs`` (it trains with another optimizer) is compared on its first
            loss only, the one before any update.

    Returns:
        ``(largest relative difference, losses compared)`` by label.
    """
    ref = rows.get(reference, {})
    if "losses" not in ref:
        return {}
    expected = np.asarray(ref["losses"])
    out = {}
    for label, row in rows.items():
        if "losses" not in row or len(row["losses"]) != len(expected):
            continue
        count = 1 if row.get("optimizer_differs") else steps or len(expected)
        got = np.asarray(row["losses"][:count])
        diff = np.abs(got - expected[:count]) / np.abs(expected[:count])
        out[label] = (float(np.max(diff)), count)
    return out


def _turns(chunk: int) -> str:
    if chunk > 0:
        return f"(systems taking turns, {chunk} steps at a time)"
    return "(one system after another)"


def threads_label(threads: int) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''}" if threads else "default threads"


def format_table(report: dict[str, Any]) -> str:
    """The results as Markdown tables, one per model (and thread setting)."""
    rtol = report.get("agreement_rtol")
    agreement = "loss rel. diff vs torch_eager (steps)" + (f", within {rtol:g}" if rtol else "")
    lines = [
        f"sgemm peak (numpy BLAS, 1024^3 float32): {report['sgemm_gflops']:.1f} GFLOP/s;"
        f" {report['steps']} timed steps after {report['warmup']} warm-up steps"
        f" {_turns(report.get('chunk', 0))}, {report['rounds']} round(s),"
        f" load average at start {report['load_average']}",
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
            f" x compute limit | {agreement} |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = entry["systems"]
        ref = rows.get(REFERENCE.label, {}).get("median_ms")
        agree = loss_agreement(rows, steps=report.get("agreement_steps"))
        for label, row in rows.items():
            if "error" in row:
                lines.append(f"| {label} | failed: {row['error']} | | | | | |")
                continue
            ms = row["median_ms"]
            ratio = f"{ms / ref:.2f}" if ref else "-"
            note = f" ({row['optimizer']})" if row.get("optimizer", "adamw") != "adamw" else ""
            diff = "-"
            if label in agree:
                value, count = agree[label]
                diff = f"{value:.1e} ({count})"
                if rtol:
                    diff += " ok" if value <= rtol else " **disagrees**"
            lines.append(
                f"| {label}{note} | {ms:.3f} | {row['peak_rss_mb']:.0f} |"
                f" {flops / (ms * 1e-3) / 1e9:.2f} | {ratio} | {ms / limit_ms:.1f} | {diff} |"
            )
        lines.append("")
    return "\n".join(lines)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, its usage line spelled as the other commands' (click's) spell it."""

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: str | None = None) -> None:
        super().add_usage(usage, actions, groups, "Usage: " if prefix is None else prefix)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="traingraph bench",
        description="Benchmark traingraph's training step against peers.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--zoo",
        action="store_true",
        help="the zoo set (benchmarks/zoo.py) against torch eager, torch.compile,"
        " onnxruntime-training and ExecuTorch",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=[*DEFAULT_MODELS, *ZOO_MODELS],
        help=f"default: {' '.join(DEFAULT_MODELS)}; with --zoo the whole zoo set",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="labels to run (default: traingraph, its variants and all peers; with --zoo"
        " traingraph and the zoo's peers)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per round [50; zoo 20]"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps before them [10; zoo 3]"
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="run the systems side by side, taking turns this many timed steps at a time"
        " (0: one system after another) [10; zoo 2]",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[0],
        help="intra-op threads of every system, one run per value (0: each library's default);"
        " `--threads 0 1` runs the defaults and one thread",
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="zoo set: this batch size for every model"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="repetitions, each with fresh processes"
    )
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
        "--setup-envs",
        "--setup-peers",
        action="store_true",
        help="create the peers' virtual environments and exit",
    )
    args = parser.parse_args(argv)
    defaults = {"steps": (50, 20), "warmup": (10, 3), "chunk": (10, 2)}
    for name, (default, zoo) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, zoo if args.zoo else default)
    if args.models is None:
        args.models = list(ZOO_MODELS if args.zoo else DEFAULT_MODELS)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; returns the report (see :func:`format_table`)."""
    bench_dir = (args.bench_dir or default_bench_dir()).resolve()
    cache = (args.cache or bench_dir / ".envs" / "cache").resolve()
    zoo = getattr(args, "zoo", False)
    threads_list = getattr(args, "threads", None) or [0]
    batch = getattr(args, "batch", None)
    systems = list(ZOO_SYSTEMS) if zoo else [*traingraph_systems(args.sweep), *PEERS]
    if args.systems:
        unknown = sorted(set(args.systems) - {s.label for s in systems})
        if unknown:
            raise SystemExit(
                f"unknown systems {unknown}; expected labels from {[s.label for s in systems]}"
            )
        systems = [s for s in systems if s.label in args.systems]
    prepare_models(bench_dir, cache, args.models, args.dropout, batch)
    report: dict[str, Any] = {
        "command": " ".join(["traingraph bench", *sys.argv[1:]]),
        "sgemm_gflops": sgemm_peak_gflops(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "chunk": args.chunk,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "models": {},
    }
    if zoo:
        report.update(agreement_steps=AGREEMENT_STEPS, agreement_rtol=AGREEMENT_RTOL)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_index in range(args.rounds):
        for threads in threads_list:
            for model in args.models:
                key = model if len(threads_list) == 1 else f"{model}, {threads_label(threads)}"
                entry = cache / entry_name(model, args.dropout, batch)
                shift = round_index % len(systems)
                order = systems[shift:] + systems[:shift]
                chunk = max(args.chunk, 0)
                measurement = Measurement(entry, args.steps, args.warmup, chunk, threads)
                if args.chunk > 0:
                    results = run_interleaved(order, measurement, bench_dir, args.timeout)
                else:
                    results = {
                        s.label: run_system(s, measurement, bench_dir, args.timeout)
                        for s in order
                    }
                for label, result in results.items():
                    raw.setdefault(key, {}).setdefault(label, []).append(result)
                    status = result.get("error") or f"{result['median_ms']:.3f} ms"
                    print(
                        f"[round {round_index + 1}] {key:28s} {label:28s} {status}",
                        file=sys.stderr,
                        flush=True,
                    )
    for threads in threads_list:
        for model in args.models:
            key = model if len(threads_list) == 1 else f"{model}, {threads_label(threads)}"
            entry = cache / entry_name(model, args.dropout, batch)
            meta = json.loads((entry / "meta.json").read_text())
            report["models"][key] = {
                "description": meta["description"],
                "threads": threads,
                "train_flops": meta["train_flops"],
                "systems": {s.label: pooled(raw[key][s.label]) for s in systems},
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


def command() -> Any:
    """The ``traingraph bench`` click command: the arguments go to :func:`main` as they are."""
    import click

    @click.command(
        "bench",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def bench_command(args: tuple[str, ...]) -> None:
        """Benchmark the training step against PyTorch, onnxruntime-training and other peers
        (`traingraph bench --help` lists the options; `--zoo` runs real models)."""
        sys.exit(main(list(args)))

    return bench_command


__all__ = ["command", "main", "run", "sgemm_peak_gflops"]
