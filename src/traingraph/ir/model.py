"""Loading, preparing and saving models: paths, ``onnx.ModelProto`` and ``onnx_ir.Model`` alike."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TypeAlias

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from traingraph.errors import ModelError
from traingraph.ir.fold import (
    densify_sparse_constants,
    drop_zero_biases,
    fold_shape_computations,
    identity_slices,
)

ModelLike: TypeAlias = "str | os.PathLike[str] | onnx.ModelProto | ir.Model"

MIN_OPSET = 13
# Over this size a model is saved with its tensors in an external data file.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_ir(model: ModelLike, *, copy: bool = True, infer_shapes: bool = True) -> ir.Model:
    """Load ``model`` as an ``onnx_ir.Model`` ready for differentiation.

    Functions are inlined and shapes inferred. A given ``ir.Model`` is copied unless ``copy``
    is False, so the caller's model is never modified.
    """
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ModelError(
                f"model file {str(path)!r} does not exist; pass the path of an .onnx file"
            )
        try:
            proto = onnx.load(str(path))
        except Exception as exc:
            raise ModelError(
                f"{str(path)!r} is not a readable ONNX model ({type(exc).__name__}: {exc});"
                " pass an .onnx file saved by onnx.save or torch.onnx.export"
            ) from None
    elif isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, ir.Model):
        if not copy:
            _prepare(model, infer_shapes=infer_shapes)
            return model
        proto = ir.to_proto(model)
    else:
        raise ModelError(
            f"expected a path, an onnx.ModelProto or an onnx_ir.Model, got {type(model).__name__}"
        )
    m = ir.from_proto(densify_sparse_constants(proto))
    _prepare(m, infer_shapes=infer_shapes)
    return m


def _prepare(m: ir.Model, *, infer_shapes: bool) -> None:
    opset = default_opset(m)
    if opset < MIN_OPSET or opset > max_supported_opset():
        raise ModelError(
            f"the model uses default-domain opset {opset}; traingraph supports opsets"
            f" {MIN_OPSET} to {max_supported_opset()}. Convert it with"
            " onnx.version_converter.convert_version(model, 17)."
        )
    if m.functions:
        common_passes.InlinePass()(m)
        common_passes.RemoveUnusedFunctionsPass()(m)
    drop_zero_biases(m.graph)  # an exporter's zero bias is an addition over every output
    if infer_shapes:
        infer_shapes_in_place(m)
        if fold_shape_computations(m.graph):  # shapes behind computed Slice bounds, Resize sizes
            infer_shapes_in_place(m)
    identity_slices(m.graph)  # an exporter's `x[:, 1:]` slices axis 0 from 0 to the end


# Ops whose outputs are sequences of tensors.
_SEQUENCE_OPS = frozenset(
    {"SplitToSequence", "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase"}
)


def infer_shapes_in_place(m: ir.Model, *, data_prop: bool = True) -> BaseException | None:
    """Infer the shapes and types of ``m``'s values with onnx's shape inference.

    Shape inference is a help, not a requirement: where it fails the model keeps what it had,
    and rules that need a shape say so. onnx's strict inference gives up on the whole model at
    the first node it rejects, and its data propagation rejects some valid models (it treats
    a ``Mul`` of a ``[4, 1, 1]`` and an ``[8]`` tensor, both computed from shapes, as a shape
    computation of mismatched lengths): a failed attempt is retried without data propagation,
    then node by node (``strict_mode=False``, which leaves unknown only what follows a
    rejected node); a ``MemoryError`` is not retried. onnx-ir's pass copies back
    only dtypes and tensor shapes, which would give a sequence of tensors (a
    ``SplitToSequence`` output) a tensor type; the outputs of the sequence ops keep a sequence
    type here.

    Returns:
        The exception of the last attempt, None where one succeeded.
    """
    attempts = [(True, data_prop), (True, False), (False, False)]
    for strict, propagate in dict.fromkeys(attempts):
        failure = _inference_failure(m, strict_mode=strict, data_prop=propagate)
        if failure is None or isinstance(failure, MemoryError):
            break
    for graph in m.graphs():
        for node in graph:
            if node.op_type not in _SEQUENCE_OPS or node.domain not in ("", "ai.onnx"):
                continue
            for value in node.outputs:
                if isinstance(value.type, ir.TensorType):
                    value.type = ir.SequenceType(value.type)
                    value.shape = None
    return failure


def _inference_failure(m: ir.Model, **options: bool) -> BaseException | None:
    """Run onnx-ir's shape inference pass on ``m`` with ``options``; the exception that made
    it leave the model unchanged (it logs it and goes on), or None where it ran."""
    failures = _LoggedFailures()
    logger = logging.getLogger(common_passes.shape_inference.__name__)
    logger.addHandler(failures)
    try:
        common_passes.ShapeInferencePass(**options)(m)
    except Exception as error:  # inference is optional, see infer_shapes_in_place
        return error
    finally:
        logger.removeHandler(failures)
    return failures.error


class _LoggedFailures(logging.Handler):
    """Keeps the exception of the first failure record logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None and record.exc_info and record.exc_info[1] is not None:
            self.error = record.exc_info[1]


