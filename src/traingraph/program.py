"""Model + loss + optimizer -> a :class:`TrainingProgram`: the train, eval and optimizer graphs.

The train graph computes the loss, the extra outputs, the gradient of every trainable parameter
(outputs ``<p>_grad``) and the updated running statistics of BatchNormalization (outputs
``<buffer>_updated``). Parameters and buffers are graph inputs, so the runtime keeps them in its
own persistent buffers; their initial values travel in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from traingraph.autodiff.engine import differentiate, name_output, values_by_name
from traingraph.autodiff.lowering import (
    batch_statistics_to_training_mode,
    lower_training_batch_norm,
    running_stats_default,
)
from traingraph.errors import ModelError, SizeLimitError, reports_load_errors
from traingraph.ir.builder import OpBuilder, is_float
from traingraph.ir.fold import remove_dead_nodes
from traingraph.ir.model import ModelLike, default_opset, infer_shapes_in_place, load_ir, to_proto
from traingraph.ir.model import save as save_model
from traingraph.ir.random import lower_dropout
from traingraph.ir.slices import hoist_slices
from traingraph.ir.transposes import (
    compose_transposes,
    compose_views,
    move_transposes,
    transposed_products,
)
from traingraph.limits import (
    MAX_ELEMENTS_VARIABLE,
    check_ir_model,
    data_propagation_allowed,
    max_tensor_elements,
)
from traingraph.losses import LabelSpec, Loss
from traingraph.optim.alias import Optimizer
from traingraph.optim.model import build_optimizer_model, state_slots
from traingraph.optim.transforms import ParamInfo
from traingraph.precision import (
    GRADS_FINITE,
    autocast,
    low_precision_type,
    scale_loss,
    unscale_gradients,
)

LOSS_OUTPUT = "loss"
MakeLabels = Callable[[list[LabelSpec]], list[ir.Value]]
"""Makes the label inputs of a loss from its label specs."""
BATCH_DIM = "batch"
BUFFER_UPDATE_SUFFIX = "_updated"
LAZY_RESET_GRAD = "lazy_reset_grad"
"""An onnxblock training model's bool input: True makes each gradient output the step's own
gradient, False adds it to the gradient buffer's value."""
ACCUMULATION_BUFFER = ".accumulation.buffer"
ACCUMULATION_OUT = ".accumulation.out"
"""Suffixes of ``<name>_grad`` in an onnxblock training model: the gradient buffer input and the
accumulated gradient output."""
MODEL_FIX = (
    "Check the model with onnx.checker.check_model(model, full_check=True) and export it again"
)


@dataclass
class TrainingProgram:
    """The graphs and state of one training setup.

    Attributes:
        train_model: Forward + loss + gradients (+ running-statistics updates).
        eval_model: Forward + loss in inference mode (Dropout off, BatchNorm on running stats).
        optimizer_model: The optimizer update graph, or None without an optimizer.
        parameters: Initial values of every parameter and buffer, in graph-input order.
        requires_grad: Which parameters are trained.
        input_names: The model's data inputs, then the loss's label inputs.
        output_names: The loss (when there is one) and the additional outputs.
        buffer_updates: Train-graph output name -> the buffer it updates.
    """

    train_model: onnx.ModelProto
    eval_model: onnx.ModelProto
    optimizer_model: onnx.ModelProto | None
    parameters: dict[str, np.ndarray]
    requires_grad: dict[str, bool]
    input_names: list[str]
    output_names: list[str]
    buffer_updates: dict[str, str] = field(default_factory=dict)

    @property
    def trainable(self) -> list[str]:
        return [n for n, r in self.requires_grad.items() if r]


