"""Exceptions raised by traingraph.

Every error says what was received, what was expected and how to fix it.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


class TraingraphError(Exception):
    """Base class of every error that traingraph raises on purpose."""


class GradientNotImplementedError(TraingraphError, NotImplementedError):
    """A node on the gradient path has no gradient rule, or one of its attributes is unsupported."""

    def __init__(
        self,
        op_type: str,
        node_name: str,
        opset: int,
        reason: str = "",
        supported: tuple[str, ...] = (),
        domain: str = "",
    ) -> None:
        self.op_type = op_type
        self.node_name = node_name
        self.opset = opset
        self.domain = domain
        qualified = f"{domain}::{op_type}" if domain else op_type
        what = reason or f"no gradient rule is registered for op {qualified!r}"
        lines = [
            f"cannot differentiate node {node_name!r} (op {qualified}, opset {opset}): {what}.",
            "To fix: put traingraph's stop_gradients on the tensors that feed this node if they"
            " need no gradient, register a rule with traingraph.autodiff.register_gradient"
            f"({op_type!r}), or re-export the model so that it uses supported ops.",
        ]
        if supported:
            lines.append(f"Supported ops ({len(supported)}): {', '.join(sorted(supported))}.")
        super().__init__("\n".join(lines))


class ModelError(TraingraphError, ValueError):
    """A model, tensor name or argument does not fit what traingraph expects."""


class CheckpointError(TraingraphError):
    """A checkpoint file is missing, corrupt or does not match the model."""


class DeviceError(TraingraphError, RuntimeError):
    """A requested device or execution provider is not available."""


class SizeLimitError(ModelError):
    """A model, checkpoint or data file declares a tensor larger than traingraph's size limit."""


class DataError(ModelError):
    """A data file or batch does not fit what the model expects."""


class NonFiniteLossError(TraingraphError, FloatingPointError):
    """A training step computed a loss that is NaN or infinite."""


class UsageError(TraingraphError, RuntimeError):
    """An API object is used in an order or from several threads in a way it does not support."""


class ArgumentTypeError(TraingraphError, TypeError):
    """An argument has a type that traingraph does not accept."""


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


_ARTIFACTS_FIX = (
    "Check that the file is a complete ONNX model that traingraph.artifacts.generate_artifacts"
    " wrote for this checkpoint, and generate the artifacts again if it is not"
)


def _describe(value: object) -> str:
    """A path as its quoted string; any other object by its type, never its (long) text."""
    if isinstance(value, (str, os.PathLike)):
        return repr(os.fspath(value))
    return f"(a {type(value).__name__})"


def reports_load_errors(
    path_argument: str, what: str, fix: str = _ARTIFACTS_FIX
) -> Callable[[_F], _F]:
    """Decorates a function that loads files so that whatever goes wrong is a TraingraphError.

    A file that onnx, protobuf or onnxruntime cannot read (DecodeError, InvalidArgument, Fail,
    InvalidGraph, UnicodeDecodeError, ...) or that makes a later step fail becomes a
    :class:`ModelError` naming the file and the original error (chained as its cause); running
    out of memory becomes a :class:`SizeLimitError`. traingraph's own errors pass unchanged.

    Args:
        path_argument: The decorated function's parameter that holds the file's path.
        what: What the file is, for the message (e.g. ``"training model"``).
        fix: What the user can do, the message's last sentence.
    """

    def decorate(function: _F) -> _F:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except TraingraphError:
                raise
            except MemoryError as exc:
                path = signature.bind_partial(*args, **kwargs).arguments.get(path_argument)
                raise SizeLimitError(
                    f"{what} {_describe(path)} needs more memory than this machine has"
                    f" ({_first_line(exc)}); check that the file is not corrupt, or use a"
                    " machine with more memory"
                ) from exc
            except Exception as exc:
                path = signature.bind_partial(*args, **kwargs).arguments.get(path_argument)
                raise ModelError(
                    f"cannot load {what} {_describe(path)}: {_first_line(exc)}. {fix}"
                ) from exc

        return wrapper  # type: ignore[return-value]

    return decorate
