"""JAX: the benchmark models in ``jax.numpy`` with torch's semantics, one jitted train step.

The forward pass, loss, gradient and optimizer update (AdamW or SGD momentum, torch's
formulas) are one ``jax.jit`` function with the parameter and optimizer buffers donated.
Weights are the cached torch ``state_dict`` (names and layouts as torch keeps them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_entry, parse_args, report, timed_loop


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    from jax import lax

    config = json.loads(args.config)
    meta, weights, data = load_entry(args.entry)
    name, dropout = meta["name"], meta["dropout"]
    trainable = meta["trainable"]
    params = {k: jnp.asarray(weights[k]) for k in trainable}
    buffers = {k: jnp.asarray(v) for k, v in weights.items() if "running" in k}

    def linear(p, prefix, x):
        return x @ p[f"{prefix}.weight"].T + p[f"{prefix}.bias"]

    def conv(p, prefix, x, stride=1, padding=0):
        y = lax.conv_general_dilated(
            x,
            p[f"{prefix}.weight"],
            (stride, stride),
            [(padding, padding)] * 2,
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        )
        bias = p.get(f"{prefix}.bias")
        return y if bias is None else y + bias[None, :, None, None]

    def max_pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def batch_norm(p, prefix, x, new_buffers):
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3))
        count = x.size // x.shape[1]
        m, v = buffers_in[f"{prefix}.running_mean"], buffers_in[f"{prefix}.running_var"]
        new_buffers[f"{prefix}.running_mean"] = 0.9 * m + 0.1 * mean
        new_buffers[f"{prefix}.running_var"] = 0.9 * v + 0.1 * var * count / (count - 1)
        shape = (1, -1, 1, 1)
        h = (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + 1e-5)
        return h * p[f"{prefix}.weight"].reshape(shape) + p[f"{prefix}.bias"].reshape(shape)

    def layer_norm(p, prefix, x):
        mean = x.mean(-1, keepdims=True)
        var = x.var(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p[f"{prefix}.weight"] + p[f"{prefix}.bias"]

    def drop(x, key):
        if dropout == 0:
            return x
        keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
        return jnp.where(keep, x / (1.0 - dropout), 0.0)

    def block(p, prefix, x, nb):
        h = jax.nn.relu(
            batch_norm(p, f"{prefix}.bn1", conv(p, f"{prefix}.conv1", x, stride_of[prefix], 1), nb)
        )
        h = batch_norm(p, f"{prefix}.bn2", conv(p, f"{prefix}.conv2", h, 1, 1), nb)
        if f"{prefix}.down.0.weight" in p:
            x = batch_norm(
                p, f"{prefix}.down.1", conv(p, f"{prefix}.down.0", x, stride_of[prefix]), nb
            )
        return jax.nn.relu(h + x)

    stride_of = {"layer1": 1, "layer2": 2, "layer3": 2}

    def encoder(p, prefix, x, key):
        batch, seq, d = x.shape
        heads = 4
        keys = jax.random.split(key, 4)
        q, k, v = jnp.split(linear(p, f"{prefix}.qkv", x), 3, axis=-1)
        q, k, v = (
            t.reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3) for t in (q, k, v)
        )
        scores = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * (d // heads) ** -0.5, axis=-1)
        attended = (drop(scores, keys[0]) @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
        x = layer_norm(
            p, f"{prefix}.norm1", x + drop(linear(p, f"{prefix}.out", attended), keys[1])
        )
        hidden = drop(jax.nn.gelu(linear(p, f"{prefix}.linear1", x), approximate=False), keys[2])
        return layer_norm(
            p, f"{prefix}.norm2", x + drop(linear(p, f"{prefix}.linear2", hidden), keys[3])
        )

    buffers_in = buffers

    def forward(p, x, key):
        new_buffers = {}
        if name == "mlp":
            out = linear(p, "fc2", jax.nn.relu(linear(p, "fc1", x)))
        elif name == "lenet":
            h = max_pool(jax.nn.relu(conv(p, "conv1", x, 1, 2)))
            h = max_pool(jax.nn.relu(conv(p, "conv2", h)))
            h = jax.nn.relu(linear(p, "fc1", h.reshape(h.shape[0], -1)))
            out = linear(p, "fc3", jax.nn.relu(linear(p, "fc2", h)))
        elif name == "resnet8":
            h = jax.nn.relu(batch_norm(p, "bn", conv(p, "conv", x, 1, 1), new_buffers))
            for prefix in ("layer1", "layer2", "layer3"):
                h = block(p, prefix, h, new_buffers)
            out = linear(p, "fc", h.mean(axis=(2, 3)))
        else:
            keys = jax.random.split(key, 2)
            for i in range(2):
                x = encoder(p, f"layers.{i}", x, keys[i])
            out = linear(p, "fc", x.mean(axis=1))
        return out, new_buffers

    def loss_fn(p, x, y, key):
        logits, new_buffers = forward(p, x, key)
        picked = jnp.take_along_axis(logits, y[:, None], axis=1)[:, 0]
        return (jax.nn.logsumexp(logits, axis=1) - picked).mean(), new_buffers

    lr, wd, mu = meta["lr"], meta["weight_decay"], meta["momentum"]
    b1, b2, eps = 0.9, 0.999, 1e-8

    def update(p, g, state, t):
        if meta["optimizer"] == "sgd":
            buf = {k: mu * state["buf"][k] + g[k] for k in p}
            return {k: p[k] - lr * buf[k] for k in p}, {"buf": buf}
        m = {k: b1 * state["m"][k] + (1 - b1) * g[k] for k in p}
        v = {k: b2 * state["v"][k] + (1 - b2) * g[k] * g[k] for k in p}
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        new = {
            k: p[k] * (1 - lr * wd) - (lr / bc1) * m[k] / (jnp.sqrt(v[k] / bc2) + eps) for k in p
        }
        return new, {"m": m, "v": v}

    def train_step(p, state, buffers_state, x, y, key, t):
        nonlocal buffers_in
        buffers_in = buffers_state
        (loss, new_buffers), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, y, key)
        new_p, new_state = update(p, grads, state, t)
        return new_p, new_state, {**buffers_state, **new_buffers}, loss

    step_fn = jax.jit(train_step, donate_argnums=(0, 1, 2))

    def zeros():
        return {k: jnp.zeros_like(v) for k, v in params.items()}

    opt_state = {"buf": zeros()} if meta["optimizer"] == "sgd" else {"m": zeros(), "v": zeros()}
    carry = {"p": params, "s": opt_state, "b": buffers, "t": 0, "key": jax.random.PRNGKey(0)}

    def step(x, y):
        carry["t"] += 1
        carry["key"], key = jax.random.split(carry["key"])
        carry["p"], carry["s"], carry["b"], loss = step_fn(
            carry["p"], carry["s"], carry["b"], x, y, key, jnp.float32(carry["t"])
        )
        return float(loss.block_until_ready())

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args)
    report("jax_jit", meta, times, losses, setup, config=config)


if __name__ == "__main__":
    main()
