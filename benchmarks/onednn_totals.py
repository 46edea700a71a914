"""oneDNN against traingraph's kernels, onnxruntime and torch, summed over a model's convolutions.

Times every distinct 2-D convolution of the chosen torchvision models with
``benchmarks/onednn_conv.py`` (forward, backward-data, backward-weights; each implementation
alternating, median of ``--repeats``; its docstring says how to install oneDNN) and sums each
implementation's time over the model's convolutions, a geometry counted as often as the model
runs it.

traingraph's Winograd kernel runs the 3x3 convolutions of stride 1 and padding 1 (even sizes),
forward and, with the filters turned, their input gradients; its totals are over those
geometries, printed beside the other implementations' totals over the same geometries (the
input gradients timed here in a second alternation: oneDNN, the Winograd kernel, torch).
traingraph's direct kernel runs only a network's first Conv of at most 4 channels and stride 1
(none in a ResNet), so its times (printed per geometry) are not summed.

    taskset -c 0 python benchmarks/onednn_totals.py --models resnet18 resnet50 --threads 1
    python benchmarks/onednn_totals.py --models resnet18 resnet50 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import onednn_conv
from onednn_conv import Shape, _convc

WINOGRAD = "traingraph winograd"
DIRECT = "traingraph direct"


def conv_counts(name: str, batch: int, size: int) -> Counter[Shape]:
    """How many times torchvision's ``name`` runs each Conv2d geometry on a
    (batch, 3, size, size) input (the geometries as ``onednn_conv.model_convs`` spells them)."""
    model = getattr(onednn_conv.torchvision_models(), name)(num_classes=10).eval()
    counts: Counter[Shape] = Counter()

    def hook(module: torch.nn.Conv2d, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        n, c, h, w = inputs[0].shape
        shape = (n, c, h, w, module.out_channels, *module.kernel_size, *module.stride,
                 *module.padding, *module.dilation, module.groups)  # fmt: skip
        counts[shape] += 1  # type: ignore[index]

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.zeros(batch, 3, size, size))
    return counts


def winograd_input_gradient(
    dll: ctypes.CDLL, shape: Shape, threads: int, repeats: int
) -> dict[str, float] | None:
    """Median ms of the input gradient of a 3x3 convolution of stride 1 and padding 1: oneDNN,
    traingraph's Winograd kernel on the turned filters (as the CPU runtime runs it) and torch,
    alternating; None where the kernel does not apply."""
    n, c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, g = shape
    if (kh, kw, sh, sw, ph, pw, dh, dw, g) != (3, 3, 1, 1, 1, 1, 1, 1, 1) or h % 2 or wd % 2:
        return None
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((m, c, kh, kw), dtype=np.float32)
    dy = rng.standard_normal((n, m, h, wd), dtype=np.float32)
    dx = np.empty_like(x)
    pointers = (dx.ctypes.data, w.ctypes.data, dy.ctypes.data)
    plan = dll.dn_create(1, n, c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, g, 1, *pointers)
    if not plan:
        raise RuntimeError(f"oneDNN has no primitive for {onednn_conv.describe(shape)} (op 1)")
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
    mask = (True, False, False)
    runs = {
        "onednn": lambda: dll.dn_run(plan),
        WINOGRAD: lambda: _convc.conv_winograd(dy, w, None, None, dx, threads, 2, True),
        "torch": lambda: torch.ops.aten.convolution_backward(
            tdy, tx, tw, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1, mask
        ),
    }
    return onednn_conv.time_all(runs, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet18"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dll = onednn_conv.onednn_library(tmp)
        for name in args.models:
            counts = conv_counts(name, args.batch, args.size)
            head = f"{name}, batch {args.batch}, {args.size}x{args.size}, {args.threads} threads"
            print(f"## {head}: {sum(counts.values())} convolutions, {len(counts)} geometries")
            totals: dict[str, dict[str, float]] = {}
            for shape, count in counts.items():
                measured = onednn_conv.bench(dll, shape, args.threads, args.repeats)
                winograd = winograd_input_gradient(dll, shape, args.threads, args.repeats)
                if winograd is not None:
                    measured["backward-data (Winograd)"] = winograd
                for op, times in measured.items():
                    cells = "  ".join(f"{k} {v:.2f}" for k, v in times.items())
                    print(f"{count} x {onednn_conv.describe(shape):32s} {op:24s} {cells}")
                    groups = [op]
                    if op == "forward" and WINOGRAD in times:
                        groups.append("forward (Winograd)")
                    for group in groups:
                        row = totals.setdefault(group, {})
                        for k, v in times.items():
                            if k != DIRECT and (k != WINOGRAD or group != "forward"):
                                row[k] = row.get(k, 0.0) + count * v
                sys.stdout.flush()
            print(f"### {head}: ms summed over the model's convolutions")
            print("(Winograd): over the geometries the Winograd kernel runs")
            for op, row in totals.items():
                print(f"{op:24s} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
