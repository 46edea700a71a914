"""Shared gradient checks: traingraph's gradients against central finite differences and torch.

``check_op_gradient`` builds a one-node model, appends the scalar loss
``L = sum_k sum(Y_k * W_k)`` with fixed random weights ``W_k`` (so no gradient is trivially
all-ones), differentiates it with :func:`traingraph.autodiff.build_gradient_graph` and compares
the onnxruntime result with central differences in float64 and, when ``torch_fn`` is given,
with ``torch.autograd``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from traingraph.autodiff import build_gradient_graph
from traingraph.ir.model import max_ir_version

_NP_TO_ONNX = {
    np.dtype(np.float64): onnx.TensorProto.DOUBLE,
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float16): onnx.TensorProto.FLOAT16,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.bool_): onnx.TensorProto.BOOL,
}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def assert_default_domain_only(model: onnx.ModelProto) -> None:
    """Every node of ``model`` (and its subgraphs) is in the default ONNX domain."""
    domains = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    assert not domains, f"non-default domains in the gradient graph: {domains}"


def _value_info(name: str, array: np.ndarray, dynamic: str) -> onnx.ValueInfoProto:
    shape: list[Any] = list(array.shape)
    if dynamic == "batch" and shape:
        shape[0] = f"{name}_batch"
    elif dynamic == "all":
        shape = [f"{name}_d{i}" for i in range(len(shape))]
    return helper.make_tensor_value_info(name, _NP_TO_ONNX[array.dtype], shape)


def make_op_model(
    op_type: str,
    inputs: Mapping[str, np.ndarray | None],
    attrs: Mapping[str, Any] | None = None,
    *,
    const_inputs: Sequence[str] = (),
    num_outputs: int = 1,
    opset: int = 17,
    dynamic: str = "batch",
) -> onnx.ModelProto:
    """A model of one ``op_type`` node. Inputs named in ``const_inputs`` become initializers;
    a None input is left out (an empty input name)."""
    graph_inputs, inits, names = [], [], []
    for name, array in inputs.items():
        if array is None:
            names.append("")
            continue
        names.append(name)
        if name in const_inputs:
            inits.append(numpy_helper.from_array(np.asarray(array), name))
        else:
            graph_inputs.append(_value_info(name, np.asarray(array), dynamic))
    while names and names[-1] == "":
        names.pop()
    outputs = [f"y{k}" for k in range(num_outputs)]
    node = helper.make_node(op_type, names, outputs, name=f"{op_type}_node", **(attrs or {}))
    graph = helper.make_graph(
        [node],
        "op",
        graph_inputs,
        [onnx.ValueInfoProto(name=o) for o in outputs],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=max_ir_version()
    )
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def add_weighted_sum_loss(
    model: onnx.ModelProto, outputs: Sequence[str], out_arrays: Sequence[np.ndarray]
) -> onnx.ModelProto:
    """Append ``loss = sum_k ReduceSum(Y_k * W_k)``; ``W_k`` are new graph inputs ``w_<Y_k>``."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    terms = []
    for name, arr in zip(outputs, out_arrays):
        w = f"w_{name}"
        g.input.append(helper.make_tensor_value_info(w, _NP_TO_ONNX[arr.dtype], arr.shape))
        g.node.append(helper.make_node("Mul", [name, w], [f"{name}_weighted"]))
        if opset >= 13:
            g.node.append(
                helper.make_node("ReduceSum", [f"{name}_weighted"], [f"{name}_sum"], keepdims=0)
            )
        terms.append(f"{name}_sum")
    g.node.append(helper.make_node("Sum", terms, ["loss"]))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", _NP_TO_ONNX[out_arrays[0].dtype], []))
    return model


def numeric_gradient(
    fn: Callable[[dict[str, np.ndarray]], float],
    feeds: dict[str, np.ndarray],
    name: str,
    eps: float,
) -> np.ndarray:
    """Central finite differences of the scalar ``fn`` with respect to ``feeds[name]``."""
    base = feeds[name]
    grad = np.zeros_like(base, dtype=np.float64)
    flat = base.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = fn(feeds)
        flat[i] = old - eps
        minus = fn(feeds)
        flat[i] = old
        grad.reshape(-1)[i] = (plus - minus) / (2 * eps)
    return grad


