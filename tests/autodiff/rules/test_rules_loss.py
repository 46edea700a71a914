
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradcheck import add_weighted_sum_loss, check_op_gradient, make_op_model
from traingraph.autodiff import build_gradient_graph
from traingraph.errors import GradientNotImplementedError

rng = np.random.default_rng(0)

OPS = {"SoftmaxCrossEntropyLoss": F.cross_entropy, "NegativeLogLikelihoodLoss": F.nll_loss}
SHAPES = [(5, 3), (2, 3, 2, 2)]


def case(shape, ignore_index=None, label_dtype=np.int64):
    """Scores ``shape`` and labels in range, every third one set to ``ignore_index``."""
    x = rng.standard_normal(shape)
    labels = rng.integers(0, shape[1], size=(shape[0], *shape[2:]))
    if ignore_index is not None:
        labels[labels == ignore_index] = (ignore_index + 1) % shape[1]
        labels.reshape(-1)[::3] = ignore_index
    return x, labels.astype(label_dtype)


def attrs_for(reduction, ignore_index):
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    return attrs


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 1, -100])
def test_loss(op, shape, reduction, weighted, ignore_index):
    x, labels = case(shape, ignore_index)
    weight = rng.uniform(0.5, 2.0, shape[1]) if weighted else None
    torch_weight = None if weight is None else torch.tensor(weight)

    def torch_fn(x, t):
        return OPS[op](
            x, t, weight=torch_weight, reduction=reduction,
            ignore_index=-100 if ignore_index is None else ignore_index,
        )

    inputs = {"x": x, "labels": labels, "weight": weight}
    check_op_gradient(
        op, inputs, attrs_for(reduction, ignore_index), const_inputs=["weight"],
        used_outputs=[0], torch_fn=torch_fn,
    )


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dynamic", ["none", "all"])
@pytest.mark.parametrize("opset", [13, 22, 26])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
def test_loss_dynamic_shapes_and_opsets(op, dynamic, opset, label_dtype):
    x, labels = case((3, 4, 2), ignore_index=2, label_dtype=label_dtype)
    check_op_gradient(
        op, {"x": x, "labels": labels}, attrs_for("mean", 2), opset=opset, dynamic=dynamic,
        torch_fn=lambda x, t: OPS[op](x, t.long(), ignore_index=2),
    )


def _picked_loss(x, t, w, *, softmax, reduction, ignore_index):
    """The ONNX loss written with differentiable torch ops (torch's losses do not
    differentiate their class weights)."""
    lp = F.log_softmax(x, 1) if softmax else x
    kept = t != ignore_index
    safe = torch.where(kept, t, 0)
    picked = lp.gather(1, safe.unsqueeze(1)).squeeze(1)
    wt = w[safe] * kept
    loss = -wt * picked
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / wt.sum()
    return loss


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 3)])
def test_loss_weight_gradient(op, reduction, shape):
    x, labels = case(shape, ignore_index=0)
    weight = rng.uniform(0.5, 2.0, shape[1])

    def torch_fn(x, t, w):
        return _picked_loss(
            x, t, w, softmax=op == "SoftmaxCrossEntropyLoss", reduction=reduction,
            ignore_index=0,
        )

    check_op_gradient(
        op, {"x": x, "labels": labels, "weight": weight}, attrs_for(reduction, 0),
        wrt=["x", "weight"], dynamic="all", torch_fn=torch_fn,
    )


@pytest.mark.parametrize("used_outputs", [[0, 1], [1]])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("dynamic", ["batch", "all"])
def test_softmax_cross_entropy_log_prob_output(used_outputs, reduction, dynamic):
    x, labels = case((4, 3, 2), ignore_index=1)
    weight = rng.uniform(0.5, 2.0, 3)

    def torch_fn(x, t):
        loss = F.cross_entropy(
            x, t, weight=torch.tensor(weight), reduction=reduction, ignore_index=1
        )
        return tuple((loss, F.log_softmax(x, 1))[k] for k in used_outputs)

    check_op_gradient(
        "SoftmaxCrossEntropyLoss", {"x": x, "labels": labels, "weight": weight},
        attrs_for(reduction, 1), const_inputs=["weight"], num_outputs=2,
        used_outputs=used_outputs, dynamic=dynamic, torch_fn=torch_fn,
    )


def test_unknown_rank_is_refused():
    x, labels = case((3, 4))
    model = make_op_model("NegativeLogLikelihoodLoss", {"x": x, "labels": labels})
    del model.graph.input[0].type.tensor_type.shape.dim[:]
    model.graph.input[0].type.tensor_type.ClearField("shape")
    model.graph.ClearField("value_info")
    loss_model = add_weighted_sum_loss(model, ["y0"], [np.zeros(())])
    with pytest.raises(GradientNotImplementedError, match="rank"):
        build_gradient_graph(loss_model, wrt=["x"], loss="loss")
