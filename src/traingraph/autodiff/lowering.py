"""Rewrites of forward ops that some runtimes lack into standard ops that every runtime runs.

BatchNormalization in training mode (``training_mode=1``) is refused by onnxruntime's CUDA
kernel from opset 14 on and missing from many other ONNX runtimes, while its inference mode and
the reductions it is made of run everywhere. :func:`lower_training_batch_norm` rewrites it as
what the ONNX specification defines:

    mean = ReduceMean(X),   var = ReduceMean((X - mean)^2)     (over every axis but 1)
    Y = BatchNormalization(X, scale, B, mean, var)              (inference mode)
    running_mean = momentum * input_mean + (1 - momentum) * mean
    running_var = momentum * input_var + (1 - momentum) * var

with one choice, ``running_stats``: ``"onnx"`` is the above; ``"torch"`` updates
``running_var`` with the unbiased batch variance ``var * n / (n - 1)`` (``n`` the values per
channel), as ``torch.nn.BatchNorm*d`` does, so that a model that came from PyTorch ends with
PyTorch's statistics. The normalization uses the biased ``var`` either way, as torch does.
(PyTorch's exporters write ``momentum = 1 - m`` for torch's ``m``, so ``running = (1 - m) *
running + m * batch`` is the formula above.)

The running statistics of all the nodes with one momentum are updated together, as one vector
(``Concat`` -> ``Mul``/``Mul``/``Add`` -> ``Split``), so a model with many BatchNorm layers
runs six small ops for them instead of six per layer; each element is computed as above.

The statistics come from the same helper as the BatchNormalization gradient rule, so in a
training graph the forward and backward statistics are the same nodes to a runtime that merges
common subexpressions.

Example:
    >>> lower_training_batch_norm(model.graph, opset=17)  # doctest: +SKIP
    True
    >>> lower_training_batch_norm(torch_model.graph, 17, "torch")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.rules.normalization import (
    batch_statistics,
    inverse_channel_count,
    statistics_input,
)
from traingraph.autodiff.rules.shape import static_dim
from traingraph.errors import ModelError
from traingraph.ir.builder import OpBuilder, rank, static_shape
from traingraph.ir.fold import constant_value
from traingraph.ir.tags import tagging
from traingraph.ir.transposes import axes_of

_DEFAULT_DOMAINS = ("", "ai.onnx")


def is_training_batch_norm(node: ir.Node) -> bool:
    """Whether ``node`` is a default-domain BatchNormalization with ``training_mode=1``."""
    if node.op_type != "BatchNormalization" or node.domain not in _DEFAULT_DOMAINS:
        return False
    attr = node.attributes.get("training_mode")
    return attr is not None and bool(attr.value)


RUNNING_STATS = ("torch", "onnx")
# Node metadata that sets ``running_stats`` for one BatchNormalization (the graph API's
# torch-like BatchNorm layers write "torch") where the lowering is not given one.
RUNNING_STATS_KEY = "traingraph.running_stats"


def batch_statistics_to_training_mode(b: OpBuilder, node: ir.Node) -> bool:
    """Make ``node`` a training-mode BatchNormalization where it is an inference-mode one whose
    mean and variance are its input's batch statistics, written out as PyTorch's exporters
    write ``F.batch_norm(x, None, None, training=True)`` (a BatchNorm without running
    statistics; a standardized Conv weight, as in NFNets' and BiT's ``StdConv2d``):
    ``ReduceMean(x)`` and ``ReduceMean(d * d)`` with ``d = x - ReduceMean(x, keepdims=1)``,
    over every axis but 1. The node then reads constant running statistics and returns none,
    so it computes the same values, and its gradient is a training-mode BatchNormalization's.
    Returns whether ``node`` was changed; the statistics' nodes stay for the caller to
    remove where nothing else reads them."""
    if node.op_type != "BatchNormalization" or node.domain not in _DEFAULT_DOMAINS:
        return False
    if len(node.inputs) != 5 or is_training_batch_norm(node) or len(node.outputs) > 1:
        return False
    x, scale, mean, var = node.inputs[0], node.inputs[1], node.inputs[3], node.inputs[4]
    r = rank(x) if x is not None else None
    if x is None or scale is None or mean is None or var is None or r is None or r < 2:
        return False
    axes = [0, *range(2, r)]
    if _mean_of(mean, axes, keepdims=False) is not x:
        return False
    square = _mean_of(var, axes, keepdims=False)
    product = square.producer() if square is not None else None
    if product is None or product.op_type != "Mul" or product.inputs[0] is not product.inputs[1]:
        return False
    centered = product.inputs[0].producer() if product.inputs[0] is not None else None
    if centered is None or centered.op_type != "Sub" or centered.inputs[0] is not x:
        return False
    if _mean_of(centered.inputs[1], axes, keepdims=True) is not x:
        return False
    channels = static_dim(x, 1) or (static_shape(scale) or [None])[0]
    if channels is None or mean.dtype is None:
        return False
    dtype = mean.dtype.numpy()
    node.replace_input_with(3, b.const(np.zeros(channels, dtype), mean.dtype))
    node.replace_input_with(4, b.const(np.ones(channels, dtype), mean.dtype))
    node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
    node.resize_outputs(3)  # running statistics that nothing reads: the spec's three outputs
    for out, suffix in zip(node.outputs[1:], ("running_mean", "running_var")):
        out.name = out.name or f"{node.outputs[0].name}_unread_{suffix}"
        out.shape, out.type = ir.Shape([channels]), ir.TensorType(mean.dtype)
    return True


def _mean_of(value: ir.Value | None, axes: list[int], keepdims: bool) -> ir.Value | None:
    """The input of the ReduceMean over ``axes`` (each once, in any order, negative or not) with
    ``keepdims`` that writes ``value``; else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "ReduceMean" or node.domain not in _DEFAULT_DOMAINS:
        return None
    data = node.inputs[0]
    r = rank(data) if data is not None else None
    if data is None or r is None or bool(node.attributes.get_int("keepdims", 1)) != keepdims:
        return None
    given = axes_of(node)
    if given is None or sorted(a % r for a in given) != axes or len(set(given)) != len(axes):
        return None
    return data


