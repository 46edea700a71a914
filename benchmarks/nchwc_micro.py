"""Time Convs with parameter filters as onnxruntime runs them and in its blocked (NCHWc) form.

``traingraph.runtime.rewrites.nchwc`` rewrites a Conv whose filter is a graph input into
onnxruntime's
blocked kernels, with the filter reordered in the graph. Two comparisons, each alternating the
two forms in one process:

- ``convs`` (default): one-Conv models, the filter and bias as inputs bound once, at the
  convolutions of the benchmark models (LeNet at batch 64, ResNet-8 at batch 32); median ms of
  each form over ``--repeats`` rounds of 15 runs.
- ``--step MODEL``: the training step of a benchmark model through ``Module`` with the rewrite
  and without it (the default session otherwise), in chunks of 12 steps whose order reverses
  every chunk (``session_ab.alternate``); the median of the per-chunk ratios.

Usage:
    python benchmarks/nchwc_micro.py [--repeats 5]
    python benchmarks/nchwc_micro.py --step resnet8 [--chunks 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from traingraph.runtime.rewrites import nchwc

HERE = Path(__file__).resolve().parent
# (batch, in channels, size, filters, kernel, stride, pad)
CONVS = [
    (64, 1, 28, 6, 5, 1, 0), (64, 6, 12, 16, 5, 1, 0),
    (32, 3, 32, 16, 3, 1, 1), (32, 16, 32, 16, 3, 1, 1), (32, 16, 32, 32, 3, 2, 1),
    (32, 32, 16, 32, 3, 1, 1), (32, 32, 16, 64, 3, 2, 1), (32, 64, 8, 64, 3, 1, 1),
]  # fmt: skip


def _session(model: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("y")
    return session, binding


def convs(repeats: int) -> None:
    rng = np.random.default_rng(0)
    print("| conv | plain ms | blocked ms | ratio |\n|---|---|---|---|")
    for n, c, size, m, k, s, p in CONVS:
        feeds = {
            "x": rng.standard_normal((n, c, size, size)).astype(np.float32),
            "w": rng.standard_normal((m, c, k, k)).astype(np.float32),
            "b": rng.standard_normal(m).astype(np.float32),
        }
        conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k],
                                strides=[s, s], pads=[p] * 4)  # fmt: skip
        graph = helper.make_graph(
            [conv], "conv",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, v.shape)
             for name, v in feeds.items()],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )  # fmt: skip
        plain = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        plain.ir_version = 9
        blocked = onnx.ModelProto()
        blocked.CopyFrom(plain)
        shapes = {name: list(v.shape) for name, v in feeds.items()}
        if not nchwc.convs_as_nchwc(blocked, shapes):
            print(f"| {n}x{c}x{size}x{size} -> {m} k{k} s{s} | not rewritten | | |")
            continue
        runs = {"plain": _session(plain, feeds), "blocked": _session(blocked, feeds)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, (session, binding) in runs.items():
                for _ in range(3):
                    session.run_with_iobinding(binding)
                samples = []
                for _ in range(15):
                    start = time.perf_counter()
                    session.run_with_iobinding(binding)
                    samples.append(time.perf_counter() - start)
                times[name].append(float(np.median(samples)))
        a, b = (float(np.median(times[name])) * 1e3 for name in ("plain", "blocked"))
        print(f"| {n}x{c}x{size}x{size} -> {m} k{k} s{s} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")


def step(model: str, chunks: int) -> None:
    sys.path.insert(0, str(HERE / "peers"))
    from common import load_entry
    from session_ab import alternate
    from traingraph_runner import write_artifacts

    from traingraph.api import CheckpointState, Module, Optimizer

    cache = HERE / ".envs" / "cache"
    meta, _, data = load_entry(cache / model)
    learned = nchwc.form_for
    steppers = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_artifacts(cache / model, meta, directory)
        for on in (True, False):
            nchwc.form_for = learned if on else (lambda *args: None)  # type: ignore[assignment]
            state = CheckpointState.load_checkpoint(directory / "checkpoint")
            module = Module(directory / "training_model.onnx", state)
            module.train()
            steppers.append((module, Optimizer(directory / "optimizer_model.onnx", module)))
        nchwc.form_for = learned  # type: ignore[assignment]
        samples = alternate(steppers, data["x"], data["y"], chunks, 12)
    on, off = samples
    print(f"{model}: blocked {np.median(on):.3f} ms, plain {np.median(off):.3f} ms,"
          f" per-chunk ratio plain / blocked {np.median(off / on):.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step", choices=["lenet", "resnet8"])
    parser.add_argument("--chunks", type=int, default=10)
    args = parser.parse_args()
    if args.step:
        step(args.step, args.chunks)
    else:
        convs(args.repeats)


if __name__ == "__main__":
    main()
