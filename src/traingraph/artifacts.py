"""Training artifacts on disk, with the interface of ``onnxruntime.training.artifacts``.

Example:
    >>> from traingraph import artifacts
    >>> artifacts.generate_artifacts(
    ...     "mlp.onnx",
    ...     requires_grad=["fc1.weight", "fc1.bias"],
    ...     loss=artifacts.LossType.CrossEntropyLoss,
    ...     optimizer=artifacts.OptimType.AdamW,
    ...     artifact_directory="artifacts",
    ... )

It writes ``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx`` and
``checkpoint``: plain ONNX (default-domain ops only) that current onnxruntime runs. A
``torch.nn.Module`` with ``example_inputs=`` goes through :func:`traingraph.from_torch` first.
"""

from __future__ import annotations

import enum
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from traingraph import losses, optim
from traingraph.checkpoint import CheckpointData, save_checkpoint_data
from traingraph.errors import ModelError, reports_load_errors
from traingraph.ir.export_checks import export_warnings, recorded_requires_grad
from traingraph.ir.model import ModelLike, save
from traingraph.onnxblock.artifact_blocks import block_arguments
from traingraph.onnxblock.blocks import Block
from traingraph.program import MODEL_FIX, TrainingProgram, build_program

__all__ = ["LossType", "OptimType", "generate_artifacts"]


class LossType(enum.Enum):
    """Built-in losses, by the names ``onnxruntime.training.artifacts.LossType`` uses."""

    MSELoss = "MSELoss"
    CrossEntropyLoss = "CrossEntropyLoss"
    BCEWithLogitsLoss = "BCEWithLogitsLoss"
    L1Loss = "L1Loss"
    HuberLoss = "HuberLoss"
    SmoothL1Loss = "SmoothL1Loss"
    NLLLoss = "NLLLoss"


class OptimType(enum.Enum):
    """Built-in optimizers with their default hyperparameters (set the learning rate at run time
    with ``Optimizer.set_learning_rate``; pass a ``traingraph.optim`` optimizer for other
    values)."""

    AdamW = "AdamW"
    SGD = "SGD"
    Adam = "Adam"
    RMSProp = "RMSProp"
    Adagrad = "Adagrad"


def _resolve(
    value: Any, kind: type, members: type[enum.Enum], built_ins: ModuleType, what: str
) -> Any:
    """``value`` as an instance of ``kind``: given as one, or as a ``members`` enum member or
    that member's name, which builds ``built_ins.<name>()`` with its defaults; None stays
    None."""
    if value is None or isinstance(value, kind):
        return value
    if isinstance(value, str) and value in members.__members__:
        value = members[value]
    if isinstance(value, members):
        return getattr(built_ins, value.value)()
    raise ModelError(
        f"{what} must be a {members.__name__} member, a {kind.__module__}.{kind.__name__} or"
        f" None, got {value!r}. Built-in: {', '.join(members.__members__)}"
    )


def _is_torch_module(model: object) -> bool:
    """Whether ``model`` is a ``torch.nn.Module`` (never imports torch: a module exists only
    where torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def _header(model: ModelLike) -> onnx.ModelProto | None:
    """``model`` as a ModelProto whose initializers may lack their external data; None for
    what is no readable model (build_program then says so)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_file():
            return None
        try:
            return onnx.load(os.fspath(model), load_external_data=False)
        except Exception:  # build_program reports an unreadable file
            return None
    return ir.to_proto(model) if isinstance(model, ir.Model) else None


def _to_ort_format(paths: Sequence[Path], custom_op_library: str | os.PathLike | None) -> None:
    """Write ``<model>.ort`` beside each model with onnxruntime's converter."""
    try:
        from onnxruntime.tools.convert_onnx_models_to_ort import (
            OptimizationStyle,
            convert_onnx_models_to_ort,
        )
    except ImportError as error:
        raise ModelError(
            f"ort_format=True needs onnxruntime.tools.convert_onnx_models_to_ort, which the"
            f" installed onnxruntime lacks ({error}); install the full onnxruntime package or"
            " drop ort_format"
        ) from None
    library = Path(custom_op_library) if custom_op_library is not None else None
    for path in paths:
        convert_onnx_models_to_ort(
            path,
            output_dir=path.parent,
            optimization_styles=[OptimizationStyle.Fixed],
            custom_op_library_path=library,
        )


