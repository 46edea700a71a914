"""Fuzz cases: seed files, seeded mutators and the entry points that read the mutated files.

A case is ``(kind, seed)``: the seed picks a mutator and an entry point and drives every random
choice, so a case runs the same way on every machine. :func:`run_case` runs one case in this
process and says what happened; :func:`serve` is the loop of a worker process (see
:mod:`fuzz.harness`), with a cap on its address space.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KINDS = ("model", "training", "native", "ort", "npz")
INPUTS, CLASSES, SAMPLES = 4, 3, 24

# ------------------------------------------------------------------------------------ seeds


def seed_model() -> onnx.ModelProto:
    """A small MLP classifier: x [batch, 4] -> Gemm -> Relu -> Gemm -> logits [batch, 3]."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, INPUTS)).astype(np.float32), "fc1.weight")
    b1 = numpy_helper.from_array(np.zeros(8, np.float32), "fc1.bias")
    w2 = numpy_helper.from_array(rng.standard_normal((CLASSES, 8)).astype(np.float32), "fc2.weight")
    b2 = numpy_helper.from_array(np.zeros(CLASSES, np.float32), "fc2.bias")
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], transB=1, name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["logits"], transB=1,
                             name="fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", INPUTS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        [w1, b1, w2, b2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def seed_data(rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    rng = rng or np.random.default_rng(0)
    return {
        "x": rng.standard_normal((SAMPLES, INPUTS)).astype(np.float32),
        "y": rng.integers(0, CLASSES, SAMPLES).astype(np.int64),
    }


class Seeds:
    """The seed files of every kind, written once into ``root``."""

    def __init__(self, root: Path) -> None:
        from traingraph.api import CheckpointState, Module, Optimizer
        from traingraph.artifacts import generate_artifacts

        self.root = root
        self.model = root / "model.onnx"
        onnx.save(seed_model(), self.model)
        self.artifacts = root / "artifacts"
        generate_artifacts(str(self.model), loss="CrossEntropyLoss", optimizer="AdamW",
                           artifact_directory=str(self.artifacts))  # fmt: skip
        state = CheckpointState.load_checkpoint(self.artifacts / "checkpoint")
        module = Module(self.artifacts / "training_model.onnx", state)
        optimizer = Optimizer(self.artifacts / "optimizer_model.onnx", module)
        data = seed_data()
        module(data["x"][:8], data["y"][:8])
        optimizer.step()
        self.native = root / "native.ckpt"
        self.ort = root / "ort.ckpt"
        CheckpointState.save_checkpoint(state, self.native, True)
        CheckpointState.save_checkpoint(state, self.ort, True, format="ort")
        self.npz = root / "data.npz"
        np.savez(self.npz, **data)
        self.bytes = {
            "model": self.model.read_bytes(),
            "training": (self.artifacts / "training_model.onnx").read_bytes(),
            "native": self.native.read_bytes(),
            "ort": self.ort.read_bytes(),
            "npz": self.npz.read_bytes(),
        }


# --------------------------------------------------------------------------------- mutators
HUGE = (2**20, 2**24, 2**31, 2**40, 2**62, -1, -(2**40), 0)


def bit_flips(data: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        i = int(rng.integers(0, len(out)))
        out[i] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


def truncation(data: bytes, rng: np.random.Generator) -> bytes:
    return data[: int(rng.integers(0, len(data)))]


def random_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    if rng.random() < 0.5:
        return rng.bytes(int(rng.integers(0, 2 * len(data) + 1)))
    out = bytearray(data)
    start = int(rng.integers(0, len(out)))
    span = rng.bytes(int(rng.integers(1, 65)))
    out[start : start + len(span)] = span
    return bytes(out)


def _model_dims(model: onnx.ModelProto) -> list[Any]:
    """Every dimension holder in the model: value-info dims and initializer dims."""
    holders: list[Any] = []
    g = model.graph
    for v in (*g.input, *g.output, *g.value_info):
        holders.extend(("dim", d) for d in v.type.tensor_type.shape.dim)
    for t in g.initializer:
        holders.extend(("init", t, i) for i in range(len(t.dims)))
    return holders


def model_huge_dims(data: bytes, rng: np.random.Generator) -> bytes:
    model = onnx.load_from_string(data)
    holders = _model_dims(model)
    for _ in range(int(rng.integers(1, 3))):
        holder = holders[int(rng.integers(0, len(holders)))]
        value = int(rng.choice(HUGE))
        if holder[0] == "dim":
            holder[1].dim_value = value
        else:
            holder[1].dims[holder[2]] = value
    return model.SerializeToString()


def model_wrong_types(data: bytes, rng: np.random.Generator) -> bytes:
    model = onnx.load_from_string(data)
    g = model.graph
    choice = int(rng.integers(0, 4))
    new_type = int(rng.choice([TensorProto.INT64, TensorProto.STRING, TensorProto.DOUBLE,
                               TensorProto.BOOL, TensorProto.FLOAT16, 0, 999]))  # fmt: skip
    if choice == 0:
        v = g.input[int(rng.integers(0, len(g.input)))]
        v.type.tensor_type.elem_type = new_type
    elif choice == 1:
        t = g.initializer[int(rng.integers(0, len(g.initializer)))]
        t.data_type = new_type
    elif choice == 2:  # a rank change
        v = g.input[int(rng.integers(0, len(g.input)))]
        dims = v.type.tensor_type.shape.dim
        if len(dims) and rng.random() < 0.5:
            del dims[-1]
        else:
            dims.add().dim_value = int(rng.integers(1, 5))
    else:
        node = g.node[int(rng.integers(0, len(g.node)))]
        if node.input:
            node.input[int(rng.integers(0, len(node.input)))] = rng.choice(["", "nope", "x"])
    return model.SerializeToString()


def ckpt_huge_dims(data: bytes, rng: np.random.Generator, kind: str) -> bytes:
    """A native checkpoint with edited header shapes or nominal specs; for ort, dims bytes."""
    if kind == "ort":  # int64 dims of tensors: overwrite an 8-byte-aligned word near a dim
        out = bytearray(data)
        i = int(rng.integers(0, max(1, len(out) // 8))) * 8
        out[i : i + 8] = struct.pack("<q", int(rng.choice(HUGE)))
        return bytes(out[: len(data)])
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    meta = json.loads(header["__metadata__"]["traingraph"])
    if rng.random() < 0.5:
        meta["nominal"] = True
        meta["parameter_specs"] = {
            name: {"dtype": str(rng.choice(["<f4", "|O", "<c8", "<f8", "bogus"])),
                   "shape": [int(rng.choice(HUGE)), int(rng.integers(1, 4))]}
            for name in meta["parameters"]
        }  # fmt: skip
        if rng.random() < 0.5:
            meta["optimizer_step"] = int(rng.choice([-1, 2**70, 3]))
    else:
        key = str(rng.choice([k for k in header if k != "__metadata__"]))
        header[key]["shape"] = [int(rng.choice(HUGE)), 1]
    header["__metadata__"]["traingraph"] = json.dumps(meta)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    return struct.pack("<Q", len(new)) + new + data[8 + length :]


def ckpt_wrong_content(data: bytes, rng: np.random.Generator, kind: str) -> bytes:
    """A well-formed checkpoint whose parameters do not fit the model (shape, dtype, names)."""
    from traingraph.checkpoint import CheckpointData, load_checkpoint_data, save_checkpoint_data

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in"
        src.write_bytes(data)
        ckpt = load_checkpoint_data(src)
        name = str(rng.choice(list(ckpt.parameters)))
        array = ckpt.parameters[name]
        choice = int(rng.integers(0, 5))
        if choice == 0:
            ckpt.parameters[name] = np.zeros((*array.shape, 2), array.dtype)
        elif choice == 1:
            ckpt.parameters[name] = array.astype(rng.choice([np.float64, np.int64, np.float16]))
        elif choice == 2:
            ckpt.parameters[name + "_renamed"] = ckpt.parameters.pop(name)
            ckpt.requires_grad[name + "_renamed"] = ckpt.requires_grad.pop(name)
            ckpt.optimizer_state.pop(name, None)
        elif choice == 3:
            ckpt.parameters[name] = np.full(array.shape, np.nan, array.dtype)
        else:
            ckpt.parameters[name] = array.reshape(-1)[: max(1, array.size // 2)].copy()
        ckpt = CheckpointData(**{**ckpt.__dict__})
        out = Path(tmp) / "out"
        save_checkpoint_data(ckpt, out, format="ort" if kind == "ort" else "native")
        return out.read_bytes()


def npz_huge_dims(data: bytes, rng: np.random.Generator) -> bytes:
    """Rewrites one member's .npy header with a huge or negative shape."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    victim = str(rng.choice(src.namelist()))
    with zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            member = src.read(name)
            if name == victim:
                buf = io.BytesIO(member)
                version = np.lib.format.read_magic(buf)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)  # fmt: skip
                shape, fortran, dtype = read(buf)
                body = buf.read()
                head = io.BytesIO()
                header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran,
                          "shape": (int(rng.choice(HUGE)), *shape[1:])}  # fmt: skip
                np.lib.format.write_array_header_2_0(head, header)
                member = head.getvalue() + body
            dst.writestr(name, member)
    return out.getvalue()


def npz_wrong_content(data: bytes, rng: np.random.Generator) -> bytes:
    arrays = seed_data(rng)
    choice = int(rng.integers(0, 8))
    if choice == 0:
        arrays["y"] = arrays["y"][: int(rng.integers(0, SAMPLES))]  # lengths differ
    elif choice == 1:
        arrays["y"] = np.array(int(rng.integers(0, 3)))  # 0-d
    elif choice == 2:
        arrays["x"] = arrays["x"].astype(rng.choice(["U3", np.complex64, np.bool_]))
    elif choice == 3:
        arrays["y"] = arrays["y"] + int(rng.choice([CLASSES, 100, -5]))  # labels out of range
    elif choice == 4:
        arrays["x"][int(rng.integers(0, SAMPLES))] = rng.choice([np.nan, np.inf])
    elif choice == 5:
        arrays["x"] = arrays["x"].reshape(SAMPLES, 2, 2)  # wrong rank
    elif choice == 6:
        arrays = {"a": arrays["x"], "b": arrays["y"]}  # wrong names
    else:
        arrays["x"] = arrays["x"][:, : int(rng.integers(0, INPUTS))]  # wrong width
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def mutate(kind: str, data: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    """Picks a mutator for ``kind`` and applies it; returns its name and the new bytes."""
    generic: dict[str, Callable[[bytes, np.random.Generator], bytes]] = {
        "bit_flips": bit_flips,
        "truncation": truncation,
        "random_bytes": random_bytes,
    }
    structural: dict[str, Callable[[bytes, np.random.Generator], bytes]]
    if kind in ("model", "training"):
        structural = {"huge_dims": model_huge_dims, "wrong_types": model_wrong_types}
    elif kind in ("native", "ort"):
        structural = {
            "huge_dims": lambda d, r: ckpt_huge_dims(d, r, kind),
            "wrong_content": lambda d, r: ckpt_wrong_content(d, r, kind),
        }
    else:
        structural = {"huge_dims": npz_huge_dims, "wrong_content": npz_wrong_content}
    mutators = {**generic, **structural}
    name = str(rng.choice(list(mutators)))
    return name, mutators[name](data, rng)


# ------------------------------------------------------------------------------ entry points
def _cli(*args: str) -> None:
    from traingraph.cli import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        cli.main(args=list(args), prog_name="traingraph", standalone_mode=False)


def _train_step(artifacts: Path, checkpoint: Path, data: dict[str, np.ndarray]) -> None:
    from traingraph.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(checkpoint)
    module = Module(artifacts / "training_model.onnx", state, artifacts / "eval_model.onnx")
    optimizer = Optimizer(artifacts / "optimizer_model.onnx", module)
    module(data["x"][:8], data["y"][:8])
    optimizer.step()
    module.eval()
    module(data["x"][:8], data["y"][:8])


def entry_points(kind: str, seeds: Seeds, work: Path, file: Path) -> dict[str, Callable[[], Any]]:
    """The entry points that read a mutated file of ``kind`` (``file``, inside ``work``)."""
    data = seed_data()
    if kind == "model":
        return {
            "generate_artifacts": lambda: __import__(
                "traingraph.artifacts", fromlist=["generate_artifacts"]
            ).generate_artifacts(str(file), loss="CrossEntropyLoss", optimizer="AdamW",
                                 artifact_directory=str(work / "out")),  # fmt: skip
            "cli info": lambda: _cli("info", str(file)),
            "cli artifacts": lambda: _cli("artifacts", str(file), "--out", str(work / "out")),
        }
    if kind == "training":
        artifacts = work / "artifacts"
        shutil.copytree(seeds.artifacts, artifacts)
        shutil.copy(file, artifacts / "training_model.onnx")
        return {
            "Module + step": lambda: _train_step(artifacts, artifacts / "checkpoint", data),
            "cli eval": lambda: _cli("eval", str(artifacts), "--data", str(seeds.npz)),
            "cli export": lambda: _cli("export", str(artifacts), "--out", str(work / "m.onnx")),
        }
    if kind in ("native", "ort"):
        from traingraph.api import CheckpointState

        return {
            "CheckpointState": lambda: CheckpointState.load_checkpoint(file),
            "Module + step": lambda: _train_step(seeds.artifacts, file, data),
            "cli info": lambda: _cli("info", str(file)),
            "cli export": lambda: _cli("export", str(seeds.artifacts), "--checkpoint", str(file),
                                       "--out", str(work / "m.onnx")),  # fmt: skip
        }
    return {
        "cli train": lambda: _cli("train", str(seeds.model), "--data", str(file),
                                  "--epochs", "1", "--batch-size", "8",
                                  "--out", str(work / "run")),  # fmt: skip
        "cli eval": lambda: _cli("eval", str(seeds.artifacts), "--data", str(file)),
    }


# ----------------------------------------------------------------------------------- running
def run_case(kind: str, seed: int, seeds: Seeds) -> dict[str, Any]:
    """Runs case ``(kind, seed)`` here; returns its mutator, entry point and outcome.

    Outcomes: ``accepted`` (no error), ``clean`` (a TraingraphError or a click error: one
    line for the user), ``raw`` (any other exception), ``memory`` (MemoryError).
    """
    import click

    from traingraph.errors import TraingraphError

    rng = np.random.default_rng((KINDS.index(kind), seed))
    result: dict[str, Any] = {"kind": kind, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            result["mutator"], content = mutate(kind, seeds.bytes[kind], rng)
        except Exception as exc:  # a structural mutator that cannot apply: flip bits instead
            result["mutator"] = f"bit_flips ({type(exc).__name__} in mutator)"
            content = bit_flips(seeds.bytes[kind], rng)
        suffix = {"model": ".onnx", "training": ".onnx", "npz": ".npz"}.get(kind, ".ckpt")
        file = work / f"case{suffix}"
        file.write_bytes(content)
        entries = entry_points(kind, seeds, work, file)
        entry = list(entries)[int(rng.integers(0, len(entries)))]
        result["entry"] = entry
        try:
            entries[entry]()
            result["outcome"] = "accepted"
        except (TraingraphError, click.ClickException) as exc:
            result["outcome"], result["error"] = "clean", f"{type(exc).__name__}: {exc}"
        except MemoryError as exc:
            result["outcome"], result["error"] = "memory", f"MemoryError: {exc}"
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            result["outcome"] = "raw"
            result["error"] = (
                f"{type(exc).__name__}: {str(exc)[:300]} at {Path(where.filename).name}"
                f":{where.lineno}"
            )
    return result


def serve(memory_bytes: int) -> None:
    """Worker loop: reads ``kind seed`` lines on stdin, answers one JSON line per case."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr)  # the harness asks on a hang
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = sys.stdout
    sys.stdout = sys.stderr  # everything else the cases print goes to the worker's stderr
    with tempfile.TemporaryDirectory() as tmp:
        seeds = Seeds(Path(tmp))
        out.write("ready\n")
        out.flush()
        for line in sys.stdin:
            kind, seed = line.split()
            out.write(json.dumps(run_case(kind, int(seed), seeds)) + "\n")
            out.flush()
