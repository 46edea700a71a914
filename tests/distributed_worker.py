"""One process of the data-parallel tests: ``python distributed_worker.py SCENARIO FOLDER``
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); test_distributed.py
starts two. The models, data and training loops are defined here once, for the worker and for
the single-process reference the tests compare with.

The worker trains the demo CNN through fit (api.Module / Optimizer, checkpoint, resume), an
MLP through the graph API (its gradients in several buckets), the demo again with gradient
accumulation over uneven micro-batches, and a BatchNorm model whose running statistics are
averaged (on a GPU also the CUDA-graph step, in float32 and in fp16 with a loss scaler), and
writes ``rank{R}.npz`` with the parameters after every step; ``agreed{R}.txt`` with the errors of
:func:`agreements`; then rank 1 exits during a further run of the demo, and rank 0 writes the
error it got to ``error.txt``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from traingraph import artifacts, demo, distributed, optim
from traingraph.data import Batches
from traingraph.errors import NonFiniteLossError
from traingraph.fit import Callback, FitState, ModelCheckpoint, Trainer, fit
from traingraph.runtime.session import SessionConfig

DEVICE = os.environ.get("TRAINGRAPH_TEST_DEVICE", "cpu")
"""The device of the models: under torchrun, "cuda" is each process's LOCAL_RANK GPU."""
BACKEND = os.environ.get("TRAINGRAPH_TEST_BACKEND") or None
TIMEOUT = datetime.timedelta(seconds=30)
MLP_STEPS = 6


def make_demo_artifacts(
    folder: Path, optimizer: Any = None, mixed_precision: str | None = None
) -> None:
    """The demo CNN's artifacts (AdamW unless ``optimizer`` is given) in ``folder``."""
    artifacts.generate_artifacts(
        demo.digits_cnn(seed=0),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2) if optimizer is None else optimizer,
        artifact_directory=folder,
        additional_output_names=[demo.OUTPUT_NAME],
        mixed_precision=mixed_precision,
    )


