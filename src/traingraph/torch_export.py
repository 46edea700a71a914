"""A PyTorch module in, a training-ready ONNX model out: :func:`from_torch`.

The module is exported in train mode, so BatchNormalization keeps its batch statistics and its
running statistics (as initializers that training updates, not trains) and Dropout stays a
training Dropout. Every parameter is an initializer named as in ``model.named_parameters()``,
every buffer one named as in ``model.named_buffers()``; the data inputs and outputs get a
dynamic batch axis. The result is checked against the module before it is returned.

torch is imported here only; ``import traingraph`` never imports it.

Example:
    >>> import torch
    >>> import traingraph
    >>> from traingraph import artifacts
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> model = traingraph.from_torch(net, torch.zeros(2, 4), path="net.onnx")
    >>> artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss,
    ...                              optimizer=artifacts.OptimType.AdamW)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from traingraph.errors import ModelError
from traingraph.ir.export_checks import REQUIRES_GRAD_KEY
from traingraph.ir.model import EXTERNAL_DATA_THRESHOLD
from traingraph.ir.random import DRAWS
from traingraph.torch_forms import exportable_forms

if TYPE_CHECKING:
    import torch

__all__ = ["from_torch"]

EXPORTERS = ("dynamo", "torchscript")
TORCHSCRIPT_OPSET = 17
BATCH_DIM = "batch"
# The exported forward equals the module's within float32 rounding of a deep network.
RTOL = 1e-3
ATOL = 1e-4

DynamicAxes = str | Mapping[str, Mapping[int, str] | Sequence[int]] | None


@dataclass
class _Reference:
    """The module's train-mode forward on the example inputs (dropout off)."""

    outputs: list[np.ndarray]
    structure: Any
    used: set[str]
    moved: set[str]  # the floating-point buffers the forward changes (running statistics)
    hints: list[str] = field(default_factory=list)  # what no exporter converts
    tolerance: tuple[float, float] = (RTOL, ATOL)  # the check's rtol and atol


