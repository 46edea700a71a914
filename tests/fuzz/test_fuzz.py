"""A fixed-seed sample of fuzz cases per kind: every one is accepted or refused cleanly.

``python -m tests.fuzz --cases 10000`` runs the full set (see ``tests/fuzz/__main__.py``).
"""

from __future__ import annotations

from fuzz.cases import KINDS
from fuzz.harness import failures, run_cases, table

CASES_PER_KIND = 300
SEED = 20_000  # apart from the seeds the full runs start at


def test_fuzz_sample_has_no_raw_errors_hangs_crashes_or_memory_blowups():
    cases = [(kind, SEED + i) for i in range(CASES_PER_KIND) for kind in KINDS]
    results = run_cases(cases, timeout=120.0)
    bad = failures(results)
    assert not bad, table(results) + "\n" + "\n".join(
        f"{r['outcome']}: {r['kind']} seed {r['seed']} {r.get('mutator')} via {r.get('entry')}:"
        f" {r.get('error')}"
        for r in bad
    )
    outcomes = {r["outcome"] for r in results}
    assert "clean" in outcomes  # the mutators do produce bad input
