"""Gradients of the ONNX loss ops: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both pick one log-probability per element: with ``lp`` the log-probabilities ``(N, C, d1, ...)``,
``t`` the labels ``(N, d1, ...)``, ``w`` the optional class weights and ``v_i`` zero where the
label is ``ignore_index``,

    loss_i = -w[t_i] * v_i * lp[i, t_i]

reduced by ``none`` (per element), ``sum``, or ``mean`` (divided by ``D = sum_i w[t_i] * v_i``).
With ``onehot[i, c] = v_i * [t_i == c]`` and ``G_i`` the incoming gradient spread over the
elements (``G / D`` for ``mean``),

    dL/dlp = -onehot * w * G_i.

For SoftmaxCrossEntropyLoss ``lp = log_softmax(scores, axis=1)``, whose gradient is
``dL/dscores = u - softmax * sum_c(u)`` for ``u = dL/dlp`` (including the gradient of the
optional ``log_prob`` output). The weights' gradient is ``dL/dw[c] = sum_i onehot[i, c] * G_i *
(nll_i - [mean] * L)`` with ``nll_i = -lp[i, t_i]`` and ``L`` the reduced loss. When every
label of a ``mean`` loss is ignored, ``D = 0`` and the gradient is NaN, like the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.context import GradContext
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import OpBuilder, rank

Grads = Sequence[ir.Value | None]

_REDUCTIONS = ("none", "sum", "mean")


def _along_classes(b: OpBuilder, v: ir.Value, r: int) -> ir.Value:
    """Reshape a ``(C,)`` tensor to ``(1, C, 1, ...)`` of rank ``r``."""
    return b.Reshape(v, b.ints([1, -1] + [1] * (r - 2)))


def _label_onehot(ctx: GradContext, r: int) -> ir.Value:
    """``onehot[i, c] = [t_i == c] * [t_i != ignore_index]``, shaped and typed like input 0."""
    b, x = ctx.b, ctx.x(0)
    labels = ctx.x(1)
    if labels.dtype != ir.DataType.INT64:
        labels = b.cast(labels, ir.DataType.INT64)
    labels = b.unsqueeze(labels, [1])
    num_classes = x.shape.dims[1] if x.shape is not None else None
    if isinstance(num_classes, int):
        classes = b.const(np.arange(num_classes, dtype=np.int64).reshape([1, -1] + [1] * (r - 2)))
    else:
        zero, one = b.const(np.int64(0)), b.const(np.int64(1))
        count = b.squeeze(b.shape(x, 1, 2), [0])
        classes = _along_classes(b, b.op("Range", zero, count, one), r)
    onehot = b.Equal(labels, classes)
    ignore_index = ctx.attr("ignore_index")
    if ignore_index is not None:
        kept = b.Not(b.Equal(labels, b.const(np.int64(ignore_index))))
        onehot = b.And(onehot, kept)
    return b.cast_like(onehot, x)


def _log_prob_gradient(
    ctx: GradContext, grads: Grads, lp: ir.Value
) -> tuple[ir.Value | None, ir.Value | None]:
    """``(dL/dlp, dL/dweights)`` from the gradient of the loss output.

    ``lp`` holds the log-probabilities (the node's input 0 or computed from it).
    """
    b, g = ctx.b, grads[0]
    if g is None:
        return None, None
    reduction = ctx.attr("reduction", "mean")
    if reduction not in _REDUCTIONS:
        ctx.unsupported(f"reduction={reduction!r}; expected one of {_REDUCTIONS}")
    r = rank(ctx.x(0))
    if r is None or r < 2:
        ctx.unsupported(f"input 0 has rank {r}; expected a known rank of at least 2")
    onehot = _label_onehot(ctx, r)
    weighted = onehot
    if ctx.has_input(2):
        weighted = b.Mul(onehot, _along_classes(b, ctx.x(2), r))
    if reduction == "none":
        spread = b.unsqueeze(g, [1])
    elif reduction == "sum":
        spread = g
    else:
        spread = b.Div(g, b.sum(weighted, keepdims=False))
    d_lp = b.Neg(b.Mul(weighted, spread))
    d_weights = None
    if ctx.need(2):
        nll = b.Neg(b.sum(b.Mul(onehot, lp), [1]))
        if reduction == "mean":
            nll = b.Sub(nll, ctx.outputs[0])
        d_weights = b.sum(b.Mul(onehot, b.Mul(spread, nll)), [0, *range(2, r)], keepdims=False)
    return d_lp, d_weights


@register_gradient("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """NegativeLogLikelihoodLoss: the input holds the log-probabilities."""
    d_input, d_weights = _log_prob_gradient(ctx, grads, ctx.x(0))
    return [d_input if ctx.need(0) else None, None, d_weights][: len(ctx.inputs)]


@register_gradient("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """SoftmaxCrossEntropyLoss, with the optional ``log_prob`` output."""
    b = ctx.b
    has_log_prob = len(ctx.outputs) > 1 and bool(ctx.outputs[1].name)
    lp = ctx.outputs[1] if has_log_prob else b.LogSoftmax(ctx.x(0), axis=1)
    d_lp, d_weights = _log_prob_gradient(ctx, grads, lp)
    g_log_prob = grads[1] if len(grads) > 1 else None
    if g_log_prob is not None:
        d_lp = g_log_prob if d_lp is None else b.Add(d_lp, g_log_prob)
    d_scores = None
    if ctx.need(0) and d_lp is not None:
        softmax = b.Exp(lp)
        d_scores = b.Sub(d_lp, b.Mul(softmax, b.sum(d_lp, [1])))
    return [d_scores, None, d_weights][: len(ctx.inputs)]
