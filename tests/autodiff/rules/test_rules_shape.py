import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from gradcheck import check_model_gradient, check_op_gradient
from traingraph.ir.model import max_ir_version

rng = np.random.default_rng(0)
DYNAMIC = ["none", "batch", "all"]


def r(*shape):
    return rng.standard_normal(shape)


def ints(*values):
    return np.array(values, dtype=np.int64)


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize(
    ("allowzero", "target", "out_shape"),
    [
        (0, (6, -1), (6, 4)),
        (0, (0, 12), (2, 12)),
        (0, (0, -1, 2), (2, 6, 2)),
        (1, (4, 3, 2), (4, 3, 2)),
        (0, (-1,), (24,)),
    ],
)
def test_reshape(dynamic, allowzero, target, out_shape):
    check_op_gradient(
        "Reshape", {"x": r(2, 3, 4), "shape": ints(*target)}, {"allowzero": allowzero},
        const_inputs=["shape"], dynamic=dynamic, opset=14,
        torch_fn=lambda t: t.reshape(out_shape),
    )


def test_reshape_shape_computed_at_run_time():
    x = r(2, 3, 4)
    check_op_gradient(
        "Reshape", {"x": x, "shape": ints(3, 8)}, wrt=["x"], dynamic="all",
        torch_fn=lambda t, s: t.reshape(3, 8),
    )