@reports_load_errors("model", "model", MODEL_FIX)
def build_program(
    model: ModelLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: Loss | None = None,
    optimizer: Optimizer | None = None,
    additional_output_names: Sequence[str] | None = None,
    loss_input_names: Sequence[str] | None = None,
    mixed_precision: str | None = None,
    running_stats: str | None = None,
) -> TrainingProgram:
    """Turn ``model`` into a :class:`TrainingProgram`.

    Args:
        model: The inference model (path, ``onnx.ModelProto`` or ``onnx_ir.Model``).
        requires_grad: Initializers to train. Default: every floating-point initializer that is
            not in ``frozen_params`` and is not a BatchNormalization running statistic.
        frozen_params: Initializers kept as (non-trained) parameters in the checkpoint.
        loss: The loss block applied to the model outputs, or None when the model's first
            output already is the loss.
        optimizer: The optimizer; None builds no optimizer graph.
        additional_output_names: Model outputs (or intermediate tensors) that the train and eval
            graphs also return.
        loss_input_names: Model outputs fed to the loss (default: every model output).
        mixed_precision: "fp16" or "bf16" to compute in that type with float32 parameters
            (:mod:`traingraph.precision`): the train graph then takes a float32 scalar input
            ``loss_scale``, returns gradients of the unscaled loss and a boolean output
            ``grads_finite``. None: float32.
        running_stats: How training-mode BatchNormalization updates its running variance:
            ``"torch"`` with the unbiased batch variance (as ``torch.nn.BatchNorm*d``),
            ``"onnx"`` with the biased one (the ONNX specification). None: ``"torch"`` for a
            model PyTorch exported (``producer_name == "pytorch"``), else each node's
            choice (:func:`~traingraph.autodiff.lowering.lower_training_batch_norm`).
    """
    base = load_ir(model, copy=True, infer_shapes=False)
    check_ir_model(base, _describe_source(model))  # before shape inference allocates from them
    base = load_ir(base, copy=False)
    opset = default_opset(base)
    graph = base.graph
    _make_batch_dynamic(graph)
    params = _choose_parameters(graph, requires_grad, frozen_params)
    values = values_by_name(graph)
    for name in additional_output_names or ():
        if name not in values:
            raise ModelError(
                f"additional output {name!r} is not a tensor of the model; expected one of its"
                f" outputs {[o.name for o in graph.outputs]} or an intermediate tensor"
            )
    proto = to_proto(base)

    train = ir.from_proto(proto)
    built = build_train_graph(
        train,
        params,
        loss=loss,
        loss_input_names=loss_input_names,
        output_names=additional_output_names or (),
        mixed_precision=mixed_precision,
        running_stats=running_stats_default(base) if running_stats is None else running_stats,
    )
    low = None if mixed_precision is None else low_precision_type(mixed_precision)
    label_names, buffer_updates = built.label_names, built.buffer_updates
    lift_parameters(train.graph, params)

    evaluation = ir.from_proto(proto)
    to_inference_mode(evaluation.graph)
    if low is not None:
        _infer_shapes(evaluation)
        autocast(evaluation.graph, opset, low)
    eval_loss, _ = _attach_loss(evaluation.graph, opset, loss, loss_input_names)
    eval_extra = [values_by_name(evaluation.graph)[n] for n in additional_output_names or ()]
    evaluation.graph.outputs.clear()
    evaluation.graph.outputs.extend([eval_loss, *eval_extra])
    _infer_shapes(evaluation)
    hoist_slices(evaluation.graph, keep=additional_output_names or ())
    move_transposes(evaluation.graph, opset, keep=additional_output_names or ())
    remove_dead_nodes(evaluation.graph)
    lift_parameters(evaluation.graph, params)

    initial = {name: _initializer_array(graph, name) for name in params}
    opt_model = None
    if optimizer is not None:
        infos = [
            ParamInfo(name, tuple(initial[name].shape), initial[name].dtype)
            for name, r in params.items()
            if r
        ]
        opt_model = build_optimizer_model(optimizer, infos, opset=opset)
        describe_optimizer(opt_model, optimizer, infos)
    data_inputs = [v.name or "" for v in graph.inputs if v.name not in params]
    return TrainingProgram(
        train_model=to_proto(train),
        eval_model=to_proto(evaluation),
        optimizer_model=opt_model,
        parameters=initial,
        requires_grad=dict(params),
        input_names=data_inputs + label_names,
        output_names=[LOSS_OUTPUT, *(additional_output_names or ())],
        buffer_updates=buffer_updates,
    )


