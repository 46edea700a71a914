"""onnxruntime-training's checkpoint format (flatbuffers, file identifier ``ODTC``, version 2).

This reads and writes the files of ``onnxruntime.training.api.CheckpointState`` as
onnxruntime-training 1.19.2 does. The schema (``ort_training_checkpoint.fbs`` and the ``Tensor``
table of ``ort.fbs`` in the onnxruntime repository) is::

    table Checkpoint { version:int32; module_state:ModuleState;
                       optimizer_groups:[OptimizerGroup]; property_bag:PropertyBag; }
    table ModuleState { requires_grad_params:[Tensor]; frozen_params:[Tensor];
                        is_nominal_state:bool; has_external_data:bool; }
    table OptimizerGroup { group_name:string; step:int64; initial_learning_rate:float;
                           optimizer_states:[ParameterOptimizerState]; }
    table ParameterOptimizerState { param_name:string; momentums:[Tensor]; }
    table PropertyBag { ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty]; }
    table IntProperty { name:string; value:int64; }      // likewise float (float32), string
    table Tensor { name:string; doc_string:string; dims:[int64]; data_type:TensorDataType (int32);
                   raw_data:[uint8]; string_data:[string]; external_data_offset:int64 = -1; }

What onnxruntime-training writes, and this module too: parameters sorted by name, split into
``requires_grad_params`` and ``frozen_params`` (both vectors always present); one optimizer group
``group0`` whose per-parameter momentums are named ``momentum0`` (and ``momentum1``); the
``optimizer_groups`` vector always present (empty without optimizer state); the property bag only
when there are properties, with its three vectors sorted by name. A nominal checkpoint's tensors
have no dims and no data. Slot names map to traingraph's as follows: AdamW's ``momentum0`` /
``momentum1`` are ``exp_avg`` / ``exp_avg_sq``; SGD's lone ``momentum0`` is ``momentum_buffer``.

Precision: the learning rate and float properties are float32 in this format; they are read back as
the shortest decimal that round-trips that float32 (``0.001`` stays ``0.001``).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import flatbuffers
import numpy as np
from flatbuffers import number_types as fb_types
from flatbuffers.table import Table

from traingraph.checkpoint.state import (
    CheckpointData,
    PropertyValue,
    atomic_write,
    check_checkpoint_data,
    validate_property,
)
from traingraph.errors import CheckpointError, ModelError
from traingraph.limits import check_elements

__all__ = ["CHECKPOINT_VERSION", "FILE_IDENTIFIER", "load", "loads", "save", "to_bytes"]

FILE_IDENTIFIER = b"ODTC"
CHECKPOINT_VERSION = 2
_GROUP_NAME = "group0"
_INT64 = np.iinfo(np.int64)
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Field slots (declaration order) of the schema's tables.
_CKPT_VERSION, _CKPT_MODULE_STATE, _CKPT_OPTIMIZER_GROUPS, _CKPT_PROPERTY_BAG = range(4)
_MS_REQUIRES_GRAD, _MS_FROZEN, _MS_NOMINAL, _MS_EXTERNAL_DATA = range(4)
_T_NAME, _T_DOC, _T_DIMS, _T_DATA_TYPE, _T_RAW_DATA, _T_STRING_DATA, _T_EXTERNAL_OFFSET = range(7)
_GROUP_NAME_SLOT, _GROUP_STEP, _GROUP_LR, _GROUP_STATES = range(4)
_POS_PARAM_NAME, _POS_MOMENTUMS = range(2)
_BAG_INTS, _BAG_FLOATS, _BAG_STRINGS = range(3)
_PROP_NAME, _PROP_VALUE = range(2)
_TABLE_SIZES = {"Checkpoint": 4, "ModuleState": 4, "Tensor": 7, "OptimizerGroup": 4,
                "ParameterOptimizerState": 2, "PropertyBag": 3, "Property": 2}  # fmt: skip

# TensorDataType values (the ONNX TensorProto codes) that map to a NumPy dtype.
_DTYPE_OF_CODE: dict[int, np.dtype] = {
    1: np.dtype("<f4"), 2: np.dtype("u1"), 3: np.dtype("i1"), 4: np.dtype("<u2"),
    5: np.dtype("<i2"), 6: np.dtype("<i4"), 7: np.dtype("<i8"), 9: np.dtype("?"),
    10: np.dtype("<f2"), 11: np.dtype("<f8"), 12: np.dtype("<u4"), 13: np.dtype("<u8"),
    14: np.dtype("<c8"), 15: np.dtype("<c16"),
}  # fmt: skip
_CODE_OF_DTYPE: dict[np.dtype, int] = {
    dtype.newbyteorder("="): code for code, dtype in _DTYPE_OF_CODE.items()
}

# traingraph slot name -> onnxruntime-training momentum name, per optimizer.
_SLOT_MAPS = (
    {"exp_avg": "momentum0", "exp_avg_sq": "momentum1"},  # AdamW
    {"momentum_buffer": "momentum0"},  # SGD
)


def _float32_value(value: float) -> float:
    """The shortest decimal that round-trips the float32 ``value``."""
    return float(str(np.float32(value)))


# --------------------------------------------------------------------------------------------
# Writing


class _Writer:
    """Builds the flatbuffer of one checkpoint, bottom-up (children before their parents)."""

    def __init__(self) -> None:
        self.b = flatbuffers.Builder(1024)

    def vector(self, offsets: list[int]) -> int:
        self.b.StartVector(4, len(offsets), 4)
        for off in reversed(offsets):
            self.b.PrependUOffsetTRelative(off)
        return self.b.EndVector()

    def tensor(self, name: str, array: np.ndarray, nominal: bool) -> int:
        code = _CODE_OF_DTYPE.get(array.dtype.newbyteorder("="))
        if code is None:
            raise ModelError(
                f"cannot write tensor {name!r} to an onnxruntime-training checkpoint: dtype"
                f" {array.dtype} is not supported; supported dtypes are"
                f" {', '.join(str(d) for d in _DTYPE_OF_CODE.values())}."
            )
        b = self.b
        name_off = b.CreateString(name)
        shape = () if nominal else array.shape
        dims_off = b.CreateNumpyVector(np.asarray(shape, dtype=np.int64))
        raw = b"" if nominal else np.ascontiguousarray(array, _DTYPE_OF_CODE[code]).tobytes()
        raw_off = b.CreateByteVector(raw)
        b.StartObject(_TABLE_SIZES["Tensor"])
        b.PrependUOffsetTRelativeSlot(_T_NAME, name_off, 0)
        b.PrependUOffsetTRelativeSlot(_T_DIMS, dims_off, 0)
        b.PrependInt32Slot(_T_DATA_TYPE, code, 0)
        b.PrependUOffsetTRelativeSlot(_T_RAW_DATA, raw_off, 0)
        return b.EndObject()

    def module_state(self, data: CheckpointData) -> int:
        names = sorted(data.parameters)
        groups = [[n for n in names if bool(data.requires_grad[n]) == f] for f in (True, False)]
        tensors = [[self.tensor(n, data.parameters[n], data.nominal) for n in g] for g in groups]
        trainable, frozen = (self.vector(offsets) for offsets in tensors)
        b = self.b
        b.StartObject(_TABLE_SIZES["ModuleState"])
        b.PrependUOffsetTRelativeSlot(_MS_REQUIRES_GRAD, trainable, 0)
        b.PrependUOffsetTRelativeSlot(_MS_FROZEN, frozen, 0)
        b.PrependBoolSlot(_MS_NOMINAL, data.nominal, False)
        return b.EndObject()

    def optimizer_group(self, data: CheckpointData) -> int:
        if data.learning_rate is None:
            raise ModelError(
                "cannot write optimizer state to an onnxruntime-training checkpoint without a"
                " learning rate: the format stores the group's initial learning rate. Set"
                " CheckpointData.learning_rate, or save with include_optimizer_state=False."
            )
        b = self.b
        states = []
        for name in sorted(data.optimizer_state):
            momentums = _ort_momentums(name, data.optimizer_state[name])
            momentum_offs = [self.tensor(m, momentums[m], False) for m in sorted(momentums)]
            name_off = b.CreateString(name)
            momentums_off = self.vector(momentum_offs)
            b.StartObject(_TABLE_SIZES["ParameterOptimizerState"])
            b.PrependUOffsetTRelativeSlot(_POS_PARAM_NAME, name_off, 0)
            b.PrependUOffsetTRelativeSlot(_POS_MOMENTUMS, momentums_off, 0)
            states.append(b.EndObject())
        group_name = b.CreateString(_GROUP_NAME)
        states_off = self.vector(states)
        b.StartObject(_TABLE_SIZES["OptimizerGroup"])
        b.PrependUOffsetTRelativeSlot(_GROUP_NAME_SLOT, group_name, 0)
        b.PrependFloat32Slot(_GROUP_LR, float(data.learning_rate), 0.0)
        b.PrependInt64Slot(_GROUP_STEP, int(data.optimizer_step), 0)
        b.PrependUOffsetTRelativeSlot(_GROUP_STATES, states_off, 0)
        return b.EndObject()

    def property_bag(self, properties: dict[str, PropertyValue]) -> int:
        b = self.b
        kinds: dict[type, list[int]] = {int: [], float: [], str: []}
        for name in sorted(properties):
            value = _ort_property(name, properties[name])
            name_off = b.CreateString(name)
            value_off = b.CreateString(value) if isinstance(value, str) else 0
            b.StartObject(_TABLE_SIZES["Property"])
            b.PrependUOffsetTRelativeSlot(_PROP_NAME, name_off, 0)
            if isinstance(value, str):
                b.PrependUOffsetTRelativeSlot(_PROP_VALUE, value_off, 0)
            elif isinstance(value, int):
                b.PrependInt64Slot(_PROP_VALUE, value, 0)
            else:
                b.PrependFloat32Slot(_PROP_VALUE, value, 0.0)
            kinds[type(value)].append(b.EndObject())
        ints, floats, strings = (self.vector(kinds[t]) for t in (int, float, str))
        b.StartObject(_TABLE_SIZES["PropertyBag"])
        b.PrependUOffsetTRelativeSlot(_BAG_INTS, ints, 0)
        b.PrependUOffsetTRelativeSlot(_BAG_FLOATS, floats, 0)
        b.PrependUOffsetTRelativeSlot(_BAG_STRINGS, strings, 0)
        return b.EndObject()

    def checkpoint(self, data: CheckpointData, include_optimizer_state: bool) -> bytes:
        module_state = self.module_state(data)
        groups = []
        if include_optimizer_state and data.optimizer_state:
            groups.append(self.optimizer_group(data))
        bag = self.property_bag(data.properties) if data.properties else 0
        groups_off = self.vector(groups)
        b = self.b
        b.StartObject(_TABLE_SIZES["Checkpoint"])
        b.PrependInt32Slot(_CKPT_VERSION, CHECKPOINT_VERSION, 0)
        b.PrependUOffsetTRelativeSlot(_CKPT_MODULE_STATE, module_state, 0)
        b.PrependUOffsetTRelativeSlot(_CKPT_OPTIMIZER_GROUPS, groups_off, 0)
        if bag:
            b.PrependUOffsetTRelativeSlot(_CKPT_PROPERTY_BAG, bag, 0)
        b.Finish(b.EndObject(), file_identifier=FILE_IDENTIFIER)
        return bytes(b.Output())


def _ort_momentums(name: str, slots: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Renames one parameter's optimizer slots to onnxruntime-training's momentum names."""
    for slot_map in _SLOT_MAPS:
        if set(slots) == set(slot_map):
            return {slot_map[slot]: array for slot, array in slots.items()}
    raise ModelError(
        f"cannot write the optimizer state of parameter {name!r} (slots {sorted(slots)}) to an"
        " onnxruntime-training checkpoint: that format holds only AdamW state (exp_avg,"
        " exp_avg_sq) or SGD state (momentum_buffer). Save it in the native format instead."
    )