def running_stats_default(m: ir.Model) -> str | None:
    """``"torch"`` for a model that PyTorch exported (``producer_name == "pytorch"``, as both
    of its exporters write), else None: each node's :data:`RUNNING_STATS_KEY` metadata, or
    the ONNX specification's update."""
    return "torch" if m.producer_name == "pytorch" else None


def lower_training_batch_norm(
    graph: ir.Graph, opset: int, running_stats: str | None = None
) -> bool:
    """Replace every training-mode BatchNormalization of ``graph`` with standard ops.

    Each node's outputs keep their names (and graph-output places); the node is removed.

    Args:
        graph: The graph, changed in place.
        opset: The graph's default-domain opset (14 or later where training mode exists).
        running_stats: ``"torch"``: the running variance is updated with the unbiased batch
            variance, as ``torch.nn.BatchNorm*d`` does; ``"onnx"``: with the biased one, as
            the ONNX specification says. None: each node's :data:`RUNNING_STATS_KEY`
            metadata, ``"onnx"`` where it has none.

    Returns:
        Whether any node was rewritten.

    Raises:
        ModelError: When the rank of a node's input is unknown, or ``running_stats`` (or a
            node's metadata) is not one of :data:`RUNNING_STATS`.
    """
    b = OpBuilder(graph, opset, prefix="bn_lowered")
    nodes = [node for node in graph if is_training_batch_norm(node)]
    updates: list[_RunningUpdate] = []
    for node in nodes:
        with tagging(b, "batch_norm_forward", node.name or "BatchNormalization"):
            updates += _lower_one(b, node, _running_stats(node, running_stats) == "torch")
    _update_running_statistics(b, updates)
    for node in nodes:
        graph.remove(node, safe=True)
    if nodes:
        graph.sort()
    return bool(nodes)


def _running_stats(node: ir.Node, running_stats: str | None) -> str:
    choice = running_stats or node.metadata_props.get(RUNNING_STATS_KEY, "onnx")
    if choice not in RUNNING_STATS:
        where = "running_stats" if running_stats else f"node {node.name!r}'s {RUNNING_STATS_KEY}"
        raise ModelError(
            f"{where} is {choice!r}; expected one of {RUNNING_STATS}: 'torch' updates the"
            " running variance with the unbiased batch variance, 'onnx' with the biased one"
        )
    return choice


