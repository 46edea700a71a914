"""Fewer copies of data: Transposes merged with the reshapes around them, and moved through the
ops that commute with them until they meet and merge.

Every ``Transpose`` writes a copy of its input, and on a CPU a copy of an activation that the
backward pass keeps costs what its bytes cost in memory traffic. Exporters write many:
``torch.nn.MultiheadAttention`` moves the batch axis behind the sequence axis on the way in and
back on the way out, packs q, k and v along a new axis and moves the heads around the batch,
eight copies a layer where two would do. The gradient graph has one copy for each of them.

- :func:`compose_views` writes each chain of ``Transpose``, ``Reshape``, ``Squeeze``,
  ``Unsqueeze`` and ``Flatten`` nodes whose intermediate values only the chain reads as at
  most ``Reshape -> Transpose -> Reshape``: the input is reshaped to the finest factors that
  every shape along the chain splits and merges, the factors are permuted once, and the result
  reshaped to the chain's output shape. A chain with two or more Transposes then copies once
  (or not at all, where the permutations cancel).
- :func:`move_transposes` moves a Transpose past the ops that commute with it, down to the
  view chain it feeds or up to the one that feeds it, where :func:`compose_views` merges them:
  a ``MatMul`` by a matrix (the permutation keeps the last axis), elementwise ops whose other
  operand broadcasts along the axes the permutation keeps, normalizations and softmaxes over
  the last axis, and a ``Gather`` of one index. A ``Gemm`` between a Reshape that merges the
  leading axes and one that splits them again becomes the ``MatMul`` and ``Add`` it computes,
  so that the Transposes around it can meet; ``Shape`` of a Transpose reads its input; the
  Gathers of every index of one axis become one ``Split``. It runs on the forward graph before
  it is differentiated, so the gradient graph has the fewer copies too.
- :func:`transposed_products` computes ``Transpose(A B)`` as ``B^T A^T`` with the Gemm's
  transpose flags, where a gradient rule transposes a product (a weight gradient).

Each element of the forward pass is computed from the same operands as before. A sum over the
rows of a product (a weight's or a bias's gradient) adds the same terms, in the order of the
rows as they now lie in memory: the same sums up to rounding, as from another GEMM blocking.
The dimensions along a chain must be known, except one per Reshape target, which the others
determine (the batch, symbolic or computed from ``Shape`` at run time).

Example:
    >>> move_transposes(graph, opset=17, keep={"logits"})  # doctest: +SKIP
    9
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from traingraph.ir.fold import Dim as FoldDim
from traingraph.ir.fold import constant_value, partial_value, remove_if_unused
from traingraph.ir.tags import KEY as TAG_KEY

_DEFAULT = ("", "ai.onnx")
VIEW_OPS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
UNARY = frozenset({
    "Abs", "Cast", "Ceil", "Celu", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round",
    "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Tanh", "ThresholdedRelu",
})  # fmt: skip
"""Elementwise ops of one input: each output element is computed from the same element."""
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})
LAST_AXIS = frozenset({"LayerNormalization", "Softmax", "LogSoftmax"})
"""Ops that compute along the last axis only (when their ``axis`` is the last)."""
MAX_RANK = 8
"""The most axes a composed Transpose may have (onnxruntime's CUDA Transpose takes 8)."""

Dim = int | str | None
"""A dimension: its length, the name of a symbolic one, or None where it is unknown."""
_UNKNOWN = "\0?"
"""The prefix of the names the layout gives unknown dimensions (no symbolic name has it)."""


# ---------------------------------------------------------------------- the layout algebra
@dataclass
class _Layout:
    """A tensor's axes as factors of a source tensor's dimensions.

    Attributes:
        sizes: The size of each factor: an int, or a name (of a symbolic dimension, or
            :data:`_UNKNOWN` and a number for an unknown one).
        order: The factors in the source's memory order, outermost first.
        axes: The factors of each axis of the tensor, outermost first (none for an axis of 1).
        source: The source's dimensions as the layout names them.
    """

    sizes: list[int | str]
    order: list[int]
    axes: list[list[int]]
    source: list[int | str]

    @classmethod
    def of(cls, dims: Sequence[Dim]) -> _Layout:
        named = [f"{_UNKNOWN}{i}" if d is None else d for i, d in enumerate(dims)]
        kept = [d for d in named if d != 1]
        axes, k = [], 0
        for d in named:
            axes.append([] if d == 1 else [k])
            k += d != 1
        return cls(list(kept), list(range(len(kept))), axes, named)

    def dims(self) -> list[int | str | None]:
        """Each axis's length (an int, a single factor's name, or None for a product of
        factors of which one is not a number)."""
        out: list[int | str | None] = []
        for axis in self.axes:
            sizes = [self.sizes[f] for f in axis]
            if all(isinstance(s, int) for s in sizes):
                out.append(math.prod(int(s) for s in sizes))
            else:
                out.append(sizes[0] if len(sizes) == 1 else None)
        return out

    def transpose(self, perm: Sequence[int]) -> bool:
        if sorted(perm) != list(range(len(self.axes))):
            return False
        self.axes = [self.axes[a] for a in perm]
        return True

    def reshape(self, target: Sequence[Dim]) -> bool:
        """Split and merge the factors to the axes of ``target`` (None: the one axis whose
        length the others determine); False where the shapes have no common refinement."""
        queue = [f for axis in self.axes for f in axis]
        rest = [i for i, d in enumerate(target) if d is None]
        if len(rest) > 1:
            return False
        if not rest and not self._solve(queue, target):
            return False
        cut = rest[0] if rest else len(target)
        front = self._take(queue, target[:cut], from_back=False)
        back = self._take(queue, target[cut + 1 :][::-1], from_back=True) if rest else []
        if front is None or back is None or (queue and not rest):
            return False
        self.axes = front + ([queue] if rest else []) + back[::-1]
        return True

    def _solve(self, queue: list[int], target: Sequence[Dim]) -> bool:
        """Give the one named factor of ``queue`` the length that an all-number ``target``
        determines (the Reshape fails at run time for any other); False where it cannot."""
        names = {self.sizes[f] for f in queue if isinstance(self.sizes[f], str)}
        if not names or not all(isinstance(d, int) for d in target):
            return True
        if len(names) > 1:
            return False
        known = math.prod(int(self.sizes[f]) for f in queue if isinstance(self.sizes[f], int))
        total = math.prod(d for d in target if isinstance(d, int))
        if known == 0 or total % known or total // known == 1:
            return False  # (a factor of 1 would need removing from every list)
        (name,) = names
        self.sizes = [total // known if s == name else s for s in self.sizes]
        return True

    def _take(
        self, queue: list[int], dims: Sequence[Dim], from_back: bool
    ) -> list[list[int]] | None:
        """The factors of each of ``dims``, taken from the front of ``queue`` (or its back,
        for ``dims`` given from the last), splitting a factor where a dimension ends in it."""
        axes: list[list[int]] = []
        end = -1 if from_back else 0
        for d in dims:
            if d == 1:
                axes.append([])
                continue
            if isinstance(d, str):
                if not queue or self.sizes[queue[end]] != d:
                    return None
                axes.append([queue.pop(end)])
                continue
            axis: list[int] = []
            product = 1
            while product < int(d):  # type: ignore[arg-type]
                if not queue or not isinstance(self.sizes[queue[end]], int):
                    return None
                f, size = queue[end], int(self.sizes[queue[end]])
                if int(d) % product:  # type: ignore[arg-type]
                    return None
                need = int(d) // product  # type: ignore[arg-type]
                if size <= need:
                    if need % size:
                        return None
                    taken = queue.pop(end)
                    product *= size
                else:  # the dimension ends inside factor f: split it
                    if size % need:
                        return None
                    inner = len(self.sizes)
                    self.order.insert(self.order.index(f) + 1, inner)
                    self.sizes.append(size // need if not from_back else need)
                    self.sizes[f] = need if not from_back else size // need
                    if from_back:
                        taken = inner
                    else:
                        taken, queue[0] = f, inner
                    product *= need
                if from_back:
                    axis.insert(0, taken)
                else:
                    axis.append(taken)
            axes.append(axis)
        return axes

    def apply(self, node: ir.Node) -> bool:
        """Follow one view op; False where it cannot be followed."""
        op, rank = node.op_type, len(self.axes)
        if op == "Transpose":
            perm = perm_of(node) or list(reversed(range(rank)))
            return self.transpose(perm)
        if op == "Flatten":
            attr = node.attributes.get("axis")
            axis = (1 if attr is None else int(attr.as_int())) % (rank + 1)
            head = [f for a in self.axes[:axis] for f in a]
            self.axes = [head, [f for a in self.axes[axis:] for f in a]]
            return True
        if op in ("Squeeze", "Unsqueeze"):
            axes = axes_of(node)
            if axes is None:
                return False
            if op == "Squeeze":
                gone = {a % rank for a in axes}
                if any(self.axes[a] for a in gone):
                    return False
                self.axes = [a for i, a in enumerate(self.axes) if i not in gone]
            else:
                for a in sorted(a % (rank + len(axes)) for a in axes):
                    self.axes.insert(a, [])
            return True
        target = _reshape_target(node, self.dims())
        return target is not None and self.reshape(target)

    def plan(self) -> tuple[list[int | str], list[int]]:
        """``(source reshaped to these dims, permutation)``: adjacent factors that stay
        adjacent and in order are merged (numbers only)."""
        sequence = [f for axis in self.axes for f in axis]
        follows = {a: b for a, b in zip(sequence, sequence[1:])}
        groups: list[list[int]] = []
        for f in self.order:
            last = groups[-1][-1] if groups else None
            if (
                last is not None
                and follows.get(last) == f
                and isinstance(self.sizes[f], int)
                and isinstance(self.sizes[last], int)
            ):
                groups[-1].append(f)
            else:
                groups.append([f])
        sizes = [
            self.sizes[g[0]] if len(g) == 1 else math.prod(int(self.sizes[f]) for f in g)
            for g in groups
        ]
        head = {g[0]: i for i, g in enumerate(groups)}
        return sizes, [head[f] for f in sequence if f in head]


def axes_of(node: ir.Node) -> list[int] | None:
    """The ``axes`` of a Squeeze, Unsqueeze or reduction: its constant second input (from
    opset 13 for Squeeze and Unsqueeze, 18 for most reductions) or its attribute before;
    None where neither gives them."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        value = constant_value(node.inputs[1])
        return None if value is None else [int(a) for a in np.ravel(value)]
    attr = node.attributes.get("axes")
    return None if attr is None else [int(a) for a in attr.as_ints()]


def _reshape_target(node: ir.Node, current: Sequence[Dim]) -> list[Dim] | None:
    """A Reshape's target: numbers, names of symbolic dimensions, and None for the one
    dimension that the others determine (``-1``, or one not known before the run)."""
    attr = node.attributes.get("allowzero")
    zero_copies = attr is None or not attr.as_int()
    elements = partial_value(node.inputs[1]) if len(node.inputs) > 1 else None
    if elements is None:
        return dims_of(node.outputs[0])
    target: list[Dim] = []
    for i, e in enumerate(elements):
        if isinstance(e, FoldDim):
            dims = dims_of(e.value)
            target.append(None if dims is None else dims[e.axis])
        elif e is None or e == -1:
            target.append(None)
        elif e == 0 and zero_copies:
            target.append(current[i] if i < len(current) else None)
        else:
            target.append(int(e))  # type: ignore[arg-type]
    if sum(not isinstance(d, int) for d in target) == 1:
        # the one that is not a number is what the others leave, whatever its name
        target = [d if isinstance(d, int) else None for d in target]
    return target


def dims_of(value: ir.Value | None) -> list[Dim] | None:
    """``value``'s dimensions (ints, names of symbolic ones, None where unknown); None where
    its rank is unknown."""
    if value is None or value.shape is None:
        return None
    dims: list[Dim] = []
    for d in value.shape.dims:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value is not None:
            dims.append(str(d.value))
        else:
            dims.append(None)
    return dims


def perm_of(node: ir.Node) -> list[int] | None:
    """A ``Transpose``'s permutation (its input's axes reversed where it has none)."""
    attr = node.attributes.get("perm")
    if attr is not None:
        return [int(a) for a in attr.as_ints()]
    value = node.inputs[0]
    if value is None or value.shape is None:
        return None
    return list(reversed(range(len(value.shape))))


def _is(node: ir.Node | None, ops: Iterable[str]) -> bool:
    """Whether ``node`` is a default-domain op of ``ops`` that no kernel tag claims (a native
    kernel or a runtime rewrite reads the tagged nodes of its pattern as written)."""
    return (
        node is not None
        and node.domain in _DEFAULT
        and node.op_type in ops
        and TAG_KEY not in node.metadata_props
    )


def _only_reader(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


def _layout_after(
    dims: Sequence[Dim],
    chain: Sequence[ir.Node],
    before: Sequence[int] | None = None,
    after: Sequence[int] | None = None,
) -> _Layout | None:
    """The layout of ``Transpose(before) -> chain -> Transpose(after)``'s output (each
    Transpose where given) in terms of the factors of its input's ``dims``; None where a step
    cannot be followed."""
    layout = _Layout.of(dims)
    steps_ok = (
        (before is None or layout.transpose(before))
        and all(layout.apply(node) for node in chain)
        and (after is None or layout.transpose(after))
    )
    return layout if steps_ok else None


def _copies(chain: Sequence[ir.Node]) -> int:
    """How many of ``chain``'s nodes are Transposes that move data."""
    perms = [perm_of(n) for n in chain if n.op_type == "Transpose"]
    return sum(1 for p in perms if p is None or p != sorted(p))


def compose_transposes(graph: ir.Graph) -> list[ir.Node]:
    """Read each ``Transpose`` of a ``Transpose`` from the first one's input, with the two
    permutations composed (none where they cancel), and remove the nodes that leaves unread.

    A gradient rule transposes what its forward node read, and the forward often read a
    transposed value itself: a ``Linear`` exported as ``MatMul(x, Transpose(W))`` gets the
    input gradient ``MatMul(dy, Transpose(Transpose(W)))``. Composed, the gradient reads ``W``,
    and the forward's ``Transpose(W)`` keeps one reader, which a runtime folds into its
    ``MatMul`` instead of writing the transposed copy (and keeping it alive for the backward
    pass). A transpose moves elements without computing, so every value stays the same.

    Returns:
        The nodes removed.
    """
    removed: list[ir.Node] = []
    for node in list(graph):
        if node.graph is not graph:
            continue  # removed as an earlier node's source
        inner = _transpose_of(node)
        if inner is None:
            continue
        source = inner.inputs[0]
        first, second = perm_of(inner), perm_of(node)
        if source is None or first is None or second is None or len(first) != len(second):
            continue
        composed = [first[axis] for axis in second]
        transposed = inner.outputs[0]
        if composed == sorted(composed) and not node.outputs[0].is_graph_output():
            node.outputs[0].replace_all_uses_with(source)
            graph.remove(node, safe=True)
            removed.append(node)
        else:
            node.replace_input_with(0, source)
            node.attributes["perm"] = ir.AttrInt64s("perm", composed)
        removed += remove_if_unused(graph, transposed)
    return removed


def _transpose_of(node: ir.Node) -> ir.Node | None:
    """The ``Transpose`` that computes the input of the ``Transpose`` ``node``, else None."""
    if not _is(node, {"Transpose"}) or not node.inputs or node.inputs[0] is None:
        return None
    inner = node.inputs[0].producer()
    return inner if _is(inner, {"Transpose"}) else None


# ----------------------------------------------------------------------- view chains
def _chains(graph: ir.Graph, keep: set[str]) -> list[list[ir.Node]]:
    """The maximal chains of view ops whose intermediate values only the chain reads."""

    def inner(value: ir.Value) -> bool:  # a value the chain may remove
        return _only_reader(value) is not None and value.name not in keep

    chains = []
    for node in graph:
        if not _is(node, VIEW_OPS):
            continue
        source = node.inputs[0]
        before = None if source is None else source.producer()
        if _is(before, VIEW_OPS) and source is not None and inner(source):
            continue  # not the head of its chain
        chains.append(_chain_from(node, keep))
    return chains


def compose_views(
    graph: ir.Graph, forward: set[ir.Node] | None = None, keep: Iterable[str] = ()
) -> int:
    """Write each chain of view ops that copies more than once as at most ``Reshape ->
    Transpose -> Reshape`` (see the module's docstring).

    Args:
        graph: The graph, changed in place.
        forward: The forward pass's nodes, where the graph also has a backward pass: a chain
            is rewritten only where all its nodes are among them or none is, and the nodes
            written for a forward chain are added to it.
        keep: Names of values that must stay (values a caller reads).

    Returns:
        How many chains were rewritten.
    """
    kept = set(keep)
    count = 0
    for chain in _chains(graph, kept):
        if len(chain) < 2:
            continue
        if forward is not None and len({n in forward for n in chain}) != 1:
            continue
        x, y = chain[0].inputs[0], chain[-1].outputs[0]
        if x is None or any(n.inputs[0] is None for n in chain):
            continue
        x_dims = dims_of(x)
        layout = None if x_dims is None else _layout_after(x_dims, chain)
        if layout is None:
            continue
        fine, perm = layout.plan()
        steps = _steps(layout.source, layout.dims(), fine, perm)
        if steps is None or len(perm) > MAX_RANK:
            continue
        moves = sum(kind == "transpose" for kind, _ in steps)
        if (moves, len(steps)) >= (_copies(chain), len(chain)):
            continue
        new = _write_steps(x, y, steps, label=chain[-1].name or "moves")
        if y.shape is not None:
            new[-1].outputs[0].shape = y.shape
        _insert(graph, chain[-1], new)
        _replace_output(y, new[-1].outputs[0])
        if forward is not None and chain[0] in forward:
            forward.update(new)
        for node in reversed(chain):
            _remove_with_constants(graph, node, forward)
        count += 1
    return count


Step = tuple[str, list[Any]]
"""One step of a rewritten chain: ``("reshape", dims)`` or ``("transpose", perm)``."""


def _steps(
    source: list[int | str], out: list[Any], fine: list[int | str], perm: list[int]
) -> list[Step] | None:
    """``Reshape(fine) -> Transpose(perm) -> Reshape(out)`` of a tensor of dims ``source``
    (as a layout names them), each step left out where it changes nothing (one Reshape where
    nothing is left); None where a Reshape target cannot be written (two dimensions in it
    that are not numbers)."""
    steps: list[Step] = []
    current: list[Any] = list(source)
    if perm != sorted(perm):
        if fine != current:
            steps.append(("reshape", list(fine)))
        steps.append(("transpose", perm))
        current = [fine[a] for a in perm]
    if current != out or not steps:
        steps.append(("reshape", out))
    if any(kind == "reshape" and _target(dims) is None for kind, dims in steps):
        return None
    return steps


def _write_steps(x: ir.Value, y: ir.Value, steps: list[Step], label: str) -> list[ir.Node]:
    """The nodes of ``steps`` applied to ``x``, typed like ``y``."""
    new: list[ir.Node] = []
    current, dims = x, list(dims_of(x) or [])
    for kind, arg in steps:
        if kind == "transpose":
            perm = [int(a) for a in arg]
            node = ir.Node(
                "",
                "Transpose",
                [current],
                [ir.AttrInt64s("perm", perm)],
                name=f"{label}/moves/transpose",
            )
            new.append(node)
            current, dims = node.outputs[0], [dims[a] for a in perm]
            _typed(current, y, dims)
        else:
            dims = list(arg)
            target = _target(dims)
            assert target is not None
            current = _reshape(new, current, target, dims, y, f"{label}/moves/reshape")
    return new


def _target(dims: Sequence[Dim]) -> list[int] | None:
    """A Reshape target of ``dims``: the one that is not a number as -1; None where more are
    not."""
    if sum(not isinstance(d, int) for d in dims) > 1:
        return None
    return [int(d) if isinstance(d, int) else -1 for d in dims]


def _reshape(
    new: list[ir.Node],
    x: ir.Value,
    target: list[int],
    dims: Sequence[Dim],
    like: ir.Value,
    label: str,
) -> ir.Value:
    shape = _int_constant(target, f"{label}/target")
    node = ir.Node("", "Reshape", [x, shape.outputs[0]], name=label)
    new += [shape, node]
    _typed(node.outputs[0], like, dims)
    return node.outputs[0]


def _insert(graph: ir.Graph, before: ir.Node, nodes: Sequence[ir.Node]) -> None:
    """Insert ``nodes`` before ``before``, each named after where it came from
    (``<origin>/moves/...``) and unique in the graph, as are the values they write."""
    taken = {n.name for n in graph}
    values = {v.name for n in graph for v in n.outputs} | {v.name for v in graph.inputs}
    values |= set(graph.initializers)
    for node in nodes:
        name = node.name or "moves"
        head, mark, tail = name.partition("/moves")
        base = f"{head}/moves" if mark else name
        rest = "/" + tail.rsplit("/", 1)[-1] if mark and "/" in tail else ""
        candidate, k = f"{base}{rest}", 0
        while candidate in taken:
            k += 1
            candidate = f"{base}_{k}{rest}"
        node.name = candidate
        taken.add(candidate)
        for i, value in enumerate(node.outputs):
            if value.name is None:
                value.name, k = f"{candidate}_out{i}", 0
                while value.name in values:
                    k += 1
                    value.name = f"{candidate}_out{i}_{k}"
                values.add(value.name)
    graph.insert_before(before, nodes)


def _typed(value: ir.Value, like: ir.Value, dims: Sequence[Dim]) -> None:
    """Give ``value`` ``like``'s type and ``dims`` (a layout's names of unknown ones as
    unknown)."""
    value.type = like.type
    if like.type is None:
        return  # (a shape without a type cannot be written)
    value.shape = ir.Shape(
        [
            d
            if isinstance(d, int)
            else ir.SymbolicDim(None if d is None or d.startswith(_UNKNOWN) else d)
            for d in dims
        ]
    )


def _replace_output(old: ir.Value, new: ir.Value) -> None:
    """Let ``new`` take ``old``'s place and name."""
    if new is old:
        return
    name = old.name
    old.name = None
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    new.name = name


def _remove_with_constants(
    graph: ir.Graph, node: ir.Node, forward: set[ir.Node] | None = None
) -> None:
    """Remove ``node`` (nothing reads its outputs any more) and what computed only its
    shape-like inputs (a Reshape's target, from constants or from ``Shape`` of a tensor)."""
    inputs = list(node.inputs)
    graph.remove(node, safe=True)
    if forward is not None:
        forward.discard(node)
    for v in inputs[1:]:
        if v is None or v.uses():
            continue
        removed = remove_if_unused(graph, v)
        if forward is not None:
            forward.difference_update(removed)
        if v.is_initializer() and v.name:
            graph.initializers.pop(v.name, None)


def _shapes_from_sources(graph: ir.Graph) -> int:
    """Compute each ``Shape`` of a Transpose's output from the Transpose's input (its shape
    permuted), so that only data readers read the output and its chain can be merged."""
    count = 0
    for node in list(graph):
        if not _is(node, {"Shape"}) or not node.inputs or node.inputs[0] is None:
            continue
        producer = node.inputs[0].producer()
        written = None if producer is None else _shape_nodes(producer, node.name or "shape")
        if written is None:
            continue
        new, rank = written
        start_attr, end_attr = node.attributes.get("start"), node.attributes.get("end")
        start = 0 if start_attr is None else int(start_attr.as_int())
        end = rank if end_attr is None else int(end_attr.as_int())
        picked = list(range(rank))[slice(start, end)]
        if picked != list(range(rank)):
            indices = _int_constant(picked, f"{node.name}/moves/picked")
            axis = [ir.AttrInt64("axis", 0)]
            gathered = ir.Node("", "Gather", [new[-1].outputs[0], indices.outputs[0]], axis,
                               name=f"{node.name}/moves/gather")  # fmt: skip
            new += [indices, gathered]
        out = new[-1].outputs[0]
        out.type, out.shape = node.outputs[0].type, node.outputs[0].shape
        _insert(graph, node, new)
        _replace_output(node.outputs[0], out)
        graph.remove(node, safe=True)
        count += 1
    return count


def _int_constant(values: Sequence[int], name: str) -> ir.Node:
    """A ``Constant`` node of the 1-D int64 tensor ``values``, its output typed."""
    node = ir.Node(
        "", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(values, np.int64)))],
        name=name,
    )  # fmt: skip
    node.outputs[0].type = ir.TensorType(ir.DataType.INT64)
    node.outputs[0].shape = ir.Shape([len(values)])
    return node


