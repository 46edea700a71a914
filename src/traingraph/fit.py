"""The fit loop: train from any iterable of numpy batches, with callbacks and a progress bar.

A batch is a tuple (or list) of arrays in the order of the training model's inputs (data
inputs, then labels), or a dict keyed by those input names. Arrays may be numpy arrays or any
objects with a ``.numpy()`` method, so a PyTorch ``DataLoader`` or a Hugging Face dataset
(``dataset.with_format("numpy").iter(batch_size)``) feeds the loop directly.

Example:
    >>> from traingraph.data import Batches
    >>> from traingraph.fit import EarlyStopping, ModelCheckpoint, Trainer, accuracy, fit
    >>> trainer = Trainer.from_artifacts("artifacts")
    >>> state = fit(
    ...     trainer,
    ...     Batches((x_train, y_train), batch_size=32),
    ...     epochs=10,
    ...     val_data=Batches((x_val, y_val), batch_size=256, shuffle=False),
    ...     metrics={"accuracy": accuracy},
    ...     callbacks=[ModelCheckpoint("run/checkpoint"), EarlyStopping(patience=3)],
    ... )
    >>> state.history[-1]["val_accuracy"]
    0.97

An interrupted run (Ctrl-C) stops after the step in progress, and its checkpoint records where
it stopped; ``fit(..., resume=True)`` on a trainer opened from that checkpoint continues there.
With :class:`~traingraph.data.Batches` the continued run takes exactly the same steps as an
uninterrupted one.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.data import Batches
from traingraph.errors import ModelError, NonFiniteLossError
from traingraph.losses import ClassLabels, class_labels
from traingraph.optim.schedulers import LRScheduler
from traingraph.runtime.device import Device
from traingraph.runtime.session import SessionConfig

if TYPE_CHECKING:
    from traingraph.distributed import DataParallel

__all__ = [
    "Callback",
    "EarlyStopping",
    "FitState",
    "MetricsWriter",
    "ModelCheckpoint",
    "ProgressBar",
    "Trainer",
    "accuracy",
    "evaluate",
    "fit",
    "plot_metrics",
]

Metric = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], float]
"""``metric(outputs, batch) -> value``: ``outputs`` are the model outputs (the loss first), and
``batch`` the input arrays (labels last). The epoch value is the batch-size-weighted mean."""

# Checkpoint properties that record the position of a run.
EPOCH, BATCH, STEP, HISTORY, TRAIN_SUMS = "epoch", "batch", "global_step", "history", "train_sums"


class Trainer:
    """A training :class:`~traingraph.api.Module`, its :class:`~traingraph.api.Optimizer` and
    their :class:`~traingraph.api.CheckpointState`.

    Args:
        state: The checkpoint state.
        module: The module running the training (and eval) graphs.
        optimizer: The optimizer updating the module's parameters.
        class_labels: The class-index label inputs and the values each may hold
            (:func:`traingraph.losses.class_labels` of the training model; ``from_artifacts``
            reads them): every batch's labels are checked before the step runs.
    """

    def __init__(
        self,
        state: CheckpointState,
        module: Module,
        optimizer: Optimizer,
        class_labels: Mapping[str, ClassLabels] | None = None,
    ) -> None:
        self.state = state
        self.module = module
        self.optimizer = optimizer
        self.class_labels = dict(class_labels or {})

    @classmethod
    def from_artifacts(
        cls,
        directory: str | os.PathLike,
        *,
        checkpoint: str | os.PathLike | None = None,
        device: str | Device = "cpu",
        prefix: str = "",
        session_config: SessionConfig | None = None,
    ) -> Trainer:
        """Open the artifacts that ``generate_artifacts`` (or ``traingraph artifacts``) wrote.

        Args:
            directory: The artifacts directory.
            checkpoint: A checkpoint to start from instead of ``directory/checkpoint``.
            device: "cpu", "cuda" or "cuda:N".
            prefix: The prefix of the artifact file names.
            session_config: onnxruntime session settings.
        """
        root = Path(directory)
        if not root.is_dir():
            raise ModelError(
                f"artifacts directory {str(root)!r} does not exist; create it with"
                " `traingraph artifacts MODEL.onnx --out DIR` or generate_artifacts(...)"
            )
        files = {
            kind: root / f"{prefix}{kind}"
            for kind in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")
        }
        missing = [str(p) for k, p in files.items() if k != "eval_model.onnx" and not p.is_file()]
        if missing:
            raise ModelError(
                f"{str(root)!r} is not a complete artifacts directory: {missing} missing;"
                " generate the artifacts with an optimizer"
            )
        ckpt = Path(checkpoint) if checkpoint is not None else root / f"{prefix}checkpoint"
        state = CheckpointState.load_checkpoint(ckpt)
        eval_model = files["eval_model.onnx"]
        module = Module(
            files["training_model.onnx"],
            state,
            eval_model if eval_model.is_file() else None,
            device=device,
            session_config=session_config,
        )
        labels = class_labels(
            onnx.load(files["training_model.onnx"], load_external_data=False)
        )
        return cls(state, module, Optimizer(files["optimizer_model.onnx"], module), labels)

    @property
    def input_names(self) -> list[str]:
        """The inputs of a training batch, in order: the data inputs, then the labels."""
        return self.module.train().input_names()

    def train_step(self, batch: Any) -> list[np.ndarray]:
        """One step: forward, gradients and an optimizer update. Returns the train outputs."""
        outputs = self.module.train()(*self._arrays(batch))
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return _as_list(outputs)

    def eval_step(self, batch: Any) -> list[np.ndarray]:
        """A forward pass of the eval graph. Returns the eval outputs (the loss first)."""
        return _as_list(self.module.eval()(*self._arrays(batch)))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save the parameters, optimizer state and properties (atomically) to ``path``."""
        CheckpointState.save_checkpoint(self.state, path, include_optimizer_state=True)

    def export(self, path: str | os.PathLike, output_names: Sequence[str]) -> None:
        """Write the inference model with the current weights and the given outputs."""
        self.module.export_model_for_inferencing(path, list(output_names))

    def _arrays(self, batch: Any) -> list[np.ndarray]:
        names = self.module.input_names()
        if isinstance(batch, Mapping):
            missing = [n for n in names if n not in batch]
            if missing:
                raise ModelError(
                    f"the batch has no {missing}; a dict batch needs the keys {names}, got"
                    f" {list(batch)}"
                )
            values = [batch[n] for n in names]
        elif isinstance(batch, (tuple, list)):
            if len(batch) != len(names):
                raise ModelError(
                    f"a batch holds {len(batch)} arrays, but the model takes {len(names)}:"
                    f" {names} (data inputs, then labels)"
                )
            values = list(batch)
        else:
            raise ModelError(
                f"a batch must be a tuple, list or dict of arrays ({names}), got"
                f" {type(batch).__name__}"
            )
        arrays = [_to_numpy(v) for v in values]
        for name, array in zip(names, arrays, strict=True):
            if name in self.class_labels:
                self.class_labels[name].check(name, array)
        return arrays


