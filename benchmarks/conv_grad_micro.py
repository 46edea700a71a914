"""Time the Conv weight and input gradients that traingraph emits, on onnxruntime's CPU provider.

Each formulation runs alone in a small ONNX model, in a session made the way the runtime makes
them (optimization level "all", ``--threads`` intra-op threads, no spinning), next to PyTorch's
own backward (``torch.nn.grad.conv2d_weight`` / ``conv2d_input``) on the same number of threads.

``dL/dW`` for ``Y = Conv(X, W)`` (the input unfolded by
:func:`traingraph.autodiff.rules.conv.unfold`, then contracted with the output gradient):

- ``per_sample``: :func:`~traingraph.autodiff.rules.conv.weight_grad_by_sample`, one batched
  MatMul per sample summed over the batch;
- ``gemm``: :func:`~traingraph.autodiff.rules.conv.weight_grad_by_gemm`, the batch moved inside
  the contraction and one GEMM;
- ``transposed_conv``: the textbook form, a Conv of ``X`` transposed to ``[C, N, H, W]`` with
  the output gradient transposed to ``[M, N, H', W']`` as its kernel (stride 1 only).

``dL/dX``:

- ``conv_transpose``: :func:`~traingraph.autodiff.rules.conv.transposed_conv_to`;
- ``col2im`` (CPU): the same model as the session runs it on the CPU, rewritten by
  :func:`traingraph.runtime.rewrites.specialize.for_cpu` into a batched MatMul and Col2Im;
- ``flipped_conv``: a Conv of the output gradient with the flipped, transposed weight
  (:func:`~traingraph.autodiff.rules.conv.flipped_conv`), timed where
  :func:`~traingraph.autodiff.rules.conv.flipped_conv_fits` lets the rule use it.

The rule's pick for each case is marked with ``*``. Every result is checked against a float64
PyTorch reference. Cases: the convolutions of the benchmark models (``benchmarks/models.py``):
LeNet-5 at batch 64 and ResNet-8 at batch 32, plus a depthwise and a stride-1 1x1 convolution.

With ``--device cuda`` every form runs on onnxruntime's CUDA provider (rewritten by
:func:`~traingraph.runtime.rewrites.specialize.for_cuda` as the runtime's CUDA sessions are,
inputs and outputs bound in GPU memory, cuDNN's algorithms searched exhaustively) next to
PyTorch's CUDA backward.

Usage:
    python benchmarks/conv_grad_micro.py [--repeats 30] [--threads 2] [--cases lenet resnet]
        [--device cpu|cuda] [--batch 32] [--cuda-option prefer_nhwc=1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.nn.grad

from traingraph.autodiff.rules.conv import (
    Window,
    flipped_conv,
    flipped_conv_fits,
    flipped_weight,
    transposed_conv_to,
    unfold,
    weight_grad_by_gemm,
    weight_grad_by_sample,
)
from traingraph.ir.builder import OpBuilder
from traingraph.runtime.rewrites.specialize import for_cpu, for_cuda
from traingraph.runtime.session import SessionConfig


@dataclass(frozen=True)
class Case:
    """One 2-D convolution: ``[N, C, H, H] -> [N, M, H', H']``, a ``k x k`` kernel, stride ``s``."""

    name: str
    batch: int
    channels: int
    size: int
    filters: int
    kernel: int
    pad: int
    stride: int = 1
    group: int = 1

    @property
    def out_size(self) -> int:
        return (self.size + 2 * self.pad - self.kernel) // self.stride + 1

    @property
    def window(self) -> Window:
        k, p, s = self.kernel, self.pad, self.stride
        return Window((k, k), (s, s), (1, 1), (p, p), (p, p))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of the Conv input ``x``, output gradient ``dy`` and weight ``w``."""
        n, c, m, h, o, k = (
            self.batch, self.channels, self.filters, self.size, self.out_size, self.kernel
        )
        return {"x": (n, c, h, h), "dy": (n, m, o, o), "w": (m, c // self.group, k, k)}


CASES = (
    Case("lenet conv1 1->6 k5 p2 28x28", 64, 1, 28, 6, 5, 2),
    Case("lenet conv2 6->16 k5 14x14", 64, 6, 14, 16, 5, 0),
    Case("resnet stem 3->16 k3 32x32", 32, 3, 32, 16, 3, 1),
    Case("resnet layer1 16->16 k3 32x32", 32, 16, 32, 16, 3, 1),
    Case("resnet layer2.conv1 16->32 k3 s2 32x32", 32, 16, 32, 32, 3, 1, 2),
    Case("resnet layer2.down 16->32 k1 s2 32x32", 32, 16, 32, 32, 1, 0, 2),
    Case("resnet layer2.conv2 32->32 k3 16x16", 32, 32, 16, 32, 3, 1),
    Case("resnet layer3.conv1 32->64 k3 s2 16x16", 32, 32, 16, 64, 3, 1, 2),
    Case("resnet layer3.down 32->64 k1 s2 16x16", 32, 32, 16, 64, 1, 0, 2),
    Case("resnet layer3.conv2 64->64 k3 8x8", 32, 64, 8, 64, 3, 1),
    Case("pointwise 32->64 k1 16x16", 32, 32, 16, 64, 1, 0),
    Case("depthwise 32 k3 16x16", 32, 32, 16, 32, 3, 1, group=32),
    Case("resnet50 stem 3->64 k7 s2 224x224 (x1)", 64, 3, 224, 64, 7, 3, 2),
    Case("resnet50 layer1 64->64 k1 56x56 (x1)", 64, 64, 56, 64, 1, 0),
    Case("resnet50 layer1 256->64 k1 56x56 (x2)", 64, 256, 56, 64, 1, 0),
    Case("resnet50 layer1 64->64 k3 56x56 (x3)", 64, 64, 56, 64, 3, 1),
    Case("resnet50 layer1 64->256 k1 56x56 (x4)", 64, 64, 56, 256, 1, 0),
    Case("resnet50 layer2 256->128 k1 56x56 (x1)", 64, 256, 56, 128, 1, 0),
    Case("resnet50 layer2 128->128 k3 s2 56x56 (x1)", 64, 128, 56, 128, 3, 1, 2),
    Case("resnet50 layer2 256->512 k1 s2 56x56 (x1)", 64, 256, 56, 512, 1, 0, 2),
    Case("resnet50 layer2 512->128 k1 28x28 (x3)", 64, 512, 28, 128, 1, 0),
    Case("resnet50 layer2 128->128 k3 28x28 (x3)", 64, 128, 28, 128, 3, 1),
    Case("resnet50 layer2 128->512 k1 28x28 (x4)", 64, 128, 28, 512, 1, 0),
    Case("resnet50 layer3 512->256 k1 28x28 (x1)", 64, 512, 28, 256, 1, 0),
    Case("resnet50 layer3 256->256 k3 s2 28x28 (x1)", 64, 256, 28, 256, 3, 1, 2),
    Case("resnet50 layer3 512->1024 k1 s2 28x28 (x1)", 64, 512, 28, 1024, 1, 0, 2),
    Case("resnet50 layer3 1024->256 k1 14x14 (x5)", 64, 1024, 14, 256, 1, 0),
    Case("resnet50 layer3 256->256 k3 14x14 (x5)", 64, 256, 14, 256, 3, 1),
    Case("resnet50 layer3 256->1024 k1 14x14 (x6)", 64, 256, 14, 1024, 1, 0),
    Case("resnet50 layer4 1024->512 k1 14x14 (x1)", 64, 1024, 14, 512, 1, 0),
    Case("resnet50 layer4 512->512 k3 s2 14x14 (x1)", 64, 512, 14, 512, 3, 1, 2),
    Case("resnet50 layer4 1024->2048 k1 s2 14x14 (x1)", 64, 1024, 14, 2048, 1, 0, 2),
    Case("resnet50 layer4 2048->512 k1 7x7 (x2)", 64, 2048, 7, 512, 1, 0),
    Case("resnet50 layer4 512->512 k3 7x7 (x2)", 64, 512, 7, 512, 3, 1),
    Case("resnet50 layer4 512->2048 k1 7x7 (x3)", 64, 512, 7, 2048, 1, 0),
)
"""The benchmark models' convolutions, then torchvision ResNet-50's at batch 64 on 224 x 224
(``(xK)``: how many of its Convs have that shape)."""

Build = Callable[[OpBuilder, ir.Value, ir.Value, ir.Value], ir.Value]


PLAIN_CUDA = False
"""Whether CUDA sessions run the forms as written, without ``for_cuda`` (``--plain-cuda``)."""
CUDA_EXTRA: dict[str, str] = {}
"""Further CUDA provider options (``--cuda-option``)."""


def _session(
    case: Case, build: Build, threads: int, device: str, rewrite: bool = False
) -> ort.InferenceSession:
    """A session with inputs ``x``, ``dy`` and ``w`` and the one output ``build`` returns;
    with ``rewrite``, of the model as :func:`~traingraph.runtime.rewrites.specialize.for_cpu`
    writes it."""
    inputs = [
        ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
        for name, shape in case.shapes.items()
    ]
    graph = ir.Graph(inputs, [], nodes=[], name="bench")
    graph.outputs.append(build(OpBuilder(graph, 17), *inputs))
    model = ir.Model(graph, ir_version=10)
    model.opset_imports[""] = 17
    config = SessionConfig(intra_op_threads=threads, cuda_extra=CUDA_EXTRA)
    providers: list[Any] = ["CPUExecutionProvider"]
    if device == "cuda":
        providers = [("CUDAExecutionProvider", config.cuda_options()), *providers]
    source = ir.to_proto(model).SerializeToString()
    if device == "cuda" and not PLAIN_CUDA:
        source = for_cuda(source)  # as the runtime's CUDA sessions do
    return ort.InferenceSession(
        for_cpu(source) if rewrite else source, config.session_options(), providers=providers
    )


def _weight_forms(case: Case) -> dict[str, Build]:
    win, group = case.window, case.group

    def cols(b: OpBuilder, x: ir.Value, w: ir.Value) -> ir.Value:
        return unfold(b, x, win, case.channels)

    def transposed_conv(b: OpBuilder, x: ir.Value, dy: ir.Value, w: ir.Value) -> ir.Value:
        # The output gradient is the kernel, dilated by the stride; the windows the stride
        # leaves out at the end are cut by a smaller end pad.
        swap = [1, 0, 2, 3]
        extra = (case.size + 2 * case.pad - case.kernel) % case.stride
        end = case.pad - extra
        grad = b.Conv(
            b.Transpose(x, perm=swap),
            b.Transpose(dy, perm=swap),
            pads=[case.pad, case.pad, max(end, 0), max(end, 0)],
            dilations=[case.stride] * 2,
        )
        if end < 0:
            grad = b.Slice(grad, b.ints([0, 0]), b.ints([case.kernel] * 2), b.ints([2, 3]))
        return b.Transpose(grad, perm=swap)

    forms: dict[str, Build] = {
        "per_sample": lambda b, x, dy, w: weight_grad_by_sample(b, cols(b, x, w), x, dy, w, group),
        "gemm": lambda b, x, dy, w: weight_grad_by_gemm(
            b, cols(b, x, w), dy, w, group, case.out_size**2
        ),
    }
    if case.group == 1:
        forms["transposed_conv"] = transposed_conv
    return forms


def _input_forms(case: Case) -> dict[str, Build]:
    win, group = case.window, case.group
    sizes, outs = [case.size] * 2, [case.out_size] * 2
    forms: dict[str, Build] = {
        "conv_transpose": lambda b, x, dy, w: transposed_conv_to(
            b, dy, w, win, group, x, sizes, outs
        ),
    }
    if _flips(case):
        forms["flipped_conv"] = lambda b, x, dy, w: flipped_conv(
            b, dy, _flipped(b, w, case), win, group
        )
    return forms


def _flipped(b: OpBuilder, w: ir.Value, case: Case) -> ir.Value:
    flipped = flipped_weight(b, w, case.window.kernel, case.group)
    assert flipped is not None
    return flipped


def _rule_picks(case: Case, device: str) -> tuple[str, str]:
    """The weight and input gradient forms that the Conv rule emits for ``case`` and the
    session runs on ``device``."""
    weight = "gemm" if case.out_size**2 <= case.filters // case.group else "per_sample"
    transposed = "col2im" if device == "cpu" else "conv_transpose"
    return weight, "flipped_conv" if _flips(case) else transposed


def _flips(case: Case) -> bool:
    return flipped_conv_fits(case.window, case.channels, case.filters, case.group)


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


def _runner(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], device: str) -> Callable:
    """A call that runs ``sess`` once and returns its output on the host; on CUDA the inputs
    and the output stay bound in GPU memory, and only the result check copies."""
    if device != "cuda":
        return lambda: sess.run(None, feeds)[0]
    binding = sess.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    binding.bind_output(sess.get_outputs()[0].name, "cuda")

    def call(fetch: bool = False) -> np.ndarray | None:
        sess.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0] if fetch else None

    return call


