"""Tests of checkpoint data, the native format and onnxruntime-training's format.

The onnxruntime-training fixtures in tests/data were made by onnxruntime-training 1.19.2 with
tests/data/make_ort_checkpoints.py. The tests marked ``slow`` at the end run that script again, and
check that onnxruntime-training loads and trains from what traingraph writes; they need a Python
with onnxruntime-training 1.19.2, named by the environment variable TRAINGRAPH_ORTT_PYTHON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from traingraph.checkpoint import (
    CheckpointData,
    PropertyTypeError,
    detect_format,
    load_checkpoint_data,
    native,
    ort_format,
    save_checkpoint_data,
    validate_property,
)
from traingraph.errors import CheckpointError, ModelError

DATA = Path(__file__).resolve().parents[1] / "data"
SCRIPT = DATA / "make_ort_checkpoints.py"
ORTT_PYTHON = os.environ.get("TRAINGRAPH_ORTT_PYTHON")
MLP_SHAPES = {"fc1.weight": (8, 4), "fc1.bias": (8,), "fc2.weight": (3, 8), "fc2.bias": (3,)}


def make_data(*, nominal: bool = False) -> CheckpointData:
    """A checkpoint with several dtypes, AdamW state on two parameters and typed properties."""
    rng = np.random.default_rng(1)
    parameters = {
        "encoder/w": rng.standard_normal((3, 4)).astype(np.float32),
        "encoder/b": rng.standard_normal(4).astype(np.float64),
        "scale": np.array(2.5, dtype=np.float16),
        "table": rng.integers(-5, 5, size=(2, 3)).astype(np.int64),
        "mask": np.array([True, False, True]),
        "counts": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    if nominal:
        parameters = {n: np.zeros_like(a) for n, a in parameters.items()}
    return CheckpointData(
        parameters=parameters,
        requires_grad={n: n.startswith("encoder") for n in parameters},
        optimizer_state={
            n: {
                "exp_avg": rng.standard_normal(parameters[n].shape).astype(parameters[n].dtype),
                "exp_avg_sq": rng.random(parameters[n].shape).astype(parameters[n].dtype),
            }
            for n in ("encoder/w", "encoder/b")
        },
        optimizer_step=17,
        learning_rate=0.003,
        properties={"epoch": 4, "big": 2**40, "neg": -3, "loss": 0.125, "tiny": 1e-30,
                    "name": "run-α", "empty": ""},  # fmt: skip
        nominal=nominal,
    )


def assert_same(actual: CheckpointData, expected: CheckpointData) -> None:
    assert list(actual.parameters) == list(expected.parameters)
    for name, array in expected.parameters.items():
        assert actual.parameters[name].dtype == array.dtype, name
        np.testing.assert_array_equal(actual.parameters[name], array)
    assert actual.requires_grad == expected.requires_grad
    assert list(actual.optimizer_state) == list(expected.optimizer_state)
    for name, slots in expected.optimizer_state.items():
        assert list(actual.optimizer_state[name]) == list(slots)
        for slot, array in slots.items():
            assert actual.optimizer_state[name][slot].dtype == array.dtype
            np.testing.assert_array_equal(actual.optimizer_state[name][slot], array)
    assert actual.optimizer_step == expected.optimizer_step
    assert actual.learning_rate == expected.learning_rate
    assert actual.properties == expected.properties
    assert [type(v) for v in actual.properties.values()] == [
        type(v) for v in expected.properties.values()
    ]
    assert actual.nominal == expected.nominal


def leftover_temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------------------------
# Native format


def test_native_round_trip_keeps_everything(tmp_path):
    data = make_data()
    path = tmp_path / "model.ckpt"
    save_checkpoint_data(data, path)
    assert detect_format(path) == "native"
    assert_same(load_checkpoint_data(path), data)


def test_native_round_trip_without_learning_rate(tmp_path):
    data = make_data()
    data.learning_rate = None
    save_checkpoint_data(data, tmp_path / "a.ckpt")
    assert load_checkpoint_data(tmp_path / "a.ckpt").learning_rate is None


def test_native_nominal_checkpoint_stores_no_parameter_data(tmp_path):
    data = make_data(nominal=True)
    save_checkpoint_data(data, tmp_path / "nominal.ckpt", include_optimizer_state=False)
    with safetensors.numpy.safe_open(str(tmp_path / "nominal.ckpt"), framework="numpy") as f:
        assert list(f.keys()) == []
    loaded = load_checkpoint_data(tmp_path / "nominal.ckpt")
    assert loaded.nominal
    for name, array in data.parameters.items():
        assert loaded.parameters[name].shape == array.shape
        assert loaded.parameters[name].dtype == array.dtype
        assert not loaded.parameters[name].any()


def test_native_without_optimizer_state(tmp_path):
    save_checkpoint_data(make_data(), tmp_path / "a.ckpt", include_optimizer_state=False)
    loaded = load_checkpoint_data(tmp_path / "a.ckpt")
    assert loaded.optimizer_state == {}
    assert loaded.optimizer_step == 0
    assert loaded.learning_rate is None
    assert loaded.properties == make_data().properties


def test_native_file_is_plain_safetensors_with_checksum(tmp_path):
    path = tmp_path / "a.ckpt"
    data = make_data()
    save_checkpoint_data(data, path)
    with safetensors.numpy.safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["traingraph"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)
    assert meta["format"] == native.FORMAT_NAME
    assert meta["version"] == native.FORMAT_VERSION
    assert meta["sha256"] == native.checksum(meta, tensors)
    assert set(tensors) == {f"param/{n}" for n in data.parameters} | {
        f"optim/{n}/{s}" for n, slots in data.optimizer_state.items() for s in slots
    }


def test_native_big_endian_arrays_are_stored_little_endian(tmp_path):
    data = make_data()
    data.parameters["encoder/w"] = data.parameters["encoder/w"].astype(">f4")
    save_checkpoint_data(data, tmp_path / "a.ckpt")
    loaded = load_checkpoint_data(tmp_path / "a.ckpt").parameters["encoder/w"]
    np.testing.assert_array_equal(loaded, data.parameters["encoder/w"])


def test_unserializable_tensor_leaves_old_checkpoint_intact(tmp_path):
    path = tmp_path / "model.ckpt"
    save_checkpoint_data(make_data(), path)
    before = path.read_bytes()
    bad = make_data()
    bad.parameters["encoder/w"] = np.ones((2, 2), dtype=np.complex128)
    with pytest.raises(ModelError, match=r"parameter 'encoder/w'.*complex128.*not supported"):
        save_checkpoint_data(bad, path)
    assert path.read_bytes() == before
    assert leftover_temp_files(tmp_path) == []


@pytest.mark.parametrize("fmt", ["native", "ort"])
def test_failure_mid_write_leaves_old_checkpoint_intact(tmp_path, monkeypatch, fmt):
    path = tmp_path / "model.ckpt"
    data = make_data()
    data.parameters = {n: a for n, a in data.parameters.items() if n != "scale"}
    data.requires_grad.pop("scale")
    save_checkpoint_data(data, path, format=fmt)
    before = path.read_bytes()

    def write_half_then_fail(tmp: str | Path) -> None:
        with open(tmp, "wb") as f:
            f.write(before[: len(before) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", lambda tmp, content: write_half_then_fail(tmp))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint_data(make_data(), path, format=fmt)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert leftover_temp_files(tmp_path) == []
    assert load_checkpoint_data(path).parameters.keys() == data.parameters.keys()


def test_overwrite_replaces_checkpoint(tmp_path):
    path = tmp_path / "model.ckpt"
    save_checkpoint_data(make_data(), path)
    data = make_data()
    data.optimizer_step = 99
    save_checkpoint_data(data, path)
    assert load_checkpoint_data(path).optimizer_step == 99
    assert leftover_temp_files(tmp_path) == []


def test_missing_directory_raises(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        save_checkpoint_data(make_data(), tmp_path / "nope" / "a.ckpt")


def test_missing_file_raises(tmp_path):
    path = tmp_path / "absent.ckpt"
    with pytest.raises(CheckpointError, match=r"absent\.ckpt.*does not exist"):
        load_checkpoint_data(path)


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -4])
def test_truncated_native_file_raises(tmp_path, keep):
    path = tmp_path / "a.ckpt"
    save_checkpoint_data(make_data(), path)
    content = path.read_bytes()
    path.write_bytes(content[:keep] if keep >= 0 else content[:keep])
    with pytest.raises(CheckpointError, match=r"a\.ckpt.*truncated"):
        load_checkpoint_data(path)


def test_corrupt_native_file_fails_checksum(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint_data(make_data(), path)
    content = bytearray(path.read_bytes())
    content[-3] ^= 0xFF
    path.write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match=r"a\.ckpt.*checksum mismatch.*write the checkpoint"):
        load_checkpoint_data(path)


def test_not_a_checkpoint_raises(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are not the tensors you are looking for")
    with pytest.raises(CheckpointError, match=r"notes\.txt.*not a checkpoint"):
        load_checkpoint_data(path)


def test_plain_safetensors_file_is_not_a_traingraph_checkpoint(tmp_path):
    path = tmp_path / "weights.safetensors"
    safetensors.numpy.save_file({"w": np.ones(3, np.float32)}, str(path))
    with pytest.raises(CheckpointError, match="not a traingraph checkpoint"):
        load_checkpoint_data(path)


def test_unknown_native_version_raises(tmp_path, monkeypatch):
    path = tmp_path / "future.ckpt"
    monkeypatch.setattr(native, "FORMAT_VERSION", 99)
    save_checkpoint_data(make_data(), path)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"future\.ckpt.*version 99.*upgrade traingraph"):
        load_checkpoint_data(path)


# --------------------------------------------------------------------------------------------
# Data checks


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (True, "bool"),
        (None, "NoneType"),
        ([1, 2], "list"),
        (b"raw", "bytes"),
        (np.ones(2), "ndarray"),
    ],
)
def test_bad_property_values_raise_type_error(tmp_path, value, match):
    with pytest.raises(PropertyTypeError, match=match) as info:
        validate_property("p", value)
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ModelError)
    data = make_data()
    data.properties["p"] = value
    for fmt in ("native", "ort"):
        with pytest.raises(PropertyTypeError, match="checkpoint property 'p'"):
            save_checkpoint_data(data, tmp_path / "a.ckpt", format=fmt)
    assert not (tmp_path / "a.ckpt").exists()


def test_property_name_must_be_str():
    with pytest.raises(PropertyTypeError, match="name 3"):
        validate_property(3, 1)


def test_numpy_scalar_properties_become_python_numbers(tmp_path):
    assert type(validate_property("a", np.int32(3))) is int
    assert type(validate_property("b", np.float32(0.5))) is float
    data = make_data()
    data.properties = {"a": np.int64(7), "b": np.float64(0.25)}
    save_checkpoint_data(data, tmp_path / "a.ckpt")
    assert load_checkpoint_data(tmp_path / "a.ckpt").properties == {"a": 7, "b": 0.25}


def test_requires_grad_must_cover_parameters(tmp_path):
    data = make_data()
    del data.requires_grad["scale"]
    data.requires_grad["ghost"] = True
    with pytest.raises(ModelError, match=r"missing for \['scale'\].*\['ghost'\]"):
        save_checkpoint_data(data, tmp_path / "a.ckpt")


def test_optimizer_state_of_unknown_parameter_raises(tmp_path):
    data = make_data()
    data.optimizer_state["ghost"] = {"exp_avg": np.zeros(1)}
    with pytest.raises(ModelError, match="'ghost', which is not a parameter"):
        save_checkpoint_data(data, tmp_path / "a.ckpt")


def test_non_array_values_raise(tmp_path):
    data = make_data()
    data.parameters["scale"] = 2.5
    with pytest.raises(ModelError, match=r"parameter 'scale' is a float; expected a numpy"):
        save_checkpoint_data(data, tmp_path / "a.ckpt")


def test_unknown_format_raises(tmp_path):
    with pytest.raises(ModelError, match="unknown checkpoint format 'onnx'.*native, ort"):
        save_checkpoint_data(make_data(), tmp_path / "a.ckpt", format="onnx")


# --------------------------------------------------------------------------------------------
# onnxruntime-training format: reading files that onnxruntime-training 1.19.2 wrote


def check_ort_adamw_checkpoint(path: Path, expected_dir: Path) -> None:
    """Checks a checkpoint written after AdamW steps against the script's expectations."""
    info = json.loads((expected_dir / "ort_mlp_expected.json").read_text())
    expected = np.load(expected_dir / "ort_mlp_expected.npz")
    data = load_checkpoint_data(path)
    assert detect_format(path) == "ort"
    assert not data.nominal
    assert data.requires_grad == {n: n in info["trainable"] for n in sorted(MLP_SHAPES)}
    for name in MLP_SHAPES:
        np.testing.assert_array_equal(data.parameters[name], expected[f"param/{name}"])
        assert data.parameters[name].dtype == np.float32
    assert sorted(data.optimizer_state) == sorted(info["trainable"])
    for name, slots in data.optimizer_state.items():
        assert list(slots) == ["exp_avg", "exp_avg_sq"]
        for slot, array in slots.items():
            # Reference moments accumulate in float64 from onnxruntime's float32 gradients.
            np.testing.assert_allclose(array, expected[f"{slot}/{name}"], rtol=1e-4, atol=1e-7)
    assert data.optimizer_step == info["adamw_step"]
    assert data.learning_rate == info["learning_rate"]
    assert data.properties == info["properties"]
    assert [type(v) for v in data.properties.values()] == [int, float, str]


