"""The optimizer model: one ONNX graph that applies an optimizer step to every parameter.

Inputs, in order: ``learning_rate`` (float32 scalar), ``step`` (int64 scalar, the 1-based
number of the step being taken), every parameter ``p``, every gradient ``f"{p}_grad"``, then
every state slot by its name. Outputs: every ``f"{p}_out"``, then every ``f"{slot}_out"``.
The graph holds default-domain ops only.

Example:
    >>> params = {"fc.weight": w, "fc.bias": bias}
    >>> proto = build_optimizer_model(AdamW(lr=1e-3), [ParamInfo(n, a.shape, a.dtype) ...])
    >>> state = init_state(AdamW(lr=1e-3), params)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir

from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import MIN_OPSET, max_ir_version, max_supported_opset, to_proto
from traingraph.optim.alias import Optimizer
from traingraph.optim.transforms import ParamInfo, StateSlot, UpdateContext

Params = Sequence[ParamInfo] | Mapping[str, np.ndarray]


def param_infos(params: Params) -> list[ParamInfo]:
    """``params`` as :class:`ParamInfo`; a mapping of names to arrays is described by them."""
    if isinstance(params, Mapping):
        return [
            ParamInfo(name, tuple(np.shape(a)), np.asarray(a).dtype) for name, a in params.items()
        ]
    infos = list(params)
    for p in infos:
        if not isinstance(p, ParamInfo):
            raise TypeError(
                "expected ParamInfo entries or a mapping of names to arrays; got"
                f" {type(p).__name__}"
            )
    return infos


def state_slots(optimizer: Optimizer, params: Params) -> list[StateSlot]:
    """The state tensors that ``optimizer`` keeps for ``params``, in the model's input order."""
    return optimizer.transform.init(param_infos(params))


def init_state(optimizer: Optimizer, params: Params) -> dict[str, np.ndarray]:
    """The initial value of every state slot, by slot name, in the model's input order."""
    return {
        slot.name: np.full(slot.shape, slot.init, dtype=slot.dtype)
        for slot in state_slots(optimizer, params)
    }