def check_model_gradient(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    loss: str = "loss",
    rtol: float = 1e-5,
    atol: float = 1e-6,
    eps: float = 1e-6,
    finite_differences: bool = True,
) -> dict[str, np.ndarray]:
    """Differentiate ``model`` (scalar output ``loss``) and check the result against central
    differences of the forward model. Returns the analytic gradients by ``wrt`` name."""
    grad_model = build_gradient_graph(model, wrt=list(wrt), loss=loss)
    onnx.checker.check_model(grad_model, full_check=True)
    assert_default_domain_only(grad_model)
    names = [o.name for o in grad_model.graph.output]
    for x in wrt:
        assert f"{x}_grad" in names, f"{x}_grad missing from outputs {names}"
    feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}
    needed = {i.name for i in grad_model.graph.input}
    run_feeds = {k: v for k, v in feeds.items() if k in needed}
    got = session(grad_model).run([f"{x}_grad" for x in wrt], run_feeds)
    analytic = dict(zip(wrt, got))
    if finite_differences:
        forward = session(model)
        forward_inputs = {i.name for i in model.graph.input}

        def fn(f: dict[str, np.ndarray]) -> float:
            out = forward.run([loss], {k: v for k, v in f.items() if k in forward_inputs})[0]
            return float(np.asarray(out, dtype=np.float64).sum())

        for x in wrt:
            if x not in feeds:
                raise AssertionError(f"finite differences need {x} as a graph input")
            expected = numeric_gradient(fn, feeds, x, eps)
            np.testing.assert_allclose(
                analytic[x],
                expected,
                rtol=rtol,
                atol=atol,
                err_msg=f"gradient of {x} differs from finite differences",
            )
    return analytic


