
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from gradcheck import (
    add_weighted_sum_loss,
    check_op_gradient,
    make_op_model,
    numeric_gradient,
    session,
)
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)

# Float32 tolerances (for kernels that onnxruntime has only in float32): the float32 loss
# needs a large finite-difference step.
F32 = {"eps": 1e-2, "rtol": 5e-3, "atol": 1e-3}


def r(*shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def positive(*shape):
    return np.abs(r(*shape)) + 0.5


# ---------------------------------------------------------------- BatchNormalization

BN_SHAPES = [(5, 3), (4, 3, 5), (3, 2, 3, 4), (2, 2, 3, 2, 2)]


@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
@pytest.mark.parametrize("opset", [14, 15, 26])
def test_batch_norm_training(shape, dynamic, opset):
    c = shape[1]
    inputs = {"x": r(*shape), "scale": r(c), "bias": r(c), "mean": r(c), "var": positive(c)}
    check_op_gradient(
        "BatchNormalization",
        inputs,
        {"training_mode": 1, "epsilon": 1e-3, "momentum": 0.8},
        const_inputs=["mean", "var"],
        num_outputs=3,
        used_outputs=[0],
        opset=opset,
        dynamic=dynamic,
        torch_fn=lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True, eps=1e-3),
    )


@pytest.mark.parametrize("wrt", [["x"], ["scale"], ["bias"], ["scale", "bias"], ["x", "bias"]])
def test_batch_norm_training_partial_wrt(wrt):
    """Only the wanted gradients are built; each equals torch's."""
    inputs = {"x": r(4, 3, 2, 3), "scale": r(3), "bias": r(3), "mean": r(3), "var": positive(3)}
    check_op_gradient(
        "BatchNormalization", inputs, {"training_mode": 1}, wrt=wrt,
        const_inputs=["mean", "var"], num_outputs=3, used_outputs=[0], opset=15,
        torch_fn=lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
    )


@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_batch_norm_training_float32_offset_matches_torch(dynamic):
    """float32 activations far from zero (mean 50, spread 0.5): the centered statistics keep
    dx, dscale and dbias at float32 accuracy against torch's kernel."""
    x = (50.0 + 0.5 * r(8, 4, 6, 6)).astype(np.float32)
    inputs = {
        "x": x, "scale": r(4, dtype=np.float32), "bias": r(4, dtype=np.float32),
        "mean": np.zeros(4, np.float32), "var": np.ones(4, np.float32),
    }
    model = make_op_model(
        "BatchNormalization", inputs, {"training_mode": 1}, const_inputs=["mean", "var"],
        num_outputs=3, opset=17, dynamic=dynamic,
    )
    feeds = {k: inputs[k] for k in ("x", "scale", "bias")}
    y = session(model).run(["y0"], feeds)[0]
    weights = {"w_y0": r(*y.shape, dtype=np.float32)}
    grad_model = build_gradient_graph(
        add_weighted_sum_loss(model, ["y0"], [y]), wrt=["x", "scale", "bias"], loss="loss"
    )
    got = session(grad_model).run(["x_grad", "scale_grad", "bias_grad"], {**feeds, **weights})
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    out = F.batch_norm(t["x"], None, None, t["scale"], t["bias"], training=True)
    (out * torch.tensor(weights["w_y0"])).sum().backward()
    for name, value in zip(("x", "scale", "bias"), got):
        expected = t[name].grad.numpy()
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


def _batch_norm_eval(x, w, b, mean, var):
    # F.batch_norm does not differentiate its running statistics; the same formula does.
    view = (1, -1) + (1,) * (x.dim() - 2)
    return (x - mean.view(view)) / torch.sqrt(var.view(view) + 1e-3) * w.view(view) + b.view(view)


