"""Rewrites of a standard ONNX model for the execution provider that runs it.

Training graphs and their artifacts are written once, for any runtime. A few forms are slow or
missing in one of onnxruntime's providers; :func:`for_cpu` and :func:`for_cuda` rewrite them,
with the same results, when a session is created.

On the CPU (:func:`for_cpu`, which runs at every CPU session creation, once per segment of a
segmented training step), the model is returned as it is after a search of its bytes where no
op a rewrite takes appears, and after a scan of its nodes with their inferred shapes where no
pass has a candidate (most segments); otherwise it is converted to onnx-ir once,
:func:`cpu_passes` run over it, and it is serialized once:

- A ``ConvTranspose`` (the input gradient of a strided Conv, or of a Conv whose input has more
  positions than its output) becomes ``Col2Im(MatMul(W^T, G))``: the products of every sample
  in one batched MatMul, then the columns added into the image (the onnxscript rewriter rules
  of :mod:`traingraph.runtime.rewrites.conv_transpose`). onnxruntime's ConvTranspose kernel
  computes the same sums one sample at a time, a GEMM per sample too small to use the cores
  well (``benchmarks/conv_grad_micro.py`` times both forms). Col2Im exists from opset 18 on,
  so a model of an older opset is first converted with ``onnx.version_converter``; where that
  fails, or a shape the rewrite needs is not static, the node stays. Col2Im has no kernel in
  onnxruntime's CUDA provider and in several other runtimes, which is why artifacts keep
  ConvTranspose.
- The Relu gradient's float32 mask ``Cast(Greater(v, 0))`` stays as written: its vectorized
  forms (``Ceil(Clip(v, 0, 1))``) give NaN where ``v`` is NaN, where the mask is 0, and
  the Cast of the booleans is a single pass as well (``benchmarks/relu_mask_micro.py`` times
  both forms).
- The rules of :mod:`traingraph.runtime.rewrites` for the CPU: a float32 ``ReduceSum`` over
  the leading axes of a static shape as ``MatMul(ones, X)`` between two Reshapes.
- A ``ScatterND`` with a reduction over rows (indices ``[..., 1]``) as a ``ScatterElements`` on
  axis 0 (:data:`traingraph.runtime.rewrites.SCATTER_RULES`): onnxruntime's CPU ScatterND
  adds rows from several threads without ordering them and loses updates of repeated rows.
  A ``ScatterElements`` that adds one row into a constant-filled table (a Gather of one
  position's gradient) as a broadcast ``Where``: one parallel pass where onnxruntime fills the
  table, then walks the row on one thread.
- A Conv whose filter is a graph input (a parameter, or a filter computed from one) runs in
  onnxruntime's blocked NCHWc kernels, with the filter reordered in the graph (the onnx-ir pass
  :class:`traingraph.runtime.rewrites.nchwc.ConvsAsNchwc`): onnxruntime blocks only Convs with
  constant filters, and its other kernel unfolds the input (im2col) before a GEMM, a pass the
  blocked one avoids.

On CUDA (:func:`for_cuda`), the model converted to onnx-ir once, with its inferred shapes where
it has weight gradients or grouped Convs, and serialized once (:func:`cuda_passes`):

- The rules of :data:`traingraph.runtime.rewrites.CUDA_RULES` (onnxscript rewriter rules): a
  right ``BitShift`` by a constant as a ``Div`` by ``2^k``, a product with a cast boolean mask
  as a ``Where``, and a ``ReduceSum`` or ``ReduceMean`` over axes that are not one run of
  neighbouring axes (the per-channel statistics of BatchNormalization and their gradients
  reduce ``[0, 2, 3]`` of ``NCHW``) as a chain of reductions over runs, the innermost first.
  The provider reduces a run that starts or ends the tensor with its own row and column
  kernels, and hands other axis sets to cuDNN's general reduction, which is not tuned for
  these shapes. Means of equal-sized groups are the mean, so the chain computes the same
  value (summed in another order).
- The weight gradient of a 3 x 3 (or larger) Conv with a small output and a large weight, as
  the autodiff tags it, becomes one Conv of the input with the output gradient as its filters
  (the onnx-ir pass :class:`traingraph.runtime.rewrites.weight_grads.WeightGradsAsConvs`).
- The rule of :data:`traingraph.runtime.rewrites.CUDA_FOLD_RULES`, on the grouped Convs the
  weight gradients left: a grouped ``Conv`` with one input channel per group, no bias and the
  same constant filters in every group (the one-hot unfold of a convolution's weight
  gradient), whose input has a static shape of fewer than :data:`FOLD_LIMIT` elements, becomes
  one ungrouped Conv over the channels folded into the batch, between two Reshapes; the values
  and their layout are the same. On small inputs cuDNN's grouped direct kernel is the slower
  form (LeNet at batch 64 and ResNet-8 at batch 32 train 4-20% faster folded); on larger ones
  the folded Conv is, by up to 4.6x (ResNet-50's stride-2 unfolds at batch 64;
  ``benchmarks/conv_grad_micro.py --device cuda`` times both forms).
- With ``SessionConfig(recompute=True)``, a forward value that is one elementwise op of values
  the gradient pass holds anyway (a GELU's output) is computed again before its first gradient
  reader instead of held through the forward pass (:mod:`traingraph.runtime.rewrites.recompute`);
  the session then runs without onnxruntime's common subexpression elimination, which would
  merge the copy back.

Example:
    >>> source = for_cuda("training_model.onnx")  # doctest: +SKIP
    >>> source = for_cpu("training_model.onnx")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Mapping, Set

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper, shape_inference, version_converter

from traingraph.ir.tags import kernel_of
from traingraph.runtime import rewrites
from traingraph.runtime.rewrites import FOLD_LIMIT, conv_transpose, nchwc, weight_grads
from traingraph.runtime.rewrites import recompute as recompute_pass

Source = str | bytes


def for_cuda(source: Source, *, recompute: bool = False) -> Source:
    """``source`` (a path or serialized model) rewritten for the CUDA provider; ``source``
    itself where nothing applies.

    The model is converted to onnx-ir once, :func:`cuda_passes` run over it (with the cheap
    forward values computed again for the gradient pass where ``recompute``), and it is
    serialized once where they changed it.
    """
    head = onnx.load(source, load_external_data=False) if isinstance(source, str) else None
    if head is not None and not any(_applies(n, recompute) for n in head.graph.node):
        return source
    proto = onnx.load(source) if isinstance(source, str) else onnx.load_from_string(source)
    if any(_weight_grad(n) or _groups(n) > 1 for n in proto.graph.node):
        # The weight gradients and the grouped Convs read the inferred shapes; where shape
        # inference fails, no shape is known.
        with contextlib.suppress(Exception):
            proto = shape_inference.infer_shapes(proto)
    model = ir.serde.deserialize_model(proto)
    if not cuda_passes(recompute=recompute)(model).modified:
        return source
    return ir.serde.serialize_model(model).SerializeToString()


def cuda_passes(*, recompute: bool = False) -> ir.passes.PassManager:
    """The CUDA provider's rewrites in order, as one onnx-ir pass over a model whose values
    carry their inferred shapes: :data:`~traingraph.runtime.rewrites.CUDA_RULES`, the weight
    gradients (:class:`~traingraph.runtime.rewrites.weight_grads.WeightGradsAsConvs`),
    :data:`~traingraph.runtime.rewrites.CUDA_FOLD_RULES` (the grouped Convs that are left),
    then, with ``recompute``, the cheap forward values computed again for the gradient pass
    (:class:`~traingraph.runtime.rewrites.recompute.RecomputeInBackward`)."""
    passes: list[ir.passes.PassBase] = [
        rewrites.rules_pass(rewrites.CUDA_RULES),
        weight_grads.WeightGradsAsConvs(),
        rewrites.rules_pass(rewrites.CUDA_FOLD_RULES),
    ]
    if recompute:
        passes.append(recompute_pass.RecomputeInBackward())
    return ir.passes.PassManager(passes)


def _weight_grad(node: onnx.NodeProto) -> bool:
    return kernel_of(node) == weight_grads.KERNEL


def for_cpu(source: Source) -> Source:
    """``source`` (a path or serialized model) rewritten for the CPU provider; ``source``
    itself where nothing applies.

    Where a node may be rewritten (found in the bytes, then among the nodes), the model's
    shapes are inferred; where a pass has a candidate among the nodes with their shapes, the
    model is converted to opset 18 where it is older and a ConvTranspose becomes a Col2Im, then
    to onnx-ir; :func:`cpu_passes` run over it, and it is serialized once where they changed
    it. Where shape inference fails, the model stays; where the conversion fails, its
    ConvTransposes do.
    """
    if not _mentions(source, (b"Conv", b"ReduceSum", b"Scatter", b"Expand")):
        return source  # most models: found without parsing them
    proto = onnx.load(source) if isinstance(source, str) else onnx.load_from_string(source)
    constants = constant_tensors(proto.graph)
    expanded = {n.output[0] for n in proto.graph.node if _is_expand(n)}
    broadcasts = any(_adds_expanded(n, expanded) for n in proto.graph.node)
    if not broadcasts and not any(_cpu_candidate(n, constants) for n in proto.graph.node):
        return source
    given = list(proto.graph.value_info)
    try:
        proto = shape_inference.infer_shapes(proto)
    except Exception:  # every CPU rewrite reads the inferred shapes
        return source
    shapes, types = static_shapes(proto.graph)
    opsets = [o for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    sums = broadcasts or any(_leading_axes(n, constants) for n in proto.graph.node)
    scatters = any(_reduces_by_scatter(n) for n in proto.graph.node)
    col2im = any(_becomes_col2im(n, shapes, types) for n in proto.graph.node)
    blocked = any(_becomes_blocked(n, constants, shapes, opsets) for n in proto.graph.node)
    if not (sums or scatters or col2im or blocked):
        return source  # no pass has a candidate: most segments of a training graph
    # the shapes the passes read: the inputs of the candidates (the rest costs a conversion)
    read = {v for n in proto.graph.node if _cpu_candidate(n, constants) for v in n.input}
    read.update(v.name for v in given)
    if scatters:
        read.update(_scatter_reads(proto.graph))
    for node in proto.graph.node:  # an expanded addend's sum: its operands and the Expand's
        if _adds_expanded(node, expanded):
            read.update(node.input)
            for n in proto.graph.node:  # the Expand, and the Shape it expands to
                if n.output and n.output[0] in node.input:
                    read.update(n.input)
                    read.update(v for m in proto.graph.node if m.output and m.output[0] in n.input
                                and m.op_type == "Shape" for v in m.input)  # fmt: skip
    kept = [v for v in proto.graph.value_info if v.name in read]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(kept)
    if col2im and _default_opset(proto) < conv_transpose.COL2IM_OPSET:
        try:
            proto = version_converter.convert_version(proto, conv_transpose.COL2IM_OPSET)
        except Exception:  # a model the converter cannot take: its ConvTransposes stay
            col2im = False
    model = ir.serde.deserialize_model(proto)
    passes = cpu_passes(sums=sums, scatters=scatters, col2im=col2im, blocked=blocked)
    if not passes(model).modified:
        return source
    return ir.serde.serialize_model(model).SerializeToString()


def cpu_passes(
    *, sums: bool = True, scatters: bool = True, col2im: bool = True, blocked: bool = True
) -> ir.passes.PassManager:
    """The CPU provider's rewrites in order, as one onnx-ir pass over a model whose values
    carry their inferred shapes: :data:`~traingraph.runtime.rewrites.CPU_RULES` (``sums``),
    :data:`~traingraph.runtime.rewrites.SCATTER_RULES` (``scatters``) and
    the ConvTransposes as Col2Im (:data:`~traingraph.runtime.rewrites.conv_transpose.RULES`,
    ``col2im``, where the model's opset has Col2Im) in one pass over the nodes, then the Convs
    in the blocked layout (:class:`~traingraph.runtime.rewrites.nchwc.ConvsAsNchwc`,
    ``blocked``). :func:`for_cpu` leaves out those without a candidate in the model: the
    rewriter tries every rule on every node."""
    rules = [
        *(rewrites.CPU_RULES if sums else ()),
        *(rewrites.SCATTER_RULES if scatters else ()),
        *(conv_transpose.RULES if col2im else ()),
    ]
    passes: list[ir.passes.PassBase] = [rewrites.rules_pass(rules)] if rules else []
    if scatters or sums:  # what a rule's replacement no longer reads (a one-row scatter's
        passes.append(ir.passes.common.RemoveUnusedNodesPass())  # table, an Expand's Shape)
    if blocked:
        passes.append(nchwc.ConvsAsNchwc())
    return ir.passes.PassManager(passes)


def _cpu_candidate(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> bool:
    """Whether one of :func:`cpu_passes` may rewrite ``node``, before its shapes are known: a
    ReduceSum over leading axes, a ConvTranspose, or a Conv whose filter is not a constant."""
    if is_conv_transpose(node) or _leading_axes(node, constants) or _reduces_by_scatter(node):
        return True
    return (
        node.op_type == "Conv" and node.domain in ("", "ai.onnx")
        and len(node.input) > 1 and node.input[1] not in constants
    )  # fmt: skip


def _reduces_by_scatter(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a candidate of :data:`~traingraph.runtime.rewrites.SCATTER_RULES`:
    a ``ScatterND`` with a reduction, or a ``ScatterElements`` that adds or writes."""
    if node.op_type not in ("ScatterND", "ScatterElements") or node.domain not in ("", "ai.onnx"):
        return False
    reduction = next((a.s for a in node.attribute if a.name == "reduction"), b"none")
    if node.op_type == "ScatterND":
        return reduction != b"none"
    return reduction in (b"add", b"none")


def _is_expand(node: onnx.NodeProto) -> bool:
    return node.op_type == "Expand" and node.domain in ("", "ai.onnx") and len(node.output) == 1


def _adds_expanded(node: onnx.NodeProto, expanded: Set[str]) -> bool:
    """Whether ``node`` is a two-input Sum or Add of an Expand's output (a candidate of
    :data:`~traingraph.runtime.rewrites.EXPANDED_ADDEND_AS_BROADCAST`)."""
    if node.op_type not in ("Sum", "Add") or node.domain not in ("", "ai.onnx"):
        return False
    return len(node.input) == 2 and any(v in expanded for v in node.input)


def _scatter_reads(graph: onnx.GraphProto) -> set[str]:
    """The values whose shapes ``one_row_scatter_as_where`` reads beside a ScatterElements'
    inputs (:func:`traingraph.runtime.rewrites._one_row_parts`): the index and the table's
    depth, two nodes above it."""
    producer = {o: n for n in graph.node for o in n.output}

    def above(value: str, op_type: str, k: int) -> str | None:
        node = producer.get(value)
        if node is None or node.op_type != op_type or len(node.input) <= k:
            return None
        return node.input[k]

    read: set[str] = set()
    for node in graph.node:
        if node.op_type == "ScatterElements" and len(node.input) == 3:
            column = above(node.input[1], "Expand", 0)
            flat = above(column, "Unsqueeze", 0) if column else None
            shape = above(node.input[0], "Expand", 1)
            depth = above(shape, "Concat", 0) if shape else None
            read.update(v for v in (flat, depth) if v)
    return read


def _becomes_col2im(
    node: onnx.NodeProto, shapes: Mapping[str, list[int | None]], types: Mapping[str, int]
) -> bool:
    """Whether :data:`~traingraph.runtime.rewrites.conv_transpose.RULES` rewrite ``node``, given
    the inferred shapes and element types of the values (at opset 18)."""
    geometry = transposed_geometry(node, shapes)
    return geometry is not None and types.get(node.input[0]) == onnx.TensorProto.FLOAT


def _becomes_blocked(
    node: onnx.NodeProto,
    constants: Mapping[str, onnx.TensorProto],
    shapes: Mapping[str, list[int | None]],
    opsets: list[onnx.OperatorSetIdProto],
) -> bool:
    """Whether :class:`~traingraph.runtime.rewrites.nchwc.ConvsAsNchwc` rewrites ``node``, given
    the inferred shapes (its form learned here where it is not yet)."""
    return (
        _cpu_candidate(node, constants) and node.op_type == "Conv"
        and nchwc.form_for(node, shapes, opsets) is not None
    )  # fmt: skip


def _mentions(source: Source, texts: tuple[bytes, ...]) -> bool:
    """Whether the serialized model (a path or bytes) holds any of ``texts`` anywhere."""
    if not isinstance(source, str):
        return any(text in source for text in texts)
    with open(source, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return any(view.find(text) >= 0 for text in texts)


def is_conv_transpose(node: onnx.NodeProto) -> bool:
    return node.op_type == "ConvTranspose" and node.domain in ("", "ai.onnx")


def _default_opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)


def static_shapes(
    graph: onnx.GraphProto,
) -> tuple[dict[str, list[int | None]], dict[str, int]]:
    """The shape of every value shape inference found (None for a dimension it left open), and
    the element type of every tensor value."""
    shapes: dict[str, list[int | None]] = {}
    types: dict[str, int] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if not info.type.HasField("tensor_type"):
            continue
        types[info.name] = info.type.tensor_type.elem_type
        if info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in info.type.tensor_type.shape.dim
            ]
    shapes.update((t.name, list(t.dims)) for t in graph.initializer)
    types.update((t.name, t.data_type) for t in graph.initializer)
    return shapes, types


