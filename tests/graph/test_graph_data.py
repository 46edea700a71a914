"""The double-buffered input pipeline and weight sources that load and purge."""

from __future__ import annotations

import time

import numpy as np
import pytest

import traingraph as tg
from traingraph import layers as L
from traingraph.graph import Batch, InferenceGraph, InputPipeline, WeightSource, init


def _train() -> tuple[tg.TrainingGraph, tg.Graph]:
    init.manual_seed(0)
    g = tg.Graph("mlp")
    x = g.input("x", shape=[None, 8])
    g.output("y", L.Linear(16, 3)(L.ReLU()(L.Linear(8, 16)(x))))
    train = tg.TrainingGraph([g], loss=tg.losses.CrossEntropyLoss(), optimizer=tg.optim.SGD(lr=0.1))
    train.add_inputs({"x": x}, loss_labels={"t": tg.TensorSpec([None], "int64")})
    return train.compile("cpu"), g


def test_pipeline_bounds_in_flight_overlaps_and_matches_sync() -> None:
    rng = np.random.default_rng(0)
    data = [
        (rng.standard_normal((32, 8)).astype(np.float32), rng.integers(0, 3, 32)) for _ in range(8)
    ]

    def prepare(i: int) -> Batch:
        time.sleep(0.01)  # host work that overlaps the device's steps
        return Batch({"x": data[i][0]}, {"t": data[i][1]})

    train, _ = _train()
    pipe = InputPipeline(range(len(data)), prepare=prepare, depth=2)
    results = pipe.run(train, max_in_flight=2)
    assert 1 <= pipe.stats.max_in_flight <= 2
    assert len(pipe.stats.prepare_spans) == len(data)
    first_step_end = pipe.stats.step_spans[0][1]
    assert any(start < first_step_end for start, _ in pipe.stats.prepare_spans[1:])
    reference, _ = _train()
    for (x, t), result in zip(data, results):
        expected = reference.execute({"x": x}, loss_labels={"t": t})
        assert np.array_equal(result.loss, expected.loss)


def test_pipeline_iterates_tuples_and_reports_errors() -> None:
    pipe = InputPipeline([({"x": 1}, {"t": 2})], depth=1)
    assert [b.inputs for b in pipe] == [{"x": 1}]

    def broken(_: int) -> Batch:
        raise RuntimeError("bad file")

    with pytest.raises(RuntimeError, match="bad file"):
        list(InputPipeline(range(3), prepare=broken))
    with pytest.raises(TypeError, match="prepare must return"):
        list(InputPipeline([3]))
    with pytest.raises(ValueError, match="depth"):
        InputPipeline([], depth=0)


def test_weight_sources_load_on_first_use_and_purge(tmp_path) -> None:
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    source = WeightSource.from_file(tmp_path / "w.npy")
    assert not source.is_loaded and source.shape == (16, 8) and source.loads == 0
    g = tg.Graph("src")
    x = g.input("x", shape=[None, 8])
    g.output("y", L.Linear(8, 16, weight=source)(x))
    assert source.loads == 0  # building the graph reads no weight
    g.save(tmp_path / "g.onnx")
    assert source.loads == 1 and not source.is_loaded
    infer = InferenceGraph([g]).compile("cpu")
    assert source.loads == 2 and not source.is_loaded
    np.testing.assert_array_equal(infer.get_parameters()["linear0.weight"], w)
    train = tg.TrainingGraph([g], loss=tg.losses.MSELoss(), optimizer=tg.optim.SGD(lr=0.1))
    train.compile("cpu")
    assert source.loads == 3 and not source.is_loaded
    X = np.ones((2, 8), np.float32)
    out = infer.execute({"x": X}).outputs["y"]
    np.testing.assert_allclose(out, X @ w.T + infer.get_parameters()["linear0.bias"], rtol=1e-5)
    with source:
        assert source.is_loaded
    assert not source.is_loaded
    bad = WeightSource(lambda: np.zeros((2, 2)), (3, 3))
    with pytest.raises(tg.ModelError, match="declared"):
        bad.load()
