"""Training graphs cut around native kernels on the CPU: onnxruntime sessions in turn.

onnxruntime's CPU provider runs a graph one op at a time, each a pass over memory. These
subgraphs are chains of such passes that a fused loop does in one or two, and sit in the
middle of the step:

- the gradient of a training-mode BatchNormalization, with the Relu gradient in front of it
  (the statistics, two sums, the affine map, the mask: about ten passes);
  :func:`split_batch_norm_grads` finds them;
- a Conv's output gradient routed through the MaxPool (and Relu) after the Conv, where the
  Conv's input gradient reads it too (an ArgMax over the windows, two upsamplings, a
  comparison, the masks); :func:`split_max_pool_grads` finds them. The first Conv of a network,
  whose output gradient only its own weight gradient reads, is routed after the run instead
  (:class:`~traingraph.runtime.cpu.kernels.conv_grads.MaxPoolRoute`);
- a lowered Dropout's keep mask (:mod:`traingraph.runtime.cpu.kernels.masks`), which depends on the
  step's
  seed alone: every mask is written right after the seed is drawn;
- a strided Conv's input gradient after its MatMul (:mod:`traingraph.runtime.cpu.kernels.col2im`):
  the
  columns added into the image, with the Sum and Relu mask after them;
- a first Conv of few input channels (and its Relu), computed directly before the first segment
  (:mod:`traingraph.runtime.cpu.kernels.direct_conv`);
- a training-mode BatchNormalization's forward pass, with the residual Add and Relu after it
  (:mod:`traingraph.runtime.cpu.kernels.bn_forward`);
- a 3 x 3 Conv of stride 1, forward or input gradient, by Winograd's transforms
  (:mod:`traingraph.runtime.cpu.kernels.winograd`);
- a Conv's weight gradient (:class:`~traingraph.runtime.cpu.kernels.conv_grads.WeightGradKernel`),
  as
  soon as its output gradient is written, while that is still in cache;
- GELU and its gradient (:mod:`traingraph.runtime.cpu.kernels.gelu`), and a LayerNormalization's
  gradient (:mod:`traingraph.runtime.cpu.kernels.layer_norm`);
- a sum over the leading axes of a large value (a weight gradient's sum over the samples,
  :mod:`traingraph.runtime.cpu.kernels.batch_sum`).

Each match is checked numerically against its kernel. :func:`plan_segments` orders what is
left into onnxruntime segments with the kernels between them, and :class:`SegmentedRunner`
runs them with the interface of :class:`~traingraph.runtime.session.BoundRunner`: values that
cross a cut stay where they were written (onnxruntime's outputs are read in place, the
kernels' outputs are bound as inputs), in buffers kept from step to step, shared by values
that are not needed at the same time.

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from traingraph.runtime import heap
from traingraph.runtime.cpu import graph_match
from traingraph.runtime.cpu.graph_match import Pending, settle
from traingraph.runtime.cpu.kernels import Kernel, conv_grads, find
from traingraph.runtime.cpu.kernels.flipped_filter import FlippedFilter, FlippedReorder
from traingraph.runtime.cpu.kernels.permutes import (
    FilterReorder,
    split_filter_reorders,
    split_transposed_operands,
)
from traingraph.runtime.device import Device
from traingraph.runtime.rewrites.specialize import for_cpu
from traingraph.runtime.session import BoundRunner, ort_type_to_numpy
from traingraph.runtime.views import view as device_view


def find_kernels(
    model: onnx.ModelProto,
    weight_grads: Sequence[conv_grads.WeightGrad],
    forward: onnx.ModelProto | None = None,
    kernels: Collection[str] | None = None,
) -> tuple[onnx.ModelProto, list[tuple[Kernel, set[int]]]]:
    """Every kernel of the registry (:func:`traingraph.runtime.cpu.kernels.find`) among
    ``kernels`` (names, as ``SessionConfig.native_kernels``; all where None) that ``model``
    holds, with the nodes each replaces, and ``model`` as they need it: with the columns the
    Col2Im kernels read written after its nodes."""
    return find(model, weight_grads, forward, kernels)


@dataclass
class Segment:
    """One onnxruntime segment: its model, the values it reads from earlier segments or
    kernels, and the values it writes."""

    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    output_views: dict[str, OutputView] = field(default_factory=dict)
    """The outputs that are a graph output under another shape, by name: the segment writes
    them into the graph output's memory (:func:`_output_views`)."""


@dataclass(frozen=True)
class OutputView:
    """A value a segment writes that is graph output ``target`` under another shape.

    Attributes:
        target: The graph output.
        shape: The value's shape.
        target_shape: The graph output's shape.
        dtype: Their element type.
    """

    target: str
    shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class OutputInfo:
    """A step's output as ``InferenceSession.get_outputs`` describes one: its name, shape and
    onnxruntime type name (``tensor(float)``)."""

    name: str
    shape: list[int]
    type: str


@dataclass
class Plan:
    """Segments and, after each, the kernels that run before the next."""

    segments: list[Segment]
    kernels: list[list[Kernel]] = field(default_factory=list)
    other_inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    """The model inputs no segment reads (a kernel's, or the native weight gradients')."""
    first: list[Kernel] = field(default_factory=list)
    """The kernels that read only model inputs: they run before the first segment."""

    @property
    def all_kernels(self) -> list[Kernel]:
        """Every kernel, in the order they run."""
        return self.first + [k for ks in self.kernels for k in ks]


