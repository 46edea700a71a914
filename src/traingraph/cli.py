"""The ``traingraph`` command line.

``traingraph train`` with no arguments trains the embedded demo (a small CNN on the 8x8 digits);
the other commands generate artifacts, train your own model, evaluate, export and inspect.
Every error prints one line starting with ``error:`` and exits with a non-zero code.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

__all__ = ["cli", "main"]

ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
RUN_SETTINGS = "run.json"
DEMO = "demo"
SCHEDULERS = ("constant", "linear", "cosine")
EXIT_INTERRUPTED = 130
_DIRECTORY = click.Path(exists=True, file_okay=False)
# Options that a resumed run may change; every other setting comes from the run's run.json.
RESUMABLE_OPTIONS = ("epochs", "device")
DEMO_DEFAULTS = {"epochs": 10, "batch_size": 32, "lr": 5e-3, "scheduler": "cosine"}
MODEL_DEFAULTS = {"epochs": 10, "batch_size": 32, "lr": 1e-3, "scheduler": "constant"}


class RunFolder:
    """The files of one training run: its settings, artifacts, checkpoint and results."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.settings_file = root / RUN_SETTINGS
        self.artifacts = root / "artifacts"
        self.checkpoint = root / "checkpoint"
        self.model = root / "model.onnx"

    @classmethod
    def create(cls, out: str | None, name: str) -> RunFolder:
        if out is not None:
            root = Path(out)
            if root.exists() and any(root.iterdir()):
                raise click.UsageError(
                    f"--out {out!r} is not empty; pass a new folder, or continue the run in it"
                    f" with --resume {out}"
                )
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            root = Path("runs") / f"{name}-{stamp}"
            suffix = 1
            while root.exists():
                suffix += 1
                root = Path("runs") / f"{name}-{stamp}-{suffix}"
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.UsageError(
                f"cannot create the run folder {str(root)!r} ({exc.strerror}); pass --out a"
                " folder in a writable place"
            ) from None
        return cls(root)

    @classmethod
    def open(cls, path: str) -> RunFolder:
        run = cls(Path(path))
        if not run.settings_file.is_file():
            raise click.UsageError(
                f"{path!r} is not a run folder (it has no {RUN_SETTINGS}); pass a folder that"
                " `traingraph train` wrote"
            )
        return run

    def settings(self) -> dict[str, Any]:
        return dict(json.loads(self.settings_file.read_text()))

    def save_settings(self, settings: dict[str, Any]) -> None:
        self.settings_file.write_text(json.dumps(settings, indent=2) + "\n")


def _error(message: str) -> click.ClickException:
    return click.ClickException(message)


# ---------------------------------------------------------------------------------------- data
def _load_onnx(path: Path, load_external_data: bool = True) -> Any:
    """The model in ``path``, its declared sizes checked (:mod:`traingraph.limits`)."""
    import onnx

    from traingraph.limits import check_model_proto

    fix = "pass an .onnx file saved by onnx.save or torch.onnx.export"
    if path.is_file() and path.stat().st_size == 0:
        raise _error(f"{str(path)!r} is empty (0 bytes), not an ONNX model; {fix}")
    try:
        model = onnx.load(os.fspath(path), load_external_data=load_external_data)
    except Exception as exc:
        raise _error(
            f"{str(path)!r} is not a readable ONNX model ({type(exc).__name__}); {fix}"
        ) from None
    if not model.graph.node and not model.opset_import:
        raise _error(f"{str(path)!r} holds no ONNX graph (no nodes, no opset); {fix}")
    check_model_proto(model, f"model {str(path)!r}")
    return model


