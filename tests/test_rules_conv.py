"""Gradients of Conv and ConvTranspose against finite differences and torch.autograd.

onnxruntime has no float64 kernel for Conv or ConvTranspose, so these checks run in float32. The
loss is linear in each input separately (and finite differences perturb one input at a time), so
central differences are exact up to float32 rounding for any step: a large ``eps`` keeps that
rounding small next to the tolerances.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import check_op_gradient
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
