"""GELU and its gradient, run natively on the CPU between onnxruntime segments.

An exporter writes the exact GELU, ``a * (1 + erf(a / sqrt 2)) / 2``, as five elementwise
nodes (Div, Erf, Add, Mul, Mul), and the training graph's gradient of it as about ten more
(the products of both factors, the derivative of Erf through Mul, Neg and Exp, and their Sum),
each a pass over the activation in onnxruntime, about fifteen passes over the feed-forward
layers' widest activation; the tanh approximation (GPT-2's), ``a / 2 (1 + tanh(sqrt(2 / pi)
(a + 0.044715 a^3)))``, takes eight nodes and twelve for its gradient. :class:`Gelu` computes
the forward in one pass and the gradient, ``g * GELU'(a)``, in another (``_convc.gelu``), from
``a`` and the output's gradient ``g`` alone. Where a Dropout follows (a Mul by its mask, which
only it reads), the forward writes the masked output and the gradient reads the masked
output's gradient: the two Muls by the mask go too.

:func:`split_gelus` takes each GELU that the rules of
:data:`traingraph.runtime.cpu.patterns.GELU` and
:data:`~traingraph.runtime.cpu.patterns.GELU_TANH` match and walks from its nodes to the
gradient nodes that read its intermediate values: autodiff writes that gradient op by op (no
rule writes it whole, to tag it), and its form follows how the contributions of the GELU's uses
of ``a`` are summed. From opset 20 the exporters write ``nn.GELU`` as one ``Gelu`` op, which
onnxruntime computes in one kernel; its gradient, the nodes the ``Gelu`` rule writes after its
input, becomes one kernel the same way. The nodes are replaced only where nothing else reads
those values. Each match is checked against the nodes it replaces on random inputs and with
NaN and infinities. The kernel's erf is within 1.5e-7 of the exact one and its tanh within 2
units in the last place (onnxruntime's are within a few units in the last place).

The artifacts on disk stay standard ONNX; this is how the CPU runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, replace

import numpy as np
import onnx

from traingraph.runtime.cpu import graph_match, patterns, verify
from traingraph.runtime.cpu.native import NATIVE, Arrays, OneOutput, Outputs, output_array

_DEFAULT = ("", "ai.onnx")
_ELEMENTWISE = frozenset(
    {"Mul", "Div", "Add", "Sub", "Neg", "Exp", "Erf", "Tanh", "Sum", "Pow", "Sqrt"}
)
_MAX_GRAD_NODES = 24  # about ten for the gradient of one GELU


@dataclass(frozen=True)
class Gelu(OneOutput):
    """``out = GELU(a)``, or where ``g`` is given, ``out = g * GELU'(a)``: the gradient of
    ``a`` for the gradient ``g`` of GELU's output; times ``mask`` where given.

    Attributes:
        a: GELU's input.
        g: The gradient of its output, or None for the forward.
        out: The value the kernel writes.
        mask: A factor of GELU's output (the Dropout mask after it), or None. With ``g``, the
            gradient of ``a`` for the gradient ``g`` of the product.
        tanh: The tanh approximation, ``a / 2 (1 + tanh(sqrt(2 / pi) (a + 0.044715 a^3)))``,
            instead of the exact GELU.
    """

    a: str
    g: str | None
    out: str
    mask: str | None = None
    tanh: bool = False

    @property
    def inputs(self) -> list[str]:
        return [self.a] + ([self.g] if self.g else []) + ([self.mask] if self.mask else [])

    def compute(self, values: Arrays, out: Outputs, threads: int) -> None:
        """Write ``out`` into ``out`` (in place where an array of its shape is there)."""
        a = values[self.a]
        g = values[self.g] if self.g else None
        if g is not None and g.shape != a.shape:
            raise ValueError(
                f"gelu gradient {self.out!r}: the gradient {list(g.shape)} must have the input's"
                f" shape {list(a.shape)}"
            )
        assert NATIVE is not None
        mask = values[self.mask] if self.mask else None
        if mask is not None and mask.shape != a.shape:  # a factor that broadcasts
            plain = np.empty(a.shape, np.float32)
            NATIVE.gelu(a, g, plain, threads, None, self.tanh)
            product = plain * mask
            output_array(out, self.out, product.shape)[...] = product
            return
        target = output_array(out, self.out, a.shape)
        NATIVE.gelu(a, g, target, threads, mask, self.tanh)


def split_gelus(
    model: onnx.ModelProto, taken: Set[int] = frozenset(), read: Set[str] = frozenset()
) -> list[tuple[Gelu, set[int]]]:
    """Each GELU of ``model`` (a match of :data:`traingraph.runtime.cpu.patterns.GELU` or
    :data:`~traingraph.runtime.cpu.patterns.GELU_TANH`, with the Dropout mask after it where
    there is one) and the gradient that reads its values, as :class:`Gelu` kernels with the
    indices of the nodes each replaces, none in ``taken`` (other kernels' nodes, which read
    only the values in ``read``). ``[]`` where the extension is missing or nothing matches."""
    if NATIVE is None or not hasattr(NATIVE, "gelu"):
        return []
    matches: list[tuple[Gelu, set[int]]] = []
    claimed = set(taken)
    constants = graph_match.constant_values(model.graph)
    index: graph_match.GraphIndex | None = None
    shapes: Mapping[str, list[int | None]] = {}
    for family, tanh in ((patterns.GELU, False), (patterns.GELU_TANH, True)):
        found = patterns.find(model, family, claimed, read)
        if found.index is None or not found.matches:
            continue
        index, shapes = found.index, found.shapes
        for match in found.matches:
            kernels = _kernels(index, match, constants, claimed, tanh)
            for kernel, nodes in kernels or []:
                claimed |= nodes
                matches.append((kernel, nodes))
    ops = [
        i for i, node in enumerate(model.graph.node)
        if node.op_type == "Gelu" and node.domain in _DEFAULT and i not in claimed
    ]  # fmt: skip
    if ops:
        if index is None:
            index = graph_match.GraphIndex.of(model.graph)
            shapes = graph_match.inferred_shapes(model)
        for i in ops:
            gradient = _op_gradient(index, i, constants, claimed)
            if gradient is not None:
                claimed |= gradient[1]
                matches.append(gradient)
    if index is None or not matches:
        return []
    return verify.verified_kernels(model, index, matches, shapes)


def _scalar(constants: Mapping[str, np.ndarray], name: str) -> float | None:
    value = constants.get(name)
    if value is None or value.size != 1 or value.dtype != np.float32:
        return None
    return float(value.reshape(()))


def _other(node: onnx.NodeProto, value: str) -> str | None:
    """The other input of a two-input node one of whose inputs is ``value``."""
    if len(node.input) != 2 or value not in node.input or node.input[0] == node.input[1]:
        return None
    return node.input[1] if node.input[0] == value else node.input[0]


def _kernels(
    g: graph_match.GraphIndex,
    match: patterns.Match,
    constants: Mapping[str, np.ndarray],
    taken: Set[int],
    tanh: bool,
) -> list[tuple[Gelu, set[int]]] | None:
    """The forward kernel of the GELU ``match`` (the ``tanh`` approximation's, or the exact
    one's) and the gradient kernel, where the graph has one (the nodes after the values of the
    forward: :func:`_backward`), or None where they are not a GELU's alone."""
    if match.nodes & taken:
        return None
    a, y, masked = match.name("a"), match.name("gelu"), match.name("masked")
    assert a is not None and y is not None
    front = set(match.nodes) - ({g.producer[masked]} if masked else set())
    values = {a} | {o for i in front for o in g.nodes[i].output if o and o != y}
    grads = {
        r for v in values for r in g.consumers.get(v, set()) if r not in front
    }  # fmt: skip
    kernels = [(Gelu(a, None, y, tanh=tanh), front)]
    if grads:
        backward = _backward(g, a, front, grads, constants, taken)
        if backward is None:
            return None
        dy, da, nodes = backward
        kernels.append((Gelu(a, dy, da, tanh=tanh), nodes))
    if masked:
        mask = match.name("mask")
        assert mask is not None
        kernels = [
            (Gelu(a, None, masked, mask, tanh), set(match.nodes)),
            *(_masked_gradient(g, kernel, nodes, mask, taken) for kernel, nodes in kernels[1:]),
        ]
    return kernels if _closed(g, kernels, y) else None


