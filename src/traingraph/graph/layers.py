"""Layers with ``torch.nn``'s arguments, default initializations and parameter names.

A layer is created once (its parameters are drawn then, from :mod:`traingraph.graph.init`'s
seeded generators) and called on :class:`~traingraph.graph.graph.Tensor` handles; calling it
adds its nodes and parameters (``<layer name>.<param>``) to the tensors' graph. Calling the
same layer again shares its parameters. Functional ops (:func:`add`, :func:`matmul`,
:func:`reshape`, ...) build parameter-free nodes.

Example:
    >>> h = Conv2d(1, 8, kernel_size=3, padding=1)(x)
    >>> h = Flatten()(MaxPool2d(2)(ReLU()(h)))
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from traingraph.autodiff.lowering import RUNNING_STATS_KEY
from traingraph.graph import init
from traingraph.graph.data import WeightSource
from traingraph.graph.graph import Graph, Tensor

__all__ = [
    "ELU", "GELU", "AvgPool1d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv1d", "Conv2d",
    "ConvTranspose2d", "Dropout", "Embedding", "Flatten", "GlobalAvgPool", "GlobalMaxPool",
    "GroupNorm", "Identity", "Layer", "LayerNorm", "LeakyReLU", "Linear", "LogSoftmax",
    "MaxPool1d", "MaxPool2d", "MultiheadAttention", "ReLU", "SiLU", "Sigmoid", "Softmax",
    "Softplus", "Tanh", "add", "concat", "div", "gather", "matmul", "mul", "reduce_max",
    "reduce_mean", "reduce_min", "reduce_sum", "reshape", "slice", "split", "sub", "transpose",
]  # fmt: skip

Weight = np.ndarray | WeightSource


def _pair(value: int | Sequence[int], n: int, what: str) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    values = [int(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{what} needs {n} values; got {list(value)}")
    return values


class Layer:
    """Base of the layers: holds parameters, adds them to a graph when called.

    Attributes:
        name: The layer's name in the graph (None: ``<kind><n>`` in call order).
        params: Local parameter name -> initial value (array or weight source).
        inputs: The tensors of the last call; ``output``: its result.
    """

    kind = "layer"

    def __init__(self, name: str | None = None, seed: int | None = None) -> None:
        self.name = name
        self.seed = seed
        self.params: dict[str, Weight] = {}
        self.trainable: dict[str, bool] = {}
        self.inputs: tuple[Tensor, ...] = ()
        self.output: Tensor | None = None

    def _rng(self) -> np.random.Generator:
        return init.generator(self.seed)

    def _param(
        self,
        local: str,
        shape: Sequence[int],
        initializer: init.Initializer,
        value: Weight | None = None,
        trainable: bool = True,
    ) -> None:
        if value is None:
            value = initializer(tuple(shape), self._rng(), np.float32)
        elif not isinstance(value, WeightSource):
            value = np.asarray(value, dtype=np.float32)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"{type(self).__name__}.{local} needs shape {list(shape)}; got {list(value.shape)}"
            )
        self.params[local] = value
        self.trainable[local] = trainable

    def __call__(self, *inputs: Tensor) -> Tensor:
        if not inputs or not isinstance(inputs[0], Tensor):
            raise TypeError(
                f"{type(self).__name__} is called on traingraph Tensors (from g.input(...) or"
                f" another layer); got {[type(x).__name__ for x in inputs]}"
            )
        g = inputs[0].graph
        prefix = g.layer_name(self, self.kind, self.name)
        weights = {
            local: g.parameter(f"{prefix}.{local}", value, self.trainable[local]).value
            for local, value in self.params.items()
        }
        g.builder.scope = f"{prefix}/"
        try:
            out = self.forward(g, weights, *[g.as_value(x) for x in inputs])
        finally:
            g.builder.scope = ""
        self.inputs, self.output = inputs, g.wrap(out)
        return self.output

    def parameter_names(self, graph: Graph) -> list[str]:
        """The full names of this layer's parameters in ``graph``."""
        prefix = graph.layer_name(self, self.kind, self.name)
        return [f"{prefix}.{local}" for local in self.params]

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        raise NotImplementedError


