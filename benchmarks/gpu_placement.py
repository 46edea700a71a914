"""Which nodes of a zoo model's CUDA-graph step onnxruntime leaves off the GPU.

For each model (the artifacts that ``gpu_bench.py --zoo`` prepares), the training graph is
made static for the batch (:func:`~traingraph.runtime.cuda.with_static_inputs`,
:func:`~traingraph.runtime.cuda.dropout_from_noise`,
:func:`~traingraph.runtime.cuda.static_shapes.for_capture`, as
:class:`~traingraph.runtime.cuda.CudaGraphStep` does), a CUDA session is created with
onnxruntime's informational log, and the nodes it places on the CPU and the copies it inserts
are listed; then a session with ``enable_cuda_graph`` is created and run once on zeros, which
fails where a capture is not possible.

Usage (on the GPU machine)::

    python3 benchmarks/gpu_placement.py --models resnet50:64,bert:32 --cache /tmp/tg-gpu-zoo
    python3 benchmarks/gpu_placement.py --models resnet50:64 --cuda-option prefer_nhwc=1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks import gpu_zoo  # noqa: E402


def _logged_session(model: bytes, options: dict[str, str], log: Path) -> tuple[Any, str]:
    """A CUDA session of ``model`` with the informational log written to ``log`` (fd 2)."""
    import onnxruntime as ort

    session_options = ort.SessionOptions()
    session_options.log_severity_level = 1
    saved = os.dup(2)
    with open(log, "w") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            session = ort.InferenceSession(
                model, session_options, providers=[("CUDAExecutionProvider", options)]
            )
            error = ""
        except Exception as exc:  # reported, not raised
            session, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return session, error


def check(
    name: str, batch: int, precision: str, cache: Path, small: bool,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The placement report of one model (see the module docstring); ``extra``: further CUDA
    provider options, for example ``{"prefer_nhwc": "1"}``."""
    import onnxruntime as ort

    from traingraph.runtime.cuda import dropout_from_noise, with_static_inputs
    from traingraph.runtime.cuda.static_shapes import for_capture

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    directory = gpu_zoo.artifact_dir(cache, name, small, precision)
    inputs, labels = gpu_zoo.batches(name, batch, small)[0]
    shapes = {n: a.shape for n, a in inputs.items()} | {"labels": labels.shape}
    static = with_static_inputs(directory / "training_model.onnx", shapes)
    static, noise = dropout_from_noise(static)
    static = for_capture(static)
    model = static.SerializeToString()
    report: dict[str, Any] = {"model": name, "batch": batch, "precision": precision}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ort.log"
        _, error = _logged_session(model, {"enable_cuda_graph": "0", **(extra or {})}, log)
        text = log.read_text(errors="replace")
        report["session_error"] = error
        cpu = re.findall(r"Node\(s\) placed on \[CPUExecutionProvider\].*?(?=\n\S|\Z)", text, re.S)
        report["cpu_nodes"] = [c[:3000] for c in cpu]
        report["memcpy"] = [line for line in text.splitlines() if "Memcpy" in line][:20]
        report["not_assigned"] = [
            line for line in text.splitlines() if "not assigned" in line or "fallback" in line
        ][:20]
        session, error = _logged_session(model, {"enable_cuda_graph": "1", **(extra or {})}, log)
        report["graph_session_error"] = error
        if session is not None:
            feeds: dict[str, Any] = {}
            for i in session.get_inputs():
                dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64,
                         "tensor(bool)": np.bool_, "tensor(float16)": np.float16}.get(i.type)
                if dtype is None:
                    report["graph_run_error"] = f"input {i.name} of type {i.type}"
                    return report
                feeds[i.name] = ort.OrtValue.ortvalue_from_numpy(
                    np.zeros(i.shape, dtype), "cuda", 0
                )  # fmt: skip
            binding = session.io_binding()
            for n, v in feeds.items():
                binding.bind_ortvalue_input(n, v)
            for o in session.get_outputs():
                binding.bind_output(o.name, "cuda")
            try:
                session.run_with_iobinding(binding)
                session.run_with_iobinding(binding)
                report["graph_run_error"] = ""
            except Exception as exc:
                report["graph_run_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["log_tail"] = text.splitlines()[-5:]
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50:64,bert:32")
    parser.add_argument("--precisions", default="fp32")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tg-gpu-zoo")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--cuda-option", action="append", default=[], metavar="KEY=VALUE",
        help="a further CUDA provider option, for example prefer_nhwc=1",
    )
    args = parser.parse_args(argv)
    extra = dict(option.split("=", 1) for option in args.cuda_option)
    reports = []
    for item in args.models.split(","):
        name, _, batch = item.partition(":")
        for precision in args.precisions.split(","):
            gpu_zoo.prepare(name, args.small, [precision], args.cache)
            report = check(name, int(batch), precision, args.cache, args.small, extra)
            print(json.dumps(report, indent=1), flush=True)
            reports.append(report)
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
