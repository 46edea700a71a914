"""The fit loop: batches from numpy, dicts and a PyTorch DataLoader; callbacks; interrupt and
resume."""

from __future__ import annotations

import io
import json
import os
import signal

import numpy as np
import pytest
import torch
from rich.console import Console

from torch_models import MLP, classification_data, export, seeded
from traingraph import artifacts, optim
from traingraph.data import Batches
from traingraph.errors import ModelError
from traingraph.fit import (
    Callback,
    EarlyStopping,
    MetricsWriter,
    ModelCheckpoint,
    ProgressBar,
    Trainer,
    accuracy,
    evaluate,
    fit,
)
from traingraph.optim import CosineLRScheduler


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("artifacts")
    artifacts.generate_artifacts(
        export(seeded(MLP), torch.zeros(2, 20)),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optim.AdamW(lr=1e-2),
        artifact_directory=directory,
        additional_output_names=["logits"],
    )
    return directory


@pytest.fixture(scope="module")
def data():
    x, y = classification_data(160, 20, 5)
    y = (np.argmax(x[:, :5], axis=1)).astype(np.int64)  # a learnable rule
    return x, y


def test_fit_learns_and_writes_metrics(artifact_dir, data, tmp_path):
    trainer = Trainer.from_artifacts(artifact_dir)
    assert trainer.input_names == ["x", "labels"]
    x, y = data
    writer = MetricsWriter(tmp_path)
    state = fit(
        trainer,
        Batches((x[:128], y[:128]), 16),
        epochs=5,
        val_data=Batches((x[128:], y[128:]), 64, shuffle=False),
        metrics={"accuracy": accuracy},
        callbacks=[writer, ModelCheckpoint(tmp_path / "ckpt")],
        progress=False,
    )
    history = state.history
    assert [row["epoch"] for row in history] == [1, 2, 3, 4, 5]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["accuracy"] > history[0]["accuracy"]
    assert {"val_loss", "val_accuracy", "lr", "seconds"} <= set(history[-1])
    assert state.global_step == 5 * 8 and not state.interrupted
    assert json.loads((tmp_path / "metrics.json").read_text()) == history
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header.split(",")[:3] == ["epoch", "loss", "accuracy"]
    assert writer.plot_path == tmp_path / "metrics.png"
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    again = Trainer.from_artifacts(artifact_dir, checkpoint=tmp_path / "ckpt")
    result = evaluate(again, [(x[128:], y[128:])], {"accuracy": accuracy})
    assert result["loss"] == pytest.approx(history[-1]["val_loss"], rel=1e-5)


def test_dict_batches_and_a_pytorch_dataloader_train_the_same(artifact_dir, data):
    x, y = data
    dataset = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=False)
    dicts = [{"x": x[i : i + 32], "labels": y[i : i + 32]} for i in range(0, len(x), 32)]
    results = []
    for source in (loader, dicts):
        trainer = Trainer.from_artifacts(artifact_dir)
        fit(trainer, source, epochs=2, progress=False)
        results.append(trainer.state.parameters["fc1.weight"].data)
    np.testing.assert_array_equal(results[0], results[1])


class _InterruptAt(Callback):
    """Sends this process a SIGINT (as Ctrl-C would) after ``step`` steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, state, logs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def _run(artifact_dir, data, checkpoint, *, resume=False, interrupt_at=None):
    x, y = data
    trainer = Trainer.from_artifacts(artifact_dir, checkpoint=checkpoint if resume else None)
    scheduler = CosineLRScheduler(trainer.optimizer, 5, 30, 1e-2)
    callbacks = [ModelCheckpoint(checkpoint)]
    if interrupt_at is not None:
        callbacks.append(_InterruptAt(interrupt_at))
    state = fit(
        trainer,
        Batches((x, y), 16, seed=3),
        epochs=3,
        metrics={"accuracy": accuracy},
        callbacks=callbacks,
        scheduler=scheduler,
        resume=resume,
        progress=False,
    )
    return trainer, state


def test_interrupt_then_resume_matches_an_uninterrupted_run(artifact_dir, data, tmp_path):
    reference, expected = _run(artifact_dir, data, tmp_path / "reference")
    _, stopped = _run(artifact_dir, data, tmp_path / "ckpt", interrupt_at=13)
    assert stopped.interrupted and (stopped.epoch, stopped.batch, stopped.global_step) == (1, 3, 13)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed, state = _run(artifact_dir, data, tmp_path / "ckpt", resume=True)
    assert state.global_step == 30 and not state.interrupted
    for name, _ in reference.state.parameters:
        np.testing.assert_array_equal(
            resumed.state.parameters[name].data, reference.state.parameters[name].data
        )
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in expected.history]
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in state.history] == strip


def test_early_stopping_stops_when_the_metric_stops_improving(artifact_dir, data):
    x, y = data
    trainer = Trainer.from_artifacts(artifact_dir)
    # The training loss falls every epoch, so "max" mode never sees an improvement.
    state = fit(
        trainer,
        Batches((x, y), 16),
        epochs=10,
        callbacks=[EarlyStopping("loss", mode="max", patience=2)],
        progress=False,
    )
    assert len(state.history) == 3 and state.stop


def test_progress_prints_one_line_per_epoch_without_a_terminal(artifact_dir, data):
    x, y = data
    out = io.StringIO()
    bar = ProgressBar(console=Console(file=out, force_terminal=False))
    assert not bar.show_bar
    fit(Trainer.from_artifacts(artifact_dir), [(x, y)], epochs=2, progress=False, callbacks=[bar])
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("epoch 2/2  loss ")
    assert "\x1b[" not in out.getvalue()


def test_errors_name_what_was_expected(artifact_dir, data):
    x, y = data
    trainer = Trainer.from_artifacts(artifact_dir)
    with pytest.raises(ModelError, match=r"holds 1 arrays, but the model takes 2: \['x', 'lab"):
        fit(trainer, [(x,)], progress=False)
    with pytest.raises(ModelError, match=r"no \['labels'\]"):
        fit(trainer, [{"x": x}], progress=False)
    with pytest.raises(ModelError, match="epochs must be a positive int"):
        fit(trainer, [(x, y)], epochs=0, progress=False)
    with pytest.raises(ModelError, match="yielded no batches"):
        fit(trainer, iter([(x, y)]), epochs=2, progress=False)
    with pytest.raises(ModelError, match="monitors 'val_loss'"):
        fit(trainer, [(x, y)], callbacks=[EarlyStopping()], progress=False)
    with pytest.raises(ModelError, match="not a complete artifacts directory"):
        Trainer.from_artifacts(artifact_dir / "..")