def plan_segments(
    model: onnx.ModelProto, grads: Sequence[tuple[Kernel, set[int]]], *, cpu: bool = True
) -> Plan:
    """``model`` without the nodes of ``grads``, cut into segments: a node goes into the
    segment after the last kernel whose output it reads (transitively), or, where only nodes
    read its outputs, into the first segment that reads them (:func:`_sunk`); a kernel that
    reads only model inputs runs before the first segment. The nodes need not be in order where only
    kernels read a node's outputs (they may come last). A cheap node of :data:`RECOMPUTED`
    goes as well into the later segments that read its output and its input
    (:func:`_recomputed`). With ``cpu`` (the default), products over flattened rows and the
    shape ops at the cuts are made views for the CPU (:func:`_flat_gemms`,
    :func:`_views_at_cuts`); other devices' segments keep their nodes as they are."""
    graph = model.graph
    removed = set().union(*(nodes for _, nodes in grads)) if grads else set()
    removed -= _still_read(graph, removed, [g for g, _ in grads])
    kept = [node for i, node in enumerate(graph.node) if i not in removed]
    # a Constant goes into every segment that reads it, as an initializer would, unless a
    # kernel reads it or it is a graph output
    outside = {o.name for o in graph.output} | {v for g, _ in grads for v in g.inputs}
    constants = {
        node.output[0]: node
        for node in kept
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
        and not node.input and node.output[0] not in outside
    }  # fmt: skip
    kept = [node for node in kept if not node.output or node.output[0] not in constants]
    kept = graph_match.without_identities(kept, outside)
    by_output = {o: k for k, (grad, _) in enumerate(grads) for o in grad.outputs}
    by_node = {o: i for i, node in enumerate(kept) for o in node.output if o}
    stages: dict[tuple[bool, int], int] = {}  # (a kernel?, its index) -> its stage

    def value_stage(name: str) -> int:
        k = by_output.get(name)
        if k is not None:
            return stages[True, k] + 1
        i = by_node.get(name)
        return stages[False, i] if i is not None else -1

    def writer(name: str) -> tuple[bool, int] | None:
        k = by_output.get(name)
        i = by_node.get(name)
        return (True, k) if k is not None else (False, i) if i is not None else None

    # a node's stage: that of its latest input, at least 0; a kernel's: that of its latest
    # input (-1 where it reads only model inputs); each after those of what it reads
    def decide(item: tuple[bool, int]) -> int | Pending[tuple[bool, int]]:
        kernel, index = item
        reads = [v for v in (grads[index][0].inputs if kernel else kept[index].input) if v]
        unsettled = [w for v in reads if (w := writer(v)) is not None and w not in stages]
        if unsettled:
            return Pending(unsettled)
        latest = max((value_stage(v) for v in reads), default=-1)
        return latest if kernel else max(0, latest)

    for start in [(False, i) for i in range(len(kept))] + [(True, k) for k in range(len(grads))]:
        settle(start, stages, decide)
    kernel_stage = [stages[True, k] for k in range(len(grads))]  # -1: before the first segment
    placed = _sunk(kept, {i: stages[False, i] for i in range(len(kept))}, outside)
    kernel_reads: dict[str, int] = {}  # a value -> the first stage whose kernels read it
    for k, (grad, _) in enumerate(grads):
        for v in grad.inputs:
            kernel_reads[v] = min(kernel_reads.get(v, kernel_stage[k]), kernel_stage[k])
    placed = _merged(kept, placed, {o.name for o in graph.output}, kernel_reads)
    nodes_at: dict[int, list[onnx.NodeProto]] = {}
    for i, node in enumerate(kept):
        nodes_at.setdefault(placed[i], []).append(node)
    fed = {i.name for i in graph.input} | {t.name for t in graph.initializer} | set(constants)
    for s, copies in _recomputed(kept, placed, outside, fed).items():
        nodes_at[s] = copies + nodes_at.get(s, [])
    kernels: dict[int, list[Kernel]] = {}
    for k, (grad, _) in enumerate(grads):
        kernels.setdefault(kernel_stage[k], []).append(grad)
    last = max([*nodes_at, *(s + 1 for s in kernels)], default=0)
    readers: dict[str, set[int]] = {}  # value -> the stages that read it and don't write it
    for s, members in nodes_at.items():
        for node in members:
            for v in node.input:
                if v not in constants:  # written in each segment that reads it
                    readers.setdefault(v, set()).add(s)
    for s, members in nodes_at.items():
        for node in members:
            for o in node.output:
                readers.get(o, set()).discard(s)
    initializers = {t.name: t for t in graph.initializer}
    graph_inputs = {i.name: i for i in graph.input}
    types = _types(model)
    graph_outputs = {o.name for o in graph.output}
    segments: list[Segment] = []
    plan_kernels: list[list[Kernel]] = []
    first: list[Kernel] = list(kernels.get(-1, []))
    for s in range(last + 1):
        members = nodes_at.get(s, [])
        needed = sorted({v for n in members for v in n.input if v in constants})
        members = [constants[v] for v in needed] + members
        produced = {o for n in members for o in n.output if o}
        read = [v for n in members for v in n.input if v]
        inputs = sorted({v for v in read if v not in produced and v not in initializers})
        outputs = sorted(
            o for o in produced if o in outside or readers.get(o)
        )
        flat_types: dict[str, onnx.ValueInfoProto] = {}
        before: list[ViewStep] = []
        after: list[ViewStep] = []
        if cpu:
            members, flat_types = _flat_gemms(members, outputs, graph_outputs, types)
            members, inputs, outputs, before, after = _views_at_cuts(
                members, inputs, outputs, graph_outputs, types
            )
            members, outputs, output_views = _output_views(members, outputs, graph_outputs, types)
        else:
            output_views = {}
        if before:
            (plan_kernels[-1] if plan_kernels else first).extend(before)
        sub = helper.make_graph(
            members,
            f"{graph.name or 'training'}_segment{s}",
            [graph_inputs.get(v) or types.get(v) or _float(v) for v in inputs],
            [types.get(o) or flat_types.get(o) or _float(o) for o in outputs],
            [initializers[v] for v in sorted({v for v in read if v in initializers})],
        )
        segment = helper.make_model(sub, opset_imports=list(model.opset_import))
        segment.ir_version = model.ir_version
        segments.append(Segment(segment, inputs, outputs, output_views))
        plan_kernels.append([*after, *kernels.get(s, [])])
    segment_reads = {v for segment in segments for v in segment.inputs}
    others = [info for name, info in graph_inputs.items() if name not in segment_reads]
    return Plan(segments, plan_kernels, others, first)


VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
"""Ops whose output is their first input's elements in the same order, under another shape."""


