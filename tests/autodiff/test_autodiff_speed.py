"""Speed of the autodiff pass on a BERT-base-sized graph (see benchmarks/autodiff_speed.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx

from gradcheck import assert_default_domain_only, session
from traingraph.autodiff import build_gradient_graph


def _benchmark() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "autodiff_speed.py"
    spec = importlib.util.spec_from_file_location("autodiff_speed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _benchmark()


def test_bert_base_12_layers_under_5_seconds() -> None:
    model = bench.bert_model(layers=12)
    assert 850 <= len(model.graph.node) <= 1100
    seconds = bench.time_gradient(model, repeats=3)
    assert seconds < 5.0, f"build_gradient_graph took {seconds:.2f} s (median of 3)"


def test_bert_gradient_graph_is_valid_and_runs() -> None:
    model = bench.bert_model(layers=2)
    grad_model = build_gradient_graph(model, loss="loss")
    onnx.checker.check_model(grad_model, full_check=True)
    assert_default_domain_only(grad_model)
    params = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    weights = [p for p in params if p.endswith((".weight", ".bias", ".word", ".position"))]
    rng = np.random.default_rng(0)
    mask = np.zeros((2, 1, 1, 7), np.float32)
    mask[1, ..., 5:] = -1e4
    feeds = {
        "input_ids": rng.integers(0, 1024, (2, 7)),
        "attention_mask": mask,
        "target": rng.standard_normal((2, 7, 768)).astype(np.float32),
    }
    names = [o.name for o in grad_model.graph.output]
    assert names[1:] == [f"{p}_grad" for p in params]
    outs = dict(zip(names, session(grad_model).run(None, feeds)))
    for p in weights:
        g = outs[f"{p}_grad"]
        assert np.all(np.isfinite(g)), p
    # Only the rows of the embedding tables that the batch reads get a gradient.
    word_grad = outs["embeddings.word_grad"]
    unused = np.setdiff1d(np.arange(1024), feeds["input_ids"])
    assert np.all(word_grad[unused] == 0) and np.any(word_grad != 0)
    assert np.all(outs["embeddings.position_grad"][7:] == 0)
