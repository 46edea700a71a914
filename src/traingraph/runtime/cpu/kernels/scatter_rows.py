"""The row scatter-add of an embedding's gradient, in one native pass on the CPU.

The gradient of a ``Gather`` of a table (an embedding's: BERT's, GPT-2's, an LSTM tagger's)
adds each looked-up row's gradient into its row of a zero table.
:func:`traingraph.autodiff.rules.indexing.scatter_add_rows` writes it, from opset 16, as
``ScatterElements(Expand(0, [D, R]), Expand(Unsqueeze(index, [1]), Shape(rows)), rows, axis=0,
reduction="add")``: the index of row ``i`` repeated across its ``R`` columns. onnxruntime's CPU
ScatterElements walks the ``[M, R]`` indices one element at a time on one thread, after the
Expand has filled the ``[D, R]`` zeros (a vocabulary's worth of rows, every step).

:class:`ScatterAddRows` reads the ``M`` row indices instead of their expanded copy, and for the
zero table only its shape, so both Expands leave the graph where only the scatter reads them. It
writes the table (zeros, or the scatter's data), then adds ``rows[i]`` into row ``index[i]`` for
each ``i`` in order (``_convc.scatter_add_rows``): each sum is the graph's, term by term in its
order, NaN, infinities and signed zeros included (``0 + -0`` is ``+0``). The threads share the
table's rows; each walks every index and adds those in its own rows. A negative index counts
from the end, as ONNX says; an index outside ``[-D, D)`` raises IndexError, where onnxruntime
fails the run.

The matcher takes any float32 ``ScatterElements(axis=0, reduction="add")`` whose indices are an
Expand, to the updates' shape (``Shape(updates)``, or a constant equal to its static shape), of
``Unsqueeze(v, [1])`` or of another ``[M, 1]`` value, and whose data is any 2-D tensor or zeros
(an Expand of a one-element ``+0.0`` constant, or a ``ConstantOfShape`` of ``+0.0``). The
load-time check (:func:`traingraph.runtime.cpu.verify.verified_kernels`) feeds the nodes valid
indices, repeated and negative, with a small table of the updates' width, and compares bit for
bit, on finite values and then with NaN, infinities and negative zeros in the updates and data.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

Shapes = Mapping[str, list[int | None]]


@dataclass(frozen=True)
class ScatterAddRows(OneOutput):
    """``out = table`` (zeros of the shape ``table`` where ``zeros``), then ``out[index[i]] +=
    updates[i]`` for each ``i`` in order.

    Attributes:
        index: The row indices: ``[M]``, or ``[M, 1]`` (one of either broadcast to every row),
            any integer type.
        updates: The rows added, ``[M, R]``.
        out: The result ``[D, R]``.
        table: The float32 table ``[D, R]`` the rows are added into, or, where ``zeros``, the
            int64 shape ``[D, R]`` of a table of zeros.
        zeros: Whether the rows are added into zeros.
    """

    index: str
    updates: str
    out: str
    table: str
    zeros: bool = False

    @property
    def inputs(self) -> list[str]:
        return [self.index, self.updates, self.table]

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there).

        Raises:
            ValueError: The shapes are not those of :class:`ScatterAddRows`.
            IndexError: An index is outside ``[-D, D)``.
        """
        updates, table = values[self.updates], values[self.table]
        data = None if self.zeros else table
        dims = tuple(int(d) for d in np.asarray(table).reshape(-1)) if self.zeros else table.shape
        index = np.asarray(values[self.index])
        if len(dims) != 2 or updates.ndim != 2 or not _rows(index):
            raise ValueError(
                f"scatter_add_rows {self.out!r}: index {list(index.shape)}, updates"
                f" {list(updates.shape)}, table {list(dims)}; expected index [M] or [M, 1],"
                " updates [M, R] and a table [D, R] (a graph whose ScatterElements reads these"
                " fails too: check the shapes of the Gather it differentiates)"
            )
        flat = np.ascontiguousarray(index.reshape(-1), np.int64)
        if flat.size == 1 and updates.shape[0] != 1:  # Expand broadcasts one row's index
            flat = np.full(updates.shape[0], flat[0], np.int64)
        assert NATIVE is not None
        target = output_array(out, self.out, (dims[0], dims[1]))
        NATIVE.scatter_add_rows(flat, updates, data, target, threads)