def _model_io(path: Path) -> tuple[dict[str, np.dtype], list[str]]:
    """The graph inputs (name -> numpy dtype) and output names of an ONNX file."""
    import onnx

    model = _load_onnx(path, load_external_data=False)
    try:
        inputs = {
            i.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
            for i in model.graph.input
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise _error(
            f"{str(path)!r} declares an input of an unknown element type ({exc}); generate the"
            " artifacts again with `traingraph artifacts MODEL.onnx`"
        ) from None
    return inputs, [o.name for o in model.graph.output]


def _cast(arrays: Sequence[Any], dtypes: dict[str, np.dtype], source: str) -> list[np.ndarray]:
    """The arrays converted to the model's input dtypes; an error names the one that cannot be."""
    cast = []
    for name, array in zip(dtypes, arrays):
        array = np.asarray(array)
        dtype = dtypes[name]
        if array.dtype.kind not in "biuf":
            raise _error(
                f"{source}: array for input {name!r} has dtype {array.dtype}; the model takes"
                f" {dtype}. Save it as {dtype} (e.g. numpy.savez(..., {name}=a.astype("
                f"numpy.{dtype.name})))"
            )
        cast.append(array.astype(dtype, copy=False))
    return cast


def _pick(arrays: dict[str, np.ndarray], names: Sequence[str], prefix: str) -> list[Any] | None:
    if all(prefix + n in arrays for n in names):
        return [arrays[prefix + n] for n in names]
    if len(names) == 2 and all(prefix + k in arrays for k in "xy"):
        return [arrays[prefix + "x"], arrays[prefix + "y"]]
    return None


def _load_arrays(path: str, names: Sequence[str], prefix: str = "") -> list[Any] | None:
    from traingraph.data import load_npz

    arrays = load_npz(path)
    picked = _pick(arrays, names, prefix)
    if picked is None and not prefix:
        raise _error(
            f"{path!r} holds the arrays {sorted(arrays)}; the model needs {list(names)} (its"
            " inputs, labels last), or 'x' and 'y' for one input and one label. Save them with"
            f" numpy.savez({path!r}, {', '.join(f'{n}=...' for n in names)})"
        )
    return picked


def _datasets(
    settings: dict[str, Any], dtypes: dict[str, np.dtype]
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The training and validation arrays of a run, cast to the model's input dtypes."""
    from traingraph.data import split_arrays

    names = list(dtypes)
    if settings["source"] == DEMO:
        from traingraph.datasets import load_digits

        train: list[Any] = list(load_digits("train"))
        val: list[Any] | None = list(load_digits("test"))
    else:
        train = _load_arrays(settings["data"], names) or []
        val = _load_arrays(settings["data"], names, prefix="val_")
        if settings.get("val_data"):
            val = _load_arrays(settings["val_data"], names)
        if val is None and settings["val_fraction"] > 0:
            split = split_arrays(train, settings["val_fraction"], settings["seed"])
            train, val = list(split[0]), list(split[1])

    source = "the demo data" if settings["source"] == DEMO else repr(settings["data"])
    return _cast(train, dtypes, source), _cast(val, dtypes, source) if val is not None else None


def _metrics(dtypes: dict[str, np.dtype], outputs: Sequence[str]) -> dict[str, Any]:
    """Accuracy when the graphs return the logits and the labels are class indices."""
    from traingraph.fit import accuracy

    label = list(dtypes.values())[-1]
    return {"accuracy": accuracy} if len(outputs) >= 2 and label.kind in "iu" else {}


# ---------------------------------------------------------------------------------- commands
@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="traingraph", message="traingraph %(version)s")
def cli() -> None:
    """traingraph: build, differentiate and run training graphs in standard ONNX.

    Start with `traingraph train`: it trains a small CNN on the embedded 8x8 digits in a few
    seconds and writes a run folder with the artifacts, checkpoint, inference model, metrics
    and a plot.
    """


def _loss_choice() -> click.Choice:
    return click.Choice(
        ["CrossEntropyLoss", "MSELoss", "BCEWithLogitsLoss", "L1Loss", "HuberLoss",
         "SmoothL1Loss", "NLLLoss"],
        case_sensitive=False,
    )  # fmt: skip


def _optimizer_choice() -> click.Choice:
    return click.Choice(["AdamW", "Adam", "SGD", "RMSProp", "Adagrad"], case_sensitive=False)


def _canonical(choice: click.Choice, value: str) -> str:
    return next(c for c in choice.choices if str(c).lower() == value.lower())


def _generate(
    model: Any,
    out: Path,
    loss: str,
    optimizer: str,
    lr: float,
    frozen: Sequence[str] = (),
    requires_grad: Sequence[str] = (),
) -> list[str]:
    """Write the artifacts of ``model`` (a path or a ModelProto) to ``out``.

    The model's outputs are also outputs of the training graphs. Returns their names.
    """
    from traingraph import artifacts, optim

    if isinstance(model, Path):
        outputs = _model_io(model)[1]
    else:
        outputs = [o.name for o in model.graph.output]
    artifacts.generate_artifacts(
        model,
        requires_grad=list(requires_grad) or None,
        frozen_params=list(frozen) or None,
        loss=artifacts.LossType[_canonical(_loss_choice(), loss)],
        optimizer=getattr(optim, _canonical(_optimizer_choice(), optimizer))(lr=lr),
        artifact_directory=out,
        additional_output_names=outputs,
    )
    return outputs


@cli.command("artifacts")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--loss", default="CrossEntropyLoss", show_default=True, type=_loss_choice(),
              help="Loss applied to the model's first output.")
