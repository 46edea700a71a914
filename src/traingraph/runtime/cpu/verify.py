"""The numeric check of every native kernel: a match is used only where the nodes it replaces
compute what the kernel computes.

:func:`verified_kernels` is the one entry: each kernel's finder hands it its matches, with a
:class:`Check` where the kernel needs more than the defaults (inputs with ties or zeros, windows
of one draw, a random mask's seeds, one check for the matches of one form). The nodes of the
matches run at load in one single-threaded onnxruntime session (:func:`run_subgraph`; a second
one only where a match is fed a value another's nodes compute), on random inputs and then on
the same inputs with a NaN and infinities in them (:func:`with_non_finite`), and the kernel's
results are compared with theirs (:func:`same_values`: the same non-finite values in the same
places, the others within :data:`CHECK_RTOL` of the largest magnitude). A match that disagrees
is dropped with a warning that says why, and the graph computes it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from traingraph.runtime.cpu.graph_match import (
    FLOAT,
    GraphIndex,
)

# Relative tolerance of the numeric check, against the largest magnitude of the result.
CHECK_RTOL = 1e-4

Values = Mapping[str, np.ndarray]
"""Arrays by value name: a check's inputs, or what its nodes computed."""

logger = logging.getLogger("traingraph.runtime.cpu.kernels")
"""Where the verifier says which matches it drops, and why."""


def report_dropped(kernels: Iterable[object], reason: str) -> None:
    """Log that the native ``kernels`` are dropped (the graph computes their values) and why."""
    for kernel in kernels:
        outputs = getattr(kernel, "outputs", None) or getattr(kernel, "output", "?")
        logger.warning(
            "native kernel %s (writing %s) dropped: %s; the graph computes it",
            type(kernel).__name__, outputs, reason,
        )


_providers: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "check_providers", default=None
)


@contextlib.contextmanager
def checked_on(providers: list[Any]) -> Iterator[None]:
    """Within the block, the nodes of each check run on ``providers`` (onnxruntime's provider
    list) instead of the CPU: the kernels of another device are checked against what the
    graph computes there."""
    token = _providers.set(providers)
    try:
        yield
    finally:
        _providers.reset(token)


@overload
def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: dict[str, np.ndarray],
    outputs: list[str],
) -> list[np.ndarray]: ...


@overload
def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: list[dict[str, np.ndarray]],
    outputs: list[str],
) -> list[list[np.ndarray]]: ...


def run_subgraph(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    feeds: dict[str, np.ndarray] | list[dict[str, np.ndarray]],
    outputs: list[str],
) -> list[np.ndarray] | list[list[np.ndarray]]:
    """Run ``nodes`` of ``model`` (with the constants they read) on ``feeds``, in one
    single-threaded onnxruntime CPU session (or one of the providers :func:`checked_on`
    names), and return ``outputs``; for a list of feeds (of one set of names and shapes), a
    run on each, in the one session."""
    runs = feeds if isinstance(feeds, list) else [feeds]
    graph = model.graph
    needed = {name for n in nodes for name in n.input}
    constant_nodes = [
        n for n in graph.node
        if n.op_type == "Constant" and any(o in needed for o in n.output) and n not in nodes
    ]  # fmt: skip
    sub = helper.make_graph(
        constant_nodes + nodes,
        "native_check",
        [
            helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)
            )
            for name, v in runs[0].items()
        ],
        [helper.make_tensor_value_info(name, FLOAT, None) for name in outputs],
        [t for t in graph.initializer if t.name in needed],
    )
    check = helper.make_model(sub, opset_imports=list(model.opset_import))
    check.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        check.SerializeToString(), options, providers=_providers.get() or ["CPUExecutionProvider"]
    )
    results = [list(session.run(outputs, run)) for run in runs]
    return results if isinstance(feeds, list) else results[0]


