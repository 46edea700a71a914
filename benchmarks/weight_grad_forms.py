"""Time the CPU runtime's two forms of a Conv weight gradient on the same arrays.

``product``: :func:`traingraph.runtime.cpu.kernels.conv_grads.product_weight_grad`, the unfold
written natively (``_convc.unfold``) and one product by onnxruntime's ``Gemm``; ``native``: the
native kernel's sums (``_convc.weight_grads``, by Winograd's F(4 x 4, 3 x 3) where it applies).
The form :func:`~traingraph.runtime.cpu.kernels.conv_grads.by_product` picks is marked with
``*``; both results are checked against each other. Median ms of ``--repeats`` calls after one.

A case is ``N,C,H,M,K,S``: ``N`` samples of ``C`` channels over ``H x H``, ``M`` filters of
``K x K``, stride ``S``, pads ``K // 2``. The default cases are the zoo CNNs' small planes and
their neighbours.

Usage:
    python benchmarks/weight_grad_forms.py [--threads 2 1] [--repeats 15]
        [--cases 16,512,4,512,3,1 ...]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np

from traingraph.runtime.cpu.kernels import conv_grads

CASES = [
    "16,512,4,512,3,1", "16,256,7,256,3,1", "16,128,14,128,3,1", "16,128,8,128,3,1",
    "16,128,7,32,3,1", "16,128,3,32,3,1", "16,128,7,128,3,1", "16,256,14,512,3,2",
    "16,128,28,256,3,2", "16,64,32,128,3,2", "16,1024,7,256,1,1", "16,512,14,128,1,1",
    "32,40,16,240,1,1", "32,672,8,112,1,1", "16,256,56,512,1,2", "16,512,28,1024,1,2",
]  # fmt: skip


def _median_ms(run: Callable[[], None], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _native(conv: tuple[object, ...], threads: int) -> None:
    assert conv_grads.NATIVE is not None
    conv_grads.NATIVE.weight_grads([conv], threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="+", default=CASES, help="N,C,H,M,K,S each")
    args = parser.parse_args(argv)
    if conv_grads.NATIVE is None:
        parser.error("traingraph.runtime._convc was not built (no C compiler at install time)")
    rng = np.random.default_rng(0)
    print("| x -> dy, kernel, stride | " + " | ".join(
        f"{t} thread(s): product / native ms" for t in args.threads) + " |")  # fmt: skip
    print("|---|" + "---|" * len(args.threads))
    for case in args.cases:
        n, c, h, m, k, s = (int(v) for v in case.split(","))
        p = k // 2
        oh = (h + 2 * p - k) // s + 1
        x = rng.standard_normal((n, c, h, h)).astype(np.float32)
        dy = rng.standard_normal((n, m, oh, oh)).astype(np.float32)
        grad = conv_grads.WeightGrad("g", "w", "x", "dy", (s, s), (p, p), (p, p), (1, 1), 1,
                                     None, (k, k))  # fmt: skip
        picked = conv_grads.by_product(grad, dy.shape, (k, k))
        by_product = np.empty((m, c, k, k), np.float32)
        by_sums = np.empty((m, c, k, k), np.float32)
        product = functools.partial(conv_grads.product_weight_grad, x, dy, grad, by_product)
        native = functools.partial(_native, (x, dy, by_sums, (s, s), (p, p), (1, 1), 1))
        cells = []
        for threads in args.threads:
            a = _median_ms(functools.partial(product, threads=threads), args.repeats)
            b = _median_ms(functools.partial(native, threads=threads), args.repeats)
            cells.append(f"{a:.2f}{'*' if picked else ''} / {b:.2f}{'' if picked else '*'}")
        scale = float(np.abs(by_sums).max())
        np.testing.assert_allclose(by_product, by_sums, rtol=1e-3, atol=1e-4 * scale)
        shape = f"[{n}, {c}, {h}, {h}] -> [{n}, {m}, {oh}, {oh}], {k}x{k}, {s}"
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
