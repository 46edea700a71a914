"""Thin helpers over onnx_ir: the op builder and model loading/saving."""

from traingraph.ir.builder import OpBuilder, is_float, static_shape
from traingraph.ir.model import ModelLike, default_opset, load_ir, save, to_proto

__all__ = [
    "ModelLike",
    "OpBuilder",
    "default_opset",
    "is_float",
    "load_ir",
    "save",
    "static_shape",
    "to_proto",
]
