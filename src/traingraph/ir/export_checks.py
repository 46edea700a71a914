"""Signs that an ONNX model will not train as the model it was exported from.

An export made for inference loses what training needs: BatchNorm runs on its running
statistics or is folded into the Conv before it, Dropout is gone, and exporters turn values
computed from parameters into new initializers (``onnx::Mul_123``, ``val_12``,
``embedding_2``) that ``requires_grad=None`` would then train as parameters.
:func:`export_warnings` names what it finds; :func:`traingraph.artifacts.generate_artifacts`
warns with it and ``traingraph info`` prints it. :func:`traingraph.from_torch` exports in
train mode and records the trainable parameters (:data:`REQUIRES_GRAD_KEY`), so its models
raise none of these.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence

import onnx

__all__ = ["REQUIRES_GRAD_KEY", "export_warnings", "recorded_requires_grad"]

# Metadata key of the trainable parameters (a JSON list) that from_torch records.
REQUIRES_GRAD_KEY = "traingraph.requires_grad"
PYTORCH_PRODUCER = "pytorch"
_DEFAULT_DOMAINS = ("", "ai.onnx")
# Node metadata in which the dynamo exporter keeps the torch modules and functions of a node.
_SCOPE_KEYS = ("namespace", "pkg.torch.onnx.class_hierarchy", "pkg.torch.onnx.name_scopes")
_OTHER_NORMALIZATIONS = {
    "LayerNormalization", "GroupNormalization", "InstanceNormalization", "RMSNormalization",
    "SimplifiedLayerNormalization", "LpNormalization",
}  # fmt: skip
# Initializer names that exporters generate: TorchScript's "onnx::Mul_123", the dynamo
# exporter's "val_12" / "_val_12" and lifted constants, and an op's name with a counter
# ("embedding_2") where a torch parameter name would be a dotted module path.
_GENERATED = re.compile(
    r"^(onnx::.*|_?val_\d+|lifted_tensor_\d+|_?tensor_constant\d+|[a-z][a-z0-9]*(_[a-z0-9]+)*_\d+)$"
)
_SHOWN = 8


def recorded_requires_grad(model: onnx.ModelProto) -> list[str] | None:
    """The trainable parameters that :func:`traingraph.from_torch` recorded in ``model``, or
    None when it holds no such record."""
    for prop in model.metadata_props:
        if prop.key == REQUIRES_GRAD_KEY:
            return [str(n) for n in json.loads(prop.value)]
    return None


def export_warnings(
    model: onnx.ModelProto,
    requires_grad: Collection[str] | None = None,
    frozen_params: Collection[str] = (),
) -> list[str]:
    """What makes ``model`` look like an eval-mode export of a training model.

    Args:
        model: The model (its initializers need not hold their data).
        requires_grad: The initializers that will be trained; None: those that
            ``generate_artifacts`` trains by default (the recorded ones of a
            :func:`traingraph.from_torch` model, else every floating-point initializer but
            ``frozen_params`` and BatchNorm running statistics).
        frozen_params: Initializers kept frozen.

    Returns:
        One message per finding, naming the nodes or initializers; empty when none.
    """
    graph = model.graph
    trainable = _trainable(model, requires_grad, frozen_params)
    found = []
    # statistics held in the model (running statistics, perhaps behind an Identity), not
    # computed from the batch (the dynamo exporter's BatchNorm(track_running_stats=False))
    stored = {t.name for t in graph.initializer}
    for node in graph.node:
        reads = [v for v in node.input if v]
        if node.op_type == "Constant" or (reads and all(v in stored for v in reads)):
            stored.update(node.output)
    inference_bn = [
        node.name or f"#{i}"
        for i, node in enumerate(graph.node)
        if node.op_type == "BatchNormalization"
        and node.domain in _DEFAULT_DOMAINS
        and not _training_mode(node, _opset(model))
        and any(name in trainable for name in node.input[1:3])
        and all(name in stored for name in node.input[3:5])
    ]
    if inference_bn:
        found.append(
            f"{len(inference_bn)} BatchNormalization node(s) are in inference mode"
            f" (training_mode=0) while their scale or bias is trained: {_listed(inference_bn)}."
            " The model looks like an eval-mode export: traingraph trains these on batch"
            " statistics, but such an export may also have folded other BatchNorms into Convs"
            " and dropped Dropout. Export the module with traingraph.from_torch(model,"
            " example_inputs), which exports it in train mode."
        )
    # A from_torch model was exported in train mode; a Dropout of p=0 may still be gone.
    traces = _lost_layer_traces(model) if recorded_requires_grad(model) is None else []
    if traces:
        found.append(
            "the model comes from PyTorch and has Conv layers but no BatchNormalization or"
            f" Dropout, while names say it had them: {_listed(traces)}. It looks like an"
            " eval-mode export (BatchNorm folded into the Convs, Dropout removed), which"
            " trains another model. Export the module with traingraph.from_torch(model,"
            " example_inputs), which exports it in train mode."
        )
    generated = [
        i.name
        for i in graph.initializer
        if i.name in trainable and _looks_generated(i.name, model.producer_name)
    ]
    if generated:
        found.append(
            f"{len(generated)} initializer(s) that would be trained look generated by the"
            f" exporter rather than parameters: {_listed(generated)}. They are usually"
            " constants folded from a parameter (a BatchNorm folded into a Conv, a slice of a"
            " position embedding), and training them trains a copy, not the parameter. Export"
            " the module with traingraph.from_torch(model, example_inputs), or name the"
            " parameters to train with requires_grad=[...]."
        )
    return found


def _trainable(
    model: onnx.ModelProto, requires_grad: Collection[str] | None, frozen: Collection[str]
) -> set[str]:
    if requires_grad is None:
        requires_grad = recorded_requires_grad(model)
    if requires_grad is not None:
        return set(requires_grad)
    stats = {
        name
        for node in model.graph.node
        if node.op_type == "BatchNormalization"
        for name in node.input[3:5]
    }
    floats = {
        onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    }  # fmt: skip
    return {
        i.name
        for i in model.graph.initializer
        if i.data_type in floats and i.name not in stats and i.name not in frozen
    }


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), 0)


def _training_mode(node: onnx.NodeProto, opset: int) -> bool:
    if opset and opset < 14:
        # Before opset 14 a training BatchNorm is one that returns its statistics.
        return len([o for o in node.output if o]) > 1
    return any(a.name == "training_mode" and a.i == 1 for a in node.attribute)


def _lost_layer_traces(model: onnx.ModelProto) -> list[str]:
    """Names in a PyTorch model with Convs and no BatchNormalization or Dropout that mention
    BatchNorm (``bn``, ``batch_norm``, ``norm``) or Dropout."""
    graph = model.graph
    ops = {n.op_type for n in graph.node if n.domain in _DEFAULT_DOMAINS}
    if (
        model.producer_name != PYTORCH_PRODUCER
        or "Conv" not in ops
        or ops & {"BatchNormalization", "Dropout"}
    ):
        return []
    any_norm = not (ops & _OTHER_NORMALIZATIONS)
    names: list[str] = [i.name for i in graph.initializer]
    for node in graph.node:
        names.append(node.name)
        names += [p.value for p in node.metadata_props if p.key in _SCOPE_KEYS]
    traces: dict[str, None] = {}
    for name in names:
        for token in re.split(r"[^0-9A-Za-z_]+", name):
            if _mentions_lost_layer(token.lower(), any_norm):
                traces.setdefault(token, None)
    return list(traces)


def _mentions_lost_layer(token: str, any_norm: bool) -> bool:
    parts = token.split("_")
    if any(re.fullmatch(r"bn\d*", p) for p in parts):
        return True
    if "dropout" in token or "batchnorm" in token or "batch_norm" in token:
        return True
    return any_norm and "norm" in token


def _looks_generated(name: str, producer: str) -> bool:
    if name.startswith("onnx::"):
        return True
    return producer == PYTORCH_PRODUCER and "." not in name and bool(_GENERATED.match(name))


def _listed(names: Sequence[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(repr(n) for n in names[:_SHOWN]) + more
