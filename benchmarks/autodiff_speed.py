"""Time :func:`traingraph.autodiff.build_gradient_graph` on a BERT-base-sized encoder graph.

The graph is written with ``onnx.helper`` the way the TorchScript exporter writes BERT at opset
14: decomposed LayerNorm and GELU, run-time reshape targets built from ``Shape``/``Gather``/
``Concat``, an additive attention mask and a mean-squared-error loss on the last hidden state.
Twelve layers of hidden size 768, 12 heads and feed-forward size 3072 give about 1,000 nodes.
The weights are uniform in [-0.02, 0.02] and the vocabulary is small, which keeps the build quick
without changing the graph that is differentiated.

Usage:
    python benchmarks/autodiff_speed.py [--layers 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from traingraph.autodiff import build_gradient_graph


class _GraphWriter:
    """Collects nodes and initializers with generated names."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.rng = rng
        self.count = 0

    def op(self, op_type: str, *inputs: str, **attrs: object) -> str:
        self.count += 1
        out = f"{op_type.lower()}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def weight(self, name: str, *shape: int, fill: float | None = None) -> str:
        if fill is None:
            value = self.rng.random(shape, dtype=np.float32)
            value -= 0.5
            value *= 0.04
        else:
            value = np.full(shape, fill, np.float32)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def linear(self, x: str, name: str, n_in: int, n_out: int) -> str:
        w = self.weight(f"{name}.weight", n_in, n_out)
        b = self.weight(f"{name}.bias", n_out, fill=0.0)
        return self.op("Add", self.op("MatMul", x, w), b)

    def layer_norm(self, x: str, name: str, hidden: int) -> str:
        mean = self.op("ReduceMean", x, axes=[-1])
        centered = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", centered, "two"), axes=[-1])
        std = self.op("Sqrt", self.op("Add", var, "eps"))
        normed = self.op("Div", centered, std)
        gamma = self.weight(f"{name}.weight", hidden, fill=1.0)
        beta = self.weight(f"{name}.bias", hidden, fill=0.0)
        return self.op("Add", self.op("Mul", normed, gamma), beta)

    def gelu(self, x: str) -> str:
        erf = self.op("Erf", self.op("Div", x, "sqrt2"))
        return self.op("Mul", self.op("Mul", x, self.op("Add", erf, "one")), "half")

    def split_heads(self, x: str) -> str:
        """``[batch, seq, hidden]`` to ``[batch, heads, seq, head_dim]``."""
        split = self.op("Reshape", x, self.shape_of(x, "heads_dims"))
        return self.op("Transpose", split, perm=[0, 2, 1, 3])

    def shape_of(self, x: str, *tail: str) -> str:
        """``[batch, seq, *tail]`` of ``x`` as a run-time shape."""
        shape = self.op("Shape", x)
        batch = self.op("Unsqueeze", self.op("Gather", shape, "idx0", axis=0), "axis0")
        seq = self.op("Unsqueeze", self.op("Gather", shape, "idx1", axis=0), "axis0")
        return self.op("Concat", batch, seq, *tail, axis=0)


def bert_model(
    layers: int = 12,
    hidden: int = 768,
    heads: int = 12,
    ffn: int = 3072,
    vocab: int = 1024,
    max_positions: int = 512,
    opset: int = 14,
    seed: int = 0,
) -> onnx.ModelProto:
    """A BERT encoder with its loss ``loss = mean((encoder(input_ids) - target)^2)``.

    Inputs: ``input_ids`` int64 ``[batch, seq]``, ``attention_mask`` float ``[batch, 1, 1, seq]``
    (0 to attend, a large negative number to mask) and ``target`` ``[batch, seq, hidden]``.
    """
    w = _GraphWriter(np.random.default_rng(seed))
    head_dim = hidden // heads
    for name, value in {
        "idx0": np.array(0, np.int64),
        "idx1": np.array(1, np.int64),
        "axis0": np.array([0], np.int64),
        "heads_dims": np.array([heads, head_dim], np.int64),
        "hidden_dim": np.array([hidden], np.int64),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-12, np.float32),
        "sqrt2": np.array(np.sqrt(2.0), np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
        "scale": np.array(np.sqrt(head_dim), np.float32),
        "zero_i": np.array([0], np.int64),
    }.items():
        w.const(name, value)

    words = w.op("Gather", w.weight("embeddings.word", vocab, hidden), "input_ids", axis=0)
    seq_len = w.op("Unsqueeze", w.op("Gather", w.op("Shape", "input_ids"), "idx1", axis=0), "axis0")
    position_table = w.weight("embeddings.position", max_positions, hidden)
    positions = w.op("Slice", position_table, "zero_i", seq_len)
    h = w.layer_norm(w.op("Add", words, positions), "embeddings.norm", hidden)

    for i in range(layers):
        p = f"layer.{i}"
        q = w.split_heads(w.linear(h, f"{p}.attention.query", hidden, hidden))
        k = w.split_heads(w.linear(h, f"{p}.attention.key", hidden, hidden))
        v = w.split_heads(w.linear(h, f"{p}.attention.value", hidden, hidden))
        scores = w.op("MatMul", q, w.op("Transpose", k, perm=[0, 1, 3, 2]))
        scores = w.op("Add", w.op("Div", scores, "scale"), "attention_mask")
        context = w.op("MatMul", w.op("Softmax", scores, axis=-1), v)
        context = w.op("Transpose", context, perm=[0, 2, 1, 3])
        context = w.op("Reshape", context, w.shape_of(h, "hidden_dim"))
        attn = w.linear(context, f"{p}.attention.output", hidden, hidden)
        h = w.layer_norm(w.op("Add", attn, h), f"{p}.attention.norm", hidden)
        inner = w.gelu(w.linear(h, f"{p}.intermediate", hidden, ffn))
        out = w.linear(inner, f"{p}.output", ffn, hidden)
        h = w.layer_norm(w.op("Add", out, h), f"{p}.output.norm", hidden)

    diff = w.op("Sub", h, "target")
    w.nodes.append(helper.make_node("ReduceMean", [w.op("Mul", diff, diff)], ["loss"], keepdims=0))
    graph = helper.make_graph(
        w.nodes,
        "bert",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.FLOAT, ["batch", 1, 1, "seq"]
            ),
            helper.make_tensor_value_info("target", TensorProto.FLOAT, ["batch", "seq", hidden]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=w.initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def time_gradient(model: onnx.ModelProto, repeats: int = 3) -> float:
    """The median wall time in seconds of ``build_gradient_graph(model, loss="loss")``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_gradient_graph(model, loss="loss")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    model = bert_model(layers=args.layers)
    built = time.perf_counter() - start
    seconds = time_gradient(model, args.repeats)
    print(
        f"{args.layers}-layer BERT-base graph: {len(model.graph.node)} nodes,"
        f" {len(model.graph.initializer)} initializers, built in {built:.2f} s;"
        f" build_gradient_graph median of {args.repeats}: {seconds:.3f} s"
    )


if __name__ == "__main__":
    main()
