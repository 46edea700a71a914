"""Makes the onnxruntime-training checkpoint fixtures of tests/checkpoint/test_checkpoint.py;
trains from one.

Run it with a Python that has onnxruntime-training 1.19.2 (it does not need traingraph):

    python tests/data/make_ort_checkpoints.py make tests/data
    python tests/data/make_ort_checkpoints.py train CHECKPOINT WORKDIR OUT.npz

``make`` builds a tiny MLP (4 -> 8 -> 3, ``fc2.bias`` frozen), generates AdamW and SGD training
artifacts with ``onnxruntime.training.artifacts.generate_artifacts``, trains a few steps and writes:

- ``ort_mlp_initial.ckpt``: the checkpoint that generate_artifacts writes;
- ``ort_mlp_nominal.ckpt``: the nominal checkpoint that generate_artifacts writes;
- ``ort_mlp_adamw.ckpt``: after 3 AdamW steps, with properties, ``include_optimizer_state=True``;
- ``ort_mlp_sgd.ckpt``: after 1 SGD step, ``include_optimizer_state=True``;
- ``ort_mlp_expected.npz`` / ``ort_mlp_expected.json``: what a reader must find in those files:
  parameters as onnxruntime-training reports them, and AdamW's first and second moments computed
  here with NumPy from the gradients onnxruntime-training reports.

``train`` loads CHECKPOINT with ``CheckpointState.load_checkpoint``, builds the AdamW ``Module`` and
``Optimizer`` (artifacts regenerated in WORKDIR), takes 2 more steps and saves the parameters it
loaded, the losses and the parameters after the steps to OUT.npz (keys ``loaded/<name>``,
``losses``, ``trained/<name>``) plus ``properties_json``, the loaded properties as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer

TRAINABLE = ["fc1.weight", "fc1.bias", "fc2.weight"]
FROZEN = ["fc2.bias"]
PROPERTIES = {"epoch": 3, "best_loss": 0.25, "run": "tiny-mlp"}
ADAMW_STEPS = 3
BETA1, BETA2 = 0.9, 0.999


def build_model() -> onnx.ModelProto:
    """A 4 -> 8 -> 3 MLP with fixed random weights (Gemm, Relu, Gemm; opset 17)."""
    rng = np.random.default_rng(0)
    shapes = {"fc1.weight": (8, 4), "fc1.bias": (8,), "fc2.weight": (3, 8), "fc2.bias": (3,)}
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
        for n, s in shapes.items()
    ]
    nodes = [
        helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["hidden"], transB=1),
        helper.make_node("Relu", ["hidden"], ["act"]),
        helper.make_node("Gemm", ["act", "fc2.weight", "fc2.bias"], ["output"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=5).astype(np.int64)
    return x, y


def generate(directory: Path, optimizer: artifacts.OptimType, nominal: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(
        build_model(),
        requires_grad=TRAINABLE,
        frozen_params=FROZEN,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optimizer,
        artifact_directory=str(directory),
        nominal_checkpoint=nominal,
    )


def make(out: Path) -> None:
    work = out / "_artifacts"
    generate(work / "adamw", artifacts.OptimType.AdamW, nominal=True)
    generate(work / "sgd", artifacts.OptimType.SGD)
    (out / "ort_mlp_initial.ckpt").write_bytes((work / "adamw" / "checkpoint").read_bytes())
    (out / "ort_mlp_nominal.ckpt").write_bytes(
        (work / "adamw" / "nominal_checkpoint").read_bytes()
    )

    state = CheckpointState.load_checkpoint(str(work / "adamw" / "checkpoint"))
    for name, value in PROPERTIES.items():
        state.properties[name] = value
    module = Module(str(work / "adamw" / "training_model.onnx"), state)
    optimizer = Optimizer(str(work / "adamw" / "optimizer_model.onnx"), module)
    module.train()
    m = {n: np.zeros_like(state.parameters[n].data) for n in TRAINABLE}
    v = {n: np.zeros_like(state.parameters[n].data) for n in TRAINABLE}
    for step in range(ADAMW_STEPS):
        module(*batch(step))
        for n in TRAINABLE:
            g = state.parameters[n].grad.astype(np.float64)
            m[n] = BETA1 * m[n] + (1 - BETA1) * g
            v[n] = BETA2 * v[n] + (1 - BETA2) * g * g
        optimizer.step()
        module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, str(out / "ort_mlp_adamw.ckpt"), True)

    expected = {f"param/{n}": state.parameters[n].data for n in TRAINABLE + FROZEN}
    expected.update({f"exp_avg/{n}": m[n].astype(np.float32) for n in TRAINABLE})
    expected.update({f"exp_avg_sq/{n}": v[n].astype(np.float32) for n in TRAINABLE})
    np.savez_compressed(out / "ort_mlp_expected.npz", **expected)
    info = {
        "trainable": TRAINABLE,
        "frozen": FROZEN,
        "adamw_step": ADAMW_STEPS,
        "learning_rate": 0.001,
        "properties": PROPERTIES,
    }
    (out / "ort_mlp_expected.json").write_text(json.dumps(info, indent=2) + "\n")

    sgd_state = CheckpointState.load_checkpoint(str(work / "sgd" / "checkpoint"))
    sgd_module = Module(str(work / "sgd" / "training_model.onnx"), sgd_state)
    sgd_optimizer = Optimizer(str(work / "sgd" / "optimizer_model.onnx"), sgd_module)
    sgd_module.train()
    sgd_module(*batch(0))
    sgd_optimizer.step()
    CheckpointState.save_checkpoint(sgd_state, str(out / "ort_mlp_sgd.ckpt"), True)

    for path in sorted(work.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    work.rmdir()


def train(checkpoint: Path, work: Path, out: Path) -> None:
    generate(work, artifacts.OptimType.AdamW)
    state = CheckpointState.load_checkpoint(str(checkpoint))
    names = TRAINABLE + FROZEN
    result = {f"loaded/{n}": state.parameters[n].data.copy() for n in names}
    properties = dict(iter(state.properties))  # iterating yields (name, value) pairs
    result["properties_json"] = np.array(json.dumps(properties))
    module = Module(str(work / "training_model.onnx"), state)
    optimizer = Optimizer(str(work / "optimizer_model.onnx"), module)
    module.train()
    losses = []
    for step in range(2):
        losses.append(float(module(*batch(10 + step))))
        optimizer.step()
        module.lazy_reset_grad()
    result["losses"] = np.array(losses)
    result.update({f"trained/{n}": state.parameters[n].data.copy() for n in names})
    np.savez(out, **result)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "make":
        make(Path(args[0]))
    elif command == "train":
        train(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        sys.exit(f"unknown command {command!r}; expected 'make' or 'train' (see the docstring)")