class Check:
    """How :func:`verified_kernels` checks one kind of kernel: the defaults, which a kernel's
    module overrides where its matches need more (inputs with ties, windows of one draw, seeds
    of a random mask; one check for the matches of one form).

    By default each match is checked on its own, on standard-normal inputs of the nodes'
    shapes drawn for all matches at once, then on the same inputs with a NaN and infinities in
    them, the kernel computed single-threaded and compared by :func:`same_values`.
    """

    def form(self, kernel: Any, nodes: set[int]) -> Hashable | None:
        """A key that the matches of one form and shapes share: the check of the first decides
        for all (the same layer repeated). None (the default): checked on its own."""
        return None

    def inputs(
        self, matches: Sequence[tuple[Any, set[int]]]
    ) -> list[dict[str, np.ndarray] | None] | None:
        """For each match, the values of the inputs its nodes read (None: not checked, so not
        used); None (the default) to draw standard-normal values of their inferred shapes, the
        values between matches computed by the nodes that stay (:func:`verified_kernels`)."""
        return None

    def runs(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The inputs of each run: ``feeds``, then with a NaN and infinities in them."""
        return [feeds, with_non_finite(feeds)]

    def run_names(self) -> Sequence[str]:
        """What each of :meth:`runs` is, for the warning of a dropped match."""
        return ("finite inputs", "non-finite inputs")

    def agrees(self, kernel: Any, values: Values, expected: Values, run: int) -> bool:
        """Whether ``kernel`` computes from ``values`` what the nodes computed in run ``run``
        (``expected``): :func:`kernel_agrees`."""
        return kernel_agrees(kernel, values, expected)


def verified_kernels(
    model: onnx.ModelProto,
    g: GraphIndex,
    matches: Sequence[tuple[Any, set[int]]],
    shapes: Mapping[str, Sequence[int | None]],
    offsets: Mapping[str, float] | None = None,
    check: Check | None = None,
) -> list[tuple[Any, set[int]]]:
    """The matches (native kernels of :mod:`traingraph.runtime.cpu.segments`, each with the indices
    of the nodes it replaces) whose kernel computes what their nodes compute, on the inputs and
    runs ``check`` gives (:class:`Check`: by default random inputs of the model's batch, or 2
    where it is open, ``offsets`` added to the named ones), all in one single-threaded
    onnxruntime session. With the default inputs, the nodes between matches that stay (the
    Squeezes of a BatchNorm's statistics) run in the check too, and a kernel reads what the
    others' nodes computed (an addend that is another's output). A match of a form checked
    already (:meth:`Check.form`) takes its verdict; a match that disagrees is dropped, with a
    warning that says why."""
    check = check or Check()
    decides: dict[Hashable, int] = {}  # a form -> the match checked for it
    checked_as: dict[int, int] = {}  # a match -> the match whose check decides it
    for index, (kernel, nodes) in enumerate(matches):
        form = check.form(kernel, nodes)
        if form is not None and form in decides:
            checked_as[index] = decides[form]
            continue
        if form is not None:
            decides[form] = index
        checked_as[index] = index
    unique = [index for index, decider in checked_as.items() if index == decider]
    passed = set().union(*(
        _agreeing(model, g, matches, part, shapes, offsets or {}, check)
        for part in _bounded(unique, matches, shapes, g)
    ))  # fmt: skip
    return [match for index, match in enumerate(matches) if checked_as[index] in passed]


CHECK_BYTES = 64 << 20
"""The bytes of the kernels' inputs that one check session takes at most: a check holds its
inputs, a copy with non-finite values and what the nodes compute from each at once, so the
matches of a large model are checked in several sessions, and loading it costs no more memory
than a training step."""


def _bounded(
    indices: list[int],
    matches: Sequence[tuple[Any, set[int]]],
    shapes: Mapping[str, Sequence[int | None]],
    g: GraphIndex,
) -> list[list[int]]:
    """``indices`` in runs, in order, whose kernels' inputs (float32 of their inferred shapes,
    batch 2 where it is open; those of unknown shape not counted) take at most
    :data:`CHECK_BYTES` each, or one group alone. A group is the matches whose nodes read what
    another's nodes compute (a GELU's gradient nodes read its forward's intermediates): they
    are checked in one session, where those values are computed rather than drawn at random."""
    owner = {node: index for index in indices for node in matches[index][1]}
    group = {index: index for index in indices}

    def root(index: int) -> int:
        while group[index] != index:
            index = group[index] = group[group[index]]
        return index

    for index in indices:
        for node in matches[index][1]:
            for value in g.nodes[node].input:
                other = owner.get(g.producer.get(value, -1))
                if other is not None and other != index:
                    group[root(index)] = root(other)
    members: dict[int, list[int]] = {}
    for index in indices:
        members.setdefault(root(index), []).append(index)
    parts: list[list[int]] = []
    total = 0
    for together in members.values():
        size = sum(
            4 * math.prod(int(d or 2) for d in shape)
            for index in together
            for v in matches[index][0].inputs
            if (shape := shapes.get(v)) is not None
        )
        if not parts or total + size > CHECK_BYTES:
            parts.append([])
            total = 0
        parts[-1].extend(together)
        total += size
    return parts


def _agreeing(
    model: onnx.ModelProto,
    g: GraphIndex,
    matches: Sequence[tuple[Any, set[int]]],
    indices: list[int],
    shapes: Mapping[str, Sequence[int | None]],
    offsets: Mapping[str, float],
    check: Check,
) -> set[int]:
    """Which of ``matches`` (those at ``indices``) agree with their nodes: the check of
    :func:`verified_kernels`."""
    drawn = check.inputs([matches[i] for i in indices])
    if drawn is not None:
        # inputs of the kernel's choosing: a match fed a value that another's nodes compute
        # (one's dx the next one's dy) is checked in another session
        inputs = {i: values for i, values in zip(indices, drawn) if values is not None}
        groups = _apart(g, matches, inputs)
        return set().union(*(_agreeing_with(model, g, matches, k, inputs, check) for k in groups))
    checked = [
        i for i in indices
        if all((d := shapes.get(v)) is not None and None not in d[1:]
               for v in matches[i][0].inputs)
    ]  # fmt: skip
    if not checked:
        return set()
    members = _with_nodes_between(g, set().union(*(matches[i][1] for i in checked)))
    produced = {o for i in members for o in g.nodes[i].output}
    reads = {v for i in members for v in g.nodes[i].input if v}
    external = sorted(reads - produced - g.constants)
    feeds = random_feeds(np.random.default_rng(0), external, shapes)
    if feeds is None:
        return set()
    for name, offset in offsets.items():
        if name in feeds:  # else another kernel's nodes compute it
            feeds[name] += offset
    agreed = _compared(model, g, matches, checked, members, feeds, check)
    if agreed is None and len(checked) > 1:  # one match's nodes must not cost the others theirs
        return {i for i in checked if _agreeing(model, g, matches, [i], shapes, offsets, check)}
    return agreed or set()


def _apart(
    g: GraphIndex, matches: Sequence[tuple[Any, set[int]]], inputs: Mapping[int, Mapping[str, Any]]
) -> list[list[int]]:
    """The matches of ``inputs`` in groups (as few as may be) where no match is fed a value
    that the nodes of another compute."""
    groups: list[tuple[list[int], set[str], set[str]]] = []  # matches, computed, fed
    for i, fed in inputs.items():
        computed = {o for n in matches[i][1] for o in g.nodes[n].output}
        for group, group_computed, group_fed in groups:
            if not (computed & group_fed or set(fed) & group_computed):
                group.append(i)
                group_computed |= computed
                group_fed |= set(fed)
                break
        else:
            groups.append(([i], computed, set(fed)))
    return [group for group, _, _ in groups]


def _agreeing_with(
    model: onnx.ModelProto,
    g: GraphIndex,
    matches: Sequence[tuple[Any, set[int]]],
    checked: list[int],
    inputs: Mapping[int, Mapping[str, np.ndarray]],
    check: Check,
) -> set[int]:
    """Which of the ``checked`` matches agree with their nodes on the ``inputs`` of each."""
    members = set().union(*(matches[i][1] for i in checked))
    feeds = {name: v for i in checked for name, v in inputs[i].items()}
    agreed = _compared(model, g, matches, checked, members, feeds, check)
    if agreed is None and len(checked) > 1:  # one match's nodes must not cost the others theirs
        return {i for i in checked if _agreeing_with(model, g, matches, [i], inputs, check)}
    return agreed or set()


def _compared(
    model: onnx.ModelProto,
    g: GraphIndex,
    matches: Sequence[tuple[Any, set[int]]],
    checked: list[int],
    members: set[int],
    feeds: dict[str, np.ndarray],
    check: Check,
) -> set[int] | None:
    """Which of the ``checked`` matches compute what the nodes ``members`` compute from
    ``feeds``, in the runs ``check`` makes of them; None where onnxruntime cannot run the
    nodes (a single match's is then dropped with a warning)."""
    produced = {o for i in members for o in g.nodes[i].output}
    wanted = [o for i in checked for o in matches[i][0].outputs]
    # what the nodes between compute and a kernel reads (a Relu between two matches)
    wanted += sorted({v for i in checked for v in matches[i][0].inputs} & produced - set(wanted))
    runs = check.runs(feeds)
    try:
        results = run_subgraph(model, [g.nodes[i] for i in sorted(members)], runs, wanted)
    except Exception as error:  # a subgraph onnxruntime rejects stays in the graph
        if len(checked) == 1:
            report_dropped([matches[checked[0]][0]], f"onnxruntime cannot run its nodes ({error})")
        return None
    agreed = set()
    for i in checked:
        kernel = matches[i][0]
        for run, (name, inputs, outputs) in enumerate(zip(check.run_names(), runs, results)):
            expected = dict(zip(wanted, outputs))
            if not check.agrees(kernel, {**inputs, **expected}, expected, run):
                report_dropped([kernel], f"it disagrees with its nodes on {name}")
                break
        else:
            agreed.add(i)
    return agreed


def _with_nodes_between(g: GraphIndex, members: set[int]) -> set[int]:
    """``members`` with the nodes that compute, from their results and constants alone, a
    value they read (a Relu between two matches, the Squeezes of a BatchNorm's statistics)."""
    while True:
        produced = {o for i in members for o in g.nodes[i].output}
        reads = {v for i in members for v in g.nodes[i].input if v}
        between = {
            g.producer[v] for v in reads - produced
            if v in g.producer and all(
                u in produced or u in g.constants for u in g.nodes[g.producer[v]].input if u
            )
        }  # fmt: skip
        if between <= members:
            return members
        members = members | between


def random_feeds(
    rng: np.random.Generator, names: Sequence[str], shapes: Mapping[str, Sequence[int | None]]
) -> dict[str, np.ndarray] | None:
    """A standard-normal float32 value for each of ``names`` of its inferred shape (batch 2
    where it is open), to check a native kernel against the nodes it replaces; None where a
    shape beyond the batch is unknown."""
    feeds = {}
    for name in names:
        shape = shapes.get(name)
        if shape is None or None in shape[1:]:
            return None
        full = [int(shape[0] or 2), *(int(d or 0) for d in shape[1:])] if shape else []
        feeds[name] = rng.standard_normal(full, dtype=np.float32)
    return feeds


class WindowedDraws:
    """Standard-normal float32 inputs for the numeric checks of many matches at once, drawn
    once: input k of a check (its x, its dy, ...) is a copy of the start of window k of one
    draw, so the inputs of one check are independent of each other, while another check may
    see the same values, which weakens neither. An input another check made already keeps its
    array (a value two matches read gets one); where its window is one this check's other
    inputs take too, a new input gets a draw of its own.

    Args:
        rng: The generator.
        windows: Windows (inputs per check).
        size: Elements per window: the largest input.
    """

    def __init__(self, rng: np.random.Generator, windows: int, size: int) -> None:
        self._rng = rng
        self._draw = rng.standard_normal((windows, size), dtype=np.float32)
        self._sources: dict[str, int] = {}  # a feed -> its window (< 0: a draw of its own)
        self.feeds: dict[str, np.ndarray] = {}
        """Every input made so far, by name."""

    def inputs(
        self,
        wanted: Sequence[
            tuple[str, int, Sequence[int], Callable[[np.ndarray], np.ndarray] | None]
        ],
    ) -> dict[str, np.ndarray]:
        """The inputs of one check: for each ``(name, window, shape, transform)`` the array
        of ``name``, made from ``window`` (a copy, or what ``transform`` makes of it: a new
        array) unless another check made it already."""
        used = {self._sources[name] for name, *_ in wanted if name in self.feeds}
        for name, window, shape, transform in wanted:
            if name in self.feeds:
                continue
            if window in used:
                window = -1 - len(self._sources)
                raw = self._rng.standard_normal(shape, dtype=np.float32)
            else:
                raw = self._draw[window, : math.prod(shape)].reshape(shape)
            used.add(window)
            self._sources[name] = window
            self.feeds[name] = transform(raw) if transform is not None else raw.copy()
        return {name: self.feeds[name] for name, *_ in wanted}


def kernel_agrees(
    kernel: Any,
    values: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    *,
    threads: int = 1,
    rtol: Mapping[str, float] | None = None,
    flat: Collection[str] = (),
) -> bool:
    """Whether ``kernel`` (a native kernel of :mod:`traingraph.runtime.cpu.segments`), computed
    on ``threads`` threads from ``values``, writes each of its outputs as ``expected`` holds
    it, to ``CHECK_RTOL`` of its largest element (or the output's ``rtol``); the outputs in
    ``flat`` (a parameter's gradient, which the graph may keep with dims of one) by their
    elements alone. False where it refuses the shapes."""
    got: dict[str, np.ndarray] = {}
    try:
        kernel.compute(values, got, threads)
    except ValueError:
        return False
    return all(
        same_values(
            got[name],
            expected[name].reshape(got[name].shape)
            if name in flat and expected[name].size == got[name].size
            else expected[name],
            (rtol or {}).get(name, CHECK_RTOL),
        )
        for name in kernel.outputs
    )


def same_values(got: np.ndarray, want: np.ndarray, rtol: float = CHECK_RTOL) -> bool:
    """Whether ``got`` is what the graph computed, ``want``: the same shape, NaN exactly where
    ``want`` is NaN, the same infinities, and finite values within ``rtol`` of ``want``'s
    largest finite magnitude. Every check of a fast path against its nodes compares so."""
    if got.shape != want.shape:
        return False
    finite = np.isfinite(want)
    if not np.array_equal(np.isnan(got), np.isnan(want)):
        return False
    if not np.array_equal(got[np.isinf(want)], want[np.isinf(want)]):
        return False
    if not np.isfinite(got[finite]).all():
        return False
    if not finite.any():
        return True
    scale = float(np.abs(want[finite]).max()) or 1.0
    return bool(np.abs(got[finite] - want[finite]).max() <= rtol * scale)


def with_non_finite(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of ``feeds`` with a NaN, a +Inf and a -Inf in each float array of rank 2 or more
    and 8 elements or more (the last sample's first, middle and last elements): the inputs
    on which a check sees that a fast path propagates them as the graph does. Vectors (a
    scale, a bias) keep their values, so that the other elements stay finite."""
    poisoned = dict(feeds)
    for name, value in feeds.items():
        if value.dtype.kind != "f" or value.ndim < 2 or value.size < 8:
            continue
        copy = value.copy()
        last = copy.reshape(copy.shape[0], -1)[-1]
        last[0], last[last.size // 2], last[-1] = np.nan, np.inf, -np.inf
        poisoned[name] = copy
    return poisoned
