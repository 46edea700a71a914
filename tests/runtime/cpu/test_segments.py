"""BatchNormalization gradients computed natively between onnxruntime segments: the kernel
against PyTorch, the match and the plan on a residual network, and Module's train steps
against the graph as written and against ``torch.autograd``."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from gradcheck import assert_same_training
from torch_models import ResidualNet, export, seeded
from traingraph import artifacts, from_torch, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.runtime.cpu import segments
from traingraph.runtime.cpu.kernels import batch_norm, conv_grads
from traingraph.runtime.cpu.kernels.col2im import Col2ImSum
from traingraph.runtime.cpu.native import AVAILABLE, NATIVE
from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig

pytestmark = pytest.mark.skipif(
    not AVAILABLE,
    reason="traingraph.runtime._convc was not built (no C compiler at install time)",
)


@pytest.mark.parametrize("relu", [True, False], ids=["relu", "plain"])
@pytest.mark.parametrize(
    "shape",
    [(4, 3, 5, 7), (8, 16, 12, 12), (3, 5, 17), (2, 3, 4, 5, 6), (4, 6, 2, 2), (8, 5, 3, 3)],
    ids=["tails", "vector-rows", "1d", "3d", "2x2-planes", "3x3-planes"],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_torch(shape, relu, threads):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)  # a mean far from 0
    scale = rng.standard_normal(shape[1]).astype(np.float32)
    bias = rng.standard_normal(shape[1]).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    leaves = [torch.from_numpy(v.astype(np.float64)).requires_grad_() for v in (x, scale, bias)]
    out = nn.functional.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True)
    out = torch.relu(out) if relu else out
    out.backward(torch.from_numpy(dy.astype(np.float64)))
    y = out.detach().numpy().astype(np.float32) if relu else None
    dx, dscale, dbias = np.empty_like(x), np.empty_like(scale), np.empty_like(bias)
    NATIVE.batch_norm_grad(x, dy, y, scale, dx, dscale, dbias, 1e-5, threads)
    for got, leaf in zip((dx, dscale, dbias), leaves):
        want = leaf.grad.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_kernel_skips_the_gradients_not_asked_for():
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((4, 3, 5, 5)).astype(np.float32) for _ in range(2))
    scale = rng.standard_normal(3).astype(np.float32)
    full = [np.empty_like(x), np.empty_like(scale), np.empty_like(scale)]
    NATIVE.batch_norm_grad(x, dy, None, scale, *full, 1e-5, 2)
    dbias = np.empty_like(scale)
    NATIVE.batch_norm_grad(x, dy, None, scale, None, None, dbias, 1e-5, 2)
    np.testing.assert_array_equal(dbias, full[2])


def test_kernel_refuses_arrays_it_cannot_take():
    x = np.zeros((2, 3, 4, 4), np.float32)
    c = np.zeros(3, np.float32)
    kernel = NATIVE.batch_norm_grad
    with pytest.raises(ValueError, match="one shape"):
        kernel(x, np.zeros((2, 3, 4, 5), np.float32), None, c, np.empty_like(x), c, c, 1e-5, 1)
    with pytest.raises(ValueError, match="one shape"):
        kernel(x, x, None, np.zeros(4, np.float32), np.empty_like(x), c, c, 1e-5, 1)
    with pytest.raises(ValueError, match="dx is not float32"):
        kernel(x, x, None, c, np.empty(x.shape), c, c, 1e-5, 1)


def _directory(tmp_path):
    model = seeded(ResidualNet)
    onnx_model = export(model, torch.zeros(4, 3, 10, 10), training=True)
    artifacts.generate_artifacts(
        onnx_model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.05, momentum=0.9),
        artifact_directory=tmp_path,
    )
    return model, tmp_path


def _module(directory, native: bool = True):
    """A Module of the artifacts in ``directory`` (with the native kernels, or without any),
    and its state."""
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(native_segments=native, native_conv_grads=native)
    return Module(directory / "training_model.onnx", state, session_config=config), state


def test_every_batch_norm_gradient_is_matched_and_planned(tmp_path):
    _, directory = _directory(tmp_path)
    model = onnx.load(directory / "training_model.onnx")
    found = batch_norm.split_batch_norm_grads(model)
    by_scale = {grad.scale: grad for grad, _ in found}
    assert sorted(by_scale) == ["bn.weight", "bn1.weight", "bn2.weight", "down.1.weight"]
    assert by_scale["bn.weight"].y is not None and by_scale["bn1.weight"].y is not None
    assert by_scale["bn2.weight"].y is None and by_scale["down.1.weight"].y is None
    assert by_scale["bn2.weight"].dy == by_scale["down.1.weight"].dy  # one gradient, two BNs
    assert all(grad.dscale == f"{grad.scale}_grad" for grad in by_scale.values())
    plan = segments.plan_segments(model, found)
    kernels = [[k.scale for k in ks if not isinstance(k, segments.ViewStep)] for ks in plan.kernels]
    # the block's BNs first (its two branches together), then bn1, then the stem's
    assert [sorted(ks) for ks in kernels if ks] == [
        ["bn2.weight", "down.1.weight"], ["bn1.weight"], ["bn.weight"],
    ]  # fmt: skip
    # a Constant is written in each segment that reads it, not passed from one to the next
    constants = {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    for segment in plan.segments:
        assert not (set(segment.inputs) | set(segment.outputs)) & constants
        if segment.model.graph.node:
            onnx.checker.check_model(segment.model)


def test_models_without_a_training_batch_norm_have_nothing_to_split(tmp_path):
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    torch.manual_seed(0)
    artifacts.generate_artifacts(
        export(net, torch.zeros(2, 2, 6, 6), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    assert batch_norm.split_batch_norm_grads(onnx.load(tmp_path / "training_model.onnx")) == []


def _run(directory, native: bool, batches):
    module, state = _module(directory, native)
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    assert isinstance(module.step.runner, segments.SegmentedRunner) == native
    losses, grads = [], []
    for step, (x, y) in enumerate(batches):
        losses.append(float(module(x, y)))
        if step == 1:  # no reset in between: the gradients add up
            losses.append(float(module(x, y)))
        grads.append({n: p.grad.copy() for n, p in state.parameters.items() if p.grad is not None})
        opt.step()
        module.lazy_reset_grad()
    params = {n: p.data.copy() for n, p in state.parameters.items()}
    return losses, grads, params


def test_segmented_steps_match_the_graph_and_torch(tmp_path):
    torch_model, directory = _directory(tmp_path)
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, 4))
        for _ in range(3)
    ]
    run = _run(directory, True, batches)
    assert_same_training(run, _run(directory, False, batches), one_scale=True)
    losses, grads, _ = run

    # the first step against torch.autograd (the export's tracing pass moved the running
    # statistics, which the gradients do not read)
    x, y = batches[0]
    torch_model.train()
    loss = nn.functional.cross_entropy(torch_model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(losses[0], loss.item(), rtol=1e-5)
    scale = max(p.grad.abs().max().item() for p in torch_model.parameters())
    for name, param in torch_model.named_parameters():
        np.testing.assert_allclose(
            grads[0][name], param.grad.numpy(), rtol=1e-3, atol=1e-5 * scale, err_msg=name
        )


def test_values_between_segments_are_kept_while_the_batch_keeps_its_shape(tmp_path):
    module, _ = _module(_directory(tmp_path)[1])
    runner = module.step.runner
    assert isinstance(runner, segments.SegmentedRunner)
    rng = np.random.default_rng(0)

    def step(n):
        x = rng.standard_normal((n, 3, 10, 10)).astype(np.float32)
        loss = float(module(x, rng.integers(0, 5, n)))
        module.lazy_reset_grad()
        return loss, {name: array for name, (array, _) in runner._cuts.items()}

    _, first = step(4)
    assert first and all(a.shape[0] == 4 for a in first.values() if a.ndim == 4)
    loss, second = step(4)  # the same buffers, written in place
    assert all(second[name] is first[name] for name in first) and np.isfinite(loss)
    _, smaller = step(3)  # a new batch size: new buffers of its shapes
    assert all(a.shape[0] == 3 for a in smaller.values() if a.ndim == 4)
    assert not any(smaller[name] is first[name] for name in first)
    # a shape the inputs do not decide fails the run with the kept buffers: it is run again
    # with buffers onnxruntime allocates, and the step goes on
    name = next(n for n, a in smaller.items() if a.ndim == 4)
    array = np.empty((1, *smaller[name].shape[1:]), np.float32)
    runner._cuts[name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
    assert np.isfinite(step(3)[0])
    assert runner._cuts[name][0].shape[0] == 3


def test_values_that_are_not_read_at_once_share_memory(tmp_path):
    module, _ = _module(_directory(tmp_path)[1])
    runner = module.step.runner
    assert isinstance(runner, segments.SegmentedRunner)
    rng = np.random.default_rng(0)
    for _ in range(2):
        module(rng.standard_normal((4, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, 4))
    steps = runner._steps
    born = {name: i for i, step in enumerate(steps) for name in segments.step_writes(step)}
    last = {name: i for i, step in enumerate(steps) for name in segments.step_reads(step)}
    for name in module.step.outputs:  # what the caller gets lives to the end
        last[name] = len(steps)
    arrays = {**{name: array for name, (array, _) in runner._cuts.items()}, **runner._kept}
    assert len(arrays) > 10
    shared = 0
    for i, a in enumerate(arrays):
        for b in list(arrays)[i + 1 :]:
            if np.shares_memory(arrays[a], arrays[b]):
                shared += 1
                # one is read for the last time before the other is written
                assert last.get(a, born[a]) < born[b] or last.get(b, born[b]) < born[a], (a, b)
    assert shared > 0
    total = sum(a.nbytes for a in arrays.values())
    distinct = {a.ctypes.data: a for a in arrays.values()}
    assert sum(a.nbytes for a in distinct.values()) < total


def test_weight_gradients_are_computed_between_the_segments(tmp_path):
    _, directory = _directory(tmp_path)
    module, _ = _module(directory)
    plan = module.step.runner._plan
    weights = [k for k in plan.all_kernels if isinstance(k, conv_grads.WeightGradKernel)]
    gradients = module.step.gradients
    assert {k.grad.param for k in weights} == {g.param for g in gradients.weight_grads}
    assert len(weights) == 4 and not gradients.after_run  # the stem, two 3 x 3, the 1 x 1
    # each runs as soon as the segments let it: after the segment that writes the last of the
    # values it reads, or after the first segment that follows the kernel that does
    for stage, kernels in enumerate(plan.kernels):
        for at, kernel in enumerate(kernels):
            if isinstance(kernel, conv_grads.WeightGradKernel):
                written = set(plan.segments[stage].outputs)
                earlier = plan.kernels[stage - 1] if stage else plan.first
                written |= {o for k in [*earlier, *kernels[:at]] for o in k.outputs}
                assert written & set(kernel.inputs), kernel.grad.param
    # and the gradients are those of the graph as written
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 10, 10)).astype(np.float32)
    y = rng.integers(0, 5, 4)
    grads = []
    for native in (True, False):
        m, state = _module(directory, native)
        m(x, y)
        grads.append({n: p.grad.copy() for n, p in state.parameters.items() if p.grad is not None})
    for name in (k.grad.param for k in weights):
        want = grads[1][name]
        np.testing.assert_allclose(grads[0][name], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


class NormMLP(nn.Module):
    """BatchNorm1d over features ([N, C]), a Relu after one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(6, 16), nn.BatchNorm1d(16)
        self.fc2, self.bn2 = nn.Linear(16, 8), nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn2(self.fc2(torch.relu(self.bn1(self.fc1(x))))))