@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize(
    "opset,attrs", [(13, {}), (15, {}), (15, {"training_mode": 0}), (26, {"training_mode": 0})]
)
def test_batch_norm_inference(shape, opset, attrs):
    c = shape[1]
    inputs = {"x": r(*shape), "scale": r(c), "bias": r(c), "mean": r(c), "var": positive(c)}
    check_op_gradient(
        "BatchNormalization",
        inputs,
        {"epsilon": 1e-3, **attrs},
        opset=opset,
        dynamic="all",
        torch_fn=_batch_norm_eval,
    )


def test_batch_norm_inference_frozen_stats():
    """Fine-tuning with frozen statistics: mean and var are initializers outside wrt."""
    inputs = {"x": r(3, 2, 4), "scale": r(2), "bias": r(2), "mean": r(2), "var": positive(2)}
    check_op_gradient(
        "BatchNormalization",
        inputs,
        {"epsilon": 1e-3, "training_mode": 0},
        const_inputs=["mean", "var"],
        opset=15,
        torch_fn=lambda x, w, b: F.batch_norm(
            x, torch.tensor(inputs["mean"]), torch.tensor(inputs["var"]), w, b, eps=1e-3
        ),
    )


def test_batch_norm_running_stats_match_torch():
    """The forward op's running statistics equal torch's after one step.

    ONNX: running = momentum * running + (1 - momentum) * batch_stat, with the biased batch
    variance; torch: running = (1 - momentum) * running + momentum * batch_stat, with the
    unbiased batch variance.
    """
    x, scale, bias, mean, var = r(4, 3, 5, 5), r(3), r(3), r(3), positive(3)
    momentum = 0.9
    model = make_op_model(
        "BatchNormalization",
        {"x": x, "scale": scale, "bias": bias, "mean": mean, "var": var},
        {"training_mode": 1, "momentum": momentum},
        num_outputs=3,
        opset=15,
    )
    y, running_mean, running_var = session(model).run(
        None, {"x": x, "scale": scale, "bias": bias, "mean": mean, "var": var}
    )
    bn = torch.nn.BatchNorm2d(3, momentum=1 - momentum).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(scale))
        bn.bias.copy_(torch.tensor(bias))
        bn.running_mean.copy_(torch.tensor(mean))
        bn.running_var.copy_(torch.tensor(var))
    xt = torch.tensor(x)
    np.testing.assert_allclose(y, bn(xt).detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(running_mean, bn.running_mean.numpy(), rtol=1e-6, atol=1e-6)
    n = x.size / 3
    torch_biased = bn.running_var.numpy() - (1 - momentum) * xt.var(dim=(0, 2, 3)).numpy() / n
    np.testing.assert_allclose(running_var, torch_biased, rtol=1e-6, atol=1e-6)


def test_batch_norm_gradient_into_running_stats_is_refused():
    model = make_op_model(
        "BatchNormalization",
        {"x": r(3, 2), "scale": r(2), "bias": r(2), "mean": r(2), "var": positive(2)},
        {"training_mode": 1},
        num_outputs=3,
        opset=15,
    )
    loss_model = add_weighted_sum_loss(model, ["y0", "y1"], [r(3, 2), r(2)])
    with pytest.raises(GradientNotImplementedError, match="running_mean"):
        build_gradient_graph(loss_model, wrt=["x"], loss="loss")


def test_batch_norm_9_training_is_refused():
    model = make_op_model(
        "BatchNormalization",
        {"x": r(3, 2), "scale": r(2), "bias": r(2), "mean": r(2), "var": positive(2)},
        num_outputs=5,
        opset=13,
    )
    loss_model = add_weighted_sum_loss(model, ["y0"], [r(3, 2)])
    with pytest.raises(GradientNotImplementedError, match="opset 14"):
        build_gradient_graph(loss_model, wrt=["x"], loss="loss")


# ---------------------------------------------------------------- LayerNormalization


@pytest.mark.parametrize("axis", [-1, -2, 1, 0])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_layer_norm(axis, with_bias, dynamic):
    shape = (2, 3, 4)
    norm_shape = shape[axis % 3 :]
    bias = r(*norm_shape) if with_bias else None
    inputs = {"x": r(*shape), "scale": r(*norm_shape), "bias": bias}

    def torch_fn(x, w, b=None):
        return F.layer_norm(x, norm_shape, w, b, eps=1e-3)

    check_op_gradient(
        "LayerNormalization",
        inputs,
        {"axis": axis, "epsilon": 1e-3},
        dynamic=dynamic,
        torch_fn=torch_fn,
    )


def test_layer_norm_broadcast_scale():
    """A scale of shape (1, 4) broadcasts against the normalized shape (3, 4)."""
    inputs = {"x": r(2, 3, 4), "scale": r(1, 4), "bias": r(4)}
    check_op_gradient(
        "LayerNormalization",
        inputs,
        {"axis": -2},
        opset=26,
        torch_fn=lambda x, w, b: F.layer_norm(x, (3, 4), eps=1e-5) * w + b,
    )


@pytest.mark.parametrize("used_outputs", [[0, 1, 2], [1], [2]])
@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_layer_norm_mean_and_inv_std_outputs(used_outputs, dynamic):
    # Mean and InvStdDev are float (stash_type=1) whatever X's dtype, so the check runs in
    # float32 with looser tolerances.
    inputs = {"x": r(2, 3, 4, dtype=np.float32), "scale": r(3, 4, dtype=np.float32)}

    def torch_fn(x, w):
        mean = x.mean(dim=(1, 2), keepdim=True)
        inv_std = 1 / torch.sqrt(x.var(dim=(1, 2), unbiased=False, keepdim=True) + 1e-5)
        y = F.layer_norm(x, (3, 4), w)
        return tuple((y, mean, inv_std)[k] for k in used_outputs)

    check_op_gradient(
        "LayerNormalization",
        inputs,
        {"axis": 1},
        num_outputs=3,
        used_outputs=used_outputs,
        dynamic=dynamic,
        torch_fn=torch_fn,
        **F32,
    )


def test_layer_norm_float16_stashes_in_float():
    x, w, bias = r(3, 8), r(8), r(8)
    model = make_op_model(
        "LayerNormalization",
        {"x": x.astype(np.float16), "w": w.astype(np.float16), "b": bias.astype(np.float16)},
        {"stash_type": 1},
    )
    weights = r(3, 8)
    loss_model = add_weighted_sum_loss(model, ["y0"], [weights.astype(np.float16)])
    grad_model = build_gradient_graph(loss_model, wrt=["x", "w", "b"], loss="loss")
    onnx.checker.check_model(grad_model, full_check=True)
    feeds = {"x": x, "w": w, "b": bias, "w_y0": weights}
    got = session(grad_model).run(
        ["x_grad", "w_grad", "b_grad"], {k: v.astype(np.float16) for k, v in feeds.items()}
    )
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    loss = (F.layer_norm(tensors["x"], (8,), tensors["w"], tensors["b"]) * tensors["w_y0"]).sum()
    loss.backward()
    for name, value in zip(["x", "w", "b"], got):
        assert value.dtype == np.float16
        np.testing.assert_allclose(value, tensors[name].grad.numpy(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------ InstanceNormalization


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 2, 3, 4), (1, 2, 2, 3, 2)])
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
def test_instance_norm(shape, dynamic):
    # onnxruntime's InstanceNormalization has a float32 kernel only.
    c = shape[1]
    inputs = {
        "x": r(*shape, dtype=np.float32),
        "scale": r(c, dtype=np.float32),
        "bias": r(c, dtype=np.float32),
    }
    check_op_gradient(
        "InstanceNormalization",
        inputs,
        {"epsilon": 1e-3},
        dynamic=dynamic,
        torch_fn=lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=1e-3),
        **F32,
    )


