"""Dropout keep masks computed natively on the CPU, between onnxruntime segments.

:func:`traingraph.ir.random.lower_dropout` writes a training-mode Dropout's mask as a
counter-based hash in standard integer ops: the positions, two multiplications, two shifts and
additions, a comparison, a cast and a scale, each a pass over the mask in onnxruntime, about
ten passes where one suffices. The mask depends on the
step's seed alone (and on the shape), so :func:`split_dropout_masks` finds each one, from the
``uint32`` seed to the scaled float mask, and a native kernel writes it in one pass; all of a
graph's masks are ready right after the seed is drawn, before the first Dropout needs one.

Each match is run against the subgraph it replaces, for several seeds, and kept only where the
masks are bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from traingraph.ir.random import GOLDEN, MIX
from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, Outputs, output_array
from traingraph.runtime.cpu.verify import Values

KERNEL = "dropout_mask"
"""The tag of a lowered Dropout's keep mask (:func:`traingraph.ir.random.lower_dropout`)."""

_UINT32 = onnx.TensorProto.UINT32
_MAX_CONE = 64  # nodes computing the hash: about 30 for one mask
_CHECK_SEEDS = (0x2545F491, 2**32 - 1, 7)


Dim = int | tuple[str, int]
"""A mask dimension: a number, or ``(input, axis)``: that axis of a graph input (a batch)."""


@dataclass(frozen=True)
class DropoutMask:
    """One Dropout keep mask: ``scale`` where the hash of a position is below ``threshold``.

    Attributes:
        seed: The ``uint32`` scalar the hash starts from (the step's seed plus the Dropout's
            offset).
        mask: The float32 mask the graph computed (``keep * scale``).
        dims: The mask's shape.
        threshold: The keep threshold on the hash.
        scale: ``1 / (1 - ratio)``.
    """

    seed: str
    mask: str
    dims: tuple[Dim, ...]
    threshold: int
    scale: float

    @property
    def inputs(self) -> list[str]:
        return [self.seed] + sorted({d[0] for d in self.dims if isinstance(d, tuple)})

    @property
    def outputs(self) -> list[str]:
        return [self.mask]

    def shape(self, values: Mapping[str, Any]) -> tuple[int, ...]:
        """The mask's shape given the graph inputs its dimensions refer to."""
        return tuple(d if isinstance(d, int) else int(values[d[0]].shape[d[1]]) for d in self.dims)

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write the mask into ``out`` (in place where an array of its shape is there)."""
        shape = self.shape(values)
        mask = output_array(out, self.mask, shape)
        assert NATIVE is not None
        seed = int(np.asarray(values[self.seed]).reshape(()))
        NATIVE.dropout_mask(
            mask, seed, GOLDEN, MIX, self.threshold, self.scale, threads
        )


def split_dropout_masks(model: onnx.ModelProto) -> list[tuple[DropoutMask, set[int]]]:
    """Each lowered Dropout mask of ``model`` the native kernel computes, with the indices of
    the nodes it replaces; ``[]`` where the extension is missing or nothing matches. A mask
    matches where onnx's shape inference gives each of its dimensions as a number or as a
    graph input's symbolic dimension (a batch)."""
    if NATIVE is None or any(graph_match.has_subgraph(n) for n in model.graph.node):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    if not any(n.op_type == "Less" for n in g.nodes):
        return []
    constants = graph_match.constant_values(model.graph)
    shapes = _symbolic_shapes(model)
    axes: dict[str, tuple[str, int]] = {}  # a graph input's symbolic dimension -> where it is
    for info in model.graph.input:
        for axis, d in enumerate(shapes.get(info.name) or ()):
            if isinstance(d, str) and d:
                axes.setdefault(d, (info.name, axis))
    found = []
    seeds = _Seeds({o for n in g.nodes if n.op_type == "Shape" for o in n.output})
    for i, node in enumerate(g.nodes):
        if node.op_type == "Less" and node.domain in ("", "ai.onnx") and g.tagged(i, KERNEL):
            match = _match(g, i, constants, shapes, axes, seeds)
            if match is not None:
                found.append(match)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    check = _Check(shapes, {mask.mask: shaped for mask, _, shaped in found}, types)
    matches = [(mask, kept) for mask, kept, _ in found]
    return verify.verified_kernels(model, g, matches, {}, check=check)  # inputs: the check's


_Shape = Sequence[int | str | None]


def _match(
    g: graph_match.GraphIndex,
    less: int,
    constants: Mapping[str, np.ndarray],
    shapes: Mapping[str, _Shape],
    axes: Mapping[str, tuple[str, int]],
    seeds: _Seeds,
) -> tuple[DropoutMask, set[int], set[str]] | None:
    """The mask computed from ``Less(hash, threshold)`` at node ``less``, the nodes that
    compute it, and the values whose shape alone it reads."""
    node = g.nodes[less]
    threshold = constants.get(node.input[1])
    if threshold is None or threshold.dtype != np.uint32 or threshold.size != 1:
        return None
    # Less -> shape ops -> Cast(float) [-> Mul(scale)]: the mask
    chain, roots, value = [less], [node.input[0]], node.output[0]
    step = g.only_reader(value)
    while step is not None and g.nodes[step].op_type in graph_match.SHAPE_OPS:
        if g.nodes[step].input[0] != value:
            return None
        chain.append(step)
        roots += [v for v in g.nodes[step].input[1:] if v]
        value = g.nodes[step].output[0]
        step = g.only_reader(value)
    if step is None or g.nodes[step].op_type != "Cast":
        return None
    if _cast_to(g.nodes[step]) != graph_match.FLOAT:
        return None
    chain.append(step)
    value, scale = g.nodes[step].output[0], 1.0
    step = g.only_reader(value)
    if step is not None and g.nodes[step].op_type == "Mul":
        other = [v for v in g.nodes[step].input if v != value]
        factor = constants.get(other[0]) if len(other) == 1 else None
        if factor is not None and factor.dtype == np.float32 and factor.size == 1:
            chain.append(step)
            value, scale = g.nodes[step].output[0], float(factor.reshape(()))
    shape = shapes.get(value)
    if shape is None or value in g.outputs:
        return None
    dims: list[Dim] = []
    for d in shape:
        dim = d if isinstance(d, int) else axes.get(d) if d else None
        if dim is None:
            return None
        dims.append(dim)
    cone = _hash_cone(g, roots, seeds)
    if cone is None:
        return None
    nodes, seed, shaped = cone
    if any(not shapes.get(v) or None in shapes[v] for v in shaped):
        return None
    # the nodes whose results something else reads too (and what they read) stay
    kept = graph_match.exclusive_cone(g, chain[-1], nodes | set(chain))
    if not set(chain) <= kept:
        return None
    mask = DropoutMask(seed, value, tuple(dims), int(threshold.reshape(())), scale)
    return mask, kept, shaped