def test_batch_norm_over_features_trains_as_the_graph_does(tmp_path):
    torch.manual_seed(0)
    artifacts.generate_artifacts(
        export(seeded(NormMLP), torch.zeros(4, 6), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        # not Adam: the Linear biases before the BatchNorms have a gradient of 0 up to
        # rounding, which Adam's normalization turns into steps of either sign
        optimizer=optim.SGD(lr=0.1, momentum=0.9),
        artifact_directory=tmp_path,
    )
    found = batch_norm.split_batch_norm_grads(onnx.load(tmp_path / "training_model.onnx"))
    assert sorted((g.scale, g.y is not None) for g, _ in found) == [
        ("bn1.weight", True), ("bn2.weight", False),
    ]  # fmt: skip
    rng = np.random.default_rng(1)
    batches = [
        (rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)) for n in (8, 8, 5)
    ]
    assert_same_training(_run(tmp_path, True, batches), _run(tmp_path, False, batches))


def test_a_segment_onnxruntime_rejects_leaves_the_graph_whole(tmp_path, monkeypatch):
    # Where a segment fails to load, Module runs the training graph as it is, and says so.
    _, directory = _directory(tmp_path)

    def broken(self, *args):
        raise RuntimeError("rejected")

    monkeypatch.setattr(segments.SegmentedRunner, "__init__", broken)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    with pytest.warns(RuntimeWarning, match="segment failed to load.*rejected"):
        module = Module(directory / "training_model.onnx", state)
    assert not isinstance(module.step.runner, segments.SegmentedRunner)
    # the Conv weight gradients are computed after the run instead of between segments
    gradients = module.step.gradients
    assert gradients.after_run and gradients.after_run == gradients.weight_grads
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, 4)
    assert np.isfinite(float(module(x, y)))
    plain, plain_state = _module(directory, native=False)
    plain(x, y)
    for name, param in plain_state.parameters.items():
        if param.grad is not None:
            want = param.grad
            got = state.parameters[name].grad
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_a_stage_joins_a_later_one_that_runs_before_its_readers():
    # nodes by stage: 0: a (read by a kernel of stage 2), 1: b (read by node c of stage 2),
    # 2: c (read by a kernel of stage 6); 3: d (read by a kernel of stage 4); 5: e writes a
    # graph output
    nodes = [
        helper.make_node("Neg", ["x"], ["a"]),
        helper.make_node("Neg", ["x"], ["b"]),
        helper.make_node("Neg", ["b"], ["c"]),
        helper.make_node("Neg", ["x"], ["d"]),
        helper.make_node("Neg", ["x"], ["e"]),
    ]
    placed = {0: 0, 1: 1, 2: 2, 3: 3, 4: 5}
    merged = segments._merged(nodes, placed, {"e"}, {"a": 2, "c": 6, "d": 4, "e": 6})
    # the last stages first: e is pinned; d stays (no stage with nodes up to 4, where its
    # reader runs); c joins e's stage, the last that runs before c's reader, and b follows c;
    # a finds no stage with nodes left up to 2: three runs instead of five
    assert merged == {0: 0, 1: 5, 2: 5, 3: 3, 4: 5}
    # a stage its kernels read right after it stays
    assert segments._merged(nodes[:1], {0: 2}, set(), {"a": 2}) == {0: 2}


