"""Checkpoints: the data they hold and the file formats that store it.

Two formats, chosen on save and detected from the file's bytes on load:

- ``"native"``: one safetensors file with JSON metadata and a SHA-256 checksum
  (:mod:`traingraph.checkpoint.native`);
- ``"ort"``: onnxruntime-training 1.19's flatbuffers checkpoint, readable by
  ``onnxruntime.training.api.CheckpointState.load_checkpoint``
  (:mod:`traingraph.checkpoint.ort_format`).

Example:
    >>> import numpy as np
    >>> data = CheckpointData(
    ...     parameters={"w": np.ones((2, 2), np.float32)},
    ...     requires_grad={"w": True},
    ...     optimizer_state={},
    ...     properties={"epoch": 3},
    ... )
    >>> save_checkpoint_data(data, "model.ckpt")  # doctest: +SKIP
    >>> load_checkpoint_data("model.ckpt").properties  # doctest: +SKIP
    {'epoch': 3}
"""

from __future__ import annotations

import os
from pathlib import Path

from traingraph.checkpoint import native, ort_format
from traingraph.checkpoint.state import CheckpointData, PropertyTypeError, validate_property
from traingraph.errors import CheckpointError, ModelError

__all__ = [
    "FORMATS",
    "CheckpointData",
    "PropertyTypeError",
    "detect_format",
    "load_checkpoint_data",
    "save_checkpoint_data",
    "validate_property",
]

FORMATS = ("native", "ort")
_SAVERS = {"native": native.save, "ort": ort_format.save}
_LOADERS = {"native": native.load, "ort": ort_format.load}
_SNIFF_BYTES = 9


def save_checkpoint_data(
    data: CheckpointData,
    path: str | os.PathLike[str],
    *,
    format: str = "native",
    include_optimizer_state: bool = True,
) -> None:
    """Writes a checkpoint file atomically: ``path`` never holds a partial file.

    Args:
        data: The checkpoint content.
        path: Destination file.
        format: ``"native"`` (traingraph's safetensors file) or ``"ort"`` (onnxruntime-training's).
        include_optimizer_state: If False, the optimizer state, step and learning rate are left out.

    Raises:
        ModelError: ``format`` is unknown, or ``data`` is inconsistent or does not fit the format.
        PropertyTypeError: A property is not an int, float or str.
        CheckpointError: The destination directory does not exist.
    """
    saver = _SAVERS.get(format)
    if saver is None:
        raise ModelError(
            f"unknown checkpoint format {format!r}; expected one of {', '.join(FORMATS)}."
        )
    saver(data, path, include_optimizer_state=include_optimizer_state)


def detect_format(path: str | os.PathLike[str]) -> str:
    """Tells a checkpoint file's format from its first bytes.

    Returns:
        ``"ort"`` for an onnxruntime-training checkpoint (file identifier ``ODTC`` at byte 4),
        ``"native"`` for a safetensors file (an 8-byte header length followed by ``{``).

    Raises:
        CheckpointError: The file is missing, too short to be a checkpoint, or neither format.
    """
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"cannot load checkpoint {str(file)!r}: the file does not exist.")
    with open(file, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if head[4:8] == ort_format.FILE_IDENTIFIER:
        return "ort"
    if head[8:9] == b"{":
        return "native"
    if len(head) < _SNIFF_BYTES:
        raise CheckpointError(
            f"cannot load checkpoint {str(file)!r}: the file has {len(head)} bytes, too few for"
            " a checkpoint of either format. Pass a checkpoint file; if this one was a"
            " checkpoint, it is truncated: restore it from a backup or write it again."
        )
    raise CheckpointError(
        f"cannot load checkpoint {str(file)!r}: it is not a checkpoint (neither a traingraph"
        " safetensors checkpoint nor an onnxruntime-training 'ODTC' checkpoint). Pass a file"
        " written by traingraph.save_checkpoint_data or onnxruntime-training's"
        " CheckpointState.save_checkpoint."
    )


def load_checkpoint_data(path: str | os.PathLike[str]) -> CheckpointData:
    """Reads a checkpoint file of either format (detected from its bytes).

    Raises:
        CheckpointError: The file is missing, truncated, corrupt, not a checkpoint or of an
            unknown version; the message names the file and what to do.
    """
    return _LOADERS[detect_format(path)](path)
