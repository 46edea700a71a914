"""Migrating from onnxruntime-training: the same training code, with the imports changed.

Run: python examples/migrate_from_onnxruntime_training.py

The code below is a classic onnxruntime-training loop. Only the two imports differ:

    from onnxruntime.training import artifacts                            # before
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from traingraph import artifacts                                      # after
    from traingraph.api import CheckpointState, Module, Optimizer
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from traingraph import artifacts
from traingraph.api import CheckpointState, LinearLRScheduler, Module, Optimizer
from traingraph.datasets import load_digits


def logistic_regression() -> onnx.ModelProto:
    """A linear classifier on flattened 8x8 images, built with onnx.helper."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(
        (rng.standard_normal((64, 10)) * 0.01).astype(np.float32), "weight"
    )
    bias = numpy_helper.from_array(np.zeros(10, np.float32), "bias")
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["images"], ["flat"]),
            helper.make_node("MatMul", ["flat", "weight"], ["scores"]),
            helper.make_node("Add", ["scores", "bias"], ["logits"]),
        ],
        "logistic_regression",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[weight, bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main(out: Path) -> None:
    artifacts.generate_artifacts(
        logistic_regression(),
        requires_grad=["weight", "bias"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=out,
    )
    state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
    model = Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    optimizer = Optimizer(str(out / "optimizer_model.onnx"), model)

    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    batch_size, epochs = 32, 10
    steps = epochs * (len(x_train) // batch_size)
    scheduler = LinearLRScheduler(optimizer, warmup_step_count=20, total_step_count=steps,
                                  initial_lr=0.02)  # fmt: skip
    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        model.train()
        order = rng.permutation(len(x_train))
        for i in range(len(x_train) // batch_size):
            index = order[i * batch_size : (i + 1) * batch_size]
            loss = model(x_train[index], y_train[index])
            optimizer.step()
            scheduler.step()
            model.lazy_reset_grad()
        model.eval()
        print(f"epoch {epoch + 1}: train loss {float(loss):.4f},"
              f" test loss {float(model(x_test, y_test)):.4f}")  # fmt: skip

    state.properties["epochs"] = epochs
    CheckpointState.save_checkpoint(state, str(out / "trained.ckpt"), include_optimizer_state=True)
    model.export_model_for_inferencing(str(out / "inference.onnx"), ["logits"])

    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "inference.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x_test})
    print(f"test accuracy: {np.mean(np.argmax(logits, axis=1) == y_test):.2%}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