def test_the_columns_one_kernel_adds_are_written_in_one_run(tmp_path):
    # the residual block's two strided Convs: the shortcut's MatMul, whose input gradient is
    # ready first, waits for the other's segment
    # (at 12 x 12 the block's 3 x 3 Conv, on 6 x 6, goes by Winograd's transforms, and the
    # shortcut's MatMul is alone in its stage)
    artifacts.generate_artifacts(
        export(seeded(ResidualNet), torch.zeros(4, 3, 12, 12), training=True),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    plan = Module(tmp_path / "training_model.onnx", state).step.runner._plan
    sums = [(s, k) for s, ks in enumerate(plan.kernels) for k in ks if isinstance(k, Col2ImSum)]
    ((stage, kernel),) = sums
    assert len(kernel.terms) == 2
    assert {t.columns for t in kernel.terms} <= set(plan.segments[stage].outputs)
    # without the merges, the step has more onnxruntime runs
    runs = sum(bool(s.model.graph.node) for s in plan.segments)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segments, "_merged", lambda nodes, placed, *rest: dict(placed))
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        unmerged = Module(tmp_path / "training_model.onnx", state).step.runner._plan
    assert sum(bool(s.model.graph.node) for s in unmerged.segments) > runs


def test_models_with_subgraphs_are_not_cut():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    orelse = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=orelse)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert batch_norm.split_batch_norm_grads(model) == []
    assert batch_norm.split_max_pool_grads(model, []) == []


