"""Building blocks: :class:`Block` and the small blocks that add one op (or a few) by name.

A block's ``build`` receives tensor names and returns the names of the tensors it adds; calling
the block edits the model of the surrounding :func:`~traingraph.onnxblock.base` context and
checks it. Every block adds default-domain ONNX ops only (``LabelEncoder`` is ``ai.onnx.ml``).

Example:
    >>> class WeightedSum(Block):
    ...     def __init__(self, w):
    ...         super().__init__()
    ...         self.w, self.mul, self.add = Constant(w), Mul(), Add()
    ...
    ...     def build(self, a, b):
    ...         return self.add(self.mul(self.w(), a), b)
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import onnx

from traingraph.onnxblock import graph_utils, model_accessor

__all__ = [
    "Abs",
    "Add",
    "Block",
    "Cast",
    "Clip",
    "Constant",
    "Div",
    "InputLike",
    "LabelEncoder",
    "Linear",
    "Log",
    "Mul",
    "Neg",
    "PassThrough",
    "Pow",
    "ReduceAllL2",
    "ReduceMean",
    "ReduceSum",
    "SequenceConstruct",
    "Sigmoid",
    "Sub",
]

_T = TypeVar("_T")


class Block(ABC):
    """Base class of every block.

    Subclasses implement :meth:`build`, which edits ``self.base`` (the model of the current
    context) and returns the names of the tensors it produced. Calling the block runs
    ``build`` and checks the edited model with ``onnx.checker``.

    Args:
        temp_file_name: Accepted for onnxruntime-training's signature, where it names the file
            that models with external data are written to while blocks check them. traingraph
            edits and checks the model in memory and writes no such file; a relative name is
            required as there.

    Attributes:
        base: The ``onnx.ModelProto`` being edited (set when the block is called).
    """

    base: onnx.ModelProto

    def __init__(self, temp_file_name: str = "temp.onnx") -> None:
        if os.path.isabs(temp_file_name):
            raise RuntimeError(
                f"temp_file_name {temp_file_name!r} is an absolute path; pass a relative file"
                " name (or leave the default)"
            )
        self.base = None  # type: ignore[assignment]

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Add this block's nodes to ``self.base``; return the names of its outputs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.base = model_accessor.current().model
        output = self.build(*args, **kwargs)
        onnx.checker.check_model(self.base, full_check=True)
        return output

    def infer_shapes_on_base(self) -> onnx.ModelProto:
        """A copy of the current context's model with the types onnx shape inference finds.

        Raises:
            RuntimeError: No :func:`~traingraph.onnxblock.base` context is open.
        """
        return onnx.shape_inference.infer_shapes(model_accessor.current().model)

    def _node(self, op_type: str, inputs: Sequence[str], domain: str = "", **attrs: Any) -> str:
        """Append one ``op_type`` node reading ``inputs``; return its output's name."""
        output = graph_utils.fresh_name(self.base, f"{op_type.lower()}_output")
        node = onnx.helper.make_node(
            op_type,
            list(inputs),
            [output],
            name=graph_utils.fresh_name(self.base, op_type),
            domain=domain,
            **attrs,
        )
        self.base.graph.node.append(node)
        return output

    def _initializer(self, hint: str, value: Any, dtype: Any = np.float32) -> str:
        """Add ``value`` as an initializer named after ``hint``; return its name."""
        name = graph_utils.fresh_name(self.base, hint)
        array = np.asarray(value, dtype=dtype)
        self.base.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
        return name

    @staticmethod
    def _built(value: _T | None, message: str) -> _T:
        """``value``, what the block's call built.

        Raises:
            RuntimeError: ``value`` is None: the block has not been called yet (``message``).
        """
        if value is None:
            raise RuntimeError(message)
        return value


class _BinaryOp(Block):
    op_type = ""

    def build(self, input_name1: str, input_name2: str) -> str:
        return self._node(self.op_type, [input_name1, input_name2])


class Add(_BinaryOp):
    """``input1 + input2``."""

    op_type = "Add"


class Sub(_BinaryOp):
    """``input1 - input2``."""

    op_type = "Sub"


class Mul(_BinaryOp):
    """``input1 * input2``."""

    op_type = "Mul"


class Div(_BinaryOp):
    """``input1 / input2``."""

    op_type = "Div"


class _UnaryOp(Block):
    op_type = ""

    def build(self, input_name: str) -> str:
        return self._node(self.op_type, [input_name])


class Sigmoid(_UnaryOp):
    """``1 / (1 + exp(-x))``."""

    op_type = "Sigmoid"


class Log(_UnaryOp):
    """Natural logarithm."""

    op_type = "Log"


class Neg(_UnaryOp):
    """``-x``."""

    op_type = "Neg"


class Abs(_UnaryOp):
    """``|x|``."""

    op_type = "Abs"


class _Reduce(Block):
    op_type = ""

    def __init__(self, keepdims: bool = False) -> None:
        super().__init__()
        self.keepdims = keepdims

    def build(self, input_name: str) -> str:
        return self._node(self.op_type, [input_name], keepdims=int(self.keepdims))


class ReduceMean(_Reduce):
    """The mean of every element.

    Args:
        keepdims: Keep each reduced axis with size 1 (onnxruntime-training's default); the
            default False gives a scalar, the shape a training loss has.
    """

    op_type = "ReduceMean"


class ReduceSum(_Reduce):
    """The sum of every element.

    Args:
        keepdims: Keep each reduced axis with size 1 (onnxruntime-training's default); the
            default False gives a scalar, the shape a training loss has.
    """

    op_type = "ReduceSum"


