r"""Fused optimizer updates on the CPU: in place, one pass, no allocation per step.

The standard-op optimizer graph (:func:`traingraph.optim.build_optimizer_model`) stays the
portable artifact. On the CPU, where parameters, gradients and slots are numpy views of
contiguous :class:`~traingraph.runtime.tensors.TensorStore` blocks, :func:`fused_update` applies
the same update in place, with the graph's float operations in the graph's order, so both give
the same numbers bit for bit.

Two backends compute it (:data:`BACKEND` says which one :func:`fused_update` uses):

- ``"native"``: the C extension ``traingraph.runtime._fusedc``, built at install time where a C
  compiler exists. One pass over memory per call, without the GIL, on C-contiguous float32 or
  float64 arrays (others go to the numpy code).
- ``"numpy"``: :func:`adamw_step` and :func:`sgd_step`, a fixed number of in-place numpy calls
  (about ten passes over memory) on arrays of any layout and float dtype.

Either works on any shape; called on flat blocks (all parameters at once) one call updates
everything.

Example:
    >>> update = fused_update("adamw", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
    ...                                 "weight_decay": 0.01, "amsgrad": False})
    >>> update(params, grads, {"exp_avg": m, "exp_avg_sq": v}, lr=1e-3, step=1)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from traingraph.runtime.device import physical_cores


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._fusedc")
    except ImportError:
        return None


_native = _load_native()

BACKEND: str = "native" if _native is not None else "numpy"
"""The backend :func:`fused_update` uses by default: ``"native"`` when the C extension was
built at install time, else ``"numpy"``."""


class Scratch:
    """Reusable temporaries, one pair per (shape, dtype), so updates allocate only once."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[tuple[int, ...], np.dtype], tuple[np.ndarray, np.ndarray]] = {}

    def get(self, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = (like.shape, like.dtype)
        if key not in self._buffers:
            self._buffers[key] = (np.empty_like(like), np.empty_like(like))
        return self._buffers[key]


def adamw_step(
    param: np.ndarray,
    grad: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    *,
    lr: float,
    step: int,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    scratch: Scratch | None = None,
) -> None:
    r"""One AdamW step in place, as the optimizer graph of ``optim.AdamW`` computes it.

    .. math::
        m \leftarrow m + (1-\beta_1)(g - m), \quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2, \\
        p \leftarrow p + (-\eta)\Big(\frac{m / (1-\beta_1^t)}
            {\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon} + \lambda p\Big)

    The bias corrections are computed in float64 and rounded to the parameters' dtype, as in
    the graph.

    Args:
        param, grad, exp_avg, exp_avg_sq: Arrays of one shape and float dtype; ``param``,
            ``exp_avg`` and ``exp_avg_sq`` are updated in place.
        lr: Learning rate :math:`\eta`.
        step: The 1-based number of this step :math:`t`.
        betas, eps, weight_decay: :math:`\beta_1, \beta_2, \epsilon, \lambda`.
        scratch: Temporaries to reuse between calls (allocated here when None).
    """
    _check_same(param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    dtype = param.dtype.type
    b1, b2 = betas
    bc1 = dtype(1.0 - b1**step)
    bc2_sqrt = dtype(np.sqrt(1.0 - b2**step))
    a, u = (scratch or Scratch()).get(param)
    np.subtract(grad, exp_avg, out=a)
    a *= dtype(1.0 - b1)
    exp_avg += a
    exp_avg_sq *= dtype(b2)
    np.multiply(grad, grad, out=a)
    a *= dtype(1.0 - b2)
    exp_avg_sq += a
    np.sqrt(exp_avg_sq, out=a)
    a /= bc2_sqrt
    a += dtype(eps)
    np.divide(exp_avg, bc1, out=u)
    u /= a
    if weight_decay != 0:
        np.multiply(param, dtype(weight_decay), out=a)
        u += a
    u *= -dtype(lr)
    param += u


def sgd_step(
    param: np.ndarray,
    grad: np.ndarray,
    momentum_buffer: np.ndarray | None,
    *,
    lr: float,
    step: int,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    scratch: Scratch | None = None,
) -> None:
    r"""One SGD step in place, as the optimizer graph of ``optim.SGD`` computes it.

    .. math::
        g \leftarrow g + \lambda p, \quad
        b \leftarrow \begin{cases} g & t = 1,\ \tau \ne 0 \\ \mu b + (1-\tau) g & \text{else}
        \end{cases}, \quad
        p \leftarrow p + (-\eta)\,(g + \mu b \text{ if nesterov else } b)

    (with :math:`\tau = 0` the buffer is :math:`\mu b + g`, which is :math:`g` at the first
    step because the buffer starts at zero). ``grad`` is not modified.

    Args:
        param, grad: Arrays of one shape and float dtype; ``param`` is updated in place.
        momentum_buffer: The ``momentum_buffer`` slot (None when ``momentum`` is 0).
        lr: Learning rate :math:`\eta`.
        step: The 1-based number of this step :math:`t`.
        momentum, dampening, nesterov, weight_decay: As ``torch.optim.SGD``.
        scratch: Temporaries to reuse between calls (allocated here when None).
    """
    _check_same(param, grad=grad)
    if momentum > 0 and momentum_buffer is None:
        raise ValueError("sgd_step: momentum > 0 needs the momentum_buffer slot; got None")
    dtype = param.dtype.type
    a, u = (scratch or Scratch()).get(param)
    g = grad
    if weight_decay != 0:
        np.multiply(param, dtype(weight_decay), out=a)
        np.add(grad, a, out=u)
        g = u
    if momentum > 0:
        assert momentum_buffer is not None
        _check_same(param, momentum_buffer=momentum_buffer)
        momentum_buffer *= dtype(momentum)
        if dampening == 0:
            momentum_buffer += g
        elif step == 1:
            momentum_buffer[...] = g
        else:
            np.multiply(g, dtype(1.0 - dampening), out=a)
            momentum_buffer += a
        if nesterov:
            np.multiply(momentum_buffer, dtype(momentum), out=a)
            if g is not u:
                np.copyto(u, g)
            u += a
        else:
            np.copyto(u, momentum_buffer)
    elif g is not u:
        np.copyto(u, g)
    u *= -dtype(lr)
    param += u


class FusedUpdate(Protocol):
    """``update(params, grads, slots, lr=, step=)``: one step over matching arrays in place.

    ``slots`` maps a slot kind (``"exp_avg"``, ``"momentum_buffer"``, ...) to the array of
    that slot for ``params``; all arrays have one shape (e.g. the flat blocks of a
    TensorStore, or one parameter's tensors).
    """

    def __call__(
        self,
        params: np.ndarray,
        grads: np.ndarray,
        slots: Mapping[str, np.ndarray],
        *,
        lr: float,
        step: int,
    ) -> None: ...


def fused_update(
    name: str,
    hyperparameters: Mapping[str, Any],
    *,
    backend: str | None = None,
    threads: int | None = None,
) -> FusedUpdate | None:
    """The fused update of optimizer ``name`` with ``hyperparameters``, or None.

    ``name`` and ``hyperparameters`` are :class:`traingraph.optim.Optimizer`'s ``name`` and
    ``hyperparameters``. None means there is no fused form (another algorithm, AMSGrad,
    clipping or L1 terms): run the optimizer graph instead.

    Args:
        name: The optimizer's name (``"adamw"``, ``"sgd"``, ...).
        hyperparameters: Its hyperparameters.
        backend: ``"native"`` or ``"numpy"``; None picks :data:`BACKEND`. The native update
            hands arrays it does not take (not C-contiguous, or neither float32 nor float64)
            to the numpy code.
        threads: Threads of the native update over large arrays (the elements split between
            them; the numbers do not change); None: one per physical core.

    Raises:
        ValueError: ``backend`` is unknown, or ``"native"`` where the extension was not built.
    """
    backend = BACKEND if backend is None else backend
    if backend not in ("native", "numpy"):
        raise ValueError(f"fused_update: backend must be 'native' or 'numpy'; got {backend!r}")
    if backend == "native" and _native is None:
        raise ValueError(
            "fused_update: the native backend is not available (traingraph.runtime._fusedc was"
            " not built: no C compiler at install time); use backend='numpy', or reinstall"
            " traingraph where gcc or clang exists"
        )
    extras = {"l1", "clip_grad_value", "max_grad_norm_per_tensor", "clip_grad_norm"}
    if extras & set(hyperparameters):
        return None
    native = _native if backend == "native" else None
    threads = physical_cores() if threads is None else max(1, int(threads))
    scratch = Scratch()
    h = dict(hyperparameters)
    if name == "adamw" and not h.get("amsgrad", False):
        b1, b2 = h.get("betas", (0.9, 0.999))
        eps, weight_decay = h.get("eps", 1e-8), h.get("weight_decay", 0.01)

        def adamw(params, grads, slots, *, lr, step):
            adamw_step(
                params, grads, slots["exp_avg"], slots["exp_avg_sq"], lr=lr, step=step,
                betas=(b1, b2), eps=eps, weight_decay=weight_decay, scratch=scratch,
            )  # fmt: skip

        if native is None:
            return adamw

        def native_adamw(params, grads, slots, *, lr, step):
            try:
                native.adamw(
                    params, grads, slots["exp_avg"], slots["exp_avg_sq"], lr, step, b1, b2, eps,
                    weight_decay, threads,
                )  # fmt: skip
            except native.UnsupportedArray:
                adamw(params, grads, slots, lr=lr, step=step)

        return native_adamw
    if name == "sgd":
        momentum, dampening = h.get("momentum", 0.0), h.get("dampening", 0.0)
        nesterov, weight_decay = h.get("nesterov", False), h.get("weight_decay", 0.0)

        def sgd(params, grads, slots, *, lr, step):
            sgd_step(
                params, grads, slots.get("momentum_buffer"), lr=lr, step=step, momentum=momentum,
                dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                scratch=scratch,
            )  # fmt: skip

        if native is None:
            return sgd

        def native_sgd(params, grads, slots, *, lr, step):
            try:
                native.sgd(
                    params, grads, slots.get("momentum_buffer"), lr, step, momentum, dampening,
                    nesterov, weight_decay, threads,
                )  # fmt: skip
            except native.UnsupportedArray:
                sgd(params, grads, slots, lr=lr, step=step)

        return native_sgd
    return None


def _check_same(param: np.ndarray, **others: np.ndarray) -> None:
    if param.dtype.kind != "f":
        raise TypeError(f"fused optimizer updates need float parameters; got {param.dtype}")
    for name, array in others.items():
        if array.shape != param.shape or array.dtype != param.dtype:
            raise ValueError(
                f"{name} has shape {array.shape} and dtype {array.dtype}, but the parameter has"
                f" shape {param.shape} and dtype {param.dtype}; pass matching arrays"
            )


__all__ = ["BACKEND", "FusedUpdate", "Scratch", "adamw_step", "fused_update", "sgd_step"]
