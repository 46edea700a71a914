"""Bad input gets a traingraph error naming the file and the fix; nothing hangs; nothing is lost.

One test (or more) per kind of bad input: huge declared sizes, unreadable models, checkpoints
that do not fit the model or were edited, corrupt ``.npz`` data, misuse of the API (NaN losses,
an update before any step, bad labels, threads) and interrupted saves.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from fuzz.cases import CLASSES, Seeds, seed_data, seed_model
from traingraph import data as tg_data
from traingraph import losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.artifacts import generate_artifacts
from traingraph.checkpoint import (
    load_checkpoint_data,
    native,
    save_checkpoint_data,
)
from traingraph.cli import main as cli_main
from traingraph.errors import (
    CheckpointError,
    DataError,
    ModelError,
    NonFiniteLossError,
    SizeLimitError,
    TraingraphError,
    UsageError,
)
from traingraph.fit import ModelCheckpoint, Trainer, fit
from traingraph.limits import MAX_ELEMENTS_VARIABLE


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Seeds:
    return Seeds(tmp_path_factory.mktemp("seeds"))


def _module(seeds: Seeds, checkpoint: Path | None = None, **optimizer_options):
    state = CheckpointState.load_checkpoint(checkpoint or seeds.artifacts / "checkpoint")
    artifacts = seeds.artifacts
    module = Module(artifacts / "training_model.onnx", state, artifacts / "eval_model.onnx")
    optimizer = Optimizer(artifacts / "optimizer_model.onnx", module, **optimizer_options)
    return state, module, optimizer


def _batch(n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    d = seed_data()
    return d["x"][:n].copy(), d["y"][:n].copy()


# ------------------------------------------------------------------ 1. huge declared sizes
@pytest.mark.parametrize("where", ["initializer", "input"])
def test_huge_declared_dimension_is_refused_before_shape_inference(tmp_path, where):
    model = seed_model()
    if where == "initializer":
        model.graph.initializer[0].dims[0] = 2**40
    else:
        dims = model.graph.input[0].type.tensor_type.shape.dim
        dims[1].dim_value = 2**40
    path = tmp_path / "huge.onnx"
    onnx.save(model, path)
    with pytest.raises(SizeLimitError, match=MAX_ELEMENTS_VARIABLE) as info:
        generate_artifacts(str(path), loss="CrossEntropyLoss", optimizer="AdamW",
                           artifact_directory=str(tmp_path / "out"))  # fmt: skip
    assert "huge.onnx" in str(info.value)


_GENERATE_CAPPED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
from traingraph.artifacts import generate_artifacts
generate_artifacts(sys.argv[1], loss="CrossEntropyLoss", optimizer="AdamW",
                   artifact_directory=sys.argv[2])
"""