def demo_data() -> tuple[Batches, Batches]:
    """Global batches of 25 (each split 12 / 13 over two processes) and validation batches of
    5, 5 and 1 samples (the last leaves one process without a sample)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((111, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, demo.CLASSES, 111).astype(np.int64)
    return Batches((x[:100], y[:100]), 25, seed=3), Batches((x[100:], y[100:]), 5, shuffle=False)


class Record(Callback):
    """The trainable parameters (one flat vector) after every step."""

    def __init__(self) -> None:
        self.steps: list[np.ndarray] = []

    def on_step_end(self, state: FitState, logs: Any) -> None:
        module = state.trainer.module
        self.steps.append(module.get_contiguous_parameters(trainable_only=True).numpy().copy())


def demo_trainer(folder: Path, checkpoint: Path | None = None) -> Trainer:
    return Trainer.from_artifacts(
        folder,
        checkpoint=checkpoint,
        device=distributed.local_device(DEVICE),
        session_config=SessionConfig(intra_op_threads=1, tf32=False),
    )


def train_demo(
    folder: Path, epochs: int, checkpoint: Path | None = None, save: Path | None = None
) -> tuple[np.ndarray, list[dict[str, float]]]:
    """Fit the demo (from ``checkpoint``, resuming, when given); returns the parameters after
    each step and the history."""
    trainer = demo_trainer(folder, checkpoint)
    train, val = demo_data()
    record = Record()
    callbacks: list[Callback] = [record] + ([ModelCheckpoint(save)] if save else [])
    state = fit(
        trainer,
        train,
        epochs=epochs,
        val_data=val,
        callbacks=callbacks,
        progress=False,
        resume=checkpoint is not None,
    )
    return np.stack(record.steps), state.history


def train_demo_cuda_graph(folder: Path, make: Any = None) -> np.ndarray:
    """One epoch of the demo as CUDA-graph steps (``make(module, optimizer_uri)`` makes the
    data-parallel step in a worker); returns the parameters after each step."""
    from traingraph.runtime.cuda import CudaGraphStep

    module = demo_trainer(folder).module
    uri = folder / "optimizer_model.onnx"
    step = CudaGraphStep(module, uri) if make is None else make(module, uri)
    steps = []
    for batch in demo_data()[0].epoch(0):
        step(*(batch if make is None else step.replica.shard(batch)))
        steps.append(module.get_contiguous_parameters(trainable_only=True).numpy().copy())
    UPDATES["cuda_graph"] = "kernel" if step._kernel else "graph"
    return np.stack(steps)


UPDATES: dict[str, str] = {}
"""How the last CUDA-graph step of each kind updated the state: "kernel" (the optimizer's CUDA
kernel) or "graph"."""


def train_fp16_cuda_graph(folder: Path, make: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """One epoch of the fp16 demo (with a loss scaler) as CUDA-graph steps, the last sample of
    the second batch (rank 1's part) an overflow; returns the parameters and the loss scale
    after each step."""
    from traingraph.runtime.cuda import CudaGraphStep

    module = demo_trainer(folder).module
    uri = folder / "optimizer_model.onnx"
    step = CudaGraphStep(module, uri) if make is None else make(module, uri)
    steps, scales = [], []
    for i, (x, y) in enumerate(demo_data()[0].epoch(0)):
        if i == 1:
            x = np.array(x)
            x[-1] = 1e30  # inf in float16: this step's gradients are not finite
        step(*((x, y) if make is None else step.replica.shard((x, y))))
        steps.append(module.get_contiguous_parameters(trainable_only=True).numpy().copy())
        assert module.loss_scaler is not None
        scales.append(module.loss_scaler.scale)
    return np.stack(steps), np.array(scales)


def mlp_graph() -> Any:
    """A compiled MLP (20 -> 32 -> ReLU -> 5) of the graph API, AdamW."""
    from traingraph import layers as L
    from traingraph import losses
    from traingraph.graph import CompileOptions, Graph, TensorSpec, TrainingGraph

    g = Graph("mlp")
    x = g.input("x", shape=[None, 20])
    g.output("logits", L.Linear(32, 5)(L.ReLU()(L.Linear(20, 32)(x))))
    train = TrainingGraph(
        [g], loss=losses.CrossEntropyLoss(), optimizer=optim.AdamW(lr=1e-2)
    )
    train.add_inputs({"x": x}, loss_labels={"y": TensorSpec([None], "int64")})
    options = CompileOptions(intra_op_threads=1, tf32=False)  # full float32 on CUDA
    return train.compile(distributed.local_device(DEVICE), options)


def mlp_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [
        (
            rng.standard_normal((9, 20)).astype(np.float32),
            rng.integers(0, 5, 9).astype(np.int64),
        )
        for _ in range(MLP_STEPS)
    ]


def train_mlp(initial: dict[str, np.ndarray], replica_of: Any = None) -> np.ndarray:
    """The MLP from ``initial`` over :func:`mlp_batches`; ``replica_of(graph)`` makes the
    DataParallel in a worker. Returns all parameters (in name order) after each step."""
    graph = mlp_graph()
    graph.set_parameters(initial)
    replica = replica_of(graph) if replica_of is not None else None
    steps = []
    for x, y in mlp_batches():
        if replica is None:
            graph.execute({"x": x}, loss_labels={"y": y})
        else:
            replica.execute({"x": x}, loss_labels={"y": y})
        values = graph.get_parameters()
        steps.append(np.concatenate([values[n].reshape(-1) for n in sorted(values)]))
    return np.stack(steps)


ACCUMULATION = ((9, 7, 1), (5, 6), (3,), (2, 1, 4), (1,))
"""Micro-batch sizes of each accumulated step: odd sizes split unevenly over two processes, a
micro-batch of 1 leaves rank 0 without a sample, and the last step gives it none at all."""


def accumulation_batches() -> list[list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(5)
    return [
        [
            (
                rng.standard_normal((n, 1, 8, 8)).astype(np.float32),
                rng.integers(0, demo.CLASSES, n).astype(np.int64),
            )
            for n in sizes
        ]
        for sizes in ACCUMULATION
    ]


def train_accumulated(folder: Path, distributed_run: bool = False) -> np.ndarray:
    """The demo with api.Module / Optimizer, several micro-batches accumulated per update;
    returns the trainable parameters after each update. In a worker, each process trains on
    its parts of the micro-batches, skipping the forward pass of an empty one."""
    trainer = demo_trainer(folder)
    module, optimizer = trainer.module, trainer.optimizer
    replica = distributed.DataParallel(module, optimizer) if distributed_run else None
    steps = []
    for micro_batches in accumulation_batches():
        for batch in micro_batches:
            part = batch if replica is None else replica.shard(batch, allow_empty=True)
            if len(part[0]):
                module(*part)
        optimizer.step()
        module.lazy_reset_grad()
        steps.append(module.get_contiguous_parameters(trainable_only=True).numpy().copy())
    return np.stack(steps)


BN_BATCHES = (9, 9, 7, 9)


def batchnorm_graph() -> Any:
    """A compiled graph-API model whose first layer is a BatchNorm1d (20 -> BatchNorm -> 5),
    SGD; its running statistics are of the raw inputs."""
    from traingraph import layers as L
    from traingraph import losses
    from traingraph.graph import CompileOptions, Graph, TensorSpec, TrainingGraph

    g = Graph("bn")
    x = g.input("x", shape=[None, 20])
    g.output("logits", L.Linear(20, 5)(L.BatchNorm1d(20)(x)))
    train = TrainingGraph([g], loss=losses.CrossEntropyLoss(), optimizer=optim.SGD(lr=0.1))
    train.add_inputs({"x": x}, loss_labels={"y": TensorSpec([None], "int64")})
    # as written: the CPU runtime's segments miss a BatchNorm that reads a data input
    options = CompileOptions(intra_op_threads=1, tf32=False, disable_fusion=True)
    return train.compile(distributed.local_device(DEVICE), options)


def batchnorm_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(13)
    return [
        (
            (rng.standard_normal((n, 20)) * 2 + rng.standard_normal(20)).astype(np.float32),
            rng.integers(0, 5, n).astype(np.int64),
        )
        for n in BN_BATCHES
    ]


def running_statistics(graph: Any) -> dict[str, np.ndarray]:
    return {k: v for k, v in graph.get_parameters().items() if "running" in k}


def train_batchnorm(distributed_run: bool = False) -> dict[str, np.ndarray]:
    """The BatchNorm model over :func:`batchnorm_batches`: its running statistics after each
    step (``after:NAME``) and, in a worker, this process's own before they were averaged
    (``local:NAME``)."""
    graph = batchnorm_graph()
    records: dict[str, list[np.ndarray]] = {}

    def record(prefix: str) -> None:
        for name, value in running_statistics(graph).items():
            records.setdefault(f"{prefix}:{name}", []).append(value)

    if distributed_run:

        class Recording(distributed.DataParallel):
            def average_gradients(self, grads: Any, finite: bool) -> bool:
                record("local")
                return super().average_gradients(grads, finite)

        replica = Recording(graph)
    for x, y in batchnorm_batches():
        if distributed_run:
            replica.execute({"x": x}, loss_labels={"y": y})
        else:
            graph.execute({"x": x}, loss_labels={"y": y})
        record("after")
    return {k: np.stack(v) for k, v in records.items()}


class ExitAt(Callback):
    """Ends rank 1's process (as a crash would) after ``step`` steps."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, state: FitState, logs: Any) -> None:
        if self.rank == 1 and state.global_step == self.step:
            os._exit(17)


def agreements(folder: Path) -> list[str]:
    """What the processes must agree on: the errors of a non-finite loss in rank 1's shard
    only and of a failure on rank 0 of what rank_zero_first runs, and the skipping of a batch
    too small to share."""
    x, y = (np.array(a) for a in next(iter(demo_data()[0])))
    poisoned = x.copy()
    poisoned[-1] = np.nan  # the last sample: rank 1's part
    errors = []
    try:
        fit(demo_trainer(folder / "demo"), [(x, y), (poisoned, y), (x, y)], progress=False)
    except NonFiniteLossError as exc:
        errors.append(f"NonFiniteLossError: {exc}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fit(demo_trainer(folder / "demo"), [(x, y), (x[:1], y[:1])], progress=False)
    skipped = [str(w.message) for w in caught if "was skipped" in str(w.message)]
    errors.append(f"steps {state.global_step}, batches {state.batch}: {' '.join(skipped)}")

    def fail() -> str:
        raise OSError("no space left for the run folder")

    try:
        distributed.rank_zero_first(fail)
    except (OSError, distributed.DistributedError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def main(folder: Path) -> None:
    import torch

    torch.set_num_threads(1)
    distributed.init_process_group(TIMEOUT, BACKEND)
    rank = distributed.rank()
    demo_steps, history = train_demo(folder / "demo", 2, save=folder / "ckpt")
    resumed, _ = train_demo(folder / "demo", 3, checkpoint=folder / "ckpt")
    initial = dict(np.load(folder / "mlp_initial.npz"))
    if rank == 1:  # rank 0's parameters replace these
        initial = {k: v + np.float32(1) for k, v in initial.items()}
    # the MLP's gradients average in 4 buckets, apart from the flags (the demo's: packed)
    distributed.PACKED_BYTES = 0
    mlp_steps = train_mlp(initial, partial(distributed.DataParallel, bucket_bytes=1024))
    distributed.PACKED_BYTES = 1 << 20
    accumulated = train_accumulated(folder / "demo", distributed_run=True)
    batchnorm = train_batchnorm(distributed_run=True)
    graph_steps = fp16_steps = fp16_scales = np.zeros(0)
    if DEVICE.startswith("cuda"):
        graph_steps = train_demo_cuda_graph(folder / "demo", distributed.cuda_graph_step)
        fp16_steps, fp16_scales = train_fp16_cuda_graph(
            folder / "demo16", distributed.cuda_graph_step
        )
    np.savez(
        folder / f"rank{rank}.npz",
        demo=demo_steps,
        resumed=resumed,
        mlp=mlp_steps,
        accumulated=accumulated,
        cuda_graph=graph_steps,
        cuda_graph_update=UPDATES.get("cuda_graph", ""),
        fp16=fp16_steps,
        fp16_scales=fp16_scales,
        history=json.dumps(history),
        **{f"bn.{k}": v for k, v in batchnorm.items()},
    )
    (folder / f"agreed{rank}.txt").write_text("\n".join(agreements(folder)))
    trainer = demo_trainer(folder / "demo")
    started = time.perf_counter()
    try:
        fit(trainer, demo_data()[0], epochs=1, callbacks=[ExitAt(rank, 2)], progress=False)
    except distributed.DistributedError as exc:
        seconds = time.perf_counter() - started
        (folder / "error.txt").write_text(f"{seconds:.1f}\n{exc}")
        return
    raise AssertionError("training went on after rank 1 stopped")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
