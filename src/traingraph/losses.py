"""Loss blocks: graph builders that append a loss to a model's outputs.

Each loss follows the semantics of its ``torch.nn`` namesake (same arguments, same defaults,
same reductions) and is built from standard ops that have gradient rules, so the autodiff pass
differentiates it like any other part of the model. Standard losses apply to the model's first
output; :class:`CustomLoss` builds any loss over any outputs.

Example:
    >>> loss = CrossEntropyLoss(label_smoothing=0.1)
    >>> [spec] = loss.label_specs([logits])  # int64 labels of shape (batch,) for (batch, C) logits
    >>> labels = ir.Value(name=spec.name, type=ir.TensorType(spec.dtype), shape=spec.shape)
    >>> value = loss.build(b, [logits], [labels])  # b: an OpBuilder on the logits' graph
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from traingraph.errors import ArgumentTypeError, DataError, ModelError
from traingraph.ir.builder import OpBuilder, is_float

REDUCTIONS = ("none", "mean", "sum")
Values = Sequence[ir.Value]
CLASS_LABELS_KEY = "traingraph.class_labels"
"""Node metadata key of the ``Equal`` node that compares class-index labels with
``ignore_index``; its first input is the labels, its value a JSON object with the number of
classes (null where not static) and the ``ignore_index``."""


@dataclass(frozen=True)
class LabelSpec:
    """One label input that a loss needs.

    Attributes:
        name: Default name of the label input, e.g. ``"labels"``.
        dtype: Element type of the label.
        shape: Shape of the label (it may use the symbolic batch dimension of the output), or
            None when unknown.
    """

    name: str
    dtype: ir.DataType
    shape: ir.Shape | None


class Loss:
    """Base class of the loss blocks.

    A loss says which labels it needs (:meth:`label_specs`) and appends its nodes to a graph
    (:meth:`build`).
    """

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        """The label inputs this loss needs for the model outputs ``outputs``."""
        raise NotImplementedError

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        """Append the loss nodes; return the loss value (a scalar unless ``reduction="none"``)."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- helpers
def _check_reduction(loss: Loss, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ModelError(
            f"{type(loss).__name__}: reduction={reduction!r} is not supported; expected one of"
            f" {', '.join(repr(r) for r in REDUCTIONS)}"
        )


def _first_output(loss: Loss, outputs: Sequence[ir.Value]) -> ir.Value:
    if not outputs:
        raise ModelError(f"{type(loss).__name__} needs a model output to apply to; got none")
    x = outputs[0]
    if not is_float(x):
        raise ModelError(
            f"{type(loss).__name__} applies to a floating-point output; output {x.name!r} has"
            f" dtype {x.dtype}. Apply the loss to float logits or predictions."
        )
    return x


def _check_labels(loss: Loss, labels: Sequence[ir.Value], count: int) -> None:
    if len(labels) != count:
        raise ModelError(
            f"{type(loss).__name__} takes {count} label input(s); got {len(labels)}"
            f" ({[v.name for v in labels]}). Pass one value per entry of label_specs()."
        )


def _reduce(
    b: OpBuilder, x: ir.Value, reduction: str, like: ir.Value, shape: ir.Shape | None
) -> ir.Value:
    """Apply ``reduction`` ("none", "sum" or "mean" over every element) to ``x``.

    The result gets ``like``'s dtype and ``shape`` (the shape of ``x``) or the scalar shape.
    """
    if reduction == "none":
        return _typed(x, like, shape)
    out = b.sum(x, keepdims=False) if reduction == "sum" else b.mean(x, keepdims=False)
    return _typed(out, like, ir.Shape([]))


def _typed(value: ir.Value, like: ir.Value, shape: ir.Shape | None) -> ir.Value:
    """Record ``like``'s dtype and ``shape`` on ``value`` (when it has none)."""
    if value.dtype is None and like.dtype is not None:
        value.dtype = like.dtype
    if value.shape is None and shape is not None:
        value.shape = shape
    return value


def _same_spec(x: ir.Value, name: str = "labels") -> list[LabelSpec]:
    assert x.dtype is not None
    return [LabelSpec(name, x.dtype, x.shape)]


def _as_tuples(value: Any) -> Any:
    """``value`` (a number, list or numpy array, or None) as nested tuples of floats.

    Losses keep their weights as tuples so that they stay immutable, comparable and hashable.
    """
    if value is None:
        return None
    array = np.asarray(value, dtype=np.float64)
    if array.ndim == 0:
        return float(array)
    return tuple(_as_tuples(row) for row in array)


def _as_class_weights(loss: Loss, value: Any) -> tuple[float, ...] | None:
    """``value`` (a list or 1-D numpy array, or None) as a tuple of per-class floats."""
    if value is not None and np.ndim(value) != 1:
        raise ModelError(
            f"{type(loss).__name__}: weight must be a 1-D list or array of one weight per class;"
            f" got shape {np.shape(value)}"
        )
    return _as_tuples(value)


def _class_weights(
    b: OpBuilder, loss: Loss, weight: tuple[float, ...], x: ir.Value, axis: int
) -> ir.Value:
    """The class weights as a constant of ``x``'s dtype, checked against ``x``'s class count."""
    classes = _static_dim(x, axis)
    if classes is not None and len(weight) != classes:
        raise ModelError(
            f"{type(loss).__name__}: weight has {len(weight)} entries but output {x.name!r} has"
            f" {classes} classes (dimension {axis} of shape {x.shape}); pass one weight per class"
        )
    return b.const(np.asarray(weight), like=x, name="class_weight")


def _static_dim(x: ir.Value, axis: int) -> int | None:
    if x.shape is None or len(x.shape) <= axis:
        return None
    dim = x.shape.dims[axis]
    return dim if isinstance(dim, int) else None


def _class_count(b: OpBuilder, x: ir.Value, axis: int = 1) -> ir.Value:
    """The number of classes (dimension ``axis`` of ``x``) as a scalar of ``x``'s dtype."""
    classes = _static_dim(x, axis)
    if classes is not None:
        return b.scalar(float(classes), like=x)
    return b.cast_like(b.squeeze(b.shape(x, axis, axis + 1), [0]), x)


def _class_dims(x: ir.Value, axis: int = 1) -> ir.Shape | None:
    """The shape of ``x`` without its class dimension ``axis``."""
    if x.shape is None:
        return None
    dims = list(x.shape.dims)
    return ir.Shape(dims[:axis] + dims[axis + 1 :])


def _check_class_rank(loss: Loss, x: ir.Value) -> None:
    if x.shape is not None and len(x.shape) < 2:
        raise ModelError(
            f"{type(loss).__name__} expects an output of shape (N, C) or (N, C, d1, ...); output"
            f" {x.name!r} has shape {x.shape}. Reshape it to put the batch first and the classes"
            " second."
        )


def _weights_along_classes(b: OpBuilder, w: ir.Value, x: ir.Value, axis: int = 1) -> ir.Value:
    """Reshape the class weights ``w`` (C,) to broadcast along dimension ``axis`` of ``x``."""
    if x.shape is None:
        raise ModelError(
            f"class weights need the rank of output {x.name!r}, which is unknown; give the output"
            " a shape"
        )
    trailing = len(x.shape) - 1 - axis
    return b.unsqueeze(w, list(range(1, 1 + trailing))) if trailing > 0 else w


def _nll(
    b: OpBuilder,
    logp: ir.Value,
    target: ir.Value,
    x: ir.Value,
    *,
    loss: Loss,
    weight: tuple[float, ...] | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float = 0.0,
    axis: int = 1,
) -> ir.Value:
    r"""Negative log-likelihood of class indices, with torch's weights, ignore_index and smoothing.

    For element :math:`i` with target :math:`t_i`, mask :math:`m_i = [t_i \ne \text{ignore}]`,
    class weights :math:`w` (ones by default), :math:`C` classes and smoothing :math:`\epsilon`:

    .. math::
        \ell_i = m_i \Big((1-\epsilon)\, w_{t_i} (-\log p_{i,t_i})
                 + \frac{\epsilon}{C} \sum_c w_c (-\log p_{i,c})\Big)

    ``mean`` divides :math:`\sum_i \ell_i` by :math:`\sum_i m_i w_{t_i}`.

    The classes lie along ``axis`` of ``logp`` and ``x``; the per-element losses have the
    other axes in their order.
    """
    ignored = b.Equal(target, b.const(np.int64(ignore_index), name="ignore_index"))
    node = ignored.producer()
    if node is not None:
        node.metadata_props[CLASS_LABELS_KEY] = json.dumps(
            {"classes": _static_dim(x, axis), "ignore_index": ignore_index}
        )
    safe_target = b.Where(ignored, b.const(np.int64(0), name="zero_index"), target)
    zero, one = b.scalar(0.0, like=x), b.scalar(1.0, like=x)
    keep = b.Where(ignored, zero, one)
    w = None if weight is None else _class_weights(b, loss, weight, x, axis)
    weight_of_target = keep if w is None else b.Mul(keep, b.Gather(w, safe_target, axis=0))
    picked = b.squeeze(
        b.GatherElements(logp, b.unsqueeze(safe_target, [axis]), axis=axis), [axis]
    )
    per = b.Neg(b.Mul(picked, weight_of_target))
    if label_smoothing > 0.0:
        weighted = logp if w is None else b.Mul(logp, _weights_along_classes(b, w, x, axis))
        smooth = b.Neg(b.Mul(b.sum(weighted, [axis], keepdims=False), keep))
        scale = b.Div(b.scalar(label_smoothing, like=x), _class_count(b, x, axis))
        per = b.Add(b.Mul(per, b.scalar(1.0 - label_smoothing, like=x)), b.Mul(smooth, scale))
    if reduction == "mean":
        total = b.Div(b.sum(per, keepdims=False), b.sum(weight_of_target, keepdims=False))
        return _typed(total, x, ir.Shape([]))
    return _reduce(b, per, reduction, x, _class_dims(x, axis))


def _classes_moved_from_last(x: ir.Value) -> ir.Value | None:
    """``y`` where ``x = Transpose(y, [0, r - 1, 1, ..., r - 2])`` (rank ``r >= 3``): the
    classes of ``x`` (axis 1) are ``y``'s last axis, the other axes in their order; else
    None."""
    node = x.producer()
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    source = node.inputs[0] if node.inputs else None
    perm = node.attributes.get("perm")
    if source is None or source.shape is None or perm is None:
        return None
    rank = len(source.shape)
    moved = [0, rank - 1, *range(1, rank - 1)]
    return source if rank >= 3 and list(perm.as_ints()) == moved else None


@dataclass(frozen=True)
class ClassLabels:
    """The values a class-index label input may hold: ``[0, classes)`` or ``ignore_index``.

    Attributes:
        classes: The number of classes, or None where the model does not fix it.
        ignore_index: The index that contributes neither loss nor gradient.
    """

    classes: int | None
    ignore_index: int

    def check(self, name: str, labels: np.ndarray) -> None:
        """Raise a :class:`~traingraph.errors.DataError` if ``labels`` holds an index outside
        ``[0, classes)`` other than ``ignore_index`` (onnxruntime would fail on an index past
        the classes and read a negative one from the end)."""
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu" or labels.size == 0:
            return
        if labels.min() >= 0 and (self.classes is None or labels.max() < self.classes):
            return  # every step's case: two reductions, no masks
        bad = (labels < 0) & (labels != self.ignore_index)
        if self.classes is not None:
            bad |= labels >= self.classes
        if not bad.any():
            return
        found = np.unique(labels[bad])
        expected = f"[0, {self.classes})" if self.classes is not None else "indices >= 0"
        raise DataError(
            f"labels {name!r} hold {int(bad.sum())} class index(es) out of range (values"
            f" {', '.join(str(v) for v in found[:8])}{', ...' if found.size > 8 else ''});"
            f" expected {expected} or the ignore_index {self.ignore_index}. Map the labels to"
            " 0 .. classes - 1, or give the model's output one entry per class"
        )


def class_labels(model: onnx.ModelProto) -> dict[str, ClassLabels]:
    """The class-index label inputs of a training or eval model and the values each may hold.

    They are read from the nodes that :class:`CrossEntropyLoss` and :class:`NLLLoss` tag with
    :data:`CLASS_LABELS_KEY`; a model built elsewhere has none, and its labels go unchecked.
    """
    inputs = {v.name for v in model.graph.input}
    found: dict[str, ClassLabels] = {}
    for node in model.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        if CLASS_LABELS_KEY not in props or not node.input or node.input[0] not in inputs:
            continue
        try:
            tag = json.loads(props[CLASS_LABELS_KEY])
            classes, ignore = tag["classes"], tag["ignore_index"]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(ignore, int) and (classes is None or isinstance(classes, int)):
            found[node.input[0]] = ClassLabels(classes, ignore)
    return found


# ------------------------------------------------------------------------ regression
@dataclass(frozen=True)
class _ElementwiseLoss(Loss):
    """A loss of the first output against one label of its shape and type, then ``reduction``.

    Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """

    reduction: str = "mean"

    def __post_init__(self) -> None:
        _check_reduction(self, self.reduction)

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        return _same_spec(_first_output(self, outputs))


@dataclass(frozen=True)
class MSELoss(_ElementwiseLoss):
    r"""Mean squared error, as ``torch.nn.MSELoss``: :math:`\ell_i = (x_i - y_i)^2`.

    Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_labels(self, labels, 1)
        d = b.Sub(x, labels[0])
        return _reduce(b, b.Mul(d, d), self.reduction, x, x.shape)


@dataclass(frozen=True)
class L1Loss(_ElementwiseLoss):
    r"""Mean absolute error, as ``torch.nn.L1Loss``: :math:`\ell_i = |x_i - y_i|`.

    Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_labels(self, labels, 1)
        return _reduce(b, b.Abs(b.Sub(x, labels[0])), self.reduction, x, x.shape)


def _quadratic_then_linear(
    b: OpBuilder, x: ir.Value, y: ir.Value, threshold: float, quad_scale: float, lin_scale: float
) -> ir.Value:
    """Elementwise ``quad_scale * d**2 / 2`` where ``|d| < threshold``, else
    ``lin_scale * (|d| - threshold / 2)``, with ``d = x - y``."""
    d = b.Sub(x, y)
    a = b.Abs(d)
    quadratic = b.Mul(b.Mul(d, d), b.scalar(0.5 * quad_scale, like=x))
    linear = b.Mul(b.Sub(a, b.scalar(0.5 * threshold, like=x)), b.scalar(lin_scale, like=x))
    return b.Where(b.Less(a, b.scalar(threshold, like=x)), quadratic, linear)


@dataclass(frozen=True)
class HuberLoss(_ElementwiseLoss):
    r"""Huber loss, as ``torch.nn.HuberLoss``.

    .. math::
        \ell_i = \begin{cases} \tfrac12 d_i^2 & |d_i| < \delta \\
                 \delta(|d_i| - \tfrac12\delta) & \text{otherwise} \end{cases},
        \quad d_i = x_i - y_i

    Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        delta: The threshold :math:`\delta > 0`.
    """

    delta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.delta > 0:
            raise ModelError(f"HuberLoss: delta must be positive; got {self.delta}")

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_labels(self, labels, 1)
        per = _quadratic_then_linear(b, x, labels[0], self.delta, 1.0, self.delta)
        return _reduce(b, per, self.reduction, x, x.shape)


@dataclass(frozen=True)
class SmoothL1Loss(_ElementwiseLoss):
    r"""Smooth L1 loss, as ``torch.nn.SmoothL1Loss``.

    .. math::
        \ell_i = \begin{cases} \tfrac12 d_i^2 / \beta & |d_i| < \beta \\
                 |d_i| - \tfrac12\beta & \text{otherwise} \end{cases},
        \quad d_i = x_i - y_i

    With ``beta=0`` it is the L1 loss.

    Args:
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        beta: The threshold :math:`\beta \ge 0`.
    """

    beta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta >= 0:
            raise ModelError(f"SmoothL1Loss: beta must be non-negative; got {self.beta}")

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_labels(self, labels, 1)
        if self.beta == 0:
            per = b.Abs(b.Sub(x, labels[0]))
        else:
            per = _quadratic_then_linear(b, x, labels[0], self.beta, 1.0 / self.beta, 1.0)
        return _reduce(b, per, self.reduction, x, x.shape)


# -------------------------------------------------------------------- classification
@dataclass(frozen=True)
class CrossEntropyLoss(Loss):
    r"""Cross-entropy of logits, as ``torch.nn.CrossEntropyLoss``.

    The output holds logits of shape (N, C) or (N, C, d1, ...). Labels are either int64 class
    indices of shape (N, d1, ...) or float class probabilities of the logits' shape (the
    build follows the label's dtype; ``probabilities`` chooses what :meth:`label_specs` asks for).
    With :math:`\log p = \mathrm{LogSoftmax}(x)` along the classes:

    - indices: :math:`\ell_i = m_i\big((1-\epsilon) w_{t_i}(-\log p_{i,t_i}) + \frac{\epsilon}{C}
      \sum_c w_c(-\log p_{i,c})\big)`, with :math:`m_i = [t_i \ne \text{ignore\_index}]`;
      ``mean`` divides the sum by :math:`\sum_i m_i w_{t_i}`, exactly as torch.
    - probabilities: :math:`\ell_i = -\sum_c w_c\, q_{i,c} \log p_{i,c}` with
      :math:`q = (1-\epsilon)\,y + \epsilon / C`; ``mean`` divides by the number of elements
      :math:`N d_1 \cdots`.

    Args:
        weight: Optional class weights (a list or 1-D array of C floats).
        ignore_index: Target index that contributes neither loss nor gradient (indices only).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        label_smoothing: :math:`\epsilon \in [0, 1]`.
        probabilities: Whether :meth:`label_specs` asks for class probabilities instead of
            class indices.
    """

    weight: Any = None
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    probabilities: bool = False

    def __post_init__(self) -> None:
        _check_reduction(self, self.reduction)
        object.__setattr__(self, "weight", _as_class_weights(self, self.weight))
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ModelError(
                f"CrossEntropyLoss: label_smoothing must be in [0, 1]; got {self.label_smoothing}"
            )

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        x = _first_output(self, outputs)
        _check_class_rank(self, x)
        if self.probabilities:
            return _same_spec(x)
        return [LabelSpec("labels", ir.DataType.INT64, _class_dims(x))]

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_class_rank(self, x)
        _check_labels(self, labels, 1)
        target = labels[0]
        if target.dtype is not None and is_float(target):
            return self._probabilities(b, x, b.LogSoftmax(x, axis=1), target)
        if target.dtype not in (None, ir.DataType.INT64):
            raise ModelError(
                f"CrossEntropyLoss: label {target.name!r} has dtype {target.dtype}; expected int64"
                " class indices or float class probabilities. Cast the labels to int64."
            )
        # x = Transpose(y) with y's last axis moved to 1 (``logits.transpose(1, 2)``): the same
        # terms from y along its last axis, without the transposed copy, its gradient's
        # transpose back, or a LogSoftmax along an inner axis
        source = _classes_moved_from_last(x)
        if source is not None:
            x, axis = source, len(source.shape or ()) - 1
        else:
            axis = 1
        return _nll(
            b, b.LogSoftmax(x, axis=axis), target, x, loss=self, weight=self.weight,
            ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, axis=axis,
        )

    def _probabilities(
        self, b: OpBuilder, x: ir.Value, logp: ir.Value, target: ir.Value
    ) -> ir.Value:
        q = target
        if self.label_smoothing > 0.0:
            q = b.Add(
                b.Mul(q, b.scalar(1.0 - self.label_smoothing, like=x)),
                b.Div(b.scalar(self.label_smoothing, like=x), _class_count(b, x)),
            )
        terms = b.Mul(logp, q)
        if self.weight is not None:
            w = _class_weights(b, self, self.weight, x, 1)
            terms = b.Mul(terms, _weights_along_classes(b, w, x))
        per = b.Neg(b.sum(terms, [1], keepdims=False))
        return _reduce(b, per, self.reduction, x, _class_dims(x))


@dataclass(frozen=True)
class NLLLoss(Loss):
    r"""Negative log-likelihood of log-probabilities, as ``torch.nn.NLLLoss``.

    The output holds log-probabilities of shape (N, C) or (N, C, d1, ...); labels are int64
    class indices of shape (N, d1, ...). :math:`\ell_i = -m_i w_{t_i} x_{i,t_i}` with
    :math:`m_i = [t_i \ne \text{ignore\_index}]`; ``mean`` divides the sum by
    :math:`\sum_i m_i w_{t_i}`.

    Args:
        weight: Optional class weights (a list or 1-D array of C floats).
        ignore_index: Target index that contributes neither loss nor gradient.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
    """

    weight: Any = None
    ignore_index: int = -100
    reduction: str = "mean"

    def __post_init__(self) -> None:
        _check_reduction(self, self.reduction)
        object.__setattr__(self, "weight", _as_class_weights(self, self.weight))

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        x = _first_output(self, outputs)
        _check_class_rank(self, x)
        return [LabelSpec("labels", ir.DataType.INT64, _class_dims(x))]

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_class_rank(self, x)
        _check_labels(self, labels, 1)
        return _nll(
            b, x, labels[0], x, loss=self, weight=self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction,
        )


@dataclass(frozen=True)
class BCEWithLogitsLoss(Loss):
    r"""Binary cross-entropy of logits, as ``torch.nn.BCEWithLogitsLoss``.

    .. math::
        \ell_i = w_i\big((1 - y_i)\,x_i + (1 + (p - 1)\,y_i)\,\mathrm{softplus}(-x_i)\big)

    with :math:`\mathrm{softplus}(-x) = \max(-x, 0) + \log(1 + e^{-|x|})`, which never
    overflows; its gradient is exact at :math:`x = 0` too.

    Args:
        weight: Optional weight that broadcasts against the output (a list or array).
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"``.
        pos_weight: Optional weight :math:`p` of the positive examples, broadcast along the
            last dimension (a list or array).
    """

    weight: Any = None
    reduction: str = "mean"
    pos_weight: Any = None

    def __post_init__(self) -> None:
        _check_reduction(self, self.reduction)
        for name in ("weight", "pos_weight"):
            object.__setattr__(self, name, _as_tuples(getattr(self, name)))

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        return _same_spec(_first_output(self, outputs))

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        x = _first_output(self, outputs)
        _check_labels(self, labels, 1)
        y = labels[0]
        one = b.scalar(1.0, like=x)
        # softplus(-x) = relu(-x) + log(1 + exp(-|x|)), both pieces selected with one Where so
        # that the gradient at x = 0 is the exact -1/2.
        positive = b.GreaterOrEqual(x, b.scalar(0.0, like=x))
        neg_x = b.Neg(x)
        minus_abs = b.Where(positive, neg_x, x)
        relu_neg = b.Where(positive, b.scalar(0.0, like=x), neg_x)
        softplus_neg = b.Add(relu_neg, b.Log(b.Add(one, b.Exp(minus_abs))))
        shape = x.shape
        if self.pos_weight is not None:
            pos = b.const(np.asarray(self.pos_weight), like=x, name="pos_weight")
            softplus_neg = b.Mul(b.Add(one, b.Mul(b.Sub(pos, one), y)), softplus_neg)
            shape = _broadcast(shape, np.shape(self.pos_weight))
        per = b.Add(b.Mul(b.Sub(one, y), x), softplus_neg)
        if self.weight is not None:
            per = b.Mul(per, b.const(np.asarray(self.weight), like=x, name="weight"))
            shape = _broadcast(shape, np.shape(self.weight))
        return _reduce(b, per, self.reduction, x, shape)


def _broadcast(shape: ir.Shape | None, other: tuple[int, ...]) -> ir.Shape | None:
    """The shape of a tensor of ``shape`` broadcast with a constant of shape ``other``."""
    if shape is None:
        return None
    dims: list[int | ir.SymbolicDim] = [1] * (len(other) - len(shape))
    dims.extend(shape.dims)
    padded = (1,) * (len(dims) - len(other)) + tuple(other)
    return ir.Shape([d if o == 1 else o for d, o in zip(dims, padded)])


# ---------------------------------------------------------------------------- custom
LossFn = Callable[[OpBuilder, Sequence[ir.Value], Sequence[ir.Value]], ir.Value]


@dataclass(frozen=True)
class CustomLoss(Loss):
    """A loss built by a function from graph ops, over any of the model's outputs.

    Args:
        fn: ``fn(b, outputs, labels) -> loss value``; it appends nodes with the builder ``b``.
        labels: The label inputs ``fn`` needs, in the order it receives them.

    Example:
        >>> def two_heads(b, outputs, labels):
        ...     mse = MSELoss().build(b, outputs[:1], labels[:1])
        ...     ce = CrossEntropyLoss().build(b, outputs[1:], labels[1:])
        ...     return b.Add(mse, ce)
        >>> loss = CustomLoss(two_heads, labels=[
        ...     LabelSpec("target", ir.DataType.FLOAT, ir.Shape(["batch", 1])),
        ...     LabelSpec("classes", ir.DataType.INT64, ir.Shape(["batch"])),
        ... ])
    """

    fn: LossFn
    labels: Sequence[LabelSpec] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ArgumentTypeError(
                f"CustomLoss: fn must be callable as fn(b, outputs, labels); got"
                f" {type(self.fn).__name__}"
            )
        object.__setattr__(self, "labels", tuple(self.labels))

    def label_specs(self, outputs: Values) -> list[LabelSpec]:
        return list(self.labels)

    def build(self, b: OpBuilder, outputs: Values, labels: Values) -> ir.Value:
        _check_labels(self, labels, len(self.labels))
        value = self.fn(b, outputs, labels)
        if not isinstance(value, ir.Value):
            raise ArgumentTypeError(
                f"CustomLoss: fn returned {type(value).__name__}; it must return the loss as an"
                " onnx_ir.Value built with the builder it receives"
            )
        return value


__all__ = [
    "REDUCTIONS",
    "BCEWithLogitsLoss",
    "CLASS_LABELS_KEY",
    "ClassLabels",
    "CrossEntropyLoss",
    "CustomLoss",
    "HuberLoss",
    "L1Loss",
    "LabelSpec",
    "Loss",
    "MSELoss",
    "NLLLoss",
    "SmoothL1Loss",
    "class_labels",
]