def test_each_segment_writes_its_own_profile(tmp_path, monkeypatch):
    # a segmented step creates its sessions within a moment: one file each
    _, directory = _directory(tmp_path / "artifacts")
    monkeypatch.chdir(tmp_path)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx", state, session_config=SessionConfig(profile=True)
    )
    rng = np.random.default_rng(0)
    module(rng.standard_normal((4, 3, 10, 10)).astype(np.float32), rng.integers(0, 5, 4))
    runners = [r for r in module.step.runner._runners if r is not None]
    files = {r.session.end_profiling() for r in runners}
    assert len(runners) > 1 and len(files) == len(runners)


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _malloc_in_use() -> int | None:
    """Bytes that ``malloc`` has handed out and not had back (glibc 2.33 or newer), or None."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_the_values_between_segments_leave_onnxruntime_as_they_are_written(tmp_path):
    # The first run learns the shapes of the values that cross the cuts: onnxruntime allocates
    # what a segment writes, then each value moves into the buffer it keeps for the next runs
    # and the segment's binding lets go of onnxruntime's copy. Without the arena onnxruntime
    # allocates with malloc, which counts what it holds.
    if _malloc_in_use() is None:
        pytest.skip("the bytes malloc holds are read through glibc's mallinfo2 (glibc >= 2.33)")
    _, directory = _directory(tmp_path)
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(memory_arena=False, intra_op_threads=1)
    module = Module(directory / "training_model.onnx", state, session_config=config)
    plain, _ = _module(directory, native=False)
    runner = module.step.runner
    assert isinstance(runner, segments.SegmentedRunner)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 3, 10, 10)).astype(np.float32)  # values of 0.4 to 3 MiB
    y = rng.integers(0, 5, 1024)
    before = _malloc_in_use()
    loss = float(module(x, y))
    grown = _malloc_in_use() - before
    assert loss == pytest.approx(float(plain(x, y)), rel=1e-5)
    segment_runners = [r for r in runner._runners if r is not None]
    assert len(segment_runners) > 2
    assert all(not r.binding.get_outputs() for r in segment_runners)
    arrays = [a for a, _ in runner._cuts.values()] + list(runner._kept.values())
    values = sum(a.nbytes for a in arrays)
    roots = {id(root): root.nbytes for root in map(_root, arrays)}
    buffers = sum(roots.values())
    assert buffers < values  # shared by values that do not live at once
    # the buffers, and no second copy of the values in what onnxruntime holds
    assert buffers <= grown < buffers + values // 2, (grown, buffers, values)
    # the next run writes the same buffers
    kept = {name: a for name, (a, _) in runner._cuts.items()}
    module.lazy_reset_grad()
    assert float(module(x, y)) == loss
    assert all(runner._cuts[name][0] is a for name, a in kept.items())


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def test_values_that_live_at_once_get_memory_apart_and_the_block_holds_the_most_alive():
    # (bytes, first step, last step)
    lives = [(100, 0, 1), (400, 0, 3), (50, 2, 4), (80, 2, 5), (300, 4, 6), (64, 6, 6)]
    offsets, total = segments.offsets(lives)
    for i, (size, first, last) in enumerate(lives):
        assert offsets[i] % 64 == 0  # on a cache line
        for j, (other, start, end) in enumerate(lives[:i]):
            if first <= end and start <= last:  # alive at once: apart
                assert offsets[i] + size <= offsets[j] or offsets[j] + other <= offsets[i]
    # the most alive at once, each on its cache lines: 448 + 64 + 128 at steps 2-3
    most = max(
        sum(-(-size // 64) * 64 for size, first, last in lives if first <= step <= last)
        for step in range(7)
    )
    assert total == most == 640
    rng = np.random.default_rng(0)
    many = [
        (int(rng.integers(1, 5000)), first, first + int(rng.integers(0, 20)))
        for first in rng.integers(0, 100, 200)
    ]
    offsets, total = segments.offsets(many)
    for i, (size, first, last) in enumerate(many):
        for j, (other, start, end) in enumerate(many[:i]):
            if first <= end and start <= last:
                assert offsets[i] + size <= offsets[j] or offsets[j] + other <= offsets[i]
    assert total < sum(size for size, _, _ in many) / 2


@dataclass(frozen=True)
class _Elementwise:
    """A test kernel that writes ``target = fn(source)`` in place of the nodes it replaces."""

    source: str
    target: str
    fn: Callable[[np.ndarray], np.ndarray]

    @property
    def inputs(self) -> list[str]:
        return [self.source]

    @property
    def outputs(self) -> list[str]:
        return [self.target]

    def compute(self, values, out, threads):
        x = values[self.source]
        out.setdefault(self.target, np.empty_like(x))[...] = self.fn(x)


NEG_EXP = _Elementwise("x", "b", lambda x: -np.exp(x))
"""``b = -exp(x)``, replacing an Exp and a Neg."""
DOUBLE = _Elementwise("y", "z", lambda y: y * 2)
"""``z = 2 y``, replacing a Mul by a constant 2."""


def test_nodes_of_a_kernel_that_others_still_read_stay_in_the_graph():
    # the kernel replaces a = Exp(x) and b = Neg(a), but c = Sqrt(a) reads a as well (as the
    # backward nodes of a GELU read its forward nodes' values when the gradient kernel was
    # dropped at its check): Exp stays, Neg goes, and the run computes what the graph does
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 4]) for n in "xbc"]
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["a"]),
            helper.make_node("Neg", ["a"], ["b"]),
            helper.make_node("Sqrt", ["a"], ["c"]),
        ],
        "g", floats[:1], floats[1:],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = segments.plan_segments(model, [(NEG_EXP, {0, 1})])
    ops = [n.op_type for s in plan.segments for n in s.model.graph.node]
    assert sorted(ops) == ["Exp", "Sqrt"]
    device = Device("cpu")
    runner = segments.SegmentedRunner(
        plan, lambda m: ort.InferenceSession(m.SerializeToString()), device, threads=1
    )
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    runner.bind_input("x", x)
    results = runner.run({"b": None, "c": None})
    (c,) = ort.InferenceSession(model.SerializeToString()).run(["c"], {"x": x})
    np.testing.assert_array_equal(results["c"].numpy(), c)
    np.testing.assert_array_equal(results["b"], -np.exp(x))


def _runs_as_the_graph(plan, model, feeds, outputs=("r",), runs=3):
    """Run ``plan`` ``runs`` times (the first run, then runs with the values' buffers) and
    compare ``outputs`` with onnxruntime's run of ``model`` whole, bit for bit; the runner."""
    runner = segments.SegmentedRunner(
        plan, lambda m: ort.InferenceSession(m.SerializeToString()), Device("cpu"), threads=1
    )
    want = ort.InferenceSession(model.SerializeToString()).run(list(outputs), feeds)
    for _ in range(runs):
        for name, value in feeds.items():
            runner.bind_input(name, value)
        got = runner.run(dict.fromkeys(outputs))
        for name, value in zip(outputs, want):
            np.testing.assert_array_equal(got[name].numpy(), value)
    return runner


def test_a_sigmoid_read_after_a_cut_is_computed_again_from_its_input_read_there_too():
    # s = Sigmoid(x) and y = x s in the first segment; after the kernel (z = 2 y), the second
    # reads x and s: it computes s again from x, so that s does not cross the cut
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64, 32]) for n in "xr"]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph(
        [
            helper.make_node("Sigmoid", ["x"], ["s"]),
            helper.make_node("Mul", ["x", "s"], ["y"]),
            helper.make_node("Mul", ["y", "two"], ["z"]),
            helper.make_node("Mul", ["z", "s"], ["t"]),
            helper.make_node("Mul", ["t", "x"], ["r"]),
        ],
        "g", floats[:1], floats[1:], [two],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = segments.plan_segments(model, [(DOUBLE, {2})])
    first, second = plan.segments
    assert first.outputs == ["y"] and sorted(second.inputs) == ["x", "z"]
    assert [n.op_type for n in second.model.graph.node] == ["Sigmoid", "Mul", "Mul"]
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    runner = _runs_as_the_graph(plan, model, {"x": x})
    # the kept values: y and z only
    assert set(runner._cuts) | set(runner._kept) == {"y", "z"}


def test_a_reshape_of_a_value_alive_after_the_cut_is_computed_again_there():
    # t = x reshaped crosses no cut: the second segment reads x anyway and reshapes it; g =
    # tanh(h), read on both sides, does, as h is not read after the cut (computing g again
    # there would keep h alive)
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [32, 32]) for n in "xr"]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [32, 32])
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["t"]),
            helper.make_node("Exp", ["x"], ["h"]),
            helper.make_node("Tanh", ["h"], ["g"]),
            helper.make_node("MatMul", ["x", "t"], ["m"]),
            helper.make_node("Add", ["m", "g"], ["y"]),
            helper.make_node("Mul", ["y", "two"], ["z"]),
            helper.make_node("MatMul", ["z", "t"], ["q"]),
            helper.make_node("Mul", ["q", "g"], ["p"]),
            helper.make_node("Add", ["p", "x"], ["r"]),
        ],
        "g", floats[:1], floats[1:], [two, shape],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = segments.plan_segments(model, [(DOUBLE, {5})])
    first, second = plan.segments
    # its copy in the second segment reads x there: a view of x's memory before it
    assert first.outputs == ["g", "y"] and sorted(second.inputs) == ["g", "t", "x", "z"]
    assert "Reshape" not in [n.op_type for n in second.model.graph.node]
    assert plan.kernels[0][-1] == segments.ViewStep("x", "t", (32, 32))
    x = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float32)
    _runs_as_the_graph(plan, model, {"x": x})