@reports_load_errors("model", "model", MODEL_FIX)
def generate_artifacts(
    model: ModelLike | Any,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | losses.Loss | Block | None = None,
    optimizer: OptimType | optim.Optimizer | Block | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: Sequence[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Sequence[str] | None = None,
    *,
    checkpoint_format: str = "native",
    mixed_precision: str | None = None,
    example_inputs: Any = None,
) -> TrainingProgram:
    """Generate the training, eval and optimizer models and the checkpoint.

    Args:
        model: The inference model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; or
            a ``torch.nn.Module``, exported with :func:`traingraph.from_torch` on
            ``example_inputs``.
        requires_grad: Initializers to train (default: the trainable parameters that
            :func:`traingraph.from_torch` recorded in the model; for other models every float
            initializer that is not frozen and not a BatchNorm running statistic).
        frozen_params: Initializers kept in the checkpoint but not trained.
        loss: A :class:`LossType`, a :class:`traingraph.losses.Loss` (including a custom one
            over several outputs), an onnxblock block that returns the loss's name (see
            :mod:`traingraph.onnxblock`), or None when the model's first output is the loss.
        optimizer: An :class:`OptimType`, a :class:`traingraph.optim.Optimizer` or an
            :mod:`traingraph.onnxblock.optim` optimizer; None writes no optimizer model.
        artifact_directory: Where to write (default: the current directory).
        prefix: Prefix of every file name.
        ort_format: Also write each model in onnxruntime's ORT format (``.ort`` beside the
            ``.onnx``), converted by onnxruntime's own ``convert_onnx_models_to_ort``, for
            onnxruntime's minimal builds.
        custom_op_library: Path of the shared library of the custom ops the model uses,
            for the ORT-format conversion. Custom ops must lie off the gradient path (traingraph
            differentiates default-domain ops); to run the models, register the library in an
            ``onnxruntime.SessionOptions`` passed to :class:`traingraph.api.Module`.
        additional_output_names: Extra outputs returned by the train and eval models.
        nominal_checkpoint: Also write ``{prefix}nominal_checkpoint``: shapes and dtypes only,
            for shipping to a device that receives the weights later.
        loss_input_names: Model outputs fed to the loss (default: all outputs).
        checkpoint_format: "native" (safetensors) or "ort" (onnxruntime-training's format).
        mixed_precision: "fp16" or "bf16": MatMul/Gemm/Conv compute in that type with float32
            parameters, and the training model takes a ``loss_scale`` input and returns a
            ``grads_finite`` flag, which :class:`traingraph.api.Module` drives with a dynamic
            loss scaler (see :mod:`traingraph.precision`). None: float32 throughout.
        example_inputs: For a ``torch.nn.Module`` ``model``: a tensor, a tuple of tensors or a
            dict of tensors by keyword to export it with (see :func:`traingraph.from_torch`,
            whose defaults apply).

    Returns:
        The :class:`~traingraph.program.TrainingProgram` that was written.
    """
    if custom_op_library is not None and not Path(custom_op_library).is_file():
        raise ModelError(
            f"custom_op_library {os.fspath(custom_op_library)!r} does not exist; pass the path"
            " of the custom ops' shared library"
        )
    if _is_torch_module(model):
        if example_inputs is None:
            raise ModelError(
                f"model is a torch.nn.Module ({type(model).__name__}) and example_inputs is"
                " None; pass example_inputs= (a tensor, a tuple of tensors or a dict of tensors the"
                " module takes)"
            )
        from traingraph.torch_export import from_torch

        model = from_torch(model, example_inputs)  # type: ignore[arg-type]
    elif example_inputs is not None:
        raise ModelError(
            f"example_inputs is for a torch.nn.Module model, got a {type(model).__name__};"
            " drop example_inputs"
        )
    if isinstance(model, onnx.ModelProto) and not model.graph.node:
        raise ModelError("the model has no nodes; pass the inference model to train")
    header = _header(model)
    if header is not None:
        if requires_grad is None:
            recorded = recorded_requires_grad(header)
            if recorded is not None:
                frozen = set(frozen_params or ())
                requires_grad = [n for n in recorded if n not in frozen]
        for message in export_warnings(header, requires_grad, frozen_params or ()):
            warnings.warn(message, UserWarning, stacklevel=2)
    model, loss, optimizer, loss_input_names = block_arguments(
        model, loss, optimizer, loss_input_names
    )
    program = build_program(
        model,
        requires_grad=requires_grad,
        frozen_params=frozen_params,
        loss=_resolve(loss, losses.Loss, LossType, losses, "loss"),
        optimizer=_resolve(optimizer, optim.Optimizer, OptimType, optim, "optimizer"),
        additional_output_names=additional_output_names,
        loss_input_names=loss_input_names,
        mixed_precision=mixed_precision,
    )
    directory = Path(artifact_directory) if artifact_directory is not None else Path.cwd()
    directory.mkdir(parents=True, exist_ok=True)
    save(program.train_model, directory / f"{prefix}training_model.onnx")
    save(program.eval_model, directory / f"{prefix}eval_model.onnx")
    if program.optimizer_model is not None:
        save(program.optimizer_model, directory / f"{prefix}optimizer_model.onnx")
    if ort_format:
        names = ["training", "eval"] + (["optimizer"] if program.optimizer_model else [])
        _to_ort_format([directory / f"{prefix}{n}_model.onnx" for n in names], custom_op_library)
    data = CheckpointData(
        parameters=dict(program.parameters),
        requires_grad=dict(program.requires_grad),
        optimizer_state={},
    )
    save_checkpoint_data(data, directory / f"{prefix}checkpoint", format=checkpoint_format)
    if nominal_checkpoint:
        nominal = CheckpointData(
            parameters={
                n: np.broadcast_to(np.zeros((), a.dtype), a.shape)
                for n, a in program.parameters.items()
            },
            requires_grad=dict(program.requires_grad),
            optimizer_state={},
            nominal=True,
        )
        save_checkpoint_data(
            nominal, directory / f"{prefix}nominal_checkpoint", format=checkpoint_format
        )
    return program