def _shape_nodes(producer: ir.Node, label: str) -> tuple[list[ir.Node], int] | None:
    """Nodes that compute the shape of a Transpose's output from its input (the last one
    writes it), and its rank; None for other nodes."""
    perm = perm_of(producer) if _is(producer, {"Transpose"}) and producer.inputs else None
    x = producer.inputs[0] if perm is not None else None
    if perm is None or x is None:
        return None
    shape = ir.Node("", "Shape", [x], name=f"{label}/moves/shape")
    indices = _int_constant(perm, f"{label}/moves/perm")
    moved = ir.Node("", "Gather", [shape.outputs[0], indices.outputs[0]],
                    [ir.AttrInt64("axis", 0)], name=f"{label}/moves/permuted")  # fmt: skip
    shape.outputs[0].type = ir.TensorType(ir.DataType.INT64)
    shape.outputs[0].shape = ir.Shape([len(perm)])
    return [shape, indices, moved], len(perm)


# ------------------------------------------------------------------- moving Transposes
_LOOK_AHEAD = 8
"""The most commuting ops a Transpose is moved through to meet another copy."""


def _fixes_last(perm: Sequence[int]) -> bool:
    return len(perm) > 0 and perm[-1] == len(perm) - 1


def _invariant(other: ir.Value | None, perm: Sequence[int]) -> bool:
    """Whether ``other`` broadcasts the same against a tensor and its transpose by ``perm``:
    its rank at most the tensor's, and a dimension of 1 on every axis the permutation moves."""
    dims = dims_of(other)
    if dims is None or len(dims) > len(perm):
        return False
    padded = [1] * (len(perm) - len(dims)) + dims
    return all(padded[a] == 1 for a in range(len(perm)) if perm[a] != a)


