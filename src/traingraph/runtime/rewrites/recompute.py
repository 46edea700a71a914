"""Cheap forward values computed again for the gradient pass, where that shortens what is held.

A training graph keeps every forward value its gradient nodes read, from the forward pass to
the gradient node that reads it last. Where such a value is one elementwise op of values the
gradient pass reads anyway (a GELU's output, whose input its own gradient reads; a scaled
query, whose input the product's gradient reads), computing it again right before its first
gradient reader lets the forward copy go after its last forward reader: one more pass over it,
and one tensor less held through the forward pass. In ViT-B/16 at batch 64 each layer's GELU
output is 155 MB.

:class:`RecomputeInBackward`, an onnx-ir pass, finds the gradient pass as the nodes named
``grad/...`` (the autodiff names them so) and takes a node of :data:`CHEAP_OPS` before it when

- its output is read by a gradient node and is not a graph output,
- each of its inputs is a constant, an initializer, a graph input, or a value some gradient
  node at or after the first gradient reader of the output reads too (so it is held there
  anyway),
- no node computed again reads its output (that reader's copy holds it);

and computes it again (a copy of the node, ``<name>/recomputed``) before that reader, which
and every later gradient reader then reads the copy. The values are the same, bit for bit.
onnxruntime's common subexpression elimination would merge the copy back into the node it
copies, so a model that has copies carries :data:`MARK` in its metadata and its sessions run
without that optimizer (:func:`disabled_optimizers`). CUDA sessions apply the pass where
``SessionConfig(recompute=True)`` asks for it
(:func:`traingraph.runtime.rewrites.specialize.for_cuda`). What it saves depends on where
onnxruntime's own execution order puts the step's peak: on an H200, GPT-2 small at 8 x 512
held 11.81 GiB against 12.20 at 50.8 ms against 49.9; BERT-base and ViT-B/16 held what they
held without it.
"""

from __future__ import annotations

import onnx_ir as ir

GRADIENT_PREFIX = "grad/"
"""The name prefix of the nodes the autodiff writes for the gradient pass."""
MARK = "traingraph.recomputed"
"""The metadata key of a model with recomputed values (their count)."""
CHEAP_OPS = frozenset({
    "Abs", "Add", "Cast", "Div", "Elu", "Erf", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu",
    "Max", "Min", "Mul", "Neg", "Relu", "Selu", "Sigmoid", "Softplus", "Sqrt", "Sub", "Tanh",
    "Where",
})  # fmt: skip
"""Elementwise ops of one pass, computed again rather than held. Comparisons are not among
them: their boolean masks are a quarter of a float32 tensor, and an input computed again
keeps its reader from being computed again."""


class RecomputeInBackward(ir.passes.InPlacePass):
    """Compute cheap forward values again for the gradient pass (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = list(graph)
        first = next(
            (i for i, n in enumerate(nodes) if (n.name or "").startswith(GRADIENT_PREFIX)), None
        )
        if first is None:
            return ir.passes.PassResult(model, modified=False)
        position = {node: i for i, node in enumerate(nodes)}
        chosen: dict[ir.Node, int] = {}
        # Last first: a value that a chosen node reads is held for its copy, so it stays.
        for node in reversed(nodes[:first]):
            late = _first_late_use(node, position, first)
            if late is None or any(use.node in chosen for use in node.outputs[0].uses()):
                continue
            if all(_held_at(value, late, position, first) for value in node.inputs):
                chosen[node] = late
        for node, late in chosen.items():
            _recompute(graph, node, nodes[late], position, first)
        if chosen:
            model.metadata_props[MARK] = str(len(chosen))
        return ir.passes.PassResult(model, modified=bool(chosen))


def _first_late_use(node: ir.Node, position: dict[ir.Node, int], first: int) -> int | None:
    """The position of the first gradient node reading ``node``'s output, where the node may
    be computed again (see the module docstring); else None."""
    if node.op_type not in CHEAP_OPS or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.outputs) != 1 or node.outputs[0].is_graph_output():
        return None
    late = [position[use.node] for use in node.outputs[0].uses() if position[use.node] >= first]
    return min(late) if late else None


def _held_at(value: ir.Value | None, late: int, position: dict[ir.Node, int], first: int) -> bool:
    """Whether ``value`` is held at position ``late`` anyway: a constant, an initializer, a
    graph input, or read by a gradient node there or later."""
    if value is None or value.is_graph_input() or value.is_initializer():
        return True
    producer = value.producer()
    if producer is None or producer.op_type == "Constant":
        return True
    return any(position[use.node] >= max(late, first) for use in value.uses())


def _recompute(
    graph: ir.Graph, node: ir.Node, before: ir.Node, position: dict[ir.Node, int], first: int
) -> None:
    """Copy ``node`` before ``before`` and point its gradient readers at the copy."""
    copy = ir.Node(
        node.domain,
        node.op_type,
        list(node.inputs),
        attributes=list(node.attributes.values()),
        name=f"{node.name or node.outputs[0].name}/recomputed",
    )
    graph.insert_before(before, copy)
    out, again = node.outputs[0], copy.outputs[0]
    again.name = f"{out.name}/recomputed"
    again.type, again.shape = out.type, out.shape
    for use in list(out.uses()):
        if position.get(use.node, -1) >= first:
            use.node.replace_input_with(use.idx, again)


def disabled_optimizers(model: bytes | str) -> list[str]:
    """The onnxruntime optimizers a session of ``model`` (serialized, or a path) runs
    without: common subexpression elimination where the model has recomputed values."""
    if isinstance(model, bytes):
        return ["CommonSubexpressionElimination"] if MARK.encode() in model else []
    return []
