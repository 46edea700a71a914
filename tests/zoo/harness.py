"""What every zoo model goes through: export, artifacts, gradients, a loss curve, inference.

A :class:`ZooCase` says how to build a PyTorch model and a batch for it, which loss and which
optimizer train it. :func:`run_case` exports it through :func:`traingraph.from_torch` with one
exporter, writes its artifacts, runs traingraph's training graph and compares with PyTorch:

- gradients: the parameter gradients of one train step against a float64 torch reference
  (``copy.deepcopy(model).double()``, same batch, train mode). A parameter passes when its
  gradient is within ``grad_rtol`` of the reference, relative to the reference gradient's norm,
  or within twice the distance of torch's own float32 gradient from float64 (BatchNorm over few
  values makes float32 itself that far off; all but one of torch's float32 runs have their
  parameters moved by a unit in their last place, to measure that, see :class:`GradientReport`); a
  gradient that is zero in exact arithmetic is bounded against a floor (see
  :data:`ZERO_GRADIENT_TOL`);
- the loss curve: ``steps`` optimizer steps on the same batches as ``torch.optim`` in float64
  (see :func:`curve_tolerance`);
- the inference model: ``Module.export_model_for_inferencing`` after training computes the eval
  graph's output on a batch.

Every Dropout's (and StochasticDepth's) probability is set to 0 before the model is exported,
so that PyTorch and traingraph draw no random masks and their loss curves can be compared.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from traingraph import from_torch, losses, optim
from traingraph.api import CheckpointState, Module, Optimizer
from traingraph.artifacts import generate_artifacts
from traingraph.runtime.session import SessionConfig

EXPORTERS = ("dynamo", "torchscript")
"""The exporters every case runs with."""
OPSETS: dict[str, int | None] = {"dynamo": None, "torchscript": 17}
"""The opset each exporter is asked for (None: ``from_torch``'s default)."""
OUTPUT = "output"
"""The name of every zoo model's output."""
BATCHES = 4
"""Distinct batches the loss curve cycles through."""
INFERENCE_RTOL = 1e-4
"""The inference model's largest allowed distance from the eval graph's output, relative to
the output's largest magnitude: the same graph with the loss cut off, but the Module's
session and a plain onnxruntime session rewrite it for the CPU in their own ways, and the
rounding of a 50-layer ResNet's output then differs by up to 1.6e-5; a wrong weight or
running statistic moves it by far more."""

FLOAT32_RUNS = 6
"""Torch float32 runs whose largest gradient and loss-curve errors set the bars (see
:class:`GradientReport` and :class:`CurveReport`)."""

ZERO_GRADIENT_FLOOR = 1e-6
"""Gradient errors are relative to the float64 gradient's norm, or to this fraction of the
largest gradient norm where the gradient's own is smaller: a gradient that is zero in exact
arithmetic (float64 leaves ~1e-16) has no relative error."""
ZERO_GRADIENT_TOL = 0.1
"""The largest error, relative to the floor, of a gradient that is zero in exact arithmetic
(its float64 norm is below the floor): 1e-7 of the largest gradient norm, about one unit in
the last place of a float32 number of that size. The biases of the BatchNorms after projection Convs
(MobileNetV2, EfficientNet, the MobileNetV3 segmentation backbones) have such gradients: the
next block's 1x1 Conv and BatchNorm make every sum of their output gradient over a channel 0.
What is left of them is the float32 rounding of those sums, and it measures the rounding of
the terms, not their accuracy: mobilenet_v2 leaves 2e-4 to 1e-2 of the floor in torch float32
and in traingraph alike, and from block to block one is up to 2.1x the other. A missing or
wrong term moves such a gradient to the size of the gradients around it, 1e3 to 1e5 times the
floor."""

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ZooLoss:
    """A loss on both sides: traingraph's loss block and the torch function it equals."""

    name: str
    traingraph: Callable[[], losses.Loss]
    torch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


CROSS_ENTROPY = ZooLoss("cross_entropy", losses.CrossEntropyLoss, nn.functional.cross_entropy)
"""Mean cross-entropy of logits (N, C, ...) against int64 class indices (N, ...)."""
MSE = ZooLoss("mse", losses.MSELoss, nn.functional.mse_loss)
"""Mean squared error."""


@dataclasses.dataclass(frozen=True)
class ZooOptimizer:
    """An optimizer on both sides: traingraph's and ``torch.optim``'s, same hyperparameters."""

    kind: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def traingraph(self) -> optim.Optimizer:
        if self.kind == "sgd":
            return optim.SGD(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.kind == "adamw":
            return optim.AdamW(lr=self.lr, weight_decay=self.weight_decay)
        raise ValueError(f"unknown optimizer kind {self.kind!r}; expected 'sgd' or 'adamw'")

    def torch(self, params: Any) -> torch.optim.Optimizer:
        if self.kind == "sgd":
            return torch.optim.SGD(
                params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        if self.kind == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        raise ValueError(f"unknown optimizer kind {self.kind!r}; expected 'sgd' or 'adamw'")


SGD_MOMENTUM = ZooOptimizer("sgd", lr=1e-3, momentum=0.9)
"""SGD with momentum, for the CNNs."""
ADAMW = ZooOptimizer("adamw", lr=1e-3, weight_decay=0.01)
"""AdamW, for the transformers."""


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """One model of the zoo.

    Attributes:
        name: The test id.
        build: A fresh model (called after ``torch.manual_seed(0)``); its output is one tensor.
        example_inputs: A batch of model inputs drawn with the given generator.
        labels: The labels for a batch of inputs, drawn with the given generator.
        loss: The loss applied to the model's output.
        optimizer: The optimizer of the loss curve.
        slow: Whether the case runs only with ``-m slow``.
        xfail: Exporter name -> the reason it fails (an exporter bug outside traingraph).
        input_names: The ONNX names of the model's inputs.
        steps: Optimizer steps of the loss curve.
        grad_rtol: Gradient tolerance relative to the reference gradient's norm.
        reverse: A batch with its samples in reverse order; None: every input and the labels
            reversed along their first axis.
    """

    name: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    labels: Callable[[tuple[torch.Tensor, ...], torch.Generator], torch.Tensor]
    loss: ZooLoss = CROSS_ENTROPY
    optimizer: ZooOptimizer = SGD_MOMENTUM
    slow: bool = False
    xfail: Mapping[str, str] = dataclasses.field(default_factory=dict)
    input_names: tuple[str, ...] = ("input",)
    steps: int = 20
    grad_rtol: float = 1e-3
    reverse: Callable[[Batch], Batch] | None = None


@dataclasses.dataclass
class GradientReport:
    """Per parameter: traingraph's and torch float32's distance from float64 (relative to the
    float64 gradient's norm) and traingraph's distance from torch float32.

    Torch float32's distance is the largest of :data:`FLOAT32_RUNS` float32 runs that differ
    only in rounding: one on the batch, the others with every parameter moved by about one unit
    in its last place (:func:`nudge_parameters`, a different draw each), every other one on the
    batch in reverse order (the loss, a mean, is the same; its sums are not taken in the same
    order), so that one lucky float32 run does not set the bar. The moves measure the
    problem's conditioning, which the order of the sums alone does not: a float32 gradient is
    as accurate as float32 can give it when it is as close to float64 as the gradient of
    parameters that float32 rounding moved. Where a BatchNorm over few values per channel feeds
    a ReLU (ResNet-50's layer4 at the zoo's image size sees 8 values per channel), an output
    within float32 rounding of 0 can land on either side of the kink, and the gradient of its
    channel, every parameter gradient before it, moves by 1e-2 of its norm: torch float32's
    runs differ so (ResNet-50's ``layer4.1.bn3.bias`` is 1e-4 to 2e-2 from float64 across
    eight of them), and one draw of the moves can miss it.
    """

    traingraph: dict[str, float]
    torch32: dict[str, float]
    traingraph_vs_torch32: dict[str, float]
    rtol: float
    zero: set[str] = dataclasses.field(default_factory=set)
    """The parameters whose float64 gradient is zero up to rounding (see
    :func:`compare_gradients`): their errors are relative to the floor and bounded by
    :data:`ZERO_GRADIENT_TOL`."""

    def failures(self) -> dict[str, tuple[float, float]]:
        """The parameters over tolerance: name -> (traingraph error, torch float32 error)."""
        return {
            n: (e, self.torch32[n])
            for n, e in self.traingraph.items()
            if not e <= max(ZERO_GRADIENT_TOL if n in self.zero else self.rtol,
                            2 * self.torch32[n])
        }  # fmt: skip

    def worst(self) -> tuple[float, float, float]:
        """The largest of each of the three errors."""
        return (
            max(self.traingraph.values()),
            max(self.torch32.values()),
            max(self.traingraph_vs_torch32.values()),
        )


@dataclasses.dataclass
class CurveReport:
    """The loss at each step: traingraph's, torch float64's and torch float32's (on the batches,
    and on the batches in reverse order with the parameters moved, and in the further runs of
    :class:`GradientReport` with other moves). A few steps of training with a large learning
    rate through BatchNorm over few values is chaotic in float32: by the third loss two float32
    runs that differ only in rounding can be 1e-3 to 1e-2 apart (efficientnet_b0 on two
    threads), so float32's spread is measured on every run."""

    traingraph: list[float]
    torch64: list[float]
    torch32: list[float]
    torch32_reversed: list[float]
    torch32_more: list[list[float]] = dataclasses.field(default_factory=list)

    def _errors(self, curve: list[float]) -> list[float]:
        """The distance from torch float64 at each step, relative to the loss or, once the
        loss falls below a tenth of the first, to that tenth (a loss near zero makes relative
        differences meaningless)."""
        floor = 0.1 * abs(self.torch64[0])
        return [abs(a - b) / max(abs(b), floor) for a, b in zip(curve, self.torch64)]

    def errors(self) -> list[float]:
        """traingraph's distance from torch float64 at each step."""
        return self._errors(self.traingraph)

    def torch32_errors(self) -> list[float]:
        """Torch float32's distance from float64 at each step (the largest of its runs)."""
        runs = [self.torch32, self.torch32_reversed, *self.torch32_more]
        return [max(step) for step in zip(*(self._errors(run) for run in runs))]

    def failures(self) -> list[tuple[int, float, float]]:
        """The steps over tolerance: (step, traingraph error, allowed)."""
        out = []
        torch32 = 0.0
        for k, (e, e32) in enumerate(zip(self.errors(), self.torch32_errors())):
            torch32 = max(torch32, e32)
            allowed = max(curve_tolerance(k), 3 * torch32)
            if not e <= allowed:
                out.append((k, e, allowed))
        return out


@dataclasses.dataclass
class CaseReport:
    """What :func:`run_case` measured."""

    case: str
    exporter: str
    gradients: GradientReport
    curve: CurveReport
    inference_error: float
    export_s: float
    artifacts_s: float
    load_s: float
    step_ms: tuple[float, float] | None = None
    """Median ms per train step: traingraph's and torch eager's (when timed)."""

    def problems(self) -> list[str]:
        """What differs from PyTorch beyond the tolerances, one message per check."""
        out = []
        grads, failures = self.gradients, self.gradients.failures()
        if failures:
            out.append(
                f"{len(failures)} of {len(grads.traingraph)} parameter gradients are off the"
                f" float64 reference by more than max({grads.rtol}, 2x torch float32's error):"
                f" {dict(list(failures.items())[:5])} (traingraph error, torch float32 error)"
            )
        curve = self.curve
        if curve.failures():
            out.append(
                f"the loss curve leaves torch's at steps {curve.failures()[:5]} (step, error,"
                f" allowed); traingraph {curve.traingraph}, torch float64 {curve.torch64}"
            )
        if not self.inference_error <= INFERENCE_RTOL:
            out.append(
                f"the exported inference model is {self.inference_error:.3g} (relative) off the"
                f" eval graph's output; expected at most {INFERENCE_RTOL}"
            )
        return out


def curve_tolerance(step: int) -> float:
    """The allowed relative distance of traingraph's loss from torch float64's at ``step``.

    Distances are relative to the loss (see :class:`CurveReport`). 1e-3 at the first step,
    whose loss is one float32 forward pass; each step then adds 1e-3,
    up to 1e-2 from step 9 on. A float32 update differs from the float64 one by the gradient's
    rounding (up to ~1e-3 relative, more under BatchNorm over few values), and those differences
    add up over the steps. A step that computes the wrong thing (a parameter not trained, the
    wrong momentum or weight decay, BatchNorm on running statistics) moves the loss by more
    than 1e-2 within a few steps at the zoo's learning rates. Where torch's own float32 curve has
    been further from float64 (at this step or before: small batches through BatchNorm make
    training chaotic, and rounding differences grow), three times that distance is allowed.
    """
    return min(1e-3 * (1 + step), 1e-2)


# ------------------------------------------------------------------ torch side
def zero_dropout(model: nn.Module) -> nn.Module:
    """Set every Dropout's and StochasticDepth's probability, and every attention dropout, to 0."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) or type(module).__name__ in (
            "StochasticDepth",
        ):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def build_model(case: ZooCase) -> nn.Module:
    """The case's model in train mode with seed 0 and its dropout probabilities at 0."""
    torch.manual_seed(0)
    return zero_dropout(case.build()).train()


def make_batches(case: ZooCase, count: int = BATCHES) -> list[Batch]:
    """``count`` batches of the case, each from its own seed."""
    batches = []
    for seed in range(count):
        g = torch.Generator().manual_seed(1000 + seed)
        inputs = case.example_inputs(g)
        batches.append((inputs, case.labels(inputs, g)))
    return batches


def reversed_batches(case: ZooCase, batches: Sequence[Batch]) -> list[Batch]:
    """The batches with their samples in reverse order."""
    if case.reverse is not None:
        return [case.reverse(batch) for batch in batches]
    return [(tuple(t.flip(0) for t in inputs), labels.flip(0)) for inputs, labels in batches]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def nudge_parameters(model: nn.Module, seed: int = 0) -> None:
    """Move every float32 parameter of ``model`` by about one unit in its last place, up or
    down at random (``p * (1 +- 2^-23)``), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32:
                sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
                p.mul_(1 + sign * 2.0**-23)


def torch_run(
    model: nn.Module,
    case: ZooCase,
    batches: Sequence[Batch],
    dtype: torch.dtype,
    nudged: bool = False,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train a copy of ``model`` in ``dtype``: the first step's gradients and each step's loss;
    where ``nudged``, with its parameters first moved by :func:`nudge_parameters` with
    ``seed``."""
    model = copy.deepcopy(model).to(dtype).train()
    if nudged:
        nudge_parameters(model, seed)
    opt = case.optimizer.torch(model.parameters())
    grads: dict[str, np.ndarray] = {}
    curve = []
    for step in range(case.steps):
        inputs, labels = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        out = model(*(_cast(t, dtype) for t in inputs))
        loss = case.loss.torch(out, _cast(labels, dtype))
        loss.backward()
        if step == 0:
            grads = {
                n: p.grad.detach().double().numpy()
                for n, p in model.named_parameters()
                if p.requires_grad and p.grad is not None
            }
        opt.step()
        curve.append(loss.item())
    return grads, curve


# ------------------------------------------------------------- traingraph side
def export(model: nn.Module, case: ZooCase, exporter: str, batch: Batch) -> onnx.ModelProto:
    """The case exported through :func:`traingraph.from_torch` with ``exporter``."""
    return from_torch(
        copy.deepcopy(model),
        batch[0],
        exporter=exporter,
        opset=OPSETS[exporter],
        input_names=list(case.input_names),
        output_names=[OUTPUT],
    )


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def artifacts(model: nn.Module, case: ZooCase, proto: onnx.ModelProto, directory: Path) -> None:
    """Write the case's artifacts, training exactly the model's ``named_parameters()``."""
    names = trainable_names(model)
    initializers = {i.name for i in proto.graph.initializer}
    missing = [n for n in names if n not in initializers]
    if missing:
        raise AssertionError(
            f"the export lacks the parameters {missing[:8]} ({len(missing)} of {len(names)})"
        )
    generate_artifacts(
        proto,
        requires_grad=names,
        loss=case.loss.traingraph(),
        optimizer=case.optimizer.traingraph(),
        artifact_directory=directory,
        additional_output_names=[OUTPUT],
    )


def load(directory: Path, threads: int = 0) -> tuple[CheckpointState, Module, Optimizer]:
    """The checkpoint, Module and Optimizer of the artifacts in ``directory``, running on
    ``threads`` threads (0: onnxruntime's default)."""
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(
        directory / "training_model.onnx",
        state,
        directory / "eval_model.onnx",
        session_config=SessionConfig(intra_op_threads=threads),
    )
    return state, module, Optimizer(directory / "optimizer_model.onnx", module)


def feeds(module: Module, batch: Batch) -> dict[str, np.ndarray]:
    inputs, labels = batch
    arrays = [t.detach().numpy() for t in (*inputs, labels)]
    return dict(zip(module.input_names(), arrays))


def traingraph_run(
    state: CheckpointState,
    module: Module,
    optimizer: Optimizer,
    case: ZooCase,
    batches: Sequence[Batch],
    names: Sequence[str],
) -> tuple[dict[str, np.ndarray], list[float]]:
    """Train with traingraph: the first step's gradients and each step's loss."""
    module.train()
    grads: dict[str, np.ndarray] = {}
    curve = []
    for step in range(case.steps):
        module.lazy_reset_grad()
        loss = module(feeds(module, batches[step % len(batches)]))[0]
        if step == 0:
            for n in names:
                g = state.parameters[n].grad
                assert g is not None, f"traingraph computed no gradient for {n!r}"
                grads[n] = g.astype(np.float64)
        optimizer.step()
        curve.append(float(loss))
    return grads, curve


def _relative(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    return float(np.linalg.norm(a - b) / scale)


def compare_gradients(
    tg: Mapping[str, np.ndarray],
    t64: Mapping[str, np.ndarray],
    t32: Sequence[Mapping[str, np.ndarray]],
    rtol: float,
) -> GradientReport:
    """Each parameter's gradient errors, relative to the float64 gradient's norm (floored at
    :data:`ZERO_GRADIENT_FLOOR` of the largest gradient norm, for gradients that are zero up
    to rounding, which the report lists as ``zero``); torch float32's is the largest of its
    runs ``t32``, and traingraph is compared with the first."""
    floor = ZERO_GRADIENT_FLOOR * max(float(np.linalg.norm(g)) for g in t64.values())
    report = GradientReport({}, {}, {}, rtol)
    for name, ref in t64.items():
        if float(np.linalg.norm(ref)) < floor:
            report.zero.add(name)
        scale = max(float(np.linalg.norm(ref)), floor, np.finfo(np.float64).tiny)
        got = tg[name].reshape(ref.shape)
        report.traingraph[name] = _relative(got, ref, scale)
        report.torch32[name] = max(_relative(run[name], ref, scale) for run in t32)
        report.traingraph_vs_torch32[name] = _relative(got, t32[0][name], scale)
    return report


def inference_error(module: Module, batch: Batch, directory: Path) -> float:
    """The exported inference model's largest distance from the eval graph's output on
    ``batch``, relative to the output's largest magnitude."""
    module.eval()
    expected = module(feeds(module, batch))[1]
    path = directory / "inference.onnx"
    module.export_model_for_inferencing(path, [OUTPUT])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = session.run([OUTPUT], dict(zip(names, (t.numpy() for t in batch[0]))))[0]
    module.train()
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(got - expected).max() / scale)


def run_case(
    case: ZooCase, exporter: str, directory: Path, threads: int = 0, time_repeats: int = 0
) -> CaseReport:
    """Export, generate artifacts, train and compare one case with one exporter, traingraph and
    torch each on ``threads`` threads (0: their defaults); with ``time_repeats``, also time its
    train step against torch eager (:func:`step_times`)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = build_model(case)
        batches = make_batches(case)
        start = time.perf_counter()
        proto = export(model, case, exporter, batches[0])
        exported = time.perf_counter()
        artifacts(model, case, proto, directory)
        generated = time.perf_counter()
        state, module, optimizer = load(directory, threads)
        loaded = time.perf_counter()
        names = trainable_names(model)
        tg_grads, tg_curve = traingraph_run(state, module, optimizer, case, batches, names)
        g64, c64 = torch_run(model, case, batches, torch.float64)
        g32, c32 = torch_run(model, case, batches, torch.float32)
        g32r, c32r = torch_run(
            model, case, reversed_batches(case, batches), torch.float32, nudged=True
        )
        more = [
            torch_run(
                model, case, reversed_batches(case, batches) if seed % 2 == 0 else batches,
                torch.float32, nudged=True, seed=seed,
            )
            for seed in range(1, FLOAT32_RUNS - 1)
        ]
        g32s = [g32, g32r, *(g for g, _ in more)]
        report = CaseReport(
            case=case.name,
            exporter=exporter,
            gradients=compare_gradients(tg_grads, g64, g32s, case.grad_rtol),
            curve=CurveReport(tg_curve, c64, c32, c32r, [c for _, c in more]),
            inference_error=inference_error(module, batches[0], directory),
            export_s=exported - start,
            artifacts_s=generated - exported,
            load_s=loaded - generated,
        )
        if time_repeats:
            report.step_ms = step_times(module, optimizer, model, case, batches[0], time_repeats)
        return report
    finally:
        torch.set_num_threads(previous)


# ------------------------------------------------------------------- timing
def step_times(
    module: Module,
    optimizer: Optimizer,
    model: nn.Module,
    case: ZooCase,
    batch: Batch,
    repeats: int,
    steps: int = 5,
) -> tuple[float, float]:
    """Median milliseconds per train step (forward, backward, optimizer update) of traingraph
    and of torch eager in float32, measured in ``repeats`` alternating runs of ``steps`` steps
    each after one warm-up run of each."""
    fed = feeds(module, batch)
    eager = copy.deepcopy(model).train()
    opt = case.optimizer.torch(eager.parameters())
    module.train()

    def traingraph_steps() -> None:
        for _ in range(steps):
            module.lazy_reset_grad()
            module(fed)
            optimizer.step()

    def torch_steps() -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            case.loss.torch(eager(*batch[0]), batch[1]).backward()
            opt.step()

    runs: tuple[tuple[Callable[[], None], list[float]], ...] = (
        (traingraph_steps, []),
        (torch_steps, []),
    )
    for run, _ in runs:
        run()
    for _ in range(repeats):
        for run, times in runs:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(runs[0][1]), statistics.median(runs[1][1])