def columns_nodes(
    graph: onnx.GraphProto, node: onnx.NodeProto, filters: int, name: str
) -> list[onnx.NodeProto]:
    """The nodes that write the columns of the ConvTranspose ``node`` (``filters`` = M) as
    ``{name}_columns``: ``cols[n, c * K + k, o] = sum_m W[m, c, k] * G[n, m, o]``, one batched
    MatMul of ``W^T``; ``graph`` receives the shapes they read as initializers. ``W^T`` is a
    tensor of its own (``[M, C*K, 1] -> [C*K, 1, M]``): a Transpose of two axes that feeds a
    MatMul is fused into it as a transposed operand, which onnxruntime multiplies one to two
    times as slowly as a plain one."""
    shapes = {"positions_shape": [0, filters, -1], "weight_shape": [filters, -1, 1],
              "weight_columns": [-1, filters]}  # fmt: skip
    graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.int64), f"{name}_{k}") for k, v in shapes.items()
    )
    return [
        helper.make_node("Reshape", [node.input[0], f"{name}_positions_shape"],
                         [f"{name}_positions"], name=f"{name}_positions"),
        helper.make_node("Reshape", [node.input[1], f"{name}_weight_shape"],
                         [f"{name}_weight_rows"], name=f"{name}_weight_rows"),
        helper.make_node("Transpose", [f"{name}_weight_rows"], [f"{name}_weight_moved"],
                         perm=[1, 2, 0], name=f"{name}_weight_moved"),
        helper.make_node("Reshape", [f"{name}_weight_moved", f"{name}_weight_columns"],
                         [f"{name}_weight"], name=f"{name}_weight"),
        helper.make_node("MatMul", [f"{name}_weight", f"{name}_positions"],
                         [f"{name}_columns"], name=f"{name}_columns"),
    ]  # fmt: skip