def _to_numpy(value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) and callable(getattr(value, "numpy", None)):
        value = value.numpy()
    return np.ascontiguousarray(value)


def _as_list(outputs: Any) -> list[np.ndarray]:
    return list(outputs) if isinstance(outputs, list) else [outputs]


def _batch_size(arrays: Sequence[np.ndarray]) -> int:
    first = arrays[0]
    return int(first.shape[0]) if first.ndim else 1


def accuracy(outputs: Sequence[np.ndarray], batch: Sequence[np.ndarray]) -> float:
    """Classification accuracy: argmax over axis 1 of the first extra output vs the labels.

    It needs the model's logits as an additional output of the train and eval graphs
    (``additional_output_names=["logits"]``; ``traingraph artifacts`` adds them).
    """
    if len(outputs) < 2:
        raise ModelError(
            "accuracy needs the logits as an additional output of the training graphs; generate"
            " the artifacts with additional_output_names=[<logits output name>]"
        )
    predicted = np.argmax(outputs[1], axis=1)
    return float(np.mean(predicted == batch[-1]))


@dataclass
class FitState:
    """Where a :func:`fit` run stands; callbacks read it and may set :attr:`stop`.

    Attributes:
        trainer: The trainer being fitted.
        epochs: Number of epochs of the whole run.
        steps_per_epoch: Batches per epoch, or None when the data has no length.
        epoch: The current epoch (0-based).
        batch: Batches done in the current epoch.
        global_step: Optimizer steps done in the whole run.
        history: One dict of metrics per finished epoch (``epoch`` is 1-based there).
        stop: Set to True to stop after the current epoch.
        interrupted: True when Ctrl-C stopped the run.
        rank: This process's rank in data-parallel training (0 otherwise): only rank 0
            writes checkpoints and metrics files.
        world_size: The number of data-parallel processes (1 otherwise).
    """

    trainer: Trainer
    epochs: int
    steps_per_epoch: int | None
    epoch: int = 0
    batch: int = 0
    global_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    stop: bool = False
    interrupted: bool = False
    rank: int = 0
    world_size: int = 1


