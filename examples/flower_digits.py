"""Federated learning on the embedded digits: 5 Flower nodes, non-IID data, FedAvg.

Run: python examples/flower_digits.py [--rounds 6] [--nodes 5] [--alpha 0.5] [--save global.onnx]

Needs Flower's simulation engine: pip install "traingraph[flower]" "flwr[simulation]".

The demo CNN's artifacts are generated once; each simulated node holds a label-skewed share of
the training digits (a Dirichlet(alpha) share of each class), keeps a fifth of it for its own
validation, and trains its share with traingraph's Module and Optimizer. The server averages
the nodes' parameter buffers with FedAvg and evaluates the global model on the held-out test
digits after every round.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Result
from flwr.simulation import run_simulation

from traingraph import artifacts, flower
from traingraph.datasets import load_digits
from traingraph.demo import OUTPUT_NAME, digits_cnn


def main(
    rounds: int, nodes: int, local_epochs: int, alpha: float, lr: float, batch_size: int, out: Path
) -> Result:
    """Runs the simulation and returns FedAvg's result (metrics per round)."""
    artifacts.generate_artifacts(
        digits_cnn(seed=0),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        additional_output_names=[OUTPUT_NAME],
        artifact_directory=out,
    )
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    partitions = flower.dirichlet_partition(y_train, nodes, alpha=alpha, seed=0)
    for i, part in enumerate(partitions):
        counts = np.bincount(y_train[part], minlength=10)
        print(f"node {i}: {part.size:4d} digits, per class {counts.tolist()}")

    def client_fn(context: Context) -> flower.ArtifactClient:
        node = int(context.node_config["partition-id"])
        part = partitions[node]
        cut = part.size * 4 // 5
        return flower.ArtifactClient(
            out,
            train=(x_train[part[:cut]], y_train[part[:cut]]),
            validation=(x_train[part[cut:]], y_train[part[cut:]]),
            local_epochs=local_epochs,
            learning_rate=lr,
            batch_size=batch_size,
            score_output=OUTPUT_NAME,
            seed=node,
        )

    results: list[Result] = []
    server_app = ServerApp()

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        strategy = FedAvg(min_available_nodes=nodes, min_train_nodes=nodes)
        evaluator = flower.ArtifactClient(
            out, validation=(x_test, y_test), score_output=OUTPUT_NAME
        )
        results.append(
            strategy.start(
                grid=grid,
                initial_arrays=flower.initial_arrays(out),
                num_rounds=rounds,
                train_config=ConfigRecord({"local-epochs": local_epochs}),
                evaluate_fn=flower.evaluate_fn(evaluator),
            )
        )

    run_simulation(
        server_app=server_app,
        client_app=flower.client_app(client_fn),
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return results[0]


def report(result: Result) -> None:
    """Prints the accuracy per round: the test digits (server) and the nodes' own validation."""
    print("round  test accuracy  test loss  nodes' validation accuracy  train loss")
    for rnd, metrics in sorted(result.evaluate_metrics_serverapp.items()):
        nodes = result.evaluate_metrics_clientapp.get(rnd, {})
        train = result.train_metrics_clientapp.get(rnd, {})
        node_acc = f"{nodes['eval_acc']:.2%}" if "eval_acc" in nodes else "-"
        train_loss = f"{train['train_loss']:.4f}" if "train_loss" in train else "-"
        print(
            f"{rnd:5d}  {metrics['accuracy']:13.2%}  {metrics['loss']:9.4f}"
            f"  {node_acc:>26}  {train_loss:>10}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--save", type=Path, help="Write the global model here (.onnx)")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        result = main(
            args.rounds, args.nodes, args.local_epochs, args.alpha, args.lr, args.batch_size,
            Path(tmp),
        )  # fmt: skip
        report(result)
        if args.save is not None:
            flower.save_inference_model(result.arrays, Path(tmp), args.save, [OUTPUT_NAME])
            print(f"global model written to {args.save}")
