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

from collections.abc import Hashable, Mapping, Sequence, Set
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LstmForward:
    """A chain of LSTM steps: per step ``gates = R h_prev + piece`` (``R`` ``[D, 4H, H]``),
    then the cell (``_convc.lstm_cell``).

    Attributes:
        r: The recurrence weights every step multiplies by.
        steps: The steps in the order they run (each reads the one before's ``h`` and ``c``).
        written: The steps' values that nodes outside the chain read (or the model outputs).
    """

    r: str
    steps: tuple[CellStep, ...]
    written: tuple[str, ...]

    @property
    def inputs(self) -> list[str]:
        first = self.steps[0]
        return [self.r, first.h_prev, first.c_prev, *(s.piece for s in self.steps)]

    @property
    def outputs(self) -> list[str]:
        return list(self.written)

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
        for k, step in enumerate(self.steps):
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
            NATIVE.lstm_cell(
                mm, piece, c, h_next, c_next, array("slope"), array("through"), array("f"),
                state[1] * state[2], threads,
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
    found: dict[str, tuple[str, CellStep, set[int]]] = {}  # by h_prev
    for i, node in enumerate(g.nodes):
        if i not in taken and node.op_type == "MatMul" and node.domain in _DEFAULT:
            match = _step(g, i, constants, taken)
            if match is not None:
                found[match[1].h_prev] = match
    after = {step.h for _, step, _ in found.values()}
    matches = []
    for r, first, nodes in found.values():
        if first.h_prev in after:
            continue  # not the first step of its chain
        steps, members = [first], set(nodes)
        while steps[-1].h in found:
            r_next, following, more = found[steps[-1].h]
            if r_next != r or following.c_prev != steps[-1].c:
                break
            steps.append(following)
            members |= more
        written = g.external(members)
        allowed = {v for s in steps for v in (s.h, s.c, s.slope, s.through, s.f)}
        if len(steps) > 1 and written <= allowed:
            ordered = tuple(v for s in steps for v in (s.h, s.c, s.slope, s.through, s.f)
                            if v in written)  # fmt: skip
            matches.append((LstmForward(r, tuple(steps), ordered), members))
    return verify.verified_kernels(model, g, matches, shapes, check=_InitScale(shapes))


class _InitScale(verify.Check):
    """Standard-normal inputs of the inferred shapes (a batch of 2 where it is open), but the
    recurrence weights at the scale of an LSTM's initialization (uniform within
    ``1 / sqrt(H)``, PyTorch's): with standard-normal weights of a few hundred columns the
    recurrence is chaotic, and any rounding difference of a Sigmoid or Tanh grows over the
    steps past the check's tolerance."""

    def __init__(self, shapes: Mapping[str, list[int | None]]) -> None:
        self.shapes = shapes

    def form(self, kernel: LstmForward, nodes: set[int]) -> Hashable | None:
        """The chains of one length and shapes share one check (a stack of layers): the
        matcher fixed every node and its wiring, so that only their inputs' values differ."""
        return len(kernel.steps), tuple(tuple(self.shapes.get(v) or ()) for v in kernel.inputs)

    def inputs(
        self, matches: Sequence[tuple[LstmForward, set[int]]]
    ) -> list[dict[str, np.ndarray] | None]:
        rng = np.random.default_rng(0)
        drawn: list[dict[str, np.ndarray] | None] = []
        for kernel, _ in matches:
            shapes = [self.shapes.get(name) for name in kernel.inputs]
            if any(shape is None for shape in shapes):
                drawn.append(None)
                continue
            feeds = {
                name: rng.standard_normal([int(d or 2) for d in shape or ()], dtype=np.float32)
                for name, shape in zip(kernel.inputs, shapes)
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


__all__ = ["CellStep", "LstmForward", "split_lstm_forwards"]