class Callback:
    """Base class of fit callbacks: override the hooks you need."""

    def on_fit_begin(self, state: FitState) -> None:
        """Called once, before the first step (after a resumed run's position is restored)."""

    def on_epoch_begin(self, state: FitState) -> None:
        """Called at the start of each epoch (also a resumed partial epoch)."""

    def on_step_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        """Called after each step with ``loss``, ``samples`` and ``samples_per_second``."""

    def on_epoch_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        """Called after each epoch (after validation) with the epoch's metrics."""

    def on_fit_end(self, state: FitState) -> None:
        """Called once at the end, also after an interruption or early stop."""


class ModelCheckpoint(Callback):
    """Save a checkpoint (with optimizer state and the run's position) during training.

    It saves after every epoch, every ``every_n_steps`` steps if given, and at the end of the
    run, including a run stopped by Ctrl-C; in data-parallel training, rank 0 saves.

    Args:
        path: The checkpoint file; each save replaces it atomically.
        every_n_steps: Also save every this many optimizer steps.
    """

    def __init__(self, path: str | os.PathLike, every_n_steps: int | None = None) -> None:
        self.path = Path(path)
        self.every_n_steps = every_n_steps

    def on_step_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._save(state)

    def on_epoch_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        self._save(state)

    def on_fit_end(self, state: FitState) -> None:
        self._save(state)

    def _save(self, state: FitState) -> None:
        if state.rank == 0:
            state.trainer.save_checkpoint(self.path)


