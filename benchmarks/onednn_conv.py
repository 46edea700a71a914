"""oneDNN's convolution primitives against traingraph's C kernels, onnxruntime and torch.

For each distinct 2-D convolution of the chosen torchvision models (batch and image size as
given), times in one process, alternating, median of ``--repeats``:

- forward: oneDNN (its own layouts, with the reorders from and to NCHW in the time),
  onnxruntime's Conv with the filter as an input (as in a training graph) and as a constant
  (its blocked NCHWc kernels), traingraph's ``conv_winograd`` / ``conv_direct`` where they
  apply, torch;
- backward-data: oneDNN, onnxruntime's ConvTranspose, torch;
- backward-weights: oneDNN, traingraph's ``weight_grads``, torch.

oneDNN's PyPI build (``pip install onednn==2026.1.0 onednn-devel==2026.1.0``) runs its CPU
primitives through SYCL on the OpenCL CPU device and threads with TBB, which takes the
process's CPU affinity: run under ``taskset -c 0`` with ``--threads 1`` for one thread. The
shim ``onednn_conv.c`` is compiled here with ``cc``.

    python benchmarks/onednn_conv.py --models resnet18 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from traingraph.runtime import _convc  # type: ignore[attr-defined]
from zoo.torchvision_import import torchvision_models

Shape = tuple[int, ...]  # n, c, h, w, m, kh, kw, sh, sw, ph, pw, dh, dw, g


def model_convs(name: str, batch: int, size: int) -> list[Shape]:
    """The distinct Conv2d geometries of torchvision's ``name`` on a (batch, 3, size, size)
    input, in order of first use."""
    model = getattr(torchvision_models(), name)(num_classes=10).eval()
    found: list[Shape] = []

    def hook(module: torch.nn.Conv2d, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        n, c, h, w = inputs[0].shape
        shape = (n, c, h, w, module.out_channels, *module.kernel_size, *module.stride,
                 *module.padding, *module.dilation, module.groups)  # fmt: skip
        if shape not in found:
            found.append(shape)  # type: ignore[arg-type]

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.zeros(batch, 3, size, size))
    return found


def onednn_library(directory: str) -> ctypes.CDLL:
    prefix = Path(sysconfig.get_paths()["data"])
    lib = prefix / "lib"
    out = os.path.join(directory, "onednn_conv.so")
    source = Path(__file__).with_name("onednn_conv.c")
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", str(source), f"-I{prefix / 'include'}", f"-L{lib}",
         "-ldnnl", f"-Wl,--disable-new-dtags,-rpath,{lib}", "-o", out],
        check=True,
    )  # fmt: skip
    os.environ.setdefault("OCL_ICD_FILENAMES", str(lib / "libintelocl.so"))
    dll = ctypes.CDLL(out)
    dll.dn_create.restype = ctypes.c_void_p
    dll.dn_create.argtypes = [ctypes.c_int] + [ctypes.c_long] * 14 + [ctypes.c_int] + [
        ctypes.c_void_p
    ] * 3
    dll.dn_run.argtypes = [ctypes.c_void_p]
    dll.dn_impl.restype = ctypes.c_char_p
    dll.dn_impl.argtypes = [ctypes.c_void_p]
    return dll


def ort_session(shape: Shape, transpose: bool, constant_w: int, threads: int,
                w: np.ndarray) -> Callable[[np.ndarray], object]:  # fmt: skip
    n, c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, g = shape
    attrs = dict(strides=[sh, sw], pads=[ph, pw, ph, pw], dilations=[dh, dw], group=g)
    if transpose:  # dy -> dx
        oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        xin = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, m, oh, ow])
        out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n, c, h, wd])
        extra = (h + 2 * ph - dh * (kh - 1) - 1) % sh, (wd + 2 * pw - dw * (kw - 1) - 1) % sw
        node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], output_padding=list(extra),
                                **attrs)  # fmt: skip
    else:
        xin = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, c, h, wd])
        out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    inputs = [xin]
    inits = []
    if constant_w:
        inits.append(numpy_helper.from_array(w, "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, list(w.shape)))
    graph = helper.make_graph([node], "g", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.force_spinning_stop", "1")
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    if constant_w:
        return lambda x: session.run(None, {"x": x})
    return lambda x: session.run(None, {"x": x, "w": w})


def time_all(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each run, alternating, after a warm-up of each."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for k, f in runs.items():
            start = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def describe(shape: Shape) -> str:
    n, c, h, w, m, kh, kw, sh, sw, ph, pw, dh, dw, g = shape
    text = f"{c}->{m} {h}x{w} k{kh}x{kw} s{sh}"
    if dh > 1:
        text += f" d{dh}"
    if g > 1:
        text += f" g{g}"
    return text


def bench(
    dll: ctypes.CDLL, shape: Shape, threads: int, repeats: int
) -> dict[str, dict[str, float]]:
    n, c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, g = shape
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, wd), dtype=np.float32)
    w = rng.standard_normal((m, c // g, kh, kw), dtype=np.float32)
    dy = rng.standard_normal((n, m, oh, ow), dtype=np.float32)
    y = np.empty_like(dy)
    dx = np.empty_like(x)
    dwt = np.empty_like(w)
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
    conv = dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=g)

    def onednn(op: int) -> Callable[[], object]:
        args = [a.ctypes.data for a in ((x, w, y), (dx, w, dy), (x, dwt, dy))[op]]
        plan = dll.dn_create(op, n, c, h, wd, m, kh, kw, sh, sw, ph, pw, dh, dw, g, 1, *args)
        if not plan:
            raise RuntimeError(f"oneDNN has no primitive for {describe(shape)} (op {op})")
        impls.append(dll.dn_impl(plan).decode())
        return lambda: dll.dn_run(plan)

    result: dict[str, dict[str, float]] = {}
    impls: list[str] = []
    fwd: dict[str, Callable[[], object]] = {}
    fwd["onednn"] = onednn(0)
    ort_input, ort_const = (ort_session(shape, False, const, threads, w) for const in (0, 1))
    fwd["ort (w input)"] = lambda: ort_input(x)
    fwd["ort (w const)"] = lambda: ort_const(x)
    plain = sh == sw == dh == dw == g == 1
    if plain and kh == kw == 3 and ph == pw == 1 and h % 2 == 0 and wd % 2 == 0:
        fwd["traingraph winograd"] = lambda: _convc.conv_winograd(x, w, None, None, y, threads)
    elif plain:
        fwd["traingraph direct"] = lambda: _convc.conv_direct(
            x, w, None, y, (ph, pw), False, threads
        )
    fwd["torch"] = lambda: torch.conv2d(tx, tw, None, **conv)
    result["forward"] = time_all(fwd, repeats)

    bwd: dict[str, Callable[[], object]] = {}
    bwd["onednn"] = onednn(1)
    ort_transpose = ort_session(shape, True, False, threads, w)
    bwd["ort ConvTranspose"] = lambda: ort_transpose(dy)
    mask = (True, False, False)
    bwd["torch"] = lambda: torch.ops.aten.convolution_backward(
        tdy, tx, tw, None, (sh, sw), (ph, pw), (dh, dw), False, (0, 0), g, mask)
    result["backward-data"] = time_all(bwd, repeats)

    bww: dict[str, Callable[[], object]] = {}
    bww["onednn"] = onednn(2)
    entry = (x, dy, dwt, (sh, sw), (ph, pw), (dh, dw), g)
    bww["traingraph weight_grads"] = lambda: _convc.weight_grads([entry], threads)
    mask = (False, True, False)
    bww["torch"] = lambda: torch.ops.aten.convolution_backward(
        tdy, tx, tw, None, (sh, sw), (ph, pw), (dh, dw), False, (0, 0), g, mask)
    result["backward-weights"] = time_all(bww, repeats)
    print(f"  oneDNN implementations: {', '.join(impls)}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["resnet18"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--limit", type=int, default=0, help="at most this many shapes a model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dll = onednn_library(tmp)
        for name in args.models:
            shapes = model_convs(name, args.batch, args.size)
            if args.limit:
                shapes = shapes[: args.limit]
            print(f"## {name}, batch {args.batch}, {args.size}x{args.size}, {args.threads} threads")
            for shape in shapes:
                for op, times in bench(dll, shape, args.threads, args.repeats).items():
                    cells = "  ".join(f"{k} {v:.2f}" for k, v in times.items())
                    print(f"{describe(shape):32s} {op:17s} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
