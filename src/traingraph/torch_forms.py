"""Differentiable forms of the torch functions that the ONNX exporters write as loops, or
write wrongly, or not at all.

Both exporters write ``torch.nn.functional.embedding_bag`` (``nn.EmbeddingBag``) as a ``Loop``
over the bags, which no gradient rule differentiates. :func:`exportable_forms` makes it, for
the time of an export, a lookup (``F.embedding``: one Gather of the weight) and a reduction of
the looked-up rows: over the second axis of a 2-D input, or, for a 1-D input with offsets, a
product with the ``(bags, lookups)`` matrix that marks each bag's span (``mode="max"``: the
largest value of each bag's span). Padding lookups (``padding_idx``) count in no bag, an empty
bag is zeros, ``per_sample_weights`` scale the rows: the values of torch's kernel.

:func:`traingraph.torch_export.from_torch` exports under it and then checks the exported forward
against the module's own, so a difference in a case this form does not cover is reported, not
trained. With ``mode="max"``, rows that tie for a bag's largest value share its gradient
(``torch.amax``), where torch's kernel gives it to one of them; rows looked up twice in one bag
tie with themselves and get the same total either way. With ``scale_grad_by_freq`` each
lookup's gradient is divided by its row's count among all the lookups, as torch documents and
``F.embedding`` computes; torch's CPU ``embedding_bag`` kernel divides some rows' gradients by
another row's count instead.

``scatter_reduce`` with ``reduce="mean"`` (graph networks' mean aggregation), which the dynamo
exporter writes as another reduction, becomes the sums of one ``scatter_add`` over the counts of
another (positions that no index names keep their value); ``index_reduce``, which neither
exporter converts, becomes the ``scatter_reduce`` of its index spread over the source's shape.
``"amax"`` and ``"amin"`` export as ``ScatterElements`` with ``reduction="max"`` / ``"min"``,
whose gradient (:mod:`traingraph.autodiff.rules.indexing`) shares ties as torch does.

``F.cross_entropy`` of class indices with ``label_smoothing`` (a loss inside the model), which
the dynamo exporter writes without the smoothing and the TorchScript exporter refuses, becomes
the log-softmax, ``nll_loss`` and smoothing term that torch computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from traingraph.errors import ModelError


@contextlib.contextmanager
def exportable_forms(torch: Any) -> Iterator[None]:
    """``torch.nn.functional.embedding_bag`` as lookups and reductions, ``scatter_reduce``
    (and ``index_reduce``) with ``"mean"`` as sums and counts (see the module) while the
    context is open; torch's own functions back after."""
    functional = torch.nn.functional
    original = functional.embedding_bag

    def embedding_bag(
        input: Any,
        weight: Any,
        offsets: Any = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        per_sample_weights: Any = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
    ) -> Any:
        if max_norm is not None:
            raise ModelError(
                f"embedding_bag with max_norm={max_norm} renormalizes the weight's rows in place"
                " on every lookup, which an ONNX graph does not do; set max_norm=None (clip the"
                " rows after each step instead)"
            )
        return _embedding_bag(
            torch, input, weight, offsets, scale_grad_by_freq, mode, per_sample_weights,
            include_last_offset, padding_idx,
        )  # fmt: skip

    cross_entropy = functional.cross_entropy

    def smoothed_cross_entropy(
        input: Any,
        target: Any,
        weight: Any = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> Any:
        plain = (
            label_smoothing <= 0.0 or target.is_floating_point() or input.dim() < 2
            or size_average is not None or reduce is not None
        )  # fmt: skip
        if plain:
            return cross_entropy(
                input, target, weight, size_average, ignore_index, reduce, reduction,
                label_smoothing,
            )  # fmt: skip
        return _smoothed_cross_entropy(
            torch, input, target, weight, ignore_index, reduction, label_smoothing
        )

    tensor = torch.Tensor
    originals = {
        (functional, "embedding_bag"): original,
        (functional, "cross_entropy"): cross_entropy,
        (tensor, "scatter_reduce"): tensor.scatter_reduce,
        (tensor, "scatter_reduce_"): tensor.scatter_reduce_,
        (torch, "scatter_reduce"): torch.scatter_reduce,
        (tensor, "index_reduce"): tensor.index_reduce,
        (tensor, "index_reduce_"): tensor.index_reduce_,
    }
    scatter_reduce = originals[(tensor, "scatter_reduce")]

    def scatter(self: Any, dim: int, index: Any, src: Any, reduce: str, *,
                include_self: bool = True) -> Any:  # fmt: skip
        if reduce == "mean" and self.is_floating_point():
            return _scatter_mean(torch, self, dim, index, src, include_self)
        return scatter_reduce(self, dim, index, src, reduce, include_self=include_self)

    def scatter_(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.copy_(scatter(self, *args, **kwargs))

    def index(self: Any, dim: int, index: Any, source: Any, reduce: str, *,
              include_self: bool = True) -> Any:  # fmt: skip
        dim = dim % max(source.dim(), 1)
        spread = index.view([-1 if i == dim else 1 for i in range(source.dim())])
        return scatter(self, dim, spread.expand_as(source), source, reduce,
                       include_self=include_self)  # fmt: skip

    def index_(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.copy_(index(self, *args, **kwargs))

    replacements = {
        (functional, "embedding_bag"): embedding_bag,
        (functional, "cross_entropy"): smoothed_cross_entropy,
        (tensor, "scatter_reduce"): scatter,
        (tensor, "scatter_reduce_"): scatter_,
        (torch, "scatter_reduce"): scatter,
        (tensor, "index_reduce"): index,
        (tensor, "index_reduce_"): index_,
    }
    own = {key for key in replacements if key[1] in vars(key[0])}  # not inherited ones
    try:
        for (owner, name), replacement in replacements.items():
            setattr(owner, name, replacement)
        yield
    finally:
        for (owner, name), function in originals.items():
            if (owner, name) in own:
                setattr(owner, name, function)
            else:  # torch.Tensor's methods come from its C base: uncover them again
                delattr(owner, name)


def _embedding_bag(
    torch: Any,
    ids: Any,
    weight: Any,
    offsets: Any,
    scale_grad_by_freq: bool,
    mode: str,
    per_sample_weights: Any,
    include_last_offset: bool,
    padding_idx: int | None,
) -> Any:
    if mode not in ("sum", "mean", "max"):
        raise ModelError(f"embedding_bag mode {mode!r}; expected 'sum', 'mean' or 'max'")
    if per_sample_weights is not None and mode != "sum":
        raise ModelError(
            f"embedding_bag takes per_sample_weights with mode='sum' only, got mode={mode!r}"
        )
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    rows = torch.nn.functional.embedding(ids, weight, scale_grad_by_freq=scale_grad_by_freq)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1).to(rows.dtype)
    if ids.dim() == 2:
        if offsets is not None:
            raise ModelError("embedding_bag with a 2-D input takes no offsets (each row is a bag)")
        members = torch.ones_like(ids, dtype=torch.bool)
        if padding_idx is not None:
            members = ids != padding_idx
        return _reduce(torch, rows, members, mode, axis=1)
    if ids.dim() != 1 or offsets is None or offsets.dim() != 1:
        raise ModelError(
            f"embedding_bag takes a 2-D input, or a 1-D input with 1-D offsets; got an input"
            f" of shape {tuple(ids.shape)} and offsets"
            f" {None if offsets is None else tuple(offsets.shape)}"
        )
    positions = torch.arange(ids.shape[0], device=ids.device)
    starts = offsets[:-1] if include_last_offset else offsets
    ends = offsets[1:] if include_last_offset else torch.cat([offsets[1:], positions[-1:] + 1])
    # members[b, j]: lookup j is in bag b
    members = (positions.unsqueeze(0) >= starts.unsqueeze(1)) & (
        positions.unsqueeze(0) < ends.unsqueeze(1)
    )
    if padding_idx is not None:
        members = members & (ids != padding_idx).unsqueeze(0)
    if mode == "max":
        return _reduce(torch, rows.unsqueeze(0), members, mode, axis=1)
    weights = members.to(rows.dtype)
    sums = weights @ rows
    if mode == "sum":
        return sums
    return sums / weights.sum(1, keepdim=True).clamp(min=1)


def _reduce(torch: Any, rows: Any, members: Any, mode: str, axis: int) -> Any:
    """The sum, mean or largest value of ``rows`` over ``axis`` where ``members`` (broadcast
    over the rows' last axis) holds; zeros for a bag without members."""
    mask = members.unsqueeze(-1)
    if mode == "max":
        lowest = torch.finfo(rows.dtype).min
        largest = torch.where(mask, rows, torch.full_like(rows[..., :1, :], lowest)).amax(axis)
        return torch.where(mask.any(axis), largest, torch.zeros_like(largest))
    weights = mask.to(rows.dtype)
    sums = (rows * weights).sum(axis)
    if mode == "sum":
        return sums
    return sums / weights.sum(axis).clamp(min=1)


def _scatter_mean(
    torch: Any, self: Any, dim: int, index: Any, src: Any, include_self: bool
) -> Any:
    """``self.scatter_reduce(dim, index, src, "mean", include_self=include_self)`` as the
    sums of a ``scatter_add`` over the counts of another: positions that no index names keep
    their value."""
    counts = torch.zeros_like(self).scatter_add(dim, index, torch.ones_like(src))
    if include_self:
        return self.scatter_add(dim, index, src) / (counts + 1)
    sums = self.scatter(dim, index, torch.zeros_like(src)).scatter_add(dim, index, src)
    return torch.where(counts > 0, sums / counts.clamp(min=1), self)


def _smoothed_cross_entropy(
    torch: Any,
    logits: Any,
    target: Any,
    weight: Any,
    ignore_index: int,
    reduction: str,
    smoothing: float,
) -> Any:
    """``F.cross_entropy`` of class indices with ``label_smoothing``, as torch computes it:
    ``(1 - s) * nll + s / classes * smooth``, ``smooth`` the (weighted) sum of the negative
    log-probabilities over the classes, zero at ignored targets, reduced as the loss is (the
    mean over the weights of the counted targets)."""
    log_p = torch.log_softmax(logits, 1)
    nll = torch.nn.functional.nll_loss(
        log_p, target, weight=weight, ignore_index=ignore_index, reduction=reduction
    )
    ignored = target == ignore_index
    if weight is not None:
        per_class = weight.view([1, -1] + [1] * (logits.dim() - 2))
        smooth = -(log_p * per_class).sum(1)
    else:
        smooth = -log_p.sum(1)
    smooth = torch.where(ignored, torch.zeros_like(smooth), smooth)
    if reduction == "mean":
        if weight is not None:
            counted = weight[torch.where(ignored, torch.zeros_like(target), target)]
            total = torch.where(ignored, torch.zeros_like(counted), counted).sum()
        else:
            total = (~ignored).sum().to(smooth.dtype)
        smooth = smooth.sum() / total
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1.0 - smoothing) * nll + smooth * (smoothing / logits.shape[1])