# ----------------------------------------------------------------------------- linear and conv
class Linear(Layer):
    r""":math:`y = x W^\top + b`, ``weight`` of shape (out, in), torch's default init."""

    kind = "linear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        weight: Weight | None = None,
        bias_value: Weight | None = None,
        weight_init: init.Initializer | None = None,
        name: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(name, seed)
        bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self._param(
            "weight", (out_features, in_features),
            weight_init or init.kaiming_uniform(a=math.sqrt(5)), weight,
        )  # fmt: skip
        if bias:
            self._param("bias", (out_features,), init.uniform(-bound, bound), bias_value)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        b = g.builder
        y = b.MatMul(x[0], b.Transpose(w["weight"], perm=[1, 0]))
        return b.Add(y, w["bias"]) if "bias" in w else y


class _ConvNd(Layer):
    kind = "conv"
    dims = 2
    transposed = False

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        bias: bool = True,
        output_padding: int | Sequence[int] = 0,
        *,
        weight: Weight | None = None,
        bias_value: Weight | None = None,
        weight_init: init.Initializer | None = None,
        name: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(name, seed)
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be"
                f" divisible by groups ({groups})"
            )
        n = self.dims
        self.kernel = _pair(kernel_size, n, "kernel_size")
        self.stride = _pair(stride, n, "stride")
        self.padding = _pair(padding, n, "padding")
        self.dilation = _pair(dilation, n, "dilation")
        self.output_padding = _pair(output_padding, n, "output_padding")
        self.groups = groups
        if self.transposed:
            shape = (in_channels, out_channels // groups, *self.kernel)
        else:
            shape = (out_channels, in_channels // groups, *self.kernel)
        fan_in, _ = init.calculate_fans(shape)
        self._param("weight", shape, weight_init or init.kaiming_uniform(a=math.sqrt(5)), weight)
        if bias:
            bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
            self._param("bias", (out_channels,), init.uniform(-bound, bound), bias_value)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        inputs = [x[0], w["weight"]] + ([w["bias"]] if "bias" in w else [])
        attrs: dict[str, Any] = {
            "kernel_shape": self.kernel,
            "strides": self.stride,
            "pads": self.padding + self.padding,
            "dilations": self.dilation,
            "group": self.groups,
        }
        if self.transposed:
            attrs["output_padding"] = self.output_padding
            return g.builder.op("ConvTranspose", *inputs, **attrs)
        return g.builder.op("Conv", *inputs, **attrs)


class Conv1d(_ConvNd):
    """1-D convolution over (N, C, L), as ``torch.nn.Conv1d`` (``groups`` included)."""

    kind = "conv1d"
    dims = 1


class Conv2d(_ConvNd):
    """2-D convolution over (N, C, H, W), as ``torch.nn.Conv2d`` (``groups`` included)."""

    kind = "conv2d"
    dims = 2


class ConvTranspose2d(_ConvNd):
    """Transposed 2-D convolution, as ``torch.nn.ConvTranspose2d``.

    The weight has shape (in, out / groups, kH, kW).
    """

    kind = "conv_transpose2d"
    dims = 2
    transposed = True


# ----------------------------------------------------------------------------------- pooling
class _PoolNd(Layer):
    kind = "pool"
    dims = 2
    op_type = "MaxPool"

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        n = self.dims
        self.kernel = _pair(kernel_size, n, "kernel_size")
        self.stride = _pair(stride if stride is not None else kernel_size, n, "stride")
        self.padding = _pair(padding, n, "padding")
        self.ceil_mode = ceil_mode
        self.count_include_pad = count_include_pad

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        attrs: dict[str, Any] = {
            "kernel_shape": self.kernel,
            "strides": self.stride,
            "pads": self.padding + self.padding,
            "ceil_mode": int(self.ceil_mode),
        }
        if self.op_type == "AveragePool":
            attrs["count_include_pad"] = int(self.count_include_pad)
        return g.builder.op(self.op_type, x[0], **attrs)


class MaxPool1d(_PoolNd):
    """Max pooling over (N, C, L), as ``torch.nn.MaxPool1d``."""

    kind, dims, op_type = "maxpool1d", 1, "MaxPool"


class MaxPool2d(_PoolNd):
    """Max pooling over (N, C, H, W), as ``torch.nn.MaxPool2d``."""

    kind, dims, op_type = "maxpool2d", 2, "MaxPool"


class AvgPool1d(_PoolNd):
    """Average pooling over (N, C, L), as ``torch.nn.AvgPool1d``."""

    kind, dims, op_type = "avgpool1d", 1, "AveragePool"


class AvgPool2d(_PoolNd):
    """Average pooling over (N, C, H, W), as ``torch.nn.AvgPool2d``."""

    kind, dims, op_type = "avgpool2d", 2, "AveragePool"


class GlobalAvgPool(Layer):
    """Mean over every spatial dimension: (N, C, *S) -> (N, C, 1, ...) (or (N, C) with flatten)."""

    kind = "global_avgpool"
    op_type = "GlobalAveragePool"

    def __init__(self, flatten: bool = False, *, name: str | None = None) -> None:
        super().__init__(name)
        self.flatten = flatten

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        y = g.builder.op(self.op_type, x[0])
        return g.builder.Flatten(y, axis=1) if self.flatten else y


class GlobalMaxPool(GlobalAvgPool):
    """Max over every spatial dimension: (N, C, *S) -> (N, C, 1, ...) (or (N, C) with flatten)."""

    kind = "global_maxpool"
    op_type = "GlobalMaxPool"


# ----------------------------------------------------------------------------- normalization
class _BatchNorm(Layer):
    kind = "batchnorm"

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.eps, self.momentum = eps, momentum
        c = (num_features,)
        self._param("weight", c, init.ones())
        self._param("bias", c, init.zeros())
        self._param("running_mean", c, init.zeros(), trainable=False)
        self._param("running_var", c, init.ones(), trainable=False)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        y = g.builder.op(
            "BatchNormalization", x[0], w["weight"], w["bias"], w["running_mean"],
            w["running_var"], epsilon=self.eps, momentum=1.0 - self.momentum,
        )  # fmt: skip
        node = y.producer()
        assert node is not None
        node.metadata_props[RUNNING_STATS_KEY] = "torch"
        return y


class BatchNorm1d(_BatchNorm):
    """Batch normalization over (N, C) or (N, C, L), as ``torch.nn.BatchNorm1d``.

    Training uses batch statistics and updates the running statistics as torch does:
    ``running = (1 - momentum) * running + momentum * batch`` (ONNX momentum = 1 - torch
    momentum), with the unbiased batch variance for ``running_var`` (the node's
    ``traingraph.running_stats`` metadata says "torch"); inference uses the running statistics.
    """

    kind = "batchnorm1d"


class BatchNorm2d(_BatchNorm):
    """Batch normalization over (N, C, H, W), as ``torch.nn.BatchNorm2d``."""

    kind = "batchnorm2d"


class LayerNorm(Layer):
    """Normalization over the last ``len(normalized_shape)`` dims, as ``torch.nn.LayerNorm``."""

    kind = "layernorm"

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self.shape = (
            [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        )
        self.eps = eps
        self.affine = elementwise_affine
        self._param("weight", self.shape, init.ones(), trainable=elementwise_affine)
        self._param("bias", self.shape, init.zeros(), trainable=elementwise_affine)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        return g.builder.op(
            "LayerNormalization", x[0], w["weight"], w["bias"],
            axis=-len(self.shape), epsilon=self.eps,
        )  # fmt: skip


class GroupNorm(Layer):
    r"""Group normalization of (N, C, *S), as ``torch.nn.GroupNorm``.

    Built from primitives (the per-channel affine form is GroupNormalization-21's, which not
    every onnxruntime kernel has): :math:`y = \frac{x - \mu_g}{\sqrt{\sigma_g^2 + \epsilon}}
    \gamma_c + \beta_c`, with :math:`\mu_g, \sigma_g^2` over the channels of a group and the
    spatial positions.
    """

    kind = "groupnorm"

    def __init__(
        self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
        *, name: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name)
        if num_channels % num_groups:
            raise ValueError(
                f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})"
            )
        self.groups, self.channels, self.eps = num_groups, num_channels, eps
        self._param("weight", (num_channels,), init.ones(), trainable=affine)
        self._param("bias", (num_channels,), init.zeros(), trainable=affine)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        b = g.builder
        grouped = b.Reshape(x[0], b.ints([0, self.groups, -1]))
        mean = b.mean(grouped, [2], keepdims=True)
        centered = b.Sub(grouped, mean)
        var = b.mean(b.Mul(centered, centered), [2], keepdims=True)
        normed = b.Div(centered, b.Sqrt(b.Add(var, b.scalar(self.eps, like=x[0]))))
        y = b.reshape_like(normed, x[0])
        per_channel = _spatial_broadcast(g, x[0])
        scale, shift = b.Reshape(w["weight"], per_channel), b.Reshape(w["bias"], per_channel)
        return b.Add(b.Mul(y, scale), shift)


def _spatial_broadcast(g: Graph, x: ir.Value) -> ir.Value:
    """The shape ``[C, 1, ..., 1]`` broadcasting a per-channel vector over ``x``'s spatial dims."""
    b = g.builder
    spatial_ones = b.Mul(b.shape(x, 2), b.ints([0]))
    return b.Concat(b.ints([-1]), b.Add(spatial_ones, b.ints([1])), axis=0)


class Dropout(Layer):
    """Zeroes elements with probability ``p`` in training, scaling the rest by 1 / (1 - p).

    The identity in inference.
    """

    kind = "dropout"

    def __init__(self, p: float = 0.5, *, name: str | None = None, seed: int | None = None) -> None:
        super().__init__(name, seed)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1); got {p}")
        self.p = p

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        ratio = g.builder.const(self.p, ir.DataType.FLOAT, name="ratio")
        return g.builder.op("Dropout", x[0], ratio, seed=self.seed)


