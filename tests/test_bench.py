"""The benchmark's correctness check: every available system's losses agree, step by step.

A small setting (a few steps of the MLP and the LeNet CNN, and of the zoo set's LSTM tagger at
batch 2) so that it runs in CI; the peers in their own virtual environments run where those
environments exist.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import numpy as np
import pytest

from traingraph import bench

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
STEPS = 6


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench-cache")
    bench.prepare_models(BENCH_DIR, directory, ["mlp", "lenet"], None)
    return directory


@functools.cache
def _run(label: str, cache: Path, model: str) -> dict:
    """One system's result on ``model`` (run once per test session)."""
    systems = {s.label: s for s in [*bench.traingraph_systems(False), *bench.PEERS]}
    system = systems[label]
    if bench.python_for(system, BENCH_DIR) is None:
        pytest.skip(f"{label}'s environment is missing; create it with run.py --setup-envs")
    measurement = bench.Measurement(cache / model, STEPS, 0)
    result = bench.run_system(system, measurement, BENCH_DIR, timeout=300)
    assert "error" not in result, result
    return result


@pytest.mark.parametrize("model", ["mlp", "lenet"])
def test_traingraph_losses_match_torch_eager(cache, model):
    expected = _run("torch_eager", cache, model)["losses"]
    for label in ("traingraph", "traingraph graph-opt"):
        got = _run(label, cache, model)
        assert len(got["losses"]) == STEPS
        np.testing.assert_allclose(got["losses"], expected, rtol=1e-4, err_msg=label)
        assert got["median_ms"] > 0 and got["peak_rss_mb"] > 0


@pytest.mark.parametrize(
    ("label", "rtol"),
    # onnxruntime-training's fused AdamW kernel rounds differently from torch's foreach AdamW;
    # its losses drift apart by about 1e-2 relative over the first steps.
    [("jax_jit", 1e-4), ("ort_training", 3e-2)],
)
def test_peer_losses_match_torch_eager(cache, label, rtol):
    expected = _run("torch_eager", cache, "mlp")["losses"]
    got = _run(label, cache, "mlp")["losses"]
    np.testing.assert_allclose(got, expected, rtol=rtol, err_msg=label)


def test_report_table_lists_every_system(cache):
    args = argparse.Namespace(
        models=["mlp"], systems=["traingraph", "torch_eager"], steps=3, warmup=1, rounds=1,
        sweep=False, dropout=None, cache=cache, bench_dir=BENCH_DIR, timeout=300.0, chunk=2,
    )  # fmt: skip
    report = bench.run(args)
    table = bench.format_table(report)
    assert "| traingraph |" in table and "| torch_eager |" in table
    assert report["sgemm_gflops"] > 0
    rows = report["models"]["mlp"]["systems"]
    assert bench.loss_agreement(rows)["traingraph"][0] < 1e-4


