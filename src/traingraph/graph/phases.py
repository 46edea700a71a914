"""Splitting a training graph into forward and gradient phases, and planning their memory.

The train graph holds the forward nodes (model + loss) first and the gradient nodes after
them. :func:`split_phases` cuts it into two models: the forward model computes the loss and
outputs plus every forward tensor that a gradient node reads (the *saved activations*); the
gradient model takes those tensors as inputs. The runtime keeps the saved activations as device
OrtValues between the two runs, so nothing is recomputed or copied to the host.

:func:`plan_memory` walks the nodes in execution order with concrete shapes and adds up the
bytes of the tensors alive at each step (a tensor lives from the node that makes it to its last
reader), as onnxruntime's allocation planner does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from traingraph.errors import ModelError

__all__ = ["MemoryPlan", "PhaseModels", "plan_memory", "split_phases"]


@dataclass
class PhaseModels:
    """The two phases of a train graph.

    Attributes:
        forward: Inputs: data, labels, parameters. Outputs: the forward outputs, then the
            ``saved`` ones that are not forward outputs already.
        gradient: Inputs: parameters, data and labels it reads, ``saved``, user gradients.
            Outputs: the gradients.
        saved: The activations handed from the forward phase to the gradient phase.
        full: The whole train graph (shapes inferred), for memory planning.
        forward_nodes: How many of ``full``'s nodes are forward nodes.
    """

    forward: onnx.ModelProto
    gradient: onnx.ModelProto
    saved: list[str]
    full: onnx.ModelProto
    forward_nodes: int


def _needed(nodes: Sequence[onnx.NodeProto], outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """The nodes of ``nodes`` that ``outputs`` depend on, in their order."""
    wanted = set(outputs)
    kept = []
    for node in reversed(nodes):
        if any(o in wanted for o in node.output):
            kept.append(node)
            wanted.update(i for i in node.input if i)
    return kept[::-1]


def _reads(nodes: Sequence[onnx.NodeProto]) -> list[str]:
    """Values ``nodes`` read that none of them produces, in first-use order."""
    produced: set[str] = set()
    reads: dict[str, None] = {}
    for node in nodes:
        for i in node.input:
            if i and i not in produced:
                reads.setdefault(i)
        produced.update(node.output)
    return list(reads)


def split_phases(
    model: onnx.ModelProto,
    forward_nodes: int,
    forward_outputs: Sequence[str],
    gradient_outputs: Sequence[str],
) -> PhaseModels:
    """Cut ``model`` (forward nodes first, then gradient nodes) into its two phases."""
    full = onnx.shape_inference.infer_shapes(model)
    graph = full.graph
    infos = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    inits = {t.name: t for t in graph.initializer}
    nodes = list(graph.node)
    forward, backward = nodes[:forward_nodes], nodes[forward_nodes:]
    made_forward = {o for n in forward for o in n.output}
    grad_nodes = _needed(backward, gradient_outputs)
    saved = [v for v in _reads(grad_nodes) if v in made_forward]
    fwd_nodes = _needed(forward, [*forward_outputs, *saved])

    def build(name: str, phase_nodes: list[onnx.NodeProto], extra_inputs: list[str],
              outputs: Sequence[str]) -> onnx.ModelProto:  # fmt: skip
        reads = [v for v in _reads(phase_nodes) if v not in inits]
        inputs = [v.name for v in graph.input if v.name in reads]
        inputs += [v for v in extra_inputs if v in reads and v not in inputs]
        missing = [v for v in [*inputs, *outputs] if v not in infos]
        if missing:
            raise ModelError(
                f"the {name} phase needs the types of {missing[:5]}, which shape inference could"
                " not find; give the graph inputs complete types"
            )
        used_inits = [inits[v] for v in _reads(phase_nodes) if v in inits]
        phase_graph = helper.make_graph(
            phase_nodes, f"{graph.name}_{name}", [infos[v] for v in inputs],
            [infos[v] for v in outputs], initializer=used_inits,
        )  # fmt: skip
        phase = helper.make_model(phase_graph, opset_imports=list(full.opset_import))
        phase.ir_version = full.ir_version
        return phase

    return PhaseModels(
        forward=build(
            "forward",
            fwd_nodes,
            [],
            [*forward_outputs, *[v for v in saved if v not in forward_outputs]],
        ),
        gradient=build("gradient", grad_nodes, saved, list(gradient_outputs)),
        saved=saved,
        full=full,
        forward_nodes=forward_nodes,
    )


@dataclass
class MemoryPlan:
    """Bytes of a training step's intermediates, from a static plan.

    Attributes:
        forward_peak: Most bytes alive at once in the forward phase (outputs and saved
            activations included).
        saved: Bytes of the saved activations, alive from the forward phase to the gradient one.
        gradient_peak: Most bytes alive at once in the gradient phase, besides ``saved`` and
            the parameter gradients (which live in preallocated buffers).
        unknown: Tensors whose size the plan could not infer (counted as 0 bytes).
    """

    forward_peak: int
    saved: int
    gradient_peak: int
    unknown: list[str]

    @property
    def total(self) -> int:
        """Bytes the device needs for intermediates: the larger of the two phases' peaks."""
        return max(self.forward_peak, self.saved + self.gradient_peak)


