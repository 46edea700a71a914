"""traingraph: artifacts from the cached ONNX export, run by ``traingraph.api``.

Config keys (``--config``): ``optimization`` ("disable", "basic", "extended", "all"),
``intra_op_threads`` (0: one per core), ``allow_spinning`` (bool), fields of
``traingraph.runtime.session.SessionConfig``; and ``fused_optimizer`` (bool): replace
``Optimizer.step`` by :func:`traingraph.runtime.fused.fused_update` applied in place to the
runtime's parameter, gradient and slot buffers, a measurement of that fast path before it is
wired into ``traingraph.api``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_entry, parse_args, report, timed_loop


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    import onnx

    from traingraph import artifacts, optim
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.runtime.session import SessionConfig

    meta, weights, data = load_entry(args.entry)
    options = json.loads(args.config)
    fused = options.pop("fused_optimizer", False)
    config = SessionConfig(**options)
    model = onnx.load(args.entry / "model.onnx")
    trainable = meta["trainable"]
    frozen = [i.name for i in model.graph.initializer if i.name not in trainable]
    if meta["optimizer"] == "sgd":
        optimizer = optim.SGD(lr=meta["lr"], momentum=meta["momentum"])
    else:
        optimizer = optim.AdamW(lr=meta["lr"], weight_decay=meta["weight_decay"])
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        artifacts.generate_artifacts(
            model,
            requires_grad=trainable,
            frozen_params=frozen,
            loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=optimizer,
            artifact_directory=directory,
        )
        state = CheckpointState.load_checkpoint(directory / "checkpoint")
        module = Module(directory / "training_model.onnx", state, session_config=config)
        opt = Optimizer(directory / "optimizer_model.onnx", module)
    module.train()
    update = opt.step
    if fused:
        update = fused_step(optimizer, module._runtime)

    def step(x, y):
        loss = module(x, y)
        update()
        module.lazy_reset_grad()
        return loss

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args.steps, args.warmup)
    report("traingraph", meta, times, losses, setup, config=json.loads(args.config))


def fused_step(optimizer, state):
    """``Optimizer.step`` done by the fused CPU update, in place on the runtime's buffers."""
    from traingraph.runtime.fused import fused_update

    update = fused_update(optimizer.name, optimizer.hyperparameters)
    if update is None:
        raise SystemExit(f"no fused update for {optimizer.name} {optimizer.hyperparameters}")
    slots = state.optimizer_slots.cur
    groups = [
        (
            state.trainable.cur.view(name),
            state.grads.view(name),
            {k[len(name) + 1 :]: slots.view(k) for k in slots if k.startswith(name + ".")},
        )
        for name in state.trainable.cur
    ]

    def step():
        state.step += 1
        for param, grad, kinds in groups:
            update(param, grad, kinds, lr=state.learning_rate, step=state.step)

    return step


if __name__ == "__main__":
    main()