def test_an_identity_at_a_cut_reads_its_input_instead_of_copying_it():
    # z = 2 y is the kernel; i = Identity(z) (a Dropout of ratio 0 in training mode) is read
    # after it and again in a later segment: no segment writes i, the readers read z; an
    # Identity whose output the graph returns stays
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, 4]) for n in "xrk"]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["y"]),
            helper.make_node("Mul", ["y", "two"], ["z"]),
            helper.make_node("Identity", ["z"], ["i"]),
            helper.make_node("Identity", ["i"], ["j"]),
            helper.make_node("Neg", ["j"], ["n"]),
            helper.make_node("Identity", ["n"], ["k"]),
            helper.make_node("Mul", ["n", "i"], ["r"]),
        ],
        "g", floats[:1], floats[1:], [two],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = segments.plan_segments(model, [(DOUBLE, {1})])
    ops = [n.op_type for s in plan.segments for n in s.model.graph.node]
    assert ops.count("Identity") == 1  # k's, a graph output
    assert all("i" not in s.outputs and "i" not in s.inputs for s in plan.segments)
    x = np.random.default_rng(2).standard_normal((8, 4)).astype(np.float32)
    x[0, :2] = [np.nan, np.inf]
    _runs_as_the_graph(plan, model, {"x": x}, outputs=("r", "k"))