def _operand(node: ir.Node, perm: Sequence[int], opset: int) -> int | None:
    """The input of ``node`` that a Transpose by ``perm`` may move past (on either side), or
    None where the node does not commute with it."""
    if not _is(node, {node.op_type}) or not node.inputs or node.inputs[0] is None:
        return None
    op, rank = node.op_type, len(perm)
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return None
    if op in BINARY and len(node.inputs) == 2:
        for i in (0, 1):
            mine, other = node.inputs[i], node.inputs[1 - i]
            if (
                mine is not None
                and mine.shape is not None
                and len(mine.shape) == rank
                and (_invariant(other, perm))
            ):
                return i
        return None
    first = node.inputs[0]
    if first.shape is None or len(first.shape) != rank:
        return None
    if op in UNARY:
        return 0
    if not _fixes_last(perm):
        return None
    if op == "MatMul":
        weight = node.inputs[1]
        ok = weight is not None and weight.shape is not None and len(weight.shape) == 2
        return 0 if ok else None
    if op in LAST_AXIS and (op == "LayerNormalization" or opset >= 13):
        attr = node.attributes.get("axis")
        axis = -1 if attr is None else int(attr.as_int())
        return 0 if axis in (-1, rank - 1) else None
    return None


def _gather_axis(node: ir.Node) -> int | None:
    """The axis of a ``Gather`` of one constant index, else None."""
    if not _is(node, {"Gather"}) or len(node.inputs) != 2 or node.inputs[0] is None:
        return None
    index = constant_value(node.inputs[1])
    if index is None or index.ndim != 0 or node.inputs[0].shape is None:
        return None
    attr = node.attributes.get("axis")
    axis = 0 if attr is None else int(attr.as_int())
    return axis % len(node.inputs[0].shape)


