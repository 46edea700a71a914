"""Optimizers as ONNX graph builders (optax style) and learning-rate schedulers.

Example:
    >>> from traingraph.optim import AdamW, ParamInfo, build_optimizer_model, init_state
    >>> opt = AdamW(lr=1e-3, clip_grad_norm=1.0)
    >>> model = build_optimizer_model(opt, [ParamInfo("w", (4, 3), np.dtype("float32"))])
"""

from traingraph.optim.alias import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Optimizer,
    RMSProp,
    from_hyperparameters,
)
from traingraph.optim.model import (
    build_flat_optimizer_model,
    build_optimizer_model,
    flattenable,
    init_state,
    param_infos,
    state_slots,
)
from traingraph.optim.schedulers import (
    ConstantLRScheduler,
    CosineLRScheduler,
    ExponentialLRScheduler,
    LinearLRScheduler,
    LRScheduler,
    StepLRScheduler,
)
from traingraph.optim.transforms import (
    GradientTransformation,
    ParamInfo,
    StateSlot,
    UpdateContext,
    add_decayed_weights,
    add_l1_regularization,
    add_l2,
    chain,
    clip,
    clip_by_global_norm,
    clip_by_norm,
    momentum,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    trace,
)

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "ConstantLRScheduler",
    "CosineLRScheduler",
    "ExponentialLRScheduler",
    "GradientTransformation",
    "LRScheduler",
    "LinearLRScheduler",
    "Optimizer",
    "ParamInfo",
    "RMSProp",
    "StateSlot",
    "StepLRScheduler",
    "UpdateContext",
    "add_decayed_weights",
    "add_l1_regularization",
    "add_l2",
    "build_flat_optimizer_model",
    "build_optimizer_model",
    "chain",
    "clip",
    "clip_by_global_norm",
    "clip_by_norm",
    "flattenable",
    "from_hyperparameters",
    "init_state",
    "momentum",
    "param_infos",
    "scale",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_rms",
    "state_slots",
    "trace",
]
