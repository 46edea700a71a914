"""CUDA sessions and whole-step CUDA graph capture.

onnxruntime's CUDA execution provider can capture a session's kernels into a CUDA graph
(``enable_cuda_graph``) and replay it in one launch. A captured graph reads and writes fixed
device addresses, so every input and output must be bound to a device buffer that stays put.
:class:`CudaGraphStep` does that for a whole training step (train graph, then optimizer graph,
fused into one model where the optimizer runs over flat blocks: one launch and one wait per
step): each input batch is copied once into a fixed device buffer (one asynchronous copy from
page-locked memory, :mod:`~traingraph.runtime.cuda.cudart`), and parameters, gradients, updated
buffers and optimizer slots stay in the :class:`~traingraph.runtime.state.TrainingState` of
the module's :class:`~traingraph.runtime.step.TrainStep`. Where the optimizer is fused into
the training graph, that state double-buffers what a step rewrites (it reads one copy and
writes the other, then swaps): onnxruntime runs a graph more than once in the call that
captures it, and each run must see the inputs the first saw. So the step keeps one captured
graph per buffer layout (two in steady state), told apart by onnxruntime's ``gpu_graph_id``
run option. Where the parameters and slots are large (:data:`IN_PLACE_BYTES`), or the step
decides its loss scale on the host (:data:`KERNEL_BYTES`), the update is the optimizer's own
CUDA kernel (:mod:`traingraph.runtime.optimizer.device`: one pass in
place, the graph's numbers), queued on the step's stream after the captured graph. Where
that kernel does not compile and the model has no running statistics (one buffer layout),
the optimizer is a captured graph of its own that writes them in place, as
``Optimizer.step()`` does: their values and the gradients are saved before the call that
captures it and put back after, and the captured graph then replays once. The data-parallel
step keeps both copies.

A mixed-precision step with a loss scaler is fused too: the model itself keeps each value
where the gradients are not all finite and updates the loss scale and the step count, which
live on the GPU (:class:`GpuCounters`), so no step waits for the host to decide; the host's
``loss_scaler`` and ``state.step`` read them back when read.

Example:
    >>> module = Module("training_model.onnx", state, device="cuda")
    >>> step = CudaGraphStep(module, "optimizer_model.onnx")
    >>> for x, y in batches:
    ...     step(x, y)  # the loss stays on the GPU
    >>> float(step(x, y, fetch_loss=True))
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import onnx
import onnx.compose
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from traingraph.errors import DeviceError, ModelError
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import default_opset, max_ir_version, to_proto
from traingraph.ir.random import DRAWS
from traingraph.precision import GRADS_FINITE, LOSS_SCALE
from traingraph.runtime.amp import (
    COUNTERS,
    GOOD_STEPS,
    SKIPPED_STEPS,
    STEP_COUNT,
    DynamicLossScaler,
    device_update_nodes,
)
from traingraph.runtime.cuda.cudart import StagedInputs, shared_stream, synchronize
from traingraph.runtime.cuda.static_shapes import for_capture
from traingraph.runtime.device import Device
from traingraph.runtime.optimizer import FlatLayout, InPlace, OptimizerUpdate, optimizer_io
from traingraph.runtime.session import SessionConfig, create_session, ort_type_to_numpy
from traingraph.runtime.state import TrainingState
from traingraph.runtime.step import TrainStep
from traingraph.runtime.tensors import PingPong, Spec, TensorStore


class HasTrainStep(Protocol):
    """What runs a training model through a :class:`~traingraph.runtime.step.TrainStep`
    (an ``api.Module``)."""

    step: TrainStep


class HasOptimizerUpdate(Protocol):
    """What applies an :class:`~traingraph.runtime.optimizer.OptimizerUpdate` (an
    ``api.Optimizer``)."""

    update: OptimizerUpdate


def create_cuda_session(
    model: str | os.PathLike | bytes | onnx.ModelProto,
    device: Device,
    config: SessionConfig | None = None,
) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``model`` on the CUDA ``device``, with ``config``'s CUDA options.

    Raises:
        DeviceError: When ``config.cuda_graph`` is on and onnxruntime cannot place the whole
            graph on the GPU (the message says which check failed).
    """
    if device.kind != "cuda":
        raise DeviceError(f"create_cuda_session needs a CUDA device, got {device}")
    config = config or SessionConfig()
    try:
        return create_session(model, device, config)
    except Exception as error:  # onnxruntime raises its own exception types
        if not config.cuda_graph:
            raise
        what = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "the model"
        raise DeviceError(
            f"onnxruntime could not capture {what} into a CUDA graph: {error}. CUDA graphs need"
            " every node on the GPU and static shapes; run without cuda_graph"
        ) from error


