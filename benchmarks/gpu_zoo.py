"""Realistic models on one GPU: traingraph against PyTorch eager and ``torch.compile``.

``python3 benchmarks/gpu_bench.py --zoo`` runs this module. The models, built with random
weights after ``torch.manual_seed(0)`` (no download), every dropout probability 0:

- ``resnet50``: torchvision ResNet-50, 224x224 images, 1000 classes, SGD (momentum 0.9);
- ``vit_b_16``: torchvision ViT-B/16, 224x224 images, 1000 classes, AdamW;
- ``bert``: a BERT-base sequence classifier (12 layers, hidden 768, 12 heads, vocabulary
  30522; transformers from a config), sequences of 128 tokens with an attention mask, 2
  classes, AdamW;
- ``gpt2``: a GPT-2-small causal LM (12 layers, hidden 768, vocabulary 50257), sequences of
  512 tokens, the next-token loss at every position, AdamW.

Systems (``--systems``): ``traingraph_graph`` (:class:`~traingraph.runtime.cuda.CudaGraphStep`:
one CUDA graph per step), ``traingraph`` (``Module(device="cuda")`` and ``Optimizer``, one
session run each), ``torch_eager``, ``torch_compile`` (``torch.compile`` default mode) and
``torch_compile_max`` (mode ``max-autotune``); the optimizer stays eager in PyTorch (foreach
SGD / AdamW). Precisions (``--precisions``): ``fp32`` (TF32 tensor cores allowed in every
system: onnxruntime's ``use_tf32``, torch's ``allow_tf32`` for matmuls and cuDNN), ``bf16`` and
``fp16``: PyTorch under ``torch.autocast`` (fp16 with a ``GradScaler``), traingraph on
artifacts generated with ``mixed_precision`` (float32 master weights; fp16 with dynamic loss
scaling).

Each (model, batch, precision, system) runs in its own process, so that a failure or an
out-of-memory stays there and the memory figure is that system's alone. A run reads the loss
of each of its first ``--curve`` steps (compilation and capture included), then times
``--repeats`` runs of ``--steps`` steps without reading the loss (median ms/step). Every step
copies its batch from host memory. Reported: samples/s, the GPU memory the run holds at its end
beyond the CUDA context (onnxruntime's arena keeps its peak; PyTorch's caching allocator can
give memory back, so its rows add in parentheses the peak it reserved,
``torch.cuda.max_memory_reserved``), and the largest relative distance of the loss curve from
``torch_eager`` in the same precision (the same weights and batches; float32 against
``torch_eager`` fp32 too).

The models are exported (``traingraph.from_torch``) and their artifacts generated once per
model and precision under ``--cache``; ``--prepare`` only does that (it needs no GPU), so the
export can run on another machine and the cache be copied over: a run loads the weights of
the seeded PyTorch model into the checkpoint, so a nominal checkpoint is enough.

Usage::

    python3 benchmarks/gpu_bench.py --zoo --models resnet50:64,bert:32 --precisions fp32,bf16 \\
        --systems traingraph_graph,torch_eager --out zoo.json --markdown zoo.md
    python3 benchmarks/gpu_bench.py --zoo --small --device cpu   # tiny configs, to try it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
DATA_BATCHES = 4
SYSTEMS = ("traingraph_graph", "traingraph", "torch_eager", "torch_compile", "torch_compile_max")
PRECISIONS = ("fp32", "bf16", "fp16")
REFERENCE = "torch_eager"


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A benchmark model: how to build it and its batches.

    Attributes:
        name: The model's name on the command line.
        kind: ``"image"``, ``"classifier"`` (token ids and a mask, one class per sequence) or
            ``"causal"`` (token ids, the next token at every position).
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"`` (weight decay 0.01).
        lr: The learning rate.
        batches: The batch sizes run by default.
        size: Image side or sequence length (full size, then ``--small``).
        classes: Classes of an image or sequence classifier; the vocabulary of a causal LM.
    """

    name: str
    kind: str
    optimizer: str
    lr: float
    batches: tuple[int, ...]
    size: tuple[int, int]
    classes: tuple[int, int]


MODELS = {
    "resnet50": ZooModel("resnet50", "image", "sgd", 0.01, (64, 256), (224, 64), (1000, 10)),
    "vit_b_16": ZooModel("vit_b_16", "image", "adamw", 1e-4, (64,), (224, 32), (1000, 10)),
    "bert": ZooModel("bert", "classifier", "adamw", 1e-4, (32,), (128, 16), (2, 2)),
    "gpt2": ZooModel("gpt2", "causal", "adamw", 1e-4, (8,), (512, 16), (50257, 512)),
}