@dataclass(frozen=True)
class ViewStep:
    """``out``: the memory of ``source`` seen with the shape ``shape`` (-1 for the one
    dimension the inferred shape leaves open), without a copy. It stands for a node of
    :data:`VIEW_OPS` at a cut (:func:`_views_at_cuts`), where onnxruntime would copy the whole
    tensor into, or out of, the buffer the value is bound to."""

    source: str
    out: str
    shape: tuple[int, ...]

    @property
    def inputs(self) -> list[str]:
        return [self.source]

    @property
    def outputs(self) -> list[str]:
        return [self.out]

    def compute(
        self, values: Mapping[str, np.ndarray], out: dict[str, np.ndarray], threads: int
    ) -> None:
        """Set ``out[self.out]`` to the view (never a copy: a source that is not contiguous
        raises)."""
        source = values[self.source]
        if not source.flags.c_contiguous:
            raise ValueError(
                f"the view {self.out!r} of {self.source!r}: the source is not contiguous"
                f" (strides {source.strides}), so its shape {list(self.shape)} would need a copy"
            )
        out[self.out] = source.reshape(self.shape)  # a contiguous array reshapes in place


def _views_at_cuts(
    members: list[onnx.NodeProto],
    inputs: list[str],
    outputs: list[str],
    pinned: Set[str],
    types: Mapping[str, onnx.ValueInfoProto],
) -> tuple[list[onnx.NodeProto], list[str], list[str], list[ViewStep], list[ViewStep]]:
    """A segment's nodes, inputs and outputs with the view nodes (:data:`VIEW_OPS`) at its
    ends taken out as :class:`ViewStep` s: those that run before it (a view of one of its
    inputs) and after it (a view it outputs, of a value it computes or reads).

    onnxruntime hands a view's memory over inside a session, but a session's input lives in
    memory it does not own, and an output is written into the buffer bound to it: at a cut,
    a Reshape of a Gemm's output (an exported ``Linear`` of 3-D input reshapes its 2-D product
    back) or of a value the segment reads copies the whole tensor every step. A view whose
    output is a graph output, whose shape inference leaves more than one dimension open, or
    that reads an initializer, stays."""
    before: list[ViewStep] = []
    after: list[ViewStep] = []
    nodes = list(members)
    inputs, outputs = list(inputs), list(outputs)
    changed = True
    while changed:
        changed = False
        produced = {o for n in nodes for o in n.output if o}
        readers: dict[str, int] = {}
        for n in nodes:
            for v in n.input:
                readers[v] = readers.get(v, 0) + 1
        for k, node in enumerate(nodes):
            if node.op_type not in VIEW_OPS or node.domain not in ("", "ai.onnx"):
                continue
            if len(node.output) != 1 or not node.input or node.output[0] in pinned:
                continue
            source, out = node.input[0], node.output[0]
            shape = _view_shape(types.get(out))
            if shape is None:
                continue
            if source in inputs:  # a view of what the segment reads: taken before it
                before.append(ViewStep(source, out, shape))
                del nodes[k]
                inputs.append(out)
                if readers[source] == 1:
                    inputs.remove(source)
                if out in outputs:
                    outputs.remove(out)
            elif out in outputs and source in produced:  # a view it writes: taken after it
                after.append(ViewStep(source, out, shape))
                outputs.remove(out)
                if source not in outputs:
                    outputs.append(source)
                if not readers.get(out):
                    del nodes[k]
            else:
                continue
            changed = True
            break
    return nodes, sorted(inputs), sorted(outputs), _in_order(before), _in_order(after)


def _output_views(
    members: list[onnx.NodeProto],
    outputs: list[str],
    graph_outputs: Set[str],
    types: Mapping[str, onnx.ValueInfoProto],
) -> tuple[list[onnx.NodeProto], list[str], dict[str, OutputView]]:
    """A segment's nodes and outputs without the view nodes (:data:`VIEW_OPS`) that write a
    graph output from a value that only they read: the segment outputs that value instead,
    and the runner binds it to the graph output's buffer under the value's shape.

    A graph output is written into the buffer its caller binds: a Reshape there (a weight
    gradient's product of shape ``[1, C, K]`` reshaped to the filter's ``[C, ...]``) copies
    the whole gradient every step. Both shapes must be static."""
    readers = Counter(v for node in members for v in node.input)
    produced = {o for node in members for o in node.output if o}
    kept: list[onnx.NodeProto] = []
    views: dict[str, OutputView] = {}
    for node in members:
        out = node.output[0] if len(node.output) == 1 else ""
        source = node.input[0] if node.input else ""
        shape, target_shape = _static_shape(types.get(source)), _static_shape(types.get(out))
        if (
            node.op_type in VIEW_OPS and node.domain in ("", "ai.onnx")
            and out in graph_outputs and out in outputs and source in produced
            and readers[source] == 1 and source not in outputs and source not in graph_outputs
            and source not in views and shape is not None and target_shape is not None
            and math.prod(shape) == math.prod(target_shape)
            and types[source].type.tensor_type.elem_type == types[out].type.tensor_type.elem_type
        ):  # fmt: skip
            elem = types[out].type.tensor_type.elem_type
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
            views[source] = OutputView(out, shape, target_shape, dtype)
            outputs = [source if o == out else o for o in outputs]
            continue
        kept.append(node)
    return kept, sorted(outputs), views


def _static_shape(info: onnx.ValueInfoProto | None) -> tuple[int, ...] | None:
    """The shape of ``info`` where every dimension is known; else None."""
    if info is None or not info.type.HasField("tensor_type"):
        return None
    tensor = info.type.tensor_type
    if not tensor.elem_type or not tensor.HasField("shape"):
        return None
    dims = tensor.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(int(d.dim_value) for d in dims)


