"""The input gradients of strided convolutions, finished natively on the CPU between segments.

The gradient of a Conv's input is a ConvTranspose of its output gradient. Where the Conv is
strided (or its input has more positions than its output),
:func:`traingraph.runtime.rewrites.specialize.for_cpu` writes that ConvTranspose as one MatMul into
columns and a ``Col2Im`` that adds the columns into the image. onnxruntime's Col2Im adds one
element at a time, and what follows the ConvTranspose in a training graph is often more passes
over the same image: the ``Sum`` with the gradient from the input's other readers (a residual
block's shortcut, itself a strided 1x1 Conv's ConvTranspose) and the product with the mask of
the Relu that wrote the input.

:func:`split_col2ims` gives each such ConvTranspose's MatMul to onnxruntime and the rest to one
native kernel, :class:`Col2ImSum`: the columns of every ConvTranspose the Sum adds, the Sum's
other terms and the Relu mask, in one pass over the image, built plane by plane in the cache.
Each match is checked against the nodes it replaces on random inputs.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import shape_inference

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array
from traingraph.runtime.rewrites import specialize

KERNEL = "conv_input_grad"
"""The tag of the nodes of a Conv's input gradient."""

Pair = tuple[int, int]


@dataclass(frozen=True)
class Col2ImTerm:
    """One ConvTranspose's columns ``[N, C * KH * KW, OH * OW]`` and how they go into the
    image (Col2Im's attributes, with the begin pads)."""

    columns: str
    kernel: Pair
    grid: Pair
    strides: Pair
    pads: Pair
    dilations: Pair


@dataclass(frozen=True)
class Col2ImSum(OneOutput):
    """``out = (sum of addends + sum of the terms' Col2Ims)``, kept where ``gate > 0`` (the
    product with ``Cast(Greater(gate, 0))``) when ``gate`` is set.

    Attributes:
        terms: The ConvTransposes' columns.
        addends: The Sum's other terms, each of ``out``'s shape.
        gate: The value whose positive elements the Relu mask keeps, or None.
        out: The value the kernel writes.
        channels: ``out``'s channels.
        image: ``out``'s height and width.
    """

    terms: tuple[Col2ImTerm, ...]
    addends: tuple[str, ...]
    gate: str | None
    out: str
    channels: int
    image: Pair

    @property
    def inputs(self) -> list[str]:
        return [t.columns for t in self.terms] + list(self.addends) + (
            [self.gate] if self.gate else []
        )

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        batch = values[self.terms[0].columns].shape[0]
        shape = (batch, self.channels, *self.image)
        target = output_array(out, self.out, shape)
        terms = [
            (values[t.columns], t.kernel, t.grid, t.strides, t.pads, t.dilations)
            for t in self.terms
        ]
        assert NATIVE is not None
        NATIVE.col2im_sum(
            target,
            terms,
            [values[a] for a in self.addends],
            values[self.gate] if self.gate else None,
            threads,
        )