def test_a_static_dimension_of_2_24_does_not_blow_up_shape_inference(tmp_path):
    model = seed_model()
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2**24
    path = tmp_path / "wide.onnx"
    onnx.save(model, path)
    result = subprocess.run(
        [sys.executable, "-c", _GENERATE_CAPPED, str(path), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "training_model.onnx").is_file()


def test_initializer_holding_less_data_than_its_shape_is_a_model_error(tmp_path):
    model = seed_model()
    model.graph.initializer[0].dims[0] = 2**20  # 4 Mi elements declared, 32 held
    path = tmp_path / "short.onnx"
    onnx.save(model, path)
    with pytest.raises(ModelError, match="holds 128 bytes"):
        generate_artifacts(str(path), loss="CrossEntropyLoss", artifact_directory=str(tmp_path))


def test_the_size_limit_is_raised_by_an_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(seed_model(), path)
    monkeypatch.setenv(MAX_ELEMENTS_VARIABLE, "16")
    with pytest.raises(SizeLimitError, match="fc1.weight"):
        generate_artifacts(str(path), loss="CrossEntropyLoss", artifact_directory=str(tmp_path))
    monkeypatch.setenv(MAX_ELEMENTS_VARIABLE, "64")
    generate_artifacts(str(path), loss="CrossEntropyLoss", artifact_directory=str(tmp_path))


def test_memory_error_in_shape_inference_is_not_hidden(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError

    path = tmp_path / "m.onnx"
    onnx.save(seed_model(), path)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", out_of_memory)
    with pytest.raises(SizeLimitError, match="ran out of memory"):
        generate_artifacts(str(path), loss="CrossEntropyLoss", artifact_directory=str(tmp_path))


# ---------------------------------------------------------------- 2. unreadable models
@pytest.mark.parametrize("content", [b"\xff\xfe not protobuf \x00" * 5, "ünï".encode("latin-1")])
def test_module_reports_an_unreadable_training_model_naming_the_file(seeds, tmp_path, content):
    artifacts = tmp_path / "artifacts"
    shutil.copytree(seeds.artifacts, artifacts)
    (artifacts / "training_model.onnx").write_bytes(content)
    state = CheckpointState.load_checkpoint(artifacts / "checkpoint")
    with pytest.raises(ModelError, match="training_model.onnx") as info:
        Module(artifacts / "training_model.onnx", state)
    assert "generate the artifacts again" in str(info.value)


def test_module_reports_an_onnxruntime_failure_as_a_model_error(seeds, tmp_path):
    model = onnx.load(seeds.artifacts / "training_model.onnx")
    model.graph.node[0].op_type = "NoSuchOp"
    path = tmp_path / "training_model.onnx"
    onnx.save(model, path)
    with pytest.raises(ModelError, match="training_model.onnx"):
        Module(path, CheckpointState.load_checkpoint(seeds.artifacts / "checkpoint"))


# --------------------------------------------------------- 3. checkpoints against the model
def _edited_checkpoint(seeds: Seeds, tmp_path: Path, edit) -> Path:
    data = load_checkpoint_data(seeds.artifacts / "checkpoint")
    edit(data)
    path = tmp_path / "edited.ckpt"
    save_checkpoint_data(data, path)
    return path


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.parameters.update({"fc1.weight": np.zeros((8, 5), np.float32)}),
         ["'fc1.weight' has shape [8, 5], the model takes [8, 4]"]),
        (lambda d: d.parameters.update({"fc2.bias": np.zeros(3, np.float64)}),
         ["'fc2.bias' is float64, the model takes float32"]),
    ],
)  # fmt: skip
def test_checkpoint_that_does_not_fit_the_model_lists_the_mismatches(seeds, tmp_path, edit, words):
    path = _edited_checkpoint(seeds, tmp_path, edit)
    with pytest.raises(CheckpointError, match="does not fit model") as info:
        _module(seeds, path)
    for word in words:
        assert word in str(info.value)


