"""Train a small CNN on the embedded 8x8 digits with the graph API, then export it.

Run: python examples/graph_api_cnn.py
"""

from __future__ import annotations

import numpy as np

import traingraph as tg
from traingraph import layers as L
from traingraph.datasets import load_digits
from traingraph.graph import Batch, CompileOptions, InferenceGraph, InputPipeline, init


def build() -> tuple[tg.Graph, tg.graph.Tensor]:
    init.manual_seed(0)
    g = tg.Graph("digits")
    x = g.input("x", shape=[None, 1, 8, 8])
    h = L.ReLU()(L.BatchNorm2d(16)(L.Conv2d(1, 16, 3, padding=1)(x)))
    h = L.MaxPool2d(2)(h)
    h = L.ReLU()(L.Conv2d(16, 32, 3, padding=1)(h))
    h = L.GlobalAvgPool(flatten=True)(h)
    g.output("logits", L.Linear(32, 10)(L.Dropout(0.1)(h)))
    return g, x


def main() -> None:
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    g, x = build()
    train = tg.TrainingGraph(
        [g], loss=tg.losses.CrossEntropyLoss(), optimizer=tg.optim.AdamW(lr=1e-2)
    )
    train.add_inputs({"x": x}, loss_labels={"y": tg.TensorSpec([None], "int64")})
    train.compile("cpu", CompileOptions(profile=True))
    rng = np.random.default_rng(0)
    for epoch in range(15):
        order = rng.permutation(len(y_train))
        chunks = [order[i : i + 64] for i in range(0, len(order), 64)]
        pipe = InputPipeline(chunks, lambda idx: Batch({"x": x_train[idx]}, {"y": y_train[idx]}))
        results = pipe.run(train, max_in_flight=2)
        times = {k: sum(r.times[k] for r in results) for k in results[0].times}
        print(f"epoch {epoch}: loss {np.mean([float(r.loss) for r in results]):.4f}", times)
    print("device memory for a batch of 64:", train.memory_plan(64).total, "bytes")
    infer = InferenceGraph([g]).compile("cpu")
    infer.set_parameters(train.synchronize_updates())
    logits = infer.execute({"x": x_test}).outputs["logits"]
    print(f"test accuracy: {(logits.argmax(1) == y_test).mean():.3f}")
    train.export_inference("digits_cnn.onnx")


if __name__ == "__main__":
    main()