def build(name: str, small: bool) -> Any:
    """The PyTorch model ``name`` after ``torch.manual_seed(SEED)`` (``small``: tiny configs)."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    info = MODELS[name]
    classes = info.classes[small]
    if torch.version.cuda:  # torchvision's native ops match a CUDA torch: a plain import
        from torchvision import models
    else:  # transformers imports torchvision too
        sys.path.insert(0, str(ROOT / "tests"))
        from zoo.torchvision_import import torchvision_models

        models = torchvision_models()
    if info.kind == "image":
        if name == "resnet50":
            return models.resnet50(num_classes=classes)
        return models.vit_b_16(image_size=info.size[small], num_classes=classes)
    import transformers as tf

    width, layers, heads = (64, 2, 4) if small else (768, 12, 12)
    if info.kind == "classifier":
        config = tf.BertConfig(
            vocab_size=1000 if small else 30522, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=heads, intermediate_size=4 * width, max_position_embeddings=512,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
            num_labels=classes,
        )  # fmt: skip
        bert = tf.BertForSequenceClassification(config)

        class Classifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = bert

            def forward(self, input_ids: Any, attention_mask: Any) -> Any:
                return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

        return Classifier()
    gpt_config = tf.GPT2Config(
        vocab_size=classes, n_embd=width, n_layer=layers, n_head=heads, n_positions=1024,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    gpt = tf.GPT2LMHeadModel(gpt_config)

    class CausalLM(nn.Module):
        """Next-token logits ``(N, V, T - 1)`` for the labels ``input_ids[:, 1:]``."""

        def __init__(self) -> None:
            super().__init__()
            self.model = gpt

        def forward(self, input_ids: Any) -> Any:
            return self.model(input_ids=input_ids).logits[:, :-1].transpose(1, 2)

    return CausalLM()


def batches(name: str, batch: int, small: bool) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """:data:`DATA_BATCHES` batches (inputs by name, int64 labels), the same in every system."""
    info = MODELS[name]
    rng = np.random.default_rng(SEED)
    size, classes = info.size[small], info.classes[small]
    out = []
    for _ in range(DATA_BATCHES):
        if info.kind == "image":
            x = rng.standard_normal((batch, 3, size, size), dtype=np.float32)
            out.append(({"input": x}, rng.integers(0, classes, batch, dtype=np.int64)))
        elif info.kind == "classifier":
            ids = rng.integers(0, 1000, (batch, size), dtype=np.int64)
            mask = np.ones((batch, size), np.int64)
            mask[1::2, size - size // 4 :] = 0  # every second sequence ends in padding
            labels = rng.integers(0, classes, batch, dtype=np.int64)
            out.append(({"input_ids": ids, "attention_mask": mask}, labels))
        else:
            ids = rng.integers(0, classes, (batch, size), dtype=np.int64)
            out.append(({"input_ids": ids}, ids[:, 1:].copy()))
    return out


# ------------------------------------------------------------------------------ preparation
def artifact_dir(cache: Path, name: str, small: bool, precision: str) -> Path:
    return cache / f"{name}{'_small' if small else ''}" / precision


def prepare(name: str, small: bool, precisions: list[str], cache: Path) -> None:
    """Export ``name`` and write its artifacts for each of ``precisions``, unless cached."""
    todo = [p for p in precisions if not (artifact_dir(cache, name, small, p) / "done").exists()]
    if not todo:
        return
    import onnx

    from traingraph import from_torch, optim
    from traingraph.artifacts import LossType, generate_artifacts

    model_path = cache / f"{name}{'_small' if small else ''}" / "model.onnx"
    if not model_path.exists():
        start = time.perf_counter()
        inputs, _ = batches(name, 2, small)[0]
        import torch

        args = tuple(torch.from_numpy(a) for a in inputs.values())
        model = from_torch(build(name, small), args, input_names=list(inputs))
        model_path.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, model_path, save_as_external_data=True, location="model.onnx.data")
        print(f"exported {name} in {time.perf_counter() - start:.1f} s", flush=True)
    model = str(model_path)
    info = MODELS[name]
    for precision in todo:
        start = time.perf_counter()
        directory = artifact_dir(cache, name, small, precision)
        optimizer = (
            optim.SGD(lr=info.lr, momentum=0.9)
            if info.optimizer == "sgd"
            else optim.AdamW(lr=info.lr, weight_decay=0.01)
        )
        generate_artifacts(
            model,
            loss=LossType.CrossEntropyLoss,
            optimizer=optimizer,
            artifact_directory=directory,
            nominal_checkpoint=True,
            mixed_precision=None if precision == "fp32" else precision,
        )
        (directory / "checkpoint").unlink()  # the weights come from the seeded torch model
        (directory / "done").write_text("")
        print(f"artifacts {name} {precision} in {time.perf_counter() - start:.1f} s", flush=True)


# ----------------------------------------------------------------------------------- systems
Step = Callable[[dict[str, np.ndarray], np.ndarray, bool], float | None]


def traingraph_system(
    name: str, small: bool, precision: str, cache: Path, device: str, cuda_graph: bool,
    config: dict[str, Any],
) -> Step:  # fmt: skip
    """A traingraph step on the cached artifacts, with the seeded PyTorch model's weights."""
    from traingraph.api import CheckpointState, Module, Optimizer
    from traingraph.checkpoint import load_checkpoint_data, save_checkpoint_data
    from traingraph.runtime.session import SessionConfig

    directory = artifact_dir(cache, name, small, precision)
    data = load_checkpoint_data(directory / "nominal_checkpoint")
    weights = {k: v.detach().numpy() for k, v in build(name, small).state_dict().items()}
    missing = [p for p in data.parameters if p not in weights]
    if missing:
        raise KeyError(f"checkpoint parameters {missing[:5]} are not in the torch state_dict")
    data.parameters = {p: np.ascontiguousarray(weights[p]) for p in data.parameters}
    data.nominal = False
    checkpoint = Path(tempfile.mkdtemp(prefix="tg-zoo-")) / "checkpoint"
    save_checkpoint_data(data, checkpoint)
    state = CheckpointState.load_checkpoint(checkpoint)
    session_config = SessionConfig(**config)
    module = Module(
        directory / "training_model.onnx", state, device=device, session_config=session_config
    )
    module.train()
    names = module.input_names()
    if cuda_graph:
        from traingraph.runtime.cuda import CudaGraphStep

        graph_step = CudaGraphStep(module, directory / "optimizer_model.onnx")

        def captured(inputs: dict[str, np.ndarray], labels: np.ndarray, fetch: bool) -> Any:
            batch = [*(inputs[n] for n in names[:-1]), labels]
            loss = graph_step(*batch, fetch_loss=fetch)
            return None if loss is None else float(loss)

        return captured
    opt = Optimizer(directory / "optimizer_model.onnx", module)

    def step(inputs: dict[str, np.ndarray], labels: np.ndarray, fetch: bool) -> Any:
        loss = module(*(inputs[n] for n in names[:-1]), labels)
        opt.step()
        module.lazy_reset_grad()
        return float(loss) if fetch else None

    return step