@dataclass
class TrainGraph:
    """A train graph as :func:`build_train_graph` makes it.

    Attributes:
        label_names: The loss's label inputs (and its label weight input, where there is one).
        forward_outputs: The outputs of the forward pass: the loss (where there is one), the
            extra outputs, the updated buffers.
        grad_outputs: ``<name>_grad`` for each parameter and tensor differentiated, then
            ``grads_finite`` for mixed precision.
        buffer_updates: Output name -> the buffer it updates.
        forward_node_count: How many of the graph's first nodes compute the forward pass (all
            of them, where the forward nodes are not kept first).
        has_loss: Whether the graph has a loss.
    """

    label_names: list[str]
    forward_outputs: list[str]
    grad_outputs: list[str]
    buffer_updates: dict[str, str]
    forward_node_count: int
    has_loss: bool


def build_train_graph(
    model: ir.Model,
    params: Mapping[str, bool],
    *,
    loss: Loss | None,
    attach_loss: bool = True,
    loss_input_names: Sequence[str] | None = None,
    labels: MakeLabels | None = None,
    label_weight: ir.Value | None = None,
    output_names: Sequence[str] = (),
    mixed_precision: str | None = None,
    running_stats: str | None = None,
    tensor_grads: Sequence[str] = (),
    stop_gradients: Sequence[str] = (),
    user_gradients: Sequence[str] = (),
    forward_first: bool = False,
) -> TrainGraph:
    """Turn ``model``'s forward graph into a train graph, in place: training mode, the loss,
    the gradients, the updated running statistics.

    This is the one builder of train graphs: :func:`build_program` (artifacts) and the graph
    API's ``TrainingGraph`` both make theirs here.

    Args:
        model: The forward model; its parameters are initializers or graph inputs.
        params: Parameter name -> whether it is trained.
        loss: The loss block; with ``attach_loss`` and None, the model's first output is the
            loss.
        attach_loss: False: no loss (gradients come only from ``user_gradients``).
        loss_input_names: Tensors fed to the loss (default: the model's outputs).
        labels: Makes the loss's label inputs from the loss's label specs (default: inputs
            with the specs' names, shapes and dtypes).
        label_weight: A per-sample weight input ``[N]``: the loss becomes the weighted mean
            (``reduction="mean"``) or sum (``"sum"``) of the per-sample losses.
        output_names: Tensors the graph also returns (outputs or intermediate ones).
        mixed_precision: "fp16" or "bf16" (:mod:`traingraph.precision`), or None.
        running_stats: How BatchNormalization updates its running variance (see
            :func:`~traingraph.autodiff.lowering.lower_training_batch_norm`).
        tensor_grads: Tensors whose gradients the graph also returns.
        stop_gradients: Tensors the backward pass treats as constants.
        user_gradients: Tensors whose gradients come from graph inputs ``<name>_user_grad``.
        forward_first: Keep every forward node before every gradient node (for a graph cut
            into a forward and a gradient phase).
    """
    graph = model.graph
    opset = default_opset(model)
    buffer_values = to_training_mode(graph, dict(params), opset)
    low = None
    if mixed_precision is not None:
        low = low_precision_type(mixed_precision)
        _infer_shapes(model)
        autocast(graph, opset, low)
        model.metadata_props["traingraph.mixed_precision"] = mixed_precision
    loss_value: ir.Value | None = None
    label_names: list[str] = []
    if attach_loss:
        loss_value, label_names = _attach_loss(
            graph, opset, loss, loss_input_names, labels, label_weight
        )  # fmt: skip
    _infer_shapes(model)
    named = [*output_names, *tensor_grads, *stop_gradients, *user_gradients]
    hoist_slices(graph, keep=named)
    move_transposes(graph, opset, keep=named)
    values = values_by_name(graph)
    missing = [n for n in named if n not in values]
    if missing:
        raise ModelError(
            f"{missing} are not tensors of the model; expected its outputs"
            f" {[o.name for o in graph.outputs]} or intermediate tensors"
        )
    extra = [values[n] for n in output_names]
    wrt = [values[n] for n, r in params.items() if r] + [values[n] for n in tensor_grads]
    # float16's range needs loss scaling; bfloat16 has float32's exponent range (as in
    # PyTorch, where autocast to bfloat16 takes no GradScaler)
    scaled = low == ir.DataType.FLOAT16 and loss_value is not None
    scale = scale_loss(graph) if scaled else None
    forward_node_count = len(graph)
    result = differentiate(
        graph, opset, wrt, loss=loss_value, loss_seed=scale,
        stop_gradients=[values[n] for n in stop_gradients],
        user_gradients=[values[n] for n in user_gradients], prefix="grad",
    )  # fmt: skip
    b = OpBuilder(graph, opset, prefix="grad")
    grads = [_grad_or_zeros(b, result.grads[v.name or ""], v) for v in wrt]
    finite = []
    if scale is not None:
        grads, all_finite = unscale_gradients(b, grads, scale)
        finite.append(name_output(b, all_finite, GRADS_FINITE, all_finite, rename=True))
    grad_outputs = [
        name_output(b, g, f"{v.name}_grad", v, rename=True) for g, v in zip(grads, wrt)
    ]
    update_outputs = [
        name_output(b, value, out_name, value, rename=True)
        for out_name, value in buffer_values.items()
    ]
    losses = [loss_value] if loss_value is not None else []
    graph.outputs.clear()
    graph.outputs.extend([*losses, *extra, *grad_outputs, *update_outputs, *finite])
    forward_names = [v.name or "" for v in [*losses, *extra, *update_outputs]]
    grad_names = [v.name or "" for v in [*grad_outputs, *finite]]
    forward_nodes = set(itertools.islice(graph, forward_node_count))
    forward_nodes.difference_update(compose_transposes(graph))
    compose_views(graph, forward_nodes)  # (the values they replace keep their names)
    transposed_products(graph, forward_nodes)
    forward_node_count = len(forward_nodes)
    if forward_first:
        forward_node_count = _lower_batch_norm(graph, opset, forward_node_count, running_stats)
    else:
        lower_training_batch_norm(graph, opset, running_stats)
        forward_node_count = len(graph)
    forward_nodes = set(itertools.islice(graph, forward_node_count))
    forward_node_count -= len(forward_nodes.intersection(remove_dead_nodes(graph)))
    return TrainGraph(
        label_names=label_names,
        forward_outputs=forward_names,
        grad_outputs=grad_names,
        buffer_updates={n: n[: -len(BUFFER_UPDATE_SUFFIX)] for n in buffer_values},
        forward_node_count=forward_node_count,
        has_loss=loss_value is not None,
    )


