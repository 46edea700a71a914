"""onnxruntime-training's block-building API (``onnxruntime.training.onnxblock``) over
traingraph's autodiff, losses and optimizers.

Migrating means changing the import, ``import traingraph.onnxblock as onnxblock``; the blocks
build default-domain ONNX graphs that stock onnxruntime runs (see docs/migrating.md for what
differs).

Example:
    >>> import traingraph.onnxblock as onnxblock
    >>> class Training(onnxblock.TrainingBlock):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.loss = onnxblock.loss.MSELoss()
    ...
    ...     def build(self, output_name):
    ...         return self.loss(output_name)
    >>> block = Training()
    >>> block.requires_grad("fc.weight")
    >>> with onnxblock.base(model):
    ...     block(model.graph.output[0].name)
    >>> training_model, eval_model = block.to_model_proto()
"""

from traingraph.onnxblock import blocks, loss, optim
from traingraph.onnxblock.blocks import Block
from traingraph.onnxblock.checkpoint_utils import load_checkpoint_to_model, save_checkpoint
from traingraph.onnxblock.model_accessor import base, custom_op_library, empty_base
from traingraph.onnxblock.onnxblock import ForwardBlock, TrainingBlock

__all__ = [
    "Block",
    "ForwardBlock",
    "TrainingBlock",
    "base",
    "blocks",
    "custom_op_library",
    "empty_base",
    "load_checkpoint_to_model",
    "loss",
    "optim",
    "save_checkpoint",
]
