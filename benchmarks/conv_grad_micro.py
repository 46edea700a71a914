"""Time the Conv weight and input gradients that traingraph emits, on onnxruntime's CPU provider.

Two formulations of ``dL/dW`` for ``Y = Conv(X, W)`` are compared with PyTorch's own backward
(``torch.nn.grad.conv2d_weight`` / ``conv2d_input``) on the same number of threads:

- ``unfold``: the graph of :func:`traingraph.autodiff.rules.conv.conv_weight_grad`: the input's
  ``K*K`` shifted views (one Conv with one-hot kernels) contracted with the output gradient in
  one batched MatMul, summed over the batch. This is the rule's formulation.
- ``transposed_conv``: the textbook form, a Conv of ``X`` transposed to ``[C, N, H, W]`` with the
  output gradient transposed to ``[M, N, H', W']`` as its kernel (stride-1 convolutions only).

The input gradient (``ConvTranspose``, from
:func:`traingraph.autodiff.rules.conv.transposed_conv_to`) is timed too. Every result is checked
against a float64 PyTorch reference. Cases: LeNet-5's two convolutions at batch 64 and
ResNet-style 3x3 convolutions at 32x32, batch 32.

Usage:
    python benchmarks/conv_grad_micro.py [--repeats 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.nn.grad

from traingraph.autodiff.rules.conv import Window, conv_weight_grad, transposed_conv_to
from traingraph.ir.builder import OpBuilder


@dataclass(frozen=True)
class Case:
    """One 2-D convolution: ``[N, C, H, H] -> [N, M, H', H']`` with a ``k x k`` kernel."""

    name: str
    batch: int
    channels: int
    size: int
    filters: int
    kernel: int
    pad: int
    group: int = 1

    @property
    def out_size(self) -> int:
        return self.size + 2 * self.pad - self.kernel + 1

    @property
    def window(self) -> Window:
        k, p = self.kernel, self.pad
        return Window((k, k), (1, 1), (1, 1), (p, p), (p, p))


CASES = (
    Case("lenet conv1 1->6 k5 28x28", 64, 1, 28, 6, 5, 0),
    Case("lenet conv2 6->16 k5 12x12", 64, 6, 12, 16, 5, 0),
    Case("resnet 16->16 k3 32x32", 32, 16, 32, 16, 3, 1),
    Case("resnet 32->32 k3 32x32", 32, 32, 32, 32, 3, 1),
    Case("resnet 64->64 k3 32x32", 32, 64, 32, 64, 3, 1),
    Case("depthwise 32 k3 32x32", 32, 32, 32, 32, 3, 1, group=32),
)


def _tensor(name: str, shape: tuple[int, ...]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))


def _session(
    case: Case, build: Callable[[OpBuilder, ir.Value, ir.Value, ir.Value], ir.Value], threads: int
) -> ort.InferenceSession:
    """A session with inputs ``x``, ``dy`` and ``w`` and the one output ``build`` returns."""
    x = _tensor("x", (case.batch, case.channels, case.size, case.size))
    dy = _tensor("dy", (case.batch, case.filters, case.out_size, case.out_size))
    w = _tensor("w", (case.filters, case.channels // case.group, case.kernel, case.kernel))
    graph = ir.Graph([x, dy, w], [], nodes=[], name="bench")
    out = build(OpBuilder(graph, 17), x, dy, w)
    graph.outputs.append(out)
    model = ir.Model(graph, ir_version=10)
    model.opset_imports[""] = 17
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _unfold(case: Case) -> Callable[[OpBuilder, ir.Value, ir.Value, ir.Value], ir.Value]:
    return lambda b, x, dy, w: conv_weight_grad(b, x, dy, w, case.window, case.group)


def _transposed_conv(b: OpBuilder, x: ir.Value, dy: ir.Value, w: ir.Value, pad: int) -> ir.Value:
    swap = [1, 0, 2, 3]
    grad = b.Conv(b.Transpose(x, perm=swap), b.Transpose(dy, perm=swap), pads=[pad] * 4)
    return b.Transpose(grad, perm=swap)


def _transposed(case: Case) -> Callable[[OpBuilder, ir.Value, ir.Value, ir.Value], ir.Value]:
    return lambda b, x, dy, w: _transposed_conv(b, x, dy, w, case.pad)


def _input_grad(case: Case) -> Callable[[OpBuilder, ir.Value, ir.Value, ir.Value], ir.Value]:
    sizes = [case.size] * 2
    outs = [case.out_size] * 2
    return lambda b, x, dy, w: transposed_conv_to(b, dy, w, case.window, case.group, x, sizes, outs)


def _runner(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: sess.run(None, feeds)[0]


def _time_interleaved(
    fns: Mapping[str, Callable[[], object]], repeats: int
) -> dict[str, tuple[float, float]]:
    """``{name: (median ms, min ms)}``; each repeat runs every function once, in turn, so that
    changes in the machine's load fall on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: (statistics.median(v) * 1e3, min(v) * 1e3) for k, v in times.items()}


def run(case: Case, repeats: int, threads: int) -> dict[str, tuple[float, float, float]]:
    """``{formulation: (median ms, min ms, max relative error)}`` for one case."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((case.batch, case.channels, case.size, case.size), dtype=np.float32)
    dy = rng.standard_normal(
        (case.batch, case.filters, case.out_size, case.out_size), dtype=np.float32
    )
    w = rng.standard_normal(
        (case.filters, case.channels // case.group, case.kernel, case.kernel), dtype=np.float32
    )
    feeds = {"x": x, "dy": dy, "w": w}
    tx, tdy, tw = (torch.from_numpy(a) for a in (x, dy, w))
    kw = {"padding": case.pad, "groups": case.group}
    fns: dict[str, Callable[[], np.ndarray]] = {
        "torch weight": lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, **kw).numpy(),
    }
    builders = {"unfold": _unfold(case)}
    if case.group == 1:
        builders["transposed_conv"] = _transposed(case)
    for name, build in builders.items():
        fns[name] = _runner(_session(case, build, threads), feeds)
    fns["torch input"] = lambda: torch.nn.grad.conv2d_input(tx.shape, tw, tdy, **kw).numpy()
    fns["conv_transpose input"] = _runner(_session(case, _input_grad(case), threads), feeds)

    ref_w = torch.nn.grad.conv2d_weight(tx.double(), tw.shape, tdy.double(), **kw).numpy()
    ref_x = torch.nn.grad.conv2d_input(tx.shape, tw.double(), tdy.double(), **kw).numpy()
    errors = {}
    for name, fn in fns.items():
        ref = ref_x if name.endswith("input") else ref_w
        errors[name] = float(np.abs(fn() - ref).max() / np.abs(ref).max())
    timings = _time_interleaved(fns, repeats)
    return {k: (*timings[k], errors[k]) for k in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}, {args.threads} threads,"
          f" {args.repeats} interleaved runs: median / min ms (max error relative to a float64"
          " reference)")
    for case in CASES:
        print(case.name)
        for name, (median, best, err) in run(case, args.repeats, args.threads).items():
            print(f"    {name:22s} {median:8.2f} / {best:8.2f}  ({err:.0e})")


if __name__ == "__main__":
    main()
