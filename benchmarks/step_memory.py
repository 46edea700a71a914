"""What a traingraph CPU train step holds in memory, by block, after load and at its peak.

Loads a benchmark cache entry (``benchmarks/zoo.py``: ``prepare_entry``; ``benchmarks/models.py``
describes the format), writes its artifacts in a child process (as ``peers/traingraph_runner.py``
does), trains ``--steps`` steps with ``Module`` and ``Optimizer`` (the fused CPU update), and
prints the process's resident memory (``VmRSS``) and high-water mark (``VmHWM``) after each
stage, and, after load and after each step, the bytes each block holds: the training state's
(``TrainingState.held_bytes``) and the buffers a segmented step keeps for the values that cross
its cuts, each as allocated / resident MiB (resident pages read from ``/proc/self/pagemap``;
Linux only), and the resident MiB outside them (onnxruntime's arenas, the sessions, the
libraries, the interpreter, the data).

    python benchmarks/step_memory.py --entry CACHE/resnet18 --steps 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from common import in_child, load_entry
from traingraph_runner import write_artifacts

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def resident_mib(array: np.ndarray) -> float:
    """MiB of ``array``'s memory that is resident (its pages present in ``/proc/self/pagemap``)."""
    if array.nbytes == 0:
        return 0.0
    first = array.ctypes.data // PAGE
    last = (array.ctypes.data + array.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        words = np.frombuffer(pagemap.read((last - first + 1) * 8), np.uint64)
    return float((words >> np.uint64(63)).sum()) * PAGE / MIB


def _status_mib(field: str) -> float:
    """The MiB of ``field`` (``VmRSS``, ``VmHWM``) in ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split(":")[1].split()[0]) / 1024
    raise KeyError(field)


def memory() -> str:
    """The process's resident memory and its high-water mark, in MiB."""
    return f"RSS {_status_mib('VmRSS'):.0f} MiB, high-water {_status_mib('VmHWM'):.0f} MiB"


def _root(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def blocks(state: Any, runner: Any) -> str:
    """The bytes each block holds, allocated / resident MiB."""
    stores = {
        "parameters": state.trainable.allocated,
        "buffers": state.buffers.allocated,
        "gradients": [state.grads],
        "gradient_scratch": [state.grad_scratch] if state.grad_scratch is not None else [],
        "optimizer_slots": state.optimizer_slots.allocated if state.optimizer_slots else [],
    }
    held = state.held_bytes()
    parts = []
    resident = 0.0
    for name, group in stores.items():
        flats = [s.flat for s in group if s.flat is not None]
        resident += sum(map(resident_mib, flats))
        parts.append(f"{name} {held[name] / MIB:.1f}/{sum(map(resident_mib, flats)):.1f}")
    # the segmented runner's buffers of the values that cross its cuts (shared by values
    # that do not live at the same time)
    cuts = [a for a, _ in getattr(runner, "_cuts", {}).values()]
    cuts += list(getattr(runner, "_kept", {}).values())
    roots = {_root(a).ctypes.data: _root(a) for a in cuts}
    allocated = sum(a.nbytes for a in roots.values()) / MIB
    resident += sum(map(resident_mib, roots.values()))
    parts.append(f"segment buffers {allocated:.1f}/{sum(map(resident_mib, roots.values())):.1f}")
    # the rest of the process's resident memory: onnxruntime's arenas, the sessions, the
    # libraries, the interpreter and the data
    parts.append(f"the rest -/{_status_mib('VmRSS') - resident:.0f}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entry", type=Path, required=True, help="cache entry directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", default="{}", help="SessionConfig fields as a JSON object")
    args = parser.parse_args(argv)
    meta, _, data = load_entry(args.entry)
    print(f"data loaded: {memory()}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        in_child(write_artifacts, args.entry, meta, directory)
        from traingraph.api import CheckpointState, Module, Optimizer
        from traingraph.runtime.session import SessionConfig

        print(f"traingraph imported: {memory()}")
        state = CheckpointState.load_checkpoint(directory / "checkpoint")
        print(f"checkpoint loaded: {memory()}")
        config = SessionConfig(intra_op_threads=args.threads, **json.loads(args.config))
        module = Module(directory / "training_model.onnx", state, session_config=config)
        print(f"Module created: {memory()}")
        optimizer = Optimizer(directory / "optimizer_model.onnx", module)
        print(f"Optimizer created: {memory()}")
    runtime, runner = module.step.state, module.step.runner
    print(f"  held after load (MiB allocated/resident): {blocks(runtime, runner)}")
    module.train()
    x, y = data["x"], data["y"]
    for i in range(args.steps):
        loss = float(module(x[i % len(x)], y[i % len(y)]))
        optimizer.step()
        module.lazy_reset_grad()
        print(f"step {i} (loss {loss:.6f}): {memory()}")
        print(f"  held: {blocks(runtime, runner)}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