def test_session_ab_reports_every_setting(cache, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import session_ab

    configs = ['{"allow_spinning": false}', "{}"]
    session_ab.main(["mlp", *configs, "--chunks", "2", "--steps", "3", "--cache", str(cache)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mlp: 2 chunks of 3 steps, ms per step"
    assert [line.split()[0] for line in lines[1:]] == ['{"allow_spinning":', "{}"]
    assert lines[1].rstrip().endswith("vs first 1.000")


def _zoo_args(cache: Path, systems: list[str], models: list[str], batch: int) -> argparse.Namespace:
    return bench.parse_args(
        ["--zoo", "--models", *models, "--systems", *systems, "--batch", str(batch),
         "--steps", "2", "--warmup", "1", "--chunk", "1", "--threads", "1",
         "--cache", str(cache), "--bench-dir", str(BENCH_DIR)]
    )  # fmt: skip


def test_zoo_set_is_the_benchmarks_table(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR.parent))
    from benchmarks import zoo

    assert list(zoo.BENCH_MODELS) == list(bench.ZOO_MODELS)


def test_zoo_table_on_the_smallest_member(tmp_path):
    """The zoo run's report and table on the LSTM tagger at batch 2, traingraph and torch
    eager on one thread: a row per system, and losses that agree over the first steps."""
    report = bench.run(_zoo_args(tmp_path, ["traingraph", "torch_eager"], ["lstm_tagger"], 2))
    entry = report["models"]["lstm_tagger"]
    assert entry["threads"] == 1 and "batch 2" in entry["description"]
    rows = entry["systems"]
    assert list(rows) == ["traingraph", "torch_eager"]
    for row in rows.values():
        assert "error" not in row, row
        assert len(row["losses"]) == 3 and len(row["times"]) == 2
        assert row["median_ms"] > 0 and row["peak_rss_mb"] > 0
    diff, steps = bench.loss_agreement(rows, steps=bench.AGREEMENT_STEPS)["traingraph"]
    assert steps == bench.AGREEMENT_STEPS and diff < bench.AGREEMENT_RTOL
    table = bench.format_table(report).splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("| system |"))
    assert table[header - 3].startswith("### lstm_tagger: LSTM tagger")
    assert f"within {bench.AGREEMENT_RTOL:g}" in table[header]
    body = table[header + 2 : header + 4]
    assert [line.split(" | ")[0] for line in body] == ["| traingraph", "| torch_eager"]
    assert all(line.count("|") == 8 and line.endswith(" ok |") for line in body)


# What a peer cannot run, and the causes its error may name.
PEER_GAPS = {
    # onnxruntime-training 1.19.2 has no gradient builder for HardSwish
    ("ort_training", "mobilenet_v3_small"): ("HardSwish",),
    # its LSTMGrad kernel takes the forward direction only
    ("ort_training", "lstm_tagger"): ("forward direction",),
    # ExecuTorch's edge dialect has no training-mode BatchNorm; on a loaded machine the
    # lowering reaches its time limit before it gets there
    ("executorch", "mobilenet_v3_small"): ("_native_batch_norm_legit_functional", "took over"),
}
# onnxruntime-training's AdamW drifts from torch's by up to about 1e-2 relative over the first
# steps (2.4e-3 on ViT-Tiny at batch 2, 2.9e-2 on BERT-mini at batch 16)
PEER_RTOL = {"ort_training": 3e-2}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mobilenet_v3_small", "vit_tiny"])
def test_zoo_peers_agree(tmp_path, model):
    """Every zoo peer whose environment exists runs, or fails for the reason it is known to,
    and agrees with torch eager: over the first steps, or on the first loss where it trains
    with another optimizer."""
    labels = [s.label for s in bench.ZOO_SYSTEMS]
    available = [s.label for s in bench.ZOO_SYSTEMS if bench.python_for(s, BENCH_DIR)]
    args = _zoo_args(tmp_path, available, [model], 2)
    args.steps, args.timeout = 3, 1200.0
    rows = bench.run(args)["models"][model]["systems"]
    assert list(rows) == [label for label in labels if label in available]
    for label, row in rows.items():
        causes = PEER_GAPS.get((label, model))
        if causes is None:
            assert "error" not in row, (label, row)
        else:
            assert any(cause in row.get("error", "") for cause in causes), (label, row)
    agreement = bench.loss_agreement(rows, steps=bench.AGREEMENT_STEPS)
    assert set(agreement) == {label for label, row in rows.items() if "error" not in row}
    for label, (diff, steps) in agreement.items():
        assert diff < PEER_RTOL.get(label, bench.AGREEMENT_RTOL), (label, diff, steps)


def test_runners_keep_the_callers_pythonpath(monkeypatch, tmp_path):
    # A source tree named in PYTHONPATH is the one the runners import and time.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tree/src", "/more"]))
    env = bench._runner_env(tmp_path / "benchmarks")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/tree/src", "/more"]