def _flat_gemms(
    members: list[onnx.NodeProto],
    outputs: list[str],
    pinned: Set[str],
    types: Mapping[str, onnx.ValueInfoProto],
) -> tuple[list[onnx.NodeProto], dict[str, onnx.ValueInfoProto]]:
    """A segment's nodes with each output ``Add(MatMul(x, w), b)`` of an ``x`` of rank 3 or
    more (an exported ``Linear``) written on ``x``'s rows: ``Reshape(Add(MatMul(Reshape(x,
    [-1, K]), w), b), shape)``; and the types of the 2-D sums, which the segment outputs
    instead (:func:`_views_at_cuts` then takes the last Reshape as a view).

    onnxruntime fuses the MatMul and the Add into a Gemm of the rows itself, and reshapes the
    Gemm's product back into the output's buffer: a copy of the whole output every step,
    where the product could be written into that buffer. The values are the same: the
    MatMul of the rows is the batched MatMul's, row by row, and the Gemm onnxruntime makes of
    either is one."""
    producer = {o: k for k, n in enumerate(members) for o in n.output if o}
    readers: dict[str, int] = {}
    for n in members:
        for v in n.input:
            readers[v] = readers.get(v, 0) + 1
    nodes = list(members)
    flat: dict[str, onnx.ValueInfoProto] = {}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for out in outputs:
        k = producer.get(out)
        if k is None or out in pinned:
            continue
        add = nodes[k]
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            continue
        for product, bias in (tuple(add.input), tuple(reversed(add.input))):
            j = producer.get(product)
            if j is None or readers.get(product) != 1 or j in replaced:
                continue
            matmul = nodes[j]
            if matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx"):
                continue
            x, w = matmul.input
            x_shape, w_shape, b_shape = (_view_shape(types.get(v)) for v in (x, w, bias))
            shape = _view_shape(types.get(out))
            if x_shape is None or w_shape is None or b_shape is None or shape is None:
                continue
            if len(x_shape) < 3 or len(w_shape) != 2 or -1 in w_shape or len(shape) < 3:
                continue
            if b_shape not in ((w_shape[1],), (1, w_shape[1])) or shape[-1] != w_shape[1]:
                continue
            rows, summed, row_shape = f"{out}/rows", f"{out}/rows_sum", f"{out}/shape"
            elem = types[out].type.tensor_type.elem_type
            flat[summed] = helper.make_tensor_value_info(summed, elem, None)
            replaced[j] = []
            replaced[k] = [
                _int64s(f"{out}/row_shape", [-1, w_shape[0]]),
                helper.make_node("Reshape", [x, f"{out}/row_shape"], [rows]),
                helper.make_node("MatMul", [rows, w], [f"{out}/rows_product"]),
                helper.make_node("Add", [f"{out}/rows_product", bias], [summed]),
                _int64s(row_shape, list(shape)),
                helper.make_node("Reshape", [summed, row_shape], [out]),
            ]
            break
    if not replaced:
        return members, flat
    result: list[onnx.NodeProto] = []
    for k, node in enumerate(nodes):
        result += replaced.get(k, [node])
    return result, flat


def _int64s(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name],
        value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values),
    )  # fmt: skip


def _in_order(steps: list[ViewStep]) -> list[ViewStep]:
    """``steps`` with each after the step that writes its source (a view of a view)."""
    ordered: list[ViewStep] = []
    waiting = list(steps)
    while waiting:
        pending = {s.out for s in waiting}
        ready = [s for s in waiting if s.source not in pending] or waiting
        ordered += ready
        waiting = [s for s in waiting if s not in ready]
    return ordered


def _view_shape(info: onnx.ValueInfoProto | None) -> tuple[int, ...] | None:
    """The inferred shape of a tensor, -1 for its one dimension that is not static; None
    where it has no shape or more than one such dimension."""
    if info is None or not info.type.HasField("tensor_type"):
        return None
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
    return dims if dims.count(-1) <= 1 else None


RECOMPUTED = frozenset({
    "Sigmoid", "Tanh", "Relu", "Neg",
    "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Gather",
})  # fmt: skip
"""Deterministic ops that cost one pass over their output or less (an elementwise function of
one input, a copy or a view of part of one) that a later segment computes again from inputs
it holds anyway, instead of keeping their output from the segment that first computes it: the
sigmoid of a SiLU, which its gradient reads beside the SiLU's input, or a reshaped copy of a
value that stays for the backward pass itself. Not Transpose: onnxruntime folds a Transpose
into the MatMul that reads it, which then sums in another order."""


def _recomputed(
    nodes: Sequence[onnx.NodeProto],
    placed: Mapping[int, int],
    pinned: Set[str],
    fed: Set[str],
) -> dict[int, list[onnx.NodeProto]]:
    """The nodes of ``nodes`` (placed by stage) that stages after their own compute again:
    a node of :data:`RECOMPUTED` with one output that neither a kernel nor a graph output
    reads (``pinned``) goes, as well, into each later stage that reads its output, where
    each of its inputs is in ``fed`` (the model's inputs and initializers, and the Constants
    each segment writes for itself) or alive at that stage anyway (a node of that stage or of
    a later one reads it; where another node's copy computes it, that copy is in the stage),
    so that its output does not cross a cut and nothing lives longer. Returns, by stage, the
    copies it gets."""
    reading: dict[str, set[int]] = {}
    for i, node in enumerate(nodes):
        for v in node.input:
            if v:
                reading.setdefault(v, set()).add(placed[i])
    latest = {v: max(stages) for v, stages in reading.items()}
    copies: dict[int, list[onnx.NodeProto]] = {}
    copied: dict[str, set[int]] = {}  # a value computed again -> the stages that do
    for i, node in enumerate(nodes):
        if node.op_type not in RECOMPUTED or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.output) != 1 or node.output[0] in pinned:
            continue
        later = reading.get(node.output[0], set()) - {placed[i]}
        sources = [v for v in node.input if v and v not in fed]
        if later and all(
            later <= copied[v] if v in copied else latest[v] >= max(later) for v in sources
        ):
            copied[node.output[0]] = later
            for s in sorted(later):
                copies.setdefault(s, []).append(node)
    return copies


def _still_read(
    graph: onnx.GraphProto, removed: Set[int], kernels: Sequence[Kernel]
) -> set[int]:
    """The nodes of ``removed`` (indices into ``graph.node``) that must stay: those that
    compute, directly or through other removed nodes, a value that none of ``kernels`` writes
    and that a node left in the graph, a kernel or a graph output reads. A
    kernel dropped at its check leaves the nodes of another in use (the backward nodes of a
    GELU whose gradient kernel was dropped read what its forward kernel's nodes computed);
    those nodes then compute it as before."""
    written = {o for kernel in kernels for o in kernel.outputs}
    producer = {o: i for i in removed for o in graph.node[i].output if o}
    wanted = [o.name for o in graph.output]
    wanted += [v for i, node in enumerate(graph.node) if i not in removed for v in node.input]
    wanted += [v for kernel in kernels for v in kernel.inputs]
    stay: set[int] = set()
    while wanted:
        name = wanted.pop()
        i = producer.get(name)
        if i is None or i in stay or name in written:
            continue
        stay.add(i)
        wanted += [v for v in graph.node[i].input if v]
    return stay