def dataflow(
    graph: onnx.GraphProto,
) -> tuple[dict[str, onnx.NodeProto], dict[str, int], set[str]]:
    """The node that writes each value, how many node inputs read each value, and the
    graph's outputs."""
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    return producers, uses, {o.name for o in graph.output}


def positive_test(
    node: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
) -> onnx.NodeProto | None:
    """The ``Greater(v, 0)`` that ``node`` casts to float32, when ``node`` is such a Cast and
    the 0 is a float32 constant of one element; else None."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    if next((a.i for a in node.attribute if a.name == "to"), 0) != onnx.TensorProto.FLOAT:
        return None
    source = producers.get(node.input[0])
    if source is None or source.op_type != "Greater" or source.domain not in ("", "ai.onnx"):
        return None
    zero = constants.get(source.input[1])
    if zero is None or zero.data_type != onnx.TensorProto.FLOAT:
        return None
    value = numpy_helper.to_array(zero)
    return source if value.size == 1 and not value.any() and value.ndim == 0 else None


def transposed_geometry(
    node: onnx.NodeProto, shapes: Mapping[str, list[int | None]]
) -> tuple[list[int], list[int], int] | None:
    """``(image size, kernel, M)`` of a default-domain ConvTranspose that becomes a Col2Im
    (:func:`traingraph.runtime.rewrites.conv_transpose.geometry`), given the shapes of the
    values; else None."""
    if not is_conv_transpose(node):
        return None
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if isinstance(attributes.get("auto_pad"), bytes):
        attributes["auto_pad"] = attributes["auto_pad"].decode()
    return conv_transpose.geometry(attributes, shapes.get(node.input[0]), shapes.get(node.input[1]))


def _applies(node: onnx.NodeProto, recompute: bool = False) -> bool:
    return node.op_type in ("BitShift", "ReduceSum", "ReduceMean", "Conv", "Cast") or (
        recompute and node.name.startswith(recompute_pass.GRADIENT_PREFIX)
    )


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The graph's initializers and Constant node values, by name."""
    constants = {t.name: t for t in graph.initializer}
    constants.update(
        (n.output[0], a.t) for n in graph.node if n.op_type == "Constant"
        for a in n.attribute if a.name == "value"
    )  # fmt: skip
    return constants


def _leading_axes(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto]) -> int:
    """How many leading axes ``node`` sums, where it is a ReduceSum over ``0 .. k-1`` (k >= 1)
    given as constant non-negative axes; else 0."""
    axes = _reduced_axes(node, constants, "ReduceSum")
    return len(axes) if axes is not None and sorted(axes) == list(range(len(axes))) else 0


def _reduced_axes(
    node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto], *op_types: str
) -> list[int] | None:
    """The axes a reduction node of one of ``op_types`` reduces, where they are constant,
    non-negative and distinct (and not an empty list that means no reduction); else None."""
    if node.op_type not in op_types or node.domain not in ("", "ai.onnx"):
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
    return axes


def _groups(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


__all__ = ["FOLD_LIMIT", "for_cpu", "for_cuda"]