def _gathered_perm(perm: Sequence[int], axis: int) -> list[int]:
    """The permutation left of ``perm`` after a Gather of one index along its output axis
    ``axis``."""
    gone = perm[axis]
    return [p - (p > gone) for i, p in enumerate(perm) if i != axis]


def _source_dims(dims: Sequence[Dim], perm: Sequence[int]) -> list[Dim]:
    """The dimensions whose transpose by ``perm`` has ``dims``."""
    source: list[Dim] = [0] * len(dims)
    for j, a in enumerate(perm):
        source[a] = dims[j]
    return source


def _merges(dims: Sequence[Dim], before: Sequence[int] | None, chain: Sequence[ir.Node],
            after: Sequence[int] | None) -> bool:  # fmt: skip
    """Whether ``Transpose(before) -> chain -> Transpose(after)`` of a tensor of ``dims``
    copies fewer times than the chain and the Transpose apart."""
    layout = _layout_after(dims, chain, before, after)
    if layout is None:
        return False
    _, perm = layout.plan()
    return (perm != sorted(perm)) < _copies(chain) + 1 and len(perm) <= MAX_RANK


def _chain_from(node: ir.Node, keep: set[str]) -> list[ir.Node]:
    """``node`` and the view ops after it, each the only reader of a value not in ``keep``."""
    chain = [node]
    while chain[-1].outputs[0].name not in keep:
        reader = _only_reader(chain[-1].outputs[0])
        if reader is None or not _is(reader, VIEW_OPS):
            break
        chain.append(reader)
    return chain


