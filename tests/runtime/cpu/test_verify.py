"""The numeric check of native kernels (runtime/cpu/verify.py): one entry, ``verified_kernels``,
with a kernel's hooks (:class:`~traingraph.runtime.cpu.verify.Check`) for its inputs, runs,
forms and comparison; chained matches (one's output the next one's input) checked together."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from gradcheck import artifact_steps, assert_same_training
from torch_models import ChainedNorms, export, seeded
from traingraph import artifacts, optim
from traingraph.runtime.cpu import graph_match, kernels, verify
from traingraph.runtime.cpu.kernels.batch_norm import BatchNormGrad
from traingraph.runtime.cpu.native import AVAILABLE
from traingraph.runtime.session import SessionConfig

FLOAT = onnx.TensorProto.FLOAT


def _tanh_model(count: int) -> onnx.ModelProto:
    """``count`` independent Tanh nodes, ``x{i} -> y{i}``, of shape [batch, 4, 5]."""
    nodes = [helper.make_node("Tanh", [f"x{i}"], [f"y{i}"]) for i in range(count)]
    graph = helper.make_graph(
        nodes,
        "tanhs",
        [helper.make_tensor_value_info(f"x{i}", FLOAT, ["batch", 4, 5]) for i in range(count)],
        [helper.make_tensor_value_info(f"y{i}", FLOAT, ["batch", 4, 5]) for i in range(count)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@dataclass
class _Tanh:
    """A kernel computing ``y = tanh(x)``; ``finite_only`` loses NaN (writes 0 there)."""

    x: str
    y: str
    finite_only: bool = False
    calls: int = 0

    @property
    def inputs(self) -> list[str]:
        return [self.x]

    @property
    def outputs(self) -> list[str]:
        return [self.y]

    def compute(
        self, values: Mapping[str, np.ndarray], out: dict[str, np.ndarray], threads: int
    ) -> None:
        self.calls += 1
        y = np.tanh(values[self.x])
        out[self.y] = np.nan_to_num(y, nan=0.0) if self.finite_only else y


def _check(model: onnx.ModelProto, found, check=None):
    g = graph_match.GraphIndex.of(model.graph)
    shapes = {name: [None, 4, 5] for n in model.graph.node for name in (*n.input, *n.output)}
    return verify.verified_kernels(model, g, found, shapes, check=check)


def test_a_kernel_that_loses_nan_is_dropped_and_the_others_kept(caplog):
    model = _tanh_model(2)
    good, lossy = _Tanh("x0", "y0"), _Tanh("x1", "y1", finite_only=True)
    with caplog.at_level(logging.WARNING, logger="traingraph.runtime.cpu.kernels"):
        kept = _check(model, [(good, {0}), (lossy, {1})])
    assert [k for k, _ in kept] == [good]
    assert "disagrees with its nodes on non-finite inputs" in caplog.text


class _OneForm(verify.Check):
    """Every match of one form; inputs with a tie of the kernel's choosing (all 0.5)."""

    def form(self, kernel, nodes):
        return "tanh"

    def inputs(self, matches):
        return [{k.x: np.full((3, 4, 5), 0.5, np.float32)} for k, _ in matches]


def test_matches_of_one_form_take_the_verdict_of_the_first():
    model = _tanh_model(3)
    found = [(_Tanh(f"x{i}", f"y{i}"), {i}) for i in range(3)]
    kept = _check(model, found, _OneForm())
    assert [k for k, _ in kept] == [k for k, _ in found]
    assert [k.calls for k, _ in found] == [2, 0, 0]  # finite and non-finite runs of the first
    lossy = [(_Tanh(f"x{i}", f"y{i}", finite_only=True), {i}) for i in range(3)]
    assert _check(model, lossy, _OneForm()) == []


@pytest.mark.skipif(not AVAILABLE, reason="traingraph.runtime._convc was not built")
def test_chained_batch_norm_gradients_are_checked_together_and_train_as_the_graph(tmp_path):
    artifacts.generate_artifacts(
        export(seeded(ChainedNorms), torch.zeros(2, 3, 6, 6), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    _, _, found = kernels.split(model, SessionConfig(native_kernels=("batch_norm_grad",)))
    grads = [k for k, _ in found if isinstance(k, BatchNormGrad)]
    assert len(grads) == 2
    assert {g.dx for g in grads} & {g.dy for g in grads}  # one's dx is the other's dy
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((3, 3, 6, 6)).astype(np.float32), rng.integers(0, 2, 3))
        for _ in range(2)
    ]
    got = artifact_steps(tmp_path, batches, BatchNormGrad)
    expected = artifact_steps(tmp_path, batches, BatchNormGrad, without="batch_norm_grad")
    assert_same_training(got, expected, one_scale=True)


def test_checks_run_on_the_providers_named_within_checked_on(monkeypatch):
    # another device's kernels are checked against their nodes run by that device's provider
    seen = []
    real = verify.ort.InferenceSession

    def recording(model, options=None, providers=None, **kwargs):
        seen.append(providers)
        return real(model, options, providers=["CPUExecutionProvider"], **kwargs)

    monkeypatch.setattr(verify.ort, "InferenceSession", recording)
    x = helper.make_tensor_value_info("x", FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g", [x], [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.array([1.0, -2.0], np.float32)}
    (plain,) = verify.run_subgraph(model, list(graph.node), feeds, ["y"])
    device = [("CUDAExecutionProvider", {"device_id": "0"})]
    with verify.checked_on(device):
        (checked,) = verify.run_subgraph(model, list(graph.node), feeds, ["y"])
    (after,) = verify.run_subgraph(model, list(graph.node), feeds, ["y"])
    assert seen == [["CPUExecutionProvider"], device, ["CPUExecutionProvider"]]
    np.testing.assert_array_equal(checked, -feeds["x"])
    np.testing.assert_array_equal(plain, after)