@click.option("--optimizer", default="AdamW", show_default=True, type=_optimizer_choice(),
              help="Optimizer of the optimizer model.")
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(min=0),
              help="Initial learning rate stored in the optimizer model.")
@click.option("--frozen", multiple=True, metavar="NAME",
              help="Initializer kept fixed (repeat for several).")
@click.option("--requires-grad", multiple=True, metavar="NAME",
              help="Train only these initializers (repeat; default: every float initializer).")
@click.option("--out", default="artifacts", show_default=True, type=click.Path(file_okay=False),
              help="Directory that receives the artifacts.")
def artifacts_command(
    model: str,
    loss: str,
    optimizer: str,
    lr: float,
    frozen: tuple[str, ...],
    requires_grad: tuple[str, ...],
    out: str,
) -> None:
    """Generate training artifacts from an inference MODEL (.onnx).

    Writes training_model.onnx, eval_model.onnx, optimizer_model.onnx and checkpoint to --out:
    standard ONNX that stock onnxruntime runs, loadable with traingraph.api (the API of
    onnxruntime.training). The model's outputs are also outputs of the training graphs, so
    `traingraph train` can report accuracy.

    Example: traingraph artifacts mlp.onnx --loss CrossEntropyLoss --optimizer AdamW --out art
    """
    directory = Path(out)
    outputs = _generate(Path(model), directory, loss, optimizer, lr, frozen, requires_grad)
    click.echo(f"Wrote {', '.join(ARTIFACT_FILES)} to {directory}/ (model outputs: {outputs})")


@cli.command("train")
@click.argument("source", required=False, type=click.Path(exists=True))
@click.option("--data", type=click.Path(exists=True, dir_okay=False), metavar="DATA.npz",
              help="Training arrays named after the model inputs (labels last), or x and y;"
                   " optional val_-prefixed arrays for validation.")
@click.option("--val-data", type=click.Path(exists=True, dir_okay=False), metavar="VAL.npz",
              help="Validation arrays, named like the training arrays.")
@click.option("--val-fraction", default=0.1, show_default=True,
              type=click.FloatRange(0, 1, max_open=True),
              help="Fraction of the training data held out for validation when DATA.npz has no"
                   " val_ arrays and no --val-data is given (0: no validation).")
@click.option("--epochs", type=click.IntRange(min=1), help="Epochs  [default: 10]")
@click.option("--batch-size", type=click.IntRange(min=1), help="Batch size  [default: 32]")
@click.option("--lr", type=click.FloatRange(min=0),
              help="Learning rate  [default: 0.005 for the demo, 0.001 for a model; for"
                   " ARTIFACTS_DIR, the one stored in its optimizer model]")
@click.option("--scheduler", type=click.Choice(SCHEDULERS),
              help="Learning-rate schedule  [default: cosine for the demo, else constant]")
@click.option("--warmup", default=0, show_default=True, type=click.IntRange(min=0),
              help="Warmup steps of the linear and cosine schedules (constant has none).")
@click.option("--loss", default="CrossEntropyLoss", show_default=True, type=_loss_choice(),
              help="Loss, when SOURCE is a model.")
@click.option("--optimizer", default="AdamW", show_default=True, type=_optimizer_choice(),
              help="Optimizer, when SOURCE is a model.")
@click.option("--patience", type=click.IntRange(min=1),
              help="Stop early after this many epochs without a better validation loss.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the data shuffling and the validation split.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda or cuda:N (cuda needs onnxruntime-gpu: pip install"
                   " 'traingraph[gpu]').")
@click.option("--resume", type=click.Path(exists=True, file_okay=False), metavar="RUN_DIR",
              help="Continue an interrupted run in its folder, exactly where it stopped.")
