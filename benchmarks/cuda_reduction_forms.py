"""Per-channel sums of ResNet-50's BatchNorm inputs (batch 64) in several standard-op forms.

A training-mode BatchNorm's statistics and gradient are per-channel sums over the batch and
positions of an NCHW tensor. Each form below computes them with standard ops in one
onnxruntime session, timed alone (median of ``--repeats`` runs through an IOBinding, the input
already on the device):

- ``chain``: ReduceSum over the batch axis (column sums), then over the positions (row sums),
  as the CUDA rule ``reductions_over_runs`` writes a ReduceSum over ``[0, 2, 3]``;
- ``single``: one ReduceSum over ``[0, 2, 3]`` (cuDNN's general reduction on CUDA);
- ``chain_matmul``: the column sums, then the row sums as a MatMul with a column of ones;
- ``matmuls``: both stages as MatMuls with ones;
- ``squares_mul``: the mean of squares as ``Mul`` then the ``chain`` of ReduceMeans (the
  variance's form in the lowered BatchNorm);
- ``squares_sumsquare``: the same sums with ``ReduceSumSquare`` for the column sums.

The forms of one kind agree to float32 rounding (the largest relative difference from
``chain`` is printed). Run on a GPU machine with onnxruntime-gpu::

    python3 benchmarks/cuda_reduction_forms.py --repeats 20
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = (
    (64, 64, 112, 112), (64, 256, 56, 56), (64, 64, 56, 56), (64, 128, 56, 56),
    (64, 512, 28, 28), (64, 128, 28, 28), (64, 256, 28, 28), (64, 1024, 14, 14),
    (64, 256, 14, 14), (64, 512, 14, 14), (64, 2048, 7, 7), (64, 512, 7, 7),
)  # fmt: skip


def _model(
    nodes: list[onnx.NodeProto], constants: list[onnx.TensorProto], shape: tuple[int, ...]
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "sums",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [shape[1]])],
        initializer=constants,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def forms(shape: tuple[int, ...]) -> dict[str, onnx.ModelProto]:
    """Each form's one-output model for an input of ``shape``."""
    n, c, h, w = shape

    def ints(name: str, values: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(values, np.int64), name)

    def ones(name: str, dims: tuple[int, int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.ones(dims, np.float32), name)

    node = helper.make_node
    batch, positions = ints("batch", [0]), ints("positions", [1, 2])
    rows, channels = ints("rows", [c, h * w]), ints("channels", [c])
    row_sums = [node("Reshape", ["s", "rows"], ["s2"]), node("MatMul", ["s2", "ones"], ["y2"]),
                node("Reshape", ["y2", "channels"], ["y"])]  # fmt: skip
    return {
        "chain": _model(
            [node("ReduceSum", ["x", "batch"], ["s"], keepdims=0),
             node("ReduceSum", ["s", "positions"], ["y"], keepdims=0)],
            [batch, positions], shape,
        ),
        "single": _model(
            [node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], [ints("axes", [0, 2, 3])], shape
        ),
        "chain_matmul": _model(
            [node("ReduceSum", ["x", "batch"], ["s"], keepdims=0), *row_sums],
            [batch, rows, channels, ones("ones", (h * w, 1))], shape,
        ),
        "matmuls": _model(
            [node("Reshape", ["x", "flat"], ["x2"]), node("MatMul", ["ones_n", "x2"], ["s"]),
             *row_sums],
            [ints("flat", [n, c * h * w]), ones("ones_n", (1, n)), rows, channels,
             ones("ones", (h * w, 1))], shape,
        ),
        "squares_mul": _model(
            [node("Mul", ["x", "x"], ["q"]),
             node("ReduceMean", ["q", "batch"], ["s"], keepdims=0),
             node("ReduceMean", ["s", "positions"], ["y"], keepdims=0)],
            [batch, positions], shape,
        ),
        "squares_sumsquare": _model(
            [node("ReduceSumSquare", ["x", "batch"], ["s"], keepdims=0),
             node("ReduceSum", ["s", "positions"], ["y"], keepdims=0)],
            [batch, positions], shape,
        ),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        ort.preload_dlls()
        providers: list = [("CUDAExecutionProvider", {"use_tf32": "0"})]
    else:
        providers = ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    totals: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for shape in SHAPES if args.device == "cuda" else SHAPES[-2:]:
        x = ort.OrtValue.ortvalue_from_numpy(
            rng.standard_normal(shape).astype(np.float32), args.device, 0
        )
        cells, reference = [], None
        for name, model in forms(shape).items():
            session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
            binding = session.io_binding()
            binding.bind_ortvalue_input("x", x)
            binding.bind_output("y", args.device)
            for _ in range(3):
                session.run_with_iobinding(binding)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                session.run_with_iobinding(binding)
                times.append(time.perf_counter() - start)
            ms = float(np.median(times)) * 1e3
            totals[name] = totals.get(name, 0.0) + ms
            out = binding.copy_outputs_to_cpu()[0]
            if name == "chain":
                reference = out
            same_kind = reference is not None and not name.startswith("squares")
            assert reference is not None
            diff = np.abs(out - reference).max() / np.abs(reference).max() if same_kind else None
            cells.append(f"{name} {ms:.3f}" + (f" ({diff:.1e})" if diff is not None else ""))
        print(shape, " | ".join(cells), flush=True)
    print("ms over all shapes:", {k: round(v, 3) for k, v in totals.items()})


if __name__ == "__main__":
    main()