class Pow(Block):
    """``x ** exponent`` for a constant float exponent."""

    def __init__(self, exponent: float) -> None:
        super().__init__()
        self._exponent = exponent

    def build(self, pow_input_name: str) -> str:
        exponent = self._initializer("pow_exponent", self._exponent)
        return self._node("Pow", [pow_input_name, exponent])


class Constant(Block):
    """A float32 constant of shape ``[1]`` (an initializer)."""

    def __init__(self, value_float: float) -> None:
        super().__init__()
        self._value = value_float

    def build(self) -> str:
        return self._initializer("initializer", [self._value])


class SequenceConstruct(Block):
    """A tensor sequence of the given tensors."""

    def build(self, *sequence_input_names: str) -> str:
        return self._node("SequenceConstruct", sequence_input_names)


class ReduceAllL2(Block):
    r"""The L2 norm of all the given tensors together, :math:`\sqrt{\sum_i \lVert x_i \rVert^2}`,
    as a scalar (default-domain ops, where onnxruntime uses its own ``ReduceAllL2``)."""

    def build(self, *reduce_node_input_names: str) -> str:
        squares = [self._node("ReduceSumSquare", [n], keepdims=0) for n in reduce_node_input_names]
        return self._node("Sqrt", [self._node("Sum", squares)])


class Clip(Block):
    """Clamp to ``[clip_min, clip_max]`` (either bound may be None)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None) -> None:
        super().__init__()
        self._min = clip_min
        self._max = clip_max

    def build(self, clip_input_name: str) -> str:
        low = "" if self._min is None else self._initializer("clip_min", self._min)
        high = "" if self._max is None else self._initializer("clip_max", self._max)
        return self._node("Clip", [clip_input_name, low, high])


class PassThrough(Block):
    """Returns its inputs' names unchanged (a reduction of ``"none"``)."""

    def build(self, *input_names: str) -> Any:
        return input_names[0] if len(input_names) == 1 else input_names


class InputLike(Block):
    """A new graph input typed and shaped like the tensor ``like`` (a graph input or output, or
    a tensor whose type the model records or onnx shape inference finds)."""

    def __init__(self, like: str) -> None:
        super().__init__()
        self._like = like

    def build(self, input_name: str | None = None) -> str:
        graph = self.base.graph
        source = graph_utils.typed_value_info(self.base, self._like)
        if source is None:
            raise LookupError(
                f"InputLike: the type of {self._like!r} is unknown: it is not a graph input or"
                f" output (inputs {[v.name for v in graph.input]}, outputs"
                f" {[v.name for v in graph.output]}) and shape inference finds none"
            )
        clone = copy.deepcopy(source)
        clone.name = input_name or graph_utils.fresh_name(self.base, "user_input")
        graph.input.append(clone)
        return clone.name


class Cast(Block):
    """Cast to the ``onnx.TensorProto`` element type ``to``."""

    def __init__(self, to: int) -> None:
        super().__init__()
        self._to = to

    def build(self, cast_input_name: str) -> str:
        return self._node("Cast", [cast_input_name], to=self._to)


class Linear(Block):
    """``x @ weight.T + bias``, a ``torch.nn.Linear`` whose parameters become initializers.

    The weight (``out_features x in_features``) and the bias start as torch initializes them:
    uniform in :math:`\\pm 1/\\sqrt{\\text{in\\_features}}`.

    Args:
        in_features: Size of the input's last dimension.
        out_features: Size of the output's last dimension.
        bias: Whether to add a bias.
        alpha: Scale of the product (Gemm's ``alpha``).
        beta: Scale of the bias (Gemm's ``beta``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        alpha: float = 1.0,
        beta: float = 1.0,
    ) -> None:
        super().__init__()
        self._in = in_features
        self._out = out_features
        self._bias = bias
        self._alpha = alpha
        self._beta = beta

    def build(self, linear_input_name: str) -> str:
        bound = 1.0 / np.sqrt(self._in)
        rng = np.random.default_rng()
        weight = self._initializer(
            "linear.weight", rng.uniform(-bound, bound, (self._out, self._in))
        )
        inputs = [linear_input_name, weight]
        if self._bias:
            inputs.append(self._initializer("linear.bias", rng.uniform(-bound, bound, self._out)))
        return self._node("Gemm", inputs, alpha=self._alpha, beta=self._beta, transB=1)


class LabelEncoder(Block):
    """``ai.onnx.ml`` ``LabelEncoder``: maps keys to values (e.g. class names to indices).

    Takes the ``LabelEncoder`` attributes by name (``keys_int64s``, ``values_strings``,
    ``default_int64``, ...); the model gets an ``ai.onnx.ml`` opset import where it has none.
    """

    def __init__(
        self,
        default_float: float = 0.0,
        default_int64: int = -1,
        default_string: str = "_Unused",
        keys_floats: Sequence[float] | None = None,
        keys_int64s: Sequence[int] | None = None,
        keys_strings: Sequence[str] | None = None,
        values_floats: Sequence[float] | None = None,
        values_int64s: Sequence[int] | None = None,
        values_strings: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self._attributes = {
            "default_float": default_float,
            "default_int64": default_int64,
            "default_string": default_string,
            "keys_floats": keys_floats,
            "keys_int64s": keys_int64s,
            "keys_strings": keys_strings,
            "values_floats": values_floats,
            "values_int64s": values_int64s,
            "values_strings": values_strings,
        }

    def build(self, label_encoder_input_name: str) -> str:
        if not any(o.domain == "ai.onnx.ml" for o in self.base.opset_import):
            self.base.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", 2))
        attributes = {k: v for k, v in self._attributes.items() if v is not None}
        return self._node("LabelEncoder", [label_encoder_input_name], "ai.onnx.ml", **attributes)
