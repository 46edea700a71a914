"""Matching subgraphs of a training model: the index over its nodes, its inferred shapes and
the walks a kernel's matcher makes.

:class:`GraphIndex` indexes a model's nodes (producers, consumers, outputs, constants) and
answers what a matcher asks: whether a value is computed from given sources alone, which nodes
only feed a value, the form of a subgraph (to check one match for many repeated layers).
:func:`shared_analyses` computes shape inference and the index once for all the kernels' matchers
of one model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import onnx
from onnx import numpy_helper

from traingraph import limits
from traingraph.ir.tags import origin, read_tags
from traingraph.runtime.cpu.native import (
    NATIVE,
)

FLOAT = onnx.TensorProto.FLOAT
SHAPE_OPS = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"})
"""Ops that keep a value's elements and only change its shape."""


def without_identities(
    nodes: Sequence[onnx.NodeProto], pinned: Set[str]
) -> list[onnx.NodeProto]:
    """``nodes`` without their default-domain ``Identity`` nodes, each reader of an Identity's
    output reading its input instead (copies of the readers, with the inputs renamed). An
    Identity whose output is ``pinned`` (a graph output, a kernel's input) stays.

    onnxruntime's Identity hands its input over where both live in one session, but a value
    that crosses a cut is bound to a buffer of its own: an Identity at either end of a cut (a
    ``Dropout`` of ratio 0 in training mode, lowered to one, an ``nn.Identity`` or a
    ``clone()`` exported) copies the whole tensor there every step, and keeps both copies
    alive."""
    source: dict[str, str] = {}
    for node in nodes:
        if (
            node.op_type == "Identity" and node.domain in ("", "ai.onnx")
            and len(node.input) == 1 and len(node.output) == 1
            and node.input[0] and node.output[0] not in pinned
        ):  # fmt: skip
            source[node.output[0]] = source.get(node.input[0], node.input[0])
    if not source:
        return list(nodes)
    result: list[onnx.NodeProto] = []
    for node in nodes:
        if node.output and node.output[0] in source and node.op_type == "Identity":
            continue
        if any(v in source for v in node.input):
            renamed = onnx.NodeProto()
            renamed.CopyFrom(node)
            for k, v in enumerate(renamed.input):
                if v in source:
                    renamed.input[k] = source[v]
            node = renamed
        result.append(node)
    return result