def _ort_property(name: str, value: object) -> PropertyValue:
    """Checks that a property fits the format's int64 / float32 / string properties."""
    checked = validate_property(name, value)
    if isinstance(checked, int) and not _INT64.min <= checked <= _INT64.max:
        raise ModelError(
            f"checkpoint property {name!r} = {checked} does not fit in int64, the integer type"
            " of onnxruntime-training checkpoints. Store it as a str or use the native format."
        )
    if isinstance(checked, float) and math.isfinite(checked) and abs(checked) > _FLOAT32_MAX:
        raise ModelError(
            f"checkpoint property {name!r} = {checked!r} overflows float32, the float type of"
            " onnxruntime-training checkpoints. Store it as a str or use the native format."
        )
    return checked


def to_bytes(data: CheckpointData, *, include_optimizer_state: bool = True) -> bytes:
    """Serializes ``data`` in onnxruntime-training's checkpoint format.

    Args:
        data: The checkpoint content. Its optimizer state must be AdamW's (``exp_avg``,
            ``exp_avg_sq``) or SGD's (``momentum_buffer``), and needs ``learning_rate``.
        include_optimizer_state: If False, no optimizer group is written (as onnxruntime-training
            does), so the optimizer state, step and learning rate are left out.

    Returns:
        The file content.

    Raises:
        ModelError: ``data`` is inconsistent or does not fit the format (dtype, slot names,
            missing learning rate, int64 / float32 range of properties).
        PropertyTypeError: A property has an unsupported type.
    """
    check_checkpoint_data(data)
    return _Writer().checkpoint(data, include_optimizer_state)