def check_op_gradient(
    op_type: str,
    inputs: Mapping[str, np.ndarray | None],
    attrs: Mapping[str, Any] | None = None,
    *,
    wrt: Sequence[str] | None = None,
    const_inputs: Sequence[str] = (),
    num_outputs: int = 1,
    used_outputs: Sequence[int] | None = None,
    opset: int = 17,
    dynamic: str = "batch",
    torch_fn: Callable[..., Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    eps: float = 1e-6,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Check the gradient rule of ``op_type`` on one node.

    Args:
        op_type: The op.
        inputs: Node inputs by name, in order (None for a skipped optional input).
        attrs: Node attributes.
        wrt: Inputs differentiated; default every float input not in ``const_inputs``.
        const_inputs: Inputs stored as initializers (axes, shapes, indices, ...).
        num_outputs: Number of node outputs.
        used_outputs: Outputs that enter the loss (default all float outputs).
        opset: Default-domain opset of the model.
        dynamic: "none", "batch" (symbolic first dims) or "all" (every dim symbolic).
        torch_fn: ``torch_fn(*data_tensors) -> output or tuple of outputs`` to compare against;
            it takes every non-constant input, in order.
        rtol, atol, eps: Tolerances and the finite-difference step.
        seed: Seed of the loss weights.
    """
    model = make_op_model(
        op_type,
        inputs,
        attrs,
        const_inputs=const_inputs,
        num_outputs=num_outputs,
        opset=opset,
        dynamic=dynamic,
    )
    data = {k: np.asarray(v) for k, v in inputs.items() if v is not None and k not in const_inputs}
    outs = session(model).run(None, data)
    if used_outputs is None:
        used_outputs = [k for k, o in enumerate(outs) if np.asarray(o).dtype.kind == "f"]
    rng = np.random.default_rng(seed)
    out_names = [f"y{k}" for k in used_outputs]
    out_arrays = [np.asarray(outs[k]) for k in used_outputs]
    loss_model = add_weighted_sum_loss(model, out_names, out_arrays)
    weights = {
        f"w_{n}": rng.uniform(0.5, 1.5, size=a.shape).astype(a.dtype)
        for n, a in zip(out_names, out_arrays)
    }
    feeds = {**data, **weights}
    if wrt is None:
        wrt = [k for k, v in data.items() if v.dtype.kind == "f"]
    analytic = check_model_gradient(loss_model, feeds, wrt, rtol=rtol, atol=atol, eps=eps)
    if torch_fn is not None:
        compare_with_torch(torch_fn, data, wrt, analytic, weights, out_names, rtol, atol)
    return analytic


def compare_with_torch(
    torch_fn: Callable[..., Any],
    data: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    analytic: Mapping[str, np.ndarray],
    weights: Mapping[str, np.ndarray],
    out_names: Sequence[str],
    rtol: float,
    atol: float,
) -> None:
    """``torch.autograd`` gradients of the same weighted-sum loss equal ``analytic``."""
    import torch

    tensors = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in data.items()}
    outs = torch_fn(*tensors.values())
    if not isinstance(outs, (tuple, list)):
        outs = (outs,)
    loss = sum((o * torch.tensor(weights[f"w_{n}"])).sum() for o, n in zip(outs, out_names))
    grads = torch.autograd.grad(loss, [tensors[x] for x in wrt], allow_unused=True)
    for x, g in zip(wrt, grads):
        t = tensors[x]
        expected = np.zeros(t.shape) if g is None else g.detach().numpy()
        np.testing.assert_allclose(
            analytic[x],
            expected,
            rtol=rtol,
            atol=atol,
            err_msg=f"gradient of {x} differs from torch.autograd",
        )


def assert_same_training(
    got: tuple[Sequence[float], Sequence[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
    expected: tuple[Sequence[float], Sequence[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
    *,
    one_scale: bool = False,
) -> None:
    """Two runs of the same training steps, each ``(losses, the gradients of each step, the
    parameters after)``, agree: losses to 1e-5, gradients and parameters to 1e-4 relative and
    1e-6 absolute. With ``one_scale`` a step's gradients share the absolute tolerance 1e-6 of
    its largest one (the smallest carry the rounding differences of the largest)."""
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, expected
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for step, reference in zip(grads, ref_grads):
        assert step.keys() == reference.keys()
        atol = 1e-6 * max(np.abs(g).max() for g in reference.values()) if one_scale else 1e-6
        for name in reference:
            np.testing.assert_allclose(
                step[name], reference[name], rtol=1e-4, atol=atol, err_msg=name
            )
    for name in ref_params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=1e-4, atol=1e-6)


def train_steps(
    module: Any, optimizer: Any, state: Any, batches: Sequence[tuple[np.ndarray, np.ndarray]]
) -> tuple[list[float], list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """One train step per batch (forward and backward, optimizer step, gradient reset):
    the losses, each step's gradients and the parameters after, as
    :func:`assert_same_training` compares them."""
    losses, grads = [], []
    for x, y in batches:
        losses.append(float(module(x, y)))
        grads.append({n: p.grad.copy() for n, p in state.parameters.items() if p.grad is not None})
        optimizer.step()
        module.lazy_reset_grad()
    return losses, grads, {n: p.data.copy() for n, p in state.parameters.items()}


def adamw_artifacts(directory: Any, model: onnx.ModelProto, lr: float = 0.01) -> Any:
    """Training artifacts of ``model`` with a cross-entropy loss and AdamW at ``lr`` in
    ``directory``, which it returns."""
    from traingraph import artifacts, optim

    artifacts.generate_artifacts(
        model,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=lr),
        artifact_directory=directory,
    )
    return directory


def assert_trains_as_torch_adamw(
    got: tuple[Sequence[float], Any, Mapping[str, np.ndarray]],
    reference: Any,
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    lr: float,
) -> None:
    """``got`` (as :func:`train_steps` returns it) is PyTorch's cross-entropy training of the
    module ``reference`` with AdamW at ``lr`` on ``batches``: losses to 1e-5, parameters after
    to 1e-4 relative and 1e-6 absolute."""
    import torch

    opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        logits = reference(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(got[0], losses, rtol=1e-5)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(got[2][name], value.numpy(), rtol=1e-4, atol=1e-6)


def artifact_steps(
    directory: Any,
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    kind: type | tuple[type, ...],
    *,
    without: str | None = None,
) -> tuple[list[float], list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """:func:`train_steps` of the artifacts in ``directory`` with ``Module``; ``without`` (a
    kernel's name, :func:`traingraph.runtime.cpu.kernels.names`) leaves that native kernel out
    (``SessionConfig(native_kernels=...)``). Asserts the step runs a kernel of ``kind`` (a
    class, or a tuple of the forms it may take) exactly when it is not left out."""
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.runtime.cpu import kernels, segments
    from traingraph.runtime.session import SessionConfig

    chosen = None if without is None else set(kernels.names()) - {without}
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    config = SessionConfig(native_kernels=chosen)
    module = Module(directory / "training_model.onnx", state, session_config=config)
    plan = getattr(module.step.runner, "_plan", segments.Plan([]))
    # the plan's kernels, and the filter reorders that run before their segments
    kernels_run = [*plan.all_kernels, *getattr(module.step.runner, "_steps", [])]
    assert any(isinstance(k, kind) for k in kernels_run) == (without is None)
    optimizer = Optimizer(directory / "optimizer_model.onnx", module)
    return train_steps(module, optimizer, state, batches)
