"""Rewrites of a standard ONNX model for the execution provider that runs it.

Training graphs and their artifacts are written once, for any runtime. A few forms that are
right on the CPU are slow or missing in onnxruntime's CUDA provider; :func:`for_cuda` rewrites
them, with the same results, when a CUDA session is created:

- A right ``BitShift`` by a constant becomes a ``Div`` by ``2^k``: the CUDA provider has no
  BitShift kernel (the CPU one is several times faster than an integer Div), so a model that
  shifts (e.g. the hash of a lowered training Dropout) would otherwise run those nodes on the
  CPU, with copies around them, on every step.
- A ``ReduceSum`` or ``ReduceMean`` over axes that are not one run of neighbouring axes (the
  per-channel statistics of BatchNormalization and their gradients reduce ``[0, 2, 3]`` of
  ``NCHW``) becomes a chain of reductions over runs, the innermost first. The provider reduces
  a run that starts or ends the tensor with its own row and column kernels, and hands other
  axis sets to cuDNN's general reduction, which is several times slower on these shapes. Means
  of equal-sized groups are the mean, so the chain computes the same value (summed in another
  order).
- A grouped ``Conv`` with one input channel per group, no bias and the same constant filters
  in every group (the one-hot unfold of a convolution's weight gradient) becomes one ungrouped
  Conv over the channels folded into the batch, between two Reshapes. cuDNN runs the grouped
  form with a slow direct kernel; the values and their layout are the same.
- A product with a cast boolean mask, ``Mul(g, Cast(mask))`` (the gradient of Relu, a Dropout
  mask), becomes ``Where(mask, g, 0)``: one kernel instead of two, where each launch counts.
  The two differ only where the mask is off and ``g`` is not finite (0 instead of NaN) or
  negative (0 instead of -0).

Example:
    >>> source = for_cuda("training_model.onnx")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

Source = str | bytes


def for_cuda(source: Source) -> Source:
    """``source`` (a path or serialized model) rewritten for the CUDA provider; ``source``
    itself where nothing applies."""
    head = onnx.load(source, load_external_data=False) if isinstance(source, str) else None
    if head is not None and not any(_applies(n) for n in head.graph.node):
        return source
    proto = onnx.load(source) if isinstance(source, str) else onnx.load_from_string(source)
    constants = _constants(proto.graph)
    changed = False
    rewrites = (
        _shifts_as_divisions, _reductions_over_runs, _shared_filters_as_batch, _masks_as_where
    )
    for rewrite in rewrites:
        changed = rewrite(proto.graph, constants) or changed
    return proto.SerializeToString() if changed else source


def _applies(node: onnx.NodeProto) -> bool:
    return node.op_type in ("BitShift", "ReduceSum", "ReduceMean", "Conv", "Cast")


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's initializers and Constant node values, by name."""
    constants = {t.name: t for t in graph.initializer}
    constants.update(
        (n.output[0], a.t) for n in graph.node if n.op_type == "Constant"
        for a in n.attribute if a.name == "value"
    )  # fmt: skip
    return constants


def _shifts_as_divisions(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]) -> bool:
    """Write each right BitShift by a constant as a Div by ``2^k``; return whether any was."""
    changed = False
    for node in graph.node:
        direction = next((a.s for a in node.attribute if a.name == "direction"), b"")
        shift = constants.get(node.input[1]) if node.op_type == "BitShift" else None
        if shift is None or direction != b"RIGHT":
            continue
        amount = numpy_helper.to_array(shift)
        divisor = numpy_helper.from_array(
            (np.ones_like(amount) << amount).astype(amount.dtype), f"{node.output[0]}_divisor"
        )
        graph.initializer.append(divisor)
        node.op_type, node.input[1] = "Div", divisor.name
        del node.attribute[:]
        changed = True
    return changed


_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
     onnx.TensorProto.DOUBLE}
)  # fmt: skip


_BOOLEAN_OPS = frozenset(
    {"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Xor"}
)