def _chain_to(value: ir.Value, keep: set[str]) -> list[ir.Node]:
    """The view ops that compute ``value``, each the only reader of the one before."""
    chain: list[ir.Node] = []
    node = value.producer()
    while _is(node, VIEW_OPS) and node is not None:
        chain.insert(0, node)
        source = node.inputs[0]
        node = None if source is None or source.name in keep else source.producer()
        if source is None or _only_reader(source) is None:
            break
    return chain


def _sinks(value: ir.Value, perm: Sequence[int], keep: set[str], opset: int, depth: int) -> bool:
    """Whether a Transpose by ``perm`` put on ``value`` (a transposed tensor) and moved down
    meets a copy it merges with."""
    dims = dims_of(value)
    if depth == 0 or dims is None or value.is_graph_output() or value.name in keep:
        return False
    readers = [u.node for u in value.uses()]
    if readers and all(_gather_axis(r) is not None for r in readers):
        return all(
            _sinks(r.outputs[0], _gathered_perm(perm, _gather_axis(r) or 0), keep, opset,
                   depth - 1)
            for r in readers
        )  # fmt: skip
    if len(readers) != 1:
        return False
    (reader,) = readers
    if _is(reader, VIEW_OPS):
        chain = _chain_from(reader, keep)
        return _copies(chain) > 0 and _merges(_source_dims(dims, perm), perm, chain, None)
    index = _operand(reader, perm, opset)
    if index is None or reader.inputs[index] is not value:
        return False
    return _sinks(reader.outputs[0], perm, keep, opset, depth - 1)