def _rewrite_native(path: Path, edit, *, fix_checksum: bool) -> None:
    """Edits a native checkpoint's metadata in place, recomputing its checksum or not."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    meta = json.loads(header["__metadata__"]["traingraph"])
    edit(meta)
    if fix_checksum:
        with native.safe_open(str(path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)
        meta["sha256"] = native.checksum(meta, tensors)
    header["__metadata__"]["traingraph"] = json.dumps(meta)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


def test_negative_step_is_refused(seeds, tmp_path):
    path = tmp_path / "c.ckpt"
    shutil.copy(seeds.native, path)
    _rewrite_native(path, lambda m: m.update(optimizer_step=-1), fix_checksum=True)
    with pytest.raises(CheckpointError, match="optimizer step -1"):
        CheckpointState.load_checkpoint(path)
    data = load_checkpoint_data(seeds.native)
    data.optimizer_step = -1
    with pytest.raises(ModelError, match="optimizer_step"):
        save_checkpoint_data(data, tmp_path / "d.ckpt", format="ort")


# ------------------------------------------------------------ 4. the native checksum covers all
def test_native_checksum_covers_the_metadata(seeds, tmp_path):
    path = tmp_path / "c.ckpt"
    shutil.copy(seeds.native, path)
    _rewrite_native(path, lambda m: m.update(learning_rate=123.0), fix_checksum=False)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint_data(path)


@pytest.mark.parametrize(
    ("spec", "error", "words"),
    [
        ({"dtype": "<f4", "shape": [2**40, 2**10]}, SizeLimitError, MAX_ELEMENTS_VARIABLE),
        ({"dtype": "|O", "shape": [2]}, ModelError, "dtype '|O'"),
    ],
)
def test_nominal_specs_are_checked_before_allocation(seeds, tmp_path, spec, error, words):
    path = tmp_path / "c.ckpt"
    shutil.copy(seeds.native, path)

    def nominal(meta):
        meta["nominal"] = True
        meta["parameter_specs"] = {name: spec for name in meta["parameters"]}

    _rewrite_native(path, nominal, fix_checksum=True)  # checksum right: a crafted file
    with pytest.raises(error, match=words.replace("|", r"\|")):
        load_checkpoint_data(path)


def test_version_1_native_checkpoints_still_load(seeds, tmp_path):
    path = tmp_path / "v1.ckpt"
    shutil.copy(seeds.native, path)
    with native.safe_open(str(path), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)

    def version_1(meta):
        meta["version"] = 1
        meta["sha256"] = native.payload_sha256(tensors)

    _rewrite_native(path, version_1, fix_checksum=False)
    old, new = load_checkpoint_data(path), load_checkpoint_data(seeds.native)
    for name, array in new.parameters.items():
        np.testing.assert_array_equal(old.parameters[name], array)


# -------------------------------------------------------------------------------- 5. .npz
def test_npz_of_random_bytes_is_a_data_error_that_does_not_suggest_pickle(tmp_path):
    path = tmp_path / "d.npz"
    path.write_bytes(np.random.default_rng(0).bytes(300))
    with pytest.raises(DataError, match="d.npz") as info:
        tg_data.load_npz(path)
    assert "pickle" not in str(info.value)


def _npz_with_header(path: Path, shape: tuple[int, ...], dtype: str) -> None:
    head = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        head, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", head.getvalue() + b"\0" * 64)


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "words"),
    [
        ((2**40, 2**10), "<f4", SizeLimitError, MAX_ELEMENTS_VARIABLE),
        ((4,), "|O", DataError, "Python objects"),
        ((1000,), "<f4", DataError, "4000 bytes"),
    ],
)
def test_npz_headers_are_checked_before_reading(tmp_path, shape, dtype, error, words):
    path = tmp_path / "d.npz"
    _npz_with_header(path, shape, dtype)
    with pytest.raises(error, match=words):
        tg_data.load_npz(path)


@pytest.mark.parametrize(
    "arrays", [(np.zeros((5, 2)), np.array(3)), (np.zeros((5, 2)), np.zeros(4))]
)
def test_split_arrays_refuses_arrays_without_a_shared_sample_dimension(arrays):
    with pytest.raises(DataError, match="share their first"):
        tg_data.split_arrays(arrays, 0.2)


# ---------------------------------------------------------------------------- 6. misuse
def test_nan_in_a_batch_raises_and_leaves_the_parameters_finite(seeds):
    state, module, optimizer = _module(seeds)
    x, y = _batch()
    x[0, 0] = np.nan
    module(x, y)
    with pytest.raises(NonFiniteLossError, match="nonfinite='skip'"):
        optimizer.step()
    module(*_batch())  # the next step starts afresh: its gradients are finite
    optimizer.step()
    for _, parameter in state.parameters:
        assert np.isfinite(parameter.data).all()


def test_nonfinite_skip_skips_the_update(seeds):
    state, module, optimizer = _module(seeds, nonfinite="skip")
    before = {n: p.data.copy() for n, p in state.parameters}
    x, y = _batch()
    x[1] = np.inf
    module(x, y)
    optimizer.step()
    for name, parameter in state.parameters:
        np.testing.assert_array_equal(parameter.data, before[name])


@pytest.fixture(scope="module")
def sqrt_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """out = Sqrt(x * w): a finite loss, and a NaN gradient of w wherever x is 0."""
    root = tmp_path_factory.mktemp("sqrt")
    w = onnx.numpy_helper.from_array(np.ones(2, np.float32), "w")
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Mul", ["x", "w"], ["xw"]),
            onnx.helper.make_node("Sqrt", ["xw"], ["out"]),
        ],
        "sqrt",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 2])],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["batch", 2])],
        [w],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save(model, root / "model.onnx")
    return root / "model.onnx"


@pytest.mark.parametrize(
    "optimizer",
    [optim.AdamW(lr=0.1, clip_grad_norm=1.0), optim.SGD(lr=0.1, max_grad_norm_per_tensor=1.0)],
)
@pytest.mark.parametrize("policy", ["raise", "skip", "apply"])
def test_a_nonfinite_gradient_norm_follows_the_nonfinite_policy(
    sqrt_model, tmp_path, optimizer, policy
):
    generate_artifacts(str(sqrt_model), loss="MSELoss", optimizer=optimizer,
                       artifact_directory=str(tmp_path))  # fmt: skip
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module, nonfinite=policy)
    target = np.full((2, 2), 3.0, np.float32)
    x = np.array([[0.0, 1.0], [2.0, 1.0]], np.float32)
    loss = module(x, target)
    assert np.isfinite(loss) and not np.isfinite(state.parameters["w"].grad).all()
    if policy == "raise":
        with pytest.raises(NonFiniteLossError, match="gradient clipping.*nonfinite='skip'"):
            opt.step()
    else:
        opt.step()
    w = state.parameters["w"].data
    if policy == "apply":  # as onnxruntime-training: clipping by a NaN norm makes w NaN
        assert np.isnan(w).any()
        return
    np.testing.assert_array_equal(w, np.ones(2, np.float32))
    module.lazy_reset_grad()
    module(x + 1.0, target)  # the next step starts afresh: its gradients are finite
    opt.step()
    assert np.isfinite(state.parameters["w"].data).all()
    assert not np.array_equal(state.parameters["w"].data, np.ones(2, np.float32))


def test_optimizer_step_before_any_train_step_raises(seeds):
    state, _, optimizer = _module(seeds)
    before = {n: p.data.copy() for n, p in state.parameters}
    with pytest.raises(UsageError, match="before any train step"):
        optimizer.step()
    for name, parameter in state.parameters:
        np.testing.assert_array_equal(parameter.data, before[name])


@pytest.mark.parametrize("label", [CLASSES, CLASSES + 4, -1])
def test_module_names_labels_out_of_range_before_the_step(seeds, label):
    _, module, optimizer = _module(seeds)
    x, y = _batch()
    y[2] = label
    expected = rf"labels 'labels' hold 1 class index\(es\) out of range \(values {label}\);"
    with pytest.raises(DataError, match=expected + rf" expected \[0, {CLASSES}\)"):
        module(x, y)
    with pytest.raises(UsageError, match="before any train step"):  # no step ran
        optimizer.step()
    module.eval()
    with pytest.raises(DataError, match=expected):
        module(x, y)


@pytest.mark.parametrize("label", [CLASSES, CLASSES + 4, -1])
def test_fit_loop_refuses_labels_out_of_range_before_the_step(seeds, label):
    trainer = Trainer.from_artifacts(seeds.artifacts)
    assert trainer.class_labels == {"labels": losses.ClassLabels(CLASSES, -100)}
    before = {n: p.data.copy() for n, p in trainer.state.parameters}
    x, y = _batch()
    y[2] = label
    expected = rf"labels 'labels' hold 1 class index\(es\) out of range \(values {label}\);"
    with pytest.raises(DataError, match=expected + rf" expected \[0, {CLASSES}\)"):
        trainer.train_step((x, y))
    with pytest.raises(DataError, match=expected):
        trainer.eval_step({"x": x, "labels": y})
    for name, parameter in trainer.state.parameters:
        np.testing.assert_array_equal(parameter.data, before[name])


def test_fit_loop_lets_the_ignore_index_through(seeds):
    trainer = Trainer.from_artifacts(seeds.artifacts)
    x, y = _batch()
    y[:4] = -100
    loss = trainer.train_step((x, y))[0]
    assert np.isfinite(loss)


@pytest.mark.parametrize(
    ("loss", "classes", "ignore"),
    [
        (losses.CrossEntropyLoss(ignore_index=7), CLASSES, 7),
        (losses.NLLLoss(), CLASSES, -100),
    ],
)
def test_class_label_losses_tag_their_labels(tmp_path, loss, classes, ignore):
    model = tmp_path / "model.onnx"
    onnx.save(seed_model(), model)
    generate_artifacts(str(model), loss=loss, optimizer="SGD", artifact_directory=str(tmp_path))
    for name in ("training_model.onnx", "eval_model.onnx"):
        found = losses.class_labels(onnx.load(tmp_path / name))
        assert found == {"labels": losses.ClassLabels(classes, ignore)}


def test_class_labels_without_a_static_class_count_check_the_sign():
    labels = losses.ClassLabels(None, -100)
    labels.check("y", np.array([0, 5, 10**6, -100]))
    with pytest.raises(DataError, match=r"values -3, -2\); expected indices >= 0"):
        labels.check("y", np.array([1, -3, -2, -100]))


def test_batch_size_mismatch_is_named_before_onnxruntime_runs(seeds):
    _, module, _ = _module(seeds)
    x, y = _batch()
    with pytest.raises(ModelError, match="'labels' has 'batch' dimension 7, but input 'x' has 8"):
        module(x, y[:7])


def test_one_module_called_from_four_threads_gives_the_sequential_result(seeds):
    _, module, _ = _module(seeds)
    x, y = _batch()
    expected = float(module(x, y))
    results: list[object] = []

    def work() -> None:
        for _ in range(5):
            try:
                results.append(float(module(x, y)))
            except Exception as exc:  # collected and asserted below
                results.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 20


def test_optimizer_refuses_the_eval_model_at_construction(seeds):
    state = CheckpointState.load_checkpoint(seeds.artifacts / "checkpoint")
    module = Module(seeds.artifacts / "training_model.onnx", state)
    with pytest.raises(ModelError, match="is not an optimizer model"):
        Optimizer(seeds.artifacts / "eval_model.onnx", module)


def test_fit_stops_at_a_nan_loss_and_keeps_the_last_good_checkpoint(seeds, tmp_path):
    trainer = Trainer.from_artifacts(seeds.artifacts)
    x, y = _batch(24)
    x[20] = np.nan  # the third batch of 8
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 24, 8)]
    path = tmp_path / "ckpt"
    with pytest.raises(NonFiniteLossError, match="epoch 1, batch 3"):
        fit(trainer, batches, epochs=1, callbacks=[ModelCheckpoint(path, every_n_steps=1)],
            progress=False)  # fmt: skip
    saved = load_checkpoint_data(path)
    assert saved.properties["global_step"] == 2
    for name, array in saved.parameters.items():
        assert np.isfinite(array).all()
        np.testing.assert_array_equal(array, trainer.state.parameters[name].data)


# --------------------------------------------------------------- 7. the error types themselves
def test_own_errors_are_traingraph_errors_and_keep_their_builtin_types(seeds):
    with pytest.raises(TraingraphError) as info:
        losses.HuberLoss(delta=-1.0)
    assert isinstance(info.value, ValueError)
    _, _, optimizer = _module(seeds)
    with pytest.raises(TraingraphError) as info:
        optimizer.set_learning_rate(-1.0)
    assert isinstance(info.value, ValueError)
    state = CheckpointState.load_checkpoint(seeds.artifacts / "checkpoint")
    with pytest.raises(TraingraphError) as info:
        state.properties["x"] = [1, 2]
    assert isinstance(info.value, TypeError)


def _cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    assert info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_cli_messages_name_the_problem(seeds, tmp_path, capsys):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert "is empty" in _cli_error(capsys, "info", str(empty))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _cli_error(capsys, "train", "--out", str(blocker / "run"), "--epochs", "1")
    assert "cannot create the run folder" in line
    line = _cli_error(capsys, "eval", str(tmp_path))
    assert "not a complete artifacts directory" in line and "optimizer" in line


def test_cli_resume_of_a_finished_run_says_so(seeds, tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        cli_main(["train", str(seeds.model), "--data", str(seeds.npz), "--epochs", "1",
                  "--batch-size", "8", "--out", str(run)])  # fmt: skip
    assert info.value.code == 0
    capsys.readouterr()
    assert "already finished its 1 epochs" in _cli_error(capsys, "train", "--resume", str(run))


# ------------------------------------------------------------------ 8. interrupted saves, modes
@pytest.mark.parametrize("format", ["native", "ort"])
def test_stale_temporary_files_are_removed_by_the_next_save(seeds, tmp_path, format):
    data = load_checkpoint_data(seeds.native)
    path = tmp_path / "ckpt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f".ckpt.{dead.stdout.strip()}.{'ab' * 16}.tmp"
    stale.write_bytes(b"partial")
    legacy = tmp_path / f".ckpt.{'cd' * 16}.tmp"
    legacy.write_bytes(b"partial")
    unrelated = tmp_path / ".other.tmp"
    unrelated.write_bytes(b"keep")
    save_checkpoint_data(data, path, format=format)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp", "ckpt"]


@pytest.mark.parametrize("format", ["native", "ort"])
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_file_modes_follow_the_umask(seeds, tmp_path, format, umask):
    data = load_checkpoint_data(seeds.native)
    old = os.umask(umask)
    try:
        save_checkpoint_data(data, tmp_path / "ckpt", format=format)
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o666 & ~umask


_SAVER = """
import sys
sys.path.insert(0, {tests!r})
from traingraph.checkpoint import load_checkpoint_data, save_checkpoint_data
data = load_checkpoint_data({source!r})
print("ready", flush=True)
while True:
    save_checkpoint_data(data, {target!r}, format={format!r})