def from_torch(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    path: str | os.PathLike[str] | None = None,
    dynamic_axes: DynamicAxes = BATCH_DIM,
    exporter: str | None = None,
    opset: int | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> onnx.ModelProto:
    """Export ``model`` to an ONNX model that trains as the module does.

    The module is put in train mode for the export (its own mode is restored after), so
    BatchNorm exports as training-mode BatchNormalization whose running statistics are
    initializers updated by training, and Dropout as a training Dropout. Every parameter is a
    separate initializer named exactly as in ``model.named_parameters()`` and every buffer as
    in ``model.named_buffers()``. A tied parameter (one tensor reached under several names) is
    one initializer named by the name ``named_parameters()`` reports for it (its first); its
    gradient sums over every use, as in torch. Constants that the exporter lifted out of the
    forward become Constant nodes, so that only parameters and buffers are initializers. The
    trainable parameters are recorded in the model's metadata (``traingraph.requires_grad``),
    which :func:`traingraph.artifacts.generate_artifacts` reads when ``requires_grad`` is not
    given. An ``nn.Embedding``'s ``padding_idx`` (that row gets no gradient from the lookups)
    and ``scale_grad_by_freq`` are kept as metadata of the Gathers of its weight, which the
    gradient reads (an ONNX Gather says neither); ``torch.nn.functional.embedding`` called with
    them outside an ``nn.Embedding`` is not seen.

    Before returning, the exported graph runs on onnxruntime on ``example_inputs`` (and, with a
    dynamic batch, on them twice over) and is compared with the module's train-mode forward
    with dropout off and random draws fixed alike on both sides (BatchNorm on batch
    statistics in both); the module's buffers are restored after, so its running statistics
    do not move.

    Args:
        model: The ``torch.nn.Module`` to export.
        example_inputs: A tensor or a tuple of tensors, passed to ``model`` positionally, or
            a dict of tensors (a tokenizer's ``BatchEncoding``) passed by keyword: the graph
            inputs are its tensors in the order of the forward's parameters. A module that
            ``torch.compile`` or ``nn.DataParallel`` wraps is exported as the module inside.
        path: Where to also save the model (``onnx.save``); None saves nothing.
        dynamic_axes: ``"batch"``: a dynamic first axis on every input and output, named
            ``batch`` where its size is the first input's and ``<name>_dim0`` where it is
            not (an ``nn.EmbeddingBag``'s offsets beside its flat input); a dict as torch's
            ``dynamic_axes`` (``{"ids": {0: "batch", 1: "seq"}}`` or ``{"ids": [0, 1]}``);
            None: static shapes.
        exporter: ``"dynamo"`` or ``"torchscript"`` forces that exporter; None tries the dynamo
            exporter and falls back to the TorchScript exporter, with a warning naming why,
            when dynamo fails or its result loses something.
        opset: The default-domain opset; None: 17 for the TorchScript exporter, the dynamo
            exporter's own default (18 or newer) for dynamo.
        input_names: Names of the graph inputs (default: the names of ``forward``'s arguments).
        output_names: Names of the graph outputs (default: the keys of a dict output,
            ``output`` for one tensor, ``output_0``, ``output_1``, ... otherwise).
        rtol, atol: The check's tolerance: each output may differ from the module's by
            ``atol + rtol * max|output|``. A forward whose float32 rounding exceeds the
            defaults (an ill-conditioned normalization of a tiny input) takes larger ones.

    Returns:
        The ONNX model, ready for :func:`traingraph.artifacts.generate_artifacts`.

    Raises:
        ModelError: When the arguments do not fit, or when the export (every exporter tried)
            loses a parameter or computes another forward than the module: the message names
            the lost parameters and the outputs that differ, by how much.
    """
    torch = _import_torch()
    if not isinstance(model, torch.nn.Module):
        raise ModelError(
            f"from_torch expects a torch.nn.Module, got {type(model).__name__}; pass the module"
            " (for an .onnx file, call generate_artifacts on the file directly)"
        )
    if exporter not in (None, *EXPORTERS):
        raise ModelError(
            f"exporter must be one of {EXPORTERS} or None (dynamo, falling back to TorchScript),"
            f" got {exporter!r}"
        )
    model = _unwrapped(torch, model)
    args, keywords = _as_args(torch, model, example_inputs)
    present = tuple(a for a in args if a is not None)
    snapshot = _snapshot(model)
    with _train_mode(model):
        try:
            reference = _reference(torch, model, args)
            reference.tolerance = (float(rtol), float(atol))
            _restore(model, snapshot)
            default_names = keywords or _default_input_names(model, len(args))
            in_names = list(input_names or default_names)
            out_names = list(output_names or _default_output_names(reference))
            _check_names(in_names, len(present), "input_names", "example inputs")
            _check_names(out_names, len(reference.outputs), "output_names", "forward outputs")
            axes = _resolve_axes(dynamic_axes, in_names, out_names, present, reference.outputs)
            result = _export_first(
                torch, model, args, reference, in_names, out_names, axes, exporter, opset,
                dynamic_axes == BATCH_DIM, snapshot,
            )  # fmt: skip
        finally:
            _restore(model, snapshot)
    if path is not None:
        onnx.save(result, os.fspath(path))
    return result


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ModelError(
            "from_torch needs PyTorch, which is not installed; install it with"
            " pip install 'traingraph[torch]'"
        ) from None
    return torch


def _unwrapped(torch: Any, model: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile`` (``_orig_mod``), ``nn.DataParallel`` or
    ``DistributedDataParallel`` (``module``) wraps, whose forward takes ``*args`` (which the
    exporters cannot give dynamic shapes) and whose parameter names carry the wrapper's
    prefix; ``model`` itself where it wraps nothing."""
    parallel = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        inner = model.module if isinstance(model, parallel) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _as_args(
    torch: Any, model: torch.nn.Module, example_inputs: Any
) -> tuple[tuple[torch.Tensor | None, ...], list[str] | None]:
    """The positional arguments of ``model``'s forward for ``example_inputs`` (None where a
    keyword input skips a parameter), and the keywords' names in that order, for inputs given
    by keyword (a dict, or a tokenizer's ``BatchEncoding``); None for positional ones."""
    if isinstance(example_inputs, Mapping):
        return _keyword_args(torch, model, example_inputs)
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(args, (tuple, list)) or not all(isinstance(a, torch.Tensor) for a in args):
        raise ModelError(
            "example_inputs must be a tensor, a tuple of tensors passed to the module"
            " positionally or a dict of tensors passed by keyword, got"
            f" {type(example_inputs).__name__}"
        )
    return tuple(args), None


def _keyword_args(
    torch: Any, model: torch.nn.Module, inputs: Mapping[str, Any]
) -> tuple[tuple[torch.Tensor | None, ...], list[str]]:
    """``inputs`` (name -> tensor; None values left out) as positional arguments of
    ``model``'s forward, in its parameters' order, with None for the parameters between them
    that no input names."""
    given = {str(k): v for k, v in inputs.items() if v is not None}
    wrong = sorted(k for k, v in given.items() if not isinstance(v, torch.Tensor))
    positional = _positional_parameters(model)
    unknown = sorted(k for k in given if k not in positional)
    if wrong or unknown or not given:
        raise ModelError(
            f"example_inputs by keyword must map parameters of {type(model).__name__}.forward"
            f" ({', '.join(positional) or 'none by name'}) to tensors; got"
            f" {sorted(given) or 'nothing'}"
            + (f", where {wrong} are no tensors" if wrong else "")
            + (f", where {unknown} are no parameter that can be passed by position" if unknown
               else "")
            + "; pass a tuple of tensors in the forward's order instead"
        )  # fmt: skip
    last = max(positional.index(k) for k in given)
    args = tuple(given.get(name) for name in positional[: last + 1])
    return args, [name for name in positional[: last + 1] if name in given]


def _check_names(names: list[str], count: int, what: str, of: str) -> None:
    if len(names) != count or len(set(names)) != count:
        raise ModelError(
            f"{what} must name each of the {count} {of} once, got {names}; pass {count} distinct"
            " names"
        )


@contextlib.contextmanager
def _train_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in train mode, every Dropout module out of place (the dynamo exporter
    writes an in-place dropout as random ops instead of a Dropout node) and every stochastic
    depth module as a Dropout (:func:`_drop_path_as_dropout`); each one's own settings back
    after."""
    import torch

    modes = [(m, m.training) for m in model.modules()]
    in_place = [
        d
        for d in model.modules()
        if isinstance(d, torch.nn.modules.dropout._DropoutNd) and d.inplace
    ]
    drop_paths = [(m, f) for m in model.modules() if (f := _drop_path_as_dropout(torch, m))]
    model.train()
    for dropout in in_place:
        dropout.inplace = False
    for module, forward in drop_paths:
        module.forward = forward
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        for dropout in in_place:
            dropout.inplace = True
        for module, _ in drop_paths:
            del module.forward  # the class's forward again


def _drop_path_as_dropout(torch: Any, module: torch.nn.Module) -> Callable[..., Any] | None:
    """For a stochastic depth module (timm's ``DropPath``: ``drop_prob`` and ``scale_by_keep``;
    torchvision's ``StochasticDepth``: ``p`` and ``mode``), a forward that draws the same
    per-sample (or per-batch) keep mask through ``F.dropout`` of ones: the exporters write it
    as a training Dropout, which the eval graph and the inference model drop, as the module
    is the identity in eval mode. Their own forwards draw the mask with ``bernoulli_``, random
    ops that would stay in the eval graph. None for other modules, and where the
    probability is 0 (the module is the identity) or 1."""
    kind = type(module).__name__
    attrs: dict[str, Any] = vars(module)
    p: float
    if kind == "DropPath" and isinstance(attrs.get("drop_prob"), float):
        p, per_sample = attrs["drop_prob"], True
        scale = bool(attrs.get("scale_by_keep", True))
    elif kind == "StochasticDepth" and attrs.get("mode") in ("row", "batch"):
        p, per_sample, scale = float(attrs.get("p", 0.0)), attrs["mode"] == "row", True
    else:
        return None
    if not 0.0 < p < 1.0 or "forward" in vars(module):
        return None
    functional = torch.nn.functional

    def forward(x: Any) -> Any:
        if not module.training:
            return x
        shape = (x.shape[0],) + (1,) * (x.dim() - 1) if per_sample else (1,) * x.dim()
        keep = functional.dropout(x.new_ones(shape), p, training=True)  # 0 or 1 / (1 - p)
        return x * (keep if scale else (keep > 0).to(x.dtype))

    return forward


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _restore(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in snapshot:
                buffer.copy_(snapshot[name])


@contextlib.contextmanager
def _no_dropout(
    torch: Any, model: torch.nn.Module, hints: list[str] | None = None
) -> Iterator[None]:
    """Every dropout of ``model`` off: Dropout modules' ``p`` and the float dropout
    probabilities that modules keep as attributes (``MultiheadAttention.dropout``, Hugging Face
    attention's ``attention_dropout``) set to 0, and the dropout functions that the forward
    calls directly the identity; everything restored after."""
    changed: list[tuple[Any, str, float]] = []
    for module in model.modules():
        for name, value in vars(module).items():
            dropout = name == "p" and isinstance(module, torch.nn.modules.dropout._DropoutNd)
            if (dropout or "dropout" in name) and isinstance(value, float) and value > 0:
                changed.append((module, name, value))
    try:
        for module, name, _ in changed:
            setattr(module, name, 0.0)
        with _no_dropout_mode(torch, hints):
            yield
    finally:
        for module, name, value in changed:
            setattr(module, name, value)


_UNEXPORTABLE = {
    "_pack_padded_sequence": (
        "the forward packs sequences (nn.utils.rnn.pack_padded_sequence), which no exporter"
        " converts: run the RNN on the padded batch and take each sequence's last valid step"
        " with gather (or mask the padded steps) instead"
    ),
}
"""torch functions that no exporter converts -> what to do instead, named where an export
fails after the forward called them."""


def _no_dropout_mode(torch: Any, hints: list[str] | None = None) -> Any:
    """A torch function mode under which the dropout functions called from Python (not those
    called inside another torch function) are the identity and the random draws are the
    check's fixed draws (:func:`_fixed_draw`), as :func:`_runner` makes the exported random
    ops."""
    functional = torch.nn.functional
    dropouts = {
        functional.dropout, functional.dropout1d, functional.dropout2d, functional.dropout3d,
        functional.alpha_dropout, functional.feature_alpha_dropout, torch.dropout,
        torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
    }  # fmt: skip
    attention = functional.scaled_dot_product_attention
    tensor = torch.Tensor
    draws = {
        torch.randn, torch.randn_like, torch.rand, torch.rand_like, torch.normal,
        torch.bernoulli, tensor.normal_, tensor.uniform_, tensor.bernoulli_, tensor.bernoulli,
    }  # fmt: skip

    class NoDropout(torch.overrides.TorchFunctionMode):  # type: ignore[misc]
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            hint = _UNEXPORTABLE.get(getattr(func, "__name__", ""))
            if hint is not None and hints is not None and hint not in hints:
                hints.append(hint)
            if func in dropouts:
                return args[0] if args else kwargs["input"]
            if func in draws:
                return _fixed_draw(torch, func, func(*args, **kwargs), args, kwargs)
            if func is attention:
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                if "dropout_p" in kwargs:
                    kwargs["dropout_p"] = 0.0
            return func(*args, **kwargs)

    return NoDropout()


def _fixed_draw(torch: Any, func: Any, out: Any, args: tuple, kwargs: dict) -> Any:
    """``out``, drawn by ``func(*args, **kwargs)``, as the check's fixed draw: a normal draw
    is its mean, a uniform draw its low end and a Bernoulli draw 1 wherever its probability
    is above 0, in the module's forward (here) and in the exported graph
    (:func:`_fixed_draws`) alike. A Bernoulli draw that an exporter writes as
    ``RandomUniformLike(x) < p`` (``bernoulli_``, as torchvision's stochastic depth draws it)
    is then 1 where the module's is: the forward keeps every sample, as a dropout with its
    probability at 0 does."""
    tensor = torch.Tensor
    if func in (torch.randn, torch.randn_like):
        return torch.zeros_like(out)
    if func in (torch.rand, torch.rand_like):
        return torch.zeros_like(out)
    if func is torch.normal:
        mean = kwargs.get("mean", args[0] if args else 0.0)
        return torch.zeros_like(out) + mean
    if func in (torch.bernoulli, tensor.bernoulli):
        p = kwargs.get("p", args[1] if len(args) > 1 else args[0])
        return (torch.zeros_like(out) + p > 0).to(out.dtype)
    if func is tensor.normal_:
        return out.fill_(kwargs.get("mean", args[1] if len(args) > 1 else 0.0))
    if func is tensor.uniform_:
        return out.fill_(kwargs.get("from", args[1] if len(args) > 1 else 0.0))
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)  # Tensor.bernoulli_
    return out.copy_((torch.zeros_like(out) + p > 0).to(out.dtype))


_PLAIN_LEAVES: tuple[type, ...] = (int, float, bool, str, type(None))


def _reference(
    torch: Any,
    model: torch.nn.Module,
    args: tuple[torch.Tensor | None, ...],
    gradients: bool = True,
) -> _Reference:
    """Run the train-mode forward with dropout off; find the parameters the outputs depend on
    (where ``gradients``) and the buffers it moves."""
    before = _snapshot(model)
    hints: list[str] = []
    with torch.enable_grad(), _no_dropout(torch, model, hints):
        try:
            out = model(*args)
        except Exception as exc:  # the module's own code: any error
            shapes = [None if a is None else (tuple(a.shape), str(a.dtype)) for a in args]
            raise ModelError(
                f"{type(model).__name__}'s forward fails on the example inputs {shapes}:"
                f" {_first(exc)}; pass inputs the module takes (it runs in train mode)"
            ) from exc
    moved = {
        n for n, b in model.named_buffers()
        if b.is_floating_point() and n in before and not torch.equal(before[n], b)
    }  # fmt: skip
    leaves = torch.utils._pytree.tree_leaves(out)
    plain = (torch.Tensor, *_PLAIN_LEAVES)
    others = sorted({type(t).__name__ for t in leaves if not isinstance(t, plain)})
    if others:
        raise ModelError(
            f"{type(model).__name__}'s forward returns {', '.join(others)} beside its tensors,"
            " which no exporter writes to ONNX; return tensors only (a Hugging Face model:"
            " set use_cache=False in its config)"
        )
    leaves = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ModelError(
            f"{type(model).__name__}'s forward returned no tensor ({type(out).__name__}); a"
            " model to train must return its outputs as tensors"
        )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    differentiable = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    used: set[str] = set()
    if named and differentiable and gradients:
        total = sum(t.float().sum() for t in differentiable)
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
        used = {n for (n, _), g in zip(named, grads) if g is not None}
    outputs = [t.detach().cpu().numpy() for t in leaves]
    return _Reference(outputs=outputs, structure=out, used=used, moved=moved, hints=hints)


def _positional_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the parameters of ``model``'s forward that can be passed by position."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    return [
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def _default_input_names(model: torch.nn.Module, count: int) -> list[str]:
    positional = _positional_parameters(model)
    if len(positional) >= count:
        return positional[:count]
    return [f"input_{i}" for i in range(count)]


def _default_output_names(reference: _Reference) -> list[str]:
    out = reference.structure
    count = len(reference.outputs)
    if isinstance(out, Mapping):
        keys = [str(k) for k, v in out.items() if v is not None]
        if len(keys) == count:
            return keys
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def _resolve_axes(
    dynamic_axes: DynamicAxes,
    input_names: list[str],
    output_names: list[str],
    args: tuple[torch.Tensor, ...],
    outputs: list[np.ndarray],
) -> dict[str, dict[int, str]]:
    """Tensor name -> {axis: dimension name}."""
    ranks = {n: a.dim() for n, a in zip(input_names, args)}
    ranks.update({n: o.ndim for n, o in zip(output_names, outputs)})
    if dynamic_axes is None:
        return {}
    if dynamic_axes == BATCH_DIM:
        # The batch is the first axis of the first input; a first axis of another size (the
        # offsets beside a flat input of an nn.EmbeddingBag) is a dimension of its own.
        sizes = {n: int(a.shape[0]) for n, a in zip(input_names, args) if a.dim()}
        sizes.update({n: int(o.shape[0]) for n, o in zip(output_names, outputs) if o.ndim})
        batch = next(iter(sizes.values()), None)
        return {n: {0: BATCH_DIM if size == batch else f"{n}_dim0"} for n, size in sizes.items()}
    if not isinstance(dynamic_axes, Mapping):
        raise ModelError(
            f"dynamic_axes must be 'batch', None or a dict like {{'x': {{0: 'batch'}}}}, got"
            f" {dynamic_axes!r}"
        )
    axes: dict[str, dict[int, str]] = {}
    for name, spec in dynamic_axes.items():
        if name not in ranks:
            raise ModelError(
                f"dynamic_axes names {name!r}, which is not an input or output; expected one of"
                f" {list(ranks)} (set them with input_names= and output_names=)"
            )
        given = dict(spec) if isinstance(spec, Mapping) else {a: f"{name}_dim{a}" for a in spec}
        for axis in given:
            if not -ranks[name] <= axis < ranks[name]:
                raise ModelError(
                    f"dynamic_axes[{name!r}] names axis {axis}, but {name!r} has rank"
                    f" {ranks[name]}"
                )
        axes[name] = {a % ranks[name]: str(d) for a, d in given.items()}
    return axes


def _export_first(
    torch: Any,
    model: torch.nn.Module,
    args: tuple[torch.Tensor | None, ...],
    reference: _Reference,
    input_names: list[str],
    output_names: list[str],
    axes: dict[str, dict[int, str]],
    exporter: str | None,
    opset: int | None,
    batch_dynamic: bool,
    snapshot: dict[str, torch.Tensor],
) -> onnx.ModelProto:
    """Export with ``exporter`` or, for None, with the first exporter whose result is right."""
    reasons: list[str] = []
    for name in [exporter] if exporter is not None else list(EXPORTERS):
        try:
            exported = _export(torch, name, model, args, input_names, output_names, axes, opset)
        except ModelError:
            raise
        except Exception as exc:  # the exporters raise many kinds of errors
            reasons.append(f"the {name} exporter failed: {_first(exc)}")
            if exporter is not None:
                advice = "; ".join(reference.hints) or "try exporter=None or the other exporter"
                raise ModelError(f"{reasons[-1]}. {advice[0].upper()}{advice[1:]}") from exc
            continue
        finally:
            _restore(model, snapshot)
        proto = _finish(exported, model, input_names, output_names, axes)
        try:
            _check(proto, model, args, reference, input_names, batch_dynamic)
        except ModelError as exc:
            reasons.append(f"the {name} exporter's model is wrong: {exc}")
            if exporter is not None:
                raise
            continue
        if reasons:
            warnings.warn(
                f"{reasons[0]}; exported {type(model).__name__} with the {name} exporter instead",
                UserWarning,
                stacklevel=3,
            )
        _check_eval(torch, proto, model, args, input_names, reference.tolerance)
        return proto
    raise ModelError(
        f"no exporter produced a correct model of {type(model).__name__}: "
        + "; ".join(reasons + reference.hints)
    )


EVAL_CHECK_BYTES = 1 << 29
"""The largest serialized model whose eval graph ``from_torch`` checks against the module's
eval mode (:func:`_check_eval`)."""


def _check_eval(
    torch: Any,
    proto: onnx.ModelProto,
    model: torch.nn.Module,
    args: tuple[torch.Tensor | None, ...],
    input_names: list[str],
    tolerance: tuple[float, float],
) -> None:
    """Warn where the eval graph that training artifacts make of ``proto`` (Dropout off,
    BatchNorm on its running statistics) differs from ``model.eval()``'s forward on ``args``:
    the forward then does more in train mode than those two (a mask drawn inline, a branch on
    ``self.training``), which the eval graph and the inference model keep. The training graph
    is right either way (the train-mode check passed). Skipped for models over
    :data:`EVAL_CHECK_BYTES`, whose second session would double the export's memory."""
    from traingraph.program import to_inference_mode

    if proto.ByteSize() > EVAL_CHECK_BYTES:
        return
    try:
        m = ir.from_proto(proto)
        to_inference_mode(m.graph)
        got = _runner(ir.to_proto(m))(
            dict(zip(input_names, (a.detach().cpu().numpy() for a in args if a is not None)))
        )
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                expected = _reference(torch, model, args, gradients=False).outputs
        finally:
            for module, training in modes:
                module.training = training
        _compare(got, expected, proto, "", tolerance)
    except ModelError as error:
        warnings.warn(
            f"the eval graph of the exported {type(model).__name__} differs from its eval mode"
            f" ({str(error).partition(': ')[2].partition(' (allowed')[0][:300]}): the forward"
            " does more in train mode than"
            " Dropout and BatchNorm (a random mask drawn in the forward, a branch on"
            " self.training), which the eval graph and the inference model keep; the training"
            " graph is right. Draw such a mask with F.dropout (x * F.dropout(x.new_ones(...),"
            " p, self.training)), or evaluate with the module",
            UserWarning,
            stacklevel=4,
        )
    except Exception:  # the check is advice: its own failures do not fail the export
        return


def _first(exc: BaseException) -> str:
    """The first line of the innermost cause of ``exc`` (the exporters wrap the reason)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else '(no message)'}"


def _export(
    torch: Any,
    exporter: str,
    model: torch.nn.Module,
    args: tuple[torch.Tensor | None, ...],
    input_names: list[str],
    output_names: list[str],
    axes: dict[str, dict[int, str]],
    opset: int | None,
) -> onnx.ModelProto:
    """Run one exporter in train mode with every parameter kept."""
    names = {"input_names": input_names, "output_names": output_names}
    with warnings.catch_warnings(), exportable_forms(torch):
        # Train mode is what is asked for; the traced forward is checked afterwards.
        warnings.filterwarnings("ignore", message=".*training mode.*")
        warnings.filterwarnings("ignore", message=".*Removing mutation.*num_batches_tracked")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        if exporter == "dynamo":
            named = iter(input_names)
            shapes = tuple(
                None if a is None
                else {axis: torch.export.Dim.DYNAMIC for axis in axes.get(next(named), {})}
                for a in args
            )  # fmt: skip
            with contextlib.redirect_stdout(_Discard()):
                program = torch.onnx.export(
                    model, args, dynamo=True, optimize=False, opset_version=opset,
                    external_data=False, verbose=False, dynamic_shapes=shapes, **names,
                )  # fmt: skip
            return program.model_proto
        import io

        buffer = io.BytesIO()
        traced: tuple[Any, ...] = args
        if None in args:  # the inputs after the first skipped parameter by keyword
            first = args.index(None)
            keywords = dict(zip(_positional_parameters(model)[first:], args[first:]))
            traced = (*args[:first], {k: v for k, v in keywords.items() if v is not None})
        settings = {
            "dynamo": False, "opset_version": opset or TORCHSCRIPT_OPSET,
            "training": torch.onnx.TrainingMode.TRAINING, "do_constant_folding": False,
            "dynamic_axes": {n: dict(a) for n, a in axes.items()} or None, **names,
        }  # fmt: skip
        size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        if size < EXTERNAL_DATA_THRESHOLD:
            torch.onnx.export(model, traced, buffer, **settings)
            return onnx.load_from_string(buffer.getvalue())
        # past protobuf's 2 GiB the exporter writes the tensors beside a file
        with tempfile.TemporaryDirectory(prefix="traingraph-") as directory:
            path = os.path.join(directory, "model.onnx")
            torch.onnx.export(model, traced, path, **settings)
            return onnx.load(path)


class _Discard:
    """A text stream that drops what is written (the dynamo exporter's progress lines)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None


def _torch_tensors(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer by its torch name (a tied one under its first name)."""
    tensors = {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}
    tensors.update((n, b.detach().cpu().numpy()) for n, b in model.named_buffers())
    return tensors


def _finish(
    proto: onnx.ModelProto,
    model: torch.nn.Module,
    input_names: list[str],
    output_names: list[str],
    axes: dict[str, dict[int, str]],
) -> onnx.ModelProto:
    """Name initializers as torch does, lift constants into nodes, set training-mode
    BatchNorm, name the dynamic axes and record the trainable parameters."""
    m = ir.from_proto(proto)
    graph = m.graph
    torch_tensors = _torch_tensors(model)
    _rename_initializers(graph, torch_tensors, _aliases(model))
    # Tracing in train mode ran the forward, which moved the running statistics it exported.
    for name, buffer in model.named_buffers():
        value = graph.initializers.get(name)
        if value is not None and value.const_value is not None:
            value.const_value = ir.tensor(buffer.detach().cpu().numpy(), name=name)
    _constants_to_nodes(graph, set(torch_tensors))
    _training_batch_norm(graph)
    _tag_embedding_gradients(graph, model)
    for value in [*graph.inputs, *graph.outputs]:
        if value.name in axes and value.shape is not None:
            dims = list(value.shape.dims)
            for axis, dim in axes[value.name].items():
                if axis < len(dims):
                    dims[axis] = ir.SymbolicDim(dim)
            value.shape = ir.Shape(dims)
    trainable = [
        n for n, p in model.named_parameters() if p.requires_grad and n in graph.initializers
    ]
    m.metadata_props[REQUIRES_GRAD_KEY] = json.dumps(trainable)
    return ir.to_proto(m)


def _tag_embedding_gradients(graph: ir.Graph, model: torch.nn.Module) -> None:
    """Tag each Gather of an ``nn.Embedding``'s (or ``nn.EmbeddingBag``'s, see
    :mod:`traingraph.torch_forms`) weight with the module's ``padding_idx``
    (:data:`~traingraph.autodiff.rules.indexing.PADDING_IDX_KEY`: torch gives that row no
    gradient) and ``scale_grad_by_freq`` (:data:`~traingraph.autodiff.rules.indexing.
    SCALE_BY_FREQUENCY_KEY`), which the exported Gather does not say."""
    from torch import nn

    from traingraph.autodiff.rules.indexing import PADDING_IDX_KEY, SCALE_BY_FREQUENCY_KEY

    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue
        tags = {}
        if module.padding_idx is not None:
            tags[PADDING_IDX_KEY] = str(module.padding_idx)
        if module.scale_grad_by_freq:
            tags[SCALE_BY_FREQUENCY_KEY] = "1"
        weight = graph.initializers.get(names.get(id(module.weight), ""))
        for use in [] if weight is None or not tags else weight.uses():
            rows = use.node.op_type == "Gather" and use.node.attributes.get_int("axis", 0) == 0
            if rows and use.idx == 0:
                use.node.metadata_props.update(tags)


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every further name of a parameter or buffer reached under several module paths (a
    tied weight) -> the name ``named_parameters()`` / ``named_buffers()`` report for it."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named: list[tuple[str, torch.Tensor]] = [*model.named_parameters(remove_duplicate=False)]
    named += model.named_buffers(remove_duplicate=False)
    for name, tensor in named:
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def _rename_initializers(
    graph: ir.Graph, torch_tensors: dict[str, np.ndarray], aliases: dict[str, str]
) -> None:
    """Give initializers that the exporter named its own way (``p_fc1_weight``,
    ``onnx::MatMul_12``) the torch name of the parameter or buffer with the same value; an
    initializer of a tied parameter that is there under its torch name already is replaced by
    that one, so that the tied uses share one initializer."""
    for name, value in list(graph.initializers.items()):
        if name in torch_tensors or value.const_value is None:
            continue
        target = aliases.get(name) or _same_value(value.const_value.numpy(), torch_tensors, graph)
        if target is None:
            continue
        graph.initializers.pop(name)
        if target in graph.initializers:
            ir.convenience.replace_all_uses_with(value, graph.initializers[target])
            for i, output in enumerate(graph.outputs):
                if output is value:
                    graph.outputs[i] = graph.initializers[target]
        else:
            value.name = target
            graph.register_initializer(value)


def _same_value(
    array: np.ndarray, torch_tensors: dict[str, np.ndarray], graph: ir.Graph
) -> str | None:
    """The torch name of a tensor equal to ``array``: one not among the initializers yet."""
    return next(
        (
            n
            for n, t in torch_tensors.items()
            if n not in graph.initializers
            and t.shape == array.shape
            and t.dtype == array.dtype
            and np.array_equal(t, array)
        ),
        None,
    )


def _constants_to_nodes(graph: ir.Graph, torch_names: set[str]) -> None:
    """Turn initializers that are neither parameters nor buffers (constants the exporter
    lifted out of the forward) into Constant nodes, so that nothing trains them."""
    first = next(iter(graph), None)
    for name, value in list(graph.initializers.items()):
        if name in torch_names or value.const_value is None or value in graph.inputs:
            continue
        tensor = value.const_value
        graph.initializers.pop(name)
        value.const_value = None
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], num_outputs=1)
        ir.convenience.replace_all_uses_with(value, node.outputs[0])
        node.outputs[0].name = name
        node.outputs[0].shape, node.outputs[0].type = value.shape, value.type
        if first is None:
            graph.append(node)
        else:
            graph.insert_before(first, node)
        for i, output in enumerate(graph.outputs):
            if output is value:
                graph.outputs[i] = node.outputs[0]


def _training_batch_norm(graph: ir.Graph) -> None:
    """BatchNormalization over running statistics held in initializers computes batch
    statistics (``training_mode=1``), as the module did in train mode."""
    for node in graph:
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        stats = node.inputs[3:5]
        if len(stats) < 2 or any(v is None or v.name not in graph.initializers for v in stats):
            continue
        if (graph.opset_imports.get("", 0) or 0) < 14:
            continue
        node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
        if len(node.outputs) < 3:
            node.resize_outputs(3)
        for out, stat in zip(node.outputs[1:3], stats):
            assert stat is not None
            out.name = out.name or f"{stat.name}_batch_update"
            out.shape, out.type = stat.shape, stat.type


def _check(
    proto: onnx.ModelProto,
    model: torch.nn.Module,
    args: tuple[torch.Tensor | None, ...],
    reference: _Reference,
    input_names: list[str],
    batch_dynamic: bool,
) -> None:
    """Raise a ModelError naming what the export lost: parameters, or outputs that differ."""
    shapes = {n: tuple(v.shape) for n, v in _torch_tensors(model).items()}
    initializers = {i.name: tuple(i.dims) for i in proto.graph.initializer}
    lost = sorted(n for n in reference.used if n not in initializers)
    reshaped = sorted(
        f"{n} {initializers[n]} (torch {shapes[n]})"
        for n in reference.used
        if n in initializers and initializers[n] != shapes[n]
    )
    if lost or reshaped:
        generated = sorted(set(initializers) - set(shapes))
        raise ModelError(
            f"the export lost {len(lost)} of {len(reference.used)} trainable parameters"
            f" ({_listed(lost)}), or changed their shapes ({_listed(reshaped)}); initializers"
            f" that are no torch parameter or buffer: {_listed(generated)}"
        )
    unkept = sorted(n for n in reference.moved if n not in initializers)
    if unkept:
        raise ModelError(
            f"the export lost {len(unkept)} of the {len(reference.moved)} buffers that the"
            f" train-mode forward updates ({_listed(unkept)}): training would leave them at"
            " their first values and the eval-mode model would read those; running statistics"
            " that an exporter drops (InstanceNorm's track_running_stats=True) go with"
            " track_running_stats=False on their modules"
        )
    run = _runner(proto)
    feeds = [a.detach().cpu().numpy() for a in args if a is not None]
    tolerance = reference.tolerance
    _compare(run(dict(zip(input_names, feeds))), reference.outputs, proto, "", tolerance)
    batch = {a.shape[0] for a in feeds if a.ndim}
    if batch_dynamic and len(batch) == 1:
        (size,) = batch
        doubled = {n: np.concatenate([a, a]) for n, a in zip(input_names, feeds)}
        expected = [
            np.concatenate([o, o]) if o.ndim and o.shape[0] == size else o
            for o in reference.outputs
        ]
        where = f" with the example batch repeated (batch {2 * size})"
        got = run(doubled)
        try:
            _compare(got, expected, proto, where, tolerance)
        except ModelError:
            # outputs that mix the samples (a contrastive loss's in-batch negatives) are not
            # the single batch's repeated: the module's own forward on the repeated batch is
            torch = _import_torch()
            twice = tuple(None if a is None else torch.cat([a, a]) for a in args)
            own = _reference(torch, model, twice, gradients=False).outputs
            _compare(got, own, proto, where, tolerance)


def _listed(names: Sequence[str], most: int = 12) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _runner(proto: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """An onnxruntime session over ``proto`` with Dropout off and training-mode BatchNorm
    lowered to standard ops (as the training graph computes it)."""
    import onnx_ir.passes.common as common_passes
    import onnxruntime as ort

    from traingraph.autodiff.lowering import lower_training_batch_norm
    from traingraph.ir.model import default_opset, onnxruntime_source

    # onnx's shape inference (onnx_ir's pass types sequence values as tensors) gives training
    # BatchNorm's lowering the ranks it needs.
    with contextlib.suppress(Exception):
        proto = onnx.shape_inference.infer_shapes(proto)
    m = ir.from_proto(proto)
    if m.functions:
        common_passes.InlinePass()(m)
        common_passes.RemoveUnusedFunctionsPass()(m)
    graph = m.graph
    zero = ir.Value(name="from_torch_check_dropout_ratio", const_value=ir.tensor(np.float32(0)))
    zero.shape, zero.type = ir.Shape([]), ir.TensorType(ir.DataType.FLOAT)
    dropouts = [n for n in graph if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")]
    if dropouts:
        graph.register_initializer(zero)
    for node in dropouts:
        if len(node.inputs) < 2:
            node.resize_inputs(2)
        node.replace_input_with(1, zero)
    _fixed_draws(graph)
    lower_training_batch_norm(graph, default_opset(m))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # The check runs the graph as exported: onnxruntime's graph optimizers are not needed for
    # one run, and some crash the process on exports they do not expect (the dynamo
    # exporter's nn.EmbeddingBag: a Loop over a SequenceEmpty).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        with onnxruntime_source(m) as source:
            session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's errors have no common base class
        raise ModelError(f"onnxruntime cannot load the exported model: {_first(exc)}") from None

    taken = {i.name for i in session.get_inputs()}  # an exporter drops unread inputs

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        feeds = {n: a for n, a in feeds.items() if n in taken}
        try:
            return [np.asarray(o) for o in session.run(None, feeds)]
        except Exception as exc:  # onnxruntime's errors have no common base class
            shapes = {n: a.shape for n, a in feeds.items()}
            raise ModelError(
                f"onnxruntime cannot run the exported model on inputs of shapes {shapes}:"
                f" {_first(exc)}"
            ) from None

    return run


def _fixed_draws(graph: ir.Graph) -> None:
    """Each random op of ``graph`` as the check's fixed draw (:func:`_fixed_draw`)."""
    for node in [n for n in graph if n.op_type in DRAWS and n.domain in ("", "ai.onnx")]:
        attrs = node.attributes
        if node.op_type.startswith("RandomNormal"):
            mean: float | None = attrs.get_float("mean", 0.0)
        elif node.op_type.startswith("RandomUniform"):
            mean = attrs.get_float("low", 0.0)
        else:
            mean = None
        source = node.inputs[0] if node.inputs else None
        dtype = ir.DataType(attrs.get_int("dtype", 0)) if "dtype" in attrs else None
        if dtype is None:
            dtype = source.dtype if source is not None and source.dtype else ir.DataType.FLOAT
        if mean is None:  # Bernoulli: 1 where its probability is above 0
            assert source is not None
            kind = source.dtype.numpy() if source.dtype else np.float32
            zero = ir.tensor(np.zeros((), dtype=kind))
            nought = ir.node("Constant", [], {"value": zero})
            above = ir.node("Greater", [source, nought.outputs[0]])
            replacement = [nought, above, ir.node("Cast", [above.outputs[0]], {"to": dtype})]
        elif source is None:
            shape = attrs.get_ints("shape", ())
            value = ir.tensor(np.full(shape, mean, dtype=dtype.numpy()))
            replacement = [ir.node("Constant", [], {"value": value})]
        else:
            shape_of = ir.node("Shape", [source])
            fill = ir.tensor(np.full([1], mean, dtype=dtype.numpy()))
            filled = ir.node("ConstantOfShape", [shape_of.outputs[0]], {"value": fill})
            replacement = [shape_of, filled]
        graph.insert_before(node, replacement)
        ir.convenience.replace_all_uses_with(node.outputs[0], replacement[-1].outputs[0])
        if node.outputs[0].is_graph_output():
            graph.outputs[graph.outputs.index(node.outputs[0])] = replacement[-1].outputs[0]
            replacement[-1].outputs[0].name = node.outputs[0].name
        graph.remove(node, safe=True)


def _compare(
    got: list[np.ndarray],
    expected: list[np.ndarray],
    proto: onnx.ModelProto,
    where: str,
    tolerance: tuple[float, float] = (RTOL, ATOL),
) -> None:
    names = [o.name for o in proto.graph.output]
    if len(got) != len(expected):
        raise ModelError(
            f"the exported model has {len(got)} outputs ({names}), the module's forward"
            f" {len(expected)}"
        )
    wrong = []
    for name, g, e in zip(names, got, expected):
        if g.shape != e.shape:
            wrong.append(f"{name}: shape {g.shape}, torch {e.shape}")
            continue
        if e.size == 0:
            continue
        if not np.issubdtype(e.dtype, np.floating):
            if not np.array_equal(g, e):
                wrong.append(f"{name}: {int(np.sum(g != e))} of {e.size} values differ")
            continue
        diff = float(np.nanmax(np.abs(g.astype(np.float64) - e))) if e.size else 0.0
        scale = float(np.nanmax(np.abs(e))) if np.isfinite(e).any() else 0.0
        nan_mismatch = bool(np.any(np.isnan(g) != np.isnan(e)))
        rtol, atol = tolerance
        if nan_mismatch or diff > atol + rtol * scale:
            wrong.append(f"{name}: max abs difference {diff:.3g} (largest |value| {scale:.3g})")
    if wrong:
        raise ModelError(
            f"the exported forward differs from the module's train-mode forward{where}:"
            f" {'; '.join(wrong)} (allowed: {tolerance[1]:g} + {tolerance[0]:g} * largest"
            " |value|; where that is float32 rounding of an ill-conditioned forward, pass"
            " larger rtol= / atol=)"
        )