def _sunk(
    nodes: Sequence[onnx.NodeProto], earliest: Mapping[int, int], pinned: Set[str]
) -> dict[int, int]:
    """The stage of each of ``nodes`` (by index), moved from its ``earliest`` to the first
    stage that reads its outputs where only later nodes read them, so that a small node such
    as the Squeeze of a BatchNorm kernel's statistics joins its reader's segment instead of
    costing a run of its own. A node whose output a kernel reads or that is a graph output
    (``pinned``) stays."""
    readers = _readers(nodes)
    placed = dict(earliest)
    for i in reversed(range(len(nodes))):  # readers come later, so theirs are final
        outs = [o for o in nodes[i].output if o]
        if not outs or any(o in pinned for o in outs):
            continue
        reading = [placed[r] for o in outs for r in readers.get(o, ())]
        if reading:
            placed[i] = max(placed[i], min(reading))
    return placed


def _merged(
    nodes: Sequence[onnx.NodeProto],
    placed: Mapping[int, int],
    pinned: Set[str],
    kernel_reads: Mapping[str, int],
) -> dict[int, int]:
    """``placed`` (the stage of each of ``nodes``) with the nodes of a stage moved, all
    together, into the last later stage that has nodes too and runs no later than the first
    reader of their outputs (a stage's nodes, or its kernels: ``kernel_reads`` maps a value to
    the first stage whose kernels read it, a kernel of stage s running after segment s): one
    onnxruntime run fewer. Two MatMuls whose columns one kernel adds up then share a segment.
    The last stages go first, so that a stage emptied is not a target. A stage that writes a
    graph output (``pinned``) stays."""
    readers = _readers(nodes)
    stages: dict[int, set[int]] = {}
    for i, stage in placed.items():
        stages.setdefault(stage, set()).add(i)
    moved = dict(placed)
    for stage in sorted(stages, reverse=True):
        group = stages[stage]
        outs = [o for i in group for o in nodes[i].output if o]
        if not group or any(o in pinned for o in outs):
            continue
        later = [moved[r] for o in outs for r in readers.get(o, ()) if r not in group]
        later += [kernel_reads[o] for o in outs if o in kernel_reads]
        limit = min(later, default=stage)
        target = max((t for t in stages if stage < t <= limit and stages[t]), default=stage)
        if target > stage:
            for i in group:
                moved[i] = target
            stages[target] |= group
            stages[stage] = set()
    return moved


def _readers(nodes: Sequence[onnx.NodeProto]) -> dict[str, list[int]]:
    """The indices of the nodes that read each value."""
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for v in node.input:
            if v:
                readers.setdefault(v, []).append(i)
    return readers


def _types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:
        inferred = model.graph
    return {
        v.name: v for v in [*inferred.value_info, *inferred.input, *inferred.output]
    }


def _float(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, graph_match.FLOAT, None)


