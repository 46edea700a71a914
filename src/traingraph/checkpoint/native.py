"""traingraph's own checkpoint format: one safetensors file, no pickle.

Layout of the file:

- tensor ``param/<name>`` for each parameter (none in a nominal checkpoint, whose shapes and dtypes
  are in the metadata instead);
- tensor ``optim/<param>/<slot>`` for each optimizer slot;
- metadata entry ``traingraph``: a JSON object with the format name and version, the parameter
  order, ``requires_grad``, the optimizer slots, step and learning rate, the typed property bag,
  the nominal flag and a SHA-256 checksum (see :func:`checksum`). Version 2 files checksum the
  metadata and the tensor payload; version 1 files, still read, only the payload.

Declared sizes (tensor shapes, nominal parameter specs) are checked against
:func:`traingraph.limits.max_tensor_elements` before anything is allocated.

Files are written atomically (see :func:`traingraph.checkpoint.state.atomic_write`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from traingraph.checkpoint.state import (
    CheckpointData,
    atomic_write,
    check_checkpoint_data,
    validate_property,
)
from traingraph.errors import CheckpointError, ModelError, TraingraphError
from traingraph.limits import check_elements

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "checksum", "load", "payload_sha256", "save"]

FORMAT_NAME = "traingraph-checkpoint"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_METADATA_KEY = "traingraph"
_HEADER_LENGTH_BYTES = 8
# dtypes that every supported safetensors version stores (safetensors has no complex or string).
_SUPPORTED_DTYPES = tuple(
    np.dtype(t)
    for t in (
        np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32,
        np.uint64, np.int64, np.float16, np.float32, np.float64,
    )
)  # fmt: skip
_PROPERTY_TYPES = {"int": int, "float": float, "str": str}


def _param_key(name: str) -> str:
    return f"param/{name}"


def _optim_key(name: str, slot: str) -> str:
    return f"optim/{name}/{slot}"


def payload_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of the tensors, in sorted key order: key, dtype, shape, then the raw bytes of each.

    Args:
        tensors: Tensor key -> little-endian array.

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    for key in sorted(tensors):
        array = np.ascontiguousarray(tensors[key])
        digest.update(f"{key}\0{array.dtype.str}\0{list(array.shape)}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def checksum(meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of the metadata (every entry but ``sha256``, as sorted JSON) and the tensors.

    Args:
        meta: The checkpoint's metadata object.
        tensors: Tensor key -> little-endian array.

    Returns:
        The hex digest that a version 2 file records.
    """
    header = {key: value for key, value in meta.items() if key != "sha256"}
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    digest.update(payload_sha256(tensors).encode())
    return digest.hexdigest()


