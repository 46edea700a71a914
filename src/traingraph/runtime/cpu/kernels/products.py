"""Matrix products of native kernels, computed by onnxruntime's own GEMM.

A native kernel whose work is mostly one matrix product (an LSTM step's recurrence, the
weight gradient of a Conv over a small plane) hands the product to a session of that one
node, run on the kernel's arrays in place through I/O binding: the products are then those of
the graph's ``MatMul`` or ``Gemm`` nodes, at the speed of onnxruntime's kernels for this CPU.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig, create_session


class Product:
    """``out = op(a, b)`` by a one-node onnxruntime session (``op_type`` ``MatMul`` or
    ``Gemm`` with its ``attributes``) on ``threads`` threads. The arrays are float32 and
    C-contiguous; ``out`` has the product's shape and is written in place."""

    def __init__(self, op_type: str, threads: int, **attributes: int) -> None:
        self._session = _session(op_type, threads, tuple(sorted(attributes.items())))
        self._binding = self._session.io_binding()
        # what each name is bound to: a chain of products rebinds only what changed
        self._bound: dict[str, tuple[int, tuple[int, ...]]] = {}

    def __call__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        binding = self._binding
        for name, array in (("a", a), ("b", b), ("y", out)):
            if array.dtype != np.float32 or not array.flags.c_contiguous:
                raise ValueError(
                    f"{name} is {array.dtype} {'' if array.flags.c_contiguous else 'strided '}"
                    f"{list(array.shape)}; expected a C-contiguous float32 array"
                )
            place = (array.ctypes.data, array.shape)
            if self._bound.get(name) == place:
                continue
            bind = binding.bind_output if name == "y" else binding.bind_input
            bind(name, "cpu", 0, np.float32, list(array.shape), place[0])
            self._bound[name] = place
        self._session.run_with_iobinding(binding)


@functools.cache
def _session(
    op_type: str, threads: int, attributes: tuple[tuple[str, int], ...]
) -> ort.InferenceSession:
    a, b, y = (helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in "aby")
    node = helper.make_node(op_type, ["a", "b"], ["y"])
    node.attribute.extend(helper.make_attribute(name, value) for name, value in attributes)
    graph = helper.make_graph([node], "product", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    # the workers sleep between products: the kernel's own threads run around them
    config = SessionConfig(intra_op_threads=threads, allow_spinning=False, specialize=False)
    return create_session(model, Device("cpu"), config)


__all__ = ["Product"]