"""


def _run_and_kill(code: str, delay: float) -> None:
    """Runs ``code`` in a new interpreter and SIGKILLs it ``delay`` seconds after it prints
    "ready"."""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    threading.Event().wait(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()


def _kill_during_saves(seeds: Seeds, tmp_path: Path, format: str, kills: int) -> None:
    """SIGKILLs a process that saves in a loop; the checkpoint must load after every kill."""
    target = tmp_path / "ckpt"
    code = _SAVER.format(tests=str(Path(__file__).parent), source=str(seeds.native),
                         target=str(target), format=format)  # fmt: skip
    rng = np.random.default_rng(0)
    expected = load_checkpoint_data(seeds.native)
    for _ in range(kills):
        _run_and_kill(code, float(rng.uniform(0.0, 0.05)))
        if target.exists():
            loaded = load_checkpoint_data(target)
            for name, array in expected.parameters.items():
                np.testing.assert_array_equal(loaded.parameters[name], array)
    save_checkpoint_data(expected, target, format=format)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("format", ["native", "ort"])
def test_sigkill_during_saves_loses_nothing(seeds, tmp_path, format):
    _kill_during_saves(seeds, tmp_path, format, kills=3)


@pytest.mark.slow
@pytest.mark.parametrize("format", ["native", "ort"])
def test_sigkill_during_saves_loses_nothing_100_times(seeds, tmp_path, format):
    _kill_during_saves(seeds, tmp_path, format, kills=100)


_FIT_SAVER = """
import sys
sys.path.insert(0, {tests!r})
from fuzz.cases import seed_data
from traingraph.fit import ModelCheckpoint, Trainer, fit
trainer = Trainer.from_artifacts({artifacts!r})
d = seed_data()
batches = [(d["x"][i : i + 8], d["y"][i : i + 8]) for i in range(0, 24, 8)]
print("ready", flush=True)
fit(trainer, batches, epochs=10**6, callbacks=[ModelCheckpoint({target!r}, every_n_steps=1)],
    progress=False)