def _reshapes_at_a_cut() -> onnx.ModelProto:
    """``r = Reshape(Reshape(e, [24])^2, [4, 6]) e`` with ``e = Exp(x)``: node 2 (the square)
    is a kernel's, with a Reshape on either side of it."""
    floats = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])]
    out = [helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 6])]
    flat = helper.make_tensor("flat", TensorProto.INT64, [1], [24])
    square = helper.make_tensor("square", TensorProto.INT64, [2], [4, 6])
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("Reshape", ["e", "flat"], ["y"]),
            helper.make_node("Mul", ["y", "y"], ["z"]),  # the kernel's node
            helper.make_node("Reshape", ["z", "square"], ["w"]),
            helper.make_node("Mul", ["w", "e"], ["r"]),
        ],
        "g", floats, out, [flat, square],
    )  # fmt: skip
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    )


def test_views_at_a_cut_are_taken_without_copies():
    # y = Reshape(e) is what the kernel reads: the first segment writes e and y is a view of
    # it; w = Reshape(z) of the kernel's output is a view of z taken before the second segment
    model = _reshapes_at_a_cut()
    square = _Elementwise("y", "z", lambda y: y * y)
    plan = segments.plan_segments(model, [(square, {2})])
    first, second = plan.segments
    assert first.outputs == ["e"] and "Reshape" not in str(plan.segments)
    assert plan.kernels[0][0] == segments.ViewStep("e", "y", (24,))
    assert plan.kernels[0][-1] == segments.ViewStep("z", "w", (4, 6))
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    x[1, :3] = [np.nan, np.inf, -np.inf]
    runner = _runs_as_the_graph(plan, model, {"x": x})
    assert set(runner._cuts) | set(runner._kept) == {"e", "z"}  # no buffer of a view's own


