"""The native CPU kernels: one protocol, one registry, chosen by name.

Each kernel computes, between two onnxruntime segments of a training step, what a subgraph of
the training model computes (NaN and infinity included), in one or two passes over memory
where onnxruntime makes one pass per op. :data:`REGISTRY` lists them in the order they are
looked for; ``SessionConfig(native_kernels=...)`` picks some by name (:func:`select`).

Where a kernel's pattern is made by traingraph's autodiff or lowerings (a gradient, a lowered
BatchNormalization or Dropout), those tag its nodes (:mod:`traingraph.ir.tags`): a tagged
model is searched only for the kernels whose tags it holds, and each matcher starts only from
the nodes tagged for its kernel, or from the forward nodes its tags were made for
(:meth:`~traingraph.runtime.cpu.graph_match.GraphIndex.tagged`,
:meth:`~traingraph.runtime.cpu.graph_match.GraphIndex.made_for`). A model without tags (made by
onnxblock, onnxruntime-training or by hand) is searched for every kernel: each match is exact
(its nodes compute what the kernel computes, checked numerically at load, with non-finite
values), so these models keep their fast paths. The forward-side kernels (a first Conv of few
channels, Winograd's 3 x 3 Convs, GELU) read the model's own nodes, which no traingraph code
made, and are searched for in every model.

Example:
    >>> sorted(select({"gelu", "dropout_mask"}))
    ['dropout_mask', 'gelu']
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import onnx

from traingraph.errors import ModelError
from traingraph.runtime.cpu import graph_match
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.cpu.kernels.activation_grads import (
    split_hardswish_grads,
    split_hardswishes,
    split_relu_grads,
    split_silu_grads,
)
from traingraph.runtime.cpu.kernels.batch_norm import split_batch_norm_grads, split_max_pool_grads
from traingraph.runtime.cpu.kernels.batch_sum import split_batch_sums
from traingraph.runtime.cpu.kernels.bn_forward import split_batch_norm_forwards
from traingraph.runtime.cpu.kernels.clip_grad import split_clip_grads
from traingraph.runtime.cpu.kernels.col2im import split_col2ims
from traingraph.runtime.cpu.kernels.depthwise import split_depthwise_conv_transposes
from traingraph.runtime.cpu.kernels.direct_conv import split_direct_convs
from traingraph.runtime.cpu.kernels.flipped_filter import split_flipped_filters
from traingraph.runtime.cpu.kernels.gelu import split_gelus
from traingraph.runtime.cpu.kernels.layer_norm import (
    split_instance_norm_grads,
    split_layer_norm_grads,
)
from traingraph.runtime.cpu.kernels.lstm_cell import split_lstm_backwards, split_lstm_forwards
from traingraph.runtime.cpu.kernels.masks import split_dropout_masks
from traingraph.runtime.cpu.kernels.max_pool import split_max_pool_scatters
from traingraph.runtime.cpu.kernels.scatter_rows import split_scatter_add_rows
from traingraph.runtime.cpu.kernels.winograd import split_winograd_convs
from traingraph.runtime.cpu.native import Arrays, Outputs
from traingraph.runtime.session import SessionConfig


class Kernel(Protocol):
    """A native kernel between two segments: it reads ``inputs`` and writes ``outputs``."""

    @property
    def inputs(self) -> list[str]:
        """The values it reads."""
        ...

    @property
    def outputs(self) -> list[str]:
        """The values it writes."""
        ...

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``outputs`` into ``out`` (arrays there are written in place, missing ones
        allocated) from ``values``, on ``threads`` threads."""
        ...


Found = list[tuple[Kernel, set[int]]]
"""Kernels with the indices of the nodes each replaces."""


@dataclass
class Search:
    """What the kernels' finders share while one model is searched.

    Attributes:
        model: The training model (the Col2Im finder replaces it with one that writes the
            columns its kernels read).
        weight_grads: The Conv weight gradients computed natively beside the run.
        forward: The forward phase's model where ``model`` is a separate gradient phase.
        found: The kernels found so far, with their nodes.
    """

    model: onnx.ModelProto
    weight_grads: Sequence[conv_grads.WeightGrad]
    forward: onnx.ModelProto | None = None
    found: Found = field(default_factory=list)

    @property
    def taken(self) -> set[int]:
        """The nodes the kernels found so far replace."""
        return set().union(*(nodes for _, nodes in self.found)) if self.found else set()

    @property
    def read(self) -> set[str]:
        """The values the kernels found so far read."""
        return {v for k, _ in self.found for v in k.inputs}