def run(
    case: Case, repeats: int, threads: int, device: str = "cpu"
) -> dict[str, tuple[float, float, float]]:
    """``{"weight <form>" | "input <form>": (median ms, min ms, max relative error)}``."""
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v, dtype=np.float32) for k, v in case.shapes.items()}
    tx, tdy, tw = (torch.from_numpy(feeds[k]) for k in ("x", "dy", "w"))
    kw = {"stride": case.stride, "padding": case.pad, "groups": case.group}
    refs = {
        "weight": torch.nn.grad.conv2d_weight(tx.double(), tw.shape, tdy.double(), **kw).numpy(),
        "input": torch.nn.grad.conv2d_input(tx.shape, tw.double(), tdy.double(), **kw).numpy(),
    }
    dx, ddy, dw = (t.to(device) for t in (tx, tdy, tw))

    def torch_call(fn: Callable[[], torch.Tensor]) -> Callable[..., np.ndarray | None]:
        def call(fetch: bool = True) -> np.ndarray | None:
            out = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            return out.cpu().numpy() if fetch else None

        return call

    fns: dict[str, Callable[..., np.ndarray | None]] = {
        "weight torch": torch_call(lambda: torch.nn.grad.conv2d_weight(dx, dw.shape, ddy, **kw)),
        "input torch": torch_call(lambda: torch.nn.grad.conv2d_input(dx.shape, dw, ddy, **kw)),
    }
    for kind, forms in (("weight", _weight_forms(case)), ("input", _input_forms(case))):
        for name, build in forms.items():
            fns[f"{kind} {name}"] = _runner(_session(case, build, threads, device), feeds, device)
    if device == "cpu":
        build = _input_forms(case)["conv_transpose"]
        fns["input col2im"] = _runner(_session(case, build, threads, device, True), feeds, device)
    errors = {}
    for name, fn in fns.items():
        ref = refs[name.split()[0]]
        got = fn(True) if device == "cuda" else fn()
        errors[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
    timings = _time_interleaved(fns, repeats)
    return {k: (*timings[k], errors[k]) for k in sorted(fns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=None, help="batch size of every case")
    parser.add_argument(
        "--cases", nargs="*", default=[], help="run only the cases whose name contains one of these"
    )
    parser.add_argument(
        "--cuda-option", action="append", default=[], metavar="KEY=VALUE",
        help="a further CUDA provider option, for example prefer_nhwc=1",
    )
    parser.add_argument(
        "--plain-cuda", action="store_true", help="CUDA sessions without the runtime's rewrites"
    )
    args = parser.parse_args()
    global PLAIN_CUDA
    PLAIN_CUDA = args.plain_cuda
    CUDA_EXTRA.update(option.split("=", 1) for option in args.cuda_option)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}, {args.threads} threads,"
          f" {args.repeats} interleaved runs: median / min ms (max error relative to a float64"
          " reference); * marks the rule's pick")
    for case in CASES:
        if args.cases and not any(part in case.name for part in args.cases):
            continue
        if args.batch:
            case = dataclasses.replace(case, batch=args.batch)
        print(case.name, flush=True)
        picks = {f"weight {pick}" for pick in _rule_picks(case, args.device)[:1]}
        picks.add(f"input {_rule_picks(case, args.device)[1]}")
        results = run(case, args.repeats, args.threads, args.device)
        for name, (median, best, err) in results.items():
            mark = "*" if name in picks else " "
            print(f"   {mark}{name:24s} {median:8.2f} / {best:8.2f}  ({err:.0e})", flush=True)


if __name__ == "__main__":
    main()
