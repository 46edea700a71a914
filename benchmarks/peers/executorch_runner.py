"""ExecuTorch's training module: the cached ``torch.export`` program, lowered and run.

Runs in an environment with ``executorch`` from PyPI and the torch it runs with
(``benchmarks/run.py --setup-envs`` creates it). A child process (``common.cached_build``, once
per entry) takes the entry's ``program.pt2`` (the model with its cross-entropy loss, exported by
``benchmarks/zoo.py``), adds its backward graph (``torch.export.experimental.
_export_forward_backward``), lowers it to the edge dialect and to an ExecuTorch program; the
runner loads that program with ``executorch.extension.training`` and steps its SGD optimizer,
the only one ExecuTorch ships. Models trained with AdamW run with SGD (momentum 0.9) here,
which the result says (``optimizer``); only their first loss compares with the other systems.
A lowering that fails, or takes over :data:`LOWERING_LIMIT_S`, is remembered in the entry.
``--threads`` sizes ExecuTorch's thread pool (0 leaves its default).
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cached_build, load_entry, parse_args, report, timed_loop

LOWERING_LIMIT_S = 480.0
"""How long the lowering may take; a model it has not lowered by then is reported as such."""


def lower(program: Path, target: Path) -> None:
    """Write the ExecuTorch training program (forward and backward) of ``program`` to
    ``target``."""
    import torch
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    # attention decomposed into matmuls and softmax: ExecuTorch has no fused-attention kernels
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        joint = _export_forward_backward(torch.export.load(program))
    target.write_bytes(to_edge(joint).to_executorch().buffer)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    meta, _, data = load_entry(args.entry)
    name = f"executorch-{importlib.metadata.version('executorch')}.pte"
    path = cached_build(args.entry, name, LOWERING_LIMIT_S, lower, args.entry / "program.pt2")
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.extension.training import (
        _load_for_executorch_for_training,
        get_sgd_optimizer,
    )

    if args.threads:
        portable_lib._unsafe_reset_threadpool(args.threads)
    module = _load_for_executorch_for_training(str(path))
    optimizers = []

    def step(x, y):
        loss = module.forward_backward("forward", (torch.from_numpy(x), torch.from_numpy(y)))[0]
        if not optimizers:  # the parameters are known after the first step
            optimizers.append(
                get_sgd_optimizer(module.named_parameters(), meta["lr"], meta["momentum"])
            )
        optimizers[0].step(module.named_gradients())
        return float(loss)

    setup = time.perf_counter() - start
    times, losses = timed_loop(step, data, args)
    report(
        "executorch",
        meta,
        times,
        losses,
        setup,
        optimizer="sgd" if meta["optimizer"] == "sgd" else "sgd momentum 0.9 (not AdamW)",
        optimizer_differs=meta["optimizer"] != "sgd",
        threads=portable_lib._threadpool_get_thread_count(),
    )


if __name__ == "__main__":
    main()