class SegmentedRunner:
    """Runs a :class:`Plan` as one step, with :class:`BoundRunner`'s interface.

    Args:
        plan: The segments and kernels.
        make_session: Creates the onnxruntime session of a segment's model.
        device: The CPU device.
        threads: The kernels' thread count.
        layouts: Whether ``make_session`` rewrites the segments for the CPU
            (``SessionConfig.specialize``): the filter reorders of the rewrite are then
            taken out of the segments and run natively before them
            (:func:`~traingraph.runtime.cpu.kernels.permutes.split_filter_reorders`).
    """

    def __init__(
        self,
        plan: Plan,
        make_session: Callable[[onnx.ModelProto], ort.InferenceSession],
        device: Device,
        threads: int,
        layouts: bool = False,
    ) -> None:
        self.device = device
        self._plan = plan
        self._threads = threads
        produced = {o for s in plan.segments for o in s.outputs}
        produced |= {o for k in plan.all_kernels for o in k.outputs}
        split, found = _with_native_reorders(plan.segments, produced) if layouts else (
            plan.segments, [[] for _ in plan.segments]
        )  # fmt: skip
        plan, segments, reorders = _flips_reordered(plan, split, found)
        self._plan = plan
        produced |= {o for rs in reorders for r in rs for o in r.outputs}
        # a segment whose values nothing reads (nodes left behind by the kernels around
        # them) runs nothing
        self._runners = [
            BoundRunner(_idle(make_session(s.model)), device)
            if s.model.graph.node and s.outputs
            else None
            for s in segments
        ]
        self.inputs: dict[str, Any] = {}
        for runner, segment in zip(self._runners, segments):
            for name in segment.inputs:
                if runner is not None and name not in produced:
                    self.inputs.setdefault(name, runner.inputs[name])
        for info in plan.other_inputs:
            self.inputs[info.name] = _Input.of(info)
        self.output_infos: list[Any] = []
        for runner, segment in zip(self._runners, segments):
            for info in runner.session.get_outputs() if runner is not None else []:
                view = segment.output_views.get(info.name)
                self.output_infos.append(
                    info if view is None
                    else OutputInfo(view.target, list(view.target_shape), info.type)
                )  # fmt: skip
        # each graph output a segment writes under another shape: a view of the caller's
        # buffer (by the buffer's id) in that shape
        self._output_views: dict[tuple[str, int], tuple[ort.OrtValue, ort.OrtValue]] = {}
        self.outputs = [info.name for info in self.output_infos] + [
            o for k in plan.all_kernels for o in k.outputs
        ]
        # what runs, in order: an onnxruntime run of a segment, or a kernel
        self._steps: list[tuple[BoundRunner, Segment] | Kernel] = list(plan.first)
        for runner, segment, kernels, before in zip(
            self._runners, segments, plan.kernels, reorders
        ):
            if runner is not None:
                self._steps += before  # a segment's filter reorders, just before it
                self._steps.append((runner, segment))
            self._steps += kernels
        # the values each step reads for the last time (a view's source lives as long as
        # the view: both are the source's memory)
        last: dict[str, int] = {}
        for i, step in enumerate(self._steps):
            for name in step_reads(step):
                last[name] = i
        for i in reversed(range(len(self._steps))):
            step = self._steps[i]
            if isinstance(step, ViewStep):
                last[step.source] = max(last.get(step.source, i), last.get(step.out, i))
        self._done: list[list[str]] = [[] for _ in self._steps]
        for name, i in last.items():
            self._done[i].append(name)
        for i, step in enumerate(self._steps):  # a value that several steps write (a
            for name in step_writes(step):  # constant each segment computes) lives to the last
                last[name] = max(last.get(name, i), i)
        self._last = last
        self._fed: dict[str, Any] = {}
        # The values passed from one segment or kernel to later ones, kept from step to step
        # while the inputs keep their shapes: bound once, written in place, read without a
        # copy. Values that are not read at the same time share memory (:meth:`_buffers`).
        self._cuts: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # written by segments
        self._kept: dict[str, np.ndarray] = {}  # written by kernels
        self._cut_key: tuple[Any, ...] | None = None

    def bind_input(self, name: str, value: ort.OrtValue | np.ndarray) -> None:
        """Bind the model input ``name`` for the next runs."""
        self._fed[name] = value

    def run(self, outputs: Mapping[str, ort.OrtValue | None]) -> dict[str, Any]:
        """Run every segment and kernel in turn. ``outputs``: the model outputs wanted, each
        a buffer to write or None. Returns them (those not given a buffer are valid until the
        next run)."""
        key = (
            tuple(
                (name, tuple(v.shape()) if isinstance(v, ort.OrtValue) else np.shape(v))
                for name, v in self._fed.items()
            ),
            tuple((name, value is None) for name, value in outputs.items()),
        )
        if key == self._cut_key:
            try:
                return self._run(outputs, self._cuts, self._kept)
            except Exception:  # a shape the inputs do not decide: allocate every run
                self._cut_key = None
        self._cuts, self._kept = {}, {}
        written: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        values = self._run(outputs, self._cuts, self._kept, written)
        self._cuts, self._kept = self._buffers(written, outputs)
        self._cut_key = key
        heap.trim()  # what the run's values took before they had buffers
        return values

    def _run(
        self,
        outputs: Mapping[str, ort.OrtValue | None],
        cuts: Mapping[str, tuple[np.ndarray, ort.OrtValue]],
        kept: Mapping[str, np.ndarray],
        written: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = None,
    ) -> dict[str, Any]:
        """Run the steps, segments writing into ``cuts`` and kernels into ``kept`` where
        those hold a value, and return the ``outputs``. With ``written``, record there the
        type and shape of each value in host memory that a step writes into memory of its
        own, and let go of each value after its last reader: a segment's values move out of
        onnxruntime's memory as they are written (:meth:`_moved`), so that its arena holds a
        segment's own intermediates alone, as in the runs with buffers."""
        values: dict[str, Any] = dict(self._fed)
        for i, step in enumerate(self._steps):
            if isinstance(step, tuple):
                runner, segment = step
                for name in segment.inputs:
                    runner.bind_input(name, values[name])
                bound = {
                    o: outputs[o] if o in outputs else cuts[o][1] if o in cuts else None
                    for o in segment.outputs
                }  # fmt: skip
                for name, view in segment.output_views.items():
                    bound[name] = self._view_of_output(name, view, outputs) or bound[name]
                values.update(runner.run(bound))
                if written is not None:
                    _moved(runner, bound, values, outputs)
                for name, view in segment.output_views.items():
                    given = outputs.get(view.target)
                    if given is None:  # the value's buffer under the output's shape
                        cut = cuts.get(name)
                        array = cut[0] if cut is not None else np.array(_host(values[name]))
                        given = ort.OrtValue.ortvalue_from_numpy(array.reshape(view.target_shape))
                    values[view.target] = given
            else:
                self._run_kernel(step, values, outputs, kept)
            if written is not None:
                for name in [] if isinstance(step, ViewStep) else step_writes(step):
                    if self._written_into_output(step, name, outputs):
                        continue
                    value = values[name]
                    if outputs.get(name) is None and isinstance(
                        value, ort.OrtValue if isinstance(step, tuple) else np.ndarray
                    ):
                        array = _host(value)
                        written[name] = (array.dtype, array.shape)
                for name in self._done[i]:
                    if name not in outputs:
                        values.pop(name, None)
        return {name: values[name] for name in outputs}

    def _view_of_output(
        self, name: str, view: OutputView, outputs: Mapping[str, ort.OrtValue | None]
    ) -> ort.OrtValue | None:
        """The caller's buffer of ``view``'s graph output under the shape of ``name``, the value
        the segment writes (made once per buffer); None where the caller gave it no buffer."""
        buffer = outputs.get(view.target)
        if buffer is None:
            return None
        key = (name, id(buffer))
        cached = self._output_views.get(key)
        if cached is None or cached[0] is not buffer:
            cached = (buffer, device_view(buffer, 0, view.shape, view.dtype, self.device.index))
            self._output_views[key] = cached
        return cached[1]

    @staticmethod
    def _written_into_output(
        step: tuple[BoundRunner, Segment] | Kernel, name: str, outputs: Mapping[str, Any]
    ) -> bool:
        """Whether the segment ``step`` writes ``name`` into the caller's buffer of a graph
        output (so it needs no buffer of its own)."""
        if not isinstance(step, tuple):
            return False
        view = step[1].output_views.get(name)
        return view is not None and outputs.get(view.target) is not None

    def _host(self, name: str, value: Any) -> np.ndarray:
        cut = self._cuts.get(name)
        return cut[0] if cut is not None and cut[1] is value else _host(value)

    def _buffers(
        self,
        written: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
        outputs: Mapping[str, ort.OrtValue | None],
    ) -> tuple[dict[str, tuple[np.ndarray, ort.OrtValue]], dict[str, np.ndarray]]:
        """Buffers of the types and shapes in ``written``: for the values a segment writes
        (not the caller's ``outputs``, which onnxruntime allocates), the array and its
        OrtValue; for those a kernel writes, the array.

        A value lives from the step that writes it to the last that reads it (a value that
        several steps write, to the last of them; one the caller asks for, to the end of the
        run). The buffers are views of one block, where values that do not live at the same
        time share memory (:func:`offsets`), so that the step's working set stays small and
        in cache.
        """
        names: list[str] = []
        lives: list[tuple[int, int, int]] = []  # each value's bytes, first and last step
        seen: set[str] = set()
        # a value a graph output is a view of (the caller gave the output no buffer) lives on
        viewed = {
            name
            for step in self._steps if isinstance(step, tuple)
            for name, view in step[1].output_views.items() if view.target in outputs
        }  # fmt: skip
        for start, step in enumerate(self._steps):
            for name in step_writes(step):
                if name not in written or (isinstance(step, tuple) and name in outputs):
                    continue
                if name in seen:
                    continue  # written again, into the memory its first writer got
                dtype, shape = written[name]
                size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                lasting = name in outputs or name in viewed
                end = len(self._steps) if lasting else max(self._last[name], start)
                names.append(name)
                seen.add(name)
                lives.append((size, start, end))
        starts, total = offsets(lives)
        block = _aligned(total)
        cuts: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}
        kept: dict[str, np.ndarray] = {}
        segment_values = {o for s in self._steps if isinstance(s, tuple) for o in s[1].outputs}
        for name, (size, _, _), offset in zip(names, lives, starts):
            dtype, shape = written[name]
            array = block[offset : offset + size].view(dtype).reshape(shape)
            if name in segment_values:
                cuts[name] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            else:
                kept[name] = array
        return cuts, kept

    def _run_kernel(
        self,
        kernel: Kernel,
        values: dict[str, Any],
        outputs: Mapping[str, ort.OrtValue | None],
        kept: Mapping[str, np.ndarray],
    ) -> None:
        """Run ``kernel`` on ``values``, adding what it writes to them: into the buffers of
        ``outputs`` where given, else into the ``kept`` arrays where there, else into new
        ones."""
        arrays = {name: self._host(name, values[name]) for name in kernel.inputs}
        out: dict[str, np.ndarray] = {}
        for o in kernel.outputs:
            buffer = outputs.get(o)
            if buffer is not None:
                out[o] = buffer.numpy()  # written in place
            elif o in kept:
                out[o] = kept[o]
        kernel.compute(arrays, out, self._threads)
        for o in kernel.outputs:
            values[o] = out[o]