def _hoists(value: ir.Value, perm: Sequence[int], keep: set[str], opset: int, depth: int) -> bool:
    """Whether a Transpose by ``perm`` of ``value``, moved up, meets a copy it merges with."""
    if depth == 0 or value.name in keep or _only_reader(value) is None:
        return False
    node = value.producer()
    if node is None:
        return False
    if _is(node, VIEW_OPS):
        chain = _chain_to(value, keep)
        source = chain[0].inputs[0] if chain else None
        dims = dims_of(source)
        return dims is not None and _copies(chain) > 0 and _merges(dims, None, chain, perm)
    index = _operand(node, perm, opset)
    if index is None:
        return False
    return _hoists(node.inputs[index], perm, keep, opset, depth - 1)  # type: ignore[arg-type]


def _copy_node(node: ir.Node, inputs: Sequence[ir.Value | None], name: str) -> ir.Node:
    attributes = list(node.attributes.values())
    copy = ir.Node(node.domain, node.op_type, list(inputs), attributes, name=name,
                   num_outputs=len(node.outputs))  # fmt: skip
    copy.metadata_props.update(node.metadata_props)
    return copy


def _transpose_node(x: ir.Value, perm: Sequence[int], like: ir.Value, name: str) -> ir.Node:
    node = ir.Node("", "Transpose", [x], [ir.AttrInt64s("perm", list(perm))], name=name)
    dims = dims_of(x)
    if dims is not None:
        _typed(node.outputs[0], like, [dims[a] for a in perm])
    return node


