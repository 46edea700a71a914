"""traingraph: artifacts from the cached ONNX export, run by ``traingraph.api``.

The artifacts are written in a child process (``common.in_child``). Config keys
(``--config``): ``optimization`` ("disable", "basic", "extended", "all"), ``intra_op_threads``
(0: one per core; ``--threads`` sets it too), ``allow_spinning`` and ``spin_between_runs`` (bool),
fields of ``traingraph.runtime.session.SessionConfig``; and ``graph_optimizer`` (bool): run the
standard-op optimizer graph at every step (``Optimizer(..., fused=False)``) instead of the
fused in-place CPU update, to measure the portable path.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import in_child, load_entry, parse_args, report, timed_loop


def write_artifacts(
    entry: Path, meta: dict, directory: Path, model: Any = None, **options: object
) -> None:
    """The training artifacts of the cached export ``entry`` (its optimizer from ``meta``), or
    of ``model`` (an export of the same module by ``traingraph.from_torch``, which records its
    parameters); ``options`` go to ``generate_artifacts`` (e.g. ``mixed_precision``)."""
    import onnx

    from traingraph import artifacts, optim

    trainable = frozen = None
    if model is None:
        model = onnx.load(entry / "model.onnx")
        trainable = meta["trainable"]
        frozen = [i.name for i in model.graph.initializer if i.name not in trainable]
    if meta["optimizer"] == "sgd":
        optimizer = optim.SGD(lr=meta["lr"], momentum=meta["momentum"])
    else:
        optimizer = optim.AdamW(lr=meta["lr"], weight_decay=meta["weight_decay"])
    artifacts.generate_artifacts(
        model,
        requires_grad=trainable,
        frozen_params=frozen,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optimizer,
        artifact_directory=directory,
        **options,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    meta, weights, data = load_entry(args.entry)
    options = json.loads(args.config)
    fused = not options.pop("graph_optimizer", False)
    if args.threads:
        options.setdefault("intra_op_threads", args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        in_child(write_artifacts, args.entry, meta, directory)
        from traingraph.api import CheckpointState, Module, Optimizer
        from traingraph.runtime.session import SessionConfig

        state = CheckpointState.load_checkpoint(directory / "checkpoint")
        module = Module(
            directory / "training_model.onnx", state, session_config=SessionConfig(**options)
        )
        opt = Optimizer(directory / "optimizer_model.onnx", module, fused=fused)
    module.train()

    def step(x, y):
        loss = module(x, y)
        opt.step()
        module.lazy_reset_grad()
        return loss

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args)
    report("traingraph", meta, times, losses, setup, config=options)


if __name__ == "__main__":
    main()