def test_reads_ort_checkpoint_after_adamw_steps():
    check_ort_adamw_checkpoint(DATA / "ort_mlp_adamw.ckpt", DATA)


def test_reads_ort_checkpoint_from_generate_artifacts():
    data = load_checkpoint_data(DATA / "ort_mlp_initial.ckpt")
    # The script draws the initial weights in this order from default_rng(0).
    rng = np.random.default_rng(0)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in MLP_SHAPES.items()}
    assert list(data.parameters) == list(MLP_SHAPES)  # model order, trainable ones first
    for name, array in initial.items():
        np.testing.assert_array_equal(data.parameters[name], array)
    assert data.requires_grad["fc2.bias"] is False
    assert data.optimizer_state == {}
    assert data.optimizer_step == 0
    assert data.learning_rate is None
    assert data.properties == {}


def test_reads_ort_nominal_checkpoint():
    data = load_checkpoint_data(DATA / "ort_mlp_nominal.ckpt")
    assert data.nominal
    assert list(data.parameters) == list(MLP_SHAPES)
    for array in data.parameters.values():
        # onnxruntime-training's nominal checkpoints record no shapes.
        assert array.shape == ()
        assert array.dtype == np.float32
        assert array == 0


def test_reads_ort_sgd_checkpoint():
    data = load_checkpoint_data(DATA / "ort_mlp_sgd.ckpt")
    assert data.optimizer_step == 1
    assert data.learning_rate == 0.001
    assert sorted(data.optimizer_state) == ["fc1.bias", "fc1.weight", "fc2.weight"]
    for name, slots in data.optimizer_state.items():
        assert list(slots) == ["momentum_buffer"]
        assert slots["momentum_buffer"].shape == MLP_SHAPES[name]


