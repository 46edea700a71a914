"""The zoo: every model, with each exporter, trains in traingraph as it does in PyTorch.

For each case and exporter (the dynamo exporter, and the TorchScript exporter at opset 17):
the artifacts build; the parameter gradients of one step match a float64 torch reference; 20
optimizer steps follow torch's loss curve; the exported inference model computes what the eval
graph computes. The large models are marked ``slow``: ``python -m pytest -q -m slow tests/zoo``.
Each test runs traingraph and torch on one thread, as ``pytest -n 2`` runs two tests at once
on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo.cases import CASES
from zoo.harness import EXPORTERS, ZooCase, run_case


def _params() -> list[object]:
    params = []
    for case in CASES:
        for exporter in EXPORTERS:
            marks: list[pytest.MarkDecorator] = []
            if case.slow:
                marks.append(pytest.mark.slow)
            if exporter in case.xfail:
                marks.append(pytest.mark.xfail(strict=True, reason=case.xfail[exporter]))
            params.append(pytest.param(case, exporter, marks=marks, id=f"{case.name}-{exporter}"))
    return params


@pytest.mark.parametrize(("case", "exporter"), _params())
def test_trains_like_torch(case: ZooCase, exporter: str, tmp_path: Path) -> None:
    problems = run_case(case, exporter, tmp_path, threads=1).problems()
    assert not problems, "\n".join(problems)
