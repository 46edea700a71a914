"""What every benchmark runner shares: arguments, the timed loop and the JSON it prints.

A runner is a script run by ``benchmarks/run.py`` in its own process (and virtual
environment). It reads the cache entry written by :mod:`benchmarks.models`, takes
``warmup + steps`` training steps over the cached batches, and prints one JSON object on its
last stdout line: step times, losses, peak resident memory and setup time. This module only
needs numpy and the standard library, so it runs in every environment.

``--threads N`` sets the system's intra-op thread count (0 leaves its default). Building a
system's training program (artifacts, a lowered program) runs in a child process
(:func:`in_child`), so that the peak resident memory reported is that of training alone.

With ``--chunk K`` the runner takes its timed steps K at a time, each chunk when a line arrives
on stdin, and acknowledges it on stdout. The orchestrator uses this to interleave the systems
step chunk by step chunk, so that every system meets the same machine conditions (a shared
machine's speed drifts by tens of percent over seconds).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULT_PREFIX = "BENCH-RESULT "
READY = "BENCH-READY"
CHUNK_DONE = "BENCH-CHUNK"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run one benchmark system on one model.")
    parser.add_argument("--entry", type=Path, required=True, help="cache entry directory")
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--config", default="{}", help="system options as a JSON object")
    parser.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="take the timed steps this many at a time, each chunk on a line from stdin",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (0: the system's default)"
    )
    return parser.parse_args(argv)


def in_child(function: Callable[..., None], *args: Any, timeout: float | None = None) -> None:
    """Run ``function(*args)`` in a forked child process and wait for it (at most ``timeout``
    seconds, None: no limit).

    Call it before the parent starts threads of its own (a fork copies only the calling
    thread). The child's memory does not count in the parent's peak resident memory.

    Raises:
        RuntimeError: The child failed; the message ends with the child's error (its
            traceback is on stderr).
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            function(*args)
        except BaseException as error:
            send.send(f"{type(error).__name__}: {' '.join(str(error).split())}")
            raise

    process = context.Process(target=child)
    process.start()
    send.close()
    name = getattr(function, "__name__", "the build")
    if not receive.poll(timeout):
        process.kill()
        process.join()
        raise RuntimeError(f"{name} failed in a child process: it took over {timeout:.0f} s")
    try:
        cause = receive.recv()  # the child's error; end of file when it succeeds
    except EOFError:
        cause = ""
    process.join()
    if process.exitcode != 0:
        cause = cause or f"exit code {process.exitcode}"
        raise RuntimeError(f"{name} failed in a child process: {cause}")


def cached_build(
    entry: Path, name: str, timeout: float | None, build: Callable[..., None], *args: Any
) -> Path:
    """``entry / name``, built once by ``build(*args, path)`` in a child process (:func:`in_child`)
    that may take ``timeout`` seconds.

    For what a pinned peer builds from the entry alone (its version in ``name``), so that
    every run after the first skips it. A build that raised is remembered too
    (``<name>.failed``, its message), and raises again at once.

    Raises:
        RuntimeError: The build failed, now or in an earlier run.
    """
    target = entry / name
    failure = entry / f"{name}.failed"
    if failure.is_file():
        raise RuntimeError(failure.read_text())
    if not target.exists():
        partial = entry / f"{name}.partial-{os.getpid()}"
        try:
            in_child(build, *args, partial, timeout=timeout)
        except RuntimeError as error:
            if ": " in str(error):  # the child raised (it was not killed)
                failure.write_text(str(error))
            raise
        partial.rename(target)
    return target


def load_entry(entry: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(meta, weights, data)`` of a cache entry (see ``benchmarks.models.prepare``)."""
    meta = json.loads((entry / "meta.json").read_text())
    with np.load(entry / "weights.npz") as w:
        weights = {k: w[k] for k in w.files}
    with np.load(entry / "data.npz") as d:
        data = {k: d[k] for k in d.files}
    return meta, weights, data


def peak_rss_mb() -> float:
    """This process's resident-memory high-water mark, in MiB."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0


def timed_loop(
    step: Callable[[np.ndarray, np.ndarray], float],
    data: dict[str, np.ndarray],
    args: argparse.Namespace,
) -> tuple[list[float], list[float]]:
    """Run ``args.warmup + args.steps`` steps over the cached batches in order.

    With ``args.chunk``, announce readiness after the warm-up, then run the timed steps
    ``args.chunk`` at a time, each chunk when a line arrives on stdin (until end of input).

    Returns:
        The wall time of each timed step in seconds, and the loss of every step (warm-up
        included, so step k's loss is comparable across systems).
    """
    x, y = data["x"], data["y"]
    times: list[float] = []
    losses: list[float] = []

    def run(first: int, stop: int) -> None:
        for i in range(first, stop):
            xb, yb = x[i % len(x)], y[i % len(y)]
            start = time.perf_counter()
            loss = step(xb, yb)
            elapsed = time.perf_counter() - start
            losses.append(float(loss))
            if i >= args.warmup:
                times.append(elapsed)

    total = args.warmup + args.steps
    if args.chunk <= 0:
        run(0, total)
        return times, losses
    run(0, args.warmup)
    _say(READY)
    for first in range(args.warmup, total, args.chunk):
        if not sys.stdin.readline():
            break
        run(first, min(first + args.chunk, total))
        _say(CHUNK_DONE)
    return times, losses


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(
    system: str,
    meta: dict[str, Any],
    times: list[float],
    losses: list[float],
    setup_s: float,
    **extra: Any,
) -> None:
    """Print the result line that ``benchmarks/run.py`` parses."""
    result = {
        "system": system,
        "model": meta["name"],
        "times": times,
        "median_ms": float(np.median(times) * 1e3) if times else None,
        "losses": losses,
        "peak_rss_mb": peak_rss_mb(),
        "setup_s": setup_s,
        **extra,
    }
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