# ------------------------------------------------------------------------------- activations
class _Unary(Layer):
    """One ONNX op applied to the input, named where a subclass is declared.

    ``class ReLU(_Unary, op_type="Relu")`` runs ``Relu``; the layer's kind (the prefix of its
    default name) is the op's name in snake case, here ``relu``.
    """

    op_type = "Identity"

    def __init_subclass__(cls, *, op_type: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if op_type is not None:
            cls.op_type = op_type
            cls.kind = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", op_type).lower()

    def __init__(self, *, name: str | None = None, **attributes: Any) -> None:
        super().__init__(name)
        self.attributes = attributes

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        return g.builder.op(self.op_type, x[0], **self.attributes)


class Identity(_Unary, op_type="Identity"):
    """:math:`y = x`."""


class ReLU(_Unary, op_type="Relu"):
    r""":math:`\max(x, 0)`."""


class Sigmoid(_Unary, op_type="Sigmoid"):
    r""":math:`1 / (1 + e^{-x})`."""


class Tanh(_Unary, op_type="Tanh"):
    r""":math:`\tanh x`."""


class Softplus(_Unary, op_type="Softplus"):
    r""":math:`\log(1 + e^{x})`."""


class LeakyReLU(_Unary, op_type="LeakyRelu"):
    r""":math:`x` for :math:`x \ge 0`, else :math:`\alpha x` (torch's ``negative_slope``)."""

    def __init__(self, negative_slope: float = 0.01, *, name: str | None = None) -> None:
        super().__init__(name=name, alpha=float(negative_slope))


class ELU(_Unary, op_type="Elu"):
    r""":math:`x` for :math:`x > 0`, else :math:`\alpha (e^x - 1)`."""

    def __init__(self, alpha: float = 1.0, *, name: str | None = None) -> None:
        super().__init__(name=name, alpha=float(alpha))


class Softmax(_Unary, op_type="Softmax"):
    """Softmax along ``dim``, as ``torch.nn.Softmax``."""

    def __init__(self, dim: int = -1, *, name: str | None = None) -> None:
        super().__init__(name=name, axis=int(dim))


class LogSoftmax(_Unary, op_type="LogSoftmax"):
    """Log-softmax along ``dim``, as ``torch.nn.LogSoftmax``."""

    def __init__(self, dim: int = -1, *, name: str | None = None) -> None:
        super().__init__(name=name, axis=int(dim))


class Flatten(_Unary, op_type="Flatten"):
    """(N, d1, d2, ...) -> (N, d1 * d2 * ...), as ``torch.nn.Flatten()``."""

    def __init__(self, *, name: str | None = None) -> None:
        super().__init__(name=name, axis=1)


class SiLU(Layer):
    r""":math:`x \sigma(x)`."""

    kind = "silu"

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        return g.builder.Mul(x[0], g.builder.Sigmoid(x[0]))


class GELU(Layer):
    r"""GELU as ``torch.nn.GELU``: :math:`\frac{x}{2}(1 + \mathrm{erf}(x / \sqrt 2))`, or with
    ``approximate="tanh"``: :math:`\frac{x}{2}(1 + \tanh(\sqrt{2/\pi}(x + 0.044715 x^3)))`.

    Built from Erf / Tanh so that it runs at every opset (the Gelu op exists from opset 20).
    """

    kind = "gelu"

    def __init__(self, approximate: str = "none", *, name: str | None = None) -> None:
        super().__init__(name)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh'; got {approximate!r}")
        self.approximate = approximate

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        b, v = g.builder, x[0]
        if self.approximate == "tanh":
            cube = b.Mul(b.Mul(v, v), v)
            inner = b.Add(v, b.Mul(cube, b.scalar(0.044715, like=v)))
            t = b.Tanh(b.Mul(inner, b.scalar(math.sqrt(2.0 / math.pi), like=v)))
        else:
            t = b.Erf(b.Mul(v, b.scalar(1.0 / math.sqrt(2.0), like=v)))
        return b.Mul(b.Mul(v, b.scalar(0.5, like=v)), b.Add(t, b.scalar(1.0, like=v)))


# ------------------------------------------------------------------------ embedding, attention
class Embedding(Layer):
    """Rows of ``weight`` (num_embeddings, embedding_dim) picked by int64 indices; N(0, 1) init."""

    kind = "embedding"

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, weight: Weight | None = None,
        name: str | None = None, seed: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name, seed)
        self._param("weight", (num_embeddings, embedding_dim), init.normal(0.0, 1.0), weight)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        return g.builder.Gather(w["weight"], x[0], axis=0)