def _masks_as_where(graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]) -> bool:
    """Write each ``Mul`` by a cast comparison, where the cast has no other use, as a
    ``Where`` of the comparison; return whether any was."""
    del constants
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    masks: dict[str, tuple[str, int]] = {}  # cast output -> (boolean input, float type)
    for node in graph.node:
        source = producers.get(node.input[0]) if node.op_type == "Cast" else None
        to = next((a.i for a in node.attribute if a.name == "to"), 0)
        if (
            source is not None
            and source.op_type in _BOOLEAN_OPS
            and source.domain in ("", "ai.onnx")
            and to in _FLOAT_TYPES
            and uses.get(node.output[0]) == 1
            and node.output[0] not in outputs
        ):
            masks[node.output[0]] = (node.input[0], to)
    products = {
        n.output[0]: n for n in graph.node
        if n.op_type == "Mul" and n.domain in ("", "ai.onnx") and set(n.input) & set(masks)
    }  # fmt: skip
    used = {next(i for i in n.input if i in masks) for n in products.values()}

    def expand(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if node.op_type == "Cast" and node.output[0] in used:
            return []
        if node.op_type != "Mul" or products.get(node.output[0]) is not node:
            return None
        index = 0 if node.input[0] in masks else 1
        mask, to = masks[node.input[index]]
        zero = f"{node.output[0]}_zero"
        graph.initializer.append(
            numpy_helper.from_array(np.zeros((), helper.tensor_dtype_to_np_dtype(to)), zero)
        )
        return [helper.make_node("Where", [mask, node.input[1 - index], zero], [node.output[0]],
                                 name=f"{node.name or node.output[0]}_where")]  # fmt: skip

    return _expand_nodes(graph, expand)


def _reductions_over_runs(
    graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]
) -> bool:
    """Split each ReduceSum / ReduceMean over several runs of axes into one reduction per run
    (innermost run first); return whether any was."""

    def expand(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        runs = _axis_runs(node, constants)
        return None if runs is None else _chain(node, runs, graph.initializer.append)

    return _expand_nodes(graph, expand)


def _expand_nodes(
    graph: onnx.GraphProto, expand: Callable[[onnx.NodeProto], list[onnx.NodeProto] | None]
) -> bool:
    """Replace each node for which ``expand`` returns nodes by those nodes, in place and in
    order; return whether any was replaced."""
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        replacement = expand(node)
        nodes.extend([node] if replacement is None else replacement)
        changed = changed or replacement is not None
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _axis_runs(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
) -> list[list[int]] | None:
    """The node's reduced axes as runs of neighbouring axes, when it is a ReduceSum or
    ReduceMean over constant, non-negative axes that form more than one run; else None."""
    if node.op_type not in ("ReduceSum", "ReduceMean") or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: a for a in node.attribute}
    if "noop_with_empty_axes" in attrs and attrs["noop_with_empty_axes"].i:
        return None
    if len(node.input) > 1 and node.input[1]:
        tensor = constants.get(node.input[1])
        if tensor is None:
            return None
        axes = [int(a) for a in numpy_helper.to_array(tensor).reshape(-1)]
    elif "axes" in attrs:
        axes = list(attrs["axes"].ints)
    else:
        return None
    if not axes or min(axes) < 0 or len(set(axes)) != len(axes):
        return None
    runs: list[list[int]] = []
    for axis in sorted(axes):
        if runs and runs[-1][-1] == axis - 1:
            runs[-1].append(axis)
        else:
            runs.append([axis])
    return runs if len(runs) > 1 else None


def _chain(
    node: onnx.NodeProto,
    runs: list[list[int]],
    add_initializer: Callable[[onnx.TensorProto], None],
) -> list[onnx.NodeProto]:
    """The reductions of ``node`` over ``runs``, innermost first, that end in its output.

    Each keeps or drops its dimensions as ``node`` does: going from the innermost run out,
    dropping a run leaves the axis numbers of the runs before it as they are.
    """
    axes_as_input = len(node.input) > 1
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    base = node.output[0]
    chain: list[onnx.NodeProto] = []
    current = node.input[0]
    for i, run in enumerate(reversed(runs)):
        last = i == len(runs) - 1
        out = base if last else f"{base}_over{'_'.join(map(str, run))}"
        name = f"{node.name or base}_run{i}"
        if axes_as_input:
            axes_name = f"{name}_axes"
            add_initializer(numpy_helper.from_array(np.array(run, np.int64), axes_name))
            chain.append(helper.make_node(node.op_type, [current, axes_name], [out], name=name,
                                          keepdims=keepdims))  # fmt: skip
        else:
            chain.append(helper.make_node(node.op_type, [current], [out], name=name,
                                          axes=run, keepdims=keepdims))  # fmt: skip
        current = out
    return chain


def _shared_filters_as_batch(
    graph: onnx.GraphProto, constants: dict[str, onnx.TensorProto]
) -> bool:
    """Rewrite each grouped Conv whose groups have one input channel each and share one
    constant filter set as ``Reshape -> Conv -> Reshape`` (see the module docstring); return
    whether any was."""

    def expand(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        shared = _shared_filters(node, constants)
        if shared is None:
            return None
        filters, spatial = shared
        base = node.output[0]
        names = {k: f"{base}_{k}" for k in ("planes_shape", "filters", "out_shape", "planes",
                                             "planes_out")}  # fmt: skip
        graph.initializer.extend([
            numpy_helper.from_array(np.array([-1, 1] + [0] * spatial, np.int64),
                                    names["planes_shape"]),
            numpy_helper.from_array(filters, names["filters"]),
            numpy_helper.from_array(
                np.array([-1, filters.shape[0] * _groups(node)] + [0] * spatial, np.int64),
                names["out_shape"],
            ),
        ])  # fmt: skip
        conv = helper.make_node("Conv", [names["planes"], names["filters"]],
                                [names["planes_out"]], name=f"{node.name or base}_planes")
        conv.attribute.extend(a for a in node.attribute if a.name != "group")
        return [
            helper.make_node("Reshape", [node.input[0], names["planes_shape"]],
                             [names["planes"]], name=f"{node.name or base}_fold"),
            conv,
            helper.make_node("Reshape", [names["planes_out"], names["out_shape"]], [base],
                             name=f"{node.name or base}_unfold"),
        ]  # fmt: skip

    return _expand_nodes(graph, expand)


def _groups(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _shared_filters(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, int] | None:
    """``(filters [K, 1, k...], spatial rank)`` when ``node`` is a Conv with ``group`` groups
    of one input channel each, no bias, and a constant weight ``[group * K, 1, k...]`` whose
    groups all hold ``filters``; else None."""
    groups = _groups(node)
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or groups < 2:
        return None
    if len(node.input) > 2 and node.input[2]:
        return None
    if any(a.name == "auto_pad" and a.s not in (b"", b"NOTSET") for a in node.attribute):
        return None
    tensor = constants.get(node.input[1])
    if tensor is None or len(tensor.dims) < 3 or tensor.dims[1] != 1 or tensor.dims[0] % groups:
        return None
    weight = numpy_helper.to_array(tensor)
    per_group = weight.reshape(groups, -1, *weight.shape[1:])
    if not (per_group == per_group[:1]).all():
        return None
    return np.ascontiguousarray(per_group[0]), len(tensor.dims) - 2


__all__ = ["for_cuda"]