def _lower_batch_norm(
    graph: ir.Graph, opset: int, forward_node_count: int, running_stats: str | None
) -> int:
    """Lower the training-mode BatchNormalizations of a train graph, keeping forward nodes first.

    :func:`~traingraph.autodiff.lowering.lower_training_batch_norm` re-sorts the graph; its
    new nodes read only forward tensors, so moving the gradient nodes back behind every other
    node (in their sorted order) keeps the order topological and the forward nodes first.

    Returns:
        How many of ``graph``'s first nodes are forward nodes after the lowering.
    """
    gradient_nodes = set(list(graph)[forward_node_count:])
    if not lower_training_batch_norm(graph, opset, running_stats):
        return forward_node_count
    moved = [node for node in graph if node in gradient_nodes]
    graph.remove(moved)
    graph.extend(moved)
    return len(graph) - len(moved)


def _grad_or_zeros(b: OpBuilder, grad: ir.Value | None, param: ir.Value) -> ir.Value:
    return b.zeros_like(param) if grad is None else grad


def _describe_source(model: ModelLike) -> str:
    """The model's file for messages, or what kind of object it is."""
    if isinstance(model, (str, os.PathLike)):
        return f"model {os.fspath(model)!r}"
    return f"the {type(model).__name__} given as model"


def _infer_shapes(m: ir.Model) -> None:
    """Annotate the loss block's values with shapes, which some gradient rules need.

    Shape inference is a help, not a requirement: rules that need a shape say so. The sizes
    were checked against :func:`traingraph.limits.max_tensor_elements` on loading; a model with
    a dimension too large for data propagation is inferred without it
    (:func:`traingraph.limits.data_propagation_allowed`); running out of memory here still is
    an error, never a silently skipped inference.
    """
    check_ir_model(m)
    failure = infer_shapes_in_place(m, data_prop=data_propagation_allowed(m))
    if isinstance(failure, MemoryError):
        raise SizeLimitError(
            "shape inference of the training graph ran out of memory; the model declares"
            f" tensors too large for this machine (limit {max_tensor_elements()} elements per"
            f" tensor, set with {MAX_ELEMENTS_VARIABLE}). Lower the limit, or export the"
            " model with smaller static dimensions"
        ) from failure


