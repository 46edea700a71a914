"""onnxblock loss and optimizer blocks as arguments of
:func:`traingraph.artifacts.generate_artifacts`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import onnx
import onnx_ir as ir

from traingraph.errors import ModelError
from traingraph.onnxblock import graph_utils
from traingraph.onnxblock.blocks import Block
from traingraph.onnxblock.model_accessor import base
from traingraph.onnxblock.onnxblock import TrainingBlock, output_names, with_shapes
from traingraph.onnxblock.optim import OptimizerBlock

__all__ = ["block_arguments"]


def block_arguments(
    model: Any, loss: Any, optimizer: Any, loss_input_names: Sequence[str] | None
) -> tuple[Any, Any, Any, Sequence[str] | None]:
    """``(model, loss, optimizer, loss_input_names)`` for :func:`traingraph.program.build_program`
    where ``loss`` or ``optimizer`` is an onnxblock block (other values pass through).

    A loss block is applied to ``model``'s outputs (or ``loss_input_names``): the model returned
    has the block's loss as its only output, so the loss becomes None. An onnxblock optimizer
    becomes the :mod:`traingraph.optim` optimizer it stands for.

    Raises:
        ModelError: The optimizer is a block other than :mod:`traingraph.onnxblock.optim`'s, or
            the loss is a ``TrainingBlock`` (which builds its own gradients).
    """
    if isinstance(optimizer, Block):
        if not isinstance(optimizer, OptimizerBlock):
            raise ModelError(
                f"optimizer {type(optimizer).__name__} is an onnxblock block but not one of"
                " onnxblock.optim's (AdamW, SGD); traingraph builds the optimizer model from a"
                " traingraph.optim chain. Pass a traingraph.optim.Optimizer, e.g."
                " traingraph.optim.Optimizer(name, lr, chain(...)), for a custom update."
            )
        optimizer = optimizer.optimizer
    if isinstance(loss, Block):
        if isinstance(loss, TrainingBlock):
            raise ModelError(
                f"loss {type(loss).__name__} is a TrainingBlock, which builds its own training"
                " model; pass a Block or ForwardBlock that returns the loss's name"
            )
        model = _apply_loss(_as_proto(model), loss, loss_input_names)
        loss, loss_input_names = None, None
    return model, loss, optimizer, loss_input_names


def _as_proto(model: Any) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model))
    raise ModelError(
        f"a loss block needs the model as a path, an onnx.ModelProto or an onnx_ir.Model; got"
        f" {type(model).__name__}"
    )


def _apply_loss(
    model: onnx.ModelProto, loss: Block, loss_input_names: Sequence[str] | None
) -> onnx.ModelProto:
    with base(model) as accessor:
        names = list(loss_input_names or [o.name for o in accessor.model.graph.output])
        output = output_names(loss(*names))[0]
        result = with_shapes(accessor.model)
    info = graph_utils.find_value_info(result, output)
    dims = info.type.tensor_type.shape.dim if info is not None else ()
    if dims and all(d.HasField("dim_value") and d.dim_value == 1 for d in dims):
        # A loss of shape [1] (blocks.Constant's shape) or [1, 1]: the training loss's scalar.
        [scalar] = graph_utils.splice(
            result, [output], lambda b, v: [b.Reshape(v[0], b.ints([]))], prefix="loss"
        )
        output = scalar.name or ""
        result = with_shapes(result)
    graph_utils.register_graph_outputs(result, [output])
    return result
