"""The model zoo's table: correctness against PyTorch and step time against torch eager.

For each zoo model (``tests/zoo/cases.py``) and exporter, it runs what the zoo test checks
(:func:`zoo.harness.run_case`: export through ``traingraph.from_torch``, artifacts, gradients
against float64 torch, 20 optimizer steps against ``torch.optim``, the inference model against
the eval graph) and then times the train step (forward, backward, optimizer update) of
traingraph and of torch eager in float32, in alternating runs, and prints one row per model:

- grad err: the largest parameter-gradient distance from float64 torch, relative to that
  gradient's norm, of traingraph and (in parentheses) of torch float32;
- curve err: the largest relative distance of the loss from torch float64's over the steps, of
  traingraph and (in parentheses) of torch float32; then ``ok``, or ``FAIL`` where a check
  of the zoo test fails;
- ms/step: medians of the alternating runs, traingraph, torch eager, and torch's time over
  traingraph's (above 1: traingraph is faster);
- load s: the time ``Module(...)`` takes on the artifacts.

Usage:
    python benchmarks/zoo.py                       # the default (fast) zoo, both exporters
    python benchmarks/zoo.py --slow                # with the large models
    python benchmarks/zoo.py --models resnet18 unet --exporters dynamo --repeats 9
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from zoo.cases import CASES
from zoo.harness import EXPORTERS, CaseReport, run_case


def _row(report: CaseReport) -> str:
    tg, t32, _ = report.gradients.worst()
    curve = report.curve
    ok = not report.problems()
    assert report.step_ms is not None
    ours, eager = report.step_ms
    return (
        f"{report.case:<30} {report.exporter:<12} {tg:8.1e} ({t32:7.1e}) "
        f"{max(curve.errors()):8.1e} ({max(curve.torch32_errors()):7.1e}) "
        f"{'ok' if ok else 'FAIL':<5}{ours:9.1f} {eager:9.1f} {eager / ours:6.2f}x"
        f" {report.load_s:7.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", action="store_true", help="include the large models")
    parser.add_argument("--models", nargs="*", help="only these cases (by name)")
    parser.add_argument(
        "--exporters", nargs="*", default=list(EXPORTERS), choices=EXPORTERS, help="exporters"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="alternating timing runs per model (5 steps each)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads of traingraph and torch (0: defaults)"
    )
    args = parser.parse_args(argv)
    cases = [
        c
        for c in CASES
        if (args.slow or not c.slow) and (not args.models or c.name in args.models)
    ]
    if not cases:
        parser.error(f"no case matches; the cases are {[c.name for c in CASES]}")
    print(
        f"{'model':<30} {'exporter':<12} {'grad err (torch32)':<19}"
        f" {'curve err (torch32)':<19} {'':<5}{'tg ms':>9} {'torch ms':>9} {'ratio':>7}"
        f" {'load s':>7}"
    )
    failed = False
    for case in cases:
        for exporter in args.exporters:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        report = run_case(
                            case, exporter, Path(tmp), args.threads, args.repeats
                        )
                except Exception as error:  # a failing model is a row, not the end of the table
                    failed = True
                    message = str(error).splitlines()[0][:120] if str(error) else ""
                    name = type(error).__name__
                    print(f"{case.name:<30} {exporter:<12} error: {name}: {message}")
                    continue
            print(_row(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