def split_col2ims(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> tuple[onnx.ModelProto, list[tuple[Col2ImSum, set[int]]]]:
    """``model`` with the columns of each ConvTranspose the kernel finishes written after its
    nodes (nothing in it reads them: only the kernel), and each :class:`Col2ImSum` with the
    indices of the nodes it replaces: its ConvTransposes, the Sum and the mask product, none of
    them in ``taken`` (the nodes other kernels replace). ``(model, [])`` where the extension is
    missing or nothing matches."""
    native = NATIVE
    if native is None or not hasattr(native, "col2im_sum"):
        return model, []
    if not any(specialize.is_conv_transpose(n) for n in model.graph.node):
        return model, []
    if any(graph_match.has_subgraph(n) for n in model.graph.node):
        return model, []
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # without shapes nothing is matched
        return model, []
    shapes, types = specialize.static_shapes(inferred.graph)
    g = graph_match.GraphIndex.of(model.graph)
    transposed = {
        i: t
        for i, n in enumerate(g.nodes)
        if i not in taken and g.tagged(i, KERNEL) and (t := _term(n, shapes, types)) is not None
    }
    producers, _, _ = specialize.dataflow(model.graph)
    constants = specialize.constant_tensors(model.graph)
    matches: list[tuple[Col2ImSum, set[int]]] = []
    claimed = set(taken)
    for i in transposed:
        if i not in claimed:
            match = _match(g, i, transposed, claimed, shapes, producers, constants)
            claimed |= match[1]
            matches.append(match)
    filters = {i: t.filters for i, t in transposed.items()}
    written, columns = _with_columns(model, matches, filters)
    verified = _verified(model, g, matches, shapes, written, columns)
    if not verified:
        return model, []
    if len(verified) < len(matches):  # the columns of the refused ones stay unwritten
        written = _with_columns(model, verified, filters)[0]
    return written, verified


@dataclass(frozen=True)
class _Transposed:
    """A ConvTranspose the kernel can finish: its columns, filters (M), channels and image."""

    term: Col2ImTerm
    filters: int
    channels: int
    image: Pair


def _term(
    node: onnx.NodeProto, shapes: Mapping[str, list[int | None]], types: Mapping[str, int]
) -> _Transposed | None:
    """A 2-D ConvTranspose without bias that :func:`~traingraph.runtime.rewrites.specialize.for_cpu`
    would write as MatMul and Col2Im; else None."""
    if len(node.input) > 2 and node.input[2]:
        return None
    geometry = specialize.transposed_geometry(node, shapes)
    if geometry is None or types.get(node.input[0]) != onnx.TensorProto.FLOAT:
        return None
    image, kernel, filters = geometry
    grad, weight = shapes[node.input[0]], shapes[node.input[1]]
    if len(image) != 2 or weight[1] is None or None in grad[2:]:
        return None
    grid = [int(d or 0) for d in grad[2:]]
    attrs = {a.name: list(a.ints) for a in node.attribute if a.type == onnx.AttributeProto.INTS}
    strides, pads = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4)
    dilations = attrs.get("dilations", [1, 1])
    term = Col2ImTerm(
        f"{node.output[0]}_native_columns",
        graph_match.pair_of(kernel),
        graph_match.pair_of(grid),
        graph_match.pair_of(strides),
        graph_match.pair_of(pads[:2]),
        graph_match.pair_of(dilations),
    )
    out = shapes.get(node.output[0])
    if out is not None and list(out[1:]) != [weight[1], *image]:
        return None
    return _Transposed(term, int(filters), int(weight[1]), graph_match.pair_of(image))


def _match(
    g: graph_match.GraphIndex,
    first: int,
    transposed: Mapping[int, _Transposed],
    claimed: set[int],
    shapes: Mapping[str, list[int | None]],
    producers: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
) -> tuple[Col2ImSum, set[int]]:
    """The kernel that finishes the ConvTranspose at ``first``: with the Sum that is the only
    reader of its output (and of the other ConvTransposes it adds, each once), and the Relu
    mask product that is the only reader of the result, where their shapes allow."""
    own = transposed[first]
    members, addends, out = [first], list[str](), g.nodes[first].output[0]
    nodes = {first}
    reader = g.only_reader(out, claimed)
    if reader is not None and g.nodes[reader].op_type in ("Sum", "Add"):
        total = g.nodes[reader]
        inputs = [v for v in total.input if v]
        ours = [
            g.producer[v] for v in inputs
            if g.producer.get(v) in transposed and g.producer[v] not in claimed
            and g.only_reader(v) == reader and inputs.count(v) == 1
            and transposed[g.producer[v]].channels == own.channels
            and transposed[g.producer[v]].image == own.image
        ]  # fmt: skip
        others = [v for v in inputs if g.producer.get(v) not in ours]
        if first in ours and all(_same(shapes.get(v), shapes.get(total.output[0])) for v in others):
            members, addends, out = sorted(ours), others, total.output[0]
            nodes = set(members) | {reader}
    gate = None
    reader = g.only_reader(out, claimed)
    product = g.nodes[reader] if reader is not None else None
    if product is not None and product.op_type == "Mul" and len(product.input) == 2:
        other = product.input[1] if product.input[0] == out else product.input[0]
        cast = g.producer.get(other)
        greater = (
            specialize.positive_test(g.nodes[cast], producers, constants)
            if cast is not None and other != out
            else None
        )
        if greater is not None and _same(shapes.get(greater.input[0]), shapes.get(out)):
            gate, out = greater.input[0], product.output[0]
            nodes.add(g.producer[product.output[0]])
            if cast is not None and cast not in claimed and g.only_reader(other) == reader:
                nodes.add(cast)
                test = g.producer[greater.output[0]]
                if test not in claimed and g.only_reader(greater.output[0]) == cast:
                    nodes.add(test)
    kernel = Col2ImSum(
        tuple(transposed[i].term for i in members),
        tuple(addends),
        gate,
        out,
        own.channels,
        own.image,
    )
    return kernel, nodes