def _lower_one(b: OpBuilder, node: ir.Node, unbiased: bool) -> list[_RunningUpdate]:
    """Append the standard-op form of one training-mode BatchNormalization ``node`` but its
    running-statistics updates, which it returns (with the unbiased batch variance where
    ``unbiased``)."""
    x, scale, bias, mean_in, var_in = (node.inputs[i] for i in range(5))
    assert x is not None and scale is not None and bias is not None
    assert mean_in is not None and var_in is not None
    r = rank(x)
    if r is None or r < 2:
        raise ModelError(
            f"BatchNormalization node {node.name!r} has input {x.name!r} of rank {r}; lowering"
            " training mode needs a known rank of at least 2 (run shape inference first)"
        )
    axes = [0, *range(2, r)]
    eps = node.attributes.get("epsilon")
    momentum_attr = node.attributes.get("momentum")
    momentum = 0.9 if momentum_attr is None else float(momentum_attr.value)
    xs = statistics_input(b, x)
    mean, _, var = batch_statistics(b, xs, axes)
    batch_mean, batch_var = (
        b.squeeze(v, axes) if xs.dtype == like.dtype else b.cast_like(b.squeeze(v, axes), like)
        for v, like in ((mean, mean_in), (var, var_in))
    )
    per_channel = [scale, bias, batch_mean, batch_var]
    if xs is not x:
        # float16 activations, float32 statistics: onnxruntime's kernels take the per-channel
        # inputs in X's type
        stats = [b.squeeze(v, axes) for v in (mean, var)]
        per_channel = [v if v.dtype == x.dtype else b.cast_like(v, x) for v in (scale, bias)]
        per_channel += [b.cast_like(v, x) for v in stats]
    y = b.BatchNormalization(x, *per_channel, epsilon=1e-5 if eps is None else float(eps.value))
    replace_value(node.outputs[0], y)
    running_var = batch_var
    if unbiased:
        running_var = b.Mul(batch_var, _bessel_factor(b, x, scale, batch_var, var_in.dtype))
    pairs = ((mean_in, batch_mean), (var_in, running_var))
    return [
        _RunningUpdate(old, running, batch, momentum)
        for old, (running, batch) in zip(node.outputs[1:], pairs)
        if _used(old)
    ]


def _bessel_factor(
    b: OpBuilder, x: ir.Value, scale: ir.Value, like: ir.Value, dtype: ir.DataType | None
) -> ir.Value:
    """``n / (n - 1)``, ``n`` the values of ``x`` per channel (``scale`` holds one per
    channel), typed like ``like`` (of type ``dtype`` where known): a constant where the shapes
    are static; with a dynamic batch and a known channel count ``C``, ``Size(x) / (Size(x) - C)``
    (four nodes). It reads ``x`` and ``scale``, not the statistics' ReduceMeans, which a runtime
    kernel may write itself (only their Squeezes read them)."""
    dims, c_dims = static_shape(x), static_shape(scale)
    if dims is not None and c_dims is not None:
        n = math.prod(dims) // math.prod(c_dims)
        return b.scalar(n / (n - 1) if n > 1 else math.inf, like)
    if c_dims is not None and dtype is not None:
        size = b.cast(b.op("Size", x), dtype)
        return b.Div(size, b.Sub(size, b.const(float(math.prod(c_dims)), dtype)))
    inverse = b.cast_like(inverse_channel_count(b, x, scale), like)
    one = b.scalar(1.0, like)
    return b.Div(one, b.Sub(one, inverse))


class _RunningUpdate(NamedTuple):
    """``output = momentum * running + (1 - momentum) * batch`` replaces ``output``."""

    output: ir.Value
    running: ir.Value
    batch: ir.Value
    momentum: float


def _update_running_statistics(b: OpBuilder, updates: list[_RunningUpdate]) -> None:
    """Emit ``updates``: those of one momentum and dtype over 1-D statistics of known sizes as
    one update of their concatenation, the others one by one."""
    groups: dict[tuple[float, ir.DataType | None], list[_RunningUpdate]] = {}
    for update in updates:
        groups.setdefault((update.momentum, update.running.dtype), []).append(update)
    for (momentum, _), group in groups.items():
        sizes = [static_shape(u.running) for u in group]
        if len(group) == 1 or any(s is None or len(s) != 1 for s in sizes):
            for u in group:
                replace_value(u.output, _running_update(b, u.running, u.batch, momentum))
            continue
        running = b.Concat(*(u.running for u in group), axis=0)
        batch = b.Concat(*(u.batch for u in group), axis=0)
        parts = b.split(_running_update(b, running, batch, momentum, like=group[0].running),
                        [s[0] for s in sizes if s is not None])  # fmt: skip
        for u, part in zip(group, parts):
            replace_value(u.output, part)


def _running_update(
    b: OpBuilder, running: ir.Value, batch: ir.Value, momentum: float, like: ir.Value | None = None
) -> ir.Value:
    like = like if like is not None else running
    kept = b.Mul(running, b.scalar(momentum, like))
    return b.Add(kept, b.Mul(batch, b.scalar(1.0 - momentum, like)))


