"""Runs fuzz cases in worker processes with a memory cap and a time cap per case.

A worker (:func:`fuzz.cases.serve`) runs cases one after another with its address space capped
by ``resource.setrlimit(RLIMIT_AS)``. A case that runs past its time cap is a ``hang``: the
worker is killed and a new one started. A worker that dies during a case is a ``crash``.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fuzz.cases import KINDS

OUTCOMES = ("accepted", "clean", "raw", "memory", "hang", "crash")
TESTS_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MEMORY = 4 * 2**30
DEFAULT_TIMEOUT = 60.0
STARTUP_TIMEOUT = 300.0


class Worker:
    """One worker process; restarted after a hang or a crash."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.process: subprocess.Popen[str] | None = None
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())

    def _start(self) -> subprocess.Popen[str]:
        code = (
            f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r});"
            f" from fuzz.cases import serve; serve({self.memory_bytes})"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINGRAPH_DEBUG": ""}
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        line = self._read_line(process, STARTUP_TIMEOUT)
        if line != "ready":
            process.kill()
            raise RuntimeError(f"the fuzz worker did not start (it said {line!r})")
        return process

    @staticmethod
    def _read_line(process: subprocess.Popen[str], timeout: float) -> str | None:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready:
            return None
        return process.stdout.readline().strip()

    def run(self, kind: str, seed: int, timeout: float) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        process = self.process
        assert process.stdin is not None
        start = time.monotonic()
        process.stdin.write(f"{kind} {seed}\n")
        process.stdin.flush()
        line = self._read_line(process, timeout)
        seconds = time.monotonic() - start
        if line:
            result: dict[str, Any] = json.loads(line)
        else:
            hung = process.poll() is None
            where = ""
            if hung:  # the worker's stacks, written by faulthandler on SIGUSR1
                self.stderr.seek(0, os.SEEK_END)
                end = self.stderr.tell()
                process.send_signal(signal.SIGUSR1)
                time.sleep(2)
                self.stderr.seek(end)
                where = " | ".join(
                    line.strip() for line in self.stderr.read().splitlines() if "File" in line
                )[:2000]
            process.kill()
            process.wait()
            self.process = None
            result = {
                "kind": kind,
                "seed": seed,
                "outcome": "hang" if hung else "crash",
                "error": f"no answer in {timeout:.0f} s: {where}"
                if hung
                else f"exit {process.returncode}",
            }
        result["seconds"] = round(seconds, 3)
        return result

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def run_cases(
    cases: Iterable[tuple[str, int]],
    memory_bytes: int = DEFAULT_MEMORY,
    timeout: float = DEFAULT_TIMEOUT,
    log: Any = None,
) -> list[dict[str, Any]]:
    """Runs ``cases`` (``(kind, seed)`` pairs) in one worker; returns one result per case."""
    worker = Worker(memory_bytes)
    results = []
    try:
        for kind, seed in cases:
            result = worker.run(kind, seed, timeout)
            results.append(result)
            if log is not None:
                log.write(json.dumps(result) + "\n")
                log.flush()
    finally:
        worker.close()
    return results


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: cases and outcomes per kind."""
    counts: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in KINDS}
    for r in results:
        counts[r["kind"]][r["outcome"]] += 1
    lines = [
        "| kind | cases | " + " | ".join(OUTCOMES) + " |",
        "|---|---:|" + "---:|" * len(OUTCOMES),
    ]
    for kind, c in counts.items():
        if c:
            cells = " | ".join(str(c[o]) for o in OUTCOMES)
            lines.append(f"| {kind} | {sum(c.values())} | {cells} |")
    return "\n".join(lines)


def failures(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases that ended in anything but acceptance or a clean error."""
    return [r for r in results if r["outcome"] not in ("accepted", "clean")]
