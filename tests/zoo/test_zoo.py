"""The zoo: every model, with each exporter, trains in traingraph as it does in PyTorch.

For each case and exporter (the dynamo exporter, and the TorchScript exporter at opset 17):
the artifacts build; the parameter gradients of one step match a float64 torch reference; 20
optimizer steps follow torch's loss curve; the exported inference model computes what the eval
graph computes. The large models are marked ``slow``: ``python -m pytest -q -m slow tests/zoo``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo.cases import CASES
from zoo.harness import EXPORTERS, ZooCase, run_case

INFERENCE_RTOL = 1e-5


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
    report = run_case(case, exporter, tmp_path)
    grads = report.gradients
    failures = grads.failures()
    assert not failures, (
        f"{len(failures)} of {len(grads.traingraph)} parameter gradients are off the float64"
        f" reference by more than max({grads.rtol}, 2x torch float32's error):"
        f" {dict(list(failures.items())[:5])} (traingraph error, torch float32 error)"
    )
    curve = report.curve
    assert not curve.failures(), (
        f"the loss curve leaves torch's at steps {curve.failures()} (step, error, allowed);"
        f" traingraph {curve.traingraph}, torch float64 {curve.torch64}"
    )
    assert report.inference_error <= INFERENCE_RTOL, (
        f"the exported inference model is {report.inference_error:.3g} (relative) off the eval"
        f" graph's output; expected at most {INFERENCE_RTOL}"
    )