def _storable(what: str, array: np.ndarray) -> np.ndarray:
    """Returns ``array`` contiguous and little-endian; raises if the format cannot hold it."""
    if array.dtype.newbyteorder("=") not in _SUPPORTED_DTYPES:
        raise ModelError(
            f"cannot write {what} to a traingraph checkpoint: dtype {array.dtype} is not"
            f" supported; supported dtypes are {', '.join(str(d) for d in _SUPPORTED_DTYPES)}."
            " Convert the array (for example with .astype(numpy.float32))."
        )
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def save(
    data: CheckpointData, path: str | os.PathLike[str], *, include_optimizer_state: bool
) -> None:
    """Writes ``data`` to ``path`` in the native format, atomically.

    Args:
        data: The checkpoint content.
        path: Destination file; an existing file is replaced only once the new one is complete.
        include_optimizer_state: If False, the optimizer slots, step and learning rate are left out.

    Raises:
        ModelError: ``data`` is inconsistent or holds an array of an unsupported dtype.
        PropertyTypeError: A property has an unsupported type.
    """
    check_checkpoint_data(data)
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "parameters": list(data.parameters),
        "requires_grad": {name: bool(data.requires_grad[name]) for name in data.parameters},
        "nominal": bool(data.nominal),
        "properties": {
            name: {"type": type(v).__name__, "value": v}
            for name, v in ((n, validate_property(n, v)) for n, v in data.properties.items())
        },
    }
    if data.nominal:
        meta["parameter_specs"] = {
            name: {"dtype": array.dtype.str, "shape": list(array.shape)}
            for name, array in data.parameters.items()
        }
    else:
        for name, array in data.parameters.items():
            tensors[_param_key(name)] = _storable(f"parameter {name!r}", array)
    if include_optimizer_state:
        meta["optimizer_state"] = {n: list(slots) for n, slots in data.optimizer_state.items()}
        meta["optimizer_step"] = int(data.optimizer_step)
        meta["learning_rate"] = None if data.learning_rate is None else float(data.learning_rate)
        for name, slots in data.optimizer_state.items():
            for slot, array in slots.items():
                tensors[_optim_key(name, slot)] = _storable(
                    f"optimizer state {slot!r} of parameter {name!r}", array
                )
    else:
        meta["optimizer_state"] = {}
        meta["optimizer_step"] = 0
        meta["learning_rate"] = None
    meta["sha256"] = checksum(meta, tensors)
    metadata = {_METADATA_KEY: json.dumps(meta)}
    # The bytes are written by atomic_write's own file: safetensors.save_file would write a
    # temporary file of its own, which a kill during the save leaves behind.
    content = safetensors.numpy.save(tensors, metadata=metadata)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(content))


def _fail(path: Path, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"cannot load checkpoint {str(path)!r}: {problem}. {fix}")


_REWRITE = "Restore the file from a backup or write the checkpoint again."


