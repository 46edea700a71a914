"""Federated learning with Flower: clients that train traingraph artifacts on their own data.

A Flower node runs an :class:`ArtifactClient` through the ``ClientApp`` that :func:`client_app`
builds. The server sends the global parameters as an ``ArrayRecord`` holding one array: the flat
parameter buffer of :meth:`traingraph.api.Module.get_contiguous_parameters` (all parameters in
checkpoint order). The client loads it with ``Module.copy_buffer_to_parameters``, trains
``local-epochs`` epochs with :class:`~traingraph.api.Module` and
:class:`~traingraph.api.Optimizer`, and replies with its buffer, the number of samples it trained
on and its training loss. An evaluate message runs the eval graph on the node's validation data.
The round and the node's step count travel in the checkpoint's property bag (``round`` and
``step``), which the node keeps in its Flower ``Context`` between rounds.

Any Flower strategy works on the server side; FedAvg averages the buffers weighted by
``num-examples``. :func:`initial_arrays` gives the starting ``ArrayRecord`` and
:func:`evaluate_fn` a centralized evaluation of the global model. For the strategies of
``flwr.server.strategy``, :class:`ArtifactNumPyClient` is the same node as a ``NumPyClient``.

Needs the ``flower`` extra: ``pip install "traingraph[flower]"`` (and ``flwr[simulation]`` for
Flower's simulation engine).

Example:
    >>> from traingraph import artifacts, flower
    >>> from traingraph.datasets import load_digits
    >>> from traingraph.demo import digits_cnn
    >>> artifacts.generate_artifacts(
    ...     digits_cnn(), loss=artifacts.LossType.CrossEntropyLoss,
    ...     optimizer=artifacts.OptimType.AdamW, additional_output_names=["logits"],
    ...     artifact_directory="digits")  # doctest: +SKIP
    >>> x, y = load_digits("train")
    >>> app = flower.client_app(lambda context: flower.ArtifactClient(
    ...     "digits", train=(x, y), score_output="logits"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.data import Batches
from traingraph.errors import DataError, ModelError

try:
    from flwr.app import (
        Array,
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MetricRecord,
        RecordDict,
    )
    from flwr.client import NumPyClient
    from flwr.clientapp import ClientApp
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "traingraph.flower needs Flower (flwr >= 1.22), which is not installed; install it with"
        ' pip install "traingraph[flower]"'
    ) from error

__all__ = [
    "PARAMETERS_KEY",
    "ArtifactClient",
    "ArtifactNumPyClient",
    "FitResult",
    "arrays_from_parameters",
    "client_app",
    "dirichlet_partition",
    "evaluate_fn",
    "initial_arrays",
    "parameters_from_arrays",
    "save_inference_model",
]

PARAMETERS_KEY = "parameters"
"""Name of the one array of the ``ArrayRecord``: the flat parameter buffer."""
_STATE_KEY = "traingraph"
"""Key of the ``ConfigRecord`` in a node's ``Context.state`` that keeps its property bag."""
_BAG = ("round", "step")
"""The checkpoint properties that travel between rounds."""


def arrays_from_parameters(parameters: np.ndarray) -> ArrayRecord:
    """Wrap a flat parameter buffer in an ``ArrayRecord`` (one array, :data:`PARAMETERS_KEY`)."""
    return ArrayRecord({PARAMETERS_KEY: Array(np.ascontiguousarray(parameters))})


def parameters_from_arrays(arrays: ArrayRecord) -> np.ndarray:
    """The flat parameter buffer that an ``ArrayRecord`` of :func:`arrays_from_parameters` holds.

    Raises:
        ModelError: The record does not hold exactly one one-dimensional array.
    """
    if len(arrays) != 1:
        raise ModelError(
            f"the ArrayRecord holds {len(arrays)} arrays ({list(arrays)[:5]}); expected one, the"
            f" flat parameter buffer {PARAMETERS_KEY!r}: build it with"
            " traingraph.flower.initial_arrays or arrays_from_parameters"
        )
    (flat,) = (array.numpy() for array in arrays.values())
    if flat.ndim != 1:
        raise ModelError(
            f"the parameter buffer has shape {list(flat.shape)}; expected a flat (1-D) buffer as"
            " Module.get_contiguous_parameters returns"
        )
    return flat