def with_static_inputs(
    model: str | os.PathLike | onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]
) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs ``shapes`` names have those fixed shapes.

    Training graphs keep the batch dimension symbolic, so the shape computations of their
    gradients (``Shape`` -> ``Gather`` -> ``Concat`` -> ``Reshape``/``Expand``) run at every
    step. With every input shape fixed, onnxruntime's constant folding turns them into
    initializers, so no node of the step reads a shape tensor from device memory; a CUDA
    graph capture fails on the device-to-host copy such a read needs.

    Raises:
        ModelError: When a shape contradicts a fixed dimension or the rank of the input.
    """
    proto = onnx.load(os.fspath(model)) if not isinstance(model, onnx.ModelProto) else model
    proto = copy.deepcopy(proto) if isinstance(model, onnx.ModelProto) else proto
    for value in proto.graph.input:
        if value.name not in shapes:
            continue
        shape = shapes[value.name]
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ModelError(
                f"input {value.name!r} has rank {len(dims)}, but the batch gives it shape"
                f" {list(shape)}"
            )
        for dim, size in zip(dims, shape):
            if dim.HasField("dim_value") and dim.dim_value != size:
                raise ModelError(
                    f"input {value.name!r} has a fixed dimension {dim.dim_value}, but the batch"
                    f" gives it shape {list(shape)}"
                )
            dim.Clear()
            dim.dim_value = size
    return proto


def dropout_from_noise(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Spec]]:
    """Rewrite each training-mode ``Dropout`` and each random op (``RandomUniform``,
    ``RandomNormal``, their ``Like`` forms, ``Bernoulli``) of a static-shape ``proto`` to read
    its random numbers from new graph inputs.

    A CUDA graph replays the random seeds it captured, so a captured ``Dropout`` would drop the
    same elements at every step. After the rewrite, ``Dropout(x, ratio, True)`` is
    ``keep = noise >= ratio``, ``y = x * keep / (1 - ratio)`` (the mask output is ``keep``),
    with ``noise`` a uniform [0, 1) input of ``x``'s shape that the caller fills outside the
    capture. Inference-mode Dropouts stay as they are.

    Returns:
        The rewritten model and the noise inputs it takes (name -> (shape, float32)).

    Raises:
        ModelError: For a Dropout whose training mode is not a constant, a Dropout or a draw
            whose shape is not static, or a Multinomial.
    """
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    graph = model.graph
    b = OpBuilder(graph, default_opset(model), prefix="dropout_noise")
    noise: dict[str, Spec] = {}
    for node in list(graph):
        if node.op_type in DRAWS and node.domain in ("", "ai.onnx"):
            _draw_from_noise(b, node, noise)
            continue
        if node.op_type == "Multinomial" and node.domain in ("", "ai.onnx"):
            raise ModelError(
                f"Multinomial node {node.name!r} would draw the same samples at every step of a"
                " CUDA graph, which replays its seeds; train the model with"
                " api.Module(device='cuda') instead"
            )
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
        x, ratio, training = inputs[:3]
        mode = None if training is None else ir.convenience.get_const_tensor(training)
        if training is not None and mode is None:
            raise ModelError(
                f"Dropout node {node.name!r} takes a training mode computed at run time; a CUDA"
                " graph step needs it constant"
            )
        if mode is None or not bool(mode.numpy()):
            continue
        assert x is not None
        dims = [] if x.shape is None else [d for d in x.shape if isinstance(d, int)]
        if x.shape is None or len(dims) != len(x.shape):
            raise ModelError(
                f"Dropout node {node.name!r} has input shape {x.shape}; a CUDA graph step needs"
                " static shapes"
            )
        name = f"{node.name or x.name}_noise"
        value = ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(ir.DataType.FLOAT))
        graph.inputs.append(value)
        noise[name] = (tuple(dims), np.dtype(np.float32))
        p = b.const(0.5, ir.DataType.FLOAT) if ratio is None else b.cast(ratio, ir.DataType.FLOAT)
        keep = b.op("GreaterOrEqual", value, p)
        scale = b.Div(b.scalar(1.0, like=p), b.Sub(b.scalar(1.0, like=p), p))
        y = b.Mul(b.Mul(x, b.cast_like(keep, x)), b.cast_like(scale, x))
        replacements = [y, keep][: len(node.outputs)]
        for old, new in zip(node.outputs, replacements):
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            new.name, new.shape, new.type = old.name, old.shape, old.type
            old.name = None
        graph.remove(node, safe=True)
    graph.sort()
    return to_proto(model), noise


def _draw_from_noise(b: OpBuilder, node: ir.Node, noise: dict[str, Spec]) -> None:
    """Replace a random op ``node`` (:data:`~traingraph.ir.random.DRAWS`) by the same draw
    computed from new uniform [0, 1) graph inputs: ``low + (high - low) * u`` for a uniform
    draw (such as the per-step seed draw of a lowered training Dropout), ``mean + scale *
    sqrt(-2 ln(1 - u)) cos(2 pi v)`` for a normal one (Box-Muller, from two inputs), ``u < p``
    for ``Bernoulli(p)``.

    Raises:
        ModelError: Where the draw's shape is not static.
    """
    attrs = node.attributes
    source = node.inputs[0] if node.inputs else None
    if source is None:
        shape: tuple[int, ...] | None = tuple(attrs.get_ints("shape", ()))
    elif source.shape is not None and all(isinstance(d, int) for d in source.shape):
        shape = tuple(int(d) for d in source.shape)  # type: ignore[arg-type]
    else:
        shape = None
    if shape is None:
        raise ModelError(
            f"{node.op_type} node {node.name!r} draws a tensor of shape"
            f" {None if source is None else source.shape}; a CUDA graph step needs static shapes"
        )
    if "dtype" in attrs:
        dtype = ir.DataType(attrs.get_int("dtype", int(ir.DataType.FLOAT)))
    else:
        dtype = source.dtype if source is not None and source.dtype else ir.DataType.FLOAT

    def uniform(suffix: str) -> ir.Value:
        name = f"{node.name or node.outputs[0].name}_{suffix}"
        value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
        b.graph.inputs.append(value)
        noise[name] = (shape, np.dtype(np.float32))
        return value

    if node.op_type.startswith("RandomUniform"):
        low, high = attrs.get_float("low", 0.0), attrs.get_float("high", 1.0)
        scaled = b.Mul(uniform("noise"), b.const(np.float32(high - low)))
        drawn = b.Add(scaled, b.const(np.float32(low)))
    elif node.op_type.startswith("RandomNormal"):
        mean, scale = attrs.get_float("mean", 0.0), attrs.get_float("scale", 1.0)
        one_minus = b.Sub(b.const(np.float32(1.0)), uniform("noise"))
        radius = b.Sqrt(b.Mul(b.Log(one_minus), b.const(np.float32(-2.0))))
        angle = b.Mul(uniform("angle_noise"), b.const(np.float32(2 * np.pi)))
        standard = b.Mul(radius, b.Cos(angle))
        drawn = b.Add(b.Mul(standard, b.const(np.float32(scale))), b.const(np.float32(mean)))
    else:
        assert source is not None
        drawn = b.op("Less", uniform("noise"), b.cast(source, ir.DataType.FLOAT))
    boolean = node.op_type == "Bernoulli"
    out = b.cast(drawn, dtype) if boolean or dtype != ir.DataType.FLOAT else drawn
    old = node.outputs[0]
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    out.name, out.shape, out.type = old.name, old.shape, old.type
    old.name = None
    b.graph.remove(node, safe=True)


def noise_model(noise: Mapping[str, Spec]) -> onnx.ModelProto:
    """A graph whose outputs are fresh uniform [0, 1) tensors with the specs of ``noise``."""
    nodes = [
        helper.make_node("RandomUniform", [], [name], shape=list(shape), dtype=TensorProto.FLOAT)
        for name, (shape, _) in noise.items()
    ]
    outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))
        for name, (shape, _) in noise.items()
    ]
    graph = helper.make_graph(nodes, "dropout_noise", [], outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )


FUSED_PREFIX = "optimizer/"

DEVICE_SCALING_LIMIT = 2**23
"""The most elements of parameters and optimizer slots for which a mixed-precision
:class:`CudaGraphStep` decides the loss scale on the GPU. Deciding there keeps every value
that a skipped step would change with a ``Where`` over all of them (about 5 ps an element on an
H100: 1.7 ms a step for BERT-base's 330M under AdamW), while deciding on the host costs a read
of the finite flag and a second graph launch (0.04-0.09 ms a step on an H100): the fp16 MLP
step took 0.20 ms against 0.24-0.29 on the host, BERT-base 31.0 ms against 29.3."""
IN_PLACE_BYTES = 2**29
"""From how many bytes of parameters and optimizer slots a :class:`CudaGraphStep` of a model
without running statistics runs the optimizer as a captured graph of its own that writes them
in place, rather than fused into the training graph over a second copy of each. Fused, a
step is one launch (the small models' gain: the MLP's step is a fifth of a millisecond); in
place, the state is held once at the cost of a second launch and the second session's own
allocations. On an H200: BERT-base under AdamW (1.2 GiB of state) held 6.5 GiB in place
against 8.3 fused, at the same speed; ResNet-50 under SGD with momentum (0.2 GiB) 10.9
against 10.3."""
KERNEL_BYTES = 2**24
"""From how many bytes of parameters and optimizer slots a :class:`CudaGraphStep` (outside
data-parallel training) whose optimizer is not fused into the training graph (a mixed-precision
step that decides the loss scale on the host) updates them in place with the optimizer's CUDA
kernel (:attr:`~traingraph.runtime.optimizer.OptimizerUpdate.device_kernel`) rather than a
captured optimizer graph over a second copy. Above :data:`IN_PLACE_BYTES` the kernel runs
wherever it exists. A fused step of ResNet-50 under SGD (0.2 GiB of state) held 10.1 GiB on an
H200 against 10.9 with the kernel, at 62.7 against 61.7 ms; its fp16 step, which the host
decides, 8.1 GiB against 7.5 at 56.8 against 56.2 ms."""
_MAX_CONCAT = 32


def fuse_step_model(
    train: onnx.ModelProto,
    optimizer: onnx.ModelProto,
    flat: FlatLayout,
    grads: Mapping[str, tuple[int, Spec]],
    scaler: DynamicLossScaler | None = None,
) -> onnx.ModelProto | None:
    """One model for a whole step: the training graph ``train`` followed by the flat optimizer
    graph ``optimizer``, so a step is one session run (one CUDA graph launch and one wait).

    The gradients the training graph outputs one by one are flattened and concatenated, with
    zeros where the state's block pads between tensors, into the gradient vector of each chunk
    of the flat optimizer (:attr:`FlatLayout.chunks`), which is also an output (to be bound to
    the gradients' block, so they stay inspectable). A chunk's update can run once its own
    gradients are computed. The optimizer's names all get :data:`FUSED_PREFIX`.

    With a loss ``scaler`` (``train`` takes :data:`~traingraph.precision.LOSS_SCALE` and
    returns :data:`~traingraph.precision.GRADS_FINITE`), the model also decides the update:
    each new parameter and slot is ``Where(finite, new, current)``, the scale and its counters
    follow :func:`~traingraph.runtime.amp.device_update_nodes`, and the optimizer's ``step`` is
    the :data:`~traingraph.runtime.amp.STEP_COUNT` input plus one; the scaler's tensors
    (:data:`~traingraph.runtime.amp.COUNTERS`) are inputs, each with an output ``<name>_out``.

    Args:
        train: The training model (static shapes).
        optimizer: An optimizer model over the flat blocks' chunks, as ``flat`` describes.
        flat: How the optimizer model's inputs lie in the state's blocks.
        grads: Parameter -> (offset in the gradients' block, spec), for every gradient output
            ``<parameter>_grad`` of ``train``.
        scaler: The loss scaler whose rule the model applies, or None (no loss scaling).

    Returns:
        The fused model, or None where the two models import different versions of an
        opset, their names collide or the gradients have several dtypes.
    """
    versions: dict[str, int] = {}
    for model in (train, optimizer):
        for entry in model.opset_import:
            if versions.setdefault(entry.domain, entry.version) != entry.version:
                return None
    ours = onnx.compose.add_prefix(optimizer, FUSED_PREFIX)
    fused = copy.deepcopy(train)
    graph = fused.graph
    names = {v.name for v in (*graph.input, *graph.output, *graph.initializer)}
    names |= {out for node in graph.node for out in node.output}
    if any(name.startswith(FUSED_PREFIX) for name in names):
        return None
    dtypes = {spec[1] for _, spec in grads.values()}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    flat_shape = f"{FUSED_PREFIX}flatten_shape"
    graph.initializer.append(helper.make_tensor(flat_shape, TensorProto.INT64, [1], [-1]))
    ranges = sorted(
        (offset, offset + int(np.prod(shape, dtype=np.int64)), name)
        for name, (offset, (shape, _)) in grads.items()
    )
    flattened: dict[str, str] = {}
    for _, _, name in ranges:
        flattened[name] = f"{FUSED_PREFIX}{name}_grad_flat"
        reshape = helper.make_node("Reshape", [f"{name}_grad", flat_shape], [flattened[name]])
        graph.node.append(reshape)

    padding: set[str] = set()

    def zeros(n: int) -> str:
        name = f"{FUSED_PREFIX}zeros_{n}"
        if name not in padding:
            graph.initializer.append(numpy_helper.from_array(np.zeros(n, dtype), name))
            padding.add(name)
        return name

    def piece(name: str, start: int, stop: int, lo: int, hi: int) -> str:
        """The part ``[lo, hi)`` of parameter ``name``'s gradient, at ``[start, stop)``."""
        if (lo, hi) == (start, stop):
            return flattened[name]
        out = f"{FUSED_PREFIX}{name}_grad_{lo}"
        bounds = [f"{out}_{edge}" for edge in ("starts", "ends")]
        for bound, value in zip(bounds, (lo - start, hi - start)):
            graph.initializer.append(helper.make_tensor(bound, TensorProto.INT64, [1], [value]))
        graph.node.append(helper.make_node("Slice", [flattened[name], *bounds], [out]))
        return out

    vectors = []
    for chunk, lo, hi in flat.chunks:
        pieces: list[str] = []
        end = lo
        for start, stop, name in ranges:
            if stop <= lo or start >= hi:
                continue
            if max(start, lo) > end:
                pieces.append(zeros(max(start, lo) - end))
            pieces.append(piece(name, start, stop, max(start, lo), min(stop, hi)))
            end = min(stop, hi)
        if hi > end:
            pieces.append(zeros(hi - end))
        # onnxruntime's CUDA Concat takes at most 32 inputs inside a graph capture.
        while len(pieces) > _MAX_CONCAT:
            groups = [pieces[i : i + _MAX_CONCAT] for i in range(0, len(pieces), _MAX_CONCAT)]
            pieces = []
            for group in groups:
                part = f"{FUSED_PREFIX}grad_part_{len(graph.node)}"
                graph.node.append(helper.make_node("Concat", group, [part], axis=0))
                pieces.append(part)
        vector = f"{FUSED_PREFIX}{chunk}_grad"
        if len(pieces) == 1:
            graph.node.append(helper.make_node("Identity", pieces, [vector]))
        else:
            graph.node.append(helper.make_node("Concat", pieces, [vector], axis=0))
        vectors.append(helper.make_tensor_value_info(vector, elem, [hi - lo]))
    grad_outputs = {f"{name}_grad" for name in grads}
    kept = [o for o in graph.output if o.name not in grad_outputs]
    del graph.output[:]
    graph.output.extend(kept)
    graph.output.extend(vectors)
    computed = {v.name for v in vectors}
    graph.input.extend(i for i in ours.graph.input if i.name not in computed)
    graph.initializer.extend(ours.graph.initializer)
    graph.node.extend(ours.graph.node)
    graph.output.extend(ours.graph.output)
    graph.value_info.extend(ours.graph.value_info)
    # the scaler's update uses GreaterOrEqual (opset 12)
    if scaler is not None and (versions.get("", 0) < 12 or not _decide_on_device(graph, scaler)):
        return None
    del fused.opset_import[:]
    fused.opset_import.extend(helper.make_opsetid(d, v) for d, v in versions.items())
    fused.ir_version = max(train.ir_version, optimizer.ir_version)
    return fused


def _decide_on_device(graph: onnx.GraphProto, scaler: DynamicLossScaler) -> bool:
    """Make the fused ``graph`` apply its update only where the gradients are finite, and
    update the loss scaler's tensors (see :func:`fuse_step_model`). False where ``graph`` is not
    a mixed-precision training graph fused with a flat optimizer."""
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    step = f"{FUSED_PREFIX}step"
    if LOSS_SCALE not in inputs or GRADS_FINITE not in outputs or step not in inputs:
        return False
    if any(name in inputs for name in COUNTERS if name != LOSS_SCALE):
        return False
    kept = [i for i in graph.input if i.name != step]
    del graph.input[:]
    graph.input.extend(kept)
    one = f"{FUSED_PREFIX}step_one"
    graph.initializer.append(helper.make_tensor(one, TensorProto.INT64, [], [1]))
    graph.node.insert(0, helper.make_node("Add", [STEP_COUNT, one], [step]))
    for name, (shape, dtype) in COUNTERS.items():
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        if name != LOSS_SCALE:
            graph.input.append(helper.make_tensor_value_info(name, elem, list(shape)))
        graph.output.append(helper.make_tensor_value_info(f"{name}_out", elem, list(shape)))
    # Each new parameter and slot ``<x>_out`` of the optimizer: its current value where the
    # gradients are not all finite.
    selected = [
        o.name
        for o in graph.output
        if o.name.startswith(FUSED_PREFIX)
        and o.name.endswith("_out")
        and o.name[: -len("_out")] in inputs
    ]
    renamed = {name: f"{name}_new" for name in selected}
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name in renamed:
                node.output[i] = renamed[name]
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    for name in selected:
        current = name[: -len("_out")]
        graph.node.append(
            helper.make_node("Where", [GRADS_FINITE, renamed[name], current], [name])
        )
    nodes, constants = device_update_nodes(scaler, GRADS_FINITE, f"{FUSED_PREFIX}scaler/")
    graph.node.extend(nodes)
    graph.initializer.extend(constants)
    return True


class GpuCounters:
    """The loss scaler's tensors (:data:`~traingraph.runtime.amp.COUNTERS`: the scale, its
    counters and the applied step count) on the GPU, double-buffered like the parameters: a
    fused step reads ``pair.cur`` and writes ``pair.alt``. As the
    :class:`~traingraph.runtime.amp.DeviceCounters` of ``scaler`` and ``state``, it reads them
    back when the host reads its copies, and writes the host's values before the next step
    where the host set one."""

    def __init__(self, device: Device, scaler: DynamicLossScaler, state: TrainingState) -> None:
        self.pair = PingPong(TensorStore(device, COUNTERS))
        self.scaler, self.state = scaler, state
        self._host_current = True
        self._device_current = False
        scaler.counters = self
        state.counters = self

    def pull(self) -> None:
        if self._host_current:
            return
        cur = self.pair.cur
        self.scaler.mirror(
            float(cur.read(LOSS_SCALE)), int(cur.read(GOOD_STEPS)), int(cur.read(SKIPPED_STEPS))
        )
        self.state.mirror_step(int(cur.read(STEP_COUNT)))
        self._host_current = True

    def host_changed(self) -> None:
        self._device_current = False

    def push(self) -> None:
        """Write the host's values to the current copy, where the host set one since."""
        if self._device_current:
            return
        scaler = self.scaler
        values = {
            LOSS_SCALE: scaler.scale,
            GOOD_STEPS: scaler.good_steps,
            SKIPPED_STEPS: scaler.skipped_steps,
            STEP_COUNT: self.state.step,
        }
        self.pair.cur.write_all({n: np.array(v, COUNTERS[n][1]) for n, v in values.items()})
        self._device_current = True

    def advance(self) -> None:
        """A step wrote ``pair.alt``: it becomes the current copy."""
        self.pair.swap()
        self._host_current = False


class CudaGraphStep:
    """One training step (forward, gradients, optimizer update) replayed as CUDA graphs.

    The step overwrites the gradients each time (no accumulation) and updates the
    ``module``'s training state in place, so the module's parameters, checkpoints and eval
    mode see every step. Batches must keep the shape and dtype of the first one.

    The sessions are created on the first call, with the module's ``session_config`` (its
    CUDA options: TF32, cuDNN algorithm search, memory limits) plus ``cuda_graph=True``, from a
    copy of the training graph whose input shapes are fixed to the first batch's
    (:func:`with_static_inputs`) and whose Dropouts read fresh random numbers that a small
    uncaptured session draws before each step (:func:`dropout_from_noise`). Where the
    optimizer updates the state's flat blocks and there is no loss scaler, the training and
    optimizer graphs run as one (:func:`fuse_step_model`).

    Args:
        module: An ``api.Module`` (or anything with a training-model ``step``) on a CUDA
            device, in training mode.
        optimizer_uri: Path of ``optimizer_model.onnx`` (its
            :class:`~traingraph.runtime.optimizer.OptimizerUpdate` is then :attr:`optimizer`),
            or an ``api.Optimizer`` of ``module`` (then :attr:`optimizer` itself). Either has
            the learning rate; the step count is ``step.optimizer_update.state.step``.
    """

    writes_in_place = True
    """Whether a large state (:data:`IN_PLACE_BYTES`) is updated in place by a separate
    optimizer graph (the data-parallel step keeps both copies)."""

    kernel_always = False
    """Whether the optimizer's CUDA kernel makes every update where it compiles, whatever the
    state's size (the data-parallel step, whose update is otherwise a graph of its own after
    the gradients' average)."""

    def __init__(
        self, module: HasTrainStep, optimizer_uri: str | os.PathLike | HasOptimizerUpdate
    ) -> None:
        step = module.step
        device = step.device
        if device.kind != "cuda":
            raise DeviceError(
                f"CudaGraphStep needs a Module on a CUDA device; this one runs on {device}."
                " Create it with Module(..., device='cuda')"
            )
        if not isinstance(step.model, (str, os.PathLike)):
            raise ModelError("CudaGraphStep needs the step of a training model file")
        self.module = module
        self.step = step
        self.optimizer: OptimizerUpdate | HasOptimizerUpdate
        if isinstance(optimizer_uri, (str, os.PathLike)):
            self.optimizer = self.optimizer_update = OptimizerUpdate(
                onnx.load(os.fspath(optimizer_uri)),
                step.state,
                step.trainable,
                step.config,
                where=f"the optimizer model {os.fspath(optimizer_uri)!r}",
            )
        else:
            self.optimizer, self.optimizer_update = optimizer_uri, optimizer_uri.update
        if self.optimizer_update.state is not step.state:
            raise ModelError("the optimizer given to CudaGraphStep belongs to another module")
        self.device = device
        config = step.config
        # The step's sessions share one stream, on which the batch is copied asynchronously
        # from page-locked memory (unless the caller chose a stream of their own).
        self._stream = (
            None if "user_compute_stream" in config.cuda_extra else shared_stream(device.index)
        )
        if self._stream is not None:
            extra = {**config.cuda_extra, "user_compute_stream": str(self._stream.handle)}
            config = dataclasses.replace(config, cuda_extra=extra)
        self._config = dataclasses.replace(config, cuda_graph=True)
        self._train: ort.InferenceSession | None = None
        self._optim: ort.InferenceSession | None = None
        # What the host writes before each step (the batch and the scalars), and outputs.
        self._feeds: StagedInputs | TensorStore | None = None
        self._outputs: TensorStore | None = None
        self._finite = TensorStore(device, {GRADS_FINITE: ((), np.dtype(np.bool_))})
        self._graphs: dict[tuple[int, ...], tuple[int, Any, Any, tuple[object, ...]]] = {}
        self._noise: TensorStore | None = None
        self._noise_session: ort.InferenceSession | None = None
        self._noise_binding: Any = None
        # Where the fused step decides the loss scale on the GPU.
        self._counters: GpuCounters | None = None
        # What a separate optimizer graph writes in place, and the graphs it has captured.
        self._in_place = InPlace()
        self._optim_captured: set[int] = set()
        # Whether the update is the optimizer's CUDA kernel (OptimizerUpdate.device_kernel).
        self._kernel = False

    def _capture_sessions(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Create the sessions for batches shaped like ``arrays``, and the buffers they bind."""
        specs = {n: (tuple(a.shape), a.dtype) for n, a in arrays.items()}
        feeds = {
            **specs,
            "learning_rate": ((), np.dtype(np.float32)),
            "step": ((), np.dtype(np.int64)),
            LOSS_SCALE: ((), np.dtype(np.float32)),
        }
        self._feeds = (
            TensorStore(self.device, feeds)
            if self._stream is None
            else StagedInputs(self.device, feeds, self._stream)
        )
        assert isinstance(self.step.model, (str, os.PathLike))
        static = with_static_inputs(
            self.step.model, {n: shape for n, (shape, _) in specs.items()}
        )
        static, noise = dropout_from_noise(static)
        static = for_capture(static)
        if noise:
            self._noise = TensorStore(self.device, noise)
            session = create_cuda_session(noise_model(noise), self.device, self.step.config)
            self._noise_binding = session.io_binding()
            for name in noise:
                self._noise_binding.bind_ortvalue_output(name, self._noise.ortvalue(name))
            self._noise_session = session
        update = self.optimizer_update
        state_bytes = self._state_bytes() if self.writes_in_place else 0
        large = state_bytes >= IN_PLACE_BYTES
        kernel = self.writes_in_place and update.device_kernel is not None
        # One buffer layout only: a step that also swaps running statistics alternates between
        # two captured graphs, which the in-place capture has not been shown to handle.
        in_place = large and not self.step.buffer_outputs
        fused = None if in_place or (large and kernel) else self._fused_model(static)
        # The update as one kernel queued after the captured graph, in place (outside
        # onnxruntime's capture, so any number of buffer layouts): for a large state, and where
        # the optimizer would otherwise be a graph of its own (a loss scaler decided on the
        # host), after the host has read that the gradients are finite.
        self._kernel = fused is None and (
            (kernel and (large or state_bytes >= KERNEL_BYTES))
            or (self.kernel_always and update.device_kernel is not None)
        )
        if self._kernel:
            self._train = self._session(static)
            self._in_place = InPlace(parameters=True, slots=True)
        elif fused is not None:
            self._train = self._session(fused)
        else:
            self._train = self._session(static)
            self._optim = create_cuda_session(update.graph_model, self.device, self._config)
            if in_place:
                self._in_place = update.in_place
        self._outputs = TensorStore(self.device, self._static_outputs(self._train))

    def _session(self, model: onnx.ModelProto) -> Any:
        """The session of the training step: with ``cuda_segments``, cut around traingraph's
        CUDA kernels and captured as one graph where any applies
        (:mod:`~traingraph.runtime.cuda.segments`); else one onnxruntime session that
        captures its own."""
        from traingraph.runtime.cuda.segments import segmented_session

        if self._config.cuda_segments:
            segmented = segmented_session(model, self.device, self._config, self._stream)
            if segmented is not None:
                return segmented
        return create_cuda_session(model, self.device, self._config)

    def _state_bytes(self) -> int:
        """The bytes of the parameters and optimizer slots an update writes."""
        state = self.step.state
        slots = state.optimizer_slots
        stores = [state.trainable.cur, *([] if slots is None else [slots.cur])]
        return sum(store.nbytes for store in stores)

    def _fused_model(self, static: onnx.ModelProto) -> onnx.ModelProto | None:
        """The training and optimizer graphs as one model (:func:`fuse_step_model`), where the
        optimizer runs over the state's flat blocks; else None. With a loss scaler, the model
        decides the update and the scale on the GPU (:class:`GpuCounters`) where the
        parameters and slots hold at most :data:`DEVICE_SCALING_LIMIT` elements."""
        flat, state = self.optimizer_update.flat, self.step.state
        offsets = state.grads.offsets
        if flat is None or offsets is None:
            return None
        grads = {n: (offsets[n], state.grads.specs[n]) for n in self.step.trainable}
        scaler = self.step.loss_scaler
        if scaler is not None and flat.size * (1 + len(flat.kinds)) > DEVICE_SCALING_LIMIT:
            return None
        fused = fuse_step_model(static, self.optimizer_update.graph_model, flat, grads, scaler)
        if fused is not None and scaler is not None:
            # Steps of one module (batches of several shapes) share the GPU's counters.
            shared = state.counters
            if isinstance(shared, GpuCounters) and shared.scaler is scaler:
                self._counters = shared
            else:
                self._counters = GpuCounters(self.device, scaler, state)
        return fused

    def _static_outputs(
        self, session: ort.InferenceSession
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        infos = {o.name: o for o in session.get_outputs()}
        specs = {}
        for name in self.step.outputs:
            info = infos[name]
            dtype = ort_type_to_numpy(info.type)
            if dtype is None or not all(isinstance(d, int) for d in info.shape):
                raise ModelError(
                    f"output {name!r} has shape {info.shape} and type {info.type}; a CUDA graph"
                    " needs static output shapes"
                )
            specs[name] = (tuple(info.shape), dtype)
        return specs

    def __call__(self, *batch: np.ndarray, fetch_loss: bool = False) -> np.ndarray | None:
        """Run one step on ``batch`` (in ``module.input_names()`` order).

        Args:
            batch: The data inputs then the labels, as host arrays.
            fetch_loss: Copy the outputs back to the host and return the first (the loss);
                otherwise they stay on the GPU and nothing waits for the host.

        Returns:
            The loss as a numpy array when ``fetch_loss``, else None.
        """
        step, state = self.step, self.step.state
        names = step.inputs
        if len(batch) != len(names):
            raise ModelError(f"got {len(batch)} inputs, but the training model takes {names}")
        arrays = {n: np.ascontiguousarray(a) for n, a in zip(names, batch)}
        if self._feeds is None:
            self._capture_sessions(arrays)
        assert self._feeds is not None and self._outputs is not None
        assert self._train is not None
        for name, array in arrays.items():
            shape, dtype = self._feeds.specs[name]
            if array.shape != shape or array.dtype != dtype:
                raise ModelError(
                    f"input {name!r} has shape {list(array.shape)} and dtype {array.dtype};"
                    f" this CUDA graph step was captured for {list(shape)} {dtype}: every batch"
                    " must match the first (drop the last partial batch)"
                )
        assert state.learning_rate is not None
        scaler = step.loss_scaler
        feeds = {**arrays, "learning_rate": np.array(state.learning_rate, np.float32)}
        counters = self._counters
        if counters is not None:
            counters.push()  # the step count and the scale are on the GPU
        else:
            feeds["step"] = np.array(state.step + 1, np.int64)
            if scaler is not None:
                feeds[LOSS_SCALE] = np.array(scaler.scale, np.float32)
        self._feeds.write_all(feeds)
        graph_id, train_binding, optim_binding, _ = self._graph_for_layout()
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        if self._noise_session is not None:
            self._noise_session.run_with_iobinding(self._noise_binding)
        self._train.run_with_iobinding(train_binding, options)
        if step.buffer_outputs:
            state.buffers.swap()
        if counters is not None:
            # The step applied the update or kept the values, and counted it, on the GPU.
            state.trainable.swap()
            assert state.optimizer_slots is not None
            state.optimizer_slots.swap()
            counters.advance()
            state.grads_valid = True
            state.reset_grads_pending = True
            return self._outputs.read(step.outputs[0]) if fetch_loss else None
        finite = scaler is None or scaler.update(bool(self._finite.read(GRADS_FINITE)))
        if finite and self._kernel:
            self._before_kernel_update()
            handle = self._stream_handle()
            self.optimizer_update.queue_device_update(handle)  # counts the step
            # done before the host reads the state (onnxruntime's copies do not wait for the
            # stream), as the captured graph's run is done when it returns
            synchronize(handle)
        elif finite:
            if self._optim is not None:
                self._run_optimizer(graph_id, optim_binding, options)
            if not self._in_place.parameters:
                state.trainable.swap()
            assert state.optimizer_slots is not None
            if not self._in_place.slots:
                state.optimizer_slots.swap()
            state.step += 1
        state.grads_valid = True
        state.reset_grads_pending = True
        if not fetch_loss:
            return None
        return self._outputs.read(step.outputs[0])

    def _before_kernel_update(self) -> None:
        """What runs between the training graph and the optimizer's kernel (nothing here; the
        data-parallel step averages the gradients)."""

    def _stream_handle(self) -> int:
        """The address of the stream the step's sessions run on."""
        if self._stream is not None:
            return self._stream.handle
        return int(self._config.cuda_extra["user_compute_stream"])

    def _run_optimizer(self, graph_id: int, binding: Any, options: ort.RunOptions) -> None:
        """Run the separate optimizer graph; the first time for ``graph_id`` onnxruntime
        captures it, running it more than once, so what it writes in place (and the
        gradients, which a data-parallel step averages before each run) is put back and the
        run repeated, now a replay."""
        assert self._optim is not None
        if graph_id in self._optim_captured or not any(dataclasses.astuple(self._in_place)):
            self._optim.run_with_iobinding(binding, options)
            return
        state = self.step.state
        assert state.optimizer_slots is not None
        stores = [
            *([state.trainable.cur] if self._in_place.parameters else []),
            *([state.optimizer_slots.cur] if self._in_place.slots else []),
            state.grads,
        ]
        saved = [store.read_flat() for store in stores]
        self._optim.run_with_iobinding(binding, options)
        for store, values in zip(stores, saved):
            store.write_flat(values)
        self._optim_captured.add(graph_id)
        self._optim.run_with_iobinding(binding, options)

    def _graph_for_layout(self) -> tuple[int, Any, Any, tuple[object, ...]]:
        """The bindings (and graph id) for the state's current buffer layout, made once."""
        state = self.step.state
        slots = state.optimizer_slots
        assert slots is not None
        in_place = self._in_place
        stores: tuple[object, ...] = (
            state.trainable.cur,
            *(() if in_place.parameters else (state.trainable.alt,)),
            state.buffers.cur,
            state.buffers.alt,
            slots.cur,
            *(() if in_place.slots else (slots.alt,)),
            state.grads,
            state.fixed,
            *(() if self._counters is None else (self._counters.pair.cur,)),
        )
        key = tuple(id(s) for s in stores)
        if key not in self._graphs:
            train = self._bind_train()
            if self._kernel:
                optim = None
            elif self._optim is None:
                self._bind_optimizer(train, FUSED_PREFIX)
                optim = None
            else:
                optim = self._bind_optimizer(self._optim.io_binding())
            # The stores stay referenced, so their ids stay unique.
            self._graphs[key] = (len(self._graphs), train, optim, stores)
        return self._graphs[key]

    def _bind_train(self) -> Any:
        step, state = self.step, self.step.state
        assert self._feeds is not None and self._outputs is not None and self._train is not None
        binding = self._train.io_binding()
        for name in step.inputs:
            binding.bind_ortvalue_input(name, self._feeds.ortvalue(name))
        for name in step.param_inputs:
            binding.bind_ortvalue_input(name, state.ortvalue(name))
        if self._noise is not None:
            for name in self._noise:
                binding.bind_ortvalue_input(name, self._noise.ortvalue(name))
        if self._optim is not None or self._kernel:
            for name, out in step.grad_outputs.items():
                binding.bind_ortvalue_output(out, state.grads.ortvalue(name))
        for out, buffer in step.buffer_outputs.items():
            binding.bind_ortvalue_output(out, state.buffers.alt.ortvalue(buffer))
        for name in step.outputs:
            binding.bind_ortvalue_output(name, self._outputs.ortvalue(name))
        if step.loss_scaler is not None:
            scale = (
                self._feeds.ortvalue(LOSS_SCALE)
                if self._counters is None
                else self._counters.pair.cur.ortvalue(LOSS_SCALE)
            )
            binding.bind_ortvalue_input(LOSS_SCALE, scale)
            binding.bind_ortvalue_output(GRADS_FINITE, self._finite.ortvalue(GRADS_FINITE))
        return binding

    def _bind_optimizer(self, binding: Any, prefix: str = "") -> Any:
        """Bind the optimizer graph's inputs and outputs (their names after ``prefix``)."""
        assert self._feeds is not None
        binding.bind_ortvalue_input(f"{prefix}learning_rate", self._feeds.ortvalue("learning_rate"))
        counters = self._counters if prefix else None
        if counters is None:
            binding.bind_ortvalue_input(f"{prefix}step", self._feeds.ortvalue("step"))
        else:
            # The fused model counts the steps (its optimizer reads the count plus one).
            for name in COUNTERS:
                if name != LOSS_SCALE:
                    binding.bind_ortvalue_input(name, counters.pair.cur.ortvalue(name))
                binding.bind_ortvalue_output(f"{name}_out", counters.pair.alt.ortvalue(name))
        flat = self.optimizer_update.flat
        inputs, outputs = optimizer_io(self.step.state, flat, self._in_place)
        computed = {f"{name}_grad" for name, _, _ in flat.chunks} if flat is not None else set()
        for name, value in inputs.items():
            if prefix and name in computed:
                # The fused graph computes the gradient vector and writes it to the block.
                binding.bind_ortvalue_output(f"{prefix}{name}", value)
            else:
                binding.bind_ortvalue_input(f"{prefix}{name}", value)
        for name, value in outputs.items():
            binding.bind_ortvalue_output(f"{prefix}{name}", value)
        return binding
