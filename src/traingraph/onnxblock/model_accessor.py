"""The model that blocks edit: set by the :func:`base` and :func:`empty_base` contexts.

Example:
    >>> with onnxblock.base(model) as accessor:
    ...     loss_name = my_block("output-0")
    ...     edited = accessor.model
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager

import onnx

from traingraph.ir.model import max_ir_version
from traingraph.onnxblock.graph_utils import newest_opset

__all__ = ["ModelAccessor", "base", "custom_op_library", "empty_base"]


class ModelAccessor:
    """Holds the model that blocks edit.

    Attributes:
        model: The ``onnx.ModelProto`` being built (a copy of the base model).
    """

    def __init__(self, model: onnx.ModelProto, model_path: str | os.PathLike | None = None) -> None:
        self._model = model
        self._path = None if model_path is None else os.fspath(model_path)

    @property
    def model(self) -> onnx.ModelProto:
        return self._model

    @property
    def path(self) -> str:
        """The path of the base model's file.

        Raises:
            RuntimeError: The base model was given without a path.
        """
        if self._path is None:
            raise RuntimeError(
                "the base model has no path: it was given as an onnx.ModelProto without"
                " model_path. Pass onnxblock.base(model, model_path) or the model's path."
            )
        return self._path

    @property
    def has_path(self) -> bool:
        """Whether the base model was given with the path of its file."""
        return self._path is not None


_GLOBAL_ACCESSOR: ModelAccessor | None = None
_GLOBAL_CUSTOM_OP_LIBRARY: str | None = None


def current() -> ModelAccessor:
    """The accessor of the innermost :func:`base` / :func:`empty_base` context."""
    if _GLOBAL_ACCESSOR is None:
        raise RuntimeError(
            "no base model is set: a block was called outside a model context. Call blocks"
            " inside `with onnxblock.base(model):` (or `with onnxblock.empty_base():` to build"
            " a model from scratch)."
        )
    return _GLOBAL_ACCESSOR


@contextmanager
def _registered(
    model: onnx.ModelProto, model_path: str | os.PathLike | None = None
) -> Iterator[ModelAccessor]:
    global _GLOBAL_ACCESSOR
    if _GLOBAL_ACCESSOR is not None:
        raise RuntimeError(
            "a base model is already set: onnxblock.base / empty_base contexts do not nest."
            " Finish the outer context first."
        )
    _GLOBAL_ACCESSOR = ModelAccessor(model, model_path)
    try:
        yield _GLOBAL_ACCESSOR
    finally:
        _GLOBAL_ACCESSOR = None


@contextmanager
def base(
    model: onnx.ModelProto | str | os.PathLike, model_path: str | os.PathLike | None = None
) -> Iterator[ModelAccessor]:
    """Let blocks edit a copy of ``model`` (the given model is left as it is).

    Args:
        model: The base model, e.g. an exported inference model, or the path of one.
        model_path: The path of the file ``model`` was loaded from, for a model whose weights
            stay in external data files (``onnx.load(path, load_external_data=False)``): the
            copy that blocks edit reads them from beside that file. None: ``model`` holds its
            weights (or is itself a path).

    Yields:
        The :class:`ModelAccessor` whose ``model`` holds the edited copy.
    """
    if model is None:
        raise RuntimeError(
            "the base model is None; pass an onnx.ModelProto, or use onnxblock.empty_base() to"
            " build a model from scratch"
        )
    if isinstance(model, (str, os.PathLike)):
        model_path = model if model_path is None else model_path
        model = onnx.load(os.fspath(model))
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(
            f"onnxblock.base takes an onnx.ModelProto or a model path, got {type(model).__name__}"
        )
    edited = copy.deepcopy(model)
    if model_path is not None:
        if not os.path.isfile(model_path):
            raise FileNotFoundError(
                f"model_path {os.fspath(model_path)!r} does not exist; pass the path of the"
                " file the base model was loaded from, or None"
            )
        onnx.load_external_data_for_model(edited, os.path.dirname(os.path.abspath(model_path)))
    with _registered(edited, model_path) as accessor:
        yield accessor


@contextmanager
def empty_base(opset_version: int | None = None) -> Iterator[ModelAccessor]:
    """Let blocks build a model from scratch.

    Args:
        opset_version: The default-domain opset of the model (default: the newest that both onnx
            and the installed onnxruntime support).

    Yields:
        The :class:`ModelAccessor` whose ``model`` holds the model being built.
    """
    model = onnx.ModelProto()
    model.ir_version = max_ir_version()
    model.producer_name = "traingraph.onnxblock"
    model.graph.name = "graph"
    model.opset_import.append(onnx.helper.make_opsetid("", opset_version or newest_opset()))
    with _registered(model) as accessor:
        yield accessor


@contextmanager
def custom_op_library(custom_op_library_path: str | os.PathLike) -> Iterator[None]:
    """Name the shared library of the custom ops that the models built in this context use.

    traingraph's gradient builder does not load the library: it differentiates only through
    default-domain ops, and custom ops must lie off the gradient path (an op without a gradient
    rule on it raises, naming the op). The path is kept for the onnxruntime sessions that run
    the models: pass it to ``onnxruntime.SessionOptions.register_custom_ops_library`` and the
    options to :class:`traingraph.api.Module` (``session_options=``).
    """
    global _GLOBAL_CUSTOM_OP_LIBRARY
    path = os.fspath(custom_op_library_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"custom op library {path!r} does not exist; pass the .so/.dll path"
        )
    previous, _GLOBAL_CUSTOM_OP_LIBRARY = _GLOBAL_CUSTOM_OP_LIBRARY, path
    try:
        yield
    finally:
        _GLOBAL_CUSTOM_OP_LIBRARY = previous