def _max_pool_grads(search: Search) -> Found:
    """The MaxPool gradients: tiling windows routed into a Conv's output gradient, then any
    other window's scatter of its maxima."""
    routes = list(split_max_pool_grads(search.model, search.weight_grads, search.forward))
    taken = search.taken.union(*(nodes for _, nodes in routes))
    return routes + list(split_max_pool_scatters(search.model, taken))


def _col2ims(search: Search) -> Found:
    search.model, found = split_col2ims(search.model, search.taken)
    return list(found)


@dataclass(frozen=True)
class KernelSpec:
    """One native kernel of the registry.

    Attributes:
        name: Its name in ``SessionConfig(native_kernels=...)``.
        find: Its matches in a model, given what the kernels before it found.
        tag: The tag (:mod:`traingraph.ir.tags`) of the nodes the autodiff rule or lowering
            that makes its pattern writes; a tagged model without it holds no match. None
            for a kernel of the model's own forward nodes.
    """

    name: str
    find: Callable[[Search], Found]
    tag: str | None


CONV_WEIGHT_GRAD = "conv_weight_grad"
"""The Conv weight gradients computed beside the run
(:mod:`traingraph.runtime.cpu.kernels.conv_grads`)."""

REGISTRY: tuple[KernelSpec, ...] = (
    KernelSpec(
        "batch_norm_grad",
        lambda s: list(split_batch_norm_grads(s.model, s.forward)),
        "batch_norm_grad",
    ),
    KernelSpec("max_pool_grad", _max_pool_grads, "max_pool_grad"),
    KernelSpec("dropout_mask", lambda s: list(split_dropout_masks(s.model)), "dropout_mask"),
    KernelSpec("direct_conv", lambda s: list(split_direct_convs(s.model, s.taken)), None),
    KernelSpec(
        "batch_norm_forward",
        lambda s: list(split_batch_norm_forwards(s.model, s.taken)),
        "batch_norm_forward",
    ),
    KernelSpec("winograd", lambda s: list(split_winograd_convs(s.model, s.taken)), None),
    KernelSpec("flipped_filter", lambda s: list(split_flipped_filters(s.model, s.taken)), None),
    KernelSpec("gelu", lambda s: list(split_gelus(s.model, s.taken, s.read)), None),
    KernelSpec("clip_grad", lambda s: list(split_clip_grads(s.model, s.taken)), None),
    KernelSpec("hardswish_grad", lambda s: list(split_hardswish_grads(s.model, s.taken)), None),
    KernelSpec("hardswish", lambda s: list(split_hardswishes(s.model, s.taken)), None),
    KernelSpec("silu_grad", lambda s: list(split_silu_grads(s.model, s.taken)), None),
    KernelSpec("relu_grad", lambda s: list(split_relu_grads(s.model, s.taken)), None),
    KernelSpec("scatter_add_rows", lambda s: list(split_scatter_add_rows(s.model, s.taken)), None),
    KernelSpec("lstm_forward", lambda s: list(split_lstm_forwards(s.model, s.taken)), None),
    KernelSpec(
        "lstm_backward",
        lambda s: list(split_lstm_backwards(s.model, s.taken)),
        "lstm_backward",
    ),
    KernelSpec(
        "layer_norm_grad",
        lambda s: list(split_layer_norm_grads(s.model, s.taken)),
        "layer_norm_grad",
    ),
    KernelSpec(
        "instance_norm_grad",
        lambda s: list(split_instance_norm_grads(s.model, s.taken)),
        "instance_norm_grad",
    ),
    KernelSpec(
        "depthwise_conv_transpose",
        lambda s: list(split_depthwise_conv_transposes(s.model, s.taken)),
        "conv_input_grad",
    ),
    KernelSpec("batch_sum", lambda s: list(split_batch_sums(s.model, s.taken)), None),
    KernelSpec("col2im", _col2ims, "conv_input_grad"),
)
"""The kernels between segments, in the order they are looked for (a later one takes only the
nodes the earlier ones leave). The Col2Im kernel comes last: it rewrites the model."""

TAGS: Mapping[str, str] = {CONV_WEIGHT_GRAD: CONV_WEIGHT_GRAD} | {
    spec.name: spec.tag for spec in REGISTRY if spec.tag is not None
}
"""Each tagged kernel's tag."""