def _rows(index: np.ndarray) -> bool:
    """Whether ``index`` holds one integer per row: ``[M]`` or ``[M, 1]``."""
    return index.dtype.kind in "iu" and (
        index.ndim == 1 or (index.ndim == 2 and index.shape[1] == 1)
    )


def split_scatter_add_rows(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[ScatterAddRows, set[int]]]:
    """Each row scatter-add of float32 ``model`` (see the module) as a
    :class:`ScatterAddRows` with the indices of the nodes it replaces (the scatter, and the
    Expands, Unsqueeze and Shape that only it reads; none in ``taken``), checked numerically.
    ``[]`` where the extension is missing or nothing matches."""
    if not graph_match.can_match(model, "scatter_add_rows", "ScatterElements"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    constants = graph_match.constant_values(model.graph)
    shapes = graph_match.inferred_shapes(model)
    columns = _Columns(model)
    matches = graph_match.claim_matches(
        g,
        "ScatterElements",
        taken,
        lambda i, claimed: _match(g, i, constants, shapes, claimed, columns),
    )
    return verify.verified_kernels(model, g, matches, shapes, check=_Check(g, shapes, constants))


class _Columns:
    """Which integer values of ``model`` have the inferred shape ``[M, 1]``: shape inference
    runs once, and only where a matcher asks (the Unsqueeze form needs none)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._names: set[str] | None = None

    def __contains__(self, name: object) -> bool:
        if self._names is None:
            try:
                graph = onnx.shape_inference.infer_shapes(self._model).graph
            except Exception:  # without shapes no column is known
                graph = onnx.GraphProto()
            self._names = {
                v.name
                for v in [*graph.value_info, *graph.input, *graph.output]
                if v.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
                and (dims := graph_match.value_dims(v))
                and len(dims) == 2 and dims[1] == 1
            }  # fmt: skip
        return name in self._names


def _plus_zero(value: np.ndarray | None) -> bool:
    """Whether ``value`` is a float32 ``+0.0`` of one element, of rank 2 or less."""
    return (
        value is not None and value.dtype == np.float32 and value.size == 1
        and value.ndim <= 2 and float(value.reshape(-1)[0]) == 0.0
        and not np.signbit(value.reshape(-1)[0])
    )  # fmt: skip


def _zeros(
    g: graph_match.GraphIndex, data: str, constants: Mapping[str, np.ndarray], taken: Set[int]
) -> tuple[int, str] | None:
    """Where ``data`` is zeros (``Expand`` of a one-element ``+0.0`` constant, or
    ``ConstantOfShape`` of ``+0.0``): the node's index and the shape it reads."""
    expand = g.produced_by(data, "Expand", taken)
    if expand is not None and len(expand[1].input) == 2:
        plus_zero = _plus_zero(constants.get(expand[1].input[0]))
        return (expand[0], expand[1].input[1]) if plus_zero else None
    fill = g.produced_by(data, "ConstantOfShape", taken)
    if fill is None or len(fill[1].input) != 1:
        return None
    value = next((a.t for a in fill[1].attribute if a.name == "value"), None)
    zero = np.zeros(1, np.float32) if value is None else numpy_helper.to_array(value)
    return (fill[0], fill[1].input[0]) if _plus_zero(zero) else None


def _updates_shape(
    g: graph_match.GraphIndex,
    value: str,
    updates: str,
    shapes: Shapes,
    constants: Mapping[str, np.ndarray],
    taken: Set[int],
) -> set[int] | None:
    """Where ``value`` is the shape of ``updates`` (``Shape(updates)``, or a constant of its
    static shape): the Shape node's index, or none for a constant; else None."""
    if value in constants:
        dims = shapes.get(updates)
        wanted = list(dims) if dims and None not in dims else None
        return set() if constants[value].reshape(-1).tolist() == wanted else None
    found = g.produced_by(value, "Shape", taken)
    if found is None or found[1].input[0] != updates or found[1].attribute:
        return None
    return {found[0]}


def _match(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    taken: Set[int],
    columns: _Columns,
) -> tuple[ScatterAddRows, set[int]] | None:
    scatter = g.nodes[i]
    attrs = graph_match.attributes(scatter)
    if len(scatter.input) != 3 or attrs.get("reduction") != b"add":
        return None
    if attrs.get("axis", 0) not in (0, -2):
        return None
    data, indices, updates = scatter.input
    dims, update_dims = shapes.get(data), shapes.get(updates)
    if dims is None or len(dims) != 2 or update_dims is None:
        return None  # not float32, or not 2-D
    expand = g.produced_by(indices, "Expand", taken)
    if expand is None or len(expand[1].input) != 2:
        return None
    column, target = expand[1].input
    shape_nodes = _updates_shape(g, target, updates, shapes, constants, taken)
    if shape_nodes is None:
        return None
    candidates = {i, expand[0], *shape_nodes}
    unsqueeze = g.produced_by(column, "Unsqueeze", taken)
    if unsqueeze is not None and _unsqueezes_to_column(unsqueeze[1], constants):
        candidates.add(unsqueeze[0])
    elif column not in columns:
        return None
    zeros = _zeros(g, data, constants, taken)
    if zeros is not None:
        candidates.add(zeros[0])
    nodes = graph_match.exclusive_cone(g, i, candidates)
    index = unsqueeze[1].input[0] if unsqueeze is not None and unsqueeze[0] in nodes else column
    if zeros is not None and zeros[0] in nodes:
        return ScatterAddRows(index, updates, scatter.output[0], zeros[1], zeros=True), nodes
    return ScatterAddRows(index, updates, scatter.output[0], data), nodes


def _unsqueezes_to_column(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> bool:
    """Whether ``node`` is ``Unsqueeze(v, [1])`` (or ``[-1]``): a vector ``v`` as a column (any
    other rank makes the scatter's indices of another rank than its updates, which fails)."""
    if len(node.input) != 2:
        return False
    axes = constants.get(node.input[1])
    return axes is not None and axes.reshape(-1).tolist() in ([1], [-1])


CHECK_ROWS = 64
"""The updates' rows of the load-time check where their count is not static: indices drawn over
the whole table, negative ones among them, with rows 0, 1 and 2 adding into one row."""


class _Check(verify.Check):
    """Valid indices (random ones would fall outside the table, and onnxruntime fails), drawn
    over a table of the updates' width and at least 65536 elements (the threads share it),
    each run compared bit for bit: the finite run on one thread, the non-finite one on two."""

    def __init__(
        self, g: graph_match.GraphIndex, shapes: Shapes, constants: Mapping[str, np.ndarray]
    ) -> None:
        self.g = g
        self.shapes = shapes
        self.constants = constants
        self.fixed: dict[str, np.ndarray] = {}  # constants a kernel reads, which are not fed

    def form(self, kernel: ScatterAddRows, nodes: set[int]) -> Hashable | None:
        """Matches of one form and widths share one check (the check's table is its own)."""
        roles = {v: role for role, v in vars(kernel).items() if isinstance(v, str)}
        width = (self.shapes.get(kernel.updates) or [None, None])[-1]
        return self.g.form(nodes, roles), width

    def inputs(
        self, matches: Sequence[tuple[ScatterAddRows, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        rng = np.random.default_rng(0)
        return [self._feeds(kernel, nodes, rng) for kernel, nodes in matches]

    def _feeds(
        self, kernel: ScatterAddRows, nodes: set[int], rng: np.random.Generator
    ) -> dict[str, np.ndarray] | None:
        """What ``nodes`` read from outside, for one check; None where one of them is none
        of the kernel's values (nor the updates' shape)."""
        count, width = self.shapes.get(kernel.updates) or [None, None]
        m = int(count) if isinstance(count, int) and count > 0 else CHECK_ROWS
        r = int(width) if isinstance(width, int) and width > 0 else 8
        d = max(11, math.ceil((1 << 16) / r))
        if kernel.index in self.g.constants or kernel.updates in self.g.constants:
            return None
        if kernel.table in self.g.constants:  # the zeros' shape: the check takes its table
            dims = self.constants.get(kernel.table) if kernel.zeros else None
            if dims is None or dims.size != 2 or not (dims.reshape(-1) >= (5, 1)).all():
                return None
            d, r = (int(v) for v in dims.reshape(-1))
            self.fixed[kernel.table] = dims
        index = rng.integers(-d, d, max(m, 5))
        index[1] = index[0]
        index[2] = index[0] - d if index[0] >= 0 else index[0] + d  # the same row, signed
        index[3], index[4] = 1, 2 - d  # the table's rows the non-finite run poisons
        index = index[:m]
        rows = rng.standard_normal((m, r), dtype=np.float32)
        rows[:, 0] = -0.0  # each sum of that column of zeros, signed
        table: np.ndarray
        if kernel.zeros:
            table = np.array([d, r], np.int64)
        else:
            table = rng.standard_normal((d, r), dtype=np.float32)
            table[:, 0] = -0.0
        known: dict[str, np.ndarray] = {
            kernel.updates: rows,
            kernel.index: index if _vector_read(self.g, kernel, nodes) else index[:, None],
            kernel.table: table,
        }
        produced = {o for n in nodes for o in self.g.nodes[n].output}
        read = {v for n in nodes for v in self.g.nodes[n].input if v}
        feeds: dict[str, np.ndarray] = {}
        for name in sorted(read - produced - self.g.constants):
            if name in known:
                feeds[name] = known[name]
            elif self._is_updates_shape(name, kernel.updates):
                feeds[name] = np.array([m, r], np.int64)
            else:
                return None
        return feeds

    def _is_updates_shape(self, name: str, updates: str) -> bool:
        found = self.g.produced_by(name, "Shape")
        return found is not None and found[1].input[0] == updates and not found[1].attribute

    def runs(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The feeds, then with NaN, infinities (``inf`` and ``-inf`` into one element) and a
        NaN of another sign and payload in the updates and the table."""
        poisoned = dict(feeds)
        other_nan = np.array([0xFFC00123], np.uint32).view(np.float32)[0]
        spots = [((0, 1), np.inf), ((1, 1), -np.inf), ((2, 1), np.nan), ((1, 2), other_nan),
                 ((2, 2), np.nan), ((3, 3), np.inf), ((-1, -1), -np.inf)]  # fmt: skip
        for name, value in feeds.items():
            if value.dtype == np.float32 and value.ndim == 2 and value.shape[0] > 3:
                copy = value.copy()
                for (row, column), fill in spots:
                    copy[row, column % copy.shape[1]] = fill
                poisoned[name] = copy
        return [feeds, poisoned]

    def agrees(
        self, kernel: ScatterAddRows, values: verify.Values, expected: verify.Values, run: int
    ) -> bool:
        got: dict[str, np.ndarray] = {}
        try:
            kernel.compute({**self.fixed, **values}, got, 1 + run % 2)
        except (ValueError, IndexError):
            return False
        want = expected[kernel.out]
        result = got[kernel.out]
        return result.shape == want.shape and bool(
            np.array_equal(result.view(np.uint32), want.view(np.uint32))
        )


def _vector_read(g: graph_match.GraphIndex, kernel: ScatterAddRows, nodes: set[int]) -> bool:
    """Whether the kernel reads the vector that an Unsqueeze among ``nodes`` makes a column."""
    return any(
        g.nodes[n].op_type == "Unsqueeze" and g.nodes[n].input[0] == kernel.index for n in nodes
    )


__all__ = ["ScatterAddRows", "split_scatter_add_rows"]