@dataclass(frozen=True)
class FitResult:
    """What :meth:`ArtifactClient.fit` returns.

    Attributes:
        parameters: The flat parameter buffer after local training.
        num_examples: The node's training samples (FedAvg's weight).
        loss: Mean training loss over the local steps.
        round: The server round, as stored in the property bag.
        step: The node's optimizer steps over all rounds, as stored in the property bag.
    """

    parameters: np.ndarray
    num_examples: int
    loss: float
    round: int
    step: int


class ArtifactClient:
    """One federated node: trains and evaluates traingraph artifacts on the node's own data.

    The client starts from the artifacts' checkpoint; :meth:`fit` and :meth:`evaluate` load the
    parameters that the server sent. The ``ClientApp`` of :func:`client_app` builds a client for
    each message, so the optimizer state is fresh each round; calling :meth:`fit` again on one
    client continues its optimizer state.

    Args:
        artifact_directory: Where :func:`traingraph.artifacts.generate_artifacts` wrote the
            training, eval and optimizer models and the checkpoint.
        train: The node's training arrays, fed in the order of the training model's inputs
            (e.g. ``(images, labels)``); None for a node that only evaluates.
        validation: The node's validation arrays, for the eval model; None for a node that
            only trains.
        batch_size: Samples per step.
        local_epochs: Epochs per round (a train message's ``local-epochs`` overrides it).
        learning_rate: The optimizer's learning rate (a train message's ``lr`` overrides it);
            None keeps the one in the optimizer model.
        score_output: The eval model's output of class scores (``[batch, classes]``); when set,
            :meth:`evaluate` also reports the accuracy against the last validation array.
        trainable_only: Exchange only the trainable parameters (frozen ones and running
            statistics stay as the checkpoint holds them).
        seed: Seed of the batch order; epoch ``e`` of the node is shuffled with ``(seed, e)``.
        device: "cpu", "cuda" or "cuda:N".
        prefix: The file-name prefix the artifacts were generated with.

    Example:
        >>> client = ArtifactClient("digits", train=(x, y), local_epochs=2)  # doctest: +SKIP
        >>> result = client.fit(client.parameters(), server_round=1)  # doctest: +SKIP
    """

    def __init__(
        self,
        artifact_directory: str | os.PathLike,
        train: Sequence[np.ndarray] | None = None,
        validation: Sequence[np.ndarray] | None = None,
        *,
        batch_size: int = 32,
        local_epochs: int = 1,
        learning_rate: float | None = None,
        score_output: str | None = None,
        trainable_only: bool = False,
        seed: int = 0,
        device: str = "cpu",
        prefix: str = "",
    ) -> None:
        directory = Path(artifact_directory)
        self.paths = {
            name: directory / f"{prefix}{file}"
            for name, file in (
                ("checkpoint", "checkpoint"),
                ("train", "training_model.onnx"),
                ("eval", "eval_model.onnx"),
                ("optimizer", "optimizer_model.onnx"),
            )
        }
        needed = ["checkpoint", "train"]
        needed += ["optimizer"] if train is not None else []
        needed += ["eval"] if validation is not None else []
        missing = [str(self.paths[name]) for name in needed if not self.paths[name].exists()]
        if missing:
            raise ModelError(
                f"the artifacts {missing} do not exist; generate them with"
                " traingraph.artifacts.generate_artifacts(model, loss=..., optimizer=...,"
                f" artifact_directory={os.fspath(directory)!r}, prefix={prefix!r})"
            )
        if local_epochs < 1:
            raise ModelError(f"local_epochs must be at least 1, got {local_epochs!r}")
        self.train_data = None if train is None else tuple(np.asarray(a) for a in train)
        self.validation_data = (
            None if validation is None else tuple(np.asarray(a) for a in validation)
        )
        self.batch_size = batch_size
        self.local_epochs = local_epochs
        self.learning_rate = learning_rate
        self.score_output = score_output
        self.trainable_only = trainable_only
        self.seed = seed
        self.device = device
        self.state = CheckpointState.load_checkpoint(self.paths["checkpoint"])
        eval_model = self.paths["eval"] if self.paths["eval"].exists() else None
        self.module = Module(self.paths["train"], self.state, eval_model, device=device)
        self._optimizer: Optimizer | None = None

    @property
    def optimizer(self) -> Optimizer:
        """The :class:`~traingraph.api.Optimizer`, loaded on first use."""
        if self._optimizer is None:
            self._optimizer = Optimizer(self.paths["optimizer"], self.module)
        return self._optimizer

    def parameters(self) -> np.ndarray:
        """The Module's parameters as one flat float buffer (what the server averages)."""
        return self.module.get_contiguous_parameters(self.trainable_only).numpy()

    def set_parameters(self, parameters: np.ndarray) -> None:
        """Load a flat buffer of :meth:`parameters`' layout into the Module.

        Raises:
            ModelError: The buffer's size differs from the Module's parameter count.
        """
        expected = self.module.get_parameters_size(self.trainable_only)
        if parameters.size != expected:
            kind = "trainable parameters" if self.trainable_only else "parameters"
            raise ModelError(
                f"the server sent a buffer of {parameters.size} values; the artifacts in"
                f" {str(self.paths['train'].parent)!r} hold {expected} {kind}: server and"
                " clients must start from the same artifacts (and the same trainable_only)"
            )
        self.module.copy_buffer_to_parameters(parameters, self.trainable_only)

    def fit(
        self,
        parameters: np.ndarray,
        server_round: int = 0,
        *,
        local_epochs: int | None = None,
        learning_rate: float | None = None,
    ) -> FitResult:
        """Train ``local_epochs`` epochs on the node's data, starting from ``parameters``.

        The node's step count is read from the checkpoint's property bag (``step``) and
        written back with ``round`` set to ``server_round``.

        Args:
            parameters: The global parameters, a flat buffer.
            server_round: The server's round number, kept in the property bag.
            local_epochs: Epochs to train (default: the client's ``local_epochs``).
            learning_rate: Learning rate (default: the client's ``learning_rate``).

        Returns:
            The :class:`FitResult`.

        Raises:
            DataError: The client has no training data.
            ModelError: ``local_epochs`` is below 1, or the buffer does not fit the artifacts.
        """
        if self.train_data is None:
            raise DataError(
                "this ArtifactClient has no training data; pass train=(inputs..., labels) to"
                " train on this node"
            )
        epochs = self.local_epochs if local_epochs is None else int(local_epochs)
        if epochs < 1:
            raise ModelError(
                f"local_epochs must be at least 1, got {local_epochs!r}; set a positive"
                " 'local-epochs' in the strategy's train_config"
            )
        rate = self.learning_rate if learning_rate is None else float(learning_rate)
        self.set_parameters(parameters)
        optimizer = self.optimizer
        if rate is not None:
            optimizer.set_learning_rate(rate)
        batches = Batches(self.train_data, self.batch_size, seed=self.seed)
        step = int(self.state.properties.get("step", 0))
        first_epoch = step // len(batches)
        losses = []
        self.module.train()
        for epoch in range(first_epoch, first_epoch + epochs):
            for batch in batches.epoch(epoch):
                outputs = self.module(*batch)
                losses.append(float(_first(outputs)))
                optimizer.step()
                self.module.lazy_reset_grad()
        step += len(losses)
        self.state.properties["round"] = int(server_round)
        self.state.properties["step"] = step
        return FitResult(
            parameters=self.parameters(),
            num_examples=batches.size,
            loss=float(np.mean(losses)),
            round=int(server_round),
            step=step,
        )

    def evaluate(self, parameters: np.ndarray) -> dict[str, float]:
        """Run the eval graph on the node's validation data with ``parameters``.

        Returns:
            ``loss`` (the eval model's mean loss, averaged over the samples), ``accuracy``
            (when ``score_output`` is set) and ``num-examples``.

        Raises:
            DataError: The client has no validation data.
            ModelError: ``score_output`` is not an output of the eval model.
        """
        if self.validation_data is None:
            raise DataError(
                "this ArtifactClient has no validation data; pass validation=(inputs...,"
                " labels) to evaluate on this node"
            )
        self.set_parameters(parameters)
        self.module.eval()
        names = self.module.output_names()
        if self.score_output is not None and self.score_output not in names:
            raise ModelError(
                f"score_output {self.score_output!r} is not an output of the eval model, whose"
                f" outputs are {names}; generate the artifacts with"
                f" additional_output_names=[{self.score_output!r}] or pass one of those"
            )
        data = Batches(self.validation_data, max(self.batch_size, 256), shuffle=False)
        loss_sum, correct = 0.0, 0
        for batch in data.epoch(0):
            outputs = self.module(*batch)
            values = outputs if isinstance(outputs, list | tuple) else [outputs]
            count = batch[0].shape[0]
            loss_sum += float(np.asarray(values[0]).mean()) * count
            if self.score_output is not None:
                scores = np.asarray(values[names.index(self.score_output)])
                correct += int(np.sum(np.argmax(scores, axis=-1) == batch[-1]))
        metrics = {"loss": loss_sum / data.size, "num-examples": float(data.size)}
        if self.score_output is not None:
            metrics["accuracy"] = correct / data.size
        return metrics

    # ------------------------------------------------------------- property bag
    def restore_bag(self, values: Mapping[str, Any]) -> None:
        """Put ``round`` and ``step`` from ``values`` (a node's saved bag) in the property bag."""
        for key in _BAG:
            if key in values:
                self.state.properties[key] = int(values[key])

    def bag(self) -> dict[str, int]:
        """``round`` and ``step`` of the property bag (0 where unset)."""
        return {key: int(self.state.properties.get(key, 0)) for key in _BAG}


