"""Time traingraph's native convolution kernels against their peers on the benchmark models'
convolutions, alternating in one process.

- ``weight``: the native weight gradient (``_convc.weight_grads``) against PyTorch's
  ``torch.nn.grad.conv2d_weight`` (oneDNN) on the same threads;
- ``depthwise``: the native weight gradient of depthwise convolutions (one channel per group,
  16 channels to a vector) against PyTorch's, on MobileNetV3's, EfficientNet-B0's and
  ConvNeXt's shapes;
- ``col2im``: the native column sum (``_convc.col2im_sum``,
  :mod:`traingraph.runtime.cpu.kernels.col2im`)
  against onnxruntime's ``Col2Im``, for the strided input gradients of ResNet-8 (batch 32) and
  the unpadded one of LeNet's second convolution (batch 64);
- ``direct``: the first convolution computed directly (``_convc.conv_direct``,
  :mod:`traingraph.runtime.cpu.kernels.direct_conv`) against onnxruntime's ``Conv`` (and ``Relu``)
  with
  every graph optimization, for LeNet's first layer and ResNet-8's stem;
- ``winograd``: the 3 x 3 convolutions of stride 1 by Winograd's transforms
  (``_convc.conv_winograd``, :mod:`traingraph.runtime.cpu.kernels.winograd`) against onnxruntime's
  ``Conv``,
  for ResNet-8's three sizes (forward Convs; the input gradients have the same shapes).

Each result is checked against the peer's before it is timed. Figures are medians of
``--repeats`` calls, the systems taking turns in chunks of 5.

Usage:
    python benchmarks/native_kernels_micro.py [--threads 2] [--repeats 60] [--kernels depthwise]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from traingraph.runtime.cpu.native import NATIVE

# batch, channels, size, filters, kernel, stride, pad
WEIGHT_CASES = [
    (32, 3, 32, 16, 3, 1, 1), (32, 16, 32, 16, 3, 1, 1), (32, 16, 32, 32, 3, 2, 1),
    (32, 32, 16, 32, 3, 1, 1), (32, 16, 32, 32, 1, 2, 0), (32, 32, 16, 64, 3, 2, 1),
    (32, 64, 8, 64, 3, 1, 1), (32, 32, 16, 64, 1, 2, 0), (64, 1, 28, 6, 5, 1, 2),
    (64, 6, 14, 16, 5, 1, 0),
]  # fmt: skip
# batch, channels, size, kernel, stride: a depthwise convolution (pads kernel // 2)
DEPTHWISE_CASES = [
    (32, 576, 4, 5, 1), (32, 240, 8, 5, 1), (32, 72, 32, 3, 2), (32, 1152, 4, 3, 1),
    (32, 96, 64, 3, 2), (32, 144, 32, 3, 1), (32, 144, 32, 5, 2), (8, 96, 56, 7, 1),
]  # fmt: skip
# batch, channels, image, kernel, stride, pad: the input gradient's Col2Im
COL2IM_CASES = [
    (32, 16, 32, 3, 2, 1), (32, 16, 32, 1, 2, 0), (32, 32, 16, 3, 2, 1), (32, 32, 16, 1, 2, 0),
    (64, 6, 14, 5, 1, 0),
]  # fmt: skip
# batch, channels, size, filters, kernel, pad, relu: a first convolution
DIRECT_CASES = [(64, 1, 28, 6, 5, 2, True), (32, 3, 32, 16, 3, 1, False)]
# batch, channels, size, filters: a 3 x 3 convolution of stride 1 and pads 1
WINOGRAD_CASES = [(32, 16, 32, 16), (32, 32, 16, 32), (32, 64, 8, 64)]


def _alternate(systems: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each system, the systems taking turns in chunks of 5."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for run in systems.values():
        for _ in range(3):
            run()
    for _ in range(max(1, repeats // 5)):
        for name, run in systems.items():
            for _ in range(5):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def _weight_case(
    case: tuple[int, ...], threads: int, group: int = 1
) -> dict[str, Callable[[], object]]:
    """The native kernel and PyTorch on one convolution, checked against each other."""
    import torch

    n, c, h, m, k, s, p = case
    rng = np.random.default_rng(0)
    oh = (h + 2 * p - k) // s + 1
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    dy = rng.standard_normal((n, m, oh, oh)).astype(np.float32)
    dw = np.empty((m, c // group, k, k), np.float32)
    xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)

    def native() -> None:
        NATIVE.weight_grads([(x, dy, dw, (s, s), (p, p), (1, 1), group)], threads)

    def peer() -> object:
        return torch.nn.grad.conv2d_weight(xt, dw.shape, dyt, stride=s, padding=p, groups=group)

    native()
    want = np.asarray(peer())
    np.testing.assert_allclose(dw, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    return {"native": native, "peer": peer}


def weight_gradients(threads: int, repeats: int) -> None:
    import torch

    torch.set_num_threads(threads)
    print("| conv (N C H -> M k s) | native ms | torch ms | torch / native | native GFLOP/s |")
    print("|---|---|---|---|---|")
    for case in WEIGHT_CASES:
        n, c, h, m, k, s, p = case
        t = _alternate(_weight_case(case, threads), repeats)
        oh = (h + 2 * p - k) // s + 1
        flops = 2 * n * m * oh * oh * c * k * k
        print(f"| {n}x{c}x{h} -> {m} k{k} s{s} | {t['native']:.3f} | {t['peer']:.3f} |"
              f" {t['peer'] / t['native']:.2f}x | {flops / t['native'] / 1e6:.0f} |")  # fmt: skip


def depthwise_weight_gradients(threads: int, repeats: int) -> None:
    import torch

    torch.set_num_threads(threads)
    print("| depthwise conv (N C H, k s) | native ms | torch ms | torch / native |")
    print("|---|---|---|---|")
    for n, c, h, k, s in DEPTHWISE_CASES:
        t = _alternate(_weight_case((n, c, h, c, k, s, k // 2), threads, group=c), repeats)
        print(f"| {n}x{c}x{h}, k{k} s{s} | {t['native']:.3f} | {t['peer']:.3f} |"
              f" {t['peer'] / t['native']:.2f}x |")  # fmt: skip


def _session(graph: onnx.GraphProto, threads: int) -> ort.InferenceSession:
    """An onnxruntime CPU session of ``graph`` (opset 18) on ``threads`` threads that do not
    spin."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _col2im_case(case: tuple[int, ...], threads: int) -> dict[str, Callable[[], object]]:
    """The native column sum and onnxruntime's Col2Im on one image, checked against each
    other."""
    n, c, h, k, s, p = case
    grid = (h + 2 * p - k) // s + 1
    cols = np.random.default_rng(0).standard_normal((n, c * k * k, grid * grid))
    cols = cols.astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Col2Im", ["cols", "image", "block"], ["y"], strides=[s, s],
                          pads=[p] * 4)],
        "col2im",
        [helper.make_tensor_value_info("cols", TensorProto.FLOAT, list(cols.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([h, h], np.int64), "image"),
         numpy_helper.from_array(np.array([k, k], np.int64), "block")],
    )  # fmt: skip
    session = _session(graph, threads)
    out = np.empty((n, c, h, h), np.float32)
    term = (cols, (k, k), (grid, grid), (s, s), (p, p), (1, 1))

    def native() -> None:
        NATIVE.col2im_sum(out, [term], [], None, threads)

    def peer() -> object:
        return session.run(None, {"cols": cols})[0]

    native()
    np.testing.assert_allclose(out, session.run(None, {"cols": cols})[0], rtol=1e-5, atol=1e-5)
    return {"native": native, "peer": peer}


