"""The forward-side kernel candidates as onnxscript rewriter patterns, found in one place.

Two native kernels serve a model's own forward nodes, which no traingraph code made (so no tag
marks them): a network's first Conv, with the Relu that alone reads it
(:mod:`~traingraph.runtime.cpu.kernels.direct_conv`), and the GELU, exact or
tanh-approximated, with the Dropout mask product after it
(:mod:`~traingraph.runtime.cpu.kernels.gelu`). Their nodes are
declared here as onnxscript patterns (``onnxscript.rewriter.pattern``), each with a check
function that holds the conditions the kernel needs, and :func:`find` matches a family of
them in a model. The rules only match; the kernels are built from the matches.

- :data:`FIRST_CONV`: ``conv_relu``, ``Relu(Conv(x, w[, b]))`` where the Relu alone reads
  the Conv; else ``conv``, the Conv alone. The Conv is 2-D, of at most
  :data:`DIRECT_CONV_CHANNELS` input channels, with strides and dilations 1, one group, no
  padding other than explicit pads (or ``VALID``), and it reads only the graph's inputs.
- :data:`GELU`: ``Mul(Mul(a, 1 + erf(a / sqrt 2)), 0.5)`` or ``Mul(Mul(a, 0.5), 1 + erf(a /
  sqrt 2))``, with ``a / sqrt 2`` as a ``Div`` or as a ``Mul`` by ``sqrt 0.5`` (``gelu``);
  preferred, the same times a tensor of its shape (a Dropout's mask) by the one Mul that reads
  it (``masked_gelu``). Only the Add reads the Erf, only the half reads the product it
  halves; each product may take its factors in either order. Other values of the GELU may
  have other readers: its gradient, which the GELU kernel finds from the matched nodes.
- :data:`GELU_TANH`: the tanh approximation, ``a / 2 (1 + tanh(sqrt(2 / pi) (a + 0.044715
  a^3)))``, with the cube as a ``Pow`` or as products of ``a`` and the half taken of ``a``,
  of the product or of ``1 + tanh`` (the forms of the TorchScript exporter, of torch's
  decomposition and of GPT-2's written-out GELU); the masked form preferred, as above.

Converting a whole training model to onnx-ir would cost time at every load, so
:func:`find` converts only the neighbourhood of the nodes every match of a family holds
(its anchors: the Convs that read graph inputs, the Erfs, the Tanhs), with the readers of
every value computed there, the model's inferred shapes on its values, and the nodes other
kernels took marked.

Example:
    >>> [match.rule for match in find(model, FIRST_CONV).matches]  # doctest: +SKIP
    ['conv_relu']
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir
from onnx import helper
from onnxscript.rewriter import pattern

from traingraph.runtime.cpu import graph_match

DIRECT_CONV_CHANNELS = 4
"""Input channels up to which a first Conv runs directly; with more, onnxruntime's blocked
convolution fills its vectors along the channels."""

TAKEN = "traingraph.taken"
"""The ``meta`` key of a node that another kernel took (in the converted neighbourhood)."""
READ = "traingraph.read"
"""The ``meta`` key of a value that another kernel reads (in the converted neighbourhood)."""

_DEFAULT = ("", "ai.onnx")
_SMALL = 16  # elements of an initializer the rules may read as a constant
_OUTSIDE = "traingraph.outside"  # the domain of the node that writes the values from outside


@dataclass(frozen=True)
class Rule:
    """One pattern and its check.

    Attributes:
        name: The rule's name.
        root: The op type of the pattern's last node, where a match is looked for.
        target: The pattern function (``op`` and the pattern's variables).
        check: The check function (the match context and the bound variables).
    """

    name: str
    root: str
    target: Callable[..., Any]
    check: Callable[..., bool]

    def forms(self) -> tuple[pattern.RewriteRule, ...]:
        """The pattern and check as onnxscript rules, one per order of the inputs of the
        pattern's commutative nodes: the calling thread's own (a rule's matcher holds the
        state of the match under way), made when it first matches. They are only matched,
        never applied."""
        compiled: dict[Rule, tuple[pattern.RewriteRule, ...]] | None
        compiled = getattr(_compiled, "forms", None)
        if compiled is None:
            compiled = _compiled.forms = {}
        if self not in compiled:
            declared = pattern.RewriteRule(self.target, _never_applied, self.check, name=self.name)
            compiled[self] = tuple(declared.commute())
        return compiled[self]


_compiled = threading.local()
"""Per thread, ``forms``: each :class:`Rule`'s onnxscript rules, made when first matched."""


def _never_applied(op: Any, **_: Any) -> None:
    """The replacement of the rules: they find a kernel's nodes and rewrite nothing."""
    return None


@dataclass(frozen=True)
class Family:
    """Rules of which a model holds at most one match around each anchor node.

    Attributes:
        name: The family's name.
        anchors: The indices of the nodes of a graph around which a match may be (each match
            holds one): a quick look at the protobuf before anything is converted.
        reach: How many steps from producer to reader (or back) a match's nodes lie from
            its anchor, at most.
        rules: The rules in order of preference.
    """

    name: str
    anchors: Callable[[onnx.GraphProto], list[int]]
    reach: int
    rules: tuple[Rule, ...]


@dataclass(frozen=True)
class Match:
    """One match of a rule.

    Attributes:
        rule: The rule's name.
        anchor: The index of its anchor node.
        nodes: The indices of its nodes in the model.
        values: The pattern's variables and named values, bound to values of the converted
            neighbourhood (which keep the model's names), or None where a rule leaves one
            unbound.
    """

    rule: str
    anchor: int
    nodes: frozenset[int]
    values: Mapping[str, ir.Value | None]

    def name(self, variable: str) -> str | None:
        """The model's name of the value bound to ``variable``; None where it is unbound."""
        value = self.values.get(variable)
        return value.name if value is not None else None


@dataclass(frozen=True)
class Found:
    """What :func:`find` found in a model.

    Attributes:
        matches: The matches, in their anchors' order.
        index: The model's index, which the kernels' check reads too; None where nothing
            was looked for (no anchor, or a node holding a subgraph).
        shapes: Its inferred float shapes; {} where nothing was looked for.
    """

    matches: list[Match]
    index: graph_match.GraphIndex | None = None
    shapes: Mapping[str, list[int | None]] = field(default_factory=dict)


def find(
    model: onnx.ModelProto,
    family: Family,
    taken: Set[int] = frozenset(),
    read: Set[str] = frozenset(),
) -> Found:
    """The matches of ``family``'s rules in ``model``, one at most around each anchor (the
    first rule's that has one, its match of the earliest last node), in the anchors' order,
    none holding a node of ``taken`` or of an earlier match: the nodes other kernels took,
    which read only the values in ``read``; none (and no index) where ``model`` has no anchor
    or a node holds a subgraph (whose reads of outer values a match would not see)."""
    graph = model.graph
    anchors = [i for i in family.anchors(graph) if i not in taken]
    if not anchors:
        return Found([])
    g = graph_match.GraphIndex.of(graph)
    shapes = graph_match.inferred_shapes(model)
    neighbourhood = _neighbourhood(model, g, shapes, anchors, family.reach, taken, read)
    if neighbourhood is None:
        return Found([])
    view, index = neighbourhood
    below = _below(g, anchors, family.reach)  # where a match's last node may be
    nodes = [node for node in view.graph if index.get(id(node), -1) in below]
    best: dict[int, Match] = {}  # by anchor: the preferred rule's match of the earliest root
    for rule in family.rules:
        if len(best) == len(anchors):
            break  # each anchor has a match of a rule preferred to the rest
        for node in nodes:
            if node.op_type != rule.root:
                continue
            for form in rule.forms():
                result = form.match(view, view.graph, node, check_nodes_are_removable=False)
                if not result:
                    continue
                matched = frozenset(index[id(n)] for n in result.nodes)
                held = [i for i in anchors if i in matched]
                if len(held) == 1 and not matched & taken:
                    match = Match(rule.name, held[0], matched, dict(result.bindings))
                    best.setdefault(held[0], match)
                    break
    matches: list[Match] = []
    claimed: set[int] = set()
    for anchor in sorted(best):
        if not best[anchor].nodes & claimed:
            claimed |= best[anchor].nodes
            matches.append(best[anchor])
    if matches and graph_match.has_subgraphs(model):  # the nodes outside the neighbourhood
        return Found([])
    return Found(matches, g, shapes)


def _below(g: graph_match.GraphIndex, anchors: Sequence[int], reach: int) -> set[int]:
    """The anchors and the nodes that read what they write, within ``reach`` steps."""
    found = set(anchors)
    edge = set(anchors)
    for _ in range(reach):
        edge = {r for i in edge for v in g.nodes[i].output for r in g.consumers.get(v, ())}
        edge -= found
        found |= edge
    return found


def _neighbourhood(
    model: onnx.ModelProto,
    g: graph_match.GraphIndex,
    shapes: Mapping[str, list[int | None]],
    anchors: Sequence[int],
    reach: int,
    taken: Set[int],
    read: Set[str],
) -> tuple[ir.Model, dict[int, int]] | None:
    """The nodes of ``model`` within ``reach`` steps of an anchor (a step goes from a node to
    the producers and readers of what it reads and to the readers of what it writes, not
    through constants), the readers of everything they write and the Constants they read, as
    an onnx-ir model; and the index in ``model`` of each of its nodes (by ``id``). Values
    from nodes outside come from its first node, of the domain ``traingraph.outside``; the
    values carry the float ``shapes`` inferred for the model, and the nodes of ``taken`` and
    values of ``read`` are marked (:data:`TAKEN`, :data:`READ`). None where one of these
    nodes holds a subgraph."""
    graph = model.graph
    near = set(anchors)
    edge = set(anchors)
    for _ in range(reach):
        step: set[int] = set()
        for i in edge:
            node = g.nodes[i]
            for v in node.input:
                if v and v not in g.constants:
                    step |= g.consumers.get(v, set())
                    if v in g.producer:
                        step.add(g.producer[v])
            for v in node.output:
                step |= g.consumers.get(v, set())
        edge = step - near
        near |= edge
    members = set(near)
    for i in near:
        for v in g.nodes[i].output:
            members |= g.consumers.get(v, set())
    for i in list(members):
        for v in g.nodes[i].input:
            if v in g.constants and v in g.producer:
                members.add(g.producer[v])
    order = sorted(members)
    nodes = [g.nodes[i] for i in order]
    if any(graph_match.has_subgraph(node) for node in nodes):
        return None
    written = {v for node in nodes for v in node.output if v}
    reads = {v for node in nodes for v in node.input if v}
    inputs = [i.name for i in graph.input if i.name in reads]
    small = [
        t for t in graph.initializer
        if t.name in reads and math.prod(t.dims) <= _SMALL
    ]  # fmt: skip
    known = written | set(inputs) | {t.name for t in small}
    outside = sorted(reads - known)

    view = helper.make_graph(
        [helper.make_node("Values", [], outside, domain=_OUTSIDE)] + nodes,
        "neighbourhood",
        [onnx.ValueInfoProto(name=name) for name in inputs],
        [onnx.ValueInfoProto(name=o.name) for o in graph.output if o.name in written],
        small,
    )
    converted = ir.serde.deserialize_model(
        helper.make_model(
            view,
            opset_imports=list(model.opset_import) + [helper.make_opsetid(_OUTSIDE, 1)],
            ir_version=model.ir_version,
        )
    )
    index = {id(node): i for node, i in zip(list(converted.graph)[1:], order)}
    values = list(converted.graph.inputs)
    for converted_node in converted.graph:
        if index.get(id(converted_node), -1) in taken:
            converted_node.meta[TAKEN] = True
        values += converted_node.outputs
    for value in values:
        dims = shapes.get(value.name or "")
        if dims is not None:
            value.dtype = ir.DataType.FLOAT
            value.shape = ir.Shape(dims)
        if value.name in read:
            value.meta[READ] = True
    return converted, index


def _scalar(value: ir.Value | None, target: float) -> bool:
    """Whether ``value`` is a float32 constant of one element within 1e-6 of ``target``."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or tensor.size != 1:
        return False
    return abs(float(tensor.numpy().reshape(())) - target) <= 1e-6 * abs(target)


def _readers(value: ir.Value) -> set[ir.Node]:
    return {node for node, _ in value.uses()}


def _only_reader(value: ir.Value, node: ir.Node | None) -> bool:
    """Whether ``node`` alone reads ``value``, which is no graph output."""
    return not value.is_graph_output() and _readers(value) == {node}


# -- the first Conv ------------------------------------------------------------------------


def conv_pads(conv: ir.Node) -> tuple[int, int, int, int] | None:
    """The top, left, bottom and right pads of ``conv`` where the direct kernel computes it
    (2-D, its filters' shape known, of at most :data:`DIRECT_CONV_CHANNELS` channels, as many
    as its input has, strides and dilations 1, one group, explicit or no pads); else None."""
    x, w = conv.inputs[0], conv.inputs[1]
    if x is None or w is None or x.shape is None or w.shape is None:
        return None
    weight = [d for d in w.shape if isinstance(d, int)]
    if len(x.shape) != 4 or len(w.shape) != 4 or len(weight) != 4:
        return None
    if weight[1] > DIRECT_CONV_CHANNELS or x.shape[1] != weight[1]:
        return None
    attributes = conv.attributes
    auto_pad = attributes.get_string("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID") or attributes.get_int("group", 1) != 1:
        return None
    steps = list(attributes.get_ints("strides", [])) + list(attributes.get_ints("dilations", []))
    if any(v != 1 for v in steps):
        return None
    kernel = attributes.get_ints("kernel_shape")
    if kernel is not None and list(kernel) != weight[2:]:
        return None
    pads = list(attributes.get_ints("pads", [0, 0, 0, 0])) if auto_pad == "NOTSET" else [0] * 4
    if len(pads) != 4 or min(pads) < 0:
        return None
    top, left, bottom, right = pads
    return top, left, bottom, right


def _conv(op: Any, x: ir.Value, w: ir.Value) -> Any:
    return op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv"])


def _conv_relu(op: Any, x: ir.Value, w: ir.Value) -> Any:
    return op.Relu(_conv(op, x, w), _outputs=["relu"])


def _is_direct_conv(context: Any, conv: ir.Value, **_: Any) -> bool:
    node = conv.producer()
    return (
        node is not None
        and all(v is None or v.is_graph_input() for v in node.inputs)
        and conv_pads(node) is not None
    )


def _is_direct_conv_relu(context: Any, conv: ir.Value, relu: ir.Value, **_: Any) -> bool:
    return _only_reader(conv, relu.producer()) and _is_direct_conv(context, conv)


def _first_convs(graph: onnx.GraphProto) -> list[int]:
    inputs = {i.name for i in graph.input}
    return [
        i for i, node in enumerate(graph.node)
        if node.op_type == "Conv" and node.domain in _DEFAULT and len(node.input) >= 2
        and all(v in inputs for v in node.input if v)
    ]  # fmt: skip


FIRST_CONV = Family(
    "first_conv",
    _first_convs,
    1,
    (
        Rule("conv_relu", "Relu", _conv_relu, _is_direct_conv_relu),
        Rule("conv", "Conv", _conv, _is_direct_conv),
    ),
)
"""A first Conv that the direct kernel computes, with the Relu that alone reads it."""


# -- the exact GELU ------------------------------------------------------------------------


def _gelu_form(divided: bool, half_first: bool, masked: bool) -> Callable[..., Any]:
    """The pattern of one form of the GELU: ``a / sqrt 2`` as a Div (``divided``) or a Mul,
    the half taken first or last, times ``mask`` after it where ``masked``."""

    def gelu(op: Any, a: Any, scale: Any, one: Any, half: Any, mask: Any) -> Any:
        scaled = op.Div(a, scale) if divided else op.Mul(a, scale)
        plus_one = op.Add(op.Erf(scaled, _outputs=["erf"]), one)
        if half_first:
            y = op.Mul(op.Mul(a, half), plus_one, _outputs=["gelu"])
        else:
            y = op.Mul(op.Mul(a, plus_one, _outputs=["product"]), half, _outputs=["gelu"])
        return op.Mul(y, mask, _outputs=["masked"]) if masked else y

    return gelu


def _gelu_check(divided: bool) -> Callable[..., bool]:
    root = math.sqrt(2.0) if divided else math.sqrt(0.5)

    def is_gelu(
        context: Any,
        scale: ir.Value,
        one: ir.Value,
        half: ir.Value,
        erf: ir.Value,
        gelu: ir.Value,
        product: ir.Value | None = None,
        mask: ir.Value | None = None,
        masked: ir.Value | None = None,
        **_: Any,
    ) -> bool:
        if not (_scalar(scale, root) and _scalar(one, 1.0) and _scalar(half, 0.5)):
            return False
        if not _only_reader(erf, next(iter(_readers(erf)), None)):
            return False
        if product is not None and not _only_reader(product, next(iter(_readers(product)))):
            return False
        return masked is None or mask is None or _masks(gelu, mask, masked)

    return is_gelu


def _masks(gelu: ir.Value, mask: ir.Value, masked: ir.Value) -> bool:
    """Whether the Mul writing ``masked`` multiplies ``gelu`` by a tensor of its shape and,
    besides nodes of other kernels (which do not read ``gelu`` itself), alone reads it."""
    product = masked.producer()
    others = {node for node in _readers(gelu) if node is not product}
    return (
        not gelu.is_graph_output()
        and not gelu.meta.get(READ)
        and all(node.meta.get(TAKEN) for node in others)
        and mask is not gelu
        and mask.shape is not None
        and mask.shape == gelu.shape
    )


def _nodes_of(op_type: str) -> Callable[[onnx.GraphProto], list[int]]:
    """The anchors of a family: the indices of a graph's default-domain ``op_type`` nodes."""

    def anchors(graph: onnx.GraphProto) -> list[int]:
        return [
            i for i, n in enumerate(graph.node) if n.op_type == op_type and n.domain in _DEFAULT
        ]

    return anchors


GELU = Family(
    "gelu",
    _nodes_of("Erf"),
    4,
    tuple(
        Rule(
            f"{'masked_' if masked else ''}gelu{'_half_first' if half_first else ''}"
            f"_{'divided' if divided else 'scaled'}",
            "Mul",
            _gelu_form(divided, half_first, masked),
            _gelu_check(divided),
        )
        for masked in (True, False)
        for half_first in (False, True)
        for divided in (True, False)
    ),
)
"""The exact (Erf) GELU, with the Dropout mask product after it where there is one."""


# -- the tanh approximation of the GELU -------------------------------------------------------

_GELU_TANH_C = math.sqrt(2.0 / math.pi)
_GELU_TANH_K = 0.044715


def _gelu_tanh_form(powered: bool, half_at: str, masked: bool) -> Callable[..., Any]:
    """The pattern of one form of the tanh GELU, ``a / 2 (1 + tanh(c (a + k a^3)))``: the cube
    as a ``Pow`` (``powered``) or as products of ``a``; the half taken of ``a`` first, of the
    product last or of ``1 + tanh`` (``half_at``); times ``mask`` after it where ``masked``."""

    def gelu(
        op: Any, a: Any, three: Any, k: Any, c: Any, one: Any, half: Any, mask: Any
    ) -> Any:
        cube = op.Pow(a, three) if powered else op.Mul(a, op.Mul(a, a))
        inner = op.Mul(op.Add(a, op.Mul(cube, k)), c)
        plus_one = op.Add(op.Tanh(inner, _outputs=["tanh"]), one)
        if half_at == "first":
            y = op.Mul(op.Mul(a, half), plus_one, _outputs=["gelu"])
        elif half_at == "last":
            y = op.Mul(op.Mul(a, plus_one), half, _outputs=["gelu"])
        else:
            y = op.Mul(a, op.Mul(half, plus_one), _outputs=["gelu"])
        return op.Mul(y, mask, _outputs=["masked"]) if masked else y

    return gelu


def _is_gelu_tanh(
    context: Any,
    k: ir.Value,
    c: ir.Value,
    one: ir.Value,
    half: ir.Value,
    gelu: ir.Value,
    three: ir.Value | None = None,
    mask: ir.Value | None = None,
    masked: ir.Value | None = None,
    **_: Any,
) -> bool:
    if not (
        _scalar(k, _GELU_TANH_K) and _scalar(c, _GELU_TANH_C) and _scalar(one, 1.0)
        and _scalar(half, 0.5)
    ):  # fmt: skip
        return False
    if three is not None:  # Pow's exponent, of any numeric type
        exponent = ir.convenience.get_const_tensor(three)
        if exponent is None or exponent.size != 1 or float(exponent.numpy().reshape(())) != 3:
            return False
    return masked is None or mask is None or _masks(gelu, mask, masked)


GELU_TANH = Family(
    "gelu_tanh",
    _nodes_of("Tanh"),
    5,
    tuple(
        Rule(
            f"{'masked_' if masked else ''}gelu_tanh_half_{half_at}"
            f"{'_pow' if powered else '_products'}",
            "Mul",
            _gelu_tanh_form(powered, half_at, masked),
            _is_gelu_tanh,
        )
        for masked in (True, False)
        for half_at in ("first", "last", "inner")
        for powered in (True, False)
    ),
)
"""The tanh approximation of the GELU, with the Dropout mask product after it where there is
one."""


__all__ = [
    "DIRECT_CONV_CHANNELS",
    "FIRST_CONV",
    "GELU",
    "GELU_TANH",
    "READ",
    "TAKEN",
    "Family",
    "Found",
    "Match",
    "Rule",
    "conv_pads",
    "find",
]
