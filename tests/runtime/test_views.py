"""Views of part of an OrtValue's memory (traingraph.runtime.views) and the flat blocks of a
TensorStore that the optimizer updates as one vector."""

from __future__ import annotations

import gc

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from traingraph.ir.model import max_ir_version
from traingraph.runtime.device import parse_device
from traingraph.runtime.tensors import TensorStore
from traingraph.runtime.views import view


def _add_session() -> ort.InferenceSession:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"])],
        "add",
        [helper.make_tensor_value_info(n, 1, [2, 3]) for n in ("x", "y")],
        [helper.make_tensor_value_info("z", 1, [2, 3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_view_reads_and_writes_the_memory_it_points_at() -> None:
    array = np.arange(20, dtype=np.float32)
    base = ort.OrtValue.ortvalue_from_numpy(array)
    part = view(base, 4, (2, 3), np.float32)
    assert part.shape() == [2, 3]
    np.testing.assert_array_equal(part.numpy(), array[4:10].reshape(2, 3))
    part.update_inplace(np.full((2, 3), 7, np.float32))
    np.testing.assert_array_equal(array[4:10], 7)
    np.testing.assert_array_equal(array[:4], np.arange(4))
    np.testing.assert_array_equal(array[10:], np.arange(10, 20))


def test_a_session_reads_and_writes_views_in_place() -> None:
    array = np.arange(18, dtype=np.float32)
    base = ort.OrtValue.ortvalue_from_numpy(array)
    expected = array[:6] + array[6:12]
    session = _add_session()
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", view(base, 0, (2, 3), np.float32))
    binding.bind_ortvalue_input("y", view(base, 6, (2, 3), np.float32))
    binding.bind_ortvalue_output("z", view(base, 12, (2, 3), np.float32))
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(array[12:], expected)


def test_a_view_keeps_its_buffer_alive() -> None:
    base = ort.OrtValue.ortvalue_from_numpy(np.arange(8, dtype=np.float32))
    part = view(base, 2, (3,), np.float32)
    del base
    gc.collect()
    np.testing.assert_array_equal(part.numpy(), [2, 3, 4])


def test_views_of_other_dtypes() -> None:
    flags = np.array([True, False, True, True])
    part = view(ort.OrtValue.ortvalue_from_numpy(flags), 1, (3,), np.bool_)
    assert part.data_type() == "tensor(bool)"
    np.testing.assert_array_equal(part.numpy(), flags[1:])
    ints = np.arange(6, dtype=np.int64)
    np.testing.assert_array_equal(
        view(ort.OrtValue.ortvalue_from_numpy(ints), 3, (3,), np.int64).numpy(), [3, 4, 5]
    )


@pytest.mark.parametrize(("offset", "shape"), [(-1, (2,)), (7, (2,)), (0, (3, 3))])
def test_a_view_that_does_not_fit_is_refused(offset: int, shape: tuple[int, ...]) -> None:
    base = ort.OrtValue.ortvalue_from_numpy(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="the buffer holds 8"):
        view(base, offset, shape, np.float32)


def test_a_store_block_covers_its_tensors_in_order() -> None:
    values = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([9, 8], np.float32)}
    store = TensorStore(parse_device("cpu"), {n: (v.shape, v.dtype) for n, v in values.items()})
    for name, value in values.items():
        store.write(name, value)
    assert store.offsets == {"w": 0, "b": 6} and store.flat_size == 8
    block = store.block(0, store.flat_size)
    np.testing.assert_array_equal(block.numpy(), [0, 1, 2, 3, 4, 5, 9, 8])
    assert store.block(0, store.flat_size) is block  # made once
    block.update_inplace(np.arange(8, dtype=np.float32) * 10)
    np.testing.assert_array_equal(store.read("b"), [60, 70])


def test_a_store_of_mixed_dtypes_has_no_block() -> None:
    store = TensorStore(
        parse_device("cpu"), {"a": ((2,), np.float32), "n": ((), np.int64)}
    )
    assert store.offsets is None
    with pytest.raises(Exception, match="a flat block needs one"):
        store.block(0, 2)
