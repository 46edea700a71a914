"""traingraph.flower: Flower clients on traingraph artifacts, driven by FedAvg without Ray.

The federated rounds run in this process through Flower's public API only: a ``ServerApp``
with Flower's FedAvg (``flwr.server.strategy``) over a grid that hands each message to a
``ClientApp`` of :class:`traingraph.flower.ArtifactNumPyClient`, as Flower's simulation engine
does on its workers; the example (examples/flower_digits.py) runs the simulation engine itself,
with the message-API ``ClientApp`` of :func:`traingraph.flower.client_app`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip(
    "flwr", reason="traingraph.flower needs Flower: pip install 'traingraph[flower]' (in [test])"
)

from flwr.client import ClientApp
from flwr.common import (
    ArrayRecord,
    Context,
    Message,
    RecordDict,
    ndarrays_to_parameters,
)
from flwr.server import Grid, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg

from traingraph import artifacts, flower
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.data import Batches
from traingraph.datasets import load_digits
from traingraph.demo import OUTPUT_NAME, digits_cnn
from traingraph.errors import DataError, ModelError

CHANNELS = (8, 16)
LR = 2e-2


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("flower")
    artifacts.generate_artifacts(
        digits_cnn(seed=0, channels=CHANNELS),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        additional_output_names=[OUTPUT_NAME],
        artifact_directory=out,
    )
    return out


@pytest.fixture(scope="module")
def digits():
    return load_digits("train"), load_digits("test")


class LocalGrid(Grid):
    """Hands each message to a ClientApp in this process; node ``i + 1`` holds partition ``i``."""

    def __init__(self, app, nodes: int) -> None:
        self.app = app
        self.contexts = {
            i + 1: Context(
                run_id=1,
                node_id=i + 1,
                node_config={"partition-id": i, "num-partitions": nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(nodes)
        }
        self._run = SimpleNamespace(run_id=1)

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError("LocalGrid answers in send_and_receive")

    def pull_messages(self, message_ids):
        raise NotImplementedError("LocalGrid answers in send_and_receive")

    def send_and_receive(self, messages, *, timeout=None):
        return [self.app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


def _clients(artifact_dir, x, y, parts, **options):
    def client_fn(context: Context) -> flower.ArtifactClient:
        node = int(context.node_config["partition-id"])
        part = parts[node]
        cut = part.size * 4 // 5
        return flower.ArtifactClient(
            artifact_dir,
            train=(x[part[:cut]], y[part[:cut]]),
            validation=(x[part[cut:]], y[part[cut:]]),
            score_output=OUTPUT_NAME,
            learning_rate=LR,
            seed=node,
            **options,
        )

    return client_fn


def test_fit_trains_as_module_and_optimizer(artifact_dir, digits):
    (x, y), _ = digits
    x, y = x[:150], y[:150]
    client = flower.ArtifactClient(artifact_dir, train=(x, y), batch_size=32, seed=3)
    start = client.parameters() + np.float32(0.01)
    result = client.fit(start, server_round=4, local_epochs=2, learning_rate=LR)

    state = CheckpointState.load_checkpoint(artifact_dir / "checkpoint")
    module = Module(artifact_dir / "training_model.onnx", state)
    optimizer = Optimizer(artifact_dir / "optimizer_model.onnx", module)
    module.copy_buffer_to_parameters(start, trainable_only=False)
    optimizer.set_learning_rate(LR)
    batches, losses = Batches((x, y), 32, seed=3), []
    for epoch in range(2):
        for batch in batches.epoch(epoch):
            losses.append(float(module(*batch)[0]))
            optimizer.step()
            module.lazy_reset_grad()
    expected = module.get_contiguous_parameters().numpy()

    np.testing.assert_allclose(result.parameters, expected, rtol=1e-6, atol=1e-7)
    assert result.num_examples == len(x)
    assert result.loss == pytest.approx(np.mean(losses), rel=1e-6)
    assert (result.round, result.step) == (4, 2 * len(batches))
    assert client.state.properties["round"] == 4
    assert client.state.properties["step"] == 2 * len(batches)

    # The next round continues the node's epochs: epoch 2 of its shuffling.
    second = client.fit(result.parameters, server_round=5, local_epochs=1)
    assert second.step == 3 * len(batches)
    assert client.bag() == {"round": 5, "step": 3 * len(batches)}


def test_evaluate_matches_inference_in_float64(artifact_dir, digits):
    _, (x, y) = digits
    client = flower.ArtifactClient(
        artifact_dir, validation=(x, y), score_output=OUTPUT_NAME, batch_size=100
    )
    values = client.evaluate(client.parameters())

    model = digits_cnn(seed=0, channels=CHANNELS)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x})
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert values["loss"] == pytest.approx(-log_probs[np.arange(len(y)), y].mean(), rel=1e-5)
    assert values["accuracy"] == pytest.approx(np.mean(logits.argmax(axis=1) == y))
    assert values["num-examples"] == len(y)


def test_fedavg_rounds_average_the_clients_and_learn(artifact_dir, digits, tmp_path):
    (x, y), (x_test, y_test) = digits
    nodes, rounds = 3, 2
    parts = flower.dirichlet_partition(y, nodes, alpha=0.5, seed=1)
    client_fn = _clients(artifact_dir, x, y, parts)
    app = ClientApp(
        client_fn=lambda context: flower.ArtifactNumPyClient(
            client_fn(context), context
        ).to_client()
    )
    grid = LocalGrid(app, nodes)
    evaluator = flower.ArtifactClient(
        artifact_dir, validation=(x_test, y_test), score_output=OUTPUT_NAME
    )
    seen: dict[int, np.ndarray] = {}
    accuracy: dict[int, float] = {}
    node_metrics: list[list[tuple[int, dict]]] = []

    def evaluate(server_round, ndarrays, config):
        seen[server_round] = ndarrays[0]
        values = evaluator.evaluate(ndarrays[0])
        accuracy[server_round] = values["accuracy"]
        return values["loss"], {"accuracy": values["accuracy"]}

    def collect(metrics):
        node_metrics.append(metrics)
        return {}

    start = flower.ArtifactClient(artifact_dir).parameters()
    strategy = FedAvg(
        min_fit_clients=nodes,
        min_evaluate_clients=nodes,
        min_available_clients=nodes,
        initial_parameters=ndarrays_to_parameters([start]),
        evaluate_fn=evaluate,
        on_fit_config_fn=lambda server_round: {"server-round": server_round, "local-epochs": 1},
        fit_metrics_aggregation_fn=collect,
        evaluate_metrics_aggregation_fn=collect,
    )
    server = ServerApp(
        server_fn=lambda context: ServerAppComponents(
            strategy=strategy, config=ServerConfig(num_rounds=rounds)
        )
    )
    server(grid=grid, context=Context(1, 0, {}, RecordDict(), {}))

    # Round 1: the global model is the mean of the nodes' fits, weighted by their samples.
    fits = []
    for node in range(nodes):
        context = Context(1, node + 1, {"partition-id": node}, RecordDict(), {})
        fits.append(client_fn(context).fit(start, server_round=1, local_epochs=1))
    weights = np.array([fit.num_examples for fit in fits], np.float64)
    stacked = np.stack([fit.parameters.astype(np.float64) for fit in fits])
    expected = (weights[:, None] * stacked).sum(axis=0) / weights.sum()
    np.testing.assert_allclose(seen[1], expected, rtol=1e-5, atol=1e-6)

    # Each node's property bag holds the last round and its steps over all rounds.
    for node, part in enumerate(parts):
        bag = grid.contexts[node + 1].state.config_records["traingraph"]
        steps = len(Batches((part[: part.size * 4 // 5],), 32))
        assert (bag["round"], bag["step"]) == (rounds, rounds * steps)

    assert sorted(accuracy) == list(range(rounds + 1))
    assert accuracy[0] < 0.2, accuracy  # ten classes: chance
    assert accuracy[rounds] > 0.7, accuracy
    fit_rounds, evaluate_rounds = node_metrics[-2], node_metrics[-1]  # the last round's
    assert sorted(n for n, _ in fit_rounds) == sorted(fit.num_examples for fit in fits)
    assert all(m["train_loss"] > 0 and m["step"] > 0 for _, m in fit_rounds)
    assert len(evaluate_rounds) == nodes
    assert all(0 <= m["eval_acc"] <= 1 for _, m in evaluate_rounds)

    # The global model, written as an inference model, scores as the server's evaluation.
    path = tmp_path / "global.onnx"
    final = flower.arrays_from_parameters(seen[rounds])
    flower.save_inference_model(final, artifact_dir, path, [OUTPUT_NAME])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x_test})
    assert np.mean(logits.argmax(axis=1) == y_test) == pytest.approx(accuracy[rounds])


def test_buffer_of_other_artifacts_is_refused(artifact_dir, digits):
    (x, y), _ = digits
    client = flower.ArtifactClient(artifact_dir, train=(x[:40], y[:40]))
    with pytest.raises(ModelError, match=r"buffer of 7 values.*same artifacts"):
        client.fit(np.zeros(7, np.float32))
    per_tensor = ArrayRecord(
        [np.zeros(3, np.float32), np.zeros(2, np.float32)]  # a state_dict-style record
    )
    with pytest.raises(ModelError, match="holds 2 arrays"):
        flower.parameters_from_arrays(per_tensor)
    with pytest.raises(ModelError, match="local_epochs must be at least 1, got 0"):
        client.fit(client.parameters(), local_epochs=0)
    with pytest.raises(DataError, match="no validation data"):
        client.evaluate(client.parameters())


def test_dirichlet_partition_covers_every_sample_with_label_skew():
    labels = np.repeat(np.arange(10), 40)
    parts = flower.dirichlet_partition(labels, 5, alpha=0.5, seed=0)
    assert len(parts) == 5
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(labels.size))
    shares = np.stack([np.bincount(labels[p], minlength=10) / p.size for p in parts])
    assert shares.max() > 0.3  # an even split would give each class 0.1 of a node
    again = flower.dirichlet_partition(labels, 5, alpha=0.5, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    with pytest.raises(DataError, match="alpha must be positive"):
        flower.dirichlet_partition(labels, 5, alpha=0.0)


@pytest.mark.slow
def test_example_passes_90_percent_in_the_simulation_engine(tmp_path, digits):
    pytest.importorskip(
        "ray", reason="the example runs Flower's simulation engine: pip install 'flwr[simulation]'"
    )
    script = Path(__file__).resolve().parents[1] / "examples" / "flower_digits.py"
    saved = tmp_path / "global.onnx"
    run = subprocess.run(
        [sys.executable, str(script), "--rounds", "5", "--save", str(saved)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)%", run.stdout, flags=re.MULTILINE)
    accuracy = [float(value) / 100 for _, value in rows]
    assert [int(r) for r, _ in rows] == list(range(6)), run.stdout
    assert max(accuracy) > 0.9, run.stdout

    _, (x_test, y_test) = digits
    session = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x_test})
    assert np.mean(logits.argmax(axis=1) == y_test) == pytest.approx(accuracy[-1], abs=1e-4)
