"""InstanceNormalization input gradients computed natively (runtime/cpu/kernels/layer_norm.py):
GroupNorm as PyTorch's exporters write it (an InstanceNormalization over ``[N, groups, -1]``)
and InstanceNorm2d, against the graph's nodes and against torch in float64."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import traingraph
from gradcheck import artifact_steps, assert_same_training
from torch_models import seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module
from traingraph.runtime.cpu import verify
from traingraph.runtime.cpu.kernels import layer_norm
from traingraph.runtime.cpu.native import AVAILABLE

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


class NormNet(nn.Module):
    """GroupNorm after a Conv (BiT's and diffusion U-Nets' blocks), then InstanceNorm2d with
    its own scale and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.group = nn.GroupNorm(4, 16)
        self.mix = nn.Conv2d(16, 8, 3, padding=1)
        self.instance = nn.InstanceNorm2d(8, affine=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.group(self.conv(x)))
        h = torch.relu(self.instance(self.mix(h)))
        return self.fc(h.mean(dim=(2, 3)))


def _artifacts(directory):
    model = traingraph.from_torch(seeded(NormNet), torch.zeros(4, 3, 8, 8))
    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=directory,
    )
    return directory


def _with_producers(model, nodes, values):
    """``nodes`` with the nodes that compute ``values`` (the statistics the kernel computes
    again) from the model's constants and the kernel's inputs, in the model's order."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    chosen = {i for i, n in enumerate(model.graph.node) if n in nodes}
    pending = [producer[v] for v in values if v in producer]
    while pending:
        i = pending.pop()
        if i not in chosen:
            chosen.add(i)
            pending += [producer[v] for v in model.graph.node[i].input if v in producer]
    return [model.graph.node[i] for i in sorted(chosen)]


def test_each_instance_norm_gradient_is_taken_and_matches_its_nodes(tmp_path):
    """Both gradients are found; the kernel writes what their nodes compute, a row with a
    NaN included (NaN all along that row, as the graph's statistics make it)."""
    model = onnx.load(_artifacts(tmp_path) / "training_model.onnx")
    found = layer_norm.split_instance_norm_grads(model)
    assert len(found) == 2  # the GroupNorm's and the InstanceNorm2d's
    inferred = onnx.shape_inference.infer_shapes(model)
    dims = {
        v.name: [d.dim_value or 4 for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.value_info, *inferred.graph.input]
    }
    rng = np.random.default_rng(0)
    for kernel, nodes in found:
        sub = [model.graph.node[i] for i in sorted(nodes)]
        x = rng.standard_normal(dims[kernel.x]).astype(np.float32)
        dy = rng.standard_normal(dims[kernel.dy]).astype(np.float32)
        scale = rng.standard_normal(dims[kernel.scale]).astype(np.float32)
        x.reshape(x.shape[0], x.shape[1], -1)[1, 2, 3] = np.nan
        feeds = {kernel.x: x, kernel.dy: dy, kernel.scale: scale}
        written = {o for n in sub for o in n.output}
        beyond = {v for n in sub for v in n.input} - set(feeds) - written
        subgraph = _with_producers(model, sub, beyond)
        (want,) = verify.run_subgraph(model, subgraph, feeds, [kernel.dx])
        out: dict[str, np.ndarray] = {}
        kernel.compute(feeds, out, 2)
        got = out[kernel.dx]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)


def test_module_trains_as_the_graph_does_and_as_torch(tmp_path):
    directory = _artifacts(tmp_path)
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    kind = layer_norm.InstanceNormGrad
    got = artifact_steps(directory, batches, kind)
    expected = artifact_steps(directory, batches, kind, without="instance_norm_grad")
    assert_same_training(got, expected, one_scale=True)
    # one step's gradients against torch in float64
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    x, y = batches[0]
    module(x, y)
    reference = copy.deepcopy(seeded(NormNet)).double()
    loss = nn.functional.cross_entropy(reference(torch.tensor(x).double()), torch.tensor(y))
    loss.backward()
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    for name, param in reference.named_parameters():
        got_grad = state.parameters[name].grad.reshape(param.shape)
        # the Conv's bias before a normalization has a gradient of 0 in exact arithmetic:
        # its float32 rounding is bounded against the largest gradient
        bound = 1e-4 * float(param.grad.abs().max()) + 1e-6 * largest
        assert np.abs(got_grad - param.grad.numpy()).max() <= bound, name