def col2im(threads: int, repeats: int) -> None:
    print("| image (N C H, k s) | native ms | onnxruntime ms | onnxruntime / native |")
    print("|---|---|---|---|")
    for case in COL2IM_CASES:
        n, c, h, k, s, _ = case
        t = _alternate(_col2im_case(case, threads), repeats)
        print(f"| {n}x{c}x{h}, k{k} s{s} | {t['native']:.3f} | {t['peer']:.3f} |"
              f" {t['peer'] / t['native']:.2f}x |")  # fmt: skip


def _conv_case(
    case: tuple[int, ...], threads: int, native: Callable[..., None]
) -> dict[str, Callable[[], object]]:
    """``native(x, w, b, out)`` and onnxruntime's Conv (and Relu) on one layer, checked
    against each other."""
    n, c, h, m, k, p, relu = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, h)).astype(np.float32)
    w = rng.standard_normal((m, c, k, k)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[p] * 4)]
    nodes += [helper.make_node("Relu", ["c"], ["y"])] if relu else []
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y" if relu else "c", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    session = _session(graph, threads)
    out = np.empty((n, m, h + 2 * p - k + 1, h + 2 * p - k + 1), np.float32)

    def peer() -> object:
        return session.run(None, {"x": x})[0]

    native(x, w, b, out)
    expected = np.asarray(peer())
    # Winograd's F(4x4, 3x3) rounds within about 1e-5 of the output's scale
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=3e-5 * np.abs(expected).max())
    return {"native": lambda: native(x, w, b, out), "peer": peer}