@pytest.mark.parametrize("keep", [6, 100, 1000, 1800])
def test_truncated_ort_file_raises(tmp_path, keep):
    path = tmp_path / "cut.ckpt"
    path.write_bytes((DATA / "ort_mlp_adamw.ckpt").read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=r"cut\.ckpt.*(truncated|corrupt|bytes)"):
        load_checkpoint_data(path)


def test_unknown_ort_version_raises(tmp_path, monkeypatch):
    data = load_checkpoint_data(DATA / "ort_mlp_adamw.ckpt")
    monkeypatch.setattr(ort_format, "CHECKPOINT_VERSION", 3)
    content = ort_format.to_bytes(data)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="<bytes>.*checkpoint version 3"):
        ort_format.loads(content)


# --------------------------------------------------------------------------------------------
# onnxruntime-training format: writing


@pytest.mark.parametrize("fixture", ["ort_mlp_adamw.ckpt", "ort_mlp_sgd.ckpt"])
def test_ort_writer_reproduces_onnxruntime_files_byte_for_byte(tmp_path, fixture):
    original = (DATA / fixture).read_bytes()
    data = load_checkpoint_data(DATA / fixture)
    # Through the native format and back, so that nothing relies on the ORT reader's objects.
    save_checkpoint_data(data, tmp_path / "native.ckpt")
    save_checkpoint_data(load_checkpoint_data(tmp_path / "native.ckpt"), tmp_path / "ort.ckpt",
                         format="ort")  # fmt: skip
    assert (tmp_path / "ort.ckpt").read_bytes() == original


