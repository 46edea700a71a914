"""What a step holds in memory between runs: onnxruntime's CPU arena after a session's first
run (:class:`~traingraph.runtime.session.BoundRunner`), and the shared arena's growth
(:func:`~traingraph.runtime.session.shared_cpu_arena`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from traingraph.runtime import session
from traingraph.runtime.device import Device
from traingraph.runtime.session import BoundRunner, SessionConfig, create_session

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="resident pages are read from Linux's /proc"
)

MIB = 1 << 20


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _many(count: int = 128):
    """y = sum over i < count of (x + i): ``count`` values of x's size, alive until the Sum."""
    nodes = [helper.make_node("Add", ["x", f"c{i}"], [f"a{i}"]) for i in range(count)]
    nodes.append(helper.make_node("Sum", [f"a{i}" for i in range(count)], ["y"]))
    graph = helper.make_graph(
        nodes,
        "many",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor(f"c{i}", TensorProto.FLOAT, [], [float(i)]) for i in range(count)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _grown(runner: BoundRunner, x: np.ndarray) -> tuple[int, np.ndarray]:
    """The resident bytes two runs of ``runner`` on ``x`` add, and the second run's result."""
    before = _resident()
    runner.bind_input("x", x)
    runner.run({"y": None})
    result = runner.run({"y": None})["y"].numpy().copy()
    return _resident() - before, result


def _fresh_env() -> dict[str, str]:
    """The environment of a fresh interpreter that imports this module, with glibc's mmap
    threshold fixed: by default it moves with the sizes freed, and whether a block then comes
    from the heap or from its own mapping changes the resident memory by 15 MiB from run to
    run."""
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def _kept_and_shrunk() -> tuple[float, float]:
    """MiB that two runs add to the resident memory with onnxruntime's default arena and with
    the first run's shrink, after checking that both give the same, right result."""
    device = Device("cpu")
    config = SessionConfig(shared_arena=False, intra_op_threads=1, specialize=False)
    x = np.random.default_rng(0).standard_normal(MIB // 4).astype(np.float32)  # 1 MiB
    want = (128 * x.astype(np.float64) + sum(range(128))).astype(np.float32)
    keeping = BoundRunner(create_session(_many(), device, config), device)
    assert keeping._first_run is not None
    keeping._first_run = None  # as onnxruntime runs by default
    kept, kept_result = _grown(keeping, x)
    shrinking = BoundRunner(create_session(_many(), device, config), device)
    shrunk, result = _grown(shrinking, x)
    np.testing.assert_array_equal(result, kept_result)
    np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-3)
    return kept / MIB, shrunk / MIB


def test_the_first_run_gives_the_arena_back_before_the_memory_pattern_takes_its_block():
    # Each session its own arena: what one keeps is not another's to reuse. The first run
    # allocates the 128 values one by one, over regions of doubling size; from the second on,
    # onnxruntime's memory pattern takes them as one block, which none of those regions holds.
    # Measured in a fresh interpreter: in a process that has run other tests, the C heap's
    # free regions can hold the growth of either runner, and resident memory then says nothing.
    code = "import test_step_memory as t; print(*t._kept_and_shrunk())"
    env = _fresh_env()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    kept, shrunk = map(float, done.stdout.split())
    assert kept - shrunk > 64, (kept, shrunk)


def test_sessions_without_the_arena_are_not_asked_to_shrink_it():
    device = Device("cpu")
    config = SessionConfig(memory_arena=False, intra_op_threads=1, specialize=False)
    runner = BoundRunner(create_session(_many(4), device, config), device)
    assert runner._first_run is None
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    runner.bind_input("x", x)
    np.testing.assert_allclose(runner.run({"y": None})["y"].numpy(), 4 * x + 6, rtol=1e-6)


def _sessions_in_turn(region: int) -> tuple[float, str]:
    """MiB that three steps of sessions run in turn on the shared arena (as a segmented
    step's segments are: each on values of another size, its outputs in host buffers of the
    step's own) add to the resident memory, with the arena grown by regions of at least
    ``region`` bytes after a first run's shrink (-1: onnxruntime's default), after checking
    their results; and a digest of those results."""
    session.SHARED_ARENA_REGION = region  # read when the arena is registered, below
    device = Device("cpu")
    config = SessionConfig(intra_op_threads=1, specialize=False)
    sizes = [1, 2, 3, 4]  # MiB
    runners = [BoundRunner(create_session(_many(16), device, config), device) for _ in sizes]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(size * MIB // 4).astype(np.float32) for size in sizes]
    ys = [np.empty_like(x) for x in xs]
    digest = hashlib.sha256()
    before = _resident()
    for _ in range(3):
        for runner, x, y in zip(runners, xs, ys):
            runner.bind_input("x", x)
            runner.run({"y": ort.OrtValue.ortvalue_from_numpy(y)})
            want = 16 * x.astype(np.float64) + sum(range(16))
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
            digest.update(y.tobytes())
    return (_resident() - before) / MIB, digest.hexdigest()


def test_the_shared_arena_grows_by_large_regions_that_later_blocks_reuse():
    # From the second run on, each session's values take one block of its own size (the
    # memory pattern). Grown by small regions of doubling size, the arena spreads the blocks
    # over regions whose free memory does not merge; grown by a region of
    # SHARED_ARENA_REGION address space, each block takes what the ones before it freed.
    # Measured in fresh interpreters, as above.
    env = _fresh_env()
    grown, digests = {}, {}
    for region in (-1, session.SHARED_ARENA_REGION):
        code = f"import test_step_memory as t; print(*t._sessions_in_turn({region}))"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        size, digests[region] = done.stdout.split()
        grown[region] = float(size)
    assert len(set(digests.values())) == 1  # the same results
    assert grown[-1] - grown[session.SHARED_ARENA_REGION] > 24, grown
