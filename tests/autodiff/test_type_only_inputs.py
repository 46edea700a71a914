"""A value read only as CastLike's type input carries no gradient into the graph.

A ReLU6 exported by torch's dynamo exporter is ``Clip(x, CastLike(0, x), CastLike(6, x))``:
the bounds are constants, so the Clip gradient needs only the mask of ``x`` between them, not
the bounds' own gradients (each a Where and a sum over the whole activation).
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from gradcheck import session
from traingraph.autodiff import build_gradient_graph
from traingraph.ir.model import max_ir_version

D = TensorProto.DOUBLE


def _clip_model() -> object:
    """``loss = sum(Clip(x * w, CastLike(lo, x), CastLike(hi, x)))``, ``lo``, ``hi`` constants."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["xw"]),
        helper.make_node("CastLike", ["lo", "xw"], ["lo_cast"]),
        helper.make_node("CastLike", ["hi", "xw"], ["hi_cast"]),
        helper.make_node("Clip", ["xw", "lo_cast", "hi_cast"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info("x", D, [4, 5])],
        [helper.make_tensor_value_info("loss", D, [])],
        initializer=[
            numpy_helper.from_array(np.ones(5), "w"),
            numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
            numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
        ],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )


def test_clip_bounds_cast_like_the_input_get_no_gradient() -> None:
    grad_model = build_gradient_graph(_clip_model(), wrt=["w"])
    ops = [n.op_type for n in grad_model.graph.node]
    assert ops.count("Where") == 1, ops  # the mask of x only; no bound gradients
    x = np.linspace(-3.0, 9.0, 20).reshape(4, 5)
    x[0, 0], x[0, 1], x[1, 0] = np.nan, np.inf, 6.0
    outs = session(grad_model).run(None, {"x": x})
    got = dict(zip([o.name for o in grad_model.graph.output], outs))["w_grad"]
    tx = torch.tensor(x)
    w = torch.ones(5, dtype=torch.float64, requires_grad=True)
    torch.clamp(tx * w, 0.0, 6.0).sum().backward()
    assert w.grad is not None
    np.testing.assert_allclose(got, w.grad.numpy(), rtol=1e-12, equal_nan=True)