def _with_native_reorders(
    segments: Sequence[Segment], taken: Set[str]
) -> tuple[list[Segment], list[list[Kernel]]]:
    """``segments`` (rewritten for the CPU where the rewrite changes them) with their filter
    reorders and their weight gradients' transposed operands taken out
    (:func:`~traingraph.runtime.cpu.kernels.permutes.split_filter_reorders`,
    :func:`~traingraph.runtime.cpu.kernels.permutes.split_transposed_operands`), each with the
    copies as inputs, and the copies of each; the others as they are."""
    names = set(taken)
    split_segments: list[Segment] = []
    reorders: list[list[Kernel]] = []
    for segment in segments:
        found: list[Kernel] = []
        if segment.model.graph.node:
            source = segment.model.SerializeToString()
            rewritten = for_cpu(source)
            if rewritten is not source:
                assert isinstance(rewritten, bytes)
                model, filters = split_filter_reorders(onnx.load_from_string(rewritten), names)
            else:  # no blocked layouts: an input gradient's swapped filter axes, perhaps
                model, filters = split_filter_reorders(segment.model, names)
            taken_now = names | {r.out for r in filters}
            model, transposed = split_transposed_operands(model, taken_now)
            found = [*filters, *transposed]
        if found:
            names |= {o for r in found for o in r.outputs}
            new_inputs = [o for r in found for o in r.outputs]
            inputs = [*segment.inputs, *new_inputs]
            segment = dataclasses.replace(segment, model=model, inputs=inputs)
        split_segments.append(segment)
        reorders.append(found)
    return split_segments, reorders


def _flips_reordered(
    plan: Plan, segments: Sequence[Segment], reorders: Sequence[Sequence[Kernel]]
) -> tuple[Plan, list[Segment], list[list[Kernel]]]:
    """``plan``, ``segments`` and their ``reorders`` with each :class:`FlippedFilter` whose
    flipped filters only one reorder reads made one copy with it (:class:`FlippedReorder`):
    the flipped filters are then neither written nor a segment's input."""
    flips = {k.out: k for k in plan.first if isinstance(k, FlippedFilter)}
    if not flips or not any(reorders):
        return plan, list(segments), [list(r) for r in reorders]
    readers: Counter[str] = Counter()
    for segment in segments:  # the nodes whose values are read (onnxruntime drops the others)
        live = _live_nodes(segment.model.graph)
        readers.update({v for node in live for v in node.input if v})
        readers.update(o.name for o in segment.model.graph.output)
    for kernel in plan.all_kernels:
        readers.update(kernel.inputs)
    for step in (r for rs in reorders for r in rs):
        readers.update(step.inputs)
    fused: set[str] = set()
    new_reorders: list[list[Kernel]] = []
    new_segments: list[Segment] = []
    for segment, found in zip(segments, reorders):
        kept: list[Kernel] = []
        for reorder in found:
            flip = flips.get(reorder.src) if isinstance(reorder, FilterReorder) else None
            if flip is None or not isinstance(reorder, FilterReorder) or readers[flip.out] != 1:
                kept.append(reorder)
                continue
            kept.append(FlippedReorder(flip.weight, reorder, flip.group))
            fused.add(flip.out)
        if fused & set(segment.inputs):
            model = onnx.ModelProto()
            model.CopyFrom(_without_unread(segment.model))
            inputs = [i for i in model.graph.input if i.name not in fused]
            del model.graph.input[:]
            model.graph.input.extend(inputs)
            inputs = [v for v in segment.inputs if v not in fused]
            segment = dataclasses.replace(segment, model=model, inputs=inputs)
        new_segments.append(segment)
        new_reorders.append(kept)
    first = [k for k in plan.first if not (isinstance(k, FlippedFilter) and k.out in fused)]
    return dataclasses.replace(plan, first=first), new_segments, new_reorders


