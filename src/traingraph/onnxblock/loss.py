"""Loss blocks: onnxblock's names and arguments over :mod:`traingraph.losses`.

Each block adds its label input where the model has none by that name (``target`` or
``labels``, as onnxruntime names them), then builds the loss of the same-named
:mod:`traingraph.losses` class, so the loss equals its ``torch.nn`` namesake.

Example:
    >>> with onnxblock.base(model) as accessor:
    ...     loss_name = onnxblock.loss.MSELoss(reduction="sum")("output-0")
    >>> [i.name for i in accessor.model.graph.input]  # the model's inputs, then "target"
"""

from __future__ import annotations

from typing import Any, ClassVar

import onnx
import onnx_ir as ir

from traingraph import losses
from traingraph.ir.builder import OpBuilder
from traingraph.onnxblock import graph_utils
from traingraph.onnxblock.blocks import Block, InputLike

__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "MSELoss"]


class _LossBlock(Block):
    """A block that applies the :class:`traingraph.losses.Loss` ``self.loss`` to one tensor."""

    loss: losses.Loss

    def _apply(self, input_name: str, label_name: str) -> str:
        def build(b: OpBuilder, values: list[ir.Value]) -> list[ir.Value]:
            return [self.loss.build(b, values[:1], values[1:])]

        [value] = graph_utils.splice(self.base, [input_name, label_name], build, prefix="loss")
        return value.name or ""


class _TargetLossBlock(_LossBlock):
    """A loss block whose label ``target`` is shaped like the prediction."""

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        """Add the loss of ``loss_input_name`` against ``target_name`` (a new input like the
        prediction where the model has no such tensor); return the loss's name."""
        if not graph_utils.node_arg_exists(self.base, target_name):
            target_name = InputLike(loss_input_name)(target_name)
        return self._apply(loss_input_name, target_name)


class _ReductionLossBlock(_TargetLossBlock):
    """A target loss block whose one argument, ``reduction``, goes to :attr:`loss_type`."""

    loss_type: ClassVar[type[losses.MSELoss | losses.L1Loss]]

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.loss = self.loss_type(reduction=reduction)


class MSELoss(_ReductionLossBlock):
    """Mean squared error, as ``torch.nn.MSELoss`` (:class:`traingraph.losses.MSELoss`).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    loss_type = losses.MSELoss


class L1Loss(_ReductionLossBlock):
    """Mean absolute error, as ``torch.nn.L1Loss`` (:class:`traingraph.losses.L1Loss`).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    loss_type = losses.L1Loss


class BCEWithLogitsLoss(_TargetLossBlock):
    """Binary cross-entropy of logits, as ``torch.nn.BCEWithLogitsLoss``
    (:class:`traingraph.losses.BCEWithLogitsLoss`).

    Args:
        weight: Optional weight that broadcasts against the output (an array).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        pos_weight: Optional weight of the positive examples, along the last dimension.
    """

    def __init__(self, weight: Any = None, reduction: str = "mean", pos_weight: Any = None) -> None:
        super().__init__()
        self.loss = losses.BCEWithLogitsLoss(
            weight=weight, reduction=reduction, pos_weight=pos_weight
        )


class CrossEntropyLoss(_LossBlock):
    """Cross-entropy of logits against class indices, as ``torch.nn.CrossEntropyLoss``
    (:class:`traingraph.losses.CrossEntropyLoss`).

    Args:
        weight: Optional class weights (a 1-D array of one weight per class).
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: A label value that contributes neither loss nor gradient (None: every
            label counts).
    """

    def __init__(
        self, weight: Any = None, reduction: str = "mean", ignore_index: int | None = None
    ) -> None:
        super().__init__()
        self.loss = losses.CrossEntropyLoss(
            weight=weight,
            reduction=reduction,
            ignore_index=-100 if ignore_index is None else ignore_index,
        )

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        """Add the loss of the logits ``scores_input_name`` (N, C, ...) against the int64 class
        indices ``labels_name`` (a new input of shape (N, ...) where the model has no such
        tensor); return the loss's name."""
        if not graph_utils.node_arg_exists(self.base, labels_name):
            self._add_labels(scores_input_name, labels_name)
        return self._apply(scores_input_name, labels_name)

    def _add_labels(self, scores_name: str, labels_name: str) -> None:
        info = graph_utils.typed_value_info(self.base, scores_name)
        dims = None
        if info is not None and info.type.tensor_type.HasField("shape"):
            shape = info.type.tensor_type.shape.dim
            dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in shape]
            del dims[1:2]
        self.base.graph.input.append(
            onnx.helper.make_tensor_value_info(labels_name, onnx.TensorProto.INT64, dims)
        )