def describe_optimizer(
    model: onnx.ModelProto, optimizer: Optimizer, infos: list[ParamInfo]
) -> None:
    """Record what the runtime needs to start the optimizer: slot initial values and the lr."""
    slots = state_slots(optimizer, infos)
    entries = {
        "traingraph.optimizer": optimizer.name,
        "traingraph.learning_rate": repr(float(optimizer.lr)),
        "traingraph.slot_init": json.dumps({s.name: float(s.init) for s in slots}),
        "traingraph.hyperparameters": json.dumps(optimizer.hyperparameters),
    }
    for key, value in entries.items():
        model.metadata_props.add(key=key, value=value)


def _initializer_array(graph: ir.Graph, name: str) -> np.ndarray:
    value = graph.initializers[name]
    assert value.const_value is not None
    return np.array(value.const_value.numpy(), copy=True)


def batchnorm_buffers(graph: ir.Graph) -> set[str]:
    names: set[str] = set()
    for node in graph:
        if node.op_type == "BatchNormalization":
            names.update(v.name for v in node.inputs[3:5] if v is not None and v.name)
    return names


def _choose_parameters(
    graph: ir.Graph,
    requires_grad: Sequence[str] | None,
    frozen_params: Sequence[str] | None,
) -> dict[str, bool]:
    """Name -> trainable, for every initializer that becomes a parameter."""
    inits = graph.initializers
    frozen = list(frozen_params or [])
    for name in [*(requires_grad or []), *frozen]:
        if name not in inits:
            raise ModelError(
                f"parameter {name!r} is not an initializer of the model. Expected one of"
                f" {sorted(inits)[:10]}{' ...' if len(inits) > 10 else ''}"
            )
        if not is_float(inits[name]):
            raise ModelError(
                f"parameter {name!r} has dtype {inits[name].dtype}; only floating-point"
                " initializers can be parameters. Leave it out of requires_grad/frozen_params."
            )
    overlap = set(requires_grad or []) & set(frozen)
    if overlap:
        raise ModelError(
            f"{sorted(overlap)} are in both requires_grad and frozen_params; name each once"
        )
    buffers = batchnorm_buffers(graph)
    if requires_grad is None:
        trainable = [
            n for n, v in inits.items() if is_float(v) and n not in frozen and n not in buffers
        ]
        frozen += [n for n in inits if n in buffers and n not in frozen]
    else:
        trainable = list(requires_grad)
        frozen += [n for n in inits if n in buffers and n not in frozen and n not in trainable]
    order = list(inits)
    chosen = {n: True for n in trainable}
    chosen.update({n: False for n in frozen})
    return {n: chosen[n] for n in order if n in chosen}