def _closed(g: graph_match.GraphIndex, kernels: list[tuple[Gelu, set[int]]], y: str) -> bool:
    """Whether only the ``kernels``' nodes read the values their nodes compute, other than
    ``y`` and what the kernels write."""
    inside = set().union(*(nodes for _, nodes in kernels))
    results = {y} | {k.out for k, _ in kernels}
    return not any(
        o and o not in results and (o in g.outputs or not g.consumers.get(o, set()) <= inside)
        for i in inside
        for o in g.nodes[i].output
    )


def _op_gradient(
    g: graph_match.GraphIndex,
    i: int,
    constants: Mapping[str, np.ndarray],
    taken: Set[int],
) -> tuple[Gelu, set[int]] | None:
    """The gradient kernel of the ``Gelu`` op at node ``i`` (opset 20: the exporters' form of
    ``nn.GELU`` from that opset on), whose forward onnxruntime computes in one kernel: the
    nodes the gradient rule wrote after its input (:func:`_backward`), or None where there are
    none or they are not the gradient's alone."""
    node = g.nodes[i]
    approximate = next((a.s for a in node.attribute if a.name == "approximate"), b"none")
    if approximate not in (b"none", b"tanh") or len(node.input) != 1 or not node.output[0]:
        return None
    a, y = node.input[0], node.output[0]
    readers = g.consumers.get(a, set()) - {i}
    if not readers:
        return None
    backward = _backward(g, a, {i}, readers, constants, taken)
    if backward is None:
        return None
    dy, da, nodes = backward
    kernel = (Gelu(a, dy, da, tanh=approximate == b"tanh"), nodes)
    return kernel if _closed(g, [kernel], y) else None


