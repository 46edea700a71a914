"""Every loss block against torch.nn: values for each reduction and gradients through autodiff."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from gradcheck import check_model_gradient, session
from traingraph.ir.builder import OpBuilder
from traingraph.ir.model import max_ir_version
from traingraph.losses import (
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    CustomLoss,
    HuberLoss,
    L1Loss,
    LabelSpec,
    Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)

REDUCTIONS = ["none", "sum", "mean"]
W4 = [0.5, 1.0, 2.0, 1.5]


def loss_model(
    loss: Loss, outputs: list[np.ndarray], opset: int = 17, all_dynamic: bool = False
) -> onnx.ModelProto:
    """A model whose inputs are the model outputs and the loss's labels.

    The outputs have a symbolic batch dimension, or only symbolic dimensions with ``all_dynamic``.
    """
    preds = [
        ir.Value(
            name=f"pred{i}",
            shape=ir.Shape(
                [f"d{k}" for k in range(a.ndim)] if all_dynamic else ["batch", *a.shape[1:]]
            ),
            type=ir.TensorType(ir.DataType.from_numpy(a.dtype)),
        )
        for i, a in enumerate(outputs)
    ]
    labels = [
        ir.Value(name=spec.name, shape=spec.shape, type=ir.TensorType(spec.dtype))
        for spec in loss.label_specs(preds)
    ]
    graph = ir.Graph([*preds, *labels], [], nodes=[], opset_imports={"": opset}, name="loss")
    b = OpBuilder(graph, opset)
    built = loss.build(b, preds, labels)
    value = b.Identity(built)
    value.name, value.type, value.shape = "loss", preds[0].type, built.shape
    graph.outputs.append(value)
    return ir.to_proto(ir.Model(graph, ir_version=max_ir_version()))


@dataclass
class Case:
    """One loss configuration and its torch equivalent."""

    id: str
    make: Callable[[str], Loss]
    torch_make: Callable[[str], torch.nn.Module]
    pred_shape: tuple[int, ...]
    labels: LabelMaker
    pred_scale: float = 1.0
    log_probabilities: bool = False  # feed log-softmax outputs, as NLLLoss expects


def same_shape(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape)


def binary(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.0, 1.0, shape)


def indices(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, shape[1], (shape[0], *shape[2:])).astype(np.int64)


LabelMaker = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def indices_with_ignored(ignore: int) -> LabelMaker:
    def make(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        t = indices(rng, shape)
        t.reshape(-1)[::3] = ignore
        return t

    return make


def probabilities(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    p = rng.uniform(0.1, 1.0, shape)
    return p / p.sum(axis=1, keepdims=True)


CASES = [
    Case("mse", MSELoss, lambda r: torch.nn.MSELoss(reduction=r), (5, 3), same_shape),
    Case("l1", L1Loss, lambda r: torch.nn.L1Loss(reduction=r), (5, 3), same_shape),
    Case("huber", HuberLoss, lambda r: torch.nn.HuberLoss(reduction=r), (6, 3),
         same_shape, 2.0),
    Case("huber_delta", lambda r: HuberLoss(r, delta=0.7),
         lambda r: torch.nn.HuberLoss(reduction=r, delta=0.7), (6, 3), same_shape, 2.0),
    Case("smooth_l1", SmoothL1Loss, lambda r: torch.nn.SmoothL1Loss(reduction=r),
         (6, 3), same_shape, 2.0),
    Case("smooth_l1_beta", lambda r: SmoothL1Loss(r, beta=0.4),
         lambda r: torch.nn.SmoothL1Loss(reduction=r, beta=0.4), (6, 3), same_shape, 2.0),
    Case("smooth_l1_beta0", lambda r: SmoothL1Loss(r, beta=0.0),
         lambda r: torch.nn.SmoothL1Loss(reduction=r, beta=0.0), (6, 3), same_shape),
    Case("ce", lambda r: CrossEntropyLoss(reduction=r),
         lambda r: torch.nn.CrossEntropyLoss(reduction=r), (5, 4), indices),
    Case("ce_spatial", lambda r: CrossEntropyLoss(reduction=r),
         lambda r: torch.nn.CrossEntropyLoss(reduction=r), (3, 4, 2, 3), indices),
    Case("ce_weight_ignore", lambda r: CrossEntropyLoss(W4, ignore_index=-100, reduction=r),
         lambda r: torch.nn.CrossEntropyLoss(torch.tensor(W4, dtype=torch.float64), reduction=r),
         (7, 4), indices_with_ignored(-100)),
    Case("ce_ignore_class", lambda r: CrossEntropyLoss(ignore_index=2, reduction=r),
         lambda r: torch.nn.CrossEntropyLoss(ignore_index=2, reduction=r), (7, 4),
         indices_with_ignored(2)),
    Case("ce_smoothing", lambda r: CrossEntropyLoss(reduction=r, label_smoothing=0.2),
         lambda r: torch.nn.CrossEntropyLoss(reduction=r, label_smoothing=0.2), (5, 4), indices),
    Case("ce_smoothing_weight_ignore_spatial",
         lambda r: CrossEntropyLoss(np.array(W4), reduction=r, label_smoothing=0.3, ignore_index=1),
         lambda r: torch.nn.CrossEntropyLoss(torch.tensor(W4, dtype=torch.float64), reduction=r,
                                             label_smoothing=0.3, ignore_index=1),
         (3, 4, 5), indices_with_ignored(1)),
    Case("ce_probabilities", lambda r: CrossEntropyLoss(reduction=r, probabilities=True),
         lambda r: torch.nn.CrossEntropyLoss(reduction=r), (5, 4), probabilities),
    Case("ce_probabilities_weight_smoothing_spatial",
         lambda r: CrossEntropyLoss(W4, reduction=r, label_smoothing=0.1, probabilities=True),
         lambda r: torch.nn.CrossEntropyLoss(torch.tensor(W4, dtype=torch.float64), reduction=r,
                                             label_smoothing=0.1),
         (3, 4, 2), probabilities),
    Case("nll", lambda r: NLLLoss(reduction=r), lambda r: torch.nn.NLLLoss(reduction=r),
         (5, 4), indices, log_probabilities=True),
    Case("nll_weight_ignore_spatial", lambda r: NLLLoss(W4, ignore_index=3, reduction=r),
         lambda r: torch.nn.NLLLoss(torch.tensor(W4, dtype=torch.float64), ignore_index=3,
                                    reduction=r),
         (7, 4, 2), indices_with_ignored(3), log_probabilities=True),
    Case("bce", lambda r: BCEWithLogitsLoss(reduction=r),
         lambda r: torch.nn.BCEWithLogitsLoss(reduction=r), (5, 3), binary, 30.0),
    Case("bce_weight_pos_weight",
         lambda r: BCEWithLogitsLoss([[0.5, 1.0, 2.0]], reduction=r, pos_weight=[1.0, 3.0, 0.5]),
         lambda r: torch.nn.BCEWithLogitsLoss(
             torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64), reduction=r,
             pos_weight=torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)),
         (5, 3), binary, 3.0),
]  # fmt: skip


def run_case(
    case: Case, reduction: str, dtype: type, opset: int = 17, all_dynamic: bool = False
) -> None:
    rng = np.random.default_rng(0)
    pred = rng.standard_normal(case.pred_shape) * case.pred_scale
    if case.log_probabilities:
        pred = pred - np.log(np.exp(pred).sum(axis=1, keepdims=True))
    pred = pred.astype(dtype)
    labels = case.labels(rng, case.pred_shape)
    if labels.dtype.kind == "f":
        labels = labels.astype(dtype)
    loss = case.make(reduction)
    model = loss_model(loss, [pred], opset=opset, all_dynamic=all_dynamic)
    onnx.checker.check_model(model, full_check=True)
    spec = loss.label_specs(
        [ir.Value(name="p", shape=ir.Shape(list(pred.shape)),
                  type=ir.TensorType(ir.DataType.from_numpy(pred.dtype)))]
    )[0]  # fmt: skip
    assert spec.dtype == ir.DataType.from_numpy(labels.dtype)
    assert tuple(spec.shape.dims) == labels.shape  # type: ignore[union-attr]
    feeds = {"pred0": pred, spec.name: labels}
    (got,) = session(model).run(["loss"], feeds)

    x = torch.tensor(pred, requires_grad=True)
    module = case.torch_make(reduction).to(x.dtype)
    expected = module(x, torch.tensor(labels))
    expected.sum().backward()
    assert got.shape == tuple(expected.shape)
    assert got.dtype == pred.dtype
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    if dtype is np.float64:
        grads = check_model_gradient(model, feeds, ["pred0"], loss="loss", rtol=1e-5, atol=1e-7)
        assert x.grad is not None
        np.testing.assert_allclose(grads["pred0"], x.grad.numpy(), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loss_matches_torch_float64(case: Case, reduction: str) -> None:
    run_case(case, reduction, np.float64)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loss_matches_torch_float32(case: Case) -> None:
    run_case(case, "mean", np.float32)


@pytest.mark.parametrize("opset", [13, 18, 26])
@pytest.mark.parametrize("case_id", ["ce_smoothing_weight_ignore_spatial", "bce", "huber"])
def test_loss_across_opsets(case_id: str, opset: int) -> None:
    run_case(next(c for c in CASES if c.id == case_id), "mean", np.float64, opset=opset)


@pytest.mark.parametrize(
    "case_id",
    ["ce_smoothing_weight_ignore_spatial", "ce_probabilities_weight_smoothing_spatial", "mse"],
)
def test_loss_with_every_dimension_dynamic(case_id: str) -> None:
    """The class count comes from the run-time shape when it is not static."""
    run_case(next(c for c in CASES if c.id == case_id), "mean", np.float64, all_dynamic=True)


def test_custom_loss_over_two_outputs() -> None:
    """A sum of MSE on output 0 and cross-entropy on output 1."""

    def two_heads(b: OpBuilder, outputs: Any, labels: Any) -> ir.Value:
        mse = MSELoss().build(b, outputs[:1], labels[:1])
        ce = CrossEntropyLoss().build(b, outputs[1:], labels[1:])
        return b.Add(mse, ce)

    loss = CustomLoss(
        two_heads,
        labels=[
            LabelSpec("target", ir.DataType.DOUBLE, ir.Shape(["batch", 2])),
            LabelSpec("classes", ir.DataType.INT64, ir.Shape(["batch"])),
        ],
    )
    rng = np.random.default_rng(1)
    regression, logits = rng.standard_normal((4, 2)), rng.standard_normal((4, 3))
    target, classes = rng.standard_normal((4, 2)), rng.integers(0, 3, 4).astype(np.int64)
    model = loss_model(loss, [regression, logits])
    feeds = {"pred0": regression, "pred1": logits, "target": target, "classes": classes}
    (got,) = session(model).run(["loss"], feeds)
    grads = check_model_gradient(model, feeds, ["pred0", "pred1"], loss="loss")

    r, z = torch.tensor(regression, requires_grad=True), torch.tensor(logits, requires_grad=True)
    F = torch.nn.functional
    expected = F.mse_loss(r, torch.tensor(target)) + F.cross_entropy(z, torch.tensor(classes))
    expected.backward()
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(grads["pred0"], r.grad.numpy(), rtol=1e-6)  # type: ignore[union-attr]
    np.testing.assert_allclose(grads["pred1"], z.grad.numpy(), rtol=1e-6)  # type: ignore[union-attr]


def test_dynamic_batch_runs_with_other_batch_sizes() -> None:
    model = loss_model(CrossEntropyLoss(W4, label_smoothing=0.1), [np.zeros((2, 4))])
    sess = session(model)
    rng = np.random.default_rng(2)
    for n in (1, 9):
        logits, labels = rng.standard_normal((n, 4)), rng.integers(0, 4, n).astype(np.int64)
        (got,) = sess.run(["loss"], {"pred0": logits, "labels": labels})
        expected = torch.nn.functional.cross_entropy(
            torch.tensor(logits), torch.tensor(labels),
            weight=torch.tensor(W4, dtype=torch.float64), label_smoothing=0.1,
        )  # fmt: skip
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-10)


def test_bce_gradient_is_exact_at_zero_logit() -> None:
    model = loss_model(BCEWithLogitsLoss(reduction="sum"), [np.zeros((1, 3))])
    feeds = {"pred0": np.zeros((1, 3)), "labels": np.array([[0.0, 1.0, 0.25]])}
    grads = check_model_gradient(model, feeds, ["pred0"], loss="loss")
    np.testing.assert_allclose(grads["pred0"], 0.5 - feeds["labels"], rtol=1e-12)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MSELoss("avg"), "reduction='avg' is not supported"),
        (lambda: HuberLoss(delta=0.0), "delta must be positive"),
        (lambda: SmoothL1Loss(beta=-1.0), "beta must be non-negative"),
        (lambda: CrossEntropyLoss(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
        (lambda: CrossEntropyLoss(weight=[[1.0, 2.0]]), "weight must be a 1-D"),
        (lambda: CustomLoss(fn=3), "fn must be callable"),
    ],
)
def test_invalid_arguments(make: Callable[[], Loss], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_weight_length_must_match_classes() -> None:
    with pytest.raises(ValueError, match="weight has 3 entries but output 'pred0' has 4 classes"):
        loss_model(CrossEntropyLoss([1.0, 2.0, 3.0]), [np.zeros((2, 4))])


def test_losses_are_hashable_values() -> None:
    assert CrossEntropyLoss(np.array(W4)) == CrossEntropyLoss(W4)
    pos = BCEWithLogitsLoss(pos_weight=np.ones(3))
    assert hash(pos) == hash(BCEWithLogitsLoss(pos_weight=[1, 1, 1]))


WEIGHT_SMOOTHING = {"weight": [0.5, 1.0, 2.0, 1.5, 0.7], "label_smoothing": 0.2}


@pytest.mark.parametrize("options", [{}, WEIGHT_SMOOTHING], ids=["plain", "weight_smoothing"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("rank", [3, 4])
def test_cross_entropy_of_logits_transposed_to_put_classes_second(
    reduction, rank, options
) -> None:
    """``F.cross_entropy(logits.transpose(1, 2), labels)`` (a language model's loss over
    ``[N, S, V]`` logits): the loss reads the logits along their last axis, not the
    transposed copy, and gives torch's values and gradients."""
    rng = np.random.default_rng(1)
    shape = (3, 4, 5) if rank == 3 else (2, 3, 2, 5)
    logits = rng.standard_normal(shape) * 3.0
    labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int64)
    labels.flat[1] = -100  # ignored
    perm = [0, rank - 1, *range(1, rank - 1)]
    pred = ir.Value(
        name="pred0", shape=ir.Shape(["batch", *shape[1:]]), type=ir.TensorType(ir.DataType.DOUBLE)
    )
    loss = CrossEntropyLoss(reduction=reduction, **options)
    graph = ir.Graph([pred], [], nodes=[], opset_imports={"": 17}, name="loss")
    b = OpBuilder(graph, 17)
    moved = b.Transpose(pred, perm=perm)
    moved.shape = ir.Shape(["batch", shape[-1], *shape[1:-1]])
    moved.type = pred.type
    (spec,) = loss.label_specs([moved])
    target = ir.Value(name=spec.name, shape=spec.shape, type=ir.TensorType(spec.dtype))
    graph.inputs.append(target)
    built = loss.build(b, [moved], [target])
    value = b.Identity(built)
    value.name, value.type, value.shape = "loss", pred.type, built.shape
    graph.outputs.append(value)
    model = ir.to_proto(ir.Model(graph, ir_version=max_ir_version()))
    onnx.checker.check_model(model, full_check=True)
    (softmax,) = [n for n in model.graph.node if n.op_type == "LogSoftmax"]
    assert list(softmax.input) == ["pred0"] and softmax.attribute[0].i == rank - 1
    feeds = {"pred0": logits, spec.name: labels}
    (got,) = session(model).run(["loss"], feeds)
    x = torch.tensor(logits, requires_grad=True)
    weight = options.get("weight")
    expected = torch.nn.functional.cross_entropy(
        x.permute(*perm), torch.tensor(labels), reduction=reduction,
        weight=None if weight is None else torch.tensor(weight, dtype=torch.float64),
        label_smoothing=options.get("label_smoothing", 0.0),
    )
    expected.sum().backward()
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    grads = check_model_gradient(model, feeds, ["pred0"], loss="loss", rtol=1e-5, atol=1e-7)
    assert x.grad is not None
    np.testing.assert_allclose(grads["pred0"], x.grad.numpy(), rtol=1e-9, atol=1e-12)