def _check_complete(path: Path) -> None:
    """Raises if the file is shorter than its safetensors header says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER_LENGTH_BYTES)
        if len(head) < _HEADER_LENGTH_BYTES:
            raise _fail(path, f"the file is truncated ({size} bytes)", _REWRITE)
        (header_length,) = struct.unpack("<Q", head)
        if size < _HEADER_LENGTH_BYTES + header_length:
            raise _fail(
                path,
                f"the file is truncated: its header needs {header_length} bytes but the file has"
                f" {size} bytes in all",
                _REWRITE,
            )
        try:
            header = json.loads(f.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            problem = f"its safetensors header is not valid JSON ({exc})"
            raise _fail(path, problem, _REWRITE) from exc
    if not isinstance(header, dict):
        raise _fail(path, "its safetensors header is not a JSON object", _REWRITE)
    for key, entry in header.items():
        if key != "__metadata__" and isinstance(entry, dict):
            shape = entry.get("shape")
            if not isinstance(shape, list) or not all(type(d) is int for d in shape):
                raise _fail(path, f"tensor {key!r} has shape {shape!r}", _REWRITE)
            check_elements(f"checkpoint {str(path)!r}", f"tensor {key!r}", shape)
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
        and isinstance(entry["data_offsets"], list) and len(entry["data_offsets"]) == 2
        and type(entry["data_offsets"][1]) is int
    ]  # fmt: skip
    needed = _HEADER_LENGTH_BYTES + header_length + max(ends, default=0)
    if size < needed:
        raise _fail(
            path,
            f"the file is truncated: its tensors need {needed} bytes but the file has {size}",
            _REWRITE,
        )


def _read_metadata(path: Path, metadata: Mapping[str, str] | None) -> dict[str, Any]:
    if not metadata or _METADATA_KEY not in metadata:
        raise _fail(
            path,
            "it is a safetensors file but not a traingraph checkpoint (no 'traingraph' metadata)",
            "Pass a file written by traingraph, or load plain safetensors files with"
            " safetensors.numpy.load_file.",
        )
    try:
        meta = json.loads(metadata[_METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise _fail(path, f"its metadata is not valid JSON ({exc})", _REWRITE) from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise _fail(path, f"its metadata does not describe a {FORMAT_NAME} file", _REWRITE)
    version = meta.get("version")
    if version not in _READABLE_VERSIONS:
        raise _fail(
            path,
            f"it has format version {version!r}; this traingraph reads versions"
            f" {', '.join(map(str, _READABLE_VERSIONS))}",
            "Load it with the traingraph version that wrote it, or upgrade traingraph.",
        )
    return meta


def load(path: str | os.PathLike[str]) -> CheckpointData:
    """Reads a native checkpoint and verifies its checksum.

    Args:
        path: The checkpoint file.

    Returns:
        The checkpoint content.

    Raises:
        CheckpointError: The file is missing, truncated, corrupt (checksum mismatch), not a
            traingraph checkpoint, or of an unknown format version.
    """
    file = Path(path)
    if not file.is_file():
        raise _fail(file, "the file does not exist", "Check the path.")
    _check_complete(file)
    try:
        with safe_open(str(file), framework="numpy") as f:
            meta = _read_metadata(file, f.metadata())
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except SafetensorError as exc:
        raise _fail(file, f"it is not a valid safetensors file ({exc})", _REWRITE) from exc
    actual = payload_sha256(tensors) if meta["version"] == 1 else checksum(meta, tensors)
    if actual != meta.get("sha256"):
        covered = "tensor data" if meta["version"] == 1 else "metadata and tensor data"
        raise _fail(
            file,
            f"checksum mismatch: the {covered} hash to {actual}, the file records"
            f" {meta.get('sha256')}; the file is corrupt",
            _REWRITE,
        )
    try:
        return _to_checkpoint_data(meta, tensors, f"checkpoint {str(file)!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, TraingraphError):
            raise
        raise _fail(file, f"its metadata is inconsistent ({exc!r})", _REWRITE) from exc


def _nominal_parameter(source: str, name: str, spec: Mapping[str, Any]) -> np.ndarray:
    """A zero-filled placeholder for a nominal parameter, its dtype and size checked first."""
    try:
        dtype = np.dtype(spec["dtype"]).newbyteorder("=")
    except TypeError as exc:
        raise ValueError(f"parameter {name!r} has dtype {spec['dtype']!r}") from exc
    if dtype not in _SUPPORTED_DTYPES:
        raise ModelError(
            f"{source}: parameter {name!r} has dtype {spec['dtype']!r}; expected one of"
            f" {', '.join(str(d) for d in _SUPPORTED_DTYPES)}. The file is corrupt: write the"
            " checkpoint again"
        )
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise ValueError(f"parameter {name!r} has shape {shape!r}")
    check_elements(source, f"parameter {name!r}", shape)
    return np.zeros(shape, dtype=dtype)


def _to_checkpoint_data(
    meta: dict[str, Any], tensors: dict[str, np.ndarray], source: str
) -> CheckpointData:
    nominal = bool(meta["nominal"])
    if not all(isinstance(name, str) for name in meta["parameters"]):
        raise ValueError(f"parameter names {meta['parameters']!r} are not all strings")
    if nominal:
        specs = meta["parameter_specs"]
        parameters = {
            name: _nominal_parameter(source, name, specs[name]) for name in meta["parameters"]
        }
    else:
        parameters = {name: tensors[_param_key(name)] for name in meta["parameters"]}
    properties = {
        name: _PROPERTY_TYPES[entry["type"]](entry["value"])
        for name, entry in meta["properties"].items()
    }
    learning_rate = meta["learning_rate"]
    if learning_rate is not None and not np.isfinite(float(learning_rate)):
        raise ValueError(f"learning rate {learning_rate!r} is not finite")
    return CheckpointData(
        parameters=parameters,
        requires_grad={name: bool(meta["requires_grad"][name]) for name in parameters},
        optimizer_state={
            name: {slot: tensors[_optim_key(name, slot)] for slot in slots}
            for name, slots in meta["optimizer_state"].items()
        },
        optimizer_step=_step(meta["optimizer_step"]),
        learning_rate=None if learning_rate is None else float(learning_rate),
        properties=properties,
        nominal=nominal,
    )


def _step(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"optimizer step {value!r} is not an integer >= 0")
    return value
