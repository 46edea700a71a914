"""Exceptions raised by traingraph.

Every error says what was received, what was expected and how to fix it.
"""

from __future__ import annotations


class TraingraphError(Exception):
    """Base class of every error that traingraph raises on purpose."""


class GradientNotImplementedError(TraingraphError, NotImplementedError):
    """A node on the gradient path has no gradient rule, or one of its attributes is unsupported."""

    def __init__(
        self,
        op_type: str,
        node_name: str,
        opset: int,
        reason: str = "",
        supported: tuple[str, ...] = (),
        domain: str = "",
    ) -> None:
        self.op_type = op_type
        self.node_name = node_name
        self.opset = opset
        self.domain = domain
        qualified = f"{domain}::{op_type}" if domain else op_type
        what = reason or f"no gradient rule is registered for op {qualified!r}"
        lines = [
            f"cannot differentiate node {node_name!r} (op {qualified}, opset {opset}): {what}.",
            "To fix: put traingraph's stop_gradients on the tensors that feed this node if they"
            " need no gradient, register a rule with traingraph.autodiff.register_gradient"
            f"({op_type!r}), or re-export the model so that it uses supported ops.",
        ]
        if supported:
            lines.append(f"Supported ops ({len(supported)}): {', '.join(sorted(supported))}.")
        super().__init__("\n".join(lines))


class ModelError(TraingraphError, ValueError):
    """A model, tensor name or argument does not fit what traingraph expects."""


class CheckpointError(TraingraphError):
    """A checkpoint file is missing, corrupt or does not match the model."""


class DeviceError(TraingraphError, RuntimeError):
    """A requested device or execution provider is not available."""
