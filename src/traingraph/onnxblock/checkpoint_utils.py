"""Checkpoints of the parameters that :meth:`TrainingBlock.parameters
<traingraph.onnxblock.TrainingBlock.parameters>` returns, in traingraph's checkpoint format
(which :class:`traingraph.api.CheckpointState` loads)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from traingraph.checkpoint import CheckpointData, load_checkpoint_data, save_checkpoint_data
from traingraph.errors import CheckpointError

__all__ = ["load_checkpoint_to_model", "save_checkpoint"]


def save_checkpoint(
    parameters: tuple[Sequence[onnx.TensorProto], Sequence[onnx.TensorProto]],
    path_to_checkpoint: str | os.PathLike,
    nominal_checkpoint: bool = False,
) -> None:
    """Save the trainable and frozen parameters ``(trainable, frozen)`` to a checkpoint file.

    Args:
        parameters: The initializers to save, as ``TrainingBlock.parameters()`` returns them.
        path_to_checkpoint: The checkpoint file to write.
        nominal_checkpoint: Save names, shapes and dtypes only (zeros), for a device that
            receives the weights later.
    """
    if parameters is None:
        raise RuntimeError(
            "no parameters to save; pass (trainable, frozen) as TrainingBlock.parameters()"
            " returns them"
        )
    trainable, frozen = parameters
    arrays = {t.name: numpy_helper.to_array(t) for t in [*trainable, *frozen]}
    if nominal_checkpoint:
        arrays = {n: np.broadcast_to(np.zeros((), a.dtype), a.shape) for n, a in arrays.items()}
    save_checkpoint_data(
        CheckpointData(
            parameters=arrays,
            requires_grad={t.name: t in trainable for t in [*trainable, *frozen]},
            optimizer_state={},
            nominal=nominal_checkpoint,
        ),
        path_to_checkpoint,
    )


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike, model: onnx.ModelProto) -> None:
    """Replace the values of ``model``'s initializers by those of the checkpoint's parameters of
    the same names (in place).

    Raises:
        CheckpointError: The checkpoint is nominal (it holds no values).
    """
    data = load_checkpoint_data(path_to_checkpoint)
    if data.nominal:
        raise CheckpointError(
            f"{os.fspath(path_to_checkpoint)!r} is a nominal checkpoint: it holds no parameter"
            " values to load. Load a complete checkpoint."
        )
    for initializer in model.graph.initializer:
        if initializer.name in data.parameters:
            value = np.ascontiguousarray(data.parameters[initializer.name])
            initializer.CopyFrom(numpy_helper.from_array(value, initializer.name))
