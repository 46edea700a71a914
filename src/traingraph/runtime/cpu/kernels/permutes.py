"""Gathers that only permute a tensor's axes, run as one native strided copy.

onnxruntime's blocked (NCHWc) convolution kernels read the filter in channel blocks, and the
training graph reorders each filter on every step with a ``Gather`` of its positions
(:mod:`traingraph.runtime.rewrites.nchwc`). Where the channel counts are multiples of the block, the
positions are a permutation of the filter's axes split into blocks: ``dst =
src.reshape(dims).transpose(perm)``. :func:`as_permutation` finds ``dims`` and ``perm`` from
the positions (checked element by element), and :func:`permute` writes them with the native
kernel ``_convc.permute``, contiguous runs copied at memory speed where onnxruntime's Gather
reads one indexed element at a time. The values are copied, so the result is the Gather's,
NaN and infinities included.

Where the blocked layout only reorders the filter, the CPU rewrite writes the reorder as a
``Reshape``, a ``Transpose`` and a ``Reshape`` (:mod:`traingraph.runtime.rewrites.nchwc`), which
onnxruntime runs one element at a time too (a 512 x 256 x 3 x 3 filter: about 5.6 ms on one
thread, against 0.7 for the native copy). :func:`split_filter_reorders` takes such chains out of
a segment's rewritten model: each becomes a :class:`FilterReorder`, which the segmented run
computes before the segment and binds as its input.

Example:
    >>> import numpy as np
    >>> positions = np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1)
    >>> as_permutation(positions, 24)  # axes 0 and 1 stay together: one axis of 6
    ([6, 4], [1, 0])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from traingraph.runtime.cpu import graph_match
from traingraph.runtime.cpu.kernels import conv_grads
from traingraph.runtime.cpu.native import Arrays, OneOutput, Outputs, output_array
from traingraph.runtime.rewrites.nchwc import as_permutation

__all__ = [
    "FilterReorder",
    "OperandTranspose",
    "as_permutation",
    "permute",
    "split_filter_reorders",
    "split_transposed_operands",
]

TRANSPOSED_OPERAND_MIN_COLUMNS = 512
"""Columns of a weight gradient's product (``Gemm(x, dy, transA=1)``, ``dy`` ``[M, N]``) from
which its transposed operand is copied before the segment: onnxruntime's GEMM transposes ``x``
block by block, once per panel of ``dy`` (GPT-2's ``[512, 3072]`` by ``[512, 768]`` on one thread:
14.2 ms, 11.2 with ``x`` transposed first, the copy 0.5 of them); with fewer columns the copy
costs about what it saves (``[800, 768]`` by ``[800, 192]``: 1.37 against 1.42 ms)."""


def permute(
    src: np.ndarray,
    dst: np.ndarray,
    dims: list[int],
    perm: list[int],
    threads: int,
    reversed_axes: tuple[int, ...] = (),
) -> None:
    """Write ``src.reshape(dims).transpose(perm)`` into ``dst`` (float32, C-contiguous, of
    ``prod(dims)`` elements each), the axes ``reversed_axes`` of ``src.reshape(dims)`` read
    back to front, with the native kernel, or numpy where it is not built.

    Raises:
        ValueError: Where the sizes or the permutation do not fit (from the native kernel).
    """
    native = conv_grads.NATIVE
    if native is not None and hasattr(native, "permute"):
        native.permute(src, dst, dims, perm, threads, reversed_axes)
        return
    if src.size != math.prod(dims) or dst.size != src.size:
        raise ValueError(
            f"permute: src has {src.size} and dst {dst.size} elements; dims {dims} give"
            f" {math.prod(dims)}: both must hold prod(dims)"
        )
    flips = tuple(slice(None, None, -1 if a in reversed_axes else 1) for a in range(len(dims)))
    dst.reshape(-1)[:] = src.reshape(dims)[flips].transpose(perm).reshape(-1)


@dataclass(frozen=True)
class FilterReorder(OneOutput):
    """``out = src.reshape(dims).transpose(perm).reshape(shape)``, float32, by :func:`permute`.

    Attributes:
        src: The value reordered (a filter the segment reads).
        out: The reordered value.
        dims: The axes ``src`` is split into.
        perm: Their order in ``out``.
        shape: ``out``'s shape.
    """

    src: str
    out: str
    dims: tuple[int, ...]
    perm: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def inputs(self) -> list[str]:
        return [self.src]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        target = output_array(out, self.out, self.shape)
        permute(values[self.src], target, list(self.dims), list(self.perm), threads)


@dataclass(frozen=True)
class OperandTranspose(OneOutput):
    """``out = src.T`` for a 2-D float32 ``src`` whose shape is known only at run time (a
    dynamic batch), by :func:`permute`.

    Attributes:
        src: The value transposed.
        out: Its transpose.
    """

    src: str
    out: str

    @property
    def inputs(self) -> list[str]:
        return [self.src]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        src = values[self.src]
        if src.ndim != 2:
            raise ValueError(
                f"operand transpose {self.out!r}: {self.src!r} has shape {list(src.shape)};"
                " expected a matrix"
            )
        target = output_array(out, self.out, (src.shape[1], src.shape[0]))
        permute(src, target, list(src.shape), [1, 0], threads)


def split_filter_reorders(
    model: onnx.ModelProto, taken: Set[str] = frozenset()
) -> tuple[onnx.ModelProto, list[FilterReorder]]:
    """``model`` (a segment, rewritten for the CPU) without each chain of ``Reshape`` and
    ``Transpose`` nodes, at least one a Transpose, that starts at a float32 graph input
    ``src`` (a filter: the blocked layout's ``Reshape``, ``Transpose``, ``Reshape``, an input
    gradient's swap of a filter's axes, or both), whose shapes are constants of positive sizes
    (or ``src``'s static shape, where a Transpose reads it) and whose intermediate values only
    the next node reads: its result becomes a graph input, and a :class:`FilterReorder`
    computes it, the chain's permutations composed into one copy. ``taken``: names the result
    may not have (values of other segments); such chains stay. ``model`` itself and ``[]``
    where the native copy is missing or nothing matches."""
    native = conv_grads.NATIVE
    graph = model.graph
    if native is None or not hasattr(native, "permute"):
        return model, []
    if not any(n.op_type == "Transpose" for n in graph.node) or graph_match.has_subgraphs(model):
        return model, []
    g = graph_match.GraphIndex.of(graph)
    constants = graph_match.constant_values(graph)
    floats = {
        i.name: _static(graph_match.value_dims(i))
        for i in graph.input
        if graph_match.elem_type(i) == onnx.TensorProto.FLOAT
    }

    def sizes(name: str) -> list[int] | None:
        value = constants.get(name)
        if value is None or value.dtype != np.int64 or value.ndim != 1:
            return None
        dims = [int(d) for d in value]
        return dims if all(d > 0 for d in dims) else None

    reorders: list[FilterReorder] = []
    removed: set[int] = set()
    for src, shape in floats.items():
        for first in sorted(g.consumers.get(src, set()) - removed):
            chain = _chain(g, src, first, shape, sizes)
            if chain is None:
                continue
            nodes, positions, out_shape = chain
            out = g.nodes[nodes[-1]].output[0]
            if _folded_into_products(g, nodes, out):
                continue
            found = as_permutation(positions, positions.size)
            if found is None or out in g.outputs or out in taken:
                continue
            dims, perm = found
            reorders.append(FilterReorder(src, out, tuple(dims), tuple(perm), out_shape))
            removed |= set(nodes)
    if not reorders:
        return model, []
    split_model = onnx.ModelProto()
    split_model.CopyFrom(model)
    del split_model.graph.node[:]
    split_model.graph.node.extend(n for i, n in enumerate(g.nodes) if i not in removed)
    split_model.graph.input.extend(
        helper.make_tensor_value_info(r.out, onnx.TensorProto.FLOAT, list(r.shape))
        for r in reorders
    )
    # the shapes' constants, where nothing else reads them
    read = {v for n in split_model.graph.node for v in n.input}
    unread = {v for i in removed for v in g.nodes[i].input[1:] if v not in read}
    nodes = [n for n in split_model.graph.node if not set(n.output) <= unread]
    initializers = [t for t in split_model.graph.initializer if t.name not in unread]
    del split_model.graph.node[:], split_model.graph.initializer[:]
    split_model.graph.node.extend(nodes)
    split_model.graph.initializer.extend(initializers)
    return split_model, reorders


def split_transposed_operands(
    model: onnx.ModelProto, taken: Set[str] = frozenset()
) -> tuple[onnx.ModelProto, list[OperandTranspose]]:
    """``model`` (a segment) with each ``Gemm(a, b, transA=1)`` whose ``a`` is a 2-D float32
    graph input (its sizes may be known only at run time) and whose ``b`` has at least
    :data:`TRANSPOSED_OPERAND_MIN_COLUMNS` columns reading ``a`` transposed, a new graph input
    that an :class:`OperandTranspose` writes before the segment, with ``transA=0``: the same
    products (a weight gradient's ``x`` transposed). One copy serves every such Gemm of one
    ``a``. ``taken``: names the copy may not have. ``model`` itself and ``[]`` where the native
    copy is missing or nothing matches."""
    native = conv_grads.NATIVE
    graph = model.graph
    if native is None or not hasattr(native, "permute"):
        return model, []
    gemms = [
        i for i, n in enumerate(graph.node)
        if n.op_type == "Gemm" and n.domain in ("", "ai.onnx") and len(n.input) >= 2
        and any(a.name == "transA" and a.i == 1 for a in n.attribute)
    ]  # fmt: skip
    if not gemms or graph_match.has_subgraphs(model):
        return model, []
    matrices = {
        i.name: dims
        for i in graph.input
        if graph_match.elem_type(i) == onnx.TensorProto.FLOAT
        and len(dims := graph_match.value_dims(i)) == 2
    }
    shapes = graph_match.inferred_shapes(model)
    copies: dict[str, OperandTranspose] = {}
    rewritten: dict[int, onnx.NodeProto] = {}
    for i in gemms:
        node = graph.node[i]
        a, b = node.input[0], node.input[1]
        b_shape = shapes.get(b)
        if a not in matrices or b_shape is None or len(b_shape) != 2:
            continue
        trans_b = any(x.name == "transB" and x.i == 1 for x in node.attribute)
        columns = b_shape[0] if trans_b else b_shape[1]
        if columns is None or columns < TRANSPOSED_OPERAND_MIN_COLUMNS:
            continue
        if a not in copies:
            out = f"{a}/transposed"
            if out in taken or any(out == v.name for v in graph.input):
                continue
            copies[a] = OperandTranspose(a, out)
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[0] = copies[a].out
        kept = [x for x in copy.attribute if x.name != "transA"]
        del copy.attribute[:]
        copy.attribute.extend(kept)
        rewritten[i] = copy
    if not rewritten:
        return model, []
    split_model = onnx.ModelProto()
    split_model.CopyFrom(model)
    for i, node in rewritten.items():
        split_model.graph.node[i].CopyFrom(node)
    split_model.graph.input.extend(
        helper.make_tensor_value_info(r.out, onnx.TensorProto.FLOAT, matrices[r.src][::-1])
        for r in copies.values()
    )
    return split_model, list(copies.values())


def _folded_into_products(g: graph_match.GraphIndex, nodes: list[int], out: str) -> bool:
    """Whether the chain ``nodes`` is one Transpose of the last two axes that only MatMuls
    read: onnxruntime folds such a Transpose into the product (its ``FusedMatMul``), so it
    costs nothing there."""
    node = g.nodes[nodes[0]]
    if len(nodes) != 1 or node.op_type != "Transpose":
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if perm is None or len(perm) < 2:
        return False
    rank = len(perm)
    swaps_last_two = perm == [*range(rank - 2), rank - 1, rank - 2]
    readers = g.consumers.get(out, set())
    return swaps_last_two and bool(readers) and all(
        g.nodes[r].op_type == "MatMul" and g.nodes[r].domain in ("", "ai.onnx") for r in readers
    )


def _static(dims: list[int | None]) -> list[int] | None:
    """``dims`` where every one is a known positive size, else None."""
    known = [d for d in dims if d is not None and d > 0]
    return known if dims and len(known) == len(dims) else None


def _chain(
    g: graph_match.GraphIndex,
    src: str,
    first: int,
    shape: list[int] | None,
    sizes: Callable[[str], list[int] | None],
) -> tuple[list[int], np.ndarray, tuple[int, ...]] | None:
    """The ``Reshape`` and ``Transpose`` nodes from node ``first`` (a reader of ``src``, of
    ``shape`` where known) on, each value read by the next node alone; the positions in ``src``
    of its result's elements, and the result's shape. None where there is no Transpose."""
    nodes: list[int] = []
    value = src
    positions = None if shape is None else np.arange(math.prod(shape)).reshape(shape)
    i: int | None = first
    while i is not None:
        node = g.nodes[i]
        if node.domain not in ("", "ai.onnx") or not node.input or node.input[0] != value:
            break
        if node.op_type == "Reshape":
            new = sizes(node.input[1]) if len(node.input) > 1 else None
            if new is None or (positions is not None and math.prod(new) != positions.size):
                break
            positions = (
                np.arange(math.prod(new)) if positions is None else positions
            ).reshape(new)
        elif node.op_type == "Transpose" and positions is not None:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            perm = perm if perm is not None else list(range(positions.ndim))[::-1]
            if sorted(perm) != list(range(positions.ndim)):
                break
            positions = positions.transpose(perm)
        else:
            break
        nodes.append(i)
        value = node.output[0]
        i = g.only_reader(value)
    if positions is None or positions.size < 2:
        return None
    if not any(g.nodes[k].op_type == "Transpose" for k in nodes):
        return None
    return nodes, np.ascontiguousarray(positions), tuple(positions.shape)