def save(
    data: CheckpointData, path: str | os.PathLike[str], *, include_optimizer_state: bool
) -> None:
    """Writes ``data`` to ``path`` in onnxruntime-training's format, atomically.

    See :func:`to_bytes` for the arguments and errors.
    """
    content = to_bytes(data, include_optimizer_state=include_optimizer_state)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(content))


# --------------------------------------------------------------------------------------------
# Reading


class _CorruptError(Exception):
    """A structural problem found while reading; turned into a CheckpointError naming the file."""


class _Reader:
    """Typed access to the fields of one flatbuffer table."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.tab = Table(buf, pos)

    def _field(self, slot: int) -> int:
        return self.tab.Offset(4 + 2 * slot)

    def has(self, slot: int) -> bool:
        return self._field(slot) != 0

    def scalar(self, slot: int, flags: type, default: int | float | bool) -> int | float | bool:
        off = self._field(slot)
        return self.tab.Get(flags, self.tab.Pos + off) if off else default

    def string(self, slot: int, what: str) -> str:
        off = self._field(slot)
        if not off:
            raise _CorruptError(f"{what} is missing")
        start = self.tab.Indirect(self.tab.Pos + off)
        (length,) = struct.unpack_from("<I", self.tab.Bytes, start)
        if start + 4 + length > len(self.tab.Bytes):
            raise _CorruptError(f"{what} runs past the end of the file")
        return bytes(self.tab.Bytes[start + 4 : start + 4 + length]).decode("utf-8")

    def table(self, slot: int) -> _Reader | None:
        off = self._field(slot)
        if not off:
            return None
        return _Reader(self.tab.Bytes, self.tab.Indirect(self.tab.Pos + off))

    def tables(self, slot: int) -> list[_Reader] | None:
        off = self._field(slot)
        if not off:
            return None
        start, count = self.tab.Vector(off), self.tab.VectorLen(off)
        return [_Reader(self.tab.Bytes, self.tab.Indirect(start + 4 * i)) for i in range(count)]

    def numbers(self, slot: int, flags: type) -> np.ndarray:
        off = self._field(slot)
        if not off:
            return np.zeros(0, dtype=fb_types.to_numpy_type(flags))
        return self.tab.GetVectorAsNumpy(flags, off)


def _read_tensor(t: _Reader, nominal: bool) -> tuple[str, np.ndarray]:
    name = t.string(_T_NAME, "a tensor name")
    code = int(t.scalar(_T_DATA_TYPE, fb_types.Int32Flags, 0))
    dtype = _DTYPE_OF_CODE.get(code)
    if dtype is None:
        raise _CorruptError(
            f"tensor {name!r} has data type {code} (ONNX TensorProto code), which traingraph does"
            f" not read; supported codes are {sorted(_DTYPE_OF_CODE)}"
        )
    if t.has(_T_STRING_DATA) or t.scalar(_T_EXTERNAL_OFFSET, fb_types.Int64Flags, -1) != -1:
        raise _CorruptError(f"tensor {name!r} keeps its data as strings or in an external file")
    dims = [int(d) for d in t.numbers(_T_DIMS, fb_types.Int64Flags)]
    try:
        check_elements("the file", f"tensor {name!r}", dims)  # before anything is allocated
    except ModelError as exc:
        raise _CorruptError(str(exc)) from exc
    raw = t.numbers(_T_RAW_DATA, fb_types.Uint8Flags)
    if nominal and raw.size == 0:
        return name, np.zeros(dims, dtype=dtype.newbyteorder("="))
    expected = math.prod(dims) * dtype.itemsize
    if raw.size != expected:
        raise _CorruptError(
            f"tensor {name!r} of shape {dims} and dtype {dtype} should hold {expected} bytes but"
            f" holds {raw.size}"
        )
    array = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(dims)
    return name, array.astype(dtype.newbyteorder("="))


def _read_properties(bag: _Reader | None) -> dict[str, PropertyValue]:
    if bag is None:
        return {}
    readers = (
        (_BAG_INTS, lambda p: int(p.scalar(_PROP_VALUE, fb_types.Int64Flags, 0))),
        (_BAG_FLOATS, lambda p: _float32_value(p.scalar(_PROP_VALUE, fb_types.Float32Flags, 0.0))),
        (_BAG_STRINGS, lambda p: p.string(_PROP_VALUE, "a string property value")),
    )
    properties: dict[str, PropertyValue] = {}
    for slot, read_value in readers:
        for prop in bag.tables(slot) or []:
            properties[prop.string(_PROP_NAME, "a property name")] = read_value(prop)
    return properties


def _read_checkpoint(buf: bytes) -> CheckpointData:
    if len(buf) < 8 or not flatbuffers.util.BufferHasIdentifier(buf, 0, FILE_IDENTIFIER):
        raise _CorruptError("it has no 'ODTC' file identifier")
    (root,) = struct.unpack_from("<I", buf, 0)
    ckpt = _Reader(buf, root)
    version = int(ckpt.scalar(_CKPT_VERSION, fb_types.Int32Flags, 0))
    if version != CHECKPOINT_VERSION:
        raise _CorruptError(
            f"it has checkpoint version {version}; traingraph reads version {CHECKPOINT_VERSION}"
            " (onnxruntime-training 1.19)"
        )
    parameters: dict[str, np.ndarray] = {}
    requires_grad: dict[str, bool] = {}
    nominal = False
    module_state = ckpt.table(_CKPT_MODULE_STATE)
    if module_state is not None:
        nominal = bool(module_state.scalar(_MS_NOMINAL, fb_types.BoolFlags, False))
        if module_state.scalar(_MS_EXTERNAL_DATA, fb_types.BoolFlags, False):
            raise _CorruptError("its tensors are kept in an external data file")
        for slot, trains in ((_MS_REQUIRES_GRAD, True), (_MS_FROZEN, False)):
            tensors = module_state.tables(slot)
            if tensors is None:
                raise _CorruptError("its module state lacks a requires_grad or frozen list")
            for t in tensors:
                name, array = _read_tensor(t, nominal)
                parameters[name] = array
                requires_grad[name] = trains
    groups = ckpt.tables(_CKPT_OPTIMIZER_GROUPS) or []
    if len(groups) > 1:
        raise _CorruptError(f"it has {len(groups)} optimizer groups; traingraph reads one")
    optimizer_state: dict[str, dict[str, np.ndarray]] = {}
    step, learning_rate = 0, None
    for group in groups:
        step = int(group.scalar(_GROUP_STEP, fb_types.Int64Flags, 0))
        if step < 0:
            raise _CorruptError(f"its optimizer step is {step}; expected an integer >= 0")
        learning_rate = _float32_value(group.scalar(_GROUP_LR, fb_types.Float32Flags, 0.0))
        for state in group.tables(_GROUP_STATES) or []:
            param = state.string(_POS_PARAM_NAME, "an optimizer state's parameter name")
            momentums = dict(_read_tensor(t, False) for t in state.tables(_POS_MOMENTUMS) or [])
            optimizer_state[param] = _traingraph_slots(param, momentums)
    return CheckpointData(
        parameters=parameters,
        requires_grad=requires_grad,
        optimizer_state=optimizer_state,
        optimizer_step=step,
        learning_rate=learning_rate,
        properties=_read_properties(ckpt.table(_CKPT_PROPERTY_BAG)),
        nominal=nominal,
    )


def _traingraph_slots(param: str, momentums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Renames one parameter's momentums to traingraph's slot names."""
    for slot_map in _SLOT_MAPS:
        if set(momentums) == set(slot_map.values()):
            return {slot: momentums[momentum] for slot, momentum in slot_map.items()}
    raise _CorruptError(
        f"the optimizer state of {param!r} has momentums {sorted(momentums)}; traingraph reads"
        " AdamW's (momentum0, momentum1) or SGD's (momentum0)"
    )


