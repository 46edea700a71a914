"""Every script in examples/ runs to completion (so CI keeps them working)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUN_ELSEWHERE = {"fine_tune_minilm", "flower_digits"}
"""Examples that a test of their own runs (slow): tests/test_fine_tune_minilm.py; and
tests/test_flower.py, a smaller flower_digits without Ray (Flower's simulation engine)."""
EXAMPLES = sorted(
    p
    for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.py")
    if p.stem not in RUN_ELSEWHERE
)


def test_examples_exist():
    assert EXAMPLES, "examples/ holds no scripts"


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout}\n{result.stderr}"
