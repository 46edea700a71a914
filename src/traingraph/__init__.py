"""traingraph: build, differentiate and run training graphs in standard ONNX."""

from traingraph.errors import GradientNotImplementedError, ModelError, TraingraphError

__version__ = "0.1.0"

__all__ = ["GradientNotImplementedError", "ModelError", "TraingraphError", "__version__"]