def _same(a: Sequence[int | None] | None, b: Sequence[int | None] | None) -> bool:
    """Whether two inferred shapes are one shape of rank 4, but perhaps for an unknown batch."""
    if a is None or b is None or len(a) != 4 or len(b) != 4 or None in [*a[1:], *b[1:]]:
        return False
    return list(a[1:]) == list(b[1:]) and (a[0] is None or b[0] is None or a[0] == b[0])


def _with_columns(
    model: onnx.ModelProto,
    matches: list[tuple[Col2ImSum, set[int]]],
    filters: Mapping[int, int],
) -> tuple[onnx.ModelProto, dict[int, list[onnx.NodeProto]]]:
    """``model`` with the columns of the matches' ConvTransposes written after its nodes (the
    indices of its nodes stay), and the nodes written for each ConvTransposes."""
    written = onnx.ModelProto()
    written.CopyFrom(model)
    columns: dict[int, list[onnx.NodeProto]] = {}
    for i in sorted(i for _, nodes in matches for i in nodes if i in filters):
        node = model.graph.node[i]
        name = f"{node.output[0]}_native"
        columns[i] = specialize.columns_nodes(written.graph, node, filters[i], name)
        written.graph.node.extend(columns[i])
    return written, columns


@dataclass(frozen=True)
class _Check(verify.Check):
    """The numeric check of Col2Im sums: standard-normal values (of the model's batch, or 2
    where it is open) of the inputs of each match's nodes, drawn match by match."""

    g: graph_match.GraphIndex
    shapes: Mapping[str, list[int | None]]

    def inputs(
        self, matches: Sequence[tuple[Col2ImSum, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        rng = np.random.default_rng(0)
        drawn: list[dict[str, np.ndarray] | None] = []
        feeds: dict[str, np.ndarray] = {}
        for _, nodes in matches:
            reads = {v for i in nodes for v in self.g.nodes[i].input if v}
            produced = {o for i in nodes for o in self.g.nodes[i].output}
            external = sorted(reads - produced - self.g.constants)
            values = verify.random_feeds(rng, external, self.shapes)
            if values is not None:
                feeds = {**values, **feeds}  # a value two matches read keeps its first array
                values = {name: feeds[name] for name in values}
            drawn.append(values)
        return drawn


def _verified(
    model: onnx.ModelProto,
    g: graph_match.GraphIndex,
    matches: list[tuple[Col2ImSum, set[int]]],
    shapes: Mapping[str, list[int | None]],
    written: onnx.ModelProto,
    written_columns: Mapping[int, list[onnx.NodeProto]],
) -> list[tuple[Col2ImSum, set[int]]]:
    """The matches whose kernel computes what their nodes compute (:class:`_Check`), all in one
    single-threaded onnxruntime session of ``written``: ``model`` with every match's columns
    (``written_columns``, by ConvTranspose) written after its nodes, which the kernels read."""
    positions: dict[int, set[int]] = {}  # a ConvTranspose -> its columns' nodes in written
    start = len(g.nodes)
    for i, nodes in written_columns.items():
        positions[i] = set(range(start, start + len(nodes)))
        start += len(nodes)
    checked = [
        (kernel, nodes.union(*(positions.get(i, set()) for i in nodes)))
        for kernel, nodes in matches
    ]
    w = graph_match.GraphIndex.of(written.graph)
    check = _Check(w, shapes)
    agreed = {id(k) for k, _ in verify.verified_kernels(written, w, checked, shapes, check=check)}
    return [(kernel, nodes) for kernel, nodes in matches if id(kernel) in agreed]


__all__ = ["Col2ImSum", "Col2ImTerm", "split_col2ims"]