def test_a_plan_for_another_device_keeps_the_shape_ops_in_its_segments():
    # the same graph as above planned for a device whose segments read device buffers: the
    # Reshapes stay nodes of the segments (no host views), and the segments still compute it
    model = _reshapes_at_a_cut()
    kernel = _Elementwise("y", "z", lambda y: y * y)
    plan = segments.plan_segments(model, [(kernel, {2})], cpu=False)
    first, second = plan.segments
    assert first.outputs == ["e", "y"] and second.inputs == ["e", "z"]
    assert [n.op_type for n in second.model.graph.node] == ["Reshape", "Mul"]
    assert plan.kernels == [[kernel], []] and not plan.first
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    x[1, :3] = [np.nan, np.inf, -np.inf]
    _runs_as_the_graph(plan, model, {"x": x})


def test_a_graph_output_reshaped_from_a_product_is_written_into_the_callers_buffer():
    # g = Reshape(MatMul(e, e^T)) is a graph output (a weight gradient reshaped to its
    # filter's shape): the segment writes the product into the caller's buffer of g, viewed
    # as [1, 4, 4], instead of copying it there through the Reshape
    floats = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])]
    out = [
        helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 6]),
        helper.make_tensor_value_info("g", TensorProto.FLOAT, [4, 2, 2]),
    ]
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [4, 2, 2])
    perm = helper.make_tensor("rows", TensorProto.INT64, [3], [1, 4, 6])
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["e"]),
            helper.make_node("Reshape", ["e", "rows"], ["e3"]),
            helper.make_node("Transpose", ["e3"], ["t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["e3", "t"], ["p"]),
            helper.make_node("Reshape", ["p", "shape"], ["g"]),
            helper.make_node("Mul", ["e", "e"], ["z"]),  # the kernel's node
            helper.make_node("Mul", ["z", "x"], ["r"]),
        ],
        "g", floats, out, [shape, perm],
    )  # fmt: skip
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    )
    kernel = _Elementwise("e", "z", lambda e: e * e)
    plan = segments.plan_segments(model, [(kernel, {5})])
    first = plan.segments[0]
    assert "p" in first.outputs and "g" not in first.outputs
    assert first.output_views["p"] == segments.OutputView(
        "g", (1, 4, 4), (4, 2, 2), np.dtype(np.float32)
    )
    assert "Reshape" not in [n.op_type for n in first.model.graph.node if "p" in n.input]
    x = np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32)
    x[0, 0] = np.nan
    runner = _runs_as_the_graph(plan, model, {"x": x}, outputs=("r", "g"))
    assert [i.name for i in runner.output_infos] == ["e", "g", "r"]
    assert runner.output_infos[1].shape == [4, 2, 2]
    assert runner.output_infos[1].type == "tensor(float)"
    want = ort.InferenceSession(model.SerializeToString()).run(["g"], {"x": x})[0]
    buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((4, 2, 2), np.float32))
    for _ in range(3):
        runner.bind_input("x", x)
        got = runner.run({"r": None, "g": buffer})
        assert got["g"] is buffer
        np.testing.assert_array_equal(buffer.numpy(), want)
    assert "p" not in runner._cuts  # the product has no buffer of its own


def test_offsets_keep_values_alive_at_once_apart_on_the_alignment():
    lives = [(100, 0, 2), (300, 1, 3), (50, 3, 4)]
    starts, total = segments.offsets(lives, alignment=256)
    assert all(start % 256 == 0 for start in starts)
    assert starts[1] == 0  # the largest first
    assert starts[0] == 512  # after it, rounded up: both live at steps 1 and 2
    assert starts[2] == starts[0]  # the first is dead when the third is written
    assert total == 768


def test_a_view_step_never_copies():
    step = segments.ViewStep("a", "b", (-1, 4))
    out = {}
    a = np.arange(12, dtype=np.float32)
    step.compute({"a": a}, out, 1)
    assert out["b"].shape == (3, 4) and np.shares_memory(out["b"], a)
    with pytest.raises(ValueError, match="not contiguous"):  # a strided source would copy
        step.compute({"a": np.arange(12, dtype=np.float32).reshape(3, 4).T}, {}, 1)


