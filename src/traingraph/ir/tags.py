"""Kernel tags: the nodes of a pattern a native kernel serves, marked where they are made.

The gradient rules and lowerings that write such a pattern (a BatchNormalization's gradient,
a lowered Dropout's keep mask, a Conv's weight gradient, ...) tag each node they append with
the node metadata entry ``traingraph.kernel`` = ``"<kernel>:<instance>"``, the kernel's name
and the forward node it was made for. Metadata survives saving and loading, onnx-ir passes and
the checker, and other runtimes ignore it, so the artifacts stay standard ONNX. The CPU runtime
reads the tags (:func:`tagged_kernels`) to know which native kernels a training model holds
instead of searching every model for every pattern.

Example:
    >>> with tagging(b, "batch_norm_grad", node.name):  # doctest: +SKIP
    ...     dx = b.Mul(g, scale)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import onnx
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder

KEY = "traingraph.kernel"
"""The node metadata key of a kernel tag."""


def tag_value(kernel: str, instance: str) -> str:
    """The tag of the nodes of ``kernel``'s pattern made for the forward node ``instance``."""
    return f"{kernel}:{instance}"


@contextlib.contextmanager
def tagging(b: OpBuilder, kernel: str, instance: str) -> Iterator[None]:
    """Tag every node ``b`` appends within the context as part of ``kernel``'s pattern made
    for ``instance``; a node tagged by an inner context keeps its tag."""
    start = len(b.graph)
    try:
        yield
    finally:
        value = tag_value(kernel, instance)
        for node in b.graph[start:]:
            node.metadata_props.setdefault(KEY, value)


class _RuleContext(Protocol):
    b: OpBuilder
    node: ir.Node


_Rule = TypeVar("_Rule", bound=Callable[..., Any])


def tags(kernel: str) -> Callable[[_Rule], _Rule]:
    """Decorate a gradient rule whose nodes form ``kernel``'s pattern: each node it appends is
    tagged with ``kernel`` and the forward node's name (:func:`tagging`)."""

    def decorate(rule: _Rule) -> _Rule:
        @functools.wraps(rule)
        def tagged_rule(ctx: _RuleContext, *args: Any) -> Any:
            with tagging(ctx.b, kernel, ctx.node.name or ctx.node.op_type):
                return rule(ctx, *args)

        return tagged_rule  # type: ignore[return-value]

    return decorate


def kernel_of(node: onnx.NodeProto) -> str | None:
    """The kernel whose pattern ``node`` belongs to, or None for an untagged node."""
    for entry in node.metadata_props:
        if entry.key == KEY:
            return entry.value.partition(":")[0]
    return None


def origin(node: onnx.NodeProto) -> str:
    """The forward node ``node`` stands for: the one its tag names (a lowering's nodes stand
    for the node they replace), else ``node`` itself, by name."""
    for entry in node.metadata_props:
        if entry.key == KEY:
            return entry.value.partition(":")[2]
    return node.name


def read_tags(nodes: Iterable[onnx.NodeProto]) -> tuple[dict[str, set[int]], dict[str, set[str]]]:
    """The kernels ``nodes`` hold tagged patterns of, each with the indices of its nodes, and
    each with the forward nodes (by name) its patterns were made for; ``({}, {})`` for a model
    that traingraph's autodiff did not make (an onnxblock or onnxruntime-training model, a
    hand-written graph)."""
    indices: dict[str, set[int]] = {}
    instances: dict[str, set[str]] = {}
    for i, node in enumerate(nodes):
        for entry in node.metadata_props:
            if entry.key == KEY:
                kernel, _, instance = entry.value.partition(":")
                indices.setdefault(kernel, set()).add(i)
                instances.setdefault(kernel, set()).add(instance)
    return indices, instances


def tagged_kernels(nodes: Iterable[onnx.NodeProto]) -> dict[str, set[int]]:
    """The kernels ``nodes`` hold tagged patterns of, each with the indices of its nodes
    (:func:`read_tags`)."""
    return read_tags(nodes)[0]
