"""An LSTM's forward steps with each step's gate math in one native pass on the CPU.

The LSTM gradient rule (:func:`traingraph.autodiff.rules.recurrent_steps.lstm_forward`)
replaces the node by its forward written step by step, every direction stacked (``[D,
features, N]``): per step the recurrence ``MatMul`` and eighteen elementwise, ``Split`` and
``Concat`` ops on the step's small tensors, which also make what the backward reads (the
gates' slopes, ``o (1 - tanh^2 c)`` and the forget gate). onnxruntime runs each of those ops
as one pass with its own dispatch, and they do not scale with threads: at two threads they
took twice as long as the step's ``MatMul`` (the zoo's LSTM tagger, onnxruntime's profiler).

:class:`LstmForward` runs a whole chain of such steps between two onnxruntime segments: each
step's ``MatMul`` on onnxruntime (a session of that one op, so the products are the graph's),
then ``_convc.lstm_cell``, the eighteen ops' float operations in their order in one pass
(no fused multiply-adds), with the Sigmoid and Tanh computed there as onnxruntime's within
their rounding (about 1e-7) and at their ends (0 and 1, -1 and 1 for infinities, NaN for
NaN). The load-time check (:func:`traingraph.runtime.cpu.verify.verified_kernels`) compares
the kernel with its nodes, non-finite inputs included, with the recurrence weights at an
initialized LSTM's scale: under larger ones the recurrence is chaotic, and the Sigmoid's and
Tanh's rounding differences would grow over the steps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, verify
from traingraph.runtime.cpu.kernels.products import Product
from traingraph.runtime.cpu.native import NATIVE, Arrays, Outputs, output_array

_DEFAULT = ("", "ai.onnx")


@dataclass(frozen=True)
class CellStep:
    """One step's values: what it reads (``h_prev``, ``c_prev``, ``piece`` the input
    projection and biases, ``[D, 4H, N]``) and writes (``h``, ``c``, ``slope`` ``[D, 4H,
    N]``, ``through`` and the forget gate ``f``)."""

    h_prev: str
    c_prev: str
    piece: str
    h: str
    c: str
    slope: str
    through: str
    f: str

    @property
    def carried(self) -> tuple[tuple[str, str], ...]:
        """What the step reads of the one before, paired with what it passes to the next."""
        return (self.h_prev, self.h), (self.c_prev, self.c)


@dataclass(frozen=True)
class LstmForward:
    """A chain of LSTM steps: per step ``gates = R h_prev + piece`` (``R`` ``[D, 4H, H]``),
    then the cell (``_convc.lstm_cell``).

    Attributes:
        r: The recurrence weights every step multiplies by.
        steps: The steps in the order they run (each reads the one before's ``h`` and ``c``).
        written: The steps' values that nodes outside the chain read (or the model outputs).
        projection: Where the chain holds the ``Split`` of the input projection into its
            steps' pieces: the projection (``[D, 4H, T*N]``, every step's columns side by
            side), which the cell reads in place; else None.
        places: With ``projection``: the column block of each step's piece.
    """

    r: str
    steps: tuple[CellStep, ...]
    written: tuple[str, ...]
    projection: str | None = None
    places: tuple[int, ...] = ()

    recurrence_axes = (2, 4)
    """``R``'s axis of ``H`` entries and its gates (:func:`_recurrence_shape`)."""

    @property
    def inputs(self) -> list[str]:
        first = self.steps[0]
        pieces = [self.projection] if self.projection else [s.piece for s in self.steps]
        return [self.r, first.h_prev, first.c_prev, *pieces]

    @property
    def outputs(self) -> list[str]:
        return list(self.written)

    def check_shapes(self, r: tuple[int, ...], batch: int) -> dict[str, tuple[int, ...]]:
        """The shape of each input for ``R`` of shape ``r`` and a batch of ``batch``."""
        gates, state = (r[0], r[1], batch), (r[0], r[2], batch)
        first = self.steps[0]
        shapes = {self.r: r, first.h_prev: state, first.c_prev: state}
        if self.projection is not None:
            return shapes | {self.projection: (*gates[:2], batch * len(self.places))}
        return shapes | {s.piece: gates for s in self.steps}

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write :attr:`outputs` into ``out`` (in place where arrays of their shapes are
        there) from ``values``."""
        assert NATIVE is not None
        r = np.ascontiguousarray(values[self.r], np.float32)
        h = np.ascontiguousarray(values[self.steps[0].h_prev], np.float32)
        c = np.ascontiguousarray(values[self.steps[0].c_prev], np.float32)
        if (
            r.ndim != 3
            or h.ndim != 3
            or r.shape[1] != 4 * r.shape[2]
            or h.shape[:2] != (r.shape[0], r.shape[2])
            or c.shape != h.shape
        ):
            raise ValueError(
                f"LSTM steps of {self.r!r}: R {list(r.shape)}, h {list(h.shape)}, c"
                f" {list(c.shape)}; expected R [D, 4H, H] and states [D, H, N]"
            )
        state, gates = h.shape, (r.shape[0], r.shape[1], h.shape[2])
        written = set(self.written)
        roles = {"slope": gates, "through": state, "f": state}
        scratch = {role: np.empty(shape, np.float32) for role, shape in roles.items()}
        states = {"h": [np.empty(state, np.float32) for _ in range(2)],
                  "c": [np.empty(state, np.float32) for _ in range(2)]}  # fmt: skip
        mm = np.empty(gates, np.float32)
        matmul = Product("MatMul", threads)
        width, stride, projection = 0, 0, None
        if self.projection is not None:
            projection = np.ascontiguousarray(values[self.projection], np.float32)
            width, stride = gates[2], gates[2] * len(self.places)
            if projection.shape != (*gates[:2], stride):
                raise ValueError(
                    f"LSTM steps of {self.r!r}: the projection {self.projection!r} is"
                    f" {list(projection.shape)}; expected {[*gates[:2], stride]} (the steps'"
                    " gates side by side)"
                )
        for k, step in enumerate(self.steps):
            piece = projection
            if piece is None:
                piece = np.ascontiguousarray(values[step.piece], np.float32)
                if piece.shape != gates:
                    raise ValueError(
                        f"LSTM step {k}: {step.piece!r} is {list(piece.shape)}; expected"
                        f" {list(gates)} (R h_prev's shape)"
                    )

            def array(role: str, k: int = k, step: CellStep = step) -> np.ndarray:
                name = getattr(step, role)
                if name in written:
                    return output_array(out, name, roles.get(role, state))
                return states[role][k % 2] if role in states else scratch[role]

            h_next, c_next = array("h"), array("c")
            matmul(r, h, mm)
            offset = self.places[k] * width if projection is not None else 0
            NATIVE.lstm_cell(
                mm, piece, c, h_next, c_next, array("slope"), array("through"), array("f"),
                state[1] * state[2], threads, width, stride, offset,
            )  # fmt: skip
            h, c = h_next, c_next


def split_lstm_forwards(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[LstmForward, set[int]]]:
    """Each chain of LSTM steps of the rule's form in float32 ``model`` whose intermediate
    values only the chain reads, as an :class:`LstmForward` with the indices of its nodes
    (none in ``taken``), checked numerically. ``[]`` where the extension is missing or nothing
    matches."""
    if not graph_match.can_match(model, "lstm_cell", "Sigmoid"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    constants = graph_match.constant_values(model.graph)
    shapes = graph_match.inferred_shapes(model)
    found = [
        match
        for i, node in enumerate(g.nodes)
        if i not in taken and node.op_type == "MatMul" and node.domain in _DEFAULT
        and (match := _step(g, i, constants, taken)) is not None
    ]  # fmt: skip
    matches = []
    for r, steps, members in _chains(found):
        first = steps[0]
        projection, places = _projection_pieces(g, steps, taken)
        if projection is not None:
            members.add(g.producer[first.piece])  # the Split
        written = g.external(members)
        allowed = {v for s in steps for v in (s.h, s.c, s.slope, s.through, s.f)}
        if len(steps) > 1 and written <= allowed:
            ordered = tuple(v for s in steps for v in (s.h, s.c, s.slope, s.through, s.f)
                            if v in written)  # fmt: skip
            kernel = LstmForward(r, tuple(steps), ordered, projection, places)
            matches.append((kernel, members))
    return verify.verified_kernels(model, g, matches, shapes, check=_InitScale(shapes))


def _projection_pieces(
    g: graph_match.GraphIndex, steps: Sequence[CellStep], taken: Set[int]
) -> tuple[str | None, tuple[int, ...]]:
    """Where every step's piece is an output of one ``Split`` into equal parts along the last
    axis (of rank 3) that only the chain reads, the split value and the place of each step's
    piece among the parts; else ``(None, ())``."""
    producer = g.producer.get(steps[0].piece)
    if producer is None or producer in taken:
        return None, ()
    split = g.nodes[producer]
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    pieces = [s.piece for s in steps]
    if split.op_type != "Split" or split.domain not in _DEFAULT or axis not in (2, -1):
        return None, ()
    if len(split.input) > 1 and split.input[1]:
        return None, ()  # sizes given: the parts need not be equal
    if sorted(split.output) != sorted(pieces) or len(set(pieces)) != len(pieces):
        return None, ()
    if g.only_reader(split.input[0], taken) != producer:
        return None, ()
    place = {v: k for k, v in enumerate(split.output)}
    return split.input[0], tuple(place[v] for v in pieces)


def _recurrence_shape(
    dims: Sequence[int | None] | None, hidden_axis: int, gates: int
) -> tuple[int, ...] | None:
    """The shape ``[D, ., .]`` of recurrence weights whose axis ``hidden_axis`` (1 or 2) has
    ``H`` entries and the other ``gates * H`` (``R``, ``[D, 4H, H]`` for an LSTM, or ``R^T``),
    from ``dims`` with one of the two open (a transpose's ``Reshape`` to ``-1``); None where
    more is open."""
    if dims is None or len(dims) != 3 or not dims[0]:
        return None
    other = 3 - hidden_axis
    hidden, wide = dims[hidden_axis], dims[other]
    if not hidden and wide and wide % gates == 0:
        hidden = wide // gates
    if not hidden:
        return None
    full = [int(dims[0]), 0, 0]
    full[hidden_axis], full[other] = int(hidden), gates * int(hidden)
    return tuple(full) if not wide or wide == full[other] else None


class _InitScale(verify.Check):
    """Standard-normal inputs of the shapes the recurrence weights' shape gives (a batch of
    2; the kernel's ``check_shapes``), but the recurrence weights at the scale of an LSTM's
    initialization (uniform within
    ``1 / sqrt(H)``, PyTorch's): with standard-normal weights of a few hundred columns the
    recurrence is chaotic, and any rounding difference of a Sigmoid or Tanh grows over the
    steps past the check's tolerance."""

    def __init__(self, shapes: Mapping[str, list[int | None]]) -> None:
        self.shapes = shapes

    def form(self, kernel: LstmForward | LstmBackward, nodes: set[int]) -> Hashable | None:
        """The chains of one length and shapes share one check (a stack of layers): the
        matcher fixed every node and its wiring, so that only their inputs' values differ."""
        return len(kernel.steps), tuple(tuple(self.shapes.get(v) or ()) for v in kernel.inputs)

    def inputs(
        self, matches: Sequence[tuple[LstmForward | LstmBackward, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        rng = np.random.default_rng(0)
        drawn: list[dict[str, np.ndarray] | None] = []
        for kernel, _ in matches:
            r_dims = _recurrence_shape(self.shapes.get(kernel.r), *kernel.recurrence_axes)
            if r_dims is None:
                drawn.append(None)
                continue
            shapes = kernel.check_shapes(r_dims, 2)
            feeds = {
                name: rng.standard_normal(shape, dtype=np.float32)
                for name, shape in shapes.items()
            }
            r = feeds[kernel.r]
            weights = rng.uniform(-1.0, 1.0, r.shape) / np.sqrt(max(r.shape[-1], 1))
            feeds[kernel.r] = weights.astype(np.float32)
            drawn.append(feeds)
        return drawn


def _step(
    g: graph_match.GraphIndex, i: int, constants: Mapping[str, np.ndarray], taken: Set[int]
) -> tuple[str, CellStep, set[int]] | None:
    """The step whose recurrence ``MatMul`` is node ``i``: ``(R, the step, its nodes)``."""
    r, h_prev = g.nodes[i].input

    def reader(
        value: str,
        op_type: str,
        inputs: list[str] | None = None,
        *,
        any_order: bool = False,
        outputs: int = 1,
    ) -> tuple[int, onnx.NodeProto] | None:
        for j in sorted(g.consumers.get(value, ())):
            node = g.nodes[j]
            if j in taken or node.op_type != op_type or node.domain not in _DEFAULT:
                continue
            if len(node.output) != outputs:
                continue
            got = list(node.input)
            if inputs is None or got == inputs or (any_order and sorted(got) == sorted(inputs)):
                return j, node
        return None

    def sizes(node: onnx.NodeProto) -> list[int] | None:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        value = constants.get(node.input[1]) if len(node.input) > 1 else None
        return None if axis != 1 or value is None else [int(v) for v in value.reshape(-1)]

    mm = g.nodes[i].output[0]
    consumers = sorted(g.consumers.get(mm, ()))
    if len(consumers) != 1 or g.nodes[consumers[0]].op_type != "Add":
        return None
    add_i = consumers[0]
    add = g.nodes[add_i]
    if add.domain not in _DEFAULT or mm not in add.input or len(add.input) != 2:
        return None
    piece = add.input[1] if add.input[0] == mm else add.input[0]
    split2 = reader(add.output[0], "Split", outputs=2)
    if split2 is None:
        return None
    two = sizes(split2[1])
    if two is None or len(two) != 2 or two[0] != 3 * two[1]:
        return None
    hidden = two[1]
    pre_iof, pre_g = split2[1].output
    sigmoid, tanh_g = reader(pre_iof, "Sigmoid"), reader(pre_g, "Tanh")
    if sigmoid is None or tanh_g is None:
        return None
    iof, gate = sigmoid[1].output[0], tanh_g[1].output[0]
    split3 = reader(iof, "Split", outputs=3)
    if split3 is None or sizes(split3[1]) != [hidden] * 3:
        return None
    i_, o_, f_ = split3[1].output
    ig = reader(i_, "Mul", [i_, gate])
    fc = next(
        (
            (j, g.nodes[j]) for j in sorted(g.consumers.get(f_, ()))
            if j not in taken and g.nodes[j].op_type == "Mul" and g.nodes[j].domain in _DEFAULT
            and list(g.nodes[j].input)[0] == f_ and len(g.nodes[j].input) == 2
        ),
        None,
    )  # fmt: skip
    if ig is None or fc is None:
        return None
    c_prev = fc[1].input[1]
    ig_v, fc_v = ig[1].output[0], fc[1].output[0]
    c_add = reader(fc_v, "Add", [fc_v, ig_v])
    if c_add is None:
        return None
    c = c_add[1].output[0]
    tanh_c = reader(c, "Tanh")
    if tanh_c is None:
        return None
    tc = tanh_c[1].output[0]
    h_mul = reader(tc, "Mul", [o_, tc])
    if h_mul is None:
        return None
    h = h_mul[1].output[0]
    x_cat = reader(ig_v, "Concat", [ig_v, h, fc_v])
    one_minus = reader(iof, "Sub")
    igg = reader(ig_v, "Mul", [ig_v, gate])
    hth = reader(h, "Mul", [h, tc])
    if None in (x_cat, one_minus, igg, hth):
        return None
    assert x_cat and one_minus and igg and hth
    one = constants.get(one_minus[1].input[0])
    if one_minus[1].input[1] != iof or one is None or one.size != 1 or float(one.item()) != 1.0:
        return None
    x_v, om_v = x_cat[1].output[0], one_minus[1].output[0]
    slope_iof = reader(x_v, "Mul", [x_v, om_v])
    slope_g = reader(igg[1].output[0], "Sub", [i_, igg[1].output[0]])
    through = reader(hth[1].output[0], "Sub", [o_, hth[1].output[0]])
    if slope_iof is None or slope_g is None or through is None:
        return None
    sl_v, sg_v = slope_iof[1].output[0], slope_g[1].output[0]
    slope = reader(sl_v, "Concat", [sl_v, sg_v])
    if slope is None:
        return None
    parts = [split2, sigmoid, tanh_g, split3, ig, fc, c_add, tanh_c, h_mul, x_cat, one_minus,
             igg, hth, slope_iof, slope_g, through, slope]  # fmt: skip
    nodes = {i, add_i} | {j for j, _ in parts}
    for k in (x_cat, slope):
        if next((a.i for a in k[1].attribute if a.name == "axis"), None) != 1:
            return None
    step = CellStep(h_prev, c_prev, piece, h, c, slope[1].output[0], through[1].output[0], f_)
    outside = {step.h, step.c, step.slope, step.through, step.f}
    for j in nodes:
        for v in g.nodes[j].output:
            if v not in outside and (v in g.outputs or not g.consumers.get(v, set()) <= nodes):
                return None
    return r, step, nodes


@dataclass(frozen=True)
class GradStep:
    """One backward step's values: what it reads (``back`` the gates' gradient of the step
    after it, ``dy`` the gradient of its output or None, ``dc_next`` and ``f_next`` the cell
    gradient and the forget gate of the step after it, its ``through`` and ``slope``) and
    writes (its cell gradient ``dc`` and gates' gradient ``dgates``)."""

    back: str
    dy: str | None
    dc_next: str
    f_next: str
    through: str
    slope: str
    dc: str
    dgates: str

    @property
    def carried(self) -> tuple[tuple[str, str], ...]:
        """What the step reads of the one before, paired with what it passes to the next."""
        return (self.back, self.dgates), (self.dc_next, self.dc)


_Step = TypeVar("_Step", CellStep, GradStep)


def _chains(
    found: Sequence[tuple[str, _Step, set[int]]],
) -> Iterator[tuple[str, list[_Step], set[int]]]:
    """The chains of the steps ``found`` (each with its weights and nodes): each step reads
    what the one before passes on (:attr:`CellStep.carried`) and multiplies by the same
    weights. Yields each chain's weights, steps in order and nodes."""
    by_entry = {step.carried[0][0]: (r, step, nodes) for r, step, nodes in found}
    passed = {step.carried[0][1] for _, step, _ in found}
    for r, first, nodes in found:
        if first.carried[0][0] in passed:
            continue  # not the first step of its chain
        steps, members = [first], set(nodes)
        while steps[-1].carried[0][1] in by_entry:
            r_next, following, more = by_entry[steps[-1].carried[0][1]]
            links = zip(following.carried, steps[-1].carried)
            if r_next != r or any(read != given for (read, _), (_, given) in links):
                break
            steps.append(following)
            members |= more
        yield r, steps, members


@dataclass(frozen=True)
class LstmBackward:
    """A chain of LSTM backward steps: per step ``dh = R^T back + dy``, then the cell
    (``_convc.lstm_cell_grad``), ``dc = dh through + dc_next f_next`` and ``dgates = [dc, dh,
    dc, dc] slope``.

    Attributes:
        r: The transposed recurrence weights ``[D, H, 4H]`` every step multiplies by.
        steps: The steps in the order they run (each reads the one before's ``dgates`` and
            ``dc``).
        written: The steps' values that nodes outside the chain read (or the model outputs).
        columns: The ``Concat`` of every step's ``dgates`` side by side (``[D, 4H, T*N]``, the
            weight gradients' operand), written as the steps run; None where the chain does
            not hold it.
        places: With ``columns``: the column block of the first step's ``back``, then of each
            step's ``dgates``.
    """

    r: str
    steps: tuple[GradStep, ...]
    written: tuple[str, ...]
    columns: str | None = None
    places: tuple[int, ...] = ()

    recurrence_axes = (1, 4)
    """``R^T``'s axis of ``H`` entries and its gates (:func:`_recurrence_shape`)."""

    @property
    def inputs(self) -> list[str]:
        first = self.steps[0]
        reads = [v for s in self.steps for v in (s.dy, s.f_next, s.through, s.slope) if v]
        return [self.r, first.back, first.dc_next, *reads]

    @property
    def outputs(self) -> list[str]:
        return list(self.written) + ([self.columns] if self.columns else [])

    def check_shapes(self, r: tuple[int, ...], batch: int) -> dict[str, tuple[int, ...]]:
        """The shape of each input for ``R^T`` of shape ``r`` and a batch of ``batch``."""
        gates, state = (r[0], r[2], batch), (r[0], r[1], batch)
        first = self.steps[0]
        shapes = {self.r: r, first.back: gates, first.dc_next: state}
        for s in self.steps:
            shapes |= {v: state for v in (s.dy, s.f_next, s.through) if v}
            shapes[s.slope] = gates
        return shapes

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write :attr:`outputs` into ``out`` (in place where arrays of their shapes are
        there) from ``values``."""
        assert NATIVE is not None
        r = np.ascontiguousarray(values[self.r], np.float32)
        back = np.ascontiguousarray(values[self.steps[0].back], np.float32)
        dc = np.ascontiguousarray(values[self.steps[0].dc_next], np.float32)
        if (
            r.ndim != 3
            or back.ndim != 3
            or r.shape[2] != 4 * r.shape[1]
            or back.shape[:2] != (r.shape[0], r.shape[2])
            or dc.shape != (r.shape[0], r.shape[1], back.shape[2])
        ):
            raise ValueError(
                f"LSTM backward steps of {self.r!r}: R^T {list(r.shape)}, gates' gradient"
                f" {list(back.shape)}, cell gradient {list(dc.shape)}; expected R^T [D, H, 4H],"
                " [D, 4H, N] and [D, H, N]"
            )
        gates, state = back.shape, dc.shape
        width, stride, columns = 0, 0, None
        if self.columns is not None:
            width, stride = gates[2], gates[2] * len(self.places)
            columns = output_array(out, self.columns, (*gates[:2], stride))
            first = self.places[0] * width
            columns[:, :, first : first + width] = back
        written = set(self.written)
        buffers: dict[str, list[np.ndarray]] = {
            "dc": [np.empty(state, np.float32) for _ in range(2)],
            "dgates": [np.empty(gates, np.float32) for _ in range(2)],
        }
        mm = np.empty(state, np.float32)
        matmul = Product("MatMul", threads)
        for k, step in enumerate(self.steps):

            def array(role: str, k: int = k, step: GradStep = step) -> np.ndarray:
                name = getattr(step, role)
                shape = gates if role == "dgates" else state
                return output_array(out, name, shape) if name in written else buffers[role][k % 2]

            dy, f_next, through, slope = (
                np.ascontiguousarray(values[v], np.float32) if v else None
                for v in (step.dy, step.f_next, step.through, step.slope)
            )
            dc_step, dgates = array("dc"), array("dgates")
            matmul(r, back, mm)
            offset = self.places[k + 1] * width if columns is not None else 0
            NATIVE.lstm_cell_grad(
                mm, dy, dc, f_next, through, slope, dc_step, dgates, columns,
                state[1] * state[2], width, stride, offset, threads,
            )  # fmt: skip
            back, dc = dgates, dc_step


def split_lstm_backwards(
    model: onnx.ModelProto, taken: Set[int] = frozenset()
) -> list[tuple[LstmBackward, set[int]]]:
    """Each chain of LSTM backward steps of the rule's form in float32 ``model`` (tagged
    ``lstm_backward`` where the model has tags) whose intermediate values only the chain
    reads, as an :class:`LstmBackward` with the indices of its nodes (none in ``taken``), with
    the ``Concat`` of its gates' gradients where only it and the chain read them, checked
    numerically. ``[]`` where the extension is missing or nothing matches."""
    if not graph_match.can_match(model, "lstm_cell_grad", "MatMul"):
        return []
    g = graph_match.GraphIndex.of(model.graph)
    shapes = graph_match.inferred_shapes(model)
    found = [
        match
        for i, node in enumerate(g.nodes)
        if i not in taken and node.op_type == "MatMul" and node.domain in _DEFAULT
        and g.tagged(i, "lstm_backward") and (match := _grad_step(g, i, taken)) is not None
    ]  # fmt: skip
    matches = []
    for r, steps, members in _chains(found):
        if len(steps) < 2:
            continue
        columns, places = _columns_concat(g, [steps[0].back] + [s.dgates for s in steps], taken)
        if columns is not None:
            members.add(g.producer[columns])
        written = g.external(members)
        allowed = {v for s in steps for v in (s.dc, s.dgates)} | {columns}
        if written <= allowed:
            ordered = tuple(v for s in steps for v in (s.dc, s.dgates)
                            if v in written and v != columns)  # fmt: skip
            kernel = LstmBackward(r, tuple(steps), ordered, columns, places)
            matches.append((kernel, members))
    return verify.verified_kernels(model, g, matches, shapes, check=_InitScale(shapes))


def _grad_step(
    g: graph_match.GraphIndex, i: int, taken: Set[int]
) -> tuple[str, GradStep, set[int]] | None:
    """The backward step whose ``MatMul`` of the transposed recurrence weights is node ``i``:
    ``(R^T, the step, its nodes)``."""
    r, back = g.nodes[i].input
    nodes = {i}

    def only(value: str, op_type: str) -> tuple[int, onnx.NodeProto] | None:
        j = g.only_reader(value, taken)
        node = None if j is None else g.nodes[j]
        if node is None or node.op_type != op_type or node.domain not in _DEFAULT:
            return None
        assert j is not None
        nodes.add(j)
        return j, node

    mm = g.nodes[i].output[0]
    dh, dy = mm, None
    add = only(mm, "Add")
    if add is not None:
        if len(add[1].input) != 2:
            return None
        dy = add[1].input[1] if add[1].input[0] == mm else add[1].input[0]
        dh = add[1].output[0]
    readers = [g.nodes[j] for j in sorted(g.consumers.get(dh, ()))]
    mul = next((n for n in readers if n.op_type == "Mul" and list(n.input)[:1] == [dh]), None)
    cat = next((n for n in readers if n.op_type == "Concat"), None)
    if len(readers) != 2 or mul is None or cat is None or len(mul.input) != 2:
        return None
    from_h, through = mul.output[0], mul.input[1]
    dc_add = only(from_h, "Add")
    if dc_add is None or len(dc_add[1].input) != 2 or dc_add[1].input[0] != from_h:
        return None
    c_back, dc = dc_add[1].input[1], dc_add[1].output[0]
    c_mul = g.producer.get(c_back)
    if c_mul is None or c_mul in taken or g.only_reader(c_back, taken) is None:
        return None
    c_node = g.nodes[c_mul]
    if c_node.op_type != "Mul" or c_node.domain not in _DEFAULT or len(c_node.input) != 2:
        return None
    dc_next, f_next = c_node.input
    axis = next((a.i for a in cat.attribute if a.name == "axis"), None)
    if list(cat.input) != [dc, dh, dc, dc] or axis != 1 or cat.domain not in _DEFAULT:
        return None
    cat_v = cat.output[0]
    gates = only(cat_v, "Mul")
    if gates is None or list(gates[1].input)[:1] != [cat_v] or len(gates[1].input) != 2:
        return None
    nodes |= {c_mul} | {g.producer[v] for v in (from_h, cat_v)}
    if nodes & taken or any(
        g.nodes[j].domain not in _DEFAULT or len(g.nodes[j].output) != 1 for j in nodes
    ):
        return None
    step = GradStep(back, dy, dc_next, f_next, through, gates[1].input[1], dc,
                    gates[1].output[0])  # fmt: skip
    outside = {step.dc, step.dgates}
    for j in nodes:
        for v in g.nodes[j].output:
            if v not in outside and (v in g.outputs or not g.consumers.get(v, set()) <= nodes):
                return None
    return r, step, nodes


def _columns_concat(
    g: graph_match.GraphIndex, pieces: Sequence[str], taken: Set[int]
) -> tuple[str | None, tuple[int, ...]]:
    """The ``Concat`` along the last axis (of rank 3) of exactly ``pieces`` (in any order,
    each once), with the place of each piece among its inputs; ``(None, ())`` where there is
    none."""
    for j in sorted(g.consumers.get(pieces[-1], ())):
        node = g.nodes[j]
        axis = next((a.i for a in node.attribute if a.name == "axis"), None)
        if j in taken or node.op_type != "Concat" or node.domain not in _DEFAULT:
            continue
        if axis not in (2, -1) or sorted(node.input) != sorted(pieces):
            continue
        if len(set(node.input)) != len(pieces):
            continue
        place = {v: k for k, v in enumerate(node.input)}
        return node.output[0], tuple(place[v] for v in pieces)
    return None, ()


__all__ = [
    "CellStep", "GradStep", "LstmBackward", "LstmForward", "split_lstm_backwards",
    "split_lstm_forwards",
]
