"""Run many fuzz cases and print the table of outcomes.

Usage (from the repository root)::

    python -m tests.fuzz --cases 10000            # 10,000 cases of each kind
    python -m tests.fuzz --cases 200 --kinds npz native --workers 2 --log fuzz.jsonl

Each case runs in a worker process capped at ``--memory-gib`` of address space and
``--timeout`` seconds; the table counts per kind the inputs accepted, refused with
traingraph's own error (``clean``), refused with another exception (``raw``), MemoryErrors,
hangs and crashes. The exit code is 1 when any case was raw, memory, hang or crash.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.cases import KINDS
from fuzz.harness import DEFAULT_TIMEOUT, failures, run_cases, table


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--cases", type=int, default=100, help="cases per kind")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--workers", type=int, default=1, help="worker processes in parallel")
    parser.add_argument("--memory-gib", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    parser.add_argument("--log", type=Path, help="write one JSON line per case here")
    args = parser.parse_args()
    cases = [
        (kind, seed)
        for seed in range(args.first_seed, args.first_seed + args.cases)
        for kind in args.kinds
    ]
    shards = [cases[i :: args.workers] for i in range(args.workers)]
    log = args.log.open("w") if args.log else None
    with ThreadPoolExecutor(args.workers) as pool:
        parts = pool.map(
            lambda shard: run_cases(shard, int(args.memory_gib * 2**30), args.timeout, log),
            shards,
        )
        results = [r for part in parts for r in part]
    if log is not None:
        log.close()
    print(table(results))
    bad = failures(results)
    for r in bad[:50]:
        print(f"{r['outcome']}: {r['kind']} seed {r['seed']} {r.get('mutator')} via"
              f" {r.get('entry')}: {r.get('error')}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
