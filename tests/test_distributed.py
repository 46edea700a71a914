"""Data-parallel training (traingraph.distributed): two processes with gloo train the demo CNN
(api.Module / Optimizer through fit, with a checkpoint resumed by both) and an MLP (graph
API); after every step their parameters are identical and equal those of one process trained
on the same global batches. A process that dies makes the other fail with a clear error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed", reason="traingraph.distributed needs torch")

import distributed_worker as worker
from traingraph import distributed, optim
from traingraph.distributed import cuda_graph

WORKER = Path(worker.__file__)
RTOL, ATOL = 1e-5, 1e-7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _logs(outputs: list[str]) -> str:
    """Every rank's output (its last lines): a rank's failure often shows first in another's."""
    return "\n".join(f"--- rank {r} ---\n{out[-3000:]}" for r, out in enumerate(outputs))


def rank_results(folder: Path, outputs: list[str]) -> list[dict[str, np.ndarray]]:
    """The arrays each rank saved, or a failure showing every rank's output."""
    ranks = []
    for rank in range(len(outputs)):
        path = folder / f"rank{rank}.npz"
        assert path.is_file(), f"rank {rank} failed:\n{_logs(outputs)}"
        ranks.append(dict(np.load(path)))
    return ranks


def launch(folder: Path, world: int = 2, timeout: float = 240) -> list[str]:
    """Run the worker in ``world`` processes with torchrun's environment; returns each
    process's output."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
    }
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(folder)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append(out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distributed")
    worker.make_demo_artifacts(folder / "demo")
    initial = worker.mlp_graph().get_parameters()
    np.savez(folder / "mlp_initial.npz", **initial)
    outputs = launch(folder)
    ranks = rank_results(folder, outputs)
    return folder, initial, ranks, outputs


def _differences(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    absolute = np.abs(got.astype(np.float64) - expected)
    relative = absolute / np.maximum(np.abs(expected), 1e-3)
    return float(absolute.max()), float(relative.max())


def test_demo_matches_one_process(trained):
    folder, _, ranks, _ = trained
    single, history = worker.train_demo(folder / "demo", 2)
    assert single.shape[0] == 8  # 2 epochs of 4 global batches
    for rank in ranks:
        # identical replicas: the same average applied to the same parameters
        np.testing.assert_array_equal(rank["demo"], ranks[0]["demo"])
    np.testing.assert_allclose(ranks[0]["demo"], single, rtol=RTOL, atol=ATOL)
    assert np.abs(single[-1] - single[0]).max() > 1e-2  # it trained
    got = json.loads(str(ranks[0]["history"]))
    for row, expected in zip(got, history, strict=True):
        for key in ("loss", "val_loss"):
            assert row[key] == pytest.approx(expected[key], rel=1e-5), key


def test_checkpoint_of_rank_zero_resumes_on_every_rank(trained):
    folder, _, ranks, _ = trained
    assert (folder / "ckpt").is_file()
    single, _ = worker.train_demo(folder / "demo", 3)
    for rank in ranks:
        np.testing.assert_array_equal(rank["resumed"], ranks[0]["resumed"])
    assert ranks[0]["resumed"].shape[0] == 4  # the third epoch
    np.testing.assert_allclose(ranks[0]["resumed"], single[8:], rtol=RTOL, atol=ATOL)


def test_graph_api_mlp_matches_one_process(trained):
    _, initial, ranks, _ = trained
    single = worker.train_mlp(initial)
    for rank in ranks:  # rank 1 started from other parameters: rank 0's were broadcast
        np.testing.assert_array_equal(rank["mlp"], ranks[0]["mlp"])
    np.testing.assert_allclose(ranks[0]["mlp"], single, rtol=RTOL, atol=ATOL)


def test_accumulated_uneven_micro_batches_match_one_process(trained):
    folder, _, ranks, _ = trained
    single = worker.train_accumulated(folder / "demo")
    assert single.shape[0] == len(worker.ACCUMULATION)
    for rank in ranks:
        np.testing.assert_array_equal(rank["accumulated"], ranks[0]["accumulated"])
    # every micro-batch weighs by its own split (4/9, 3/7, 0/1, ...), rank 0's last step has
    # no sample at all, and the update is the one of the whole micro-batches in one process
    np.testing.assert_allclose(ranks[0]["accumulated"], single, rtol=RTOL, atol=ATOL)
    assert np.abs(np.diff(single, axis=0)).max(axis=1).min() > 1e-4  # every step trained


def _shares(size: int, world: int = 2) -> np.ndarray:
    """Each rank's share of a batch of ``size`` (the contiguous split of DataParallel.shard)."""
    return np.array([size * (r + 1) // world - size * r // world for r in range(world)]) / size


def test_batchnorm_statistics_are_averaged_over_the_processes(trained):
    _, _, ranks, _ = trained
    single = worker.train_batchnorm()
    names = sorted(k for k in single if k.startswith("after:"))
    assert len(names) == 2  # running mean and variance
    shares = np.stack([_shares(n) for n in worker.BN_BATCHES])  # [step, rank]
    for name in names:
        local = name.replace("after:", "local:")
        for rank in ranks:  # identical replicas after every step
            np.testing.assert_array_equal(rank[f"bn.{name}"], ranks[0][f"bn.{name}"])
        # each step's statistics: the ranks' own, weighted by their share of the batch
        own = np.stack([rank[f"bn.{local}"].astype(np.float64) for rank in ranks], axis=1)
        expected = np.einsum("sr,sr...->s...", shares, own)
        np.testing.assert_allclose(ranks[0][f"bn.{name}"], expected, rtol=1e-6, atol=1e-7)
        assert np.abs(own[:, 0] - own[:, 1]).max() > 1e-2  # the shards' statistics differ
    # the first layer's running mean is linear in its batches' means: one process's
    mean = next(n for n in names if "mean" in n)
    np.testing.assert_allclose(ranks[0][f"bn.{mean}"], single[mean], rtol=RTOL, atol=1e-6)


def test_a_dead_process_stops_the_others_with_an_error(trained):
    folder, _, _, outputs = trained
    error = folder / "error.txt"
    assert error.is_file(), f"rank 0 got no DistributedError:\n{outputs[0][-3000:]}"
    seconds, message = error.read_text().split("\n", 1)
    assert float(seconds) < worker.TIMEOUT.total_seconds()  # not a hang until the timeout
    assert "rank 0 of 2" in message and "average the gradients of step 3" in message
    assert "Another process probably stopped" in message


def test_processes_agree_on_nonfinite_losses_small_batches_and_failures(trained):
    folder = trained[0]
    errors = [(folder / f"agreed{r}.txt").read_text().splitlines() for r in range(2)]
    for rank, (nonfinite, small, prepared) in enumerate(errors):
        assert small.startswith("steps 1, batches 0: a batch of 1 samples was skipped"), small
        # rank 1's shard had the NaN: both stop before the update of the same batch
        assert nonfinite.startswith("NonFiniteLossError: training stopped at epoch 1, batch 2")
        expected = "OSError: no space left" if rank == 0 else "DistributedError: rank 1"
        assert prepared.startswith(expected), prepared
    assert "rank 0 failed to prepare the run" in errors[1][2]


def test_shard_splits_batches_and_weights(monkeypatch):
    x, y = np.arange(10).reshape(5, 2), np.arange(5)
    parts = [distributed._split((x, y), r, 2, allow_empty=False) for r in range(2)]
    assert [p[1:] for p in parts] == [(2, 5), (3, 5)]
    np.testing.assert_array_equal(np.concatenate([p[0][0] for p in parts]), x)
    named, count, _ = distributed._split({"x": x, "scale": np.float32(2)}, 1, 2, False)
    assert count == 3 and named["scale"] == 2 and named["x"].shape == (3, 2)
    with pytest.raises(distributed.ModelError, match="cannot be split over 8 processes"):
        distributed._split((x, y), 0, 8, allow_empty=False)
    assert distributed._split((x, y), 0, 8, allow_empty=True)[1] == 0


def test_environment_detection(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched() and distributed.world_size() == 1
    assert distributed.local_device("cuda") == "cuda"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.launched() and distributed.rank() == 1
    assert distributed.world_size() == 4
    monkeypatch.setattr(distributed, "_cuda_device_count", lambda: 8)
    assert distributed.local_device("cuda") == "cuda:3"
    monkeypatch.setattr(distributed, "_cuda_device_count", lambda: 2)
    assert distributed.local_device("cuda") == "cuda:1"  # four processes share two GPUs
    assert distributed.local_device("cpu") == "cpu"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(distributed.DistributedError, match="MASTER_ADDR"):
        distributed.init_process_group()


class _Replica:
    """What AgreedFinite calls: a DataParallel whose average reports ``agreed``."""

    def __init__(self, agreed: bool) -> None:
        self.agreed = agreed
        self.calls: list[tuple[object, bool]] = []

    def average_gradients(self, grads: object, finite: bool) -> bool:
        self.calls.append((grads, finite))
        return self.agreed and finite


def test_cuda_graph_steps_read_the_agreed_finite_flag():
    """A data-parallel CUDA-graph step with a loss scaler reads grads_finite through
    AgreedFinite: the read averages the gradients with this process's flag and gives the
    loss scaler the processes' verdict (the two-process run is the GPU test below)."""
    from traingraph.precision import GRADS_FINITE
    from traingraph.runtime.device import parse_device
    from traingraph.runtime.tensors import TensorStore

    flag = TensorStore(parse_device("cpu"), {GRADS_FINITE: ((), np.dtype(np.bool_))})
    grads = object()
    for local in (True, False):
        for agreed in (True, False):
            flag.write(GRADS_FINITE, np.array(local))
            replica = _Replica(agreed)
            wrapped = cuda_graph.AgreedFinite(flag, replica, lambda: grads)
            assert bool(wrapped.read(GRADS_FINITE)) is (local and agreed)
            assert replica.calls == [(grads, local)]  # one average per read, this flag
            assert wrapped.ortvalue(GRADS_FINITE) is flag.ortvalue(GRADS_FINITE)  # bound as is


@pytest.fixture(scope="module")
def gpu_trained(tmp_path_factory):
    """The worker on the GPU: NCCL where there are two GPUs; two processes sharing one GPU use
    gloo (NCCL takes one GPU per process), still on the device buffers."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a torch build with CUDA")
    folder = tmp_path_factory.mktemp("gpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINGRAPH_TEST_DEVICE", "cuda")
        if torch.cuda.device_count() < 2:
            patch.setenv("TRAINGRAPH_TEST_BACKEND", "gloo")
        patch.setattr(worker, "DEVICE", "cuda")
        worker.make_demo_artifacts(folder / "demo")
        worker.make_demo_artifacts(
            folder / "demo16", optimizer=optim.SGD(lr=0.1), mixed_precision="fp16"
        )
        initial = worker.mlp_graph().get_parameters()
        np.savez(folder / "mlp_initial.npz", **initial)
        outputs = launch(folder)
        yield folder, initial, rank_results(folder, outputs)


@pytest.mark.gpu
def test_two_processes_on_the_gpu_match_one(gpu_trained, monkeypatch):
    folder, initial, ranks = gpu_trained
    monkeypatch.setattr(worker, "DEVICE", "cuda")
    single, _ = worker.train_demo(folder / "demo", 2)
    for key in ("demo", "mlp", "accumulated", "cuda_graph"):
        np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=key)
    np.testing.assert_allclose(ranks[0]["demo"], single, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ranks[0]["mlp"], worker.train_mlp(initial), rtol=1e-4, atol=1e-6)
    accumulated = worker.train_accumulated(folder / "demo")
    np.testing.assert_allclose(ranks[0]["accumulated"], accumulated, rtol=1e-4, atol=1e-6)
    captured = worker.train_demo_cuda_graph(folder / "demo")
    np.testing.assert_allclose(ranks[0]["cuda_graph"], captured, rtol=1e-4, atol=1e-6)
    # the averaged update is the optimizer's CUDA kernel where it compiles (NVRTC)
    from traingraph.runtime.cuda import kernels

    compiled = kernels.load("optimizer.cu", 0) is not None
    assert str(ranks[0]["cuda_graph_update"]) == ("kernel" if compiled else "graph")


@pytest.mark.gpu
def test_fp16_cuda_graph_steps_skip_together(gpu_trained, monkeypatch):
    """fp16 with a loss scaler in the data-parallel CUDA-graph step: the second batch
    overflows in rank 1's part only, and both processes skip that update and halve their loss
    scale, as one process does on the whole batch (the scale also falls wherever the
    gradients overflow it, which the processes agree on too)."""
    folder, _, ranks = gpu_trained
    monkeypatch.setattr(worker, "DEVICE", "cuda")
    single, scales = worker.train_fp16_cuda_graph(folder / "demo16")
    assert scales[1] == scales[0] / 2 and scales[-1] == scales[1]
    np.testing.assert_array_equal(single[1], single[0])  # one process skips the update
    for rank in ranks:
        np.testing.assert_array_equal(rank["fp16_scales"], scales)
        np.testing.assert_array_equal(rank["fp16"], ranks[0]["fp16"])
    np.testing.assert_array_equal(ranks[0]["fp16"][1], ranks[0]["fp16"][0])
    # float16 products of a part and of the whole batch round apart (2e-4 at most on an
    # H100, where the parameters move by up to 0.17): SGD keeps that small
    np.testing.assert_allclose(ranks[0]["fp16"], single, rtol=1e-3, atol=1e-3)
    assert np.abs(single[-1] - single[0]).max() > 1e-2  # it trained


@pytest.mark.slow
def test_torchrun_trains_the_demo_from_the_command_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "traingraph", "train", "--epochs", "1", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("epoch 1/1") == 1  # rank 0 reports
    assert "in 2 processes" in done.stdout
    run = tmp_path / "run"
    assert {"checkpoint", "model.onnx", "metrics.json", "run.json"} <= {
        p.name for p in run.iterdir()
    }
    history = json.loads((run / "metrics.json").read_text())
    assert history[0]["val_accuracy"] > 0.5
