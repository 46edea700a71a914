"""Dropout keep masks written by the native kernel between onnxruntime segments
(traingraph.runtime.cpu.kernels.masks): the kernel against the hash, the match and its check, and
Module's train steps against the graph as written."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from gradcheck import assert_same_training, train_steps
from torch_models import export, seeded
from traingraph import artifacts, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.ir.random import GOLDEN, MIX
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import masks
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


def _reference(shape, seed, threshold, scale, mix=MIX):
    """The mask of traingraph.ir.random's hash, in 64-bit numpy arithmetic."""
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    low = np.uint64(2**32 - 1)
    h = (i * np.uint64(GOLDEN) + np.uint64(seed)) & low
    h = (h * ((h + np.uint64(1)) & low)) & low
    h = (h + (h >> np.uint64(16))) & low
    h = (h * np.uint64(mix)) & low
    h = (h + (h >> np.uint64(16))) & low
    return np.where(h < threshold, np.float32(scale), np.float32(0)).reshape(shape)


@pytest.mark.parametrize("shape", [(3, 5, 7), (17,), (2, 70001)], ids=["tails", "1d", "threads"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 123456789, 2**32 - 1])
def test_kernel_matches_the_hash(shape, threads, seed):
    threshold, scale = int(0.9 * 2**32), np.float32(1 / 0.9)
    out = np.full(shape, np.nan, np.float32)
    NATIVE.dropout_mask(out, seed, GOLDEN, MIX, threshold, float(scale), threads)
    np.testing.assert_array_equal(out, _reference(shape, seed, threshold, scale))


def test_kernel_keeps_the_asked_share():
    out = np.empty(1 << 20, np.float32)
    for keep in (0.5, 0.9):
        NATIVE.dropout_mask(out, 99, GOLDEN, MIX, round(keep * 2**32), 1.0, 2)
        assert abs(out.mean() - keep) < 3e-3


def test_kernel_refuses_arrays_it_cannot_take():
    with pytest.raises(ValueError, match="float32"):
        NATIVE.dropout_mask(np.empty(4), 1, GOLDEN, MIX, 10, 1.0, 1)
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.empty(4, np.float32)
        frozen.flags.writeable = False
        NATIVE.dropout_mask(frozen, 1, GOLDEN, MIX, 10, 1.0, 1)


class DropNet(nn.Module):
    """Dropout on the input (a batch-sized mask), after a hidden layer, and on a tensor the
    model reshapes with a fixed batch of 4 (a static mask)."""

    def __init__(self, fixed_batch: bool = True) -> None:
        super().__init__()
        self.fixed_batch = fixed_batch
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)
        self.drop_in, self.drop, self.drop_att = nn.Dropout(0.5), nn.Dropout(0.25), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(self.drop_in(x))))
        if self.fixed_batch:
            h = self.drop_att(torch.softmax(h.reshape(4, 4, 4), -1)).reshape(4, 16)
        return self.fc2(h)


def _directory(tmp_path, fixed_batch=True):
    onnx_model = export(seeded(DropNet, fixed_batch=fixed_batch), torch.zeros(4, 12), training=True)
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=0.01),
        artifact_directory=tmp_path,
    )
    return tmp_path


def test_every_mask_is_matched_and_runs_before_the_first_dropout(tmp_path):
    model = onnx.load(_directory(tmp_path) / "training_model.onnx")
    found = masks.split_dropout_masks(model)
    by_scale = {round(mask.scale, 4): mask for mask, _ in found}
    assert sorted(by_scale) == [1.1111, 1.3333, 2.0]
    assert by_scale[2.0].dims == (("x", 0), 12)  # the input's batch
    assert by_scale[1.3333].dims == (("x", 0), 16)
    assert by_scale[1.1111].dims == (4, 4, 4)
    assert by_scale[2.0].inputs[1:] == ["x"]
    ops = {model.graph.node[i].op_type for _, nodes in found for i in nodes}
    assert {"Less", "BitShift", "Cast"} <= ops and "RandomUniform" not in ops
    plan = segments.plan_segments(model, found)
    assert [len(ks) for ks in plan.kernels][:2] == [3, 0]  # all three after the seed
    first = {n.op_type for n in plan.segments[0].model.graph.node}
    assert "RandomUniform" in first and "Less" not in first
    for segment in plan.segments:
        onnx.checker.check_model(segment.model)


def test_a_mask_that_is_not_the_kernels_is_left_in_the_graph(tmp_path):
    model = onnx.load(_directory(tmp_path) / "training_model.onnx")
    # another multiplier in the first mask's hash: the match holds, the numbers do not
    changed = 0
    for node in model.graph.node:
        if node.op_type == "Constant" and changed == 0:
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.dtype == np.uint32 and value.size == 1 and int(value) == MIX:
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.uint32(MIX + 2)))
                changed += 1
    assert changed == 1
    assert len(masks.split_dropout_masks(model)) == 2


def _run(directory, native: bool, batches):
    ort.set_seed(0)  # both runs draw the same seeds
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(native_segments=native)
    module = Module(directory / "training_model.onnx", state, session_config=config)
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    if native:
        assert isinstance(module.step.runner, segments.SegmentedRunner)
        kernels = [k for ks in module.step.runner._plan.kernels for k in ks]
        assert kernels and all(isinstance(k, masks.DropoutMask) for k in kernels)
    written: dict[str, np.ndarray] = {}
    compute = masks.DropoutMask.compute

    def recorded(kernel, values, out, threads):
        compute(kernel, values, out, threads)
        written[kernel.mask] = out[kernel.mask].copy()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masks.DropoutMask, "compute", recorded)
        run = train_steps(module, opt, state, batches)
    if native:  # the last step's masks: both values
        assert written.keys() == {kernel.mask for kernel in kernels}
        for kernel in kernels:
            assert set(np.unique(written[kernel.mask])) == {0.0, np.float32(kernel.scale)}
    return run


@pytest.mark.parametrize("fixed_batch", [True, False], ids=["static", "batch-sized"])
def test_steps_with_native_masks_match_the_graph(tmp_path, fixed_batch):
    directory = _directory(tmp_path, fixed_batch)
    rng = np.random.default_rng(0)
    sizes = [4, 4, 4] if fixed_batch else [4, 7, 2]
    batches = [
        (rng.standard_normal((n, 12)).astype(np.float32), rng.integers(0, 5, n)) for n in sizes
    ]
    run = _run(directory, True, batches)
    assert_same_training(run, _run(directory, False, batches))