def _first(outputs: Any) -> Any:
    """The first output of a Module call (the loss)."""
    return outputs[0] if isinstance(outputs, list | tuple) else outputs


def client_app(client_fn: Callable[[Context], ArtifactClient]) -> ClientApp:
    """A Flower ``ClientApp`` whose train and evaluate messages run an :class:`ArtifactClient`.

    ``client_fn(context)`` builds the node's client for each message (in simulation,
    ``context.node_config["partition-id"]`` says which data partition the node holds).

    A train message's ``ConfigRecord`` may set ``local-epochs`` and ``lr``; its
    ``server-round`` (set by Flower's strategies) goes into the property bag. The reply holds
    ``arrays`` (the trained buffer) and ``metrics``: ``train_loss``, ``num-examples``, ``step``.
    An evaluate reply's ``metrics`` hold ``eval_loss``, ``num-examples`` and, with a
    ``score_output``, ``eval_acc``.

    Args:
        client_fn: Builds the node's :class:`ArtifactClient` from its Flower ``Context``.

    Returns:
        The ``ClientApp``.
    """
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        arrays, config = _unpack(message)
        result = _fit(client_fn(context), parameters_from_arrays(arrays), config, context)
        metrics = MetricRecord(
            {"train_loss": result.loss, "num-examples": result.num_examples, "step": result.step}
        )
        content = RecordDict(
            {"arrays": arrays_from_parameters(result.parameters), "metrics": metrics}
        )
        return Message(content=content, reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        client = client_fn(context)
        arrays, _ = _unpack(message)
        values = client.evaluate(parameters_from_arrays(arrays))
        metrics = MetricRecord(
            {"eval_loss": values["loss"], "num-examples": int(values["num-examples"])}
        )
        metrics.update(_evaluation_metrics(values))
        return Message(content=RecordDict({"metrics": metrics}), reply_to=message)

    return app


def _fit(
    client: ArtifactClient,
    parameters: np.ndarray,
    config: Mapping[str, Any],
    context: Context | None,
) -> FitResult:
    """:meth:`ArtifactClient.fit` as a train message's ``config`` asks (``server-round``,
    ``local-epochs``, ``lr``), with the node's property bag kept in ``context.state``."""
    if context is not None:
        saved = context.state.config_records.get(_STATE_KEY)
        if saved is not None:
            client.restore_bag(saved)
    epochs = int(_number(config, "local-epochs")) if "local-epochs" in config else None
    result = client.fit(
        parameters,
        server_round=int(_number(config, "server-round", 0)),
        local_epochs=epochs,
        learning_rate=_number(config, "lr") if "lr" in config else None,
    )
    if context is not None:
        context.state[_STATE_KEY] = ConfigRecord(dict(client.bag()))
    return result


def _evaluation_metrics(values: Mapping[str, float]) -> dict[str, float]:
    """The node's evaluation metrics beyond the loss and the sample count."""
    return {"eval_acc": values["accuracy"]} if "accuracy" in values else {}


class ArtifactNumPyClient(NumPyClient):
    """An :class:`ArtifactClient` as a Flower ``NumPyClient``, for the strategies of
    ``flwr.server.strategy`` (Flower's ``ServerApp(server_fn=...)`` and ``ClientApp(client_fn=...)``
    API); the ``ClientApp`` of :func:`client_app` serves the strategies of
    ``flwr.serverapp.strategy``.

    The parameters travel as a list holding one array, the flat parameter buffer. ``fit`` reads
    ``server-round``, ``local-epochs`` and ``lr`` from the config (a legacy strategy sends
    what its ``on_fit_config_fn`` returns) and returns the trained buffer, the number of
    samples and the metrics ``train_loss`` and ``step``; ``evaluate`` returns the eval graph's
    loss, the number of samples and, with a ``score_output``, ``eval_acc``. With a ``context``,
    the property bag (``round``, ``step``) is kept in its state between rounds.

    Args:
        client: The node's :class:`ArtifactClient`.
        context: The node's Flower ``Context`` (the one ``client_fn`` receives).

    Example:
        >>> from flwr.client import ClientApp
        >>> app = ClientApp(client_fn=lambda context: flower.ArtifactNumPyClient(
        ...     node_client(context), context).to_client())  # doctest: +SKIP
    """

    def __init__(self, client: ArtifactClient, context: Context | None = None) -> None:
        self.client = client
        self.node_context = context

    def get_parameters(self, config: Mapping[str, Any]) -> list[np.ndarray]:
        return [self.client.parameters()]

    def fit(
        self, parameters: list[np.ndarray], config: Mapping[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        result = _fit(self.client, _one_buffer(parameters), config, self.node_context)
        metrics = {"train_loss": result.loss, "step": result.step}
        return [result.parameters], result.num_examples, metrics

    def evaluate(
        self, parameters: list[np.ndarray], config: Mapping[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        values = self.client.evaluate(_one_buffer(parameters))
        return values["loss"], int(values["num-examples"]), _evaluation_metrics(values)


def _one_buffer(parameters: Sequence[np.ndarray]) -> np.ndarray:
    """The flat parameter buffer of a ``NumPyClient``'s parameter list.

    Raises:
        ModelError: The list does not hold exactly one one-dimensional array.
    """
    if len(parameters) != 1 or np.ndim(parameters[0]) != 1:
        shapes = [list(np.shape(a)) for a in parameters][:5]
        raise ModelError(
            f"the server sent {len(parameters)} arrays of shapes {shapes}; expected one, the"
            " flat parameter buffer: start the strategy from"
            " ndarrays_to_parameters([traingraph.flower.ArtifactClient(...).parameters()])"
        )
    return np.asarray(parameters[0])


def _unpack(message: Message) -> tuple[ArrayRecord, ConfigRecord]:
    """The one ``ArrayRecord`` of a message and its ``ConfigRecord`` (empty if none)."""
    content = message.content
    arrays = list(content.array_records.values())
    if len(arrays) != 1:
        raise ModelError(
            f"the {message.metadata.message_type} message holds {len(arrays)} ArrayRecords;"
            " expected one with the flat parameter buffer (see traingraph.flower.initial_arrays)"
        )
    configs = list(content.config_records.values())
    return arrays[0], configs[0] if configs else ConfigRecord()


def _number(config: Mapping[str, Any], key: str, default: float = 0) -> float:
    """``config[key]`` as a number (``default`` when absent).

    Raises:
        ModelError: The value is not an int or a float.
    """
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelError(
            f"the train message's config sets {key!r} to {value!r} ({type(value).__name__});"
            " expected a number: put an int or a float in the strategy's train_config"
        )
    return value


def initial_arrays(
    artifact_directory: str | os.PathLike, *, trainable_only: bool = False, prefix: str = ""
) -> ArrayRecord:
    """The starting global model: the artifacts' checkpoint as an ``ArrayRecord``.

    Args:
        artifact_directory: The artifacts every client uses.
        trainable_only: As the clients' ``trainable_only``.
        prefix: The file-name prefix the artifacts were generated with.
    """
    client = ArtifactClient(artifact_directory, trainable_only=trainable_only, prefix=prefix)
    return arrays_from_parameters(client.parameters())


def save_inference_model(
    arrays: ArrayRecord,
    artifact_directory: str | os.PathLike,
    inference_model_uri: str | os.PathLike,
    graph_output_names: Sequence[str],
    *,
    trainable_only: bool = False,
    prefix: str = "",
) -> None:
    """Write a global model (e.g. ``Result.arrays`` of a strategy) as a plain inference model.

    Args:
        arrays: The flat parameter buffer in an ``ArrayRecord``.
        artifact_directory: The artifacts the clients trained.
        inference_model_uri: Where to write the ``.onnx`` model.
        graph_output_names: The eval model's outputs to keep, e.g. ``["logits"]``.
        trainable_only: As the clients' ``trainable_only``.
        prefix: The file-name prefix the artifacts were generated with.

    Raises:
        ModelError: The artifacts have no eval model, or the buffer does not fit them.
    """
    client = ArtifactClient(artifact_directory, trainable_only=trainable_only, prefix=prefix)
    client.set_parameters(parameters_from_arrays(arrays))
    client.module.export_model_for_inferencing(inference_model_uri, graph_output_names)


def evaluate_fn(client: ArtifactClient) -> Callable[[int, ArrayRecord], MetricRecord]:
    """A centralized evaluation for ``Strategy.start(evaluate_fn=...)``.

    Args:
        client: An :class:`ArtifactClient` with the server's validation data.

    Returns:
        A function of ``(server_round, arrays)`` that returns the ``MetricRecord`` of
        :meth:`ArtifactClient.evaluate` (``loss``, ``accuracy`` with a ``score_output``,
        ``num-examples``).
    """

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        values = client.evaluate(parameters_from_arrays(arrays))
        return MetricRecord({**values, "num-examples": int(values["num-examples"])})

    return evaluate


def dirichlet_partition(
    labels: np.ndarray, num_partitions: int, alpha: float = 0.5, seed: int = 0
) -> list[np.ndarray]:
    """Split samples among nodes with label skew: a Dirichlet share of each class per node.

    For each class, the proportions of its samples that go to the ``num_partitions`` nodes are
    drawn from ``Dirichlet(alpha)``; a small ``alpha`` gives each node a few dominant classes
    (non-IID), a large one approaches an even split. Draws repeat until every node has at least
    one sample.

    Args:
        labels: Integer class labels, ``[N]``.
        num_partitions: Number of nodes.
        alpha: Concentration of the Dirichlet distribution, > 0.
        seed: Seed of the draws and the shuffling.

    Returns:
        One sorted index array per node; together they cover every sample once.

    Raises:
        DataError: ``alpha`` is not positive, or there are fewer samples than nodes.
    """
    labels = np.asarray(labels)
    if alpha <= 0:
        raise DataError(f"alpha must be positive, got {alpha!r}; e.g. 0.5 for a strong skew")
    if labels.ndim != 1 or labels.size < num_partitions or num_partitions < 1:
        raise DataError(
            f"cannot split {labels.size} labels (shape {list(labels.shape)}) among"
            f" {num_partitions} nodes; pass 1-D labels and at least as many samples as nodes"
        )
    rng = np.random.default_rng(seed)
    while True:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for cls in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == cls))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * members.size).astype(int)
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.append(chunk)
        result = [np.sort(np.concatenate(part)) for part in parts]
        if all(part.size for part in result):
            return result