def loads(buf: bytes, source: str = "<bytes>") -> CheckpointData:
    """Parses an onnxruntime-training checkpoint from its bytes.

    Args:
        buf: The file content.
        source: Name of the file, for error messages.

    Returns:
        The checkpoint content. Parameters come in file order (trainable first, then frozen);
        an optimizer group's step and initial learning rate become ``optimizer_step`` and
        ``learning_rate``.

    Raises:
        CheckpointError: The bytes are truncated, corrupt, of another checkpoint version, or hold
            something traingraph does not read (string tensors, external data, several groups).
    """
    try:
        return _read_checkpoint(buf)
    except _CorruptError as exc:
        problem = str(exc)
    except (struct.error, IndexError, ValueError, TypeError, OverflowError) as exc:
        problem = f"it is truncated or corrupt ({type(exc).__name__}: {exc})"
    raise CheckpointError(
        f"cannot load onnxruntime-training checkpoint {source!r}: {problem}. Check that the file"
        " was written completely by onnxruntime-training 1.19 (CheckpointState.save_checkpoint) or"
        " by traingraph, or write it again."
    )


def load(path: str | os.PathLike[str]) -> CheckpointData:
    """Reads an onnxruntime-training checkpoint file (see :func:`loads`).

    Raises:
        CheckpointError: The file is missing, truncated or corrupt.
    """
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(
            f"cannot load checkpoint {str(file)!r}: the file does not exist. Check the path."
        )
    return loads(file.read_bytes(), str(file))
