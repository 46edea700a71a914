"""The ``traingraph`` command end to end, in subprocesses, each in a fresh temp directory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from torch_models import MLP, classification_data, export, seeded
from traingraph.checkpoint import load_checkpoint_data

TIMEOUT = 120


def traingraph(*args: str, cwd, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m traingraph ARGS`` in ``cwd``; with ``check``, require exit code 0."""
    result = subprocess.run(
        [sys.executable, "-m", "traingraph", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def assert_clean_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """A non-zero exit code and one ``error:`` line naming ``words``, no traceback."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_demo_trains_above_95_percent_and_fills_the_run_folder(tmp_path):
    result = traingraph("train", "--out", "run", cwd=tmp_path)
    run = tmp_path / "run"
    assert "Final validation accuracy" in result.stdout
    accuracy = float(result.stdout.split("Final validation accuracy: ")[1].split("%")[0])
    assert accuracy > 95.0
    for name in ("run.json", "checkpoint", "model.onnx", "metrics.json", "metrics.csv",
                 "metrics.png", "artifacts/training_model.onnx", "artifacts/eval_model.onnx",
                 "artifacts/optimizer_model.onnx", "artifacts/checkpoint"):  # fmt: skip
        assert (run / name).is_file(), name
    history = json.loads((run / "metrics.json").read_text())
    assert [row["epoch"] for row in history] == list(range(1, 11))
    assert history[-1]["val_accuracy"] == pytest.approx(accuracy / 100, abs=1e-4)
    assert "\x1b[" not in result.stdout  # no progress bar when stdout is not a terminal

    import onnxruntime as ort

    from traingraph.datasets import load_digits

    x, y = load_digits("test")
    session = ort.InferenceSession(run / "model.onnx", providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x})
    assert np.mean(np.argmax(logits, axis=1) == y) == pytest.approx(accuracy / 100, abs=1e-4)

    evaluated = traingraph("eval", "run", cwd=tmp_path)
    assert f"accuracy {accuracy / 100:.4f}" in evaluated.stdout
    exported = traingraph("export", "run", "--out", "digits.onnx", cwd=tmp_path)
    assert "digits.onnx" in exported.stdout and (tmp_path / "digits.onnx").is_file()
    info = traingraph("info", "run", cwd=tmp_path).stdout
    assert "optimizer: step 450" in info and "conv1.weight" in info


def test_bring_your_own_model(tmp_path):
    onnx.save(export(seeded(MLP), torch.zeros(2, 20)), tmp_path / "mlp.onnx")
    x, y = classification_data(200, 20, 5)
    np.savez(tmp_path / "train.npz", x=x.astype(np.float64), y=y)

    made = traingraph("artifacts", "mlp.onnx", "--optimizer", "sgd", "--lr", "0.1", "--out",
                      "art", cwd=tmp_path)  # fmt: skip
    assert "training_model.onnx" in made.stdout
    result = traingraph("train", "art", "--data", "train.npz", "--epochs", "3", "--out", "run",
                        "--val-fraction", "0.2", cwd=tmp_path)  # fmt: skip
    assert "epoch 3/3" in result.stdout and "val_accuracy" in result.stdout
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert history[-1]["loss"] < history[0]["loss"]
    assert all(row["lr"] == pytest.approx(0.1) for row in history)
    assert (tmp_path / "run" / "model.onnx").is_file()

    direct = traingraph("train", "mlp.onnx", "--data", "train.npz", "--epochs", "1",
                        "--scheduler", "linear", "--out", "run2", cwd=tmp_path)  # fmt: skip
    assert "epoch 1/1" in direct.stdout
    evaluated = traingraph("eval", "run2/artifacts", "--checkpoint", "run2/checkpoint",
                           "--data", "train.npz", cwd=tmp_path)  # fmt: skip
    assert "loss" in evaluated.stdout and "(200 samples)" in evaluated.stdout


def test_info_names_the_node_without_a_gradient_rule(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Hardmax", ["x"], ["y"], name="the_hardmax")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    info = traingraph("info", "m.onnx", cwd=tmp_path).stdout
    assert "opset ai.onnx 17" in info and "x float32 [batch, 3]" in info
    assert "op Hardmax at node 'the_hardmax'" in info


def test_ctrl_c_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path):
    args = ("train", "--epochs", "3", "--batch-size", "8")
    reference = subprocess.Popen(
        [sys.executable, "-m", "traingraph", *args, "--out", "reference"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
    )
    interrupted = subprocess.Popen(
        [sys.executable, "-m", "traingraph", *args, "--out", "run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert interrupted.stdout is not None
    for line in interrupted.stdout:
        if line.startswith("epoch 1/"):
            interrupted.send_signal(signal.SIGINT)
            break
    out, err = interrupted.communicate(timeout=TIMEOUT)
    assert interrupted.returncode == 130, out + err
    assert "Traceback" not in err
    assert "traingraph train --resume run" in out
    position = load_checkpoint_data(tmp_path / "run" / "checkpoint").properties
    assert position["epoch"] in (1, 2) and position["global_step"] > 0

    resumed = traingraph("train", "--resume", "run", cwd=tmp_path)
    assert "Resuming" in resumed.stdout
    assert reference.wait(timeout=TIMEOUT) == 0
    a = load_checkpoint_data(tmp_path / "run" / "checkpoint")
    b = load_checkpoint_data(tmp_path / "reference" / "checkpoint")
    assert a.optimizer_step == b.optimizer_step == 3 * 180
    for name, value in b.parameters.items():
        np.testing.assert_array_equal(a.parameters[name], value, err_msg=name)
    for slot in b.optimizer_state:
        for kind, value in b.optimizer_state[slot].items():
            np.testing.assert_array_equal(a.optimizer_state[slot][kind], value)
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in
             json.loads((tmp_path / "reference" / "metrics.json").read_text())]  # fmt: skip
    got = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in got] == strip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("train", "missing.onnx"), ["missing.onnx", "does not exist"]),
        (("train", "--epochs", "0"), ["--epochs"]),
        (("train", "--scheduler", "wobbly"), ["--scheduler", "wobbly"]),
        (("train", "--device", "tpu"), ["unknown device 'tpu'"]),
        (("train", "bad.onnx", "--data", "data.npz"), ["bad.onnx", "not a readable ONNX model"]),
        (("train", "good.onnx"), ["--data"]),
        (("train", "good.onnx", "--data", "bad.onnx"), ["bad.onnx", "npz"]),
        (("train", "good.onnx", "--data", "data.npz"), ["holds the arrays ['a']", "'x'"]),
        (("train", "--resume", "."), ["not a run folder"]),
        (("info", "bad.onnx"), ["bad.onnx", "not a readable ONNX model"]),
        (("info", "data.npz"), ["data.npz", "neither a checkpoint nor"]),
        (("eval", "."), ["not a complete artifacts directory"]),
        (("export", "nowhere"), ["nowhere", "does not exist"]),
        (("artifacts", "good.onnx", "--loss", "Nope"), ["--loss", "Nope"]),
        (("frobnicate",), ["No such command 'frobnicate'"]),
    ],
)
def test_bad_arguments_and_files_give_one_clean_line(tmp_path, args, words):
    (tmp_path / "bad.onnx").write_bytes(b"definitely not protobuf")
    onnx.save(export(seeded(MLP), torch.zeros(2, 20)), tmp_path / "good.onnx")
    np.savez(tmp_path / "data.npz", a=np.zeros(3))
    result = traingraph(*args, cwd=tmp_path, check=False)
    assert_clean_error(result, *words)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_help_describes_every_command(tmp_path):
    top = traingraph("--help", cwd=tmp_path).stdout
    for command in ("artifacts", "train", "eval", "export", "info", "bench"):
        assert command in top
        text = traingraph(command, "--help", cwd=tmp_path).stdout
        assert "Usage: traingraph " + command in text
    assert "--resume RUN_DIR" in traingraph("train", "--help", cwd=tmp_path).stdout
