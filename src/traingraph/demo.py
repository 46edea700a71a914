"""The demo: a small CNN for the embedded 8x8 digits, built directly as an ONNX model.

The model needs neither PyTorch nor a network connection: its graph is written with
``onnx.helper`` and its weights are drawn from a seeded numpy generator, so ``traingraph train``
works right after ``pip install``.

Example:
    >>> from traingraph.demo import digits_cnn
    >>> model = digits_cnn(seed=0)
    >>> [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    (['images'], ['logits'])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CLASSES", "INPUT_NAME", "OPSET", "OUTPUT_NAME", "digits_cnn"]

INPUT_NAME = "images"
OUTPUT_NAME = "logits"
CLASSES = 10
OPSET = 17
IR_VERSION = 8  # the IR version of opset 17


def _he_uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    r"""He uniform initialization for ReLU: :math:`U(-b, b)` with :math:`b = \sqrt{6 / n_{in}}`."""
    bound = np.sqrt(6.0 / fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def digits_cnn(seed: int = 0, channels: tuple[int, int] = (16, 32)) -> onnx.ModelProto:
    """Build the demo CNN for ``[batch, 1, 8, 8]`` images and 10 classes.

    Layers: Conv 3x3 (``channels[0]``) -> ReLU -> MaxPool 2x2 -> Conv 3x3 (``channels[1]``) ->
    ReLU -> MaxPool 2x2 -> Flatten -> Gemm to 10 logits. The batch dimension is dynamic.

    Args:
        seed: Seed of the weight initialization.
        channels: Output channels of the two convolutions.

    Returns:
        The inference model: input ``images`` (float32 ``[batch, 1, 8, 8]``), output ``logits``
        (float32 ``[batch, 10]``), opset 17.
    """
    rng = np.random.default_rng(seed)
    c1, c2 = channels
    features = c2 * 2 * 2
    weights = {
        "conv1.weight": _he_uniform(rng, (c1, 1, 3, 3), 9),
        "conv1.bias": np.zeros(c1, np.float32),
        "conv2.weight": _he_uniform(rng, (c2, c1, 3, 3), c1 * 9),
        "conv2.bias": np.zeros(c2, np.float32),
        "fc.weight": _he_uniform(rng, (CLASSES, features), features) / np.float32(np.sqrt(2.0)),
        "fc.bias": np.zeros(CLASSES, np.float32),
    }
    conv: dict[str, Any] = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    pool: dict[str, Any] = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node(
            "Conv", [INPUT_NAME, "conv1.weight", "conv1.bias"], ["c1"], name="conv1", **conv
        ),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", **pool),
        helper.make_node(
            "Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], name="conv2", **conv
        ),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool2", **pool),
        helper.make_node("Flatten", ["p2"], ["flat"], name="flatten", axis=1),
        helper.make_node(
            "Gemm", ["flat", "fc.weight", "fc.bias"], [OUTPUT_NAME], name="fc", transB=1
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=[numpy_helper.from_array(v, name=k) for k, v in weights.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="traingraph.demo",
    )
    onnx.checker.check_model(model, full_check=True)
    return model