def plan_memory(
    phases: PhaseModels,
    input_shapes: Mapping[str, Sequence[int]],
    forward_outputs: Sequence[str],
    preallocated: Iterable[str],
) -> MemoryPlan:
    """Plan the intermediates of both phases for inputs of ``input_shapes``.

    Args:
        phases: The split train graph.
        input_shapes: Concrete shapes of the data and label inputs.
        forward_outputs: The forward phase's outputs besides the saved activations.
        preallocated: Outputs written into buffers that exist anyway (parameter gradients).
    """
    model = onnx.ModelProto()
    model.CopyFrom(phases.full)
    for value in model.graph.input:
        if value.name in input_shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, extent in zip(dims, input_shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(extent)
    del model.graph.value_info[:]
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    sizes: dict[str, int | None] = {}
    for v in [*inferred.graph.value_info, *inferred.graph.output]:
        sizes[v.name] = _nbytes(v)
    nodes = list(inferred.graph.node)
    forward_nodes = _needed(nodes[: phases.forward_nodes], [*forward_outputs, *phases.saved])
    grad_outputs = [o.name for o in phases.gradient.graph.output]
    gradient_nodes = _needed(nodes[phases.forward_nodes :], grad_outputs)
    unknown: list[str] = []

    def size(name: str) -> int:
        value = sizes.get(name)
        if value is None:
            unknown.append(name)
            return 0
        return value

    fwd_peak = _peak(forward_nodes, {*forward_outputs, *phases.saved}, set(), size)
    grad_peak = _peak(gradient_nodes, set(grad_outputs), set(preallocated), size)
    return MemoryPlan(
        forward_peak=fwd_peak,
        saved=sum(size(v) for v in phases.saved),
        gradient_peak=grad_peak,
        unknown=sorted(set(unknown)),
    )


# Elementwise kernels whose output onnxruntime's planner places in the buffer of an input of
# the same size that dies at that node ("may in-place").
_IN_PLACE = frozenset(
    {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Neg", "Identity", "Where",
     "LeakyRelu", "Erf", "Exp", "Sqrt", "Abs", "Reciprocal", "Softplus", "Gelu"}
)  # fmt: skip


def _peak(nodes: list[onnx.NodeProto], kept: set[str], free: set[str], size) -> int:  # type: ignore[no-untyped-def]
    """Most bytes alive at once while ``nodes`` run; ``kept`` outputs live to the end.

    An elementwise node's output reuses a dying input of the same size, as onnxruntime does.
    """
    last_use: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            last_use[name] = index
    produced: set[str] = set()
    alive: dict[str, int] = {}
    peak = 0
    for index, node in enumerate(nodes):
        for out in node.output:
            if out and out not in free:
                produced.add(out)
                donor = _donor(node, out, index, alive, last_use, kept, size)
                if donor is not None:
                    alive[out] = alive.pop(donor)
                    continue
                alive[out] = size(out)
        peak = max(peak, sum(alive.values()))
        for name in set(node.input):
            if name in produced and last_use.get(name) == index and name not in kept:
                alive.pop(name, None)
        for out in node.output:
            if out in alive and out not in last_use and out not in kept:
                alive.pop(out)
    return peak


def _donor(node, out, index, alive, last_use, kept, size) -> str | None:  # type: ignore[no-untyped-def]
    """The input whose buffer ``out`` takes over in place, if any."""
    if node.op_type not in _IN_PLACE or len(node.output) != 1:
        return None
    inputs = list(node.input)
    for name in inputs:
        dying = last_use.get(name) == index and name not in kept and inputs.count(name) == 1
        if dying and name in alive and alive[name] == size(out) > 0:
            return name
    return None


def _nbytes(value: onnx.ValueInfoProto) -> int | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    dims = []
    for dim in tensor.shape.dim:
        if not dim.HasField("dim_value"):
            return None
        dims.append(dim.dim_value)
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize
    return int(np.prod(dims, dtype=np.int64)) * itemsize
