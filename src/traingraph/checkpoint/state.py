"""The checkpoint data model and the file handling that its formats share.

A checkpoint holds a model's parameters, which of them train, the optimizer's per-parameter state
(slots such as ``exp_avg``), its step and learning rate, and a bag of user properties. Formats
(``native``, ``ort``) turn a :class:`CheckpointData` into bytes and back; nothing here knows about
any one format.
"""

from __future__ import annotations

import glob
import os
import re
import stat
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from traingraph.errors import CheckpointError, ModelError

__all__ = [
    "CheckpointData",
    "PropertyTypeError",
    "PropertyValue",
    "atomic_write",
    "check_checkpoint_data",
    "check_matches_model",
    "validate_property",
]

PropertyValue = int | float | str


_TMP_SUFFIX = ".tmp"


class PropertyTypeError(ModelError, TypeError):
    """A checkpoint property has a name or value of a type that checkpoints cannot store."""


@dataclass
class CheckpointData:
    """Everything a checkpoint file holds, independent of the file format.

    Attributes:
        parameters: Parameter arrays by name, in the model's order. In a nominal checkpoint they are
            zero-filled placeholders with the right shape and dtype (or, read from an
            onnxruntime-training nominal checkpoint, which records no shapes, 0-d zeros of the
            right dtype).
        requires_grad: For each parameter, whether it is trained (True) or frozen (False).
        optimizer_state: Parameter name -> slot name -> array, for example
            ``{"fc.weight": {"exp_avg": m, "exp_avg_sq": v}}``.
        optimizer_step: Number of optimizer steps taken.
        learning_rate: The optimizer's learning rate, or None if unknown.
        properties: User properties; values are int, float or str and keep their type.
        nominal: True if the parameter values carry no data (only names, shapes and dtypes).
    """

    parameters: dict[str, np.ndarray]
    requires_grad: dict[str, bool]
    optimizer_state: dict[str, dict[str, np.ndarray]]
    optimizer_step: int = 0
    learning_rate: float | None = None
    properties: dict[str, PropertyValue] = field(default_factory=dict)
    nominal: bool = False


def validate_property(name: object, value: object) -> PropertyValue:
    """Checks a property before it is stored and returns its value as a Python int, float or str.

    NumPy integer and floating scalars are accepted and returned as int and float. ``bool`` is
    refused: it would come back as an int.

    Args:
        name: The property name; must be a str.
        value: The property value.

    Returns:
        The value as ``int``, ``float`` or ``str``.

    Raises:
        PropertyTypeError: The name is not a str or the value is not an int, float or str.
    """
    if not isinstance(name, str):
        raise PropertyTypeError(
            f"checkpoint property name {name!r} has type {type(name).__name__}; expected a str."
        )
    if isinstance(value, (bool, np.bool_)):
        raise PropertyTypeError(
            f"checkpoint property {name!r} has a bool value ({value!r}); checkpoints store int,"
            " float and str properties. Store it as int(value) or str(value)."
        )
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    raise PropertyTypeError(
        f"checkpoint property {name!r} has a value of type {type(value).__name__} ({value!r});"
        " expected int, float or str. Convert it (for example to str) before storing it."
    )


def check_checkpoint_data(data: CheckpointData) -> None:
    """Checks that ``data`` is consistent before it is written.

    Raises:
        ModelError: A parameter has no ``requires_grad`` entry (or the other way round), an
            optimizer state names an unknown parameter, a value is not a NumPy array, or the
            optimizer step is negative.
        PropertyTypeError: A property has an unsupported type.
    """
    missing = [name for name in data.parameters if name not in data.requires_grad]
    extra = [name for name in data.requires_grad if name not in data.parameters]
    if missing or extra:
        raise ModelError(
            "checkpoint requires_grad must have one entry per parameter; missing for"
            f" {missing}, given for unknown parameters {extra}. Set requires_grad[name] to True"
            " (trained) or False (frozen) for every parameter."
        )
    for name, array in data.parameters.items():
        _check_array(f"parameter {name!r}", array)
    for name, slots in data.optimizer_state.items():
        if name not in data.parameters:
            raise ModelError(
                f"checkpoint optimizer state is given for {name!r}, which is not a parameter;"
                f" parameters are {list(data.parameters)}."
            )
        for slot, array in slots.items():
            _check_array(f"optimizer state {slot!r} of parameter {name!r}", array)
    for name, value in data.properties.items():
        validate_property(name, value)
    step = data.optimizer_step
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ModelError(
            f"checkpoint optimizer_step is {step!r}; expected an integer >= 0 (the number of"
            " optimizer steps taken)."
        )


