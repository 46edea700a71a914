"""Time the forms of the Relu gradient's mask on onnxruntime's CPU provider.

``dx = g * mask(y)`` with ``y = Relu(x)``, each form in a small model run the way the runtime
makes sessions (``--threads`` intra-op threads, no spinning), with ``Relu`` and the product
included; ``relu_only`` times ``Relu`` and a ``Mul`` alone, the floor every form shares:

- ``cast``: ``Cast(Greater(y, 0))``, as the training graph writes it;
- ``ceil_clip``: ``Ceil(Clip(y, 0, 1))``, a vectorized form (0 where ``y`` is NaN, which is
  why :func:`traingraph.runtime.rewrites.specialize.for_cpu` keeps ``cast``);
- ``where``: ``Where(Greater(y, 0), g, 0)`` in place of the product.

Every form's result is checked equal to ``cast``'s.

Usage:
    python benchmarks/relu_mask_micro.py [--repeats 80] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [(32, 16, 32, 32), (64, 6, 28, 28), (32, 32, 16, 16)]


def _session(nodes: list, shape: tuple[int, ...], threads: int) -> ort.InferenceSession:
    constants = {"zero": np.zeros((), np.float32), "one": np.ones((), np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), *nodes],
        "mask",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "g")],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _forms() -> dict[str, list]:
    node = helper.make_node
    return {
        "cast": [node("Greater", ["y", "zero"], ["m"]), node("Cast", ["m"], ["f"], to=1),
                 node("Mul", ["g", "f"], ["dx"])],
        "ceil_clip": [node("Clip", ["y", "zero", "one"], ["c"]), node("Ceil", ["c"], ["f"]),
                      node("Mul", ["g", "f"], ["dx"])],
        "where": [node("Greater", ["y", "zero"], ["m"]), node("Where", ["m", "g", "zero"], ["dx"])],
        "relu_only": [node("Mul", ["g", "y"], ["dx"])],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, median ms of {args.repeats}")
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in ("x", "g")}
        sessions = {k: _session(nodes, shape, args.threads) for k, nodes in _forms().items()}
        reference = sessions["cast"].run(None, feeds)[0]
        for name in ("ceil_clip", "where"):
            np.testing.assert_array_equal(sessions[name].run(None, feeds)[0], reference)
        times: dict[str, list[float]] = {k: [] for k in sessions}
        for _ in range(args.repeats):  # the forms take turns
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        medians = "  ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in times.items())
        print(f"{'x'.join(map(str, shape)):>12}  {medians}")


if __name__ == "__main__":
    main()