def test_a_linear_of_rows_at_a_cut_writes_its_product_into_the_cut():
    # o = x @ w + b of a 3-D x is what a kernel reads: the segment computes it on x's rows
    # (the Gemm onnxruntime would make) and outputs the 2-D sum, of which o is a view
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 5])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [5])
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 3, 5])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["o"]),
            helper.make_node("Neg", ["o"], ["z"]),  # the kernel's node
            helper.make_node("Mul", ["z", "o"], ["r"]),
        ],
        "g", [x, w, b], [r],
    )  # fmt: skip
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    )
    plan = segments.plan_segments(model, [(_Elementwise("o", "z", np.negative), {2})])
    first = plan.segments[0]
    assert first.outputs == ["o/rows_sum"]
    assert [n.op_type for n in first.model.graph.node if n.op_type != "Constant"] == [
        "Reshape", "MatMul", "Add"
    ]  # fmt: skip
    assert plan.kernels[0][0] == segments.ViewStep("o/rows_sum", "o", (-1, 3, 5))
    rng = np.random.default_rng(4)
    feeds = {
        "x": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "w": rng.standard_normal((4, 5)).astype(np.float32),
        "b": np.array([0, np.nan, np.inf, -1, 2], np.float32),
    }
    _runs_as_the_graph(plan, model, feeds)


class _LinearNorm(nn.Module):
    """LeViT's Linear and BatchNorm1d over the flattened tokens, viewed back."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.linear = nn.Linear(a, b, bias=False)
        self.bn = nn.BatchNorm1d(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class _LeViTMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.act, self.ln2 = _LinearNorm(8, 16), nn.Hardswish(), _LinearNorm(16, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.ln2(self.act(self.ln1(x)))).mean(1))


@pytest.mark.skipif(not AVAILABLE, reason="needs the native extension (python setup.py build_ext)")
def test_a_segment_whose_values_nothing_reads_runs_nothing(tmp_path) -> None:
    """With LeViT's MLP the BatchNorm kernels take in the Reshape of the view's gradient and
    leave its Shape, after the BatchNorm forward kernel, in a segment of its own that nothing
    reads (onnxruntime refuses a run without outputs); the step skips it and trains as
    torch does (float64)."""
    from traingraph import from_torch

    torch.manual_seed(0)
    net, x = _LeViTMlp(), torch.randn(4, 6, 8)
    model = from_torch(net, x)
    artifacts.generate_artifacts(
        model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.0),
        artifact_directory=tmp_path,
    )  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    labels = torch.tensor([1, 2, 3, 4])
    loss = float(module(x.numpy(), labels.numpy()))
    reference = net.double()
    expected = nn.functional.cross_entropy(reference(x.double()), labels)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    for name, param in reference.named_parameters():
        got = state.parameters[name].grad.reshape(param.shape)
        np.testing.assert_allclose(got, param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


class _Cloned(nn.Module):
    """A Conv reading an exported ``clone()`` (an Identity) of a Relu's output: its weight
    gradient, a native kernel, reads the clone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x)).clone()
        return self.fc(torch.relu(self.conv(h) + h).mean(dim=(2, 3)))


def test_an_identity_a_kernel_reads_is_bypassed_in_the_whole_model(tmp_path):
    from traingraph.runtime.cpu import kernels

    artifacts.generate_artifacts(
        from_torch(seeded(_Cloned), (torch.zeros(2, 3, 6, 6),), input_names=["x"]),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.SGD(lr=0.1, momentum=0.9),
        artifact_directory=tmp_path,
    )
    model = onnx.load(tmp_path / "training_model.onnx")
    clones = {n.output[0] for n in model.graph.node if n.op_type == "Identity"}
    clones -= {o.name for o in model.graph.output}
    assert clones
    split, grads, found = kernels.split(model, SessionConfig())
    assert grads  # the weight gradients read the Relu's output, not its copy
    reads = {v for g in grads for v in (g.x, g.dy)} | {v for k, _ in found for v in k.inputs}
    assert not reads & clones
    assert not {n.output[0] for n in split.graph.node if n.op_type == "Identity"} & clones
    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((2, 3, 6, 6)).astype(np.float32), rng.integers(0, 4, 2))
        for _ in range(3)
    ]
    from gradcheck import train_steps

    def run(config: SessionConfig):
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, session_config=config)
        optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
        return train_steps(module, optimizer, state, batches)

    plain = SessionConfig(native_conv_grads=False, native_segments=False)
    assert_same_training(run(SessionConfig()), run(plain), one_scale=True)