# --------------------------------------------------------------- GroupNormalization


GN_CASES = [((2, 6, 4), 3), ((2, 4, 3, 2), 2), ((3, 4), 4), ((2, 6, 5), 1)]


def _torch_group_norm(groups, per_group):
    def fn(x, w, b):
        if per_group:
            w, b = (v.repeat_interleave(x.shape[1] // groups) for v in (w, b))
        return F.group_norm(x, groups, w, b, eps=1e-3)

    return fn


@pytest.mark.parametrize("shape,groups", GN_CASES)
@pytest.mark.parametrize("dynamic", ["none", "batch", "all"])
@pytest.mark.parametrize("opset", [21, 26])
def test_group_norm(shape, groups, dynamic, opset):
    # stash_type=11: the default float stash would compute a float64 input in float32.
    c = shape[1]
    check_op_gradient(
        "GroupNormalization",
        {"x": r(*shape), "scale": r(c), "bias": r(c)},
        {"num_groups": groups, "epsilon": 1e-3, "stash_type": 11},
        opset=opset,
        dynamic=dynamic,
        torch_fn=_torch_group_norm(groups, per_group=False),
    )


def test_group_norm_float32_default_stash():
    inputs = {"x": r(2, 6, 3, dtype=np.float32), "scale": r(6, dtype=np.float32)}
    inputs["bias"] = r(6, dtype=np.float32)
    check_op_gradient(
        "GroupNormalization",
        inputs,
        {"num_groups": 2, "epsilon": 1e-3},
        opset=21,
        dynamic="all",
        torch_fn=_torch_group_norm(2, per_group=False),
        **F32,
    )


@pytest.mark.parametrize("shape,groups", GN_CASES)
@pytest.mark.parametrize("dynamic", ["none", "all"])
def test_group_norm_18_per_group_scale(shape, groups, dynamic):
    """Opset 18-20: scale and bias have one value per group.

    onnx's checker rejects GroupNormalization-18 as deprecated, so this test runs the
    gradient model without check_op_gradient's checker step.
    """
    inputs = {"x": r(*shape), "scale": r(groups), "bias": r(groups)}
    model = make_op_model(
        "GroupNormalization", inputs, {"num_groups": groups, "epsilon": 1e-3},
        opset=18, dynamic=dynamic,
    )
    weights = r(*shape)
    loss_model = add_weighted_sum_loss(model, ["y0"], [weights])
    grad_model = build_gradient_graph(loss_model, wrt=list(inputs), loss="loss")
    feeds = {**inputs, "w_y0": weights}
    got = session(grad_model).run([f"{k}_grad" for k in inputs], feeds)
    forward = session(loss_model)

    def loss(f):
        return float(forward.run(["loss"], f)[0])

    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    y = _torch_group_norm(groups, per_group=True)(*tensors.values())
    (y * torch.tensor(weights)).sum().backward()
    for name, value in zip(inputs, got):
        expected = numeric_gradient(loss, feeds, name, 1e-6)
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(value, tensors[name].grad.numpy(), rtol=1e-6, atol=1e-8)


# -------------------------------------------------------------------------- Dropout


@pytest.mark.parametrize(
    "inputs",
    [
        {"x": r(3, 4)},
        {"x": r(3, 4), "ratio": np.array(0.3)},
        {"x": r(3, 4), "ratio": np.array(0.3), "training": np.array(False)},
    ],
    ids=["no-ratio", "no-training-mode", "training-false"],
)
@pytest.mark.parametrize("opset", [13, 22])
def test_dropout_inference_is_identity(inputs, opset):
    check_op_gradient(
        "Dropout",
        inputs,
        {"seed": 3},
        wrt=["x"],
        const_inputs=["ratio", "training"],
        num_outputs=2,
        used_outputs=[0],
        opset=opset,
        dynamic="all",
        torch_fn=lambda x: x,
    )


def _dropout_gradient(inputs, const_inputs, num_outputs, feeds_override=None, opset=17):
    """Run the gradient graph of a training-mode Dropout once: ``(x, y, w, x_grad)``.

    A new random mask is drawn on every run, so the gradient is checked against the
    forward output of the same run: ``dL/dx = w * mask / (1 - ratio) = w * y / x``.
    """
    model = make_op_model(
        "Dropout", inputs, {"seed": 7}, const_inputs=const_inputs,
        num_outputs=num_outputs, opset=opset, dynamic="all",
    )
    x = inputs["x"]
    w = r(*x.shape)
    loss_model = add_weighted_sum_loss(model, ["y0"], [x])
    y_info = onnx.helper.make_tensor_value_info("y0", onnx.TensorProto.DOUBLE, None)
    loss_model.graph.output.append(y_info)
    grad_model = build_gradient_graph(loss_model, wrt=["x"], loss="loss")
    onnx.checker.check_model(grad_model, full_check=True)
    feeds = {k: v for k, v in inputs.items() if v is not None and k not in const_inputs}
    feeds.update(feeds_override or {})
    y, x_grad = session(grad_model).run(["y0", "x_grad"], {**feeds, "w_y0": w})
    return x, y, w, x_grad


@pytest.mark.parametrize("num_outputs", [1, 2])
@pytest.mark.parametrize("ratio_const", [True, False])
@pytest.mark.parametrize("opset", [13, 26])
def test_dropout_training_uses_forward_mask(num_outputs, ratio_const, opset):
    x = np.abs(r(4, 50)) + 0.1
    inputs = {"x": x, "ratio": np.array(0.25), "training": np.array(True)}
    const = ["training"] + (["ratio"] if ratio_const else [])
    x, y, w, x_grad = _dropout_gradient(inputs, const, num_outputs, opset=opset)
    assert 0 < np.count_nonzero(y) < y.size
    np.testing.assert_allclose(x_grad, w * y / x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.unique(np.round(y / x, 12)), [0.0, 1 / 0.75])


@pytest.mark.parametrize("training", [True, False])
def test_dropout_run_time_training_mode(training):
    x = np.abs(r(4, 50)) + 0.1
    inputs = {"x": x, "ratio": np.array(0.5), "training": np.array(training)}
    x, y, w, x_grad = _dropout_gradient(inputs, ["ratio"], 1)
    assert (np.count_nonzero(y) < y.size) == training
    np.testing.assert_allclose(x_grad, w * y / x, rtol=1e-12, atol=1e-12)


def test_dropout_ratio_gradient_is_refused():
    model = make_op_model(
        "Dropout", {"x": r(3, 4), "ratio": np.array(0.5), "training": np.array(True)},
        const_inputs=["training"],
    )
    loss_model = add_weighted_sum_loss(model, ["y0"], [r(3, 4)])
    with pytest.raises(GradientNotImplementedError, match="ratio"):
        build_gradient_graph(loss_model, wrt=["x", "ratio"], loss="loss")


def test_batch_norm_9_training_outputs_are_refused_by_name():
    """BatchNormalization-9's training outputs (opset 13, as torch exports training mode there)
    get their own error naming the op, node and opset, even where the input's rank is unknown
    (onnx infers no shape for them)."""
    node = helper.make_node(
        "BatchNormalization", ["x", "scale", "bias", "mean", "var"],
        ["y", "running_mean", "running_var", "saved_mean", "saved_var"], name="bn9",
    )  # fmt: skip
    inits = [numpy_helper.from_array(np.ones(3, np.float32), n)
             for n in ("scale", "bias", "mean", "var")]  # fmt: skip
    graph = helper.make_graph(
        [node, helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "bn9",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(GradientNotImplementedError, match=r"'bn9'.*opset 13.*BatchNormalization-9"):
        build_gradient_graph(model, wrt=["scale"], loss="loss")
