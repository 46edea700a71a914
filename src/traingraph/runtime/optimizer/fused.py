r"""Fused optimizer updates on the CPU: in place, one pass, no allocation per step.

The standard-op optimizer graph (:func:`traingraph.optim.build_optimizer_model`) is the
optimizer's portable form and its reference. On the CPU, where parameters, gradients and slots
are numpy views of contiguous :class:`~traingraph.runtime.tensors.TensorStore` blocks, the C
extension ``traingraph.runtime._fusedc`` (built at install time where a C compiler exists)
applies the same update in place, with the graph's float operations in the graph's order, so
both give the same numbers bit for bit: one pass over memory per call, without the GIL, on
C-contiguous float32 or float64 arrays. :func:`fused_update` gives it where it exists;
elsewhere the runtime runs the graph (:class:`~traingraph.runtime.optimizer.OptimizerUpdate`
chooses).

Called on flat blocks (all parameters at once) one call updates everything.

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

from traingraph.optim.model import flattenable_hyperparameters
from traingraph.optim.transforms import decay_excluded
from traingraph.runtime.device import physical_cores


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("traingraph.runtime._fusedc")
    except ImportError:
        return None


_native = _load_native()

AVAILABLE: bool = _native is not None
"""Whether the C extension was built at install time."""

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The dtypes the fused updates take (of C-contiguous arrays)."""


class FusedUpdate(Protocol):
    """``update(params, grads, slots, lr=, step=)``: one step over matching arrays in place.

    ``slots`` maps a slot kind (``"exp_avg"``, ``"momentum_buffer"``, ...) to the array of
    that slot for ``params``; all arrays have one shape and one dtype of :data:`DTYPES` and
    are C-contiguous (e.g. the flat blocks of a TensorStore, or one parameter's tensors).
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
    threads: int | None = None,
    spans: Mapping[str, tuple[int, int]] | None = None,
) -> FusedUpdate | None:
    r"""The fused update of optimizer ``name`` with ``hyperparameters``, or None.

    ``name`` and ``hyperparameters`` are :class:`traingraph.optim.Optimizer`'s ``name`` and
    ``hyperparameters``. None means there is no fused form (the extension was not built, or
    another algorithm, AMSGrad, clipping or L1 terms, or parameters left out of the weight decay
    without ``spans``): run the optimizer graph instead.

    AdamW (``optim.AdamW``) computes, with the bias corrections in float64 rounded to the
    parameters' dtype, as the graph does:

    .. math::
        m \leftarrow m + (1-\beta_1)(g - m), \quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2, \\
        p \leftarrow p + (-\eta)\Big(\frac{m / (1-\beta_1^t)}
            {\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon} + \lambda p\Big)

    SGD (``optim.SGD``), as ``torch.optim.SGD``:

    .. math::
        g \leftarrow g + \lambda p, \quad
        b \leftarrow \begin{cases} g & t = 1,\ \tau \ne 0 \\ \mu b + (1-\tau) g & \text{else}
        \end{cases}, \quad
        p \leftarrow p + (-\eta)\,(g + \mu b \text{ if nesterov else } b)

    Args:
        name: The optimizer's name (``"adamw"``, ``"sgd"``, ...).
        hyperparameters: Its hyperparameters.
        threads: Threads of the update over large arrays (the elements split between them;
            the numbers do not change); None: one per physical core.
        spans: Each parameter's ``(start, stop)`` in the flat block, which the update needs
            where ``hyperparameters`` leave parameters out of the weight decay (``no_decay``):
            it then runs over the runs of decayed and undecayed parameters in turn.
    """
    native = _native
    undecayed = undecayed_spans(name, hyperparameters, spans)
    if native is None or undecayed is None:
        return None
    h = dict(hyperparameters)
    threads = physical_cores() if threads is None else max(1, int(threads))
    if name == "adamw":
        b1, b2 = h.get("betas", (0.9, 0.999))
        eps, weight_decay = h.get("eps", 1e-8), h.get("weight_decay", 0.01)

        def adamw(params, grads, slots, *, lr, step):
            m, v = slots["exp_avg"], slots["exp_avg_sq"]
            for part, decay in _parts(params.size, undecayed, weight_decay):
                native.adamw(
                    params[part], grads[part], m[part], v[part], lr, step, b1, b2, eps, decay,
                    threads,
                )  # fmt: skip

        return adamw
    if name == "sgd":
        momentum, dampening = h.get("momentum", 0.0), h.get("dampening", 0.0)
        nesterov, weight_decay = h.get("nesterov", False), h.get("weight_decay", 0.0)

        def sgd(params, grads, slots, *, lr, step):
            buffer = slots.get("momentum_buffer")
            for part, decay in _parts(params.size, undecayed, weight_decay):
                native.sgd(
                    params[part], grads[part], None if buffer is None else buffer[part], lr,
                    step, momentum, dampening, nesterov, decay, threads,
                )  # fmt: skip

        return sgd
    return None


def undecayed_spans(
    name: str,
    hyperparameters: Mapping[str, Any],
    spans: Mapping[str, tuple[int, int]] | None = None,
) -> list[tuple[int, int]] | None:
    """The spans of the flat block a one-pass update of optimizer ``name`` leaves out of the
    weight decay (``[]``: none), or None where the optimizer has no one-pass form: another
    algorithm than AdamW without AMSGrad and SGD, clipping or L1 terms, or parameters left out
    of the weight decay without ``spans`` (each parameter's ``(start, stop)``)."""
    extras = {"l1", "clip_grad_value", "max_grad_norm_per_tensor", "clip_grad_norm"}
    if extras & set(hyperparameters):
        return None
    if not (name == "sgd" or (name == "adamw" and not hyperparameters.get("amsgrad", False))):
        return None
    if flattenable_hyperparameters(dict(hyperparameters)):
        return []
    if spans is None:
        return None
    exclude = hyperparameters.get("no_decay", ())
    return sorted(span for n, span in spans.items() if decay_excluded(n, exclude))


def _parts(
    size: int, undecayed: list[tuple[int, int]], weight_decay: float
) -> list[tuple[Any, float]]:
    """The parts of the arrays to update, each with its weight decay: the whole arrays
    (whatever their shape) where no span is undecayed, else the :func:`runs` of the flat
    block."""
    if not undecayed:
        return [(..., weight_decay)]
    return [(slice(a, b), decay) for a, b, decay in runs(size, undecayed, weight_decay)]


def runs(
    size: int, undecayed: list[tuple[int, int]], weight_decay: float
) -> list[tuple[int, int, float]]:
    """``[0, size)`` as runs ``(start, stop, decay)``: the sorted spans ``undecayed`` (next
    ones merged) without weight decay, the rest with ``weight_decay``."""
    found: list[tuple[int, int, float]] = []
    at = 0
    for start, stop in undecayed:
        if start > at:
            found.append((at, start, weight_decay))
        if found and found[-1][2] == 0.0 and found[-1][1] == start and weight_decay != 0.0:
            found[-1] = (found[-1][0], stop, 0.0)
        else:
            found.append((start, stop, 0.0))
        at = stop
    if at < size or not found:
        found.append((at, size, weight_decay))
    return found


__all__ = ["AVAILABLE", "DTYPES", "FusedUpdate", "fused_update", "runs", "undecayed_spans"]