def default_opset(m: ir.Model) -> int:
    """The model's default-domain (``ai.onnx``) opset."""
    for domain in ("", "ai.onnx"):
        if domain in m.opset_imports:
            return m.opset_imports[domain]
    raise ModelError("the model imports no default-domain opset; it is not a standard ONNX model")


@functools.cache
def max_supported_opset() -> int:
    """The newest default-domain opset that both onnx and the installed onnxruntime support."""
    return _newest_loadable(range(MIN_OPSET, onnx.defs.onnx_opset_version() + 1), lambda v: (v, 10))


@functools.cache
def max_ir_version() -> int:
    """The newest IR version that the installed onnxruntime loads."""
    return _newest_loadable(range(8, onnx.IR_VERSION + 1), lambda v: (MIN_OPSET, v))


def _newest_loadable(candidates: range, settings) -> int:  # type: ignore[no-untyped-def]
    """Binary search for the newest (opset, ir_version) setting onnxruntime accepts."""
    import onnxruntime
    from onnx import helper

    def loads(candidate: int) -> bool:
        opset, ir_version = settings(candidate)
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        probe = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version
        )
        try:
            onnxruntime.InferenceSession(
                probe.SerializeToString(), providers=["CPUExecutionProvider"]
            )
        except Exception:
            return False
        return True

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if loads(candidates[mid]):
            lo = mid
        else:
            hi = mid - 1
    return candidates[lo]


def to_proto(m: ir.Model) -> onnx.ModelProto:
    """Serialize ``m`` with an IR version that the installed onnxruntime loads."""
    m.ir_version = min(m.ir_version, max_ir_version())
    return ir.to_proto(m)


def save(m: ir.Model | onnx.ModelProto, path: str | os.PathLike) -> None:
    """Save a model (never modifying ``m``), with its tensors in ``<file>.data`` when it is
    too large for one protobuf."""
    proto = to_proto(m) if isinstance(m, ir.Model) else m
    path = Path(path)
    if not _small_enough(proto) or proto.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        if proto is m:
            # onnx.save rewrites the tensors of the proto it is given into external references.
            proto = onnx.ModelProto()
            proto.CopyFrom(m)
        onnx.save(
            proto,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
    else:
        onnx.save(proto, str(path))


def _small_enough(proto: onnx.ModelProto) -> bool:
    """Whether ``ByteSize`` can be asked (protobuf fails on messages over 2 GB)."""
    total = sum(len(t.raw_data) for t in proto.graph.initializer)
    return total < EXTERNAL_DATA_THRESHOLD


def tensor_bytes(m: ir.Model) -> int:
    """The bytes of the tensors that ``m``'s graphs hold as initializers."""
    return sum(
        value.const_value.nbytes
        for graph in m.graphs()
        for value in graph.initializers.values()
        if value.const_value is not None
    )


@contextlib.contextmanager
def onnxruntime_source(m: ir.Model) -> Iterator[bytes | str]:
    """What ``onnxruntime.InferenceSession`` takes for ``m``: its serialized bytes, or past
    :data:`EXTERNAL_DATA_THRESHOLD` of tensors (what protobuf cannot serialize, as
    :func:`save` decides) the path of a temporary file whose tensors are external data (the
    session reads them when it is created; the file is gone after)."""
    if tensor_bytes(m) < EXTERNAL_DATA_THRESHOLD:
        yield ir.to_proto(m).SerializeToString()
        return
    with tempfile.TemporaryDirectory(prefix="traingraph-") as directory:
        path = os.path.join(directory, "model.onnx")
        ir.save(m, path, external_data="model.onnx.data")
        yield path