def with_nodes(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph holds ``nodes``, or ``model`` itself where ``nodes`` are
    its graph's nodes already (as many: the callers only drop or rename nodes)."""
    if len(nodes) == len(model.graph.node) and all(
        a is b for a, b in zip(nodes, model.graph.node)
    ):
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    return result


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """The names a graph reads from outside its nodes: its inputs and initializers."""
    return {i.name for i in graph.input} | {t.name for t in graph.initializer}


def elem_type(value: onnx.ValueInfoProto) -> int:
    return int(value.type.tensor_type.elem_type)


def value_dims(value: onnx.ValueInfoProto, symbols: bool = False) -> list[Any]:
    """A value's dimensions: numbers, None where unknown (with ``symbols``, a named symbolic
    dimension is its name)."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return []
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) if symbols else None
        for d in tensor.shape.dim
    ]


_local = threading.local()
"""Per thread, within :func:`shared_analyses`: ``shared``, the shapes and indexes computed so
far, by the content of the model or graph they are of (Modules may be built in several threads
at once, as Flower's simulation does)."""


def _shared() -> dict[tuple[object, ...], Any] | None:
    return getattr(_local, "shared", None)


@contextlib.contextmanager
def shared_analyses() -> Iterator[None]:
    """Within this context :func:`inferred_shapes` and :meth:`GraphIndex.of` compute their
    result once for each model (or graph) content and give it again for the same content: the
    matchers of the kernels each ask for the model's shapes and index, and on a large graph
    shape inference takes a good part of a second. Left, the results are dropped. The cache is
    the calling thread's own."""
    outer = _shared()
    if outer is None:
        _local.shared = {}
    try:
        yield
    finally:
        if outer is None:
            _local.shared = None


def _content(message: onnx.ModelProto | onnx.GraphProto) -> bytes:
    return hashlib.blake2b(message.SerializeToString(deterministic=True)).digest()


def inferred_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """The shapes onnx's shape inference gives each float value; {} where it fails."""
    shared = _shared()
    key = ("shapes", _content(model)) if shared is not None else None
    if key is not None and shared is not None and key in shared:
        return {name: list(dims) for name, dims in shared[key].items()}
    try:
        inferred = onnx.shape_inference.infer_shapes(
            model, data_prop=limits.data_propagation_allowed(model)
        )
    except Exception:  # without shapes nothing is matched
        return {}
    graph = inferred.graph
    shapes = {
        v.name: value_dims(v)
        for v in list(graph.value_info) + list(graph.input) + list(graph.output)
        if elem_type(v) == FLOAT and v.type.tensor_type.HasField("shape")
    }
    if key is not None and shared is not None:
        shared[key] = {name: list(dims) for name, dims in shapes.items()}
    return shapes


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """``node``'s attributes by name, as Python values."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def has_subgraphs(model: onnx.ModelProto) -> bool:
    """Whether a node of ``model`` holds a subgraph (whose reads of outer values a match
    would not see)."""
    return any(has_subgraph(n) for n in model.graph.node)


def pair_of(values: Sequence[int] | None) -> tuple[int, int]:
    return (1, 1) if not values else (int(values[0]), int(values[1]))


def exclusive_cone(
    g: GraphIndex,
    root: int,
    within: set[int] | None = None,
) -> set[int]:
    """The nodes whose results reach only ``root``'s output: ``root`` and, walking back in
    topological order, every node (of ``within``, where given) all of whose used outputs feed
    only nodes already in.

    Only the producers of what the nodes already in read can join, so the walk visits those
    (latest first) rather than every earlier node."""
    nodes, producer, consumers, outputs = g.nodes, g.producer, g.consumers, g.outputs
    cone = {root}
    pending = [-j for j in producers_of(nodes[root], producer)]
    heapq.heapify(pending)
    position = root  # the walk goes down from here; a node above it was passed already
    while pending:
        i = -heapq.heappop(pending)
        if i >= position or i in cone or (within is not None and i not in within):
            continue
        position = i
        used = [name for name in nodes[i].output if name and consumers.get(name)]
        if (
            used
            and not any(name in outputs for name in nodes[i].output)
            and all(consumers[name] <= cone for name in used)
        ):
            cone.add(i)
            for j in producers_of(nodes[i], producer):
                heapq.heappush(pending, -j)
    return cone


def producers_of(node: onnx.NodeProto, producer: Mapping[str, int]) -> set[int]:
    return {producer[name] for name in node.input if name in producer}


def can_match(model: onnx.ModelProto, function: str, op_type: str) -> bool:
    """Whether a native kernel's matcher has anything to look at: the extension has
    ``function``, ``model`` holds a default-domain ``op_type`` node, and no node holds a
    subgraph (whose reads of outer values a match would not see)."""
    if NATIVE is None or not hasattr(NATIVE, function):
        return False
    nodes = model.graph.node
    if not any(n.op_type == op_type and n.domain in ("", "ai.onnx") for n in nodes):
        return False
    return not any(has_subgraph(n) for n in nodes)


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The values of ``graph``'s small constants (initializers and Constant nodes) by name."""
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            attr = node.attribute[0]
            if attr.name == "value":
                values[node.output[0]] = attr.t
    return {
        name: numpy_helper.to_array(tensor)
        for name, tensor in values.items()
        if np.prod(tensor.dims, dtype=np.int64) <= 16
    }


_Item = TypeVar("_Item", bound=Hashable)
_Kernel = TypeVar("_Kernel")
_Verdict = TypeVar("_Verdict")


class Pending(Generic[_Item]):
    """What :func:`settle`'s ``decide`` returns for an item whose verdict waits on others."""

    def __init__(self, items: list[_Item]) -> None:
        self.items = items


def settle(
    start: _Item,
    memo: dict[_Item, _Verdict],
    decide: Callable[[_Item], _Verdict | Pending[_Item]],
) -> _Verdict:
    """The verdict on ``start``, depth first without recursion: ``decide(item)`` gives an
    item's verdict, or the unsettled items it waits on, which are settled first; ``memo``
    keeps every verdict."""
    stack = [start]
    while stack:
        item = stack[-1]
        if item in memo:
            stack.pop()
            continue
        verdict = decide(item)
        if isinstance(verdict, Pending):
            stack += verdict.items
            continue
        memo[item] = verdict
        stack.pop()
    return memo[start]


def claim_matches(
    g: GraphIndex,
    op_type: str,
    taken: Collection[int],
    match: Callable[[int, set[int]], tuple[_Kernel, set[int]] | None],
    kernel: str | None = None,
) -> list[tuple[_Kernel, set[int]]]:
    """The matches of the default-domain ``op_type`` nodes, in graph order.

    ``match(i, claimed)`` is asked for each such node ``i`` outside ``claimed``: the nodes in
    ``taken`` and in the matches found before (a node goes to one match at most); where
    ``kernel`` is given, only for the nodes tagged for it.
    """
    claimed = set(taken)
    matches = []
    for i, node in enumerate(g.nodes):
        if i in claimed or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
            continue
        if kernel is not None and not g.tagged(i, kernel):
            continue
        found = match(i, claimed)
        if found is not None:
            claimed |= found[1]
            matches.append(found)
    return matches


@dataclass(frozen=True)
class GraphIndex:
    """A training model's nodes and the indexes over them that matching a subgraph uses."""

    nodes: list[onnx.NodeProto]
    producer: dict[str, int]
    consumers: dict[str, set[int]]
    outputs: set[str]
    constants: set[str]
    param_grads: set[str]  # the outputs "<input>_grad"
    initializers: Mapping[str, onnx.TensorProto] = dataclasses.field(default_factory=dict)
    tags: Mapping[str, set[int]] = dataclasses.field(default_factory=dict)
    """The nodes of each kernel's tagged patterns (:mod:`traingraph.ir.tags`); {} where the
    model has no tags."""
    instances: Mapping[str, set[str]] = dataclasses.field(default_factory=dict)
    """The forward nodes (by name) each kernel's tagged patterns were made for."""
    _digests: dict[str, bytes] = dataclasses.field(default_factory=dict, compare=False)

    @staticmethod
    def of(graph: onnx.GraphProto) -> GraphIndex:
        """The index of ``graph`` (the same one again for the same graph, unchanged, within
        :func:`shared_analyses`)."""
        shared = _shared()
        if shared is None:
            return GraphIndex._of(graph)
        # the graph itself is kept too: the index holds its nodes, and its id stays its own
        key = ("index", id(graph), _content(graph))
        if key not in shared:
            shared[key] = (graph, GraphIndex._of(graph))
        return shared[key][1]

    @staticmethod
    def _of(graph: onnx.GraphProto) -> GraphIndex:
        nodes = list(graph.node)
        consumers: dict[str, set[int]] = {}
        for i, n in enumerate(nodes):
            for name in n.input:
                consumers.setdefault(name, set()).add(i)
        constants = {t.name for t in graph.initializer} | {
            name
            for n in nodes
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
            for name in n.output
        }
        outputs = {o.name for o in graph.output}
        tags, instances = read_tags(nodes)
        return GraphIndex(
            nodes,
            {name: i for i, n in enumerate(nodes) for name in n.output if name},
            consumers,
            outputs,
            constants,
            {f"{name}_grad" for name in graph_reads(graph)} & outputs,
            {t.name: t for t in graph.initializer},
            tags,
            instances,
        )

    def tagged(self, i: int, kernel: str) -> bool:
        """Whether node ``i`` may be part of a match of ``kernel``: in a model with kernel
        tags, where it is tagged with ``kernel``; in a model without, always."""
        return not self.tags or i in self.tags.get(kernel, ())

    def made_for(self, node: onnx.NodeProto, kernel: str) -> bool:
        """Whether ``kernel``'s pattern may have been made for the forward ``node``: in a model
        with kernel tags, where a tag of ``kernel`` names it; in a model without, always."""
        return not self.tags or origin(node) in self.instances.get(kernel, ())

    def derived_from(
        self, value: str, sources: set[str], memo: dict[str, bool] | None = None
    ) -> bool:
        """Whether ``value`` is computed from ``sources`` and constants alone (a node that
        reads nothing but is no Constant, a random draw, is not); ``memo`` keeps the answers
        for values along the way, for further calls with the same ``sources``."""
        memo = {} if memo is None else memo

        def decide(v: str) -> bool | Pending[str]:
            if v in sources or v in self.constants:
                return True
            node = self.nodes[self.producer[v]] if v in self.producer else None
            if node is None or not node.input:
                return False
            # one input known not to be derived settles it; else look at the next unknown
            reads = [r for r in node.input if r]
            if any(memo.get(r) is False for r in reads):
                return False
            pending = next((r for r in reads if r not in memo), None)
            return Pending([pending]) if pending is not None else True

        return settle(value, memo, decide)

    def produced_by(
        self, value: str, op_type: str, taken: Collection[int] = ()
    ) -> tuple[int, onnx.NodeProto] | None:
        """The index and node of ``value``'s producer where it is a default-domain ``op_type``
        node not in ``taken`` (another kernel's); else None."""
        i = self.producer.get(value)
        if i is None or i in taken:
            return None
        node = self.nodes[i]
        return (i, node) if node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def only_reader(self, value: str, taken: Collection[int] = ()) -> int | None:
        """The one node that reads ``value``, where ``value`` is no graph output and the node
        is not in ``taken`` (another kernel's); else None."""
        readers = self.consumers.get(value, set())
        if len(readers) != 1 or value in self.outputs:
            return None
        reader = next(iter(readers))
        return None if reader in taken else reader

    def descendants_computed_from(
        self, start: str, sources: set[str], allowed: Callable[[str], bool]
    ) -> set[int]:
        """The nodes that read ``start`` (transitively), are computed from ``sources`` and
        constants alone, and write only ``allowed`` values.

        The walk goes forward from the readers of ``start`` (in the nodes' order), not over
        every node."""
        computable: dict[int, bool] = {}  # a node's inputs come from sources and constants
        reached = {start}
        found: set[int] = set()
        pending = sorted(self.consumers.get(start, ()))
        position = -1  # the walk goes up from here; a node below it was passed already
        while pending:
            i = heapq.heappop(pending)
            if i <= position:
                continue
            position = i
            node = self.nodes[i]
            if not any(v in reached for v in node.input if v):
                continue
            if not self._computable(i, sources, computable):
                continue
            outputs = [o for o in node.output if o]
            if all(allowed(o) for o in outputs):
                found.add(i)
                reached.update(outputs)
                for o in outputs:
                    for j in self.consumers.get(o, ()):
                        heapq.heappush(pending, j)
        return found

    def _computable(self, i: int, sources: set[str], memo: dict[int, bool]) -> bool:
        """Whether every input of node ``i`` is one of ``sources``, a constant, or written by
        an earlier node whose inputs are so too (``memo`` keeps the answers by node)."""

        def decide(j: int) -> bool | Pending[int]:
            unknown = None
            for v in self.nodes[j].input:
                if not v or v in sources or v in self.constants:
                    continue
                p = self.producer.get(v)
                if p is None or p >= j or memo.get(p) is False:
                    return False
                if p not in memo and unknown is None:
                    unknown = p  # known once p is
            return Pending([unknown]) if unknown is not None else True

        return settle(i, memo, decide)

    def leading_to(self, nodes: set[int], targets: set[str]) -> set[int]:
        """The nodes of ``nodes`` from which one of ``targets`` is reached within ``nodes``."""
        keep: set[int] = set()
        wanted = set(targets)
        for i in sorted(nodes, reverse=True):
            if any(o in wanted for o in self.nodes[i].output):
                keep.add(i)
                wanted.update(v for v in self.nodes[i].input if v)
        return keep

    def external(self, nodes: set[int]) -> set[str]:
        """The values ``nodes`` write that a model output is or another node reads."""
        return {
            o
            for j in nodes
            for o in self.nodes[j].output
            if o and (o in self.outputs or not self.consumers.get(o, set()) <= nodes)
        }

    def reads_beyond(self, nodes: set[int], sources: set[str]) -> set[str]:
        """The values ``nodes`` read that are neither written by one of them, nor one of
        ``sources``, nor a constant."""
        return {
            v
            for j in nodes
            for v in self.nodes[j].input
            if v and v not in sources and v not in self.constants
            and self.producer.get(v) not in nodes
        }  # fmt: skip

    def helpers(self, nodes: set[int], sources: set[str]) -> set[int]:
        """Nodes computed from ``sources`` and constants (recomputed statistics) that feed
        only ``nodes`` and each other."""
        found: set[int] = set()
        derived: dict[str, bool] = {}  # derived_from's answers for these sources
        changed = True
        while changed:
            changed = False
            around = set().union(*(self._producers(j) for j in nodes | found))
            for i in sorted(around, reverse=True):
                if i in nodes or i in found:
                    continue
                node = self.nodes[i]
                if any(o in self.outputs for o in node.output):
                    continue
                if not all(self.derived_from(v, sources, derived) for v in node.input if v):
                    continue
                if all(self.consumers.get(o, set()) <= nodes | found for o in node.output if o):
                    found.add(i)
                    changed = True
        return found

    def tagged_gradient(
        self, kernel: str, instance: str, sources: Set[str]
    ) -> tuple[set[int], str, set[str]] | None:
        """The nodes a gradient rule tagged as ``kernel``'s pattern for the forward node
        ``instance`` (:mod:`traingraph.ir.tags`), with those that compute what they read from
        ``sources`` alone (statistics of a normalization's input, which a kernel computes
        again), where they read one value beyond those (the output's gradient): ``(nodes,
        that value, the values they give the rest of the graph that are not computed from
        sources alone)``; None where nothing is tagged so or they read more."""
        nodes = {i for i in self.tags.get(kernel, set()) if origin(self.nodes[i]) == instance}
        if not nodes:
            return None
        memo: dict[str, bool] = {}
        beyond = self.reads_beyond(nodes, set(sources))
        given = [v for v in beyond if not self.derived_from(v, set(sources), memo)]
        if len(given) != 1:
            return None
        pending = [v for v in beyond if v != given[0] and v in self.producer]
        while pending:  # the nodes that compute the statistics, from sources and constants
            i = self.producer[pending.pop()]
            if i not in nodes:
                nodes.add(i)
                pending += [
                    v for v in self.nodes[i].input
                    if v and v in self.producer and v not in sources and v not in self.constants
                ]  # fmt: skip
        written = {o for o in self.external(nodes) if not self.derived_from(o, set(sources), memo)}
        return nodes, given[0], written

    def summed_into(self, grad: str) -> str | None:
        """The value whose ReduceSum, through shape ops, is the model output ``grad`` (a bias's
        gradient); None where it is none."""
        if grad not in self.outputs or grad not in self.producer:
            return None
        i = self.producer[grad]
        while self.nodes[i].op_type in SHAPE_OPS and self.nodes[i].input[0] in self.producer:
            i = self.producer[self.nodes[i].input[0]]
        return self.nodes[i].input[0] if self.nodes[i].op_type == "ReduceSum" else None

    def normalization_grad(
        self,
        dy: str,
        sources: set[str],
        allowed: Callable[[str], bool],
        like_x: Callable[[str], bool],
        dbias: str,
        dscale: str,
    ) -> tuple[set[int], str | None, str | None] | None:
        """The nodes of a normalization's gradient: those computed from ``sources`` (the
        input, the scale, the output gradient ``dy``) that write only ``allowed`` values, lead
        from ``dy`` to the bias gradient ``dbias``, the scale gradient ``dscale`` or a value
        ``like_x`` (of the input's shape; not those of a normalization on a parallel branch
        that sums the same ``dy``), with the statistics they recompute; and the input's
        gradient and ``dscale`` where the nodes write them. None where they write other
        values too or no ``dbias``."""
        nodes = self.descendants_computed_from(dy, sources, allowed)
        ours = {dbias, dscale} | {
            o for o in self.external(nodes) if o not in self.param_grads and like_x(o)
        }
        nodes = self.leading_to(nodes, ours)
        nodes |= self.helpers(nodes, sources)
        if self.reads_beyond(nodes, sources):
            # statistics computed outside the gradient (an exporter's own batch mean beside
            # an inference-mode BatchNormalization) that the kernel would compute again
            return None
        external = self.external(nodes)
        written = dscale if dscale in external else None
        rest = external - {dbias, written}
        if dbias not in external or len(rest) > 1:
            return None
        return nodes, next(iter(rest), None), written

    def _producers(self, i: int) -> set[int]:
        return {self.producer[v] for v in self.nodes[i].input if v in self.producer}

    def form(self, nodes: Collection[int], roles: Mapping[str, str]) -> tuple[object, ...]:
        """What ``nodes`` compute, without the names of their values: each node's op,
        attributes and inputs, an input named by the node and output that write it within,
        by its role in ``roles`` (a kernel's inputs and outputs: "x", "dy", ...), by the
        contents of the constant it is, or else by its own name. Two matches of one form whose
        inputs have the same shapes compute the same function of their inputs, so one numeric
        check decides both."""
        order = sorted(nodes)
        at = {
            name: (k, j) for k, i in enumerate(order) for j, name in enumerate(self.nodes[i].output)
        }
        form: list[object] = []
        for i in order:
            node = self.nodes[i]
            inputs = tuple(
                at[v] if v in at
                else ("role", roles[v]) if v in roles
                else ("constant", self._constant_digest(v)) if v in self.constants
                else ("value", v)
                for v in node.input
            )  # fmt: skip
            form.append((
                node.domain or "ai.onnx",
                node.op_type,
                tuple(a.SerializeToString(deterministic=True) for a in node.attribute),
                inputs,
                tuple(roles.get(o, "") for o in node.output),
            ))  # fmt: skip
        return tuple(form)

    def _constant_digest(self, name: str) -> bytes:
        """A digest of the contents (type, shape, values) of the constant ``name``."""
        digests = self._digests
        if name not in digests:
            if name in self.producer:  # a Constant node: its attribute holds the value
                node = self.nodes[self.producer[name]]
                content = b"".join(a.SerializeToString(deterministic=True) for a in node.attribute)
            else:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(self.initializers[name])
                tensor.ClearField("name")
                content = tensor.SerializeToString(deterministic=True)
            digests[name] = hashlib.blake2b(content, digest_size=16).digest()
        return digests[name]

    def computed_from(self, cone: set[int], sources: set[str]) -> set[int]:
        """The nodes of ``cone`` computed from ``sources`` and constants alone."""
        known = set(sources)
        found: set[int] = set()
        for i in sorted(cone):
            if all(v in known or v in self.constants for v in self.nodes[i].input if v):
                found.add(i)
                known.update(name for name in self.nodes[i].output if name)
        return found