def _tensor(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> ir.Value:
    element = ir.DataType.from_numpy(np.dtype(dtype))
    return ir.Value(name=name, type=ir.TensorType(element), shape=ir.Shape(shape))


def _check(params: list[ParamInfo], opset: int) -> None:
    """Validate the parameters' dtypes (one float dtype) and the opset."""
    if not MIN_OPSET <= opset <= max_supported_opset():
        raise ValueError(
            f"opset {opset} is not supported; pass an opset from {MIN_OPSET} to"
            f" {max_supported_opset()}"
        )
    dtypes = {np.dtype(p.dtype) for p in params}
    if any(d.kind != "f" for d in dtypes) or len(dtypes) > 1:
        raise ValueError(
            "the optimizer model needs parameters of one floating-point dtype; got"
            f" {sorted(str(d) for d in dtypes)}. Optimize each dtype with its own model, or cast"
            " the parameters."
        )


def build_optimizer_model(
    optimizer: Optimizer, params: Sequence[ParamInfo], opset: int = 17
) -> onnx.ModelProto:
    """The ONNX model that takes one ``optimizer`` step on ``params``.

    Args:
        optimizer: The optimizer (a named one from :mod:`traingraph.optim.alias` or a custom
            ``Optimizer(name, lr, chain(...))``).
        params: The trainable parameters.
        opset: The default-domain opset of the model (13 to the newest onnxruntime supports).

    Returns:
        A model that passes ``onnx.checker.check_model(full_check=True)``; see the module
        docstring for its inputs and outputs.

    Raises:
        ValueError: For an unsupported opset, parameters of several (or non-float) dtypes, or
            names that clash.
    """
    infos = param_infos(params)
    b, inputs = _step_graph(optimizer, infos, opset, f"{optimizer.name}_step")
    new_values: dict[str, ir.Value] = {}
    if infos:
        like = inputs.params[0]
        ctx = UpdateContext(b, b.cast_like(inputs.lr, like), b.cast_like(inputs.step, like))
        updates, new_state = optimizer.transform.update(
            ctx, inputs.grads, dict(inputs.state), inputs.params
        )
        new_values = {p.name or "": b.Add(p, u) for p, u in zip(inputs.params, updates)}
        new_values.update(new_state)
    return _finish(b, inputs, new_values)


class _Inputs(NamedTuple):
    """The optimizer model's inputs (see the module docstring)."""

    lr: ir.Value
    step: ir.Value
    params: list[ir.Value]
    grads: list[ir.Value]
    state: dict[str, ir.Value]


def _step_graph(
    optimizer: Optimizer, infos: list[ParamInfo], opset: int, name: str
) -> tuple[OpBuilder, _Inputs]:
    """A builder on an empty optimizer graph named ``name`` that has the model's inputs.

    Raises:
        ValueError: As :func:`build_optimizer_model`.
    """
    _check(infos, opset)
    slots = state_slots(optimizer, infos)
    inputs = _Inputs(
        _tensor("learning_rate", np.dtype(np.float32), ()),
        _tensor("step", np.dtype(np.int64), ()),
        [_tensor(p.name, p.dtype, p.shape) for p in infos],
        [_tensor(f"{p.name}_grad", p.dtype, p.shape) for p in infos],
        {s.name: _tensor(s.name, s.dtype, s.shape) for s in slots},
    )
    names = [v.name or "" for v in (inputs.lr, inputs.step, *inputs.params, *inputs.grads)]
    names += [s.name for s in slots]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"the optimizer model's input names must be unique; {duplicates} appear more than"
            " once (parameter names clash with each other, with 'learning_rate' or 'step', or"
            " with gradient or state names). Rename the parameters."
        )
    graph = ir.Graph(
        [inputs.lr, inputs.step, *inputs.params, *inputs.grads, *inputs.state.values()],
        [],
        nodes=[],
        opset_imports={"": opset},
        name=name,
    )
    return OpBuilder(graph, opset, prefix="optim"), inputs


def _finish(b: OpBuilder, inputs: _Inputs, new_values: Mapping[str, ir.Value]) -> onnx.ModelProto:
    """The model with outputs ``f"{p}_out"`` then ``f"{slot}_out"``: each input's new value by
    name in ``new_values``, the input itself where it has none."""
    for value in [*inputs.params, *inputs.state.values()]:
        name = value.name or ""
        b.graph.outputs.append(_output(b, new_values.get(name, value), f"{name}_out", value))
    return to_proto(ir.Model(b.graph, ir_version=max_ir_version()))


FLAT = "parameters"
"""The name of the one parameter a flat optimizer model updates (suffixed where it clashes)."""


