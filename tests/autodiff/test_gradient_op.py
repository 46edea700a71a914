"""Lowering of ``ai.onnx.preview.training::Gradient`` against onnx's own backend test data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gradcheck import assert_default_domain_only, session
from traingraph.autodiff import lower_gradient_ops
from traingraph.errors import ModelError

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data" / "simple"


def _tensors(folder: Path, kind: str) -> list[np.ndarray]:
    files = sorted(folder.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    return [numpy_helper.to_array(onnx.load_tensor(str(f))) for f in files]


@pytest.mark.parametrize("case", ["test_gradient_of_add", "test_gradient_of_add_and_mul"])
def test_backend_case(case: str) -> None:
    model_path = DATA / case / "model.onnx"
    original = onnx.load(str(model_path))
    lowered = lower_gradient_ops(model_path)
    onnx.checker.check_model(lowered, full_check=True)
    assert_default_domain_only(lowered)
    assert "ai.onnx.preview.training" not in {o.domain for o in lowered.opset_import}
    assert [o.name for o in lowered.graph.output] == [o.name for o in original.graph.output]
    data = DATA / case / "test_data_set_0"
    inputs = _tensors(data, "input")
    expected = _tensors(data, "output")
    feeds = {i.name: x for i, x in zip(original.graph.input, inputs)}
    got = session(lowered).run(None, feeds)
    assert len(got) == len(expected)
    for g, e, out in zip(got, expected, original.graph.output):
        np.testing.assert_allclose(g, e, rtol=1e-6, err_msg=out.name)


def test_original_model_is_not_modified() -> None:
    original = onnx.load(str(DATA / "test_gradient_of_add" / "model.onnx"))
    before = original.SerializeToString()
    lower_gradient_ops(original)
    assert original.SerializeToString() == before


def _gradient_model(node_inputs: list[str], xs: list[str], zs: list[str]) -> onnx.ModelProto:
    """``c = a * b``, ``d = c + a`` and a Gradient node of ``d``."""
    from onnx import TensorProto, helper

    attrs = {"xs": xs, "y": "d"}
    if zs:
        attrs["zs"] = zs
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["a", "b"], ["c"]),
            helper.make_node("Add", ["c", "a"], ["d"]),
            helper.make_node(
                "Gradient", node_inputs, [f"d_{x}" for x in xs],
                domain="ai.onnx.preview.training", name="grad", **attrs,
            ),
        ],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("a", "b")],
        [helper.make_tensor_value_info(f"d_{x}", TensorProto.FLOAT, [3]) for x in xs],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.preview.training", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_zs_are_held_constant_and_intermediate_xs() -> None:
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([4.0, 5.0, 6.0], np.float32)
    # d = a*b + a: d(d)/da = b + 1, d(d)/dc = 1 with b held constant.
    lowered = lower_gradient_ops(_gradient_model(["a", "c", "b"], ["a", "c"], ["b"]))
    onnx.checker.check_model(lowered, full_check=True)
    d_a, d_c = session(lowered).run(None, {"a": a, "b": b})
    np.testing.assert_allclose(d_a, b + 1)
    np.testing.assert_allclose(d_c, np.ones(3))


def test_inputs_other_than_named_tensors_are_refused() -> None:
    with pytest.raises(ModelError, match="feeds input 0 from 'b'"):
        lower_gradient_ops(_gradient_model(["b"], ["a"], []))


def test_unknown_tensor_is_refused() -> None:
    with pytest.raises(ModelError, match="'nope'"):
        lower_gradient_ops(_gradient_model(["a"], ["nope"], []))
