"""The kernel tags autodiff and the lowerings write, and the registry that reads them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from torch_models import SmallCNN, export, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module
from traingraph.errors import ModelError
from traingraph.ir.tags import KEY, tagged_kernels
from traingraph.runtime.cpu import kernels
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.cpu.kernels.batch_norm import BatchNormGrad
from traingraph.runtime.cpu.kernels.direct_conv import DirectConv
from traingraph.runtime.cpu.native import AVAILABLE
from traingraph.runtime.rewrites.specialize import for_cpu
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="the native kernels are not built")


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("artifacts")
    artifacts.generate_artifacts(
        export(seeded(SmallCNN, dropout=0.25), torch.zeros(4, 1, 8, 8), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05),
        artifact_directory=directory,
    )
    return directory


@pytest.fixture(scope="module")
def training_model(directory) -> onnx.ModelProto:
    return onnx.load(directory / "training_model.onnx")


def _untagged(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        del node.metadata_props[:]
    return copy


def test_the_rules_and_lowerings_tag_the_patterns_they_write(training_model):
    tags = tagged_kernels(training_model.graph.node)
    assert set(tags) == {
        "batch_norm_forward", "batch_norm_grad", "conv_weight_grad", "dropout_mask",
        "max_pool_grad",
    }  # fmt: skip
    # the artifacts stay standard ONNX that onnxruntime runs, tags and all
    onnx.checker.check_model(training_model, full_check=True)
    nodes = training_model.graph.node
    values = {e.value for n in nodes for e in n.metadata_props if e.key == KEY}
    assert all(v.count(":") == 1 for v in values)


def test_tags_survive_the_cpu_rewrites(training_model):
    source = training_model.SerializeToString()
    rewritten = for_cpu(source)
    assert rewritten != source  # the Convs in onnxruntime's blocked layout
    model = onnx.load_from_string(rewritten)
    tags = tagged_kernels(model.graph.node)
    assert tags.keys() == tagged_kernels(training_model.graph.node).keys()


def test_a_tagged_model_is_searched_only_for_the_kernels_it_holds(training_model):
    searched = kernels.searched(training_model)
    assert "layer_norm_grad" not in searched and "col2im" not in searched
    assert {"batch_norm_grad", "dropout_mask", "gelu", "winograd"} <= searched
    # without tags (an onnxblock or onnxruntime-training model) every kernel is looked for
    assert kernels.searched(_untagged(training_model)) == frozenset(kernels.names())


def test_untagged_models_keep_their_exact_structural_matches(training_model):
    def kinds(model: onnx.ModelProto) -> list[str]:
        model, grads = conv_grads.split_weight_grads(model)
        _, found = kernels.find(model, grads)
        return sorted(type(k).__name__ for k, _ in found) + [g.param for g in grads]

    assert kinds(_untagged(training_model)) == kinds(training_model)


@pytest.mark.parametrize("chosen", [(), ("dropout_mask",), ("batch_norm_grad", "conv_weight_grad")])
def test_native_kernels_picks_kernels_by_name(training_model, chosen):
    config = SessionConfig(native_kernels=chosen)
    _, grads, found = kernels.split(training_model, config)
    names = {type(k).__name__ for k, _ in found}
    assert bool(grads) == ("conv_weight_grad" in chosen)
    assert ("DropoutMask" in names) == ("dropout_mask" in chosen)
    assert ("BatchNormGrad" in names) == ("batch_norm_grad" in chosen)
    assert names <= {"DropoutMask", "BatchNormGrad"}


def test_an_unknown_kernel_name_is_refused_with_the_known_ones(directory, training_model):
    with pytest.raises(ModelError, match=r"unknown native kernels \['gleu'\].*'gelu'"):
        kernels.split(training_model, SessionConfig(native_kernels={"gleu", "winograd"}))
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(native_kernels=("gleu",))
    with pytest.raises(ModelError, match=r"unknown native kernels \['gleu'\]"):
        Module(directory / "training_model.onnx", state, session_config=config)
    with pytest.raises(ModelError, match="collection of kernel names"):
        kernels.select("gelu")


def test_every_kernel_found_has_the_protocol(training_model):
    _, grads, found = kernels.split(training_model, SessionConfig())
    for kernel, nodes in found:
        assert isinstance(kernel.inputs, list) and isinstance(kernel.outputs, list)
        assert callable(kernel.compute) and nodes
    assert np.all([g.output.endswith("_grad") for g in grads])


@pytest.mark.parametrize("kind", [BatchNormGrad, DirectConv])
def test_a_kernel_that_disagrees_with_its_nodes_is_dropped_with_a_reason(
    training_model, kind, monkeypatch, caplog
):
    compute = kind.compute

    def off_by_one(self, values, out, threads):
        compute(self, values, out, threads)
        for name in self.outputs:
            out[name] += 1

    model, grads = conv_grads.split_weight_grads(training_model)
    _, found = kernels.find(model, grads)
    assert any(isinstance(k, kind) for k, _ in found)
    monkeypatch.setattr(kind, "compute", off_by_one)
    with caplog.at_level(logging.WARNING, logger="traingraph.runtime.cpu.kernels"):
        _, found = kernels.find(model, grads)
    assert not any(isinstance(k, kind) for k, _ in found)
    assert f"native kernel {kind.__name__}" in caplog.text
    assert "disagrees with its nodes" in caplog.text
