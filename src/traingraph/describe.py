"""One-screen descriptions of an ONNX model and of a checkpoint, as ``traingraph info`` prints.

A model's description names its inputs, outputs, parameters, op types and opsets, and the
nodes on a float path that have no gradient rule; a checkpoint's, its parameters (trainable or
frozen), optimizer state and properties.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["checkpoint_lines", "lacking_rules", "model_lines"]


def _format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _parameter_lines(arrays: dict[str, Any], trainable: dict[str, bool] | None) -> list[str]:
    total = sum(int(np.prod(a.shape)) for a in arrays.values())
    size = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays.values())
    lines = [f"parameters: {len(arrays)} tensors, {total:,} values, {_format_bytes(size)}"]
    shown = list(arrays.items())[:40]
    width = max((len(n) for n, _ in shown), default=0)
    for name, a in shown:
        flag = "" if trainable is None else ("  trainable" if trainable.get(name) else "  frozen")
        dims = "[" + ", ".join(str(d) for d in a.shape) + "]"
        lines.append(f"  {name:<{width}}  {np.dtype(a.dtype).name:<8} {dims}{flag}")
    if len(arrays) > len(shown):
        lines.append(f"  ... and {len(arrays) - len(shown)} more")
    return lines


def lacking_rules(model: Any) -> list[Any]:
    """The nodes on a float path from an input or initializer that have no gradient rule."""
    from traingraph.autodiff.engine import NON_DIFFERENTIABLE
    from traingraph.autodiff.registry import get_rule
    from traingraph.ir.builder import is_float
    from traingraph.ir.model import default_opset, load_ir

    m = load_ir(model)
    opset = default_opset(m)
    live = {v for v in [*m.graph.inputs, *m.graph.initializers.values()] if is_float(v)}
    lacking = []
    for node in m.graph:
        if node.op_type in NON_DIFFERENTIABLE or not any(v in live for v in node.inputs):
            continue
        live.update(o for o in node.outputs if o.dtype is None or is_float(o))
        if get_rule(node.domain, node.op_type, opset) is None:
            lacking.append(node)
    return lacking


def model_lines(path: Path, model: Any) -> list[str]:
    """The description of ``model`` (an ``onnx.ModelProto`` read from ``path``)."""
    import onnx

    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}

    def tensor(v: onnx.ValueInfoProto) -> str:
        t = v.type.tensor_type
        dims = [d.dim_param or str(d.dim_value) for d in t.shape.dim]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name
        return f"{v.name} {dtype} [{', '.join(dims)}]"

    initializers = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    counts = collections.Counter(n.op_type for n in model.graph.node)
    lacking = lacking_rules(model)
    lines = [
        f"{path}: ONNX model, IR version {model.ir_version}, opset"
        f" {', '.join(f'{d} {v}' for d, v in opsets.items())}"
        + (f", producer {model.producer_name}" if model.producer_name else ""),
        "inputs:  " + "; ".join(tensor(i) for i in model.graph.input if i.name not in initializers),
        "outputs: " + "; ".join(tensor(o) for o in model.graph.output),
        *_parameter_lines(initializers, None),
        f"ops ({len(model.graph.node)} nodes): "
        + ", ".join(f"{op} x{c}" if c > 1 else op for op, c in sorted(counts.items())),
    ]
    if lacking:
        lines.append(f"gradients: {len(lacking)} node(s) on a float path have no gradient rule:")
        lines += [f"  op {n.op_type} at node {n.name or '<unnamed>'!r}" for n in lacking]
        lines.append(
            "  Training fails if one of them lies between a parameter and the loss: register a"
            " rule with traingraph.autodiff.register_gradient, or re-export the model without"
            " these ops."
        )
    else:
        lines.append("gradients: every op on a float path has a gradient rule")
    return lines


def checkpoint_lines(path: Path) -> list[str]:
    """The description of the checkpoint at ``path`` (either format)."""
    from traingraph.checkpoint import detect_format, load_checkpoint_data

    data = load_checkpoint_data(path)
    formats = {"native": "traingraph (safetensors)", "ort": "onnxruntime-training"}
    kind = formats[detect_format(path)]
    lines = [f"{path}: checkpoint, {kind} format" + (", nominal" if data.nominal else "")]
    lines += _parameter_lines(data.parameters, data.requires_grad)
    slots = sorted({s for slot in data.optimizer_state.values() for s in slot})
    lr = "unknown" if data.learning_rate is None else f"{data.learning_rate:g}"
    lines.append(
        f"optimizer: step {data.optimizer_step}, learning rate {lr}, state"
        f" {', '.join(slots) if slots else 'none'}"
    )
    if data.properties:
        shown = {k: (str(v) if len(str(v)) <= 60 else str(v)[:57] + "...")
                 for k, v in data.properties.items()}  # fmt: skip
        lines.append("properties: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    return lines
