r"""Named optimizers: ``torch.optim``'s algorithms as chains of gradient transformations.

Each constructor takes torch's arguments and defaults and returns an :class:`Optimizer`. The
optional ``no_decay`` (parts of parameter names, such as ``["bias", "LayerNorm.weight"]``)
leaves the parameters whose name contains one out of the weight decay, as the parameter group
with ``weight_decay=0`` of a torch fine-tuning script does. The optional ``l1``,
``clip_grad_value``, ``max_grad_norm_per_tensor`` and ``clip_grad_norm`` arguments put, in
this order, :func:`~traingraph.optim.transforms.add_l1_regularization`,
:func:`~traingraph.optim.transforms.clip`, :func:`~traingraph.optim.transforms.clip_by_norm`
and :func:`~traingraph.optim.transforms.clip_by_global_norm` in front of the chain: the L1
term acts as part of the loss's gradient, and clipping sees it before the optimizer does, as
``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``.

Example:
    >>> opt = AdamW(lr=3e-4, weight_decay=0.1, clip_grad_norm=1.0)
    >>> custom = Optimizer("custom", 0.1, chain(clip(0.5), trace(0.9), scale_by_learning_rate()))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traingraph.optim.transforms import (
    GradientTransformation,
    add_decayed_weights,
    add_l1_regularization,
    chain,
    clip,
    clip_by_global_norm,
    clip_by_norm,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    trace,
)


@dataclass
class Optimizer:
    """An optimizer: a chain of transforms and its initial learning rate.

    Attributes:
        name: Name of the algorithm (``"adamw"``, ``"sgd"``, ... or any name for a custom chain).
        lr: Initial learning rate; the optimizer model takes the current one as an input.
        transform: The gradient transformation, ending with ``scale_by_learning_rate()``.
        hyperparameters: The arguments the optimizer was built with, for checkpoints and display.
    """

    name: str
    lr: float
    transform: GradientTransformation
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_lr(self.name, self.lr)


def _check_lr(name: str, lr: float) -> None:
    if not lr >= 0:
        raise ValueError(f"{name}: the learning rate must be non-negative; got lr={lr}")


def _check_betas(name: str, betas: tuple[float, float]) -> None:
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1); got {betas}")


# The optional arguments that put a transform in front of every named optimizer, in order.
_PREFIX = (
    ("l1", add_l1_regularization),
    ("clip_grad_value", clip),
    ("max_grad_norm_per_tensor", clip_by_norm),
    ("clip_grad_norm", clip_by_global_norm),
)


def _optimizer(
    name: str,
    lr: float,
    core: list[GradientTransformation],
    hyperparameters: dict[str, Any],
    extras: tuple[float | None, ...],
    no_decay: Sequence[str] = (),
) -> Optimizer:
    """``chain(*regularization and clipping, *core, scale_by_learning_rate())`` named ``name``.

    ``extras`` holds the values of the ``_PREFIX`` arguments, None where not asked for;
    ``no_decay`` (recorded where given) the name parts of the parameters not decayed.
    """
    _check_lr(name, lr)
    if isinstance(no_decay, str) or not all(isinstance(part, str) for part in no_decay):
        raise ValueError(
            f"{name}: no_decay must be a list of strings (parts of the names of the parameters"
            f" that get no weight decay, such as ['bias', 'LayerNorm.weight']); got {no_decay!r}"
        )
    if no_decay:
        hyperparameters = {**hyperparameters, "no_decay": list(no_decay)}
    used = {arg: value for (arg, _), value in zip(_PREFIX, extras) if value is not None}
    prefix = [make(used[arg]) for arg, make in _PREFIX if arg in used]
    return Optimizer(
        name,
        lr,
        chain(*prefix, *core, scale_by_learning_rate()),
        {"lr": lr, **hyperparameters, **used},
    )


def SGD(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    l1: float | None = None,
    clip_grad_value: float | None = None,
    max_grad_norm_per_tensor: float | None = None,
    clip_grad_norm: float | None = None,
    no_decay: Sequence[str] = (),
) -> Optimizer:
    r"""Stochastic gradient descent, as ``torch.optim.SGD``.

    :math:`g \leftarrow g + \lambda p`; with momentum :math:`b_1 = g`,
    :math:`b_t = \mu b_{t-1} + (1-\tau) g`, :math:`g \leftarrow b_t` (or :math:`g + \mu b_t`
    with Nesterov); :math:`p \leftarrow p - \eta g`.

    Example:
        >>> opt = SGD(lr=0.1, momentum=0.9, nesterov=True)
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            "SGD: Nesterov momentum needs momentum > 0 and dampening == 0; got"
            f" momentum={momentum}, dampening={dampening}"
        )
    if not momentum >= 0 or not weight_decay >= 0:
        raise ValueError(
            f"SGD: momentum and weight_decay must be non-negative; got momentum={momentum},"
            f" weight_decay={weight_decay}"
        )
    core = [add_decayed_weights(weight_decay, no_decay)]
    if momentum > 0:
        core.append(trace(momentum, dampening, nesterov))
    return _optimizer(
        "sgd",
        lr,
        core,
        {"momentum": momentum, "dampening": dampening, "nesterov": nesterov,
         "weight_decay": weight_decay},
        (l1, clip_grad_value, max_grad_norm_per_tensor, clip_grad_norm),
        no_decay,
    )  # fmt: skip


def Adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    l1: float | None = None,
    clip_grad_value: float | None = None,
    max_grad_norm_per_tensor: float | None = None,
    clip_grad_norm: float | None = None,
    no_decay: Sequence[str] = (),
) -> Optimizer:
    r"""Adam, as ``torch.optim.Adam``, with its coupled L2 weight decay.

    :math:`g \leftarrow g + \lambda p`, then :func:`~traingraph.optim.transforms.scale_by_adam`,
    then :math:`p \leftarrow p - \eta u`.

    Example:
        >>> opt = Adam(lr=1e-3, betas=(0.9, 0.98), amsgrad=True)
    """
    _check_betas("Adam", betas)
    return _optimizer(
        "adam",
        lr,
        [add_decayed_weights(weight_decay, no_decay),
         scale_by_adam(betas[0], betas[1], eps, amsgrad)],
        {"betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad},
        (l1, clip_grad_value, max_grad_norm_per_tensor, clip_grad_norm),
        no_decay,
    )  # fmt: skip


def AdamW(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    amsgrad: bool = False,
    *,
    l1: float | None = None,
    clip_grad_value: float | None = None,
    max_grad_norm_per_tensor: float | None = None,
    clip_grad_norm: float | None = None,
    no_decay: Sequence[str] = (),
) -> Optimizer:
    r"""AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    :math:`p \leftarrow p - \eta(u_{\text{adam}} + \lambda p)
    = p(1 - \eta\lambda) - \eta u_{\text{adam}}`.

    Example:
        >>> opt = AdamW(lr=3e-4, weight_decay=0.1)
    """
    _check_betas("AdamW", betas)
    return _optimizer(
        "adamw",
        lr,
        [scale_by_adam(betas[0], betas[1], eps, amsgrad),
         add_decayed_weights(weight_decay, no_decay)],
        {"betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad},
        (l1, clip_grad_value, max_grad_norm_per_tensor, clip_grad_norm),
        no_decay,
    )  # fmt: skip


def RMSProp(
    lr: float = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    l1: float | None = None,
    clip_grad_value: float | None = None,
    max_grad_norm_per_tensor: float | None = None,
    clip_grad_norm: float | None = None,
    no_decay: Sequence[str] = (),
) -> Optimizer:
    r"""RMSprop, as ``torch.optim.RMSprop``.

    :math:`g \leftarrow g + \lambda p`, then :func:`~traingraph.optim.transforms.scale_by_rms`,
    then (with momentum) :math:`b_t = \mu b_{t-1} + u`, :math:`p \leftarrow p - \eta b_t`.

    Example:
        >>> opt = RMSProp(lr=1e-3, momentum=0.9, centered=True)
    """
    core = [add_decayed_weights(weight_decay, no_decay), scale_by_rms(alpha, eps, centered)]
    if momentum > 0:
        core.append(trace(momentum))
    return _optimizer(
        "rmsprop",
        lr,
        core,
        {"alpha": alpha, "eps": eps, "weight_decay": weight_decay, "momentum": momentum,
         "centered": centered},
        (l1, clip_grad_value, max_grad_norm_per_tensor, clip_grad_norm),
        no_decay,
    )  # fmt: skip


def Adagrad(
    lr: float = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    l1: float | None = None,
    clip_grad_value: float | None = None,
    max_grad_norm_per_tensor: float | None = None,
    clip_grad_norm: float | None = None,
    no_decay: Sequence[str] = (),
) -> Optimizer:
    r"""Adagrad, as ``torch.optim.Adagrad``.

    :math:`g \leftarrow g + \lambda p`, then
    :func:`~traingraph.optim.transforms.scale_by_adagrad`, then :math:`p \leftarrow p - \eta u`.

    Example:
        >>> opt = Adagrad(lr=0.1, lr_decay=1e-3, initial_accumulator_value=0.1)
    """
    return _optimizer(
        "adagrad",
        lr,
        [add_decayed_weights(weight_decay, no_decay),
         scale_by_adagrad(lr_decay, initial_accumulator_value, eps)],
        {"lr_decay": lr_decay, "weight_decay": weight_decay,
         "initial_accumulator_value": initial_accumulator_value, "eps": eps},
        (l1, clip_grad_value, max_grad_norm_per_tensor, clip_grad_norm),
        no_decay,
    )  # fmt: skip


__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Optimizer", "RMSProp"]


_NAMED: dict[str, Callable[..., Optimizer]] = {
    "sgd": SGD, "adam": Adam, "adamw": AdamW, "rmsprop": RMSProp, "adagrad": Adagrad,
}  # fmt: skip


def from_hyperparameters(name: str, hyperparameters: Mapping[str, Any]) -> Optimizer | None:
    """The named optimizer that :attr:`Optimizer.name` and :attr:`Optimizer.hyperparameters`
    describe (as an optimizer model's metadata records them), or None for a custom chain or
    arguments the named optimizer does not take.

    Example:
        >>> opt = AdamW(lr=3e-4, weight_decay=0.1)
        >>> again = from_hyperparameters(opt.name, opt.hyperparameters)
        >>> again.hyperparameters == opt.hyperparameters
        True
    """
    make = _NAMED.get(name)
    if make is None:
        return None
    arguments = dict(hyperparameters)
    if "betas" in arguments:
        arguments["betas"] = tuple(arguments["betas"])
    try:
        return make(**arguments)
    except (TypeError, ValueError):
        return None