@click.option("--out", type=click.Path(file_okay=False), metavar="RUN_DIR",
              help="Run folder to create  [default: runs/<name>-<time>]")
@click.pass_context
def train_command(ctx: click.Context, source: str | None, resume: str | None, out: str | None,
                  **options: Any) -> None:
    """Train a model; with no SOURCE, train the embedded demo.

    SOURCE is an inference model (.onnx; its artifacts are generated with --loss and
    --optimizer) or an artifacts directory (from `traingraph artifacts`). Without SOURCE, a
    small CNN learns the embedded 8x8 handwritten digits (1,797 images) in a few seconds.

    The run folder receives the artifacts, the checkpoint, the inference model (model.onnx),
    metrics.json, metrics.csv and metrics.png. Ctrl-C saves a checkpoint and stops;
    `traingraph train --resume RUN_DIR` continues exactly where the run stopped.

    Started by torchrun, the processes train data-parallel: each takes its share of every
    batch (--batch-size is the global batch), and rank 0 writes the run folder.

    \b
    Examples:
      traingraph train
      traingraph train model.onnx --data train.npz --epochs 5 --lr 1e-3
      traingraph train --resume runs/demo-20250101-120000
      torchrun --nproc-per-node 4 -m traingraph train model.onnx --data train.npz
    """
    from traingraph import distributed

    given = {
        name
        for name in options
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    }
    if resume is not None:
        fixed = sorted(given - set(RESUMABLE_OPTIONS)) + (["SOURCE"] if source else [])
        fixed += ["--out"] if out else []
        if fixed:
            raise click.UsageError(
                f"--resume continues a run with its own settings; only --epochs and --device may"
                f" be given with it, not {', '.join(fixed)}"
            )
        run = RunFolder.open(resume)
        settings = run.settings()
        settings.update({k: options[k] for k in given})
        if not run.checkpoint.is_file():
            raise _error(f"{resume!r} has no checkpoint to resume from; start a new run instead")
        _check_unfinished(resume, run, settings["epochs"])
    else:
        if source is None and options["data"] is not None:
            raise click.UsageError("--data needs a SOURCE (a model or an artifacts directory)")
        if source is not None and options["data"] is None:
            raise click.UsageError(
                f"training {source!r} needs --data DATA.npz (only the demo brings its own data)"
            )
        defaults = DEMO_DEFAULTS if source is None else MODEL_DEFAULTS
        settings = {k: options[k] if options[k] is not None else v for k, v in defaults.items()}
        if source is not None and Path(source).is_dir() and options["lr"] is None:
            settings["lr"] = None
        settings.update(
            source=DEMO if source is None else str(Path(source).resolve()),
            data=str(Path(options["data"]).resolve()) if options["data"] else None,
            val_data=str(Path(options["val_data"]).resolve()) if options["val_data"] else None,
            **{k: options[k] for k in ("val_fraction", "warmup", "loss", "optimizer",
                                       "patience", "seed", "device")},
        )  # fmt: skip
        name = DEMO if source is None else Path(source).stem

        def create() -> str:  # under torchrun, rank 0 creates the run and the others join it
            run = RunFolder.create(out, name)
            try:
                _prepare_run(run, settings)
                run.save_settings(settings)
            except BaseException:
                shutil.rmtree(run.root, ignore_errors=True)
                raise
            return str(run.root)

        run = RunFolder.open(distributed.rank_zero_first(create))
        settings = run.settings()
        try:
            code = _train(run, settings, resume=False)
        except BaseException:
            if distributed.rank() == 0 and not run.checkpoint.exists():
                shutil.rmtree(run.root, ignore_errors=True)
            raise
        ctx.exit(code)
    if given and distributed.rank() == 0:
        run.save_settings(settings)
    ctx.exit(_train(run, settings, resume=True))