def _direct_case(case: tuple[int, ...], threads: int) -> dict[str, Callable[[], object]]:
    """The direct convolution and onnxruntime's on one layer."""
    p, relu = case[5], case[6]
    return _conv_case(
        case, threads, lambda x, w, b, out: NATIVE.conv_direct(
            x, w, b, out, (p, p), relu, threads
        )
    )  # fmt: skip


def direct(threads: int, repeats: int) -> None:
    print("| conv (N C H -> M k, relu) | native ms | onnxruntime ms | onnxruntime / native |"
          " native GFLOP/s |")  # fmt: skip
    print("|---|---|---|---|---|")
    for case in DIRECT_CASES:
        n, c, h, m, k, p, relu = case
        t = _alternate(_direct_case(case, threads), repeats)
        flops = 2 * n * m * (h + 2 * p - k + 1) ** 2 * c * k * k
        print(f"| {n}x{c}x{h} -> {m} k{k}{' relu' if relu else ''} | {t['native']:.3f} |"
              f" {t['peer']:.3f} | {t['peer'] / t['native']:.2f}x |"
              f" {flops / t['native'] / 1e6:.0f} |")  # fmt: skip


def winograd(threads: int, repeats: int) -> None:
    print("| conv (N C H -> M, k3 s1 p1) | native ms | onnxruntime ms | onnxruntime / native |"
          " equivalent GFLOP/s |")  # fmt: skip
    print("|---|---|---|---|---|")
    for n, c, h, m in WINOGRAD_CASES:
        t = _alternate(
            _conv_case(
                (n, c, h, m, 3, 1, False), threads,
                lambda x, w, b, out: NATIVE.conv_winograd(x, w, b, None, out, threads),
            ),
            repeats,
        )  # fmt: skip
        flops = 2 * n * m * h * h * c * 9
        print(f"| {n}x{c}x{h} -> {m} | {t['native']:.3f} | {t['peer']:.3f} |"
              f" {t['peer'] / t['native']:.2f}x | {flops / t['native'] / 1e6:.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=60)
    kernels = ["weight", "depthwise", "col2im", "direct", "winograd"]
    parser.add_argument("--kernels", nargs="+", choices=kernels, default=kernels)
    args = parser.parse_args()
    if NATIVE is None:
        raise SystemExit("traingraph.runtime._convc was not built (no C compiler at install time)")
    if "weight" in args.kernels:
        weight_gradients(args.threads, args.repeats)
    if "depthwise" in args.kernels:
        print()
        depthwise_weight_gradients(args.threads, args.repeats)
    if "col2im" in args.kernels:
        print()
        col2im(args.threads, args.repeats)
    if "direct" in args.kernels:
        print()
        direct(args.threads, args.repeats)
    if "winograd" in args.kernels:
        print()
        winograd(args.threads, args.repeats)


if __name__ == "__main__":
    main()