"""


def _kill_during_fit(seeds: Seeds, tmp_path: Path, kills: int) -> None:
    """SIGKILLs a fit loop that saves after every step; its checkpoint must load every time."""
    target = tmp_path / "ckpt"
    code = _FIT_SAVER.format(tests=str(Path(__file__).parent), artifacts=str(seeds.artifacts),
                             target=str(target))  # fmt: skip
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(kills):
        _run_and_kill(code, float(rng.uniform(0.05, 0.3)))
        if target.exists():
            loaded = load_checkpoint_data(target)
            steps.append(loaded.properties["global_step"])
            assert all(np.isfinite(a).all() for a in loaded.parameters.values())
    assert steps, "no checkpoint was written before the kills"
    save_checkpoint_data(load_checkpoint_data(target), target)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_sigkill_during_fit_saves_loses_nothing(seeds, tmp_path):
    _kill_during_fit(seeds, tmp_path, kills=2)


@pytest.mark.slow
def test_sigkill_during_fit_saves_loses_nothing_100_times(seeds, tmp_path):
    _kill_during_fit(seeds, tmp_path, kills=100)


def test_module_infers_shapes_without_data_propagation_past_the_limit(tmp_path, monkeypatch):
    from traingraph.api import CheckpointState, Module

    model = seed_model()
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2**24
    path = tmp_path / "wide.onnx"
    onnx.save(model, path)
    generate_artifacts(str(path), loss="CrossEntropyLoss", artifact_directory=str(tmp_path))
    infer = onnx.shape_inference.infer_shapes
    propagated = []

    def recording(proto, *args, **kwargs):
        propagated.append(kwargs.get("data_prop", False))
        return infer(proto, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    Module(tmp_path / "training_model.onnx", state)
    assert propagated and not any(propagated)


def test_an_op_without_a_kernel_for_the_type_is_named_with_what_to_do(tmp_path):
    # onnxruntime's CPU provider lacks float16 ScatterElements(reduction="add"), which the
    # cross-entropy gradient uses: the error names the node and says to train in float32
    from onnx import TensorProto, helper, numpy_helper

    from traingraph.artifacts import LossType

    w = numpy_helper.from_array(np.full((4, 3), 0.1, np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])], "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["N", 3])], [w],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    generate_artifacts(
        model, loss=LossType.CrossEntropyLoss, optimizer=optim.SGD(lr=0.1),
        artifact_directory=tmp_path,
    )  # fmt: skip
    module = Module(
        tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    )
    try:
        module(np.ones((2, 4), np.float16), np.array([0, 2]))
    except ModelError as error:
        message = str(error)
    else:
        pytest.skip(
            "this onnxruntime's CPU provider runs float16 ScatterElements(reduction='add'):"
            " the model has no op without a kernel to name"
        )
    assert "ScatterElements" in message and "'x' float16 [2, 4]" in message
    assert "no kernel for that op in that element type; train the model in float32" in message
    assert "class labels" not in message