def _prepare_run(run: RunFolder, settings: dict[str, Any]) -> None:
    """Fill the run's artifacts folder and record the model's outputs in ``settings``."""
    source = settings["source"]
    if source == DEMO:
        from traingraph.demo import digits_cnn

        model: Any = digits_cnn(seed=settings["seed"])
    elif Path(source).is_dir():
        missing = [f for f in ARTIFACT_FILES if not (Path(source) / f).is_file()]
        if missing:
            raise _error(
                f"{source!r} is not an artifacts directory: it lacks {missing}; create one with"
                " `traingraph artifacts MODEL.onnx --out DIR`"
            )
        run.artifacts.mkdir(parents=True, exist_ok=True)
        for name in ARTIFACT_FILES:
            shutil.copy2(Path(source) / name, run.artifacts / name)
        _, outputs = _model_io(run.artifacts / "eval_model.onnx")
        settings["outputs"] = [o for o in outputs if o != "loss"]
        return
    else:
        model = Path(source)
    settings["outputs"] = _generate(
        model, run.artifacts, settings["loss"], settings["optimizer"], settings["lr"]
    )


def _scheduler(settings: dict[str, Any], optimizer: Any, total: int) -> Any:
    """The run's learning-rate schedule over ``total`` steps, from its initial rate."""
    from traingraph.optim import ConstantLRScheduler, CosineLRScheduler, LinearLRScheduler

    lr = settings["lr"]
    warmup = min(settings["warmup"], total)
    if settings["scheduler"] == "linear":
        return LinearLRScheduler(optimizer, warmup, total, lr)
    if settings["scheduler"] == "cosine":
        return CosineLRScheduler(optimizer, warmup, total, lr)
    return ConstantLRScheduler(optimizer, lr)


def _check_unfinished(resume: str, run: RunFolder, epochs: int) -> None:
    """Raises if the run's checkpoint already holds all ``epochs`` epochs."""
    from traingraph.checkpoint import load_checkpoint_data
    from traingraph.fit import BATCH, EPOCH

    properties = load_checkpoint_data(run.checkpoint).properties
    done, batch = int(properties.get(EPOCH, 0)), int(properties.get(BATCH, 0))
    if done >= epochs and batch == 0:
        raise _error(
            f"{resume!r} has already finished its {done} epochs, so there is nothing to resume;"
            f" pass --epochs with more than {done} to train it further"
        )


def _train(run: RunFolder, settings: dict[str, Any], resume: bool) -> int:
    from traingraph import distributed
    from traingraph.data import Batches
    from traingraph.fit import EarlyStopping, MetricsWriter, ModelCheckpoint, Trainer, fit

    dtypes, _ = _model_io(run.artifacts / "training_model.onnx")
    device = distributed.local_device(settings["device"])  # torchrun: one GPU per process
    trainer = Trainer.from_artifacts(
        run.artifacts, checkpoint=run.checkpoint if resume else None, device=device
    )
    main = distributed.rank() == 0
    dtypes = {n: dtypes[n] for n in trainer.input_names}
    train, val = _datasets(settings, dtypes)
    batches = Batches(train, settings["batch_size"], seed=settings["seed"])
    if settings["lr"] is None:
        settings["lr"] = trainer.optimizer.get_learning_rate()
        if main:
            run.save_settings(settings)
    scheduler = _scheduler(settings, trainer.optimizer, settings["epochs"] * len(batches))
    metrics = _metrics(dtypes, trainer.module.output_names())
    writer = MetricsWriter(run.root)
    callbacks: list[Any] = [ModelCheckpoint(run.checkpoint), writer]
    if settings.get("patience") and val is not None:
        callbacks.append(EarlyStopping("val_loss", patience=settings["patience"]))
    what = "the demo CNN on the 8x8 digits" if settings["source"] == DEMO else settings["source"]
    processes = distributed.world_size()
    if main:
        click.echo(
            f"{'Resuming' if resume else 'Training'} {what}: {len(train[0])} training samples"
            f"{f', {len(val[0])} validation samples' if val is not None else ''},"
            f" {settings['epochs']} epochs of {len(batches)} batches on {settings['device']}"
            f"{f' in {processes} processes' if processes > 1 else ''}"
        )
    state = fit(
        trainer,
        batches,
        epochs=settings["epochs"],
        val_data=Batches(val, 512, shuffle=False) if val is not None else None,
        metrics=metrics,
        callbacks=callbacks,
        scheduler=scheduler,
        resume=resume,
    )
    if state.interrupted:
        if main:
            click.echo(
                f"\nInterrupted in epoch {state.epoch + 1}, after batch {state.batch}. The"
                f" checkpoint is saved in {run.checkpoint}; continue with: traingraph train"
                f" --resume {run.root}"
            )
        return EXIT_INTERRUPTED
    if not main:
        return 0
    trainer.export(run.model, settings["outputs"])
    _summary(run, settings, state.history, writer.plot_path)
    return 0


