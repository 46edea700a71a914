"""Reverse-mode autodiff that writes gradients as default-domain ONNX ops.

Example:
    >>> from traingraph.autodiff import build_gradient_graph
    >>> grad_model = build_gradient_graph("model.onnx", loss="loss")
"""

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.engine import GradientResult, build_gradient_graph, differentiate
from traingraph.autodiff.gradient_op import lower_gradient_ops
from traingraph.autodiff.registry import get_rule, register_gradient, supported_ops

__all__ = [
    "GradContext",
    "GradientResult",
    "build_gradient_graph",
    "differentiate",
    "get_rule",
    "lower_gradient_ops",
    "register_gradient",
    "supported_ops",
]