def split_sequences(graph: ir.Graph, opset: int) -> bool:
    """Replace each ``SplitToSequence`` read only by ``SequenceAt`` at constant positions with
    a ``Split`` whose pieces take the places of those ``SequenceAt`` outputs.

    The dynamo exporter writes ``torch.split`` and ``chunk`` so; the pieces are the same
    tensors, and a ``Split`` differentiates where a sequence does not. A split whose piece
    sizes are not known before the run (a dynamic length on the split axis) stays.

    Returns:
        Whether any node was rewritten.
    """
    b = OpBuilder(graph, opset, prefix="split_sequence")
    changed = False
    stale: set[str | None] = set()  # dimension names of the sequences' shared element shapes
    for node in [n for n in graph if n.op_type == "SplitToSequence"]:
        if node.domain not in _DEFAULT_DOMAINS or node.outputs[0].is_graph_output():
            continue
        sizes = _sequence_sizes(node)
        readers = [use.node for use in node.outputs[0].uses()]
        positions = [
            constant_value(r.inputs[1]) if r.op_type == "SequenceAt" and r.domain
            in _DEFAULT_DOMAINS and use.idx == 0 else None
            for r, use in zip(readers, node.outputs[0].uses())
        ]  # fmt: skip
        if sizes is None or any(p is None or p.size != 1 for p in positions):
            continue
        x, axis = node.inputs[0], node.attributes.get_int("axis", 0)
        assert x is not None
        pieces = b.split(x, sizes, axis=axis)
        squeeze = not node.attributes.get_int("keepdims", 1) and not _has_split(node)
        if squeeze:
            pieces = tuple(b.squeeze(piece, [axis]) for piece in pieces)
        for piece, size in zip(pieces, sizes):
            piece.type = x.type
            if x.shape is not None:
                dims = list(x.shape.dims)
                at = axis % len(dims)  # the exporters write axis=-1 for torch.chunk(x, n, -1)
                dims[at : at + 1] = [] if squeeze else [size]
                piece.shape = ir.Shape(dims)
        for reader, position in zip(readers, positions):
            assert position is not None
            out, piece = reader.outputs[0], pieces[int(position.reshape(()))]
            if out.shape is not None:  # names the input has are true lengths
                stale.update(d.value for d in out.shape.dims if isinstance(d, ir.SymbolicDim)
                             and (x.shape is None or d not in x.shape.dims))  # fmt: skip
            out.shape, out.type = piece.shape, piece.type
            replace_value(out, piece)
            graph.remove(reader, safe=True)
        graph.remove(node, safe=True)
        changed = True
    if changed:
        _forget_dims(graph, stale - {None})
        graph.sort()
    return changed


def _forget_dims(graph: ir.Graph, names: set[str | None]) -> None:
    """Make the dimensions called ``names`` anonymous in the shapes of ``graph``'s values.

    Shape inference gives every element of a sequence one shape, so the pieces of an uneven
    split share a dimension name although their lengths differ; the pieces' readers would
    carry that false equality on.
    """
    if not names:
        return
    for node in graph:
        for value in node.outputs:
            if value.shape is not None and any(
                isinstance(d, ir.SymbolicDim) and d.value in names for d in value.shape.dims
            ):
                value.shape = ir.Shape([
                    ir.SymbolicDim(None) if isinstance(d, ir.SymbolicDim) and d.value in names
                    else d for d in value.shape.dims
                ])  # fmt: skip


def _has_split(node: ir.Node) -> bool:
    return len(node.inputs) > 1 and node.inputs[1] is not None


def _sequence_sizes(node: ir.Node) -> list[int] | None:
    """The piece lengths of a ``SplitToSequence`` when they are known before the run."""
    x = node.inputs[0]
    axis = node.attributes.get_int("axis", 0)
    length = static_dim(x, axis) if x is not None else None
    split = constant_value(node.inputs[1]) if _has_split(node) else np.ones((), np.int64)
    if split is None:
        return None
    if split.ndim == 1:
        return [int(s) for s in split]
    if length is None or int(split) <= 0:
        return None
    step = 1 if not _has_split(node) else int(split)
    return [min(step, length - start) for start in range(0, length, step)]


def _used(value: ir.Value) -> bool:
    return bool(value.name) and bool(value.uses() or value.is_graph_output())


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Put ``new`` in ``old``'s place (uses, graph outputs, name, type) where ``old`` is used."""
    if not _used(old):
        return
    new.type, new.shape = old.type, old.shape
    name = old.name
    old.name = None
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name = name