def _summary(
    run: RunFolder, settings: dict[str, Any], history: list[dict[str, float]], plot: Path | None
) -> None:
    plot_line = (
        f"  {plot.name:<14}loss and accuracy plot"
        if plot is not None
        else "  (no metrics.png: install matplotlib for the plot, pip install matplotlib)"
    )
    lines = [
        f"\nRun folder: {run.root}/",
        f"  {'artifacts/':<14}training, eval and optimizer models and the initial checkpoint",
        f"  {'checkpoint':<14}trained parameters and optimizer state",
        f"  {'model.onnx':<14}inference model (outputs: {', '.join(settings['outputs'])})",
        f"  {'metrics.json':<14}per-epoch metrics (also metrics.csv)",
        plot_line,
    ]
    if history:
        last = history[-1]
        for key, label in (("val_accuracy", "validation"), ("accuracy", "training")):
            if key in last:
                lines.append(f"Final {label} accuracy: {100 * last[key]:.2f}%")
                break
        else:
            key = "val_loss" if "val_loss" in last else "loss"
            lines.append(f"Final {key.replace('_', ' ')}: {last[key]:.4f}")
    click.echo("\n".join(lines))


def _open_trainer(path: str, checkpoint: str | None, device: str) -> tuple[Any, dict | None, Path]:
    """A trainer on a run folder (its latest checkpoint) or an artifacts directory."""
    from traingraph.fit import Trainer

    root = Path(path)
    if (root / RUN_SETTINGS).is_file():
        run = RunFolder.open(path)
        ckpt = Path(checkpoint) if checkpoint else run.checkpoint
        if not ckpt.is_file():
            ckpt = run.artifacts / "checkpoint"
        trainer = Trainer.from_artifacts(run.artifacts, checkpoint=ckpt, device=device)
        return trainer, run.settings(), run.artifacts
    missing = [f for f in ARTIFACT_FILES if not (root / f).is_file()]
    if missing:
        raise click.UsageError(
            f"{path!r} is not a run folder (it has no {RUN_SETTINGS}) and not a complete"
            f" artifacts directory (it lacks {missing}); pass a folder that `traingraph train`"
            " or `traingraph artifacts` wrote"
        )
    trainer = Trainer.from_artifacts(root, checkpoint=checkpoint, device=device)
    return trainer, None, root


@cli.command("eval")
@click.argument("path", type=_DIRECTORY, metavar="RUN_DIR|ARTIFACTS_DIR")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), metavar="DATA.npz",
              help="Arrays to evaluate on  [default for a run folder: its validation data]")
@click.option("--checkpoint", type=click.Path(exists=True, dir_okay=False),
              help="Checkpoint to evaluate  [default: the run's latest, or the artifacts']")
