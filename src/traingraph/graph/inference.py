"""``InferenceGraph``: graphs compiled for inference on a device (``MLCInferenceGraph``).

Example:
    >>> infer = InferenceGraph([g]).compile(device="cpu")
    >>> infer.execute({"x": X}).outputs["logits"]
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from traingraph.errors import ModelError
from traingraph.graph.execution import (
    CompileOptions,
    ExecutionResult,
    OnComplete,
    OrderedExecutor,
    device_feeds,
    host,
    input_specs,
)
from traingraph.graph.graph import Graph, Tensor, TensorSpec, compose
from traingraph.ir.builder import value_spec
from traingraph.ir.model import to_proto
from traingraph.program import to_inference_mode
from traingraph.runtime.device import Device, parse_device
from traingraph.runtime.session import BoundRunner, create_session
from traingraph.runtime.tensors import TensorStore

__all__ = ["InferenceGraph"]


class InferenceGraph:
    """Graphs run forward only, in inference mode (Dropout off, BatchNorm on running stats).

    Args:
        graphs: The graphs, composed in order as in
            :class:`~traingraph.graph.training.TrainingGraph`.
    """

    def __init__(self, graphs: Sequence[Graph]) -> None:
        self.graphs = list(graphs)
        self.input_specs: dict[str, TensorSpec | None] = {}
        self.extra_outputs: list[str] = []
        self.options = CompileOptions()
        self._executor = OrderedExecutor("traingraph-infer")
        self._params: TensorStore | None = None

    def add_inputs(self, inputs: Mapping[str, Tensor | TensorSpec]) -> InferenceGraph:
        """Declare the inputs fed at each execution."""
        self.input_specs.update(input_specs(self.graphs, inputs))
        return self

    def add_outputs(self, outputs: Sequence[Tensor | str]) -> InferenceGraph:
        """Also return these (intermediate) tensors."""
        self.extra_outputs += [t.name if isinstance(t, Tensor) else t for t in outputs]
        return self

    def compile(
        self, device: str | Device = "cpu", options: CompileOptions | None = None
    ) -> InferenceGraph:
        """Create the session on ``device``; copy the weights there (each loaded, then purged)."""
        self.options = options or CompileOptions()
        self.device = parse_device(device)
        model, owners = compose(self.graphs)
        to_inference_mode(model.graph)
        names = [o.name for o in model.graph.outputs]
        values = {o.name: o for node in model.graph for o in node.outputs}
        missing = [n for n in self.extra_outputs if n not in values]
        if missing:
            raise ModelError(f"outputs {missing} are not tensors of the graphs")
        model.graph.outputs.extend(values[n] for n in self.extra_outputs if n not in names)
        self.output_names = [o.name or "" for o in model.graph.outputs]
        params = {v.name: v for v in model.graph.inputs if v.name in owners}
        self.feed_names = [v.name or "" for v in model.graph.inputs if v.name not in owners]
        specs = {n: value_spec(v) for n, v in params.items()}
        previous = self.get_parameters() if self._params is not None else None
        self._params = TensorStore(self.device, specs)
        for name in specs:
            self._params.write(name, previous[name] if previous else owners[name].weight(name))
        session = create_session(to_proto(model), self.device, self.options.session_config())
        self._runner = BoundRunner(session, self.device)
        return self

    def _run(self, inputs: Mapping[str, Any]) -> ExecutionResult:
        start = time.perf_counter()
        if self._params is None:
            raise ModelError("the inference graph is not compiled; call compile(device=...) first")
        runner = self._runner
        on_device = device_feeds("inputs", inputs, self.feed_names, runner, self.device)
        for name in runner.inputs:
            runner.bind_input(
                name, on_device[name] if name in on_device else self._params.ortvalue(name)
            )
        outputs = runner.run({n: None for n in self.output_names})
        result = ExecutionResult(outputs={n: host(outputs[n]) for n in self.output_names})
        if self.options.profile:
            result.times["forward"] = time.perf_counter() - start
        return result

    def execute(
        self,
        inputs: Mapping[str, Any],
        *,
        asynchronous: bool = False,
        on_complete: OnComplete | None = None,
    ) -> ExecutionResult | Future[ExecutionResult]:
        """Run the graphs on ``inputs``; asynchronously with a Future and/or a callback."""
        return self._executor.run(lambda: self._run(inputs), asynchronous, on_complete)

    def get_parameters(self) -> dict[str, np.ndarray]:
        """The weights by name (host copies)."""
        if self._params is None:
            return {n: g.weight(n) for g in self.graphs for n in g.parameters}
        self._executor.wait()
        return {n: self._params.read(n) for n in self._params}

    def set_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Copy weights in, e.g. ``infer.set_parameters(train.get_parameters())``."""
        if self._params is None:
            raise ModelError("compile the inference graph before setting its parameters")
        self._executor.wait()
        for name, value in values.items():
            self._params.write(name, np.asarray(value))