def _live_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` (in order) whose values a graph output needs."""
    wanted = {o.name for o in graph.output}
    live: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if wanted & set(node.output):
            wanted.update(node.input)
            live.append(node)
    return live[::-1]


def _moved(
    runner: BoundRunner,
    bound: Mapping[str, ort.OrtValue | None],
    values: dict[str, Any],
    outputs: Mapping[str, ort.OrtValue | None],
) -> None:
    """The values a segment's run wrote where onnxruntime chose (``bound`` to None, and not
    the caller's ``outputs``) in ``values`` as copies in memory of their own, and ``runner``
    holding nothing: onnxruntime's memory goes back to its arena at once."""
    for name, buffer in bound.items():
        if buffer is None and name not in outputs:
            value = values[name]
            values[name] = ort.OrtValue.ortvalue_from_numpy(np.array(_host(value), copy=True))
    runner.release()


def _idle(session: ort.InferenceSession) -> ort.InferenceSession:
    """``session``, its worker threads told to stop spinning.

    onnxruntime's CPU workers spin from the session's creation until the end of its first
    run (``session.force_spinning_stop`` stops them after each run): a step's hundred
    segments, created one after the other, would each keep a core busy until the first step
    reaches them, and slow down the creation of the rest. A run that the run options
    terminate at once, on empty inputs, ends the same way and computes nothing."""
    feeds = {}
    for info in session.get_inputs():
        dtype = ort_type_to_numpy(info.type)
        if dtype is None or not isinstance(info.shape, list):
            return session
        shape = [d if isinstance(d, int) and d >= 0 else 0 for d in info.shape]
        feeds[info.name] = np.empty(shape, dtype)
    options = ort.RunOptions()
    options.terminate = True
    with contextlib.suppress(Exception):  # the terminated run's error, as intended
        session.run(None, feeds, options)
    return session


def step_reads(step: tuple[Any, Segment] | Kernel) -> list[str]:
    """What a step of a segmented run reads: a segment's inputs (a ``(session, segment)``
    pair) or a kernel's."""
    return step[1].inputs if isinstance(step, tuple) else list(step.inputs)


def step_writes(step: tuple[Any, Segment] | Kernel) -> list[str]:
    """What a step of a segmented run writes, as :func:`step_reads`."""
    return step[1].outputs if isinstance(step, tuple) else list(step.outputs)


def runner(
    model: onnx.ModelProto,
    kernels: Sequence[tuple[Kernel, set[int]]],
    make_session: Callable[[onnx.ModelProto], ort.InferenceSession],
    device: Device,
    threads: int,
    weight_grads: Sequence[conv_grads.WeightGrad] = (),
    layouts: bool = False,
) -> BoundRunner | SegmentedRunner:
    """A :class:`SegmentedRunner` of ``model`` cut around ``kernels``, or, where there are none
    or onnxruntime rejects a segment, a :class:`BoundRunner` of ``model`` whole, without the
    nodes only the kernels read (with a warning in the second case: the step is then slower,
    not wrong).

    ``weight_grads``, split from ``model`` by
    :func:`~traingraph.runtime.cpu.kernels.conv_grads.split_weight_grads`, are computed by the
    :class:`SegmentedRunner` as soon as it has their values (and written into the run's
    outputs named ``<param>_grad``); the caller computes them after a :class:`BoundRunner`'s
    run. ``layouts``: as for :class:`SegmentedRunner`."""
    if kernels:
        moved = [(conv_grads.WeightGradKernel(g), set[int]()) for g in weight_grads]
        try:
            plan = plan_segments(model, [*kernels, *moved])
            return SegmentedRunner(plan, make_session, device, threads, layouts)
        except Exception as error:  # the whole graph still runs
            warnings.warn(
                f"running the training graph whole, without its native kernels: a segment"
                f" failed to load ({type(error).__name__}: {str(error)[:200]})",
                RuntimeWarning,
                stacklevel=2,
            )
            model = _without_unread(model)
    return BoundRunner(make_session(model), device)


def after_run(
    runner: BoundRunner | SegmentedRunner, grads: Sequence[conv_grads.WeightGrad]
) -> list[conv_grads.WeightGrad]:
    """The weight gradients of ``grads`` (given to :func:`runner`) that its caller computes
    after each run: none where ``runner`` is a :class:`SegmentedRunner`, whose kernels
    compute them."""
    return [] if isinstance(runner, SegmentedRunner) else list(grads)


def _without_unread(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the nodes whose outputs neither a graph output is nor a node reads."""
    return graph_match.with_nodes(model, _live_nodes(model.graph))


@dataclass(frozen=True)
class _Input:
    """A model input as onnxruntime describes one (``NodeArg``): name, shape, type."""

    name: str
    shape: list[int | str | None]
    type: str

    @staticmethod
    def of(info: onnx.ValueInfoProto) -> _Input:
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                for d in tensor.shape.dim]  # fmt: skip
        name = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
        return _Input(info.name, dims, f"tensor({_ORT_TYPE_NAMES.get(name, name)})")


_ORT_TYPE_NAMES = {"float32": "float", "float64": "double"}


def offsets(
    lives: Sequence[tuple[int, int, int]], alignment: int = 64
) -> tuple[list[int], int]:
    """Where each value of ``lives`` (its bytes, the first and the last step it lives in)
    starts in one block, and the block's bytes: two values that live at the same time do not
    overlap. The largest values are placed first, each at the start of the smallest gap that
    holds it between those placed that live at the same time (or after the last of them), on
    an ``alignment`` boundary (a cache line by default): the block comes close to the most
    bytes that live at once.
    """
    starts = [0] * len(lives)
    placed: list[int] = []
    total = 0
    for i in sorted(range(len(lives)), key=lambda k: (-lives[k][0], lives[k][1])):
        size, first, last = lives[i]
        size = -(-size // alignment) * alignment
        taken = sorted(
            (starts[k], starts[k] + lives[k][0])
            for k in placed
            if lives[k][1] <= last and first <= lives[k][2]
        )
        best, best_gap, end = None, None, 0
        for start, stop in taken:
            gap = start - end
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = end, gap
            end = max(end, -(-stop // alignment) * alignment)
        starts[i] = end if best is None else best
        placed.append(i)
        total = max(total, starts[i] + size)
    return starts, total


def _aligned(size: int, alignment: int = 64) -> np.ndarray:
    """``size`` bytes that start on an ``alignment`` boundary (a cache line)."""
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + size]


def _host(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else value