@click.option("--batch-size", default=512, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
def eval_command(
    path: str, data: str | None, checkpoint: str | None, batch_size: int, device: str
) -> None:
    """Evaluate a trained run (or artifacts) with the eval graph: loss and accuracy.

    Example: traingraph eval runs/demo-20250101-120000
    """
    from traingraph.data import Batches
    from traingraph.fit import evaluate

    trainer, settings, artifacts = _open_trainer(path, checkpoint, device)
    dtypes_all, _ = _model_io(artifacts / "training_model.onnx")
    dtypes = {n: dtypes_all[n] for n in trainer.input_names}
    if data is not None:
        arrays = _load_arrays(data, list(dtypes)) or []
        arrays = _cast(arrays, dtypes, repr(data))
    elif settings is not None:
        _, val = _datasets(settings, dtypes)
        if val is None:
            raise click.UsageError("this run has no validation data; pass --data DATA.npz")
        arrays = val
    else:
        raise click.UsageError("evaluating an artifacts directory needs --data DATA.npz")
    trainer.module.eval()
    result = evaluate(
        trainer,
        Batches(arrays, batch_size, shuffle=False),
        _metrics(dtypes, trainer.module.output_names()),
    )
    values = "  ".join(f"{k} {v:.4f}" for k, v in result.items())
    click.echo(f"{values}  ({len(arrays[0])} samples)")


@cli.command("export")
@click.argument("path", type=_DIRECTORY, metavar="RUN_DIR|ARTIFACTS_DIR")
@click.option("--checkpoint", type=click.Path(exists=True, dir_okay=False),
              help="Checkpoint whose weights go into the model  [default: the run's latest]")
@click.option("--output", "outputs", multiple=True, metavar="NAME",
              help="Output of the inference model (repeat; default: the model's outputs).")
@click.option("--out", type=click.Path(dir_okay=False), metavar="MODEL.onnx",
              help="Where to write  [default: RUN_DIR/model.onnx or ARTIFACTS_DIR/model.onnx]")
def export_command(
    path: str, checkpoint: str | None, outputs: tuple[str, ...], out: str | None
) -> None:
    """Export the inference model with trained weights from a run folder or artifacts.

    Example: traingraph export runs/demo-20250101-120000 --out digits.onnx
    """
    trainer, settings, artifacts = _open_trainer(path, checkpoint, "cpu")
    names = list(outputs)
    if not names:
        names = settings["outputs"] if settings is not None else [
            o for o in _model_io(artifacts / "eval_model.onnx")[1] if o != "loss"
        ]
    if not names:
        raise click.UsageError(
            "the eval model returns only the loss; name the tensors to export with --output NAME"
        )
    target = Path(out) if out is not None else Path(path) / "model.onnx"
    trainer.export(target, names)
    click.echo(f"Wrote {target} (outputs: {', '.join(names)})")


def _describe_model(path: Path) -> list[str]:
    from traingraph.describe import model_lines

    model = _load_onnx(path)
    try:
        return model_lines(path, model)
    except Exception as exc:
        raise _error(
            f"{str(path)!r} is a malformed ONNX model ({type(exc).__name__}: {exc}); check it"
            " with onnx.checker.check_model and export it again"
        ) from None


@cli.command("info")
@click.argument("path", type=click.Path(exists=True), metavar="MODEL|CHECKPOINT|DIR")
def info_command(path: str) -> None:
    """Describe a model or a checkpoint.

    For a model (.onnx): inputs, outputs, parameters and sizes, op types, opset, and whether
    every op has a gradient rule (naming the op and node when one lacks it), and a warning
    where it looks like an eval-mode export of a training model. For a checkpoint:
    parameters, trainable flags, optimizer state and properties. For a run folder or an
    artifacts directory: its checkpoint.

    Example: traingraph info model.onnx
    """
    from traingraph.describe import checkpoint_lines
    from traingraph.errors import CheckpointError

    target = Path(path)
    if target.is_dir():
        candidates = [target / "checkpoint", target / "artifacts" / "checkpoint"]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise click.UsageError(f"{path!r} is a folder without a checkpoint; pass a file")
        target = found
    model: Path | None = None
    if target.suffix == ".onnx":
        lines, model = _describe_model(target), target
    else:
        try:
            lines = checkpoint_lines(target)
        except CheckpointError as exc:
            try:
                lines, model = _describe_model(target), target
            except click.ClickException:
                raise _error(
                    f"{path!r} is neither a checkpoint nor an ONNX model ({exc}); pass a"
                    " checkpoint, an .onnx file, a run folder or an artifacts directory"
                ) from None
    click.echo("\n".join(lines))
    if model is not None:
        import onnx

        from traingraph.ir.export_checks import export_warnings

        for message in export_warnings(onnx.load(str(model), load_external_data=False)):
            click.echo(f"warning: {message}", err=True)


def _bench_command() -> click.Command:
    from traingraph.bench import command

    return command()


cli.add_command(_bench_command())


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``traingraph`` command: one-line errors, non-zero exit codes."""
    from traingraph.errors import TraingraphError

    try:
        code = cli.main(args=list(argv) if argv is not None else None, prog_name="traingraph",
                        standalone_mode=False)  # fmt: skip
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        click.echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo("error: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except (TraingraphError, OSError, ValueError) as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        sys.exit(1)
    except Exception as exc:
        if os.environ.get("TRAINGRAPH_DEBUG"):
            raise
        click.echo(
            f"error: unexpected {type(exc).__name__}: {_one_line(str(exc))} (set"
            " TRAINGRAPH_DEBUG=1 to see the traceback, and please report it)",
            err=True,
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