class MultiheadAttention(Layer):
    r"""Multi-head attention over (N, L, E) tensors, as ``torch.nn.MultiheadAttention(...,
    batch_first=True)`` returning only the attended output.

    :math:`\mathrm{head}_i = \mathrm{softmax}(Q_i K_i^\top / \sqrt{d}) V_i` with
    :math:`Q = q W_q^\top + b_q` (likewise K, V from ``in_proj_weight`` (3E, E)), then
    ``out_proj``. Parameters keep torch's names and initializations (Glorot-uniform
    ``in_proj_weight``, zero biases). ``causal`` masks future positions.
    """

    kind = "mha"

    def __init__(
        self, embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
        *, name: str | None = None, seed: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(name, seed)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        e = embed_dim
        self._param("in_proj_weight", (3 * e, e), init.glorot_uniform())
        self._param("out_proj.weight", (e, e), init.kaiming_uniform(a=math.sqrt(5)))
        if bias:
            self._param("in_proj_bias", (3 * e,), init.zeros())
            self._param("out_proj.bias", (e,), init.zeros())

    def __call__(  # type: ignore[override]
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None
    ) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        return super().__call__(query, key, value)

    def forward(self, g: Graph, w: dict[str, ir.Value], *x: ir.Value) -> ir.Value:
        b = g.builder
        e, h = self.embed_dim, self.num_heads
        d = e // h
        wq, wk, wv = b.split(w["in_proj_weight"], [e, e, e], axis=0)
        biases = (
            b.split(w["in_proj_bias"], [e, e, e], axis=0) if "in_proj_bias" in w else (None,) * 3
        )
        heads = []
        for inp, weight, bias in zip(x, (wq, wk, wv), biases):
            proj = b.MatMul(inp, b.Transpose(weight, perm=[1, 0]))
            if bias is not None:
                proj = b.Add(proj, bias)
            split_heads = b.Reshape(proj, b.ints([0, 0, h, d]))
            heads.append(b.Transpose(split_heads, perm=[0, 2, 1, 3]))
        q, k, v = heads
        scores = b.MatMul(q, b.Transpose(k, perm=[0, 1, 3, 2]))
        scores = b.Mul(scores, b.scalar(1.0 / math.sqrt(d), like=x[0]))
        if self.causal:
            scores = b.Add(scores, _causal_mask(g, scores))
        attended = b.MatMul(b.Softmax(scores, axis=-1), v)
        merged = b.Reshape(b.Transpose(attended, perm=[0, 2, 1, 3]), b.ints([0, 0, e]))
        out = b.MatMul(merged, b.Transpose(w["out_proj.weight"], perm=[1, 0]))
        return b.Add(out, w["out_proj.bias"]) if "out_proj.bias" in w else out


def _causal_mask(g: Graph, scores: ir.Value) -> ir.Value:
    """-inf above the diagonal of the last two dims of ``scores`` (a (Lq, Lk) additive mask)."""
    b = g.builder
    length = b.shape(scores, 2, 3)
    grid = b.Expand(b.scalar(-1e9, like=scores), b.Concat(length, b.shape(scores, 3, 4), axis=0))
    return b.op("Trilu", grid, b.const(np.array(1, np.int64)), upper=1)


# ------------------------------------------------------------------------------- functional
def _graph_of(*xs: Any) -> Graph:
    for x in xs:
        if isinstance(x, Tensor):
            return x.graph
    raise TypeError("at least one operand must be a traingraph Tensor")


def _binary(op_type: str, a: Any, b: Any) -> Tensor:
    g = _graph_of(a, b)
    like = a if isinstance(a, Tensor) else b
    return g.wrap(g.builder.op(op_type, g.as_value(a, like), g.as_value(b, like)), like=like)


def add(a: Any, b: Any) -> Tensor:
    """Elementwise ``a + b`` with numpy broadcasting."""
    return _binary("Add", a, b)


def sub(a: Any, b: Any) -> Tensor:
    """Elementwise ``a - b``."""
    return _binary("Sub", a, b)


def mul(a: Any, b: Any) -> Tensor:
    """Elementwise ``a * b``."""
    return _binary("Mul", a, b)


def div(a: Any, b: Any) -> Tensor:
    """Elementwise ``a / b``."""
    return _binary("Div", a, b)


def matmul(a: Any, b: Any) -> Tensor:
    """Matrix product with numpy's batching rules."""
    return _binary("MatMul", a, b)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Reshape; 0 copies the input's dimension, -1 is inferred (``Reshape`` semantics)."""
    return x.graph.wrap(x.graph.builder.Reshape(x.value, x.graph.builder.ints(shape)), like=x)


def transpose(x: Tensor, perm: Sequence[int]) -> Tensor:
    """Permute the dimensions."""
    return x.graph.wrap(x.graph.builder.Transpose(x.value, perm=list(perm)), like=x)


def concat(tensors: Sequence[Tensor], axis: int) -> Tensor:
    """Concatenate along ``axis``."""
    g = _graph_of(*tensors)
    return g.wrap(g.builder.Concat(*[g.as_value(t) for t in tensors], axis=axis), like=tensors[0])


def split(x: Tensor, sizes: Sequence[int], axis: int = 0) -> tuple[Tensor, ...]:
    """Split into pieces of ``sizes`` along ``axis``."""
    parts = x.graph.builder.split(x.value, list(sizes), axis=axis)
    return tuple(x.graph.wrap(p, like=x) for p in parts)


def slice(
    x: Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
) -> Tensor:
    """``Slice`` along ``axes`` (default: the first ``len(starts)`` dimensions)."""
    b = x.graph.builder
    axes = list(axes) if axes is not None else list(range(len(starts)))
    inputs = [x.value, b.ints(starts), b.ints(ends), b.ints(axes)]
    if steps is not None:
        inputs.append(b.ints(steps))
    return x.graph.wrap(b.Slice(*inputs), like=x)


def gather(x: Tensor, indices: Tensor | Sequence[int], axis: int = 0) -> Tensor:
    """Pick entries of ``x`` along ``axis`` by int64 ``indices``."""
    index = (
        indices.value
        if isinstance(indices, Tensor)
        else x.graph.builder.const(np.asarray(indices, dtype=np.int64))
    )
    return x.graph.wrap(x.graph.builder.Gather(x.value, index, axis=axis), like=x)


def _reduction(op_type: str, x: Tensor, axes: Sequence[int] | None, keepdims: bool) -> Tensor:
    value = x.graph.builder.reduce(op_type, x.value, None if axes is None else list(axes), keepdims)
    return x.graph.wrap(value, like=x)


def reduce_sum(x: Tensor, axes: Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axes`` (all when None)."""
    return _reduction("ReduceSum", x, axes, keepdims)


def reduce_mean(x: Tensor, axes: Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axes`` (all when None)."""
    return _reduction("ReduceMean", x, axes, keepdims)


def reduce_max(x: Tensor, axes: Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axes`` (all when None)."""
    return _reduction("ReduceMax", x, axes, keepdims)


def reduce_min(x: Tensor, axes: Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Minimum over ``axes`` (all when None)."""
    return _reduction("ReduceMin", x, axes, keepdims)