def _symbolic_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """The shapes onnx's shape inference gives each tensor: numbers, symbols, or None where
    a dimension is unknown; {} where inference fails."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    except Exception:  # without shapes nothing is matched
        return {}
    return {
        v.name: graph_match.value_dims(v, symbols=True)
        for v in [*inferred.value_info, *inferred.input, *inferred.output]
        if v.type.tensor_type.HasField("shape")
    }


def _cast_to(node: onnx.NodeProto) -> int | None:
    """A Cast's target type."""
    return next((int(a.i) for a in node.attribute if a.name == "to"), None)


@dataclass
class _Seeds:
    """What tells a seed from a position in the hash: a Cast to uint32 of a value that is not
    derived from ``Shape`` results (the answers kept across the graph's masks)."""

    shape_values: set[str]
    derived: dict[str, bool] = field(default_factory=dict)

    def is_seed(self, g: graph_match.GraphIndex, node: onnx.NodeProto) -> bool:
        return (
            node.op_type == "Cast"
            and _cast_to(node) == _UINT32
            and not g.derived_from(node.input[0], self.shape_values, self.derived)
        )


def _hash_cone(
    g: graph_match.GraphIndex, roots: Sequence[str], seeds: _Seeds
) -> tuple[set[int], str, set[str]] | None:
    """The nodes that compute ``roots`` from one ``uint32`` seed (a Cast of a value that is
    not derived from shapes), constants and the shapes of other values: those nodes, the
    seed, and the values whose shape they read. None where anything else enters."""
    nodes: set[int] = set()
    found: set[str] = set()
    shaped: set[str] = set()
    stack, seen = list(roots), set()
    while stack:
        v = stack.pop()
        if v in seen or v in g.constants:
            continue
        seen.add(v)
        if v not in g.producer:
            return None  # a graph input (a seed fed from outside is not this lowering's)
        i = g.producer[v]
        node = g.nodes[i]
        if seeds.is_seed(g, node):
            found.add(v)
            continue
        nodes.add(i)
        if len(nodes) > _MAX_CONE:
            return None
        if node.op_type == "Shape":
            shaped.add(node.input[0])
            continue
        stack.extend(x for x in node.input if x)
    if len(found) != 1:
        return None
    return nodes, next(iter(found)), shaped


@dataclass
class _Check(verify.Check):
    """The numeric check of masks: bit for bit, for several seeds, computed on one thread and
    then two; the symbolic dimensions each get a different size, so a mask sized by one
    symbol where the graph sizes it by another does not pass. The nodes read only the shapes
    of the values they ``shaped`` (zeros of those shapes)."""

    shapes: Mapping[str, _Shape]
    shaped: Mapping[str, set[str]]  # a mask -> the values whose shapes its nodes read
    types: Mapping[str, int]  # a graph input -> its element type
    sizes: dict[str, int] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    seeds: list[str] = field(default_factory=list)

    def concrete(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` in the check."""
        return tuple(d if isinstance(d, int) else self.sizes.setdefault(str(d), 3 + len(self.sizes))
                     for d in self.shapes[name])  # fmt: skip

    def inputs(
        self, matches: Sequence[tuple[DropoutMask, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        feeds: list[dict[str, np.ndarray] | None] = [
            {v: np.zeros(self.concrete(v), np.float32) for v in self.shaped[mask.mask]}
            for mask, _ in matches
        ]
        for mask, _ in matches:
            for name in mask.inputs[1:]:  # the graph inputs its dimensions come from
                dtype = helper.tensor_dtype_to_np_dtype(self.types.get(name, graph_match.FLOAT))
                self.arrays.setdefault(name, np.zeros(self.concrete(name), dtype))
        self.seeds = [mask.seed for mask, _ in matches]
        return feeds

    def runs(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [
            {**feeds, **{seed: np.array((base + 0x9E37 * j) % 2**32, np.uint32)
                         for j, seed in enumerate(self.seeds)}}
            for base in _CHECK_SEEDS
        ]  # fmt: skip

    def run_names(self) -> Sequence[str]:
        return [f"seeds from {base:#x}" for base in _CHECK_SEEDS]

    def agrees(self, kernel: DropoutMask, values: Values, expected: Values, run: int) -> bool:
        values = {**self.arrays, **values}
        return verify.kernel_agrees(
            kernel, values, expected, threads=1 + run % 2, rtol={kernel.mask: 0.0}
        )
