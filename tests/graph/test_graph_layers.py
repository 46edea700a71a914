"""Layers against their torch.nn namesakes: outputs, input gradients and parameter gradients;
initializers against torch's default distributions."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

import traingraph as tg
from traingraph import layers as L
from traingraph.graph import CompileOptions, init


def _run_layer(layer: L.Layer, shape: tuple[int, ...], dtype: str = "float32", seed: int = 0):
    """Forward and backward through ``layer`` with a random output gradient."""
    rng = np.random.default_rng(seed)
    g = tg.Graph("t")
    x = g.input("x", shape=[None, *shape[1:]], dtype=dtype)
    g.output("y", layer(x))
    train = tg.TrainingGraph([g])
    train.add_inputs({"x": x})
    train.allocate_user_gradient("y")
    is_float = np.dtype(dtype).kind == "f"
    train.compile("cpu", CompileOptions(compute_all_gradients=is_float, disable_fusion=True))
    if is_float:
        X = rng.standard_normal(shape).astype(np.float32)
    else:
        X = rng.integers(0, 10, shape).astype(np.int64)
    y = train.execute_forward({"x": X}).outputs["y"]
    dy = rng.standard_normal(y.shape).astype(np.float32)
    train.execute_gradient(user_gradients={"y": dy})
    return train, X, y, dy


def _same(name: str, *args, **kwargs) -> tuple:
    """The traingraph layer and the torch module of one name, with the same arguments."""
    ours, theirs = getattr(L, name), getattr(torch.nn, name)
    return partial(ours, *args, **kwargs), partial(theirs, *args, **kwargs)


def _global_avg() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())


CASES = [
    (*_same("Linear", 5, 3), (4, 5)),
    (*_same("Linear", 5, 3), (2, 4, 5)),
    (*_same("Conv1d", 4, 6, 3, padding=1, groups=2), (2, 4, 7)),
    (*_same("Conv2d", 4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 7, 7)),
    (*_same("ConvTranspose2d", 4, 6, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 5)),
    (*_same("MaxPool2d", 2), (2, 3, 6, 6)),
    (*_same("AvgPool2d", 3, stride=2, padding=1), (2, 3, 7, 7)),
    (*_same("MaxPool1d", 2), (2, 3, 8)),
    (*_same("AvgPool1d", 2), (2, 3, 8)),
    (partial(L.GlobalAvgPool, flatten=True), _global_avg, (2, 3, 5, 5)),
    (L.GlobalMaxPool, partial(torch.nn.AdaptiveMaxPool2d, 1), (2, 3, 5, 5)),
    (*_same("BatchNorm2d", 3), (4, 3, 5, 5)),
    (*_same("BatchNorm1d", 3), (6, 3)),
    (*_same("LayerNorm", 6), (2, 4, 6)),
    (*_same("GroupNorm", 2, 4), (3, 4, 5, 5)),
    (*_same("ReLU"), (3, 7)),
    (*_same("GELU"), (3, 7)),
    (*_same("GELU", "tanh"), (3, 7)),
    (*_same("Sigmoid"), (3, 7)),
    (*_same("Tanh"), (3, 7)),
    (*_same("Softmax", 1), (3, 7)),
    (*_same("LogSoftmax", -1), (3, 7)),
    (*_same("LeakyReLU", 0.2), (3, 7)),
    (*_same("ELU"), (3, 7)),
    (*_same("SiLU"), (3, 7)),
    (*_same("Softplus"), (3, 7)),
    (*_same("Flatten"), (2, 3, 4)),
    (*_same("Dropout", 0.0), (3, 7)),
    (partial(L.MultiheadAttention, 8, 2), lambda: _TorchMHA(8, 2), (2, 5, 8)),
    (
        partial(L.MultiheadAttention, 8, 2, causal=True),
        lambda: _TorchMHA(8, 2, causal=True),
        (2, 5, 8),
    ),
]


class _TorchMHA(torch.nn.MultiheadAttention):
    def __init__(self, e: int, h: int, causal: bool = False) -> None:
        super().__init__(e, h, batch_first=True)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        mask = None
        if self.causal:
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        return super().forward(x, x, x, need_weights=False, attn_mask=mask)[0]


@pytest.mark.parametrize("make, make_torch, shape", CASES)
def test_layer_matches_torch(make, make_torch, shape) -> None:
    layer = make()
    train, X, y, dy = _run_layer(layer, shape)
    module = make_torch().train()
    params = train.get_parameters()
    state = {n.split(".", 1)[1]: torch.from_numpy(v) for n, v in params.items()}
    if state:
        module.load_state_dict(state, strict=True)
    xt = torch.from_numpy(X).requires_grad_(True)
    yt = module(xt)
    yt.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(train.gradient_tensor("x"), xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    torch_params = dict(module.named_parameters())
    for name in params:
        local = name.split(".", 1)[1]
        if local in torch_params and torch_params[local].grad is not None:
            np.testing.assert_allclose(
                train.gradient_data(name), torch_params[local].grad.numpy(), rtol=1e-4,
                atol=1e-5, err_msg=name,
            )  # fmt: skip


def test_embedding_matches_torch() -> None:
    layer = L.Embedding(10, 4)
    train, X, y, dy = _run_layer(layer, (3, 5), dtype="int64")
    module = torch.nn.Embedding(10, 4)
    module.weight.data = torch.from_numpy(train.get_parameters()["embedding0.weight"])
    yt = module(torch.from_numpy(X))
    yt.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        train.gradient_data("embedding0.weight"), module.weight.grad.numpy(), rtol=1e-5, atol=1e-6
    )


def test_functional_ops_match_numpy() -> None:
    g = tg.Graph("f")
    a = g.input("a", shape=[None, 4, 6])
    w = g.input("w", shape=[6, 3])
    first, second = L.split(a, [2, 4], axis=2)
    outs = {
        "arith": (a * 2.0 + 1.0 - a / 4.0) + (-a),
        "matmul": L.matmul(a, w) + (a @ w),
        "reshape": L.reshape(a, [0, 24]),
        "transpose": L.transpose(a, [0, 2, 1]),
        "concat": L.concat([second, first], axis=2),
        "slice": L.slice(a, [1], [3], axes=[1]),
        "gather": L.gather(a, [3, 0], axis=1),
        "sum": L.reduce_sum(a, [1]),
        "mean": L.reduce_mean(a, [2], keepdims=True),
        "max": L.reduce_max(a, [1]),
        "min": L.reduce_min(a, None),
        "ops": L.div(L.mul(L.sub(L.add(a, 1.0), 0.5), 3.0), 2.0),
    }
    for name, t in outs.items():
        g.output(name, t)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((2, 4, 6)).astype(np.float32)
    W = rng.standard_normal((6, 3)).astype(np.float32)
    r = tg.InferenceGraph([g]).compile("cpu").execute({"a": A, "w": W}).outputs
    expected = {
        "arith": A * 2 + 1 - A / 4 - A, "matmul": 2 * (A @ W), "reshape": A.reshape(2, 24),
        "transpose": A.transpose(0, 2, 1), "concat": np.concatenate([A[..., 2:], A[..., :2]], 2),
        "slice": A[:, 1:3], "gather": A[:, [3, 0]], "sum": A.sum(1),
        "mean": A.mean(2, keepdims=True), "max": A.max(1), "min": A.min(),
        "ops": ((A + 1) - 0.5) * 3 / 2,
    }  # fmt: skip
    for name, value in expected.items():
        np.testing.assert_allclose(r[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def test_initializers_follow_torch_distributions() -> None:
    rng = init.generator(0)
    shape = (400, 300)
    fan_in, fan_out = 300, 400
    w = init.kaiming_uniform(a=math.sqrt(5))(shape, rng)
    assert np.abs(w).max() <= 1 / math.sqrt(fan_in) and np.abs(w).max() > 0.99 / math.sqrt(fan_in)
    w = init.glorot_uniform()(shape, rng)
    bound = math.sqrt(6 / (fan_in + fan_out))
    assert np.abs(w).max() <= bound and np.std(w) == pytest.approx(bound / math.sqrt(3), rel=0.02)
    w = init.glorot_normal(gain=2.0)(shape, rng)
    assert np.std(w) == pytest.approx(2 * math.sqrt(2 / (fan_in + fan_out)), rel=0.02)
    w = init.kaiming_normal(nonlinearity="relu", mode="fan_out")(shape, rng)
    assert np.std(w) == pytest.approx(math.sqrt(2 / fan_out), rel=0.02)
    assert init.calculate_fans((8, 4, 3, 3)) == (36, 72)
    assert init.calculate_gain("leaky_relu", 0.2) == pytest.approx(
        torch.nn.init.calculate_gain("leaky_relu", 0.2)
    )
    assert np.array_equal(init.ones()((2,), rng), [1, 1]) and not init.zeros()((2,), rng).any()
    with pytest.raises(ValueError, match="nonlinearity"):
        init.calculate_gain("swish")


def test_layers_are_seeded() -> None:
    a, b = L.Conv2d(3, 4, 3, seed=7), L.Conv2d(3, 4, 3, seed=7)
    assert np.array_equal(a.params["weight"], b.params["weight"])
    init.manual_seed(5)
    c = L.Linear(4, 4)
    init.manual_seed(5)
    d = L.Linear(4, 4)
    assert np.array_equal(c.params["weight"], d.params["weight"])
    conv = L.Conv2d(6, 8, 3, groups=2, seed=1)
    bound = 1 / math.sqrt(3 * 9)
    assert (
        np.abs(conv.params["weight"]).max() <= bound and np.abs(conv.params["bias"]).max() <= bound
    )
