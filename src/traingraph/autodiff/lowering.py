"""Rewrites of forward ops that some runtimes lack into standard ops that every runtime runs.

BatchNormalization in training mode (``training_mode=1``) is refused by onnxruntime's CUDA
kernel from opset 14 on and missing from many other ONNX runtimes, while its inference mode and
the reductions it is made of run everywhere. :func:`lower_training_batch_norm` rewrites it as
exactly what the ONNX specification defines:

    mean = ReduceMean(X),   var = ReduceMean((X - mean)^2)     (over every axis but 1)
    Y = BatchNormalization(X, scale, B, mean, var)              (inference mode)
    running_mean = momentum * input_mean + (1 - momentum) * mean
    running_var = momentum * input_var + (1 - momentum) * var

The statistics come from the same helper as the BatchNormalization gradient rule, so in a
training graph the forward and backward statistics are the same nodes to a runtime that merges
common subexpressions.

Example:
    >>> lowered = lower_training_batch_norm(model.graph, opset=17)  # doctest: +SKIP
"""

from __future__ import annotations

import onnx_ir as ir

from traingraph.autodiff.rules.normalization import batch_statistics
from traingraph.errors import ModelError
from traingraph.ir.builder import OpBuilder, rank

_DEFAULT_DOMAINS = ("", "ai.onnx")


def is_training_batch_norm(node: ir.Node) -> bool:
    """Whether ``node`` is a default-domain BatchNormalization with ``training_mode=1``."""
    if node.op_type != "BatchNormalization" or node.domain not in _DEFAULT_DOMAINS:
        return False
    attr = node.attributes.get("training_mode")
    return attr is not None and bool(attr.value)


def lower_training_batch_norm(graph: ir.Graph, opset: int) -> bool:
    """Replace every training-mode BatchNormalization of ``graph`` with standard ops.

    Each node's outputs keep their names (and graph-output places); the node is removed.

    Args:
        graph: The graph, changed in place.
        opset: The graph's default-domain opset (14 or later where training mode exists).

    Returns:
        Whether any node was rewritten.

    Raises:
        ModelError: When the rank of a node's input is unknown.
    """
    b = OpBuilder(graph, opset, prefix="bn_lowered")
    nodes = [node for node in graph if is_training_batch_norm(node)]
    for node in nodes:
        _lower_one(b, node)
        graph.remove(node, safe=True)
    if nodes:
        graph.sort()
    return bool(nodes)


def _lower_one(b: OpBuilder, node: ir.Node) -> None:
    """Append the standard-op form of one training-mode BatchNormalization ``node``."""
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
    mean, _, var = batch_statistics(b, x, axes)
    batch_mean, batch_var = (
        b.squeeze(v, axes) if x.dtype == like.dtype else b.cast_like(b.squeeze(v, axes), like)
        for v, like in ((mean, mean_in), (var, var_in))
    )
    y = b.BatchNormalization(
        x, scale, bias, batch_mean, batch_var,
        epsilon=1e-5 if eps is None else float(eps.value),
    )
    replacements = [y]
    for running, batch in ((mean_in, batch_mean), (var_in, batch_var)):
        kept = b.Mul(running, b.scalar(momentum, running))
        replacements.append(b.Add(kept, b.Mul(batch, b.scalar(1.0 - momentum, running))))
    for old, new in zip(node.outputs, replacements):
        if not old.name or not (old.uses() or old.is_graph_output()):
            continue
        new.type, new.shape = old.type, old.shape
        name = old.name
        old.name = None
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        new.name = name