def test_reshape_zero_sized_allowzero():
    check_op_gradient(
        "Reshape", {"x": r(2, 0, 3), "shape": ints(0, 6)}, {"allowzero": 1},
        const_inputs=["shape"], opset=14, dynamic="none",
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
def test_flatten(dynamic, axis):
    x = r(2, 3, 2, 2)
    check_op_gradient(
        "Flatten", {"x": x}, {"axis": axis}, dynamic=dynamic,
        torch_fn=lambda t: t.reshape(int(np.prod(x.shape[:axis])), -1),
    )


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_squeeze_unsqueeze(opset, dynamic):
    x = r(2, 1, 3, 1)
    check_op_gradient(
        "Squeeze", {"x": x, "axes": ints(1, -1)}, const_inputs=["axes"], opset=opset,
        dynamic=dynamic, torch_fn=lambda t: t.squeeze(-1).squeeze(1),
    )
    check_op_gradient(
        "Squeeze", {"x": x}, opset=opset, dynamic="none", torch_fn=torch.squeeze,
    )
    check_op_gradient(
        "Unsqueeze", {"x": r(2, 3), "axes": ints(0, -1)}, const_inputs=["axes"], opset=opset,
        dynamic=dynamic, torch_fn=lambda t: t.unsqueeze(0).unsqueeze(-1),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("perm", [None, (0, 2, 1), (2, 0, 1), (1, 2, 0)])
def test_transpose(dynamic, perm):
    x = r(2, 3, 4)
    attrs = {} if perm is None else {"perm": list(perm)}
    check_op_gradient(
        "Transpose", {"x": x}, attrs, dynamic=dynamic,
        torch_fn=lambda t: t.permute(*(perm or (2, 1, 0))),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("axis", [1, -1, 0])
def test_concat(dynamic, axis):
    shapes = {
        0: [(1, 3), (2, 3), (3, 3)], 1: [(2, 1), (2, 3), (2, 2)], -1: [(2, 1), (2, 3), (2, 2)]
    }
    a, b, c = (r(*s) for s in shapes[axis])
    check_op_gradient(
        "Concat", {"a": a, "b": b, "c": c}, {"axis": axis}, dynamic=dynamic,
        torch_fn=lambda *ts: torch.cat(ts, dim=axis),
    )


@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_concat_some_inputs_constant(dynamic):
    a, b, c = r(2, 1), r(2, 3), r(2, 2)
    got = check_op_gradient(
        "Concat", {"a": a, "b": b, "c": c}, {"axis": 1}, wrt=["b"], const_inputs=["a"],
        dynamic=dynamic,
    )
    assert got["b"].shape == b.shape


def test_concat_single_input():
    check_op_gradient("Concat", {"a": r(2, 3)}, {"axis": 0}, torch_fn=lambda t: t)


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("used", [None, [0, 2], [1]])
def test_split_sizes_input(dynamic, opset, used):
    x = r(2, 6)
    check_op_gradient(
        "Split", {"x": x, "split": ints(1, 3, 2)}, {"axis": -1}, const_inputs=["split"],
        num_outputs=3, used_outputs=used, opset=opset, dynamic=dynamic,
        torch_fn=lambda t: tuple(
            p for k, p in enumerate(torch.split(t, [1, 3, 2], dim=-1)) if k in (used or [0, 1, 2])
        ),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("opset", [13, 18])
def test_split_equal_default(dynamic, opset):
    x = r(6, 2)
    attrs = {"num_outputs": 3} if opset >= 18 else {}
    check_op_gradient(
        "Split", {"x": x}, attrs, num_outputs=3, used_outputs=[0, 2], opset=opset,
        dynamic=dynamic,
        torch_fn=lambda t: tuple(torch.split(t, 2, dim=0)[k] for k in (0, 2)),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("used", [None, [1]])
def test_split_num_outputs_uneven(dynamic, used):
    x = r(2, 7)
    check_op_gradient(
        "Split", {"x": x}, {"axis": 1, "num_outputs": 3}, num_outputs=3, used_outputs=used,
        opset=18, dynamic=dynamic,
        torch_fn=lambda t: tuple(
            p for k, p in enumerate(torch.split(t, 3, dim=1)) if k in (used or [0, 1, 2])
        ),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize(
    ("shape", "target"),
    [((3, 1), (2, 3, 4)), ((1, 4), (3, 1)), ((2, 3), (2, 3)), ((4,), (2, 1, 1))],
)
def test_expand(dynamic, shape, target):
    x = r(*shape)
    out_shape = np.broadcast_shapes(shape, target)
    check_op_gradient(
        "Expand", {"x": x, "shape": ints(*target)}, const_inputs=["shape"], dynamic=dynamic,
        torch_fn=lambda t: t.expand(*out_shape),
    )


def test_expand_shape_computed_at_run_time():
    x = r(3, 1)
    check_op_gradient(
        "Expand", {"x": x, "shape": ints(2, 1, 4)}, wrt=["x"], dynamic="all",
        torch_fn=lambda t, s: t.expand(2, 3, 4),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("repeats", [(2, 3), (1, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("const", [True, False])
def test_tile(dynamic, repeats, const):
    x = r(2, 3)
    check_op_gradient(
        "Tile", {"x": x, "repeats": ints(*repeats)}, wrt=["x"],
        const_inputs=["repeats"] if const else [], dynamic=dynamic,
        torch_fn=(lambda t: t.repeat(*repeats)) if const else (lambda t, s: t.repeat(*repeats)),
    )


def test_tile_rank3():
    check_op_gradient(
        "Tile", {"x": r(2, 1, 3), "repeats": ints(2, 2, 1)}, const_inputs=["repeats"],
        torch_fn=lambda t: t.repeat(2, 2, 1),
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space(dynamic, mode):
    x = r(2, 8, 2, 3)
    torch_fn = None
    if mode == "CRD":
        torch_fn = lambda t: F.pixel_shuffle(t, 2)  # noqa: E731
    check_op_gradient(
        "DepthToSpace", {"x": x}, {"blocksize": 2, "mode": mode}, dynamic=dynamic,
        torch_fn=torch_fn,
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_depth_to_space_dcr_against_torch(dynamic):
    # DCR equals a reshape to [N, b, b, C', H, W], a permute and a reshape.
    x = r(1, 12, 2, 2)

    def dcr(t):
        n, c, h, w = t.shape
        moved = t.reshape(n, 2, 2, c // 4, h, w).permute(0, 3, 4, 1, 5, 2)
        return moved.reshape(n, c // 4, h * 2, w * 2)

    check_op_gradient(
        "DepthToSpace", {"x": x}, {"blocksize": 2}, dynamic=dynamic, torch_fn=dcr,
    )


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_space_to_depth(dynamic):
    x = r(2, 3, 4, 6)

    def s2d(t):
        n, c, h, w = t.shape
        moved = t.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
        return moved.reshape(n, c * 4, h // 2, w // 2)

    check_op_gradient("SpaceToDepth", {"x": x}, {"blocksize": 2}, dynamic=dynamic, torch_fn=s2d)


def test_pixel_unshuffle_round_trip_model():
    # pixel_unshuffle (a reshape/transpose chain in ONNX) followed by CRD DepthToSpace.
    nodes = [
        helper.make_node("SpaceToDepth", ["x"], ["s"], blocksize=2),
        helper.make_node("DepthToSpace", ["s"], ["d"], blocksize=2, mode="CRD"),
        helper.make_node("Mul", ["d", "w"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 2, 4, 4]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [1, 2, 4, 4]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=max_ir_version()
    )
    model = onnx.shape_inference.infer_shapes(model)
    check_model_gradient(model, {"x": r(3, 2, 4, 4), "w": r(1, 2, 4, 4)}, ["x"])
