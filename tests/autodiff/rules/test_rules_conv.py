"""Gradients of Conv and ConvTranspose against finite differences and torch.autograd.

onnxruntime has no float64 kernel for Conv or ConvTranspose, so these checks run in float32. The
loss is linear in each input separately (and finite differences perturb one input at a time), so
central differences are exact up to float32 rounding for any step: a large ``eps`` keeps that
rounding small next to the tolerances.
"""

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import (
    add_weighted_sum_loss,
    check_model_gradient,
    check_op_gradient,
    make_op_model,
    session,
)
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)
TOL = {"rtol": 2e-3, "atol": 2e-4, "eps": 0.5}


def r(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def torch_conv(pads, strides, dilations, group):
    """``F.convNd`` with ONNX-style (possibly asymmetric) pads."""
    n = len(strides)
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    torch_pads = [p for i in reversed(range(n)) for p in (pads[i], pads[n + i])]

    def run(x, w, b=None):
        return fn(F.pad(x, torch_pads), w, b, stride=strides, dilation=dilations, groups=group)

    return run


CONV_CASES = {
    # name: (x shape, w shape, strides, pads, dilations, group)
    "1d": ((2, 3, 11), (4, 3, 3), [1], [1, 1], [1], 1),
    "1d_stride_dilation": ((2, 2, 13), (3, 2, 3), [2], [2, 0], [2], 1),
    "2d": ((2, 3, 7, 7), (4, 3, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 1),
    "2d_stride2_uncovered": ((2, 3, 8, 9), (4, 3, 3, 3), [2, 2], [0, 0, 0, 0], [1, 1], 1),
    "2d_stride3_asym_pads": ((2, 2, 9, 8), (3, 2, 2, 3), [3, 2], [1, 0, 2, 1], [1, 1], 1),
    "2d_dilation": ((1, 2, 9, 9), (2, 2, 3, 3), [1, 2], [2, 1, 0, 2], [2, 3], 1),
    "2d_groups": ((2, 4, 6, 6), (6, 2, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], 2),
    "2d_depthwise": ((2, 3, 6, 6), (3, 1, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], 3),
    "2d_depthwise_multiplier": ((2, 2, 5, 5), (4, 1, 3, 3), [1, 1], [0, 1, 1, 0], [1, 1], 2),
    "2d_pointwise": ((2, 5, 4, 4), (3, 5, 1, 1), [1, 1], [0, 0, 0, 0], [1, 1], 1),
    "3d": ((1, 2, 5, 4, 5), (3, 2, 2, 3, 2), [1, 2, 1], [1, 0, 1, 0, 1, 1], [1, 1, 2], 1),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_conv(case, bias):
    xs, ws, strides, pads, dilations, group = CONV_CASES[case]
    inputs = {"x": r(*xs), "w": r(*ws), "b": r(ws[0]) if bias else None}
    attrs = {"strides": strides, "pads": pads, "dilations": dilations, "group": group}
    check_op_gradient(
        "Conv", inputs, attrs, torch_fn=torch_conv(pads, strides, dilations, group), **TOL
    )


@pytest.mark.parametrize("case", ["2d", "2d_stride3_asym_pads", "2d_depthwise", "3d"])
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_conv_dynamic_shapes_and_kernel_shape_attribute(case, dynamic):
    xs, ws, strides, pads, dilations, group = CONV_CASES[case]
    attrs = {
        "strides": strides, "pads": pads, "dilations": dilations, "group": group,
        "kernel_shape": list(ws[2:]),
    }
    check_op_gradient(
        "Conv", {"x": r(*xs), "w": r(*ws), "b": r(ws[0])}, attrs, dynamic=dynamic,
        torch_fn=torch_conv(pads, strides, dilations, group), **TOL,
    )


@pytest.mark.parametrize("opset", [13, 14, 15, 18, 22, 26])
def test_conv_opsets(opset):
    xs, ws, strides, pads, dilations, group = CONV_CASES["2d_stride3_asym_pads"]
    attrs = {"strides": strides, "pads": pads, "dilations": dilations, "group": group}
    check_op_gradient(
        "Conv", {"x": r(*xs), "w": r(*ws), "b": r(ws[0])}, attrs, opset=opset,
        torch_fn=torch_conv(pads, strides, dilations, group), **TOL,
    )


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize(
    "x_shape, strides", [((2, 2, 7, 8), [2, 3]), ((2, 2, 6, 6), [1, 1]), ((1, 2, 9), [2])]
)
def test_conv_auto_pad(auto_pad, x_shape, strides):
    w_shape = (3, 2, 4, 3)[: len(x_shape)]
    attrs = {"auto_pad": auto_pad, "strides": strides}
    check_op_gradient("Conv", {"x": r(*x_shape), "w": r(*w_shape)}, attrs, **TOL)


def test_conv_same_stride1_dynamic_spatial():
    check_op_gradient(
        "Conv", {"x": r(2, 2, 6, 5), "w": r(3, 2, 4, 3)},
        {"auto_pad": "SAME_LOWER", "kernel_shape": [4, 3]}, dynamic="all", **TOL,
    )


def test_conv_same_with_stride_needs_static_spatial_dims():
    with pytest.raises(GradientNotImplementedError, match="auto_pad=SAME_UPPER with stride 2"):
        check_op_gradient(
            "Conv", {"x": r(2, 2, 6, 5), "w": r(3, 2, 3, 3)},
            {"auto_pad": "SAME_UPPER", "strides": [2, 2], "kernel_shape": [3, 3]},
            dynamic="all", **TOL,
        )


def test_conv_without_kernel_size_is_unsupported():
    with pytest.raises(GradientNotImplementedError, match="the kernel size is unknown"):
        check_op_gradient("Conv", {"x": r(2, 2, 6, 5), "w": r(3, 2, 3, 3)}, dynamic="all")


def test_conv_weight_only_and_input_only():
    xs, ws, strides, pads, dilations, group = CONV_CASES["2d_groups"]
    attrs = {"strides": strides, "pads": pads, "dilations": dilations, "group": group}
    inputs = {"x": r(*xs), "w": r(*ws), "b": r(ws[0])}
    fn = torch_conv(pads, strides, dilations, group)
    check_op_gradient("Conv", inputs, attrs, wrt=["w"], torch_fn=fn, **TOL)
    check_op_gradient("Conv", inputs, attrs, wrt=["x"], torch_fn=fn, **TOL)


CONV_T_CASES = {
    # name: (x shape, w shape, strides, pads, output_padding, dilations, group)
    "1d": ((2, 3, 6), (3, 2, 3), [2], [1, 1], [1], [1], 1),
    "2d": ((2, 3, 4, 5), (3, 4, 3, 3), [1, 1], [1, 1, 1, 1], [0, 0], [1, 1], 1),
    "2d_stride_outpad": ((2, 2, 4, 3), (2, 3, 3, 2), [2, 3], [1, 0, 1, 0], [1, 2], [1, 1], 1),
    "2d_dilation_groups": ((1, 4, 4, 4), (4, 1, 2, 3), [2, 1], [0, 1, 0, 1], [1, 0], [2, 2], 2),
    "2d_depthwise": ((2, 3, 4, 4), (3, 1, 3, 3), [2, 2], [1, 1, 1, 1], [1, 1], [1, 1], 3),
    "3d": (
        (1, 2, 3, 3, 2), (2, 2, 2, 2, 3), [2, 1, 2], [0, 1, 1, 0, 1, 1], [1, 0, 1], [1, 1, 1], 1,
    ),
}


def torch_conv_transpose(strides, pads, output_padding, dilations, group):
    n = len(strides)
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[n]

    def run(x, w, b=None):
        return fn(
            x, w, b, stride=strides, padding=pads[:n], output_padding=output_padding,
            groups=group, dilation=dilations,
        )

    return run


@pytest.mark.parametrize("case", sorted(CONV_T_CASES))
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_conv_transpose(case, dynamic):
    xs, ws, strides, pads, out_pad, dilations, group = CONV_T_CASES[case]
    n = len(strides)
    attrs = {
        "strides": strides, "pads": pads, "output_padding": out_pad, "dilations": dilations,
        "group": group, "kernel_shape": list(ws[2:]),
    }
    symmetric = pads[:n] == pads[n:]
    check_op_gradient(
        "ConvTranspose", {"x": r(*xs), "w": r(*ws), "b": r(ws[1] * group)}, attrs,
        dynamic=dynamic,
        torch_fn=torch_conv_transpose(strides, pads, out_pad, dilations, group)
        if symmetric else None,
        **TOL,
    )


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("output_shape", [None, [9, 6], [8, 5], [6, 4]])
def test_conv_transpose_output_shape_and_auto_pad(auto_pad, output_shape):
    attrs = {"strides": [2, 2], "auto_pad": auto_pad}
    if output_shape is not None:
        attrs["output_shape"] = output_shape
    elif auto_pad == "NOTSET":
        attrs["pads"] = [1, 0, 0, 1]
    check_op_gradient("ConvTranspose", {"x": r(2, 2, 4, 3), "w": r(2, 3, 3, 2)}, attrs, **TOL)


@pytest.mark.parametrize("opset", [13, 26])
def test_conv_transpose_opsets(opset):
    xs, ws, strides, pads, out_pad, dilations, group = CONV_T_CASES["2d_stride_outpad"]
    attrs = {"strides": strides, "pads": pads, "output_padding": out_pad, "dilations": dilations}
    check_op_gradient(
        "ConvTranspose", {"x": r(*xs), "w": r(*ws), "b": r(ws[1])}, attrs, opset=opset, **TOL
    )


def test_conv_lenet_shapes_dynamic_batch():
    check_op_gradient(
        "Conv", {"x": r(3, 6, 12, 12), "w": r(16, 6, 5, 5), "b": r(16)},
        {"kernel_shape": [5, 5]}, dynamic="batch",
        torch_fn=F.conv2d, rtol=2e-3, atol=1e-3, eps=2.0,
    )


def test_conv_weight_grad_matches_torch_on_a_larger_case():
    x = torch.tensor(r(4, 8, 10, 10))
    w = torch.tensor(r(6, 8, 3, 3))
    grads = check_op_gradient(
        "Conv", {"x": x.numpy(), "w": w.numpy()}, {"pads": [1, 1, 1, 1], "strides": [2, 2]},
        wrt=["w"], torch_fn=lambda x, w: F.conv2d(x, w, padding=1, stride=2),
        rtol=2e-3, atol=2e-4, eps=1.0,
    )
    assert grads["w"].shape == (6, 8, 3, 3)


def gradient_op_types(inputs, attrs, dynamic="batch", static_weight=False):
    """The op types of the nodes the Conv rule emits (loss: a weighted sum of the output).

    With ``static_weight`` only the batch dimension of ``x`` is symbolic, as in a model whose
    parameters have fixed shapes.
    """
    model = gradient_model(inputs, attrs, dynamic, static_weight)
    grad_model = build_gradient_graph(model, wrt=list(inputs), loss="loss")
    return Counter(
        node.op_type for node in grad_model.graph.node
        if node.output[0].startswith("grad/Conv_node/")
    )


def gradient_model(inputs, attrs, dynamic="batch", static_weight=False):
    """One Conv node and a weighted-sum loss; see :func:`gradient_op_types`."""
    model = make_op_model("Conv", inputs, attrs, dynamic="none" if static_weight else dynamic)
    if static_weight:
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    out = session(model).run(None, inputs)[0]
    return add_weighted_sum_loss(model, ["y0"], [out])


FLIPPED_CASES = {
    # Stride 1, p_begin + p_end >= extent - 1 and at least 8 channels per group (or depthwise):
    # dL/dX is a Conv with the flipped weight.
    # name: (x shape, w shape, pads, dilations, group)
    "1d_asym_dilation": ((2, 8, 9), (4, 8, 3), [3, 2], [2], 1),
    "2d_asym": ((2, 8, 6, 5), (3, 8, 4, 3), [2, 0, 1, 2], [1, 1], 1),
    "2d_output_larger": ((2, 8, 5, 5), (3, 8, 3, 3), [2, 1, 2, 2], [1, 1], 1),
    "2d_dilation": ((1, 9, 8, 7), (3, 9, 3, 2), [2, 1, 2, 1], [2, 2], 1),
    "2d_groups": ((2, 16, 4, 4), (4, 8, 3, 3), [1, 1, 1, 1], [1, 1], 2),
    "2d_depthwise": ((2, 3, 5, 6), (3, 1, 3, 3), [1, 2, 1, 0], [1, 1], 3),
    "3d": ((1, 8, 4, 5, 3), (2, 8, 3, 2, 3), [1, 1, 2, 1, 0, 2], [1, 1, 2], 1),
}


@pytest.mark.parametrize("case", sorted(FLIPPED_CASES))
@pytest.mark.parametrize("dynamic", ["batch", "all"])
def test_conv_stride1_input_gradient_as_flipped_conv(case, dynamic):
    xs, ws, pads, dilations, group = FLIPPED_CASES[case]
    strides = [1] * (len(xs) - 2)
    attrs = {
        "pads": pads, "dilations": dilations, "group": group, "kernel_shape": list(ws[2:]),
    }
    inputs = {"x": r(*xs), "w": r(*ws), "b": r(ws[0])}
    check_op_gradient(
        "Conv", inputs, attrs, dynamic=dynamic,
        torch_fn=torch_conv(pads, strides, dilations, group), **TOL,
    )
    # With every dimension dynamic the channel counts are unknown: ConvTranspose instead.
    ops = gradient_op_types(inputs, attrs, dynamic, static_weight=dynamic == "batch")
    assert ops["ConvTranspose"] == (1 if dynamic == "all" else 0), ops


@pytest.mark.parametrize(
    "channels, pads",
    [(8, [0, 0, 0, 0]), (8, [1, 0, 0, 1]), (8, [3, 1, 0, 1]), (3, [1, 1, 1, 1])],
    ids=["valid", "short", "beyond_kernel", "few_channels"],
)
def test_conv_stride1_input_gradient_keeps_conv_transpose(channels, pads):
    """Where the input has more positions than the output, a pad exceeds extent - 1, or the
    groups have few channels."""
    inputs = {"x": r(2, channels, 6, 6), "w": r(4, channels, 3, 3)}
    attrs = {"pads": pads}
    check_op_gradient("Conv", inputs, attrs, torch_fn=torch_conv(pads, [1, 1], [1, 1], 1), **TOL)
    assert gradient_op_types(inputs, attrs)["ConvTranspose"] == 1


GEMM_CASES = {
    # A sample's output positions O <= the filters per group: dL/dW is one GEMM over the batch.
    # name: (x shape, w shape, strides, pads, group)
    "2d": ((3, 4, 3, 3), (12, 4, 2, 2), [1, 1], [0, 0, 0, 0], 1),
    "2d_padded_stride2": ((2, 3, 5, 4), (9, 3, 3, 3), [2, 2], [1, 0, 0, 1], 1),
    "2d_groups": ((2, 4, 3, 3), (8, 2, 2, 2), [1, 1], [0, 0, 0, 0], 2),
    "1x1": ((2, 8, 2, 3), (7, 8, 1, 1), [1, 1], [0, 0, 0, 0], 1),
    "1x1_stride2": ((2, 3, 5, 5), (10, 3, 1, 1), [2, 2], [0, 0, 0, 0], 1),
    "1d": ((2, 3, 5), (6, 3, 3), [1], [0, 0], 1),
    "3d": ((2, 2, 3, 2, 3), (8, 2, 2, 1, 2), [1, 1, 1], [0, 0, 0, 0, 0, 0], 1),
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_conv_weight_gradient_as_one_gemm(case):
    xs, ws, strides, pads, group = GEMM_CASES[case]
    dilations = [1] * len(strides)
    attrs = {"strides": strides, "pads": pads, "group": group}
    inputs = {"x": r(*xs), "w": r(*ws)}
    check_op_gradient(
        "Conv", inputs, attrs, dynamic="none",
        torch_fn=torch_conv(pads, strides, dilations, group), **TOL,
    )
    ops = gradient_op_types(inputs, attrs, "none")
    assert ops["ReduceSum"] == 0 and ops["MatMul"] == 1, ops
    if set(ws[2:]) == set(strides) == {1}:
        assert ops["Conv"] + ops["ConvTranspose"] == 1, ops


@pytest.mark.parametrize("case", ["2d_groups", "1x1_stride2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_conv_weight_gradient_as_one_gemm_dynamic_batch(case, batch):
    """A dynamic batch with static weight shapes (the way models come) keeps the GEMM."""
    xs, ws, strides, pads, group = GEMM_CASES[case]
    attrs = {"strides": strides, "pads": pads, "group": group}
    inputs = {"x": r(batch, *xs[1:]), "w": r(*ws)}
    assert gradient_op_types(inputs, attrs, static_weight=True)["ReduceSum"] == 0
    check_model_gradient(
        gradient_model(inputs, attrs, static_weight=True),
        {**inputs, "w_y0": r(*session(make_op_model("Conv", inputs, attrs)).run(None, inputs)[0]
                             .shape)},
        wrt=["x", "w"], **TOL,
    )


@pytest.mark.parametrize("strides", [[1, 1], [2, 3]])
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_conv_1x1_weight_gradient_per_sample(strides, dynamic):
    """Stride 1 needs no unfold; a stride keeps the one-hot Conv (faster than a strided Slice)."""
    inputs = {"x": r(2, 3, 7, 8), "w": r(2, 3, 1, 1), "b": r(2)}
    attrs = {"strides": strides, "kernel_shape": [1, 1]}
    check_op_gradient(
        "Conv", inputs, attrs, dynamic=dynamic,
        torch_fn=torch_conv([0] * 4, strides, [1, 1], 1), **TOL,
    )
    ops = gradient_op_types(inputs, attrs, dynamic)
    unfolds = 0 if strides == [1, 1] else 1
    assert ops["Conv"] + ops["ConvTranspose"] == 1 + unfolds and ops["ReduceSum"] == 2, ops


def test_conv_transpose_weight_gradient_as_one_gemm():
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}
    check_op_gradient(
        "ConvTranspose", {"x": r(2, 8, 2, 2), "w": r(8, 3, 3, 3), "b": r(3)}, attrs,
        torch_fn=torch_conv_transpose([2, 2], [1, 1, 1, 1], [1, 1], [1, 1], 1), **TOL,
    )


@pytest.mark.parametrize(
    ("image", "block", "attrs"),
    [
        ([5, 6], [2, 3], {}),
        ([6, 6], [3, 3], {"pads": [1, 1, 1, 1]}),
        ([7, 8], [2, 2], {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 0, 2, 1]}),
    ],
)
def test_col2im_against_torch_fold(image, block, attrs):
    """Col2Im (``F.fold``) over strides, dilations and asymmetric pads: the gradient of a
    weighted sum (each input element's gradient is the weight at the image position it is added
    into, exact in float32: onnxruntime's Col2Im is float32 only) against torch's float64
    ``fold``."""
    from traingraph.autodiff import build_gradient_graph

    k = len(image)
    pads = attrs.get("pads", [0] * 2 * k)
    strides, dilations = attrs.get("strides", [1] * k), attrs.get("dilations", [1] * k)
    padded = [image[d] + pads[d] + pads[d + k] for d in range(k)]
    blocks = [(padded[d] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1 for d in range(k)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2 * int(np.prod(block)), int(np.prod(blocks)))).astype(np.float32)
    shapes = {"image_shape": np.array(image), "block_shape": np.array(block)}
    model = make_op_model(
        "Col2Im", {"x": x, **shapes}, attrs, const_inputs=list(shapes), opset=18
    )
    (y,) = session(model).run(None, {"x": x})
    w = rng.uniform(0.5, 1.5, size=y.shape).astype(np.float32)
    grads = build_gradient_graph(add_weighted_sum_loss(model, ["y0"], [y]), wrt=["x"])
    got = session(grads).run(["x_grad"], {"x": x, "w_y0": w})[0]

    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    full = F.fold(t, padded, block, dilation=dilations, stride=strides)  # torch pads evenly
    kept = full[:, :, pads[0] : padded[0] - pads[2], pads[1] : padded[1] - pads[3]]
    np.testing.assert_allclose(y, kept.detach().numpy(), rtol=1e-5, atol=1e-5)
    (kept * torch.tensor(w, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-6, atol=0)