def _masked_gradient(
    g: graph_match.GraphIndex, backward: Gelu, nodes: set[int], mask: str, taken: Set[int]
) -> tuple[Gelu, set[int]]:
    """The gradient kernel ``backward`` (of ``nodes``) of a GELU whose output is multiplied by
    ``mask``, with the Mul of the product's gradient by ``mask`` (which writes the gradient of
    GELU's output) taken in, where only the gradient's nodes read what it writes."""
    assert backward.g is not None
    p = g.producer.get(backward.g, -1)
    grad = g.nodes[p] if p >= 0 and p not in taken and p not in nodes else None
    product = _other(grad, mask) if grad is not None and grad.op_type == "Mul" else None
    if (
        grad is None or product is None or grad.domain not in _DEFAULT
        or backward.g in g.outputs or not g.consumers.get(backward.g, set()) <= nodes
    ):  # fmt: skip
        return backward, nodes
    return replace(backward, g=product, mask=mask), nodes | {p}


def _backward(
    g: graph_match.GraphIndex,
    a: str,
    front: set[int],
    readers: set[int],
    constants: Mapping[str, np.ndarray],
    taken: Set[int],
) -> tuple[str, str, set[int]] | None:
    """The gradient of ``a`` that the elementwise nodes after ``readers`` (the nodes outside
    the forward ``front`` that read ``a`` or its values) add up: the gradient of GELU's
    output that they read, the gradient of ``a`` they write, and their indices."""
    after: set[int] = set()  # the elementwise nodes that read a's values, transitively
    stack = list(readers)
    while stack:
        i = stack.pop()
        if i in after or i in front:
            continue
        node = g.nodes[i]
        if i in taken or node.op_type not in _ELEMENTWISE or node.domain not in _DEFAULT:
            continue
        if len([o for o in node.output if o]) != 1:
            return None
        after.add(i)
        if len(after) > _MAX_GRAD_NODES:
            return None
        stack.extend(g.consumers.get(node.output[0], set()))
    if not readers <= after:
        return None
    # the gradient of a leaves them at one node
    exits = [
        i for i in after
        if g.nodes[i].output[0] in g.outputs
        or not g.consumers.get(g.nodes[i].output[0], set()) <= after
    ]  # fmt: skip
    if len(exits) != 1:
        return None
    (total,) = exits
    # back from that node: the nodes after a's values, and a constant factor of the
    # gradient that comes in (the half of GELU taken there); what else enters is the gradient
    produced = {o for i in front for o in g.nodes[i].output}
    nodes: set[int] = set()
    entering: set[str] = set()
    stack = [total]
    while stack:
        i = stack.pop()
        if i in nodes:
            continue
        nodes.add(i)
        for v in g.nodes[i].input:
            if not v or v == a or v in constants or v in produced:
                continue
            j = g.producer.get(v)
            if j is not None and (j in after or _scaled(g, j, constants, taken)):
                stack.append(j)
            else:
                entering.add(v)
    if len(entering) != 1 or not nodes >= after:
        return None
    return next(iter(entering)), g.nodes[total].output[0], nodes


def _scaled(
    g: graph_match.GraphIndex, i: int, constants: Mapping[str, np.ndarray], taken: Set[int]
) -> bool:
    """Whether node ``i`` multiplies a value by a scalar constant."""
    node = g.nodes[i]
    if i in taken or node.op_type != "Mul" or node.domain not in _DEFAULT:
        return False
    factors = [v for v in node.input if v in constants]
    return len(node.input) == 2 and len(factors) == 1 and _scalar(constants, factors[0]) is not None


__all__ = ["Gelu", "split_gelus"]