def test_ort_round_trip(tmp_path):
    data = make_data()
    path = tmp_path / "a.ckpt"
    save_checkpoint_data(data, path, format="ort")
    assert detect_format(path) == "ort"
    loaded = load_checkpoint_data(path)
    # The format sorts parameters by name, trainable ones first.
    order = sorted(n for n in data.parameters if data.requires_grad[n]) + sorted(
        n for n in data.parameters if not data.requires_grad[n]
    )
    data.parameters = {n: data.parameters[n] for n in order}
    data.requires_grad = {n: data.requires_grad[n] for n in order}
    data.optimizer_state = {n: data.optimizer_state[n] for n in sorted(data.optimizer_state)}
    # Float properties are float32 in this format; 1e-30 comes back as its float32 value.
    data.properties = {k: data.properties[k] for k in loaded.properties}
    data.properties["tiny"] = float(str(np.float32(1e-30)))
    assert_same(loaded, data)


def test_ort_nominal_round_trip(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint_data(make_data(nominal=True), path, format="ort")
    loaded = load_checkpoint_data(path)
    assert loaded.nominal
    assert {n: (a.shape, a.dtype) for n, a in loaded.parameters.items()} == {
        n: ((), a.dtype) for n, a in make_data().parameters.items()
    }


def test_ort_writer_accepts_numpy_bool_requires_grad(tmp_path):
    data = make_data()
    data.requires_grad = {n: np.bool_(v) for n, v in data.requires_grad.items()}
    save_checkpoint_data(data, tmp_path / "a.ckpt", format="ort")
    loaded = load_checkpoint_data(tmp_path / "a.ckpt")
    assert loaded.requires_grad == {n: bool(v) for n, v in data.requires_grad.items()}


def test_ort_without_optimizer_state(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint_data(make_data(), path, format="ort", include_optimizer_state=False)
    loaded = load_checkpoint_data(path)
    assert loaded.optimizer_state == {}
    assert loaded.optimizer_step == 0
    assert loaded.learning_rate is None


def test_ort_writer_rejects_slots_it_cannot_name(tmp_path):
    data = make_data()
    data.optimizer_state = {"encoder/w": {"square_avg": np.zeros((3, 4), np.float32)}}
    with pytest.raises(ModelError, match=r"'encoder/w' \(slots \['square_avg'\]\).*native format"):
        save_checkpoint_data(data, tmp_path / "a.ckpt", format="ort")


def test_ort_writer_needs_learning_rate_for_optimizer_state(tmp_path):
    data = make_data()
    data.learning_rate = None
    with pytest.raises(ModelError, match="without a learning rate"):
        save_checkpoint_data(data, tmp_path / "a.ckpt", format="ort")


@pytest.mark.parametrize(("value", "match"), [(2**63, "int64"), (1e300, "float32")])
def test_ort_writer_rejects_properties_out_of_range(tmp_path, value, match):
    data = make_data()
    data.properties["p"] = value
    with pytest.raises(ModelError, match=match):
        save_checkpoint_data(data, tmp_path / "a.ckpt", format="ort")


def test_ort_writer_rejects_unsupported_dtype(tmp_path):
    data = make_data()
    data.parameters["scale"] = np.array(["a"], dtype=object)
    with pytest.raises(ModelError, match="tensor 'scale'.*dtype object"):
        save_checkpoint_data(data, tmp_path / "a.ckpt", format="ort")


# --------------------------------------------------------------------------------------------
# Against the real onnxruntime-training 1.19.2


needs_ortt = pytest.mark.skipif(
    not ORTT_PYTHON,
    reason="needs onnxruntime-training 1.19.2, which has no wheel for current Pythons; set"
    " TRAINGRAPH_ORTT_PYTHON to a Python that has it",
)


def run_ortt(*args: str | Path) -> None:
    assert ORTT_PYTHON is not None
    subprocess.run(
        [ORTT_PYTHON, str(SCRIPT), *map(str, args)], check=True, capture_output=True, timeout=300
    )


@pytest.mark.slow
@needs_ortt
def test_live_onnxruntime_checkpoints_load_in_traingraph(tmp_path):
    run_ortt("make", tmp_path)
    check_ort_adamw_checkpoint(tmp_path / "ort_mlp_adamw.ckpt", tmp_path)
    assert load_checkpoint_data(tmp_path / "ort_mlp_initial.ckpt").requires_grad == {
        n: n != "fc2.bias" for n in MLP_SHAPES
    }


@pytest.mark.slow
@needs_ortt
def test_live_traingraph_checkpoints_load_and_train_in_onnxruntime(tmp_path):
    run_ortt("make", tmp_path)
    source = tmp_path / "ort_mlp_adamw.ckpt"
    data = load_checkpoint_data(source)
    save_checkpoint_data(data, tmp_path / "native.ckpt")
    save_checkpoint_data(load_checkpoint_data(tmp_path / "native.ckpt"), tmp_path / "tg.ckpt",
                         format="ort")  # fmt: skip
    fresh = CheckpointData(
        parameters={n: np.full(s, 0.1 * (i + 1), np.float32) for i, (n, s) in
                    enumerate(MLP_SHAPES.items())},
        requires_grad={n: n != "fc2.bias" for n in MLP_SHAPES},
        optimizer_state={},
        properties={"epoch": 9, "loss": 1.5, "tag": "fresh"},
    )  # fmt: skip
    save_checkpoint_data(fresh, tmp_path / "fresh.ckpt", format="ort")

    results = {}
    for name in ("ort_mlp_adamw", "tg", "fresh"):
        ckpt = source if name == "ort_mlp_adamw" else tmp_path / f"{name}.ckpt"
        run_ortt("train", ckpt, tmp_path / f"work_{name}", tmp_path / f"{name}.npz")
        results[name] = np.load(tmp_path / f"{name}.npz")

    own, ours = results["ort_mlp_adamw"], results["tg"]
    for key in own.files:
        np.testing.assert_array_equal(ours[key], own[key], err_msg=key)
    for name in MLP_SHAPES:
        np.testing.assert_array_equal(ours[f"loaded/{name}"], data.parameters[name])
    new = results["fresh"]
    for name, array in fresh.parameters.items():
        np.testing.assert_array_equal(new[f"loaded/{name}"], array)
    assert json.loads(str(new["properties_json"])) == fresh.properties
    assert np.isfinite(new["losses"]).all()
    assert not np.array_equal(new["trained/fc1.weight"], fresh.parameters["fc1.weight"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
