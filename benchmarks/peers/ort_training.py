"""onnxruntime-training 1.19.2: its own artifacts from the cached ONNX export.

Runs in an environment with ``onnxruntime-training-cpu==1.19.2`` (``benchmarks/run.py
--setup-envs`` creates it). Its artifacts are written once per entry, in a child process
(``common.cached_build``).
Its optimizer types are AdamW and plain SGD: the SGD-momentum model (LeNet) runs with plain
SGD here, which is reported in the result (``optimizer``, ``optimizer_differs``): only its
first loss compares with the other systems.
Config keys: ``threads`` (intra-op threads; 0: one per core; ``--threads`` sets it too).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cached_build, load_entry, parse_args, report, timed_loop

ORT_MAX_IR_VERSION = 10  # the newest IR version onnxruntime 1.19.2 loads
OPTIONAL_OUTPUTS = {"Dropout": ("mask",), "LayerNormalization": ("mean", "inv_std_dev")}


def _classes_last(model: Any) -> None:
    """Logits ``(N, C, T)`` become ``(N * T, C)``: the labels of onnxruntime-training's
    CrossEntropyLoss take the logits' shape without its last axis. The mean loss is the same
    (the runner flattens the labels to match)."""
    from onnx import TensorProto, helper

    output = model.graph.output[0]
    dims = output.type.tensor_type.shape.dim
    if len(dims) != 3:
        return
    name, n, c, t = output.name, dims[0].dim_value, dims[1].dim_value, dims[2].dim_value
    model.graph.node.extend(
        [
            helper.make_node("Transpose", [name], [f"{name}_ntc"], perm=[0, 2, 1]),
            helper.make_node(
                "Constant",
                [],
                [f"{name}_shape"],
                value=helper.make_tensor(f"{name}_shape", TensorProto.INT64, [2], [-1, c]),
            ),
            helper.make_node("Reshape", [f"{name}_ntc", f"{name}_shape"], [f"{name}_flat"]),
        ]
    )
    model.graph.output.remove(output)
    model.graph.output.append(
        helper.make_tensor_value_info(f"{name}_flat", TensorProto.FLOAT, [n * t, c])
    )


def write_artifacts(entry: Path, meta: dict, directory: Path) -> None:
    """onnxruntime-training's artifacts of the cached export ``entry``, its optimizer from
    ``meta`` (AdamW, or plain SGD), saved at the newest IR version that it loads."""
    import onnx
    from onnxruntime.training import artifacts

    directory.mkdir(parents=True)
    model = onnx.load(entry / "model.onnx")
    for node in model.graph.node:  # its gradient builder reads these optional outputs
        for extra in OPTIONAL_OUTPUTS.get(node.op_type, ())[len(node.output) - 1 :]:
            node.output.append(f"{node.output[0]}_{extra}")
    _classes_last(model)
    trainable = meta["trainable"]
    frozen = [i.name for i in model.graph.initializer if i.name not in trainable]
    kind = artifacts.OptimType.SGD if meta["optimizer"] == "sgd" else artifacts.OptimType.AdamW
    artifacts.generate_artifacts(
        model,
        requires_grad=trainable,
        frozen_params=frozen,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=kind,
        artifact_directory=directory,
    )
    for path in directory.glob("*.onnx"):
        proto = onnx.load(path)
        proto.ir_version = min(proto.ir_version, ORT_MAX_IR_VERSION)
        onnx.save(proto, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    config = json.loads(args.config)
    meta, _, data = load_entry(args.entry)
    name = f"onnxruntime-training-{importlib.metadata.version('onnxruntime-training-cpu')}"
    directory = cached_build(args.entry, name, None, write_artifacts, args.entry, meta)
    import numpy as np
    from onnxruntime import SessionOptions
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    options = SessionOptions()
    threads = int(config.get("threads") or args.threads)
    if threads:
        options.intra_op_num_threads = threads
    module = api.Module(
        str(directory / "training_model.onnx"), state, None, "cpu", session_options=options
    )
    optimizer = api.Optimizer(str(directory / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(meta["lr"])
    module.train()

    def step(x, y):
        loss = module(x, y.astype(np.int64).reshape(-1) if y.ndim > 1 else y.astype(np.int64))
        optimizer.step()
        module.lazy_reset_grad()
        return loss

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args)
    report(
        "ort_training",
        meta,
        times,
        losses,
        setup,
        config=config,
        optimizer="sgd (no momentum)" if meta["optimizer"] == "sgd" else "adamw",
        optimizer_differs=meta["optimizer"] == "sgd",
    )


if __name__ == "__main__":
    main()
