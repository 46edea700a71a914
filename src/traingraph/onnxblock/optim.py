r"""Optimizer blocks and gradient clipping: onnxblock's names and arguments over
:mod:`traingraph.optim`.

An optimizer block builds, inside :func:`~traingraph.onnxblock.empty_base`, a model in
onnxruntime's layout: inputs ``learning_rate`` (float, shape [1]), ``step`` (int64, shape [1],
the 1-based number of the step being taken; :class:`AdamW` only), the tensor sequences
``params`` and ``gradients`` and one sequence per state kind (``first_order_moments``,
``second_order_moments``); outputs ``updated_flag`` (bool [1], always True), then the updated
``params`` and state sequences. The update is the chain of the :mod:`traingraph.optim`
optimizer in :attr:`AdamW.optimizer` (torch's arithmetic), built from default-domain ops; the
same object passed to :func:`traingraph.artifacts.generate_artifacts` gives traingraph's
optimizer model for :class:`traingraph.api.Optimizer`, which also runs the model these blocks
build (its metadata names the optimizer).

Example:
    >>> optimizer = onnxblock.optim.AdamW(weight_decay=0.01, clip_grad=ClipGradNorm(1.0))
    >>> with onnxblock.empty_base() as accessor:
    ...     optimizer(training_block.parameters())
    ...     optimizer_model = accessor.model
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from traingraph import optim
from traingraph.ir.builder import OpBuilder
from traingraph.onnxblock import graph_utils
from traingraph.onnxblock.blocks import Block
from traingraph.optim.transforms import ParamInfo, UpdateContext, clip_coefficient
from traingraph.program import describe_optimizer

__all__ = ["SGD", "AdamW", "ClipGradNorm"]

# onnxruntime's names of the state sequences, by traingraph's slot kind.
_STATE_INPUTS = {"exp_avg": "first_order_moments", "exp_avg_sq": "second_order_moments"}


class ClipGradNorm(Block):
    r"""Scale a sequence of gradients to a global L2 norm of at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: with :math:`n = \sqrt{\sum_i \lVert g_i \rVert^2}`,
    :math:`g_i \leftarrow g_i \min(1, c / (n + 10^{-6}))`
    (:func:`traingraph.optim.transforms.clip_by_global_norm`'s factor).

    Args:
        max_norm: :math:`c > 0`.
    """

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        if not max_norm > 0:
            raise ValueError(f"ClipGradNorm: max_norm must be positive; got {max_norm}")
        self.max_norm = float(max_norm)

    def build(self, gradients_name: str) -> str:
        """Add the clipping of the tensor sequence ``gradients_name``; return the name of the
        clipped sequence."""
        [clipped] = graph_utils.splice(self.base, [gradients_name], self._clip, prefix="clip_grad")
        return clipped.name or ""

    def _clip(self, b: OpBuilder, values: list[ir.Value]) -> list[ir.Value]:
        [grads] = values
        element = ir.DataType.FLOAT
        if isinstance(grads.type, ir.SequenceType):
            element = grads.type.elem_type.dtype or element  # type: ignore[attr-defined]
        count = b.SequenceLength(grads)

        def add_square(body: OpBuilder, i: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
            square = body.reduce("ReduceSumSquare", body.SequenceAt(grads, i), keepdims=False)
            return [body.Add(carried[0], square)]

        zero = b.const(0.0, element, name="zero")
        [total] = _loop(b, count, [zero], add_square)
        total.dtype, total.shape = element, ir.Shape([])
        coefficient = clip_coefficient(b, b.Sqrt(total), self.max_norm, total)

        def scaled(body: OpBuilder, i: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
            grad = body.Mul(body.SequenceAt(grads, i), coefficient)
            return [body.SequenceInsert(carried[0], grad)]

        empty = b.SequenceEmpty(dtype=int(element))
        [clipped] = _loop(b, count, [empty], scaled)
        return [clipped]


LoopBody = Callable[[OpBuilder, ir.Value, list[ir.Value]], list[ir.Value]]


def _loop(
    b: OpBuilder, count: ir.Value, initial: list[ir.Value], body_fn: LoopBody
) -> list[ir.Value]:
    """A ``Loop`` of ``count`` iterations whose body ``body_fn(body, i, carried)`` returns the
    new values of the carried ``initial`` values; returns their final values."""
    i = ir.Value(name=b.fresh_name("i"), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(
        name=b.fresh_name("cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([])
    )
    carried = [ir.Value(name=b.fresh_name("carried"), type=v.type, shape=v.shape) for v in initial]
    graph = ir.Graph([i, cond, *carried], [], nodes=[], name=b.fresh_name("loop_body"))
    body = OpBuilder(graph, b.opset, prefix=b.fresh_name("body"))
    outputs = body_fn(body, i, carried)
    graph.outputs.extend([body.Identity(cond), *outputs])
    result = b.op("Loop", count, None, *initial, num_outputs=len(initial), body=graph)
    return [result] if len(initial) == 1 else list(result)


class OptimizerBlock(Block):
    """An optimizer block over the :mod:`traingraph.optim` optimizer :attr:`optimizer`."""

    optimizer: optim.Optimizer
    takes_step = True
    _model: onnx.ModelProto | None = None

    def to_model_proto(self) -> onnx.ModelProto:
        """The optimizer model this block built (as ``accessor.model`` holds it).

        Raises:
            RuntimeError: The block has not been called yet.
        """
        return self._built(
            self._model,
            "Please build the optimizer model first: call the block on the training block's"
            " parameters() inside onnxblock.empty_base()",
        )

    def build(
        self, parameters: tuple[Sequence[onnx.TensorProto], Sequence[onnx.TensorProto]]
    ) -> str:
        """Add the update of the trainable ``parameters[0]`` (as :meth:`TrainingBlock.parameters
        <traingraph.onnxblock.TrainingBlock.parameters>` returns them); return the name of the
        ``updated_flag`` output."""
        trainable, _ = parameters
        if not trainable:
            raise ValueError(
                f"{type(self).__name__}: there are no trainable parameters to update; call"
                " requires_grad(name) on the training block for the parameters to train"
            )
        model = self.base
        infos = [
            ParamInfo(t.name, tuple(t.dims), onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
            for t in trainable
        ]
        kinds = list(
            dict.fromkeys(s.name[len(s.param) + 1 :] for s in self.optimizer.transform.init(infos))
        )
        element = trainable[0].data_type
        scalars = [("learning_rate", onnx.TensorProto.FLOAT)]
        if self.takes_step:
            scalars.append(("step", onnx.TensorProto.INT64))
        sequences = ["params", "gradients", *(_STATE_INPUTS.get(k, f"{k}s") for k in kinds)]
        model.graph.input.extend(
            [onnx.helper.make_tensor_value_info(n, t, [1]) for n, t in scalars]
            + [onnx.helper.make_tensor_sequence_value_info(n, element, None) for n in sequences]
        )
        flag_name = graph_utils.fresh_name(model, "updated_flag")
        updated = [
            graph_utils.fresh_name(model, f"updated_{n}") for n in ["params", *sequences[2:]]
        ]

        def update(b: OpBuilder, values: list[ir.Value]) -> list[ir.Value]:
            lr, *rest = values
            step = rest.pop(0) if self.takes_step else None
            params_seq, grads_seq, *state_seqs = rest
            params, grads, state = [], [], {}
            for index, info in enumerate(infos):
                at = b.const(index, ir.DataType.INT64, name="index")
                param = b.SequenceAt(params_seq, at)
                param.name, param.dtype = info.name, ir.DataType.from_numpy(np.dtype(info.dtype))
                param.shape = ir.Shape(info.shape)
                params.append(param)
                grads.append(b.SequenceAt(grads_seq, at))
                for kind, seq in zip(kinds, state_seqs):
                    state[f"{info.name}.{kind}"] = b.SequenceAt(seq, at)
            like = params[0]
            step_value = b.const(1.0, like=like) if step is None else b.squeeze(step, [0])
            ctx = UpdateContext(
                b, b.cast_like(b.squeeze(lr, [0]), like), b.cast_like(step_value, like)
            )
            steps, new_state = self.optimizer.transform.update(ctx, grads, dict(state), params)
            outputs = [b.SequenceConstruct(*(b.Add(p, u) for p, u in zip(params, steps)))]
            for kind in kinds:
                names = [f"{info.name}.{kind}" for info in infos]
                outputs.append(b.SequenceConstruct(*(new_state.get(n, state[n]) for n in names)))
            flag = b.const(np.array([True]), name="updated_flag")
            for value, name in zip([flag, *outputs], [flag_name, *updated]):
                value.name = name
            return [flag, *outputs]

        inputs = [n for n, _ in scalars] + sequences
        graph_utils.splice(model, inputs, update, prefix="optimizer")
        model.graph.output.append(
            onnx.helper.make_tensor_value_info(flag_name, onnx.TensorProto.BOOL, [1])
        )
        model.graph.output.extend(
            onnx.helper.make_tensor_sequence_value_info(n, element, None) for n in updated
        )
        # What traingraph.api.Optimizer needs to run this optimizer on a Module's buffers.
        describe_optimizer(model, self.optimizer, infos)
        self._model = model
        return flag_name


class AdamW(OptimizerBlock):
    r"""AdamW, as ``torch.optim.AdamW`` (:func:`traingraph.optim.AdamW`).

    Args:
        bias_correction: Must be True: the update divides by torch's bias corrections.
        betas: :math:`(\beta_1, \beta_2)`.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay :math:`\lambda`.
        clip_grad: A :class:`ClipGradNorm` to clip the gradients' global norm first, or None.

    Attributes:
        optimizer: The :mod:`traingraph.optim` optimizer these arguments stand for.
    """

    def __init__(
        self,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clip_grad: ClipGradNorm | None = None,
    ) -> None:
        super().__init__()
        if not bias_correction:
            raise ValueError(
                "AdamW: bias_correction=False is not supported; traingraph's AdamW applies"
                " torch.optim.AdamW's bias corrections. Drop the argument."
            )
        self.optimizer = optim.AdamW(
            lr=1e-3,
            betas=tuple(betas),  # type: ignore[arg-type]
            eps=eps,
            weight_decay=weight_decay,
            clip_grad_norm=_max_norm(clip_grad),
        )


class SGD(OptimizerBlock):
    """Stochastic gradient descent, as ``torch.optim.SGD`` (:func:`traingraph.optim.SGD`).

    Args:
        clip_grad: A :class:`ClipGradNorm` to clip the gradients' global norm first, or None.

    Attributes:
        optimizer: The :mod:`traingraph.optim` optimizer these arguments stand for.
    """

    takes_step = False

    def __init__(self, clip_grad: ClipGradNorm | None = None) -> None:
        super().__init__()
        self.optimizer = optim.SGD(lr=1e-3, clip_grad_norm=_max_norm(clip_grad))


def _max_norm(clip_grad: ClipGradNorm | None) -> float | None:
    if clip_grad is None:
        return None
    if not isinstance(clip_grad, ClipGradNorm):
        raise TypeError(
            f"clip_grad must be an onnxblock.optim.ClipGradNorm or None, got"
            f" {type(clip_grad).__name__}"
        )
    return clip_grad.max_norm