def torch_system(name: str, small: bool, precision: str, device: str, mode: str | None) -> Step:
    """A PyTorch step: eager (``mode`` None) or ``torch.compile(mode=mode)``."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    model = build(name, small).to(device)
    model.train()
    info = MODELS[name]
    params = model.parameters()
    optimizer = (
        torch.optim.SGD(params, lr=info.lr, momentum=0.9)
        if info.optimizer == "sgd"
        else torch.optim.AdamW(params, lr=info.lr, weight_decay=0.01)
    )
    forward = model if mode is None else torch.compile(model, mode=mode)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    kind = "cuda" if device.startswith("cuda") else "cpu"

    def step(inputs: dict[str, np.ndarray], labels: np.ndarray, fetch: bool) -> Any:
        if mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        args = [torch.from_numpy(a).to(device, non_blocking=True) for a in inputs.values()]
        target = torch.from_numpy(labels).to(device, non_blocking=True)
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(forward(*args), target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        return loss.item() if fetch else None

    return step


def profile_kernels(step: Step, data: list[Any], steps: int, top: int = 30) -> list[str]:
    """The GPU kernels of ``steps`` steps (any library's, through ``torch.profiler``): the
    ``top`` by total time, as "ms per step, calls per step, name"."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            inputs, labels = data[i % len(data)]
            step(inputs, labels, False)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1e3
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    whole = sum(t for t, _ in totals.values()) / steps
    lines = [f"{whole:8.2f} ms/step in {sum(int(c) for _, c in totals.values()) // steps} kernels"]
    lines += [f"{t / steps:8.3f} {int(c) // steps:5d}  {n[:110]}" for n, (t, c) in ranked[:top]]
    return lines


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One (model, batch, precision, system) run, in this process."""
    spec = json.loads(args.child)
    name, batch, precision, system = spec["model"], spec["batch"], spec["precision"], spec["system"]
    cuda = args.device.startswith("cuda")
    used = None
    if cuda:
        import torch

        torch.cuda.init()
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        used = free
    start = time.perf_counter()
    if system.startswith("traingraph"):
        step = traingraph_system(
            name, args.small, precision, args.cache, args.device, system == "traingraph_graph",
            json.loads(args.tg_config),
        )  # fmt: skip
    else:
        mode = {"torch_eager": None, "torch_compile": "default"}.get(system, "max-autotune")
        step = torch_system(name, args.small, precision, args.device, mode)
    data = batches(name, batch, args.small)
    losses = []
    for i in range(args.curve):
        inputs, labels = data[i % len(data)]
        losses.append(step(inputs, labels, True))
    setup = time.perf_counter() - start

    def sync() -> None:
        if cuda:
            import torch

            torch.cuda.synchronize()

    runs = []
    for _ in range(args.repeats):
        sync()
        begin = time.perf_counter()
        for i in range(args.steps):
            inputs, labels = data[i % len(data)]
            step(inputs, labels, False)
        sync()
        runs.append((time.perf_counter() - begin) / args.steps * 1e3)
    result: dict[str, Any] = {"losses": losses, "ms_runs": runs, "ms": float(np.median(runs))}
    if args.profile and cuda:
        result["profile"] = profile_kernels(step, data, args.profile)
    result["samples_per_s"] = batch / result["ms"] * 1e3
    result["setup_and_curve_s"] = setup
    if cuda:
        import torch

        free, _ = torch.cuda.mem_get_info()
        assert used is not None
        result["gpu_mem_gib"] = (used - free) / 2**30
        if system.startswith("torch"):
            result["torch_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["torch_max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


# ------------------------------------------------------------------------------ the parent
def run_one(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec),
        "--device", args.device, "--cache", str(args.cache), "--steps", str(args.steps),
        "--repeats", str(args.repeats), "--curve", str(args.curve), "--tg-config", args.tg_config,
        "--profile", str(args.profile),
    ] + (["--small"] if args.small else [])  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        return {"error": f"exit {done.returncode}: " + "\n".join(tail)}
    result: dict[str, Any] = json.loads(lines[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def curve_distance(losses: list[float], reference: list[float]) -> float:
    pairs = list(zip(losses, reference))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else float("nan")


def markdown(rows: list[dict[str, Any]], device: str, tg_config: str) -> str:
    lines = [
        f"Device: {device}; traingraph SessionConfig: {tg_config}", "",
        "| model | batch | precision | system | ms/step | samples/s | GPU mem GiB"
        " | loss vs eager (same precision) | vs eager fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in rows:
        r = row["result"]
        if "ms" not in r:
            error = r["error"].replace("\n", " / ").replace("|", "/")[-300:]
            lines.append(
                f"| {row['model']} | {row['batch']} | {row['precision']} | {row['system']} |"
                f" failed: {error} | | | | |"
            )
            continue
        mem = r.get("gpu_mem_gib")
        memory = "-" if mem is None else f"{mem:.2f}"
        if "torch_max_reserved_gib" in r:
            memory += f" (peak {r['torch_max_reserved_gib']:.2f})"
        lines.append(
            f"| {row['model']} | {row['batch']} | {row['precision']} | {row['system']} |"
            f" {r['ms']:.2f} | {r['samples_per_s']:.0f} | {memory}"
            f" | {row.get('curve', '-')} | {row.get('curve_fp32', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated model or model:batch")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny configs (to try the script)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--curve", type=int, default=10, help="steps whose loss is read")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per system run")
    parser.add_argument(
        "--tg-config", default="{}", help="traingraph SessionConfig fields as JSON"
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tg-gpu-zoo")
    parser.add_argument("--prepare", action="store_true", help="only export and write artifacts")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--profile", type=int, default=0, help="after timing, list the GPU kernels of N steps"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    configs = []
    for item in (args.models or ",".join(MODELS)).split(","):
        name, _, batch = item.partition(":")
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; expected one of {list(MODELS)}")
        configs += [(name, int(batch))] if batch else [(name, b) for b in MODELS[name].batches]
    systems = [s for s in args.systems.split(",") if s]
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [s for s in systems if s not in SYSTEMS] + [p for p in precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"unknown {bad}; systems are {SYSTEMS}, precisions {PRECISIONS}")
    if any(s.startswith("traingraph") for s in systems):
        for name in dict.fromkeys(n for n, _ in configs):
            prepare(name, args.small, precisions, args.cache)
    if args.prepare:
        return
    device = args.device
    if device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    rows = []
    for name, batch in configs:
        for precision in precisions:
            for system in systems:
                spec = {"model": name, "batch": batch, "precision": precision, "system": system}
                result = run_one(args, spec)
                rows.append({**spec, "result": result})
                long = ("losses", "ms_runs", "profile")
                short = {k: v for k, v in result.items() if k not in long}
                print(json.dumps({**spec, **short}), flush=True)
                for line in result.get("profile", []):
                    print("   ", line, flush=True)
    for row in rows:
        losses = row["result"].get("losses")
        for key, precision in (("curve", row["precision"]), ("curve_fp32", "fp32")):
            ref = next(
                (r["result"].get("losses") for r in rows if r["system"] == REFERENCE
                 and r["model"] == row["model"] and r["batch"] == row["batch"]
                 and r["precision"] == precision), None,
            )  # fmt: skip
            if losses and ref:
                row[key] = f"{curve_distance(losses, ref):.1e}"
    table = markdown(rows, device, args.tg_config)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