def _sink(graph: ir.Graph, t: ir.Node, perm: list[int], opset: int) -> bool:
    """Move Transpose ``t`` below its reader(s); True where it moved."""
    x, out = t.inputs[0], t.outputs[0]
    readers = [u.node for u in out.uses()]
    x_dims = dims_of(x)
    if x is None or x_dims is None:
        return False
    if all(_gather_axis(r) is not None for r in readers):
        for r in readers:
            axis = _gather_axis(r) or 0
            gathered = _copy_node(r, [x, r.inputs[1]], f"{r.name}/moves")
            gathered.attributes["axis"] = ir.AttrInt64("axis", perm[axis])
            g_dims = [d for a, d in enumerate(x_dims) if a != perm[axis]]
            _typed(gathered.outputs[0], r.outputs[0], g_dims)
            moved = _transpose_node(
                gathered.outputs[0],
                _gathered_perm(perm, axis),
                r.outputs[0],
                f"{t.name}/moves/transpose",
            )
            _insert(graph, r, [gathered, moved])
            _replace_output(r.outputs[0], moved.outputs[0])
            graph.remove(r, safe=True)
        graph.remove(t, safe=True)
        return True
    (reader,) = readers
    index = _operand(reader, perm, opset)
    y_dims = dims_of(reader.outputs[0])
    if index is None or y_dims is None:
        return False
    inputs = list(reader.inputs)
    inputs[index] = x
    copy = _copy_node(reader, inputs, f"{reader.name}/moves")
    _typed(copy.outputs[0], reader.outputs[0], _source_dims(y_dims, perm))
    moved = _transpose_node(copy.outputs[0], perm, reader.outputs[0], f"{t.name}/moves/transpose")
    _insert(graph, reader, [copy, moved])
    _replace_output(reader.outputs[0], moved.outputs[0])
    graph.remove(reader, safe=True)
    graph.remove(t, safe=True)
    return True


def _hoist(graph: ir.Graph, t: ir.Node, perm: list[int], opset: int) -> bool:
    """Move Transpose ``t`` above the node that computes its input; True where it moved."""
    node = t.inputs[0].producer() if t.inputs[0] is not None else None
    index = None if node is None else _operand(node, perm, opset)
    if node is None or index is None:
        return False
    operand = node.inputs[index]
    assert operand is not None
    moved = _transpose_node(operand, perm, operand, f"{t.name}/moves/transpose")
    inputs = list(node.inputs)
    inputs[index] = moved.outputs[0]
    copy = _copy_node(node, inputs, f"{node.name}/moves")
    copy.outputs[0].type, copy.outputs[0].shape = t.outputs[0].type, t.outputs[0].shape
    _insert(graph, t, [moved, copy])
    _replace_output(t.outputs[0], copy.outputs[0])
    graph.remove(t, safe=True)
    graph.remove(node, safe=True)
    return True


def _gemm_as_matmul(graph: ir.Graph, gemm: ir.Node) -> bool:
    """Write ``Reshape -> Gemm -> Reshape`` that merges leading axes and splits them again
    as the ``MatMul`` (and ``Add``) it computes on the unmerged axes, where a Transpose is
    next to it; True where it did."""
    attrs = gemm.attributes
    if (
        not _is(gemm, {"Gemm"})
        or any(float(attrs[k].as_float()) != 1.0 for k in ("alpha", "beta") if k in attrs)
        or ("transA" in attrs and attrs["transA"].as_int())
    ):
        return False
    a = gemm.inputs[0]
    merge = None if a is None else a.producer()
    split = _only_reader(gemm.outputs[0])
    if (
        a is None or merge is None or split is None
        or not _is(merge, {"Reshape", "Flatten"}) or not _is(split, {"Reshape"})
        or _only_reader(a) is None
    ):  # fmt: skip
        return False
    x = merge.inputs[0]
    x_source = None if x is None else x.producer()
    beside = _is(x_source, {"Transpose"}) or _is(_only_reader(split.outputs[0]), {"Transpose"})
    weight = gemm.inputs[1]
    w_dims = dims_of(weight)
    x_dims, out_dims = dims_of(x), dims_of(split.outputs[0])
    if not beside or x is None or weight is None or w_dims is None or x_dims is None:
        return False
    transposed = "transB" in attrs and bool(attrs["transB"].as_int())
    k, n = (w_dims[1], w_dims[0]) if transposed else (w_dims[0], w_dims[1])
    target = _reshape_target(split, dims_of(gemm.outputs[0]) or [])
    if target is None or out_dims is None or len(target) < 3 or not isinstance(k, int):
        return False
    prefix = target[:-1]  # the rows' product is the Gemm's rows wherever the Reshape runs
    if target[-1] not in (n, None) or _target(prefix + [k]) is None:
        return False
    bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    bias_dims = dims_of(bias)
    if bias is not None and (
        bias_dims is None or len(bias_dims) > 2 or any(d != 1 for d in bias_dims[:-1])
    ):
        return False
    rows = prefix + [k]
    # every check is above: nodes made below read their inputs from the moment they exist
    new: list[ir.Node] = []
    label = gemm.name or "gemm"
    current = x
    if x_dims != rows:
        current = _reshape(new, x, _target(rows) or [], rows, a, f"{label}/moves/rows")
    if "transB" in attrs and attrs["transB"].as_int():
        flip = _transpose_node(weight, [1, 0], weight, f"{label}/moves/weight")
        new.append(flip)
        weight = flip.outputs[0]
    product = ir.Node("", "MatMul", [current, weight], name=f"{label}/moves/matmul")
    new.append(product)
    _typed(product.outputs[0], split.outputs[0], out_dims)
    result = product.outputs[0]
    if bias is not None:
        add = ir.Node("", "Add", [result, bias], name=f"{label}/moves/bias")
        new.append(add)
        _typed(add.outputs[0], split.outputs[0], out_dims)
        result = add.outputs[0]
    _insert(graph, split, new)
    _replace_output(split.outputs[0], result)
    for node in (split, gemm, merge):
        _remove_with_constants(graph, node)
    return True