def names() -> list[str]:
    """Every kernel's name: :data:`CONV_WEIGHT_GRAD` and those of :data:`REGISTRY`."""
    return [CONV_WEIGHT_GRAD] + [spec.name for spec in REGISTRY]


def select(native_kernels: Collection[str] | None) -> frozenset[str]:
    """The kernels ``native_kernels`` names (``SessionConfig.native_kernels``): all where None.

    Raises:
        ModelError: ``native_kernels`` is a single string, or names a kernel that does not
            exist.
    """
    known = names()
    if native_kernels is None:
        return frozenset(known)
    if isinstance(native_kernels, str):
        raise ModelError(
            f"native_kernels must be a collection of kernel names, got the string"
            f" {native_kernels!r}; write ({native_kernels!r},)"
        )
    unknown = sorted(set(native_kernels) - set(known))
    if unknown:
        raise ModelError(
            f"unknown native kernels {unknown}; the kernels are {known}"
        )
    return frozenset(native_kernels)


def searched(model: onnx.ModelProto, kernels: Collection[str] | None = None) -> frozenset[str]:
    """Which of the ``kernels`` (names, all where None) ``model`` may hold: all but those whose
    tag a tagged model lacks."""
    chosen = select(kernels)
    tags = set(graph_match.GraphIndex.of(model.graph).tags)
    if not tags:
        return chosen
    return frozenset(name for name in chosen if TAGS.get(name, name) in tags or name not in TAGS)


def find(
    model: onnx.ModelProto,
    weight_grads: Sequence[conv_grads.WeightGrad],
    forward: onnx.ModelProto | None = None,
    kernels: Collection[str] | None = None,
) -> tuple[onnx.ModelProto, Found]:
    """Every kernel of :data:`REGISTRY` among ``kernels`` (names; all where None) that
    ``model`` holds, with the nodes each replaces, and ``model`` as they need it (with the
    columns the Col2Im kernels read written after its nodes).

    Raises:
        ModelError: ``kernels`` names a kernel that does not exist.
    """
    search = Search(model, weight_grads, forward)
    with graph_match.shared_analyses():  # one shape inference and one index of the model
        wanted = searched(model, kernels)
        for spec in REGISTRY:
            if spec.name in wanted:
                search.found += spec.find(search)
    return search.model, search.found


def split(
    model: onnx.ModelProto, config: SessionConfig, forward: onnx.ModelProto | None = None
) -> tuple[onnx.ModelProto, list[conv_grads.WeightGrad], Found]:
    """The native kernels ``config`` asks for in the training model ``model`` on the CPU: the
    model to run, the Conv weight gradients computed beside it
    (:func:`traingraph.runtime.cpu.kernels.conv_grads.split_weight_grads`) and the kernels between
    its
    segments (:func:`find`).

    Raises:
        ModelError: ``config.native_kernels`` names a kernel that does not exist.
    """
    chosen = select(config.native_kernels)
    if _undefined_reads(model.graph):  # onnxruntime refuses the graph, with its own message
        return model, [], []
    model = _bypassed_identities(model)
    grads: list[conv_grads.WeightGrad] = []
    if config.native_conv_grads:
        model, grads = conv_grads.split_weight_grads(model, forward, chosen)
    found: Found = []
    if config.native_segments:
        model, found = find(model, grads, forward, chosen)
    return model, grads, found


def _undefined_reads(graph: onnx.GraphProto) -> bool:
    """Whether a node of ``graph`` reads a value that no graph input, initializer or node
    defines. A kernel that took such a node would hide it from onnxruntime, which refuses the
    graph whole and names the value."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined.update(t.values.name for t in graph.sparse_initializer)
    defined.update(o for node in graph.node for o in node.output)
    return any(name and name not in defined for node in graph.node for name in node.input)


def _bypassed_identities(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each reader of an ``Identity``'s output reading its input instead and
    the Identity gone, unless the output is a graph output (``model`` itself where there is
    none to remove, or where a subgraph may read one from the enclosing scope).

    An Identity is a copy (an exported ``clone()``, a lowered ``Dropout`` of ratio 0): inside
    one onnxruntime session it hands its input over, but where a kernel reads its output,
    the value crosses a cut and is copied there every step."""
    graph = model.graph
    if not any(n.op_type == "Identity" for n in graph.node) or graph_match.has_subgraphs(model):
        return model
    nodes = graph_match.without_identities(graph.node, {o.name for o in graph.output})
    return graph_match.with_nodes(model, nodes)