def check_matches_model(
    data: CheckpointData, inputs: Sequence[onnx.ValueInfoProto], model: str, checkpoint: str
) -> None:
    """Checks that the checkpoint's parameters fit the model's inputs of the same names.

    Shapes are compared dimension by dimension where the model's are static; a nominal
    checkpoint's shapes are not compared (onnxruntime-training's record none).

    Args:
        data: The checkpoint content.
        inputs: The model's graph inputs.
        model: The model file, for the message.
        checkpoint: The checkpoint, for the message.

    Raises:
        CheckpointError: Some parameters differ in dtype or shape; every mismatch is listed.
    """
    mismatches = []
    for value in inputs:
        array = data.parameters.get(value.name)
        if array is None or not value.type.HasField("tensor_type"):
            continue
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type in onnx.helper.get_all_tensor_dtypes():
            expected = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            if expected != array.dtype.newbyteorder("="):
                mismatches.append(f"{value.name!r} is {array.dtype}, the model takes {expected}")
                continue
        if data.nominal or not tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if len(dims) != array.ndim or any(
            d is not None and d != n for d, n in zip(dims, array.shape, strict=False)
        ):
            shape = ["?" if d is None else d for d in dims]
            mismatches.append(
                f"{value.name!r} has shape {list(array.shape)}, the model takes {shape}"
            )
    if mismatches:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not fit model {model!r}: {len(mismatches)}"
            f" parameter(s) differ: {'; '.join(mismatches[:10])}"
            f"{'; ...' if len(mismatches) > 10 else ''}. Load the checkpoint that"
            " generate_artifacts wrote with this model, or generate the artifacts again"
        )


def _check_array(what: str, array: object) -> None:
    if not isinstance(array, np.ndarray):
        raise ModelError(
            f"checkpoint {what} is a {type(array).__name__}; expected a numpy.ndarray"
            " (convert it with numpy.asarray)."
        )


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], object]) -> None:
    """Writes a file so that ``path`` holds either its old content or the complete new one.

    ``write`` writes the new content to a temporary file in the same directory; the temporary
    file is flushed to disk, renamed over ``path`` (an atomic replace), and the directory entry is
    flushed too. If anything fails, the temporary file is removed and ``path`` is untouched.

    Args:
        path: The file to write.
        write: Called with the temporary file's path; writes the complete content there.

    Raises:
        CheckpointError: The directory of ``path`` does not exist.
    """
    target = Path(path)
    directory = target.parent
    if not directory.is_dir():
        raise CheckpointError(
            f"cannot write checkpoint {str(target)!r}: directory {str(directory)!r} does not exist."
            " Create it first."
        )
    _remove_stale_temporaries(target)
    tmp = directory / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
    # Created with mode 0o666 so that the umask decides the final permissions, as for open();
    # the mode is set again after ``write``, in case it replaced the file.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    mode = stat.S_IMODE(os.stat(tmp).st_mode)
    try:
        write(str(tmp))
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)


def _remove_stale_temporaries(target: Path) -> None:
    """Removes the temporary files of saves of ``target`` whose process no longer runs.

    A save killed before its rename leaves ``.<name>.<pid>.<hex>.tmp`` behind; the next save
    removes it. Temporaries of processes still running (saving at the same time) are kept.
    """
    pattern = re.compile(
        re.escape(f".{target.name}.") + r"(?:(\d+)\.)?[0-9a-f]{32}" + re.escape(_TMP_SUFFIX)
    )
    for entry in target.parent.glob(f".{glob.escape(target.name)}.*{_TMP_SUFFIX}"):
        match = pattern.fullmatch(entry.name)
        if match and (match.group(1) is None or not _process_runs(int(match.group(1)))):
            entry.unlink(missing_ok=True)


def _process_runs(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # the process exists but belongs to another user
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    """Flushes a directory entry to disk where the platform allows it (POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