class EarlyStopping(Callback):
    """Stop when a monitored metric has not improved for ``patience`` epochs.

    Args:
        monitor: The metric, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: Epochs without improvement before stopping.
        min_delta: The smallest change that counts as an improvement.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
    ) -> None:
        if mode not in ("min", "max"):
            raise ModelError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.sign = 1.0 if mode == "min" else -1.0
        self.patience = patience
        self.min_delta = min_delta
        self.best = math.inf
        self.waited = 0

    def on_fit_begin(self, state: FitState) -> None:
        self.best, self.waited = math.inf, 0
        for row in state.history:
            self._update(row)

    def on_epoch_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        if self._update(logs) >= self.patience:
            state.stop = True

    def _update(self, logs: Mapping[str, float]) -> int:
        if self.monitor not in logs:
            raise ModelError(
                f"EarlyStopping monitors {self.monitor!r}, but the epoch metrics are"
                f" {sorted(logs)}; pass val_data to fit for val_* metrics"
            )
        value = self.sign * float(logs[self.monitor])
        if value < self.best - self.min_delta:
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        return self.waited


class MetricsWriter(Callback):
    """Write the epoch metrics to ``metrics.json`` and ``metrics.csv`` after every epoch, and
    a plot of them to ``metrics.png`` at the end (when matplotlib is installed); in
    data-parallel training, rank 0 writes.

    Args:
        directory: The folder that receives the files.
        plot: Draw ``metrics.png`` at the end of the run.
    """

    def __init__(self, directory: str | os.PathLike, plot: bool = True) -> None:
        self.directory = Path(directory)
        self.plot = plot
        self.plot_path: Path | None = None

    def on_epoch_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        if state.rank == 0:
            self._write(state.history)

    def on_fit_end(self, state: FitState) -> None:
        if state.rank != 0:
            return
        self._write(state.history)
        if self.plot and state.history:
            path = self.directory / "metrics.png"
            self.plot_path = path if plot_metrics(state.history, path) else None

    def _write(self, history: list[dict[str, float]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "metrics.json").write_text(json.dumps(history, indent=2) + "\n")
        columns = list(dict.fromkeys(k for row in history for k in row))
        with (self.directory / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(history)


def plot_metrics(history: Sequence[Mapping[str, float]], path: str | os.PathLike) -> bool:
    """Plot loss and accuracy (train and validation) per epoch to a PNG file.

    Returns:
        False, writing nothing, when matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    panels = [k for k in ("loss", "accuracy") if any(k in row for row in history)]
    figure = Figure(figsize=(5 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    epochs = [row["epoch"] for row in history]
    for i, name in enumerate(panels, start=1):
        axes = figure.add_subplot(1, len(panels), i)
        for key, label in ((name, "train"), (f"val_{name}", "validation")):
            if all(key in row for row in history):
                axes.plot(epochs, [row[key] for row in history], marker="o", label=label)
        axes.set_xlabel("epoch")
        axes.set_title(name)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.savefig(os.fspath(path), dpi=100)
    return True


class ProgressBar(Callback):
    """A rich progress bar (loss, throughput and ETA per step) and a metrics line per epoch.

    The bar shows only when the console is a terminal; the epoch lines always print.

    Args:
        console: A ``rich.console.Console`` (default: one on stdout).
        show_bar: Force the bar on or off (default: on when the console is a terminal).
    """

    def __init__(self, console: Any = None, show_bar: bool | None = None) -> None:
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.show_bar = self.console.is_terminal if show_bar is None else show_bar
        self._progress: Any = None
        self._task: Any = None

    def on_fit_begin(self, state: FitState) -> None:
        if not self.show_bar:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()

    def on_epoch_begin(self, state: FitState) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(
            "train",
            total=state.steps_per_epoch,
            completed=state.batch,
            epoch=f"{state.epoch + 1}/{state.epochs}",
            loss="-",
            rate="-",
        )

    def on_step_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=state.batch,
                loss=f"{logs['loss']:.4f}",
                rate=f"{logs['samples_per_second']:,.0f}",
            )

    def on_epoch_end(self, state: FitState, logs: Mapping[str, float]) -> None:
        parts = [f"epoch {int(logs['epoch'])}/{state.epochs}"]
        parts += [f"{k} {_format(v)}" for k, v in logs.items() if k not in ("epoch", "seconds")]
        parts.append(f"({logs['seconds']:.1f} s)")
        self.console.print("  ".join(parts), markup=False, highlight=False, soft_wrap=True)

    def on_fit_end(self, state: FitState) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _format(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1e-3 and value != 0 else f"{value:.4f}"


def evaluate(
    trainer: Trainer,
    data: Iterable[Any],
    metrics: Mapping[str, Metric] | None = None,
    replica: DataParallel | None = None,
) -> dict[str, float]:
    """Mean loss and metrics of the eval graph over ``data`` (weighted by batch size); with a
    :class:`~traingraph.distributed.DataParallel` ``replica``, each process evaluates its
    shard of every batch and the means are over all of them."""
    sums = _Sums(("loss", *(metrics or {})))
    for batch in data:
        arrays = trainer._arrays(batch)
        if replica is not None:
            arrays = replica.shard(arrays, train=False)
            if _batch_size(arrays) == 0:
                continue
        outputs = trainer.eval_step(arrays)
        sums.add(_batch_values(outputs, arrays, metrics), _batch_size(arrays))
    if replica is not None:
        sums.add_across(replica)
    if sums.count == 0:
        raise ModelError("the evaluation data yielded no batches; pass at least one batch")
    return sums.means()


class _Sums:
    """Batch-size-weighted sums of named values."""

    def __init__(self, names: Iterable[str], sums: Mapping[str, float] | None = None) -> None:
        stored = dict(sums or {})
        self.count = int(stored.pop("count", 0))
        self.sums = {n: float(stored.get(n, 0.0)) for n in names}

    def add(self, values: Mapping[str, float], weight: int) -> None:
        for name, value in values.items():
            self.sums[name] += value * weight
        self.count += weight

    def means(self) -> dict[str, float]:
        return {n: s / self.count for n, s in self.sums.items()}

    def add_across(self, replica: DataParallel) -> None:
        """Replace the sums and count with their totals over the data-parallel processes."""
        total = replica.sum(np.array([*self.sums.values(), self.count], np.float64))
        self.sums = {n: float(v) for n, v in zip(self.sums, total[:-1])}
        self.count = round(float(total[-1]))

    def to_json(self) -> str:
        return json.dumps({**self.sums, "count": self.count})


def _batch_values(
    outputs: Sequence[np.ndarray],
    arrays: Sequence[np.ndarray],
    metrics: Mapping[str, Metric] | None,
) -> dict[str, float]:
    values = {"loss": float(np.mean(outputs[0]))}
    for name, metric in (metrics or {}).items():
        values[name] = float(metric(outputs, arrays))
    return values


class _Interrupt:
    """Turns the first Ctrl-C (SIGINT) into a flag checked between steps; a second one
    interrupts at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.hit = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupt:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, self._previous)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)


def _epoch_batches(data: Iterable[Any], epoch: int, start: int) -> Iterator[Any]:
    if isinstance(data, Batches):
        return data.epoch(epoch, start)
    return itertools.islice(iter(data), start, None)


def fit(
    trainer: Trainer,
    train_data: Iterable[Any],
    *,
    epochs: int = 1,
    val_data: Iterable[Any] | None = None,
    metrics: Mapping[str, Metric] | None = None,
    callbacks: Sequence[Callback] = (),
    scheduler: LRScheduler | None = None,
    resume: bool = False,
    progress: bool = True,
    catch_interrupt: bool = True,
    distributed: bool | None = None,
) -> FitState:
    """Train ``trainer`` for ``epochs`` epochs over ``train_data``.

    Args:
        trainer: The :class:`Trainer` to train.
        train_data: An iterable of batches (tuples or dicts of arrays), iterated once per
            epoch: a :class:`~traingraph.data.Batches`, a PyTorch ``DataLoader``, a list, ...
        epochs: Total epochs of the run (a resumed run counts the epochs already done).
        val_data: Batches evaluated with the eval graph after each epoch (``val_*`` metrics).
        metrics: Extra metrics by name, e.g. ``{"accuracy": accuracy}``.
        callbacks: :class:`Callback` objects, called in order.
        scheduler: A learning-rate scheduler on ``trainer.optimizer``, stepped after each step.
        resume: Continue from the position recorded in the trainer's checkpoint (the epoch and
            batch where the run that saved it stopped). Exact with
            :class:`~traingraph.data.Batches`; other iterables are replayed from their start of
            the epoch and the batches already done are skipped.
        progress: Show a :class:`ProgressBar` (the bar only on a terminal) and epoch lines.
        catch_interrupt: Let Ctrl-C stop the run cleanly after the step in progress.
        distributed: Train data-parallel over the processes of a ``torch.distributed`` group
            (:class:`~traingraph.distributed.DataParallel`): every process iterates the same
            global batches and trains on its shard of each (a batch with fewer samples than
            processes is skipped, with a warning), the gradients are averaged before each
            update, the metrics are over all shards, and rank 0 alone shows progress and
            writes checkpoints and metrics files. None (the default) trains data-parallel when
            torchrun started several processes or a process group exists.

    Returns:
        The final :class:`FitState`, with the per-epoch metrics in ``history``.

    Raises:
        NonFiniteLossError: A batch's loss was NaN or infinite (with the trainer's optimizer
            on its default ``nonfinite="raise"``): the run stops before updating, so the
            parameters and the checkpoints saved so far hold the last finite state.
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ModelError(f"epochs must be a positive int, got {epochs!r}")
    names = ("loss", *(metrics or {}))
    props = trainer.state.properties
    steps = len(train_data) if hasattr(train_data, "__len__") else None  # type: ignore[arg-type]
    replica = _data_parallel(trainer, distributed)
    state = FitState(trainer, epochs, steps)
    if replica is not None:
        state.rank, state.world_size = replica.rank, replica.world_size
    sums = _Sums(names)
    if resume:
        state.epoch, state.batch = int(props.get(EPOCH, 0)), int(props.get(BATCH, 0))
        state.global_step = int(props.get(STEP, 0))
        state.history = json.loads(str(props.get(HISTORY, "[]")))
        if state.rank == 0:  # the checkpoint holds rank 0's sums of the epoch so far
            sums = _Sums(names, json.loads(str(props.get(TRAIN_SUMS, "{}"))))
    if scheduler is not None:
        while scheduler.step_count < state.global_step:
            scheduler.step()
    every = ([ProgressBar()] if progress and state.rank == 0 else []) + list(callbacks)

    def record() -> None:
        props[EPOCH], props[BATCH], props[STEP] = state.epoch, state.batch, state.global_step
        props[TRAIN_SUMS] = sums.to_json()

    for cb in every:
        cb.on_fit_begin(state)
    with _Interrupt(catch_interrupt) as interrupt:

        def stopping() -> bool:  # data-parallel processes stop at the step they agree on
            return interrupt.hit if replica is None else replica.stop_agreed

        while state.epoch < epochs and not (state.stop or stopping()):
            for cb in every:
                cb.on_epoch_begin(state)
            started, samples = time.perf_counter(), 0
            for batch in _epoch_batches(train_data, state.epoch, state.batch):
                arrays = trainer._arrays(batch)
                if replica is not None:
                    if _batch_size(arrays) < replica.world_size:
                        _warn_small_batch(_batch_size(arrays), replica.world_size)
                        state.batch += 1
                        continue
                    arrays = replica.shard(arrays)
                    replica.stop_requested = interrupt.hit
                try:
                    outputs = trainer.train_step(arrays)
                except NonFiniteLossError as exc:
                    raise NonFiniteLossError(
                        f"training stopped at epoch {state.epoch + 1}, batch {state.batch + 1}:"
                        f" {exc}. The parameters and the last checkpoint saved are those before"
                        " this batch; fix the data or the learning rate, then resume"
                    ) from None
                if scheduler is not None:
                    scheduler.step()
                size = _batch_size(arrays)
                values = _batch_values(outputs, arrays, metrics)
                sums.add(values, size)
                if replica is not None:  # the throughput of all processes
                    size = replica.global_batch or size
                samples += size
                state.batch += 1
                state.global_step += 1
                record()
                logs = {
                    "loss": values["loss"],
                    "samples": size,
                    "samples_per_second": samples / max(time.perf_counter() - started, 1e-9),
                }
                for cb in every:
                    cb.on_step_end(state, logs)
                if stopping():
                    break
            if stopping():
                state.interrupted = True
                break
            if sums.count == 0:
                raise ModelError(
                    f"the training data yielded no batches in epoch {state.epoch + 1}; pass an"
                    " iterable that yields batches on every iteration (not a one-shot iterator)"
                )
            if replica is not None:
                sums.add_across(replica)
            row: dict[str, float] = {"epoch": state.epoch + 1, **sums.means()}
            if val_data is not None:
                values = evaluate(trainer, val_data, metrics, replica)
                row.update({f"val_{k}": v for k, v in values.items()})
            row["lr"] = trainer.optimizer.get_learning_rate()
            row["seconds"] = time.perf_counter() - started
            state.history.append(row)
            state.epoch, state.batch, sums = state.epoch + 1, 0, _Sums(names)
            props[HISTORY] = json.dumps(state.history)
            record()
            for cb in every:
                cb.on_epoch_end(state, row)
        state.interrupted = state.interrupted or stopping()
    for cb in every:
        cb.on_fit_end(state)
    if replica is not None:
        replica.barrier()  # rank 0's checkpoint is written when fit returns on any rank
    return state


def _warn_small_batch(size: int, processes: int) -> None:
    warnings.warn(
        f"a batch of {size} samples was skipped: it cannot give each of the {processes}"
        " data-parallel processes a sample; pass Batches(..., drop_last=True) or a batch size"
        " that leaves a last batch of at least one sample per process",
        stacklevel=3,
    )


def _data_parallel(trainer: Trainer, distributed: bool | None) -> DataParallel | None:
    """The trainer's :class:`~traingraph.distributed.DataParallel`, where training is
    data-parallel (``distributed``, or by default where torchrun started the process)."""
    from traingraph import distributed as parallel

    if distributed is None:
        distributed = parallel.active()
    if not distributed:
        return None
    replica = parallel.DataParallel.of(trainer)
    replica.stop_requested = replica.stop_agreed = False
    return replica