def _gathers_as_split(graph: ir.Graph, value: ir.Value, opset: int) -> bool:
    """Write the Gathers of one index that read every index of one axis of ``value`` (and
    nothing else reads it) as one ``Split`` and a Squeeze of each piece; True where it did."""
    readers = [u.node for u in value.uses()]
    axes = {_gather_axis(r) for r in readers}
    dims = dims_of(value)
    if opset < 13 or len(readers) < 2 or len(axes) != 1 or dims is None or value.is_graph_output():
        return False
    (axis,) = axes
    length = None if axis is None else dims[axis]
    if axis is None or not isinstance(length, int):
        return False
    indices = [int(np.asarray(constant_value(r.inputs[1]))) % length for r in readers]
    if sorted(indices) != list(range(length)):
        return False
    if any(r.outputs[0].is_graph_output() for r in readers):
        return False
    label = readers[0].name or "gather"

    sizes, squeezed = (
        _int_constant([1] * len(indices), f"{label}/moves/sizes"),
        _int_constant([axis], f"{label}/moves/axis"),
    )
    split = ir.Node("", "Split", [value, sizes.outputs[0]], [ir.AttrInt64("axis", axis)],
                    name=f"{label}/moves/split", num_outputs=len(indices))  # fmt: skip
    new = [sizes, squeezed, split]
    by_index = dict(zip(indices, readers))
    for i, piece in enumerate(split.outputs):
        _typed(piece, value, [1 if a == axis else d for a, d in enumerate(dims)])
        reader = by_index[i]
        squeeze = ir.Node(
            "", "Squeeze", [piece, squeezed.outputs[0]], name=f"{reader.name}/moves/piece"
        )
        new.append(squeeze)
        out = reader.outputs[0]
        squeeze.outputs[0].type, squeeze.outputs[0].shape = out.type, out.shape
        _replace_output(out, squeeze.outputs[0])
    _insert(graph, readers[0], new)
    for reader in readers:
        graph.remove(reader, safe=True)
    return True


def move_transposes(graph: ir.Graph, opset: int, keep: Iterable[str] = ()) -> int:
    """Move Transposes through the ops that commute with them to the copies they merge with,
    and merge them (see the module's docstring).

    Args:
        graph: A forward graph with its shapes inferred, changed in place.
        opset: Its default-domain opset.
        keep: Names of values that must stay (values a caller reads by name).

    Returns:
        How many Transposes were moved or merged away.
    """
    kept = set(keep) | {v.name for v in graph.outputs if v.name}
    count = 0
    for node in list(graph):
        if node.graph is graph and _gemm_as_matmul(graph, node):
            count += 1
    for _ in range(8):
        moved = _shapes_from_sources(graph)
        for sink in (True, False):
            for t in [n for n in graph if _is(n, {"Transpose"})]:
                if t.graph is not graph:
                    continue
                perm, out = perm_of(t), t.outputs[0]
                if perm is None or perm == sorted(perm):
                    continue  # (moved down, its output goes; moved up, it keeps its name)
                if sink:
                    if _sinks(out, perm, kept, opset, _LOOK_AHEAD) and _sink(graph, t, perm, opset):
                        moved += 1
                elif (
                    t.inputs[0] is not None
                    and _hoists(t.inputs[0], perm, kept, opset, _LOOK_AHEAD)
                    and _hoist(graph, t, perm, opset)
                ):
                    moved += 1
            moved += compose_views(graph, keep=kept)
        if not moved:  # nothing left to move: the Gathers that read every index as a Split
            for node in list(graph):
                source = node.inputs[0] if node.graph is graph and node.inputs else None
                if source is not None and _gather_axis(node) is not None:
                    moved += _gathers_as_split(graph, source, opset)
        count += moved
        if not moved:
            break
    return count


def transposed_products(graph: ir.Graph, forward: set[ir.Node] | None = None) -> int:
    """Compute each ``Transpose`` of a matrix product that only it reads as the product of the
    transposed operands in swapped order (``Gemm`` flags, no copy).

    Returns:
        How many products were rewritten.
    """
    count = 0
    for t in list(graph):
        if t.graph is not graph or not _is(t, {"Transpose"}) or perm_of(t) != [1, 0]:
            continue
        product = t.inputs[0].producer() if t.inputs[0] is not None else None
        if product is None or _only_reader(t.inputs[0]) is not t:  # type: ignore[arg-type]
            continue
        if forward is not None and (product in forward) != (t in forward):
            continue
        if _is(product, {"MatMul"}):
            flags: tuple[int, ...] = (0, 0)
        elif _is(product, {"Gemm"}) and len([v for v in product.inputs if v is not None]) == 2:
            attrs = product.attributes
            flags = tuple(int(attrs[k].as_int()) if k in attrs else 0 for k in ("transA", "transB"))
        else:
            continue
        a, b = product.inputs[0], product.inputs[1]
        if a is None or b is None:
            continue
        if product.op_type == "MatMul" and any(
            v.shape is None or len(v.shape) != 2 for v in (a, b)
        ):
            continue  # a Gemm's operands are matrices
        attributes = [ir.AttrInt64("transA", 1 - flags[1]), ir.AttrInt64("transB", 1 - flags[0])]
        if "alpha" in product.attributes:
            attributes.append(product.attributes["alpha"])
        swapped = ir.Node("", "Gemm", [b, a], attributes, name=f"{product.name}/transposed")
        swapped.metadata_props.update(product.metadata_props)
        out = t.outputs[0]
        swapped.outputs[0].type, swapped.outputs[0].shape = out.type, out.shape
        _insert(graph, t, [swapped])
        _replace_output(out, swapped.outputs[0])
        graph.remove(t, safe=True)
        graph.remove(product, safe=True)
        if forward is not None and t in forward:
            forward.discard(t)
            forward.discard(product)
            forward.add(swapped)
        count += 1
    return count


__all__ = [
    "axes_of",
    "compose_transposes",
    "compose_views",
    "dims_of",
    "move_transposes",
    "perm_of",
    "transposed_products",
]
