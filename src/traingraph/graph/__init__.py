"""The graph API: build graphs from layers, then train or run them (ML Compute / MPS style).

Example:
    >>> from traingraph.graph import Graph, TensorSpec, TrainingGraph, layers
    >>> g = Graph("mlp")
    >>> y = layers.Linear(4, 2)(g.input("x", shape=[None, 4]))
"""

from traingraph.graph import init, layers
from traingraph.graph.data import Batch, InputPipeline, WeightSource
from traingraph.graph.execution import CompileOptions, ExecutionResult
from traingraph.graph.graph import Graph, Tensor, TensorSpec
from traingraph.graph.inference import InferenceGraph
from traingraph.graph.phases import MemoryPlan
from traingraph.graph.training import TrainingGraph

__all__ = [
    "Batch",
    "CompileOptions",
    "ExecutionResult",
    "Graph",
    "InferenceGraph",
    "InputPipeline",
    "MemoryPlan",
    "Tensor",
    "TensorSpec",
    "TrainingGraph",
    "WeightSource",
    "init",
    "layers",
]
