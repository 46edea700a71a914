"""traingraph: build, differentiate and run training graphs in standard ONNX."""

from traingraph.errors import GradientNotImplementedError, ModelError, TraingraphError

__version__ = "0.1.0"

__all__ = [
    "Graph",
    "GradientNotImplementedError",
    "InferenceGraph",
    "ModelError",
    "TensorSpec",
    "TraingraphError",
    "TrainingGraph",
    "__version__",
    "from_torch",
    "layers",
    "losses",
    "optim",
]

_LAZY_ATTRIBUTES = {
    "Graph": "traingraph.graph.graph",
    "TensorSpec": "traingraph.graph.graph",
    "TrainingGraph": "traingraph.graph.training",
    "InferenceGraph": "traingraph.graph.inference",
    "from_torch": "traingraph.torch_export",
}
_LAZY_MODULES = {"layers", "losses", "optim"}


def __getattr__(name: str) -> object:
    """Import the graph API, ``from_torch`` and the ``layers``, ``losses`` and ``optim`` modules
    on first use."""
    import importlib

    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"traingraph.{name}")
    raise AttributeError(f"module 'traingraph' has no attribute {name!r}")