def flattenable(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` treats every element alike, so one update of all parameters
    concatenated equals the updates of each: False with a per-tensor norm clip or with
    parameters left out of the weight decay."""
    return flattenable_hyperparameters(optimizer.hyperparameters)


def flattenable_hyperparameters(hyperparameters: Mapping[str, Any]) -> bool:
    """:func:`flattenable` for an optimizer's recorded ``hyperparameters``."""
    return hyperparameters.get("max_grad_norm_per_tensor") is None and not (
        hyperparameters.get("no_decay") and hyperparameters.get("weight_decay")
    )


def build_flat_optimizer_model(
    optimizer: Optimizer, params: Params, opset: int = 17
) -> onnx.ModelProto:
    """The model of :func:`build_optimizer_model`, with the same inputs and outputs, computed as
    one update of all parameters concatenated.

    Parameters, gradients and each kind of state slot are flattened (1-D tensors as they are)
    and concatenated, updated once as a single vector, and split back. The update's elementwise
    ops run once instead of once per parameter, which matters where each op costs a kernel
    launch (a GPU): for AdamW on a model with 30 parameter tensors, about 20 kernels instead of
    600. Elementwise optimizers give the per-parameter model's numbers bit for bit; with
    ``clip_grad_norm`` the global norm is summed in another order.

    Args:
        optimizer: The optimizer; :func:`flattenable` must hold.
        params: The trainable parameters.
        opset: The default-domain opset of the model.

    Raises:
        ValueError: As :func:`build_optimizer_model`, or for an optimizer with a per-tensor
            norm clip (``max_grad_norm_per_tensor``), which is not elementwise.
    """
    infos = param_infos(params)
    if len(infos) < 2:
        return build_optimizer_model(optimizer, infos, opset)
    if not flattenable(optimizer):
        raise ValueError(
            f"{optimizer.name}: max_grad_norm_per_tensor clips each tensor by its own norm, so"
            " the update of the parameters concatenated differs; use build_optimizer_model"
        )
    b, inputs = _step_graph(optimizer, infos, opset, f"{optimizer.name}_flat_step")
    taken = {p.name for p in infos} | set(inputs.state)
    flat_name = FLAT
    while flat_name in taken or any(n.startswith(f"{flat_name}.") for n in taken):
        flat_name = f"_{flat_name}"
    sizes = [int(np.prod(p.shape, dtype=np.int64)) for p in infos]
    flat = ParamInfo(flat_name, (sum(sizes),), infos[0].dtype)
    kinds = [slot.name[len(flat_name) + 1 :] for slot in state_slots(optimizer, [flat])]
    row = b.ints([-1])

    def join(values: Sequence[ir.Value], name: str) -> ir.Value:
        rows = [v if v.shape is not None and len(v.shape) == 1 else b.Reshape(v, row)
                for v in values]  # fmt: skip
        joined = b.Concat(*rows, axis=0)
        joined.name = name
        joined.type, joined.shape = values[0].type, ir.Shape(flat.shape)
        return joined

    def split(value: ir.Value) -> list[ir.Value]:
        parts = b.op("Split", value, b.ints(sizes), num_outputs=len(infos), axis=0)
        return [
            part if len(p.shape) == 1 else b.Reshape(part, b.ints(list(p.shape)))
            for part, p in zip(parts, infos)
        ]

    flat_param = join(inputs.params, flat_name)
    flat_state = {
        f"{flat_name}.{kind}": join(
            [inputs.state[f"{p.name}.{kind}"] for p in infos], f"{kind}_flat"
        )
        for kind in kinds
    }
    ctx = UpdateContext(b, b.cast_like(inputs.lr, flat_param), b.cast_like(inputs.step, flat_param))
    updates, new_state = optimizer.transform.update(
        ctx, [join(inputs.grads, "grads_flat")], flat_state, [flat_param]
    )
    new_values = dict(zip((p.name for p in infos), split(b.Add(flat_param, updates[0]))))
    for kind in kinds:
        key = f"{flat_name}.{kind}"
        if key in new_state:
            slot_names = [f"{p.name}.{kind}" for p in infos]
            new_values.update(zip(slot_names, split(new_state[key])))
    return _finish(b, inputs, new_values)


def _output(b: OpBuilder, value: ir.Value, name: str, like: ir.Value) -> ir.Value:
    """``value`` as the graph output ``name``: itself, renamed, where a node of the graph
    computes it (a runtime then writes it into the output's buffer, where an ``Identity``
    would keep it in memory of its own until the end of the run and copy it there: for a
    flat update, a temporary the size of all the parameters per output); else an
    ``Identity`` of it (an input passed through, or a value that is an output already)."""
    if value.producer() is not None and not value.is_graph_output():
        value.name, value.type, value.shape = name, like.type, like.shape
        return value
    out = b.Identity(value)
    out.name, out.type, out.shape = name, like.type, like.shape
    return out


__all__ = [
    "build_flat_optimizer_model",
    "build_optimizer_model",
    "flattenable",
    "init_state",
    "param_infos",
    "state_slots",
]