def _make_batch_dynamic(graph: ir.Graph) -> None:
    """Give every data input a symbolic first dimension."""
    for v in graph.inputs:
        if v.name in graph.initializers or v.shape is None or len(v.shape) == 0:
            continue
        if isinstance(v.shape.dims[0], int):
            v.shape = ir.Shape([BATCH_DIM, *v.shape.dims[1:]])


def lift_parameters(graph: ir.Graph, params: dict[str, bool]) -> None:
    """Turn the parameter initializers into graph inputs (the runtime binds them)."""
    for name in params:
        value = graph.initializers.pop(name)
        value.const_value = None
        if value not in graph.inputs:
            graph.inputs.append(value)


def to_training_mode(graph: ir.Graph, params: dict[str, bool], opset: int) -> dict[str, ir.Value]:
    """BatchNorm computes batch statistics and updates its running stats; Dropout is active.

    Returns the running-statistics outputs by the graph-output name they get.
    """
    b = OpBuilder(graph, opset, prefix="train_mode")
    updates: dict[str, ir.Value] = {}
    for node in list(graph):
        statistics = list(node.inputs[3:5])
        if opset >= 14 and batch_statistics_to_training_mode(b, node):
            _remove_unread(graph, statistics)
            continue
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            mean, var = node.inputs[3], node.inputs[4]
            if mean is None or var is None or mean.name not in params or var.name not in params:
                continue
            if len(node.outputs) < 3:
                node.resize_outputs(3)
            if opset >= 14:
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
            for out, buffer in ((node.outputs[1], mean), (node.outputs[2], var)):
                out.shape, out.type = buffer.shape, buffer.type
                updates[f"{buffer.name}{BUFFER_UPDATE_SUFFIX}"] = out
        elif node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            if len(node.inputs) < 2 or node.inputs[1] is None:
                ratio = b.const(0.5, ir.DataType.FLOAT, name="dropout_ratio")
                node.resize_inputs(2)
                node.replace_input_with(1, ratio)
            node.resize_inputs(3)
            node.replace_input_with(2, b.const(True, ir.DataType.BOOL, name="training_mode"))
    lower_dropout(b, [node for node in graph if node.op_type == "Dropout"])
    graph.sort()
    return updates


def _remove_unread(graph: ir.Graph, values: Sequence[ir.Value | None]) -> None:
    """Remove the nodes that write ``values`` where nothing reads them, and so on upwards."""
    pending = [v.producer() for v in values if v is not None]
    while pending:
        node = pending.pop()
        if node is None or node.graph is not graph:
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        inputs = list(node.inputs)
        graph.remove(node, safe=True)
        pending.extend(v.producer() for v in inputs if v is not None)


def to_inference_mode(graph: ir.Graph) -> None:
    """BatchNorm uses its running stats; Dropout is the identity."""
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "BatchNormalization":
            if "training_mode" in node.attributes:
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
            extra = [o for o in node.outputs[1:] if o.uses() or o.is_graph_output()]
            if extra:
                raise ModelError(
                    f"BatchNormalization node {node.name!r} returns its running statistics to"
                    " other nodes; an inference-mode graph cannot compute them"
                )
            node.resize_outputs(1)
        elif node.op_type == "Dropout" and len(node.inputs) > 2:
            node.replace_input_with(2, None)  # no training_mode: inference


