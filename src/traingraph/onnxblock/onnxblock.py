"""``ForwardBlock`` and ``TrainingBlock``: blocks that turn the edited model into a forward model,
or into training and eval models whose gradients traingraph's autodiff builds.

The module sits where onnxruntime-training keeps these classes
(``onnxruntime.training.onnxblock.onnxblock``), so imports of that path migrate too."""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any

import onnx
import onnx_ir as ir

from traingraph.autodiff.engine import differentiate, name_output, values_by_name
from traingraph.autodiff.lowering import lower_training_batch_norm, running_stats_default
from traingraph.errors import ModelError
from traingraph.ir.builder import OpBuilder, is_float
from traingraph.ir.model import default_opset, load_ir, max_ir_version, to_proto
from traingraph.onnxblock import graph_utils, model_accessor
from traingraph.onnxblock.blocks import Block
from traingraph.program import (
    ACCUMULATION_BUFFER,
    ACCUMULATION_OUT,
    LAZY_RESET_GRAD,
    lift_parameters,
    to_inference_mode,
    to_training_mode,
)

__all__ = ["ForwardBlock", "TrainingBlock", "build_training_models"]



def output_names(output: Any) -> list[str]:
    return [output] if isinstance(output, str) else [str(name) for name in output]


def with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the types onnx shape inference finds (a copy)."""
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # types are a help, not a requirement
        return copy.deepcopy(model)


def build_outputs(
    block: Block, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[onnx.ModelProto, Any, onnx.ModelProto]:
    """Run ``block.build(*args, **kwargs)`` on the model of the current context.

    Returns:
        The edited model (the context's own), ``build``'s output names, and a copy of the
        edited model with shapes inferred and those names as its graph outputs.
    """
    edited = model_accessor.current().model
    block.base = edited
    output = block.build(*args, **kwargs)
    model = with_shapes(edited)
    graph_utils.register_graph_outputs(model, output_names(output))
    return edited, output, model


class ForwardBlock(Block):
    """A block whose call leaves a forward model with ``build``'s outputs as graph outputs.

    Example:
        With ``MyForwardBlock`` a subclass that defines ``build`` (see the module's example):

        >>> block = MyForwardBlock()
        >>> with onnxblock.base(model):
        ...     block("output-0")
        >>> forward = block.to_model_proto()
    """

    def __init__(self) -> None:
        super().__init__()
        self._model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Stack blocks on the inputs; return the name(s) of the graph output(s)."""

    def to_model_proto(self) -> onnx.ModelProto:
        """The forward model.

        Raises:
            RuntimeError: The block has not been called yet.
        """
        return self._built(
            self._model, "Please build the forward models first before trying to retrieve it."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        edited, output, model = build_outputs(self, args, kwargs)
        # No newer IR version than the installed onnxruntime loads (as traingraph writes them).
        model.ir_version = min(model.ir_version, max_ir_version())
        edited.CopyFrom(model)
        self._model = model
        return output


class TrainingBlock(Block):
    """A block whose call builds training and eval models from the edited model.

    ``build`` returns the name of the loss (or several names: the first is the loss, the
    others further outputs). The training model takes the model's inputs, then every parameter
    (the initializers named in :meth:`requires_grad`, trainable or frozen), then a buffer
    ``<name>_grad.accumulation.buffer`` per trainable tensor and the bool ``lazy_reset_grad``;
    it returns ``build``'s outputs, then ``<name>_grad.accumulation.out``: the loss's gradient,
    plus the buffer's value where ``lazy_reset_grad`` is False. The eval model computes the
    outputs in inference mode (Dropout off, BatchNormalization on running statistics).

    Example:
        >>> block = MyTrainingBlock()
        >>> for name in ("fc1.weight", "fc1.bias"):
        ...     block.requires_grad(name)
        >>> with onnxblock.base(model):
        ...     block("output-0")
        >>> training_model, eval_model = block.to_model_proto()
        >>> trainable, frozen = block.parameters()
    """

    def __init__(self) -> None:
        super().__init__()
        self._requires_grad: set[str] = set()
        self._frozen_params: set[str] = set()
        self._parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]] | None = None
        self._training_model: onnx.ModelProto | None = None
        self._eval_model: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Stack blocks on the inputs; return the name of the loss (first) and other outputs."""

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        """Train (``value`` True) or freeze (False) the initializer or graph input
        ``argument_name``. Nothing is trained by default."""
        if value:
            self._requires_grad.add(argument_name)
            self._frozen_params.discard(argument_name)
        else:
            self._requires_grad.discard(argument_name)
            self._frozen_params.add(argument_name)

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        """The trainable and the frozen parameters' initial values, in the model's order.

        Raises:
            RuntimeError: The block has not been called yet.
        """
        return self._built(
            self._parameters,
            "Please build the training model first before trying to retrieve the parameters.",
        )

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """The training and eval models.

        Raises:
            RuntimeError: The block has not been called yet.
        """
        if self._training_model is None or self._eval_model is None:
            raise RuntimeError(
                "Please build the training and eval models first before trying to retrieve them."
            )
        return self._training_model, self._eval_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        edited, output, model = build_outputs(self, args, kwargs)
        trainable = [t for t in model.graph.initializer if t.name in self._requires_grad]
        frozen = [t for t in model.graph.initializer if t.name in self._frozen_params]
        self._parameters = (copy.deepcopy(trainable), copy.deepcopy(frozen))
        self._training_model, self._eval_model = build_training_models(
            model, self._requires_grad, self._frozen_params
        )
        edited.CopyFrom(self._training_model)
        return output


def build_training_models(
    model: onnx.ModelProto, requires_grad: Iterable[str], frozen_params: Iterable[str] = ()
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The training and eval models of :class:`TrainingBlock` for ``model``, whose first graph
    output is the loss.

    Raises:
        ModelError: A name is neither an initializer nor a graph input, or a trainable one is not
            floating-point.
    """
    trained, frozen = set(requires_grad), set(frozen_params)
    base = load_ir(model, copy=True)
    opset = default_opset(base)
    graph = base.graph
    inputs = [v.name for v in graph.inputs]
    unknown = sorted((trained | frozen) - set(graph.initializers) - set(inputs))
    if unknown:
        raise ModelError(
            f"requires_grad names {unknown}, which are neither initializers nor graph inputs of"
            f" the model; its initializers are {list(graph.initializers)[:10]} and its inputs"
            f" {inputs}"
        )
    params = {n: n in trained for n in graph.initializers if n in trained or n in frozen}
    proto = to_proto(base)

    train = ir.from_proto(proto)
    buffer_updates = to_training_mode(train.graph, params, opset)
    values = values_by_name(train.graph)
    wrt = [values[n] for n, r in params.items() if r]
    wrt += [v for v in train.graph.inputs if v.name in trained]
    not_float = [v.name for v in wrt if not is_float(v)]
    if not_float:
        raise ModelError(
            f"requires_grad names {not_float}, which are not floating-point tensors; only"
            " float tensors have gradients. Call requires_grad(name, False) for them."
        )
    outputs = list(train.graph.outputs)
    result = differentiate(train.graph, opset, wrt, loss=outputs[0], prefix="grad")
    b = OpBuilder(train.graph, opset, prefix="accumulate")
    reset = ir.Value(
        name=LAZY_RESET_GRAD, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1])
    )
    buffers, grads = [], []
    for v in wrt:
        grad = result.grads.get(v.name or "") or b.zeros_like(v)
        buffer = ir.Value(name=f"{v.name}_grad{ACCUMULATION_BUFFER}", type=v.type, shape=v.shape)
        total = b.Where(reset, grad, b.Add(buffer, grad))
        buffers.append(buffer)
        grads.append(name_output(b, total, f"{v.name}_grad{ACCUMULATION_OUT}", v, rename=True))
    updates = [name_output(b, v, name, v, rename=True) for name, v in buffer_updates.items()]
    train.graph.outputs.clear()
    train.graph.outputs.extend([*outputs, *grads, *updates])
    # After the outputs are placed: the lowering keeps each BatchNorm output's graph-output place.
    lower_training_batch_norm(train.graph, opset, running_stats_default(base))
    lift_parameters(train.graph, params)
    train.graph.inputs.extend([*buffers, reset] if wrt else [])

    evaluation = ir.from_proto(proto)
    to_inference_mode(evaluation.graph)
    lift_parameters(evaluation.graph, params)
    return to_proto(train), to_proto(evaluation)