def _attach_loss(
    graph: ir.Graph,
    opset: int,
    loss: Loss | None,
    loss_input_names: Sequence[str] | None,
    make_labels: MakeLabels | None = None,
    weight: ir.Value | None = None,
) -> tuple[ir.Value, list[str]]:
    """Append the loss block; returns the loss value and the label input names (see
    :func:`build_train_graph` for ``make_labels`` and ``weight``)."""
    if not graph.outputs:
        raise ModelError("the model has no outputs; a training graph needs at least one")
    if loss is None:
        value = graph.outputs[0]
        if value.shape is not None and len(value.shape) != 0:
            raise ModelError(
                f"no loss was given, so the first model output {value.name!r} is taken as the"
                f" loss, but its shape is {value.shape} and a loss must be a scalar. Pass loss="
                "traingraph.losses.MSELoss() (or another loss) to generate the loss graph."
            )
        return value, []
    outputs = list(graph.outputs)
    if loss_input_names is not None:
        by_name = values_by_name(graph)
        missing = [n for n in loss_input_names if n not in by_name]
        if missing:
            raise ModelError(f"loss inputs {missing} are not tensors of the model")
        outputs = [by_name[n] for n in loss_input_names]
    b = OpBuilder(graph, opset, prefix="loss")
    specs = loss.label_specs(outputs)
    if make_labels is None:
        labels = [
            ir.Value(name=spec.name, shape=spec.shape, type=ir.TensorType(spec.dtype))
            for spec in specs
        ]
    else:
        labels = make_labels(specs)
    graph.inputs.extend(labels)
    names = [label.name or "" for label in labels]
    if weight is None:
        value = loss.build(b, outputs, list(labels))
    else:
        reduction = getattr(loss, "reduction", None)
        if reduction not in ("mean", "sum") or not dataclasses.is_dataclass(loss):
            raise ModelError(
                f"loss label weights need a loss with reduction 'mean' or 'sum'; got"
                f" {type(loss).__name__} with reduction {reduction!r}"
            )
        per_sample = dataclasses.replace(loss, reduction="none").build(b, outputs, list(labels))
        graph.inputs.append(weight)
        weight_cast = b.cast_like(weight, outputs[0])
        total = b.sum(b.Mul(per_sample, weight_cast), keepdims=False)
        value = total if reduction == "sum" else b.Div(total, b.sum(weight_cast, keepdims=False))
        names.append(weight.name or "")
    value = name_output(b, value, LOSS_OUTPUT, value, rename=True)
    if value.type is None:
        value.type = outputs[0].type
    if value.shape is None:
        value.shape = ir.Shape([])
    return value, names


def export_inference_model(
    eval_model: onnx.ModelProto,
    parameters: Mapping[str, np.ndarray],
    graph_output_names: Sequence[str],
    path: str | os.PathLike,
) -> None:
    """Prune ``eval_model`` to ``graph_output_names``, embed ``parameters`` and save it."""
    if isinstance(graph_output_names, str) or not graph_output_names:
        raise ModelError("graph_output_names must be a non-empty list of tensor names")
    m = ir.from_proto(eval_model)
    graph = m.graph
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for o in node.outputs:
            values[o.name] = o
    missing = [n for n in graph_output_names if n not in values]
    if missing:
        raise ModelError(
            f"outputs {missing} are not tensors of the eval model; model outputs are"
            f" {[o.name for o in graph.outputs]}"
        )
    graph.outputs.clear()
    graph.outputs.extend(values[n] for n in graph_output_names)
    for value in list(graph.inputs):
        if value.name is not None and value.name in parameters:
            graph.inputs.remove(value)
            value.const_value = ir.tensor(
                np.ascontiguousarray(parameters[value.name]), name=value.name
            )
            graph.register_initializer(value)
    common_passes.RemoveUnusedNodesPass()(m)
    used = {v for node in graph for v in node.inputs} | set(graph.outputs)
    for value in list(graph.inputs):
        if value not in used:
            graph.inputs.remove(value)
    for name in [n for n, v in graph.initializers.items() if v not in used]:
        graph.initializers.pop(name)
    save_model(to_proto(m), path)
