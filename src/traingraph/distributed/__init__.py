"""Data-parallel training over ``torch.distributed``: gloo on CPUs, NCCL on GPUs, torchrun.

Every process runs the same artifacts on its shard of each global batch. Between the gradients
and the optimizer update, the gradients, which live in one flat block
(:class:`~traingraph.runtime.tensors.TensorStore`), are averaged over the processes by one
all-reduce of that block (split into buckets where it is large), so every replica applies the
same update and holds the same parameters; rank 0's parameters are broadcast at the start. CPU
gradients go through gloo; CUDA gradients go through NCCL on the device block itself, which
torch reads through ``__cuda_array_interface__`` without a copy.

The processes are started by ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``::

    torchrun --nproc-per-node 4 -m traingraph train model.onnx --data train.npz

In Python, :func:`traingraph.fit.fit` does all of this under torchrun (or with
``distributed=True``); by hand:

    >>> from traingraph import distributed
    >>> from traingraph.fit import Trainer
    >>> distributed.init_process_group()  # from torchrun's environment
    >>> trainer = Trainer.from_artifacts("artifacts", device=distributed.local_device("cuda"))
    >>> replica = distributed.DataParallel(trainer.module, trainer.optimizer)
    >>> for batch in Batches((x, y), batch_size=256):  # the same global batches everywhere
    ...     trainer.train_step(replica.shard(batch))

The gradients are averaged weighted by each shard's share of its global batch (with gradient
accumulation, by each micro-batch's), which is the gradient of the global batches for a
mean-reduced loss (the losses' default). Updated buffers (BatchNorm running statistics) are
averaged after every step with the same weights, so the replicas keep identical buffers. torch
is needed only here: ``pip install 'traingraph[distributed]'``.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from traingraph.errors import ModelError, TraingraphError
from traingraph.runtime.device import Device, parse_device

if TYPE_CHECKING:
    from traingraph.api import Module, Optimizer
    from traingraph.fit import Trainer
    from traingraph.graph.execution import ExecutionResult
    from traingraph.graph.training import TrainingGraph
    from traingraph.runtime.tensors import TensorStore

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "DataParallel",
    "DistributedError",
    "active",
    "cuda_graph_step",
    "init_process_group",
    "launched",
    "local_device",
    "rank",
    "rank_zero_first",
    "world_size",
]

DEFAULT_BUCKET_BYTES = 64 << 20
"""The largest piece of the gradient block that one all-reduce call carries."""

PACKED_BYTES = 1 << 20
"""Gradient blocks up to this size are averaged in one buffer with the processes' flags."""

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a collective waits for the other processes before it fails."""

ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables that torchrun sets and the ``env://`` rendezvous reads (LOCAL_RANK aside)."""


class DistributedError(TraingraphError, RuntimeError):
    """A collective failed (another process stopped, or it timed out), or the processes do
    not hold the same model."""


def _torch() -> tuple[Any, Any]:
    """``torch`` and ``torch.distributed``, or an error saying how to install them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise DistributedError(
            f"data-parallel training needs torch ({exc}); install it with"
            " pip install 'traingraph[distributed]'"
        ) from None
    if not dist.is_available():
        raise DistributedError(
            f"this torch build ({torch.__version__}) has no torch.distributed; install a build"
            " with it (the wheels on pypi.org have it)"
        )
    return torch, dist


def launched() -> bool:
    """Whether this process is one of several that torchrun started (``WORLD_SIZE`` > 1)."""
    try:
        return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def active() -> bool:
    """Whether training here is data-parallel: a process group exists or torchrun started
    several processes."""
    return _initialized() or launched()


def rank() -> int:
    """This process's rank (0 when training is not distributed)."""
    if _initialized():
        return int(sys.modules["torch.distributed"].get_rank())
    return int(os.environ.get("RANK", "0")) if launched() else 0


def world_size() -> int:
    """The number of processes (1 when training is not distributed)."""
    if _initialized():
        return int(sys.modules["torch.distributed"].get_world_size())
    return int(os.environ.get("WORLD_SIZE", "1")) if launched() else 1


def local_device(device: str | Device = "cpu") -> str | Device:
    """``device`` for this process: under torchrun, ``"cuda"`` becomes ``cuda:LOCAL_RANK`` (one
    GPU per process); where the host has fewer GPUs than processes, the processes share them
    in turn (``LOCAL_RANK`` modulo the number of GPUs). Any other device is returned as given."""
    if isinstance(device, str) and device.strip().lower() == "cuda" and launched():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        count = _cuda_device_count()
        return f"cuda:{local % count if count else local}"
    return device


def _cuda_device_count() -> int:
    """The GPUs this process sees (0 when torch or CUDA is missing: then no mapping applies)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def init_process_group(
    timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str | None = None
) -> None:
    """Join the default process group from torchrun's environment, if not joined yet.

    By default the group carries CPU tensors through gloo and, where CUDA is available, CUDA
    tensors through NCCL (``cpu:gloo,cuda:nccl``); under torchrun each process uses the GPU of
    its ``LOCAL_RANK``.

    Args:
        timeout: How long a collective waits for the other processes before it fails with a
            :class:`DistributedError`, instead of hanging.
        backend: torch.distributed's backend in place of the default, e.g. ``"gloo"`` for
            several processes sharing one GPU (NCCL takes one GPU per process).

    Raises:
        DistributedError: torch is missing, or the environment lacks a variable that torchrun
            sets.
    """
    torch, dist = _torch()
    if dist.is_initialized():
        return
    missing = [name for name in ENVIRONMENT if name not in os.environ]
    if missing:
        raise DistributedError(
            f"the environment lacks {missing}, which torchrun sets; start the processes with"
            " `torchrun --nproc-per-node N ...`, set RANK, WORLD_SIZE, MASTER_ADDR and"
            " MASTER_PORT yourself, or call torch.distributed.init_process_group(...) first"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if backend is None:
        nccl = torch.cuda.is_available() and dist.is_nccl_available()
        backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    atexit.register(_destroy)


def _destroy() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


def rank_zero_first(make: Callable[[], str]) -> str:
    """Run ``make`` on rank 0 only and return its text on every rank (e.g. the path of a
    folder that rank 0 created); without several processes, just ``make()``.

    Raises:
        DistributedError: On the other ranks, when ``make`` failed on rank 0 (which raises
            its own error).
    """
    if not active():
        return make()
    init_process_group()
    torch, dist = _torch()
    text, error = "", None
    if dist.get_rank() == 0:
        try:
            text = make()
        except BaseException as exc:
            error = exc
    encoded = np.frombuffer(text.encode(), np.uint8)
    length = torch.tensor([encoded.size if error is None else -1], dtype=torch.int64)
    _collective("broadcast the result of rank 0", lambda: dist.broadcast(length, src=0))
    data = torch.zeros(max(int(length[0]), 0), dtype=torch.uint8)
    if dist.get_rank() == 0:
        data.copy_(torch.from_numpy(encoded.copy()))
    if int(length[0]) > 0:
        _collective("broadcast the result of rank 0", lambda: dist.broadcast(data, src=0))
    if error is not None:
        raise error
    if int(length[0]) < 0:
        raise DistributedError(
            f"rank {dist.get_rank()}: rank 0 failed to prepare the run; its log says why"
        )
    return bytes(data.numpy()).decode()


def _collective(what: str, run: Callable[[], Any]) -> Any:
    """``run()``, with a failure of torch.distributed raised as a :class:`DistributedError`."""
    try:
        return run()
    except TraingraphError:
        raise
    except Exception as exc:
        raise _failure(what, exc) from exc


def _failure(what: str, exc: BaseException) -> DistributedError:
    dist = sys.modules.get("torch.distributed")
    where = (
        f"rank {dist.get_rank()} of {dist.get_world_size()}"
        if dist is not None and dist.is_initialized()
        else "this process"
    )
    message = " ".join(str(exc).split())[:400] or type(exc).__name__
    return DistributedError(
        f"{where}: failed to {what} ({type(exc).__name__}: {message}). Another process probably"
        " stopped or lost its connection (see its log), or did not reach this step within the"
        " timeout"
    )


class _DeviceMemory:
    """CUDA memory described by ``__cuda_array_interface__``, for ``torch.as_tensor``."""

    def __init__(self, pointer: int, count: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": typestr,
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype)).dtype


def _device_tensor(torch: Any, value: Any, count: int, dtype: np.dtype, index: int) -> Any:
    """A torch tensor over the first ``count`` elements of a CUDA OrtValue (no copy)."""
    if dtype.name == "bfloat16":  # no typestr: read the bits as int16, then view them
        memory = _DeviceMemory(value.data_ptr(), count, "<i2")
        return torch.as_tensor(memory, device=f"cuda:{index}").view(torch.bfloat16)
    memory = _DeviceMemory(value.data_ptr(), count, np.dtype(dtype).str)
    return torch.as_tensor(memory, device=f"cuda:{index}")


def _store_tensors(torch: Any, store: TensorStore) -> list[Any]:
    """1-D torch tensors over ``store``'s memory (no copy): its flat block, or one per tensor
    where its tensors have several dtypes."""
    device = store.device
    if device.kind not in ("cpu", "cuda"):
        raise DistributedError(
            f"gradients on {device} cannot be averaged; data-parallel training runs on the CPU"
            " (gloo) or CUDA devices (NCCL)"
        )
    if store.flat is not None:
        return [torch.from_numpy(store.flat)]
    if store.offsets is not None:
        dtype = next(iter(store.specs.values()))[1]
        block = store.block(0, store.flat_size)
        return [_device_tensor(torch, block, store.flat_size, dtype, device.index)]
    tensors = []
    for name, (shape, dtype) in store.specs.items():
        view = store.view(name)
        if view is not None:
            tensors.append(torch.from_numpy(view).reshape(-1))
        else:
            count = int(np.prod(shape, dtype=np.int64))
            value = store.ortvalue(name)
            tensors.append(_device_tensor(torch, value, count, dtype, device.index))
    return tensors


def _buckets(tensor: Any, bucket_bytes: int) -> Iterator[Any]:
    """``tensor`` (1-D) in pieces of at most ``bucket_bytes``."""
    step = max(1, bucket_bytes // tensor.element_size())
    for start in range(0, tensor.numel(), step):
        yield tensor[start : start + step]


def _split(arrays: Any, rank: int, world: int, allow_empty: bool) -> tuple[Any, int, int]:
    """This rank's part of a batch (a tuple, list or dict of arrays sharing their first
    dimension), with the part's and the batch's sample counts."""
    values = list(arrays.values()) if isinstance(arrays, Mapping) else arrays
    if not isinstance(values, (list, tuple)) or not values:
        raise ModelError(
            f"a batch to shard must be a non-empty tuple, list or dict of arrays, got"
            f" {type(arrays).__name__}"
        )
    total = int(values[0].shape[0]) if len(getattr(values[0], "shape", ())) else 1
    if total < world and not allow_empty:
        raise ModelError(
            f"a global batch of {total} samples cannot be split over {world} processes; use"
            f" batches of at least {world} samples (e.g. Batches(..., drop_last=True))"
        )
    start, stop = total * rank // world, total * (rank + 1) // world

    def part(value: Any) -> Any:
        shape: tuple[int, ...] = tuple(getattr(value, "shape", ()))
        return value[start:stop] if shape and int(shape[0]) == total else value

    if isinstance(arrays, Mapping):
        return {k: part(v) for k, v in arrays.items()}, stop - start, total
    return type(arrays)(part(v) for v in arrays), stop - start, total


def _device_of(model: Any) -> Device:
    """The device of a Module or a compiled TrainingGraph."""
    device = getattr(model, "device", None)
    return device if isinstance(device, Device) else parse_device("cpu")


_REPLICAS: weakref.WeakKeyDictionary[Any, DataParallel] = weakref.WeakKeyDictionary()


@dataclass
class _Parts:
    """The training parts :meth:`DataParallel.shard` gave this process since the last average."""

    samples: int = 0
    """This process's samples in them."""
    total: int = 0
    """The samples of their global batches."""
    scale: float | None = None
    """The weight the accumulated gradients are in units of: the last non-empty part's share
    of its batch (None while every part was empty)."""


class DataParallel:
    """Averages a model's gradients over the processes of a ``torch.distributed`` group.

    For a :class:`~traingraph.api.Module` and its :class:`~traingraph.api.Optimizer`, every
    :meth:`Optimizer.step <traingraph.api.Optimizer.step>` averages the gradients before
    the update (:meth:`~traingraph.api.Optimizer.register_gradient_hook`); for a compiled
    :class:`~traingraph.graph.TrainingGraph`, :meth:`execute` runs a data-parallel step. The
    processes also agree at every average on whether the step's loss was finite (so a
    :class:`~traingraph.errors.NonFiniteLossError` stops all of them at the same step) and on
    a stop that any of them asks for (:attr:`stop_requested`, then :attr:`stop_agreed`).

    Each process's gradients count by its share of the samples: a part that :meth:`shard`
    gave it of ``n`` samples out of a global batch of ``N`` weighs ``n / N``, and with gradient
    accumulation (several parts before one step) every part weighs by its own batch, so the
    average is the single-process gradient of the global batches for a mean-reduced loss.

    Args:
        model: A Module (with ``optimizer``) or a compiled TrainingGraph, the same in every
            process.
        optimizer: The Module's Optimizer.
        bucket_bytes: The largest piece of the gradient block one all-reduce call carries.
        broadcast: Copy rank 0's parameters to every process now (all of them: trainable
            ones and buffers). The optimizer state stays each process's own: start every
            process from the same checkpoint.
        sync_buffers: Average the updated buffers (BatchNorm running statistics) over the
            processes at every step, in the all-reduce of the gradients, each process's
            weighted by its share of the step's samples: the replicas keep identical buffers
            (and rank 0's checkpoint holds those), and with one part a step a running mean
            is the one of a single process on the global batches. False leaves each replica
            the statistics of its own shards.

    Raises:
        DistributedError: No process group can be joined, or the processes hold models of
            different sizes.

    Example:
        >>> replica = DataParallel(module, optimizer)
        >>> for batch in batches:  # the same global batches in every process
        ...     loss = module(*replica.shard(batch))
        ...     optimizer.step()  # averages the gradients, then updates
        ...     module.lazy_reset_grad()
    """

    def __init__(
        self,
        model: Module | TrainingGraph,
        optimizer: Optimizer | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        broadcast: bool = True,
        sync_buffers: bool = True,
    ) -> None:
        from traingraph.api import Module, Optimizer
        from traingraph.graph.training import TrainingGraph

        if isinstance(model, Module):
            if not isinstance(optimizer, Optimizer):
                raise ModelError(
                    "DataParallel(module, optimizer) needs the Module's Optimizer, got"
                    f" {type(optimizer).__name__}"
                )
        elif isinstance(model, TrainingGraph):
            if model.device is None:
                raise ModelError("compile the TrainingGraph (compile(device=...)) first")
        else:
            raise ModelError(
                f"DataParallel takes an api.Module (with its Optimizer) or a compiled"
                f" TrainingGraph, got {type(model).__name__}"
            )
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ModelError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        init_process_group()
        self._torch, self._dist = _torch()
        self.model = model
        self.optimizer = optimizer
        self.device: Device = _device_of(model)
        """Where the model's gradients live."""
        self.bucket_bytes = bucket_bytes
        self.sync_buffers = bool(sync_buffers)
        """Whether the updated buffers are averaged at every step."""
        self.rank = int(self._dist.get_rank())
        self.world_size = int(self._dist.get_world_size())
        self.steps = 0
        """Gradient averages done."""
        self.stop_requested = False
        """Set to ask every process to stop; :attr:`stop_agreed` says when all know."""
        self.stop_agreed = False
        """Whether some process had :attr:`stop_requested` set at the last average."""
        self.global_batch: int | None = None
        """The sample count of the last batch :meth:`shard` split."""
        self._parts = _Parts()
        self._views: dict[int, tuple[TensorStore, list[Any]]] = {}
        self._staging: dict[tuple[int, ...], Any] = {}
        if broadcast:
            self.broadcast_parameters()
        if optimizer is not None:
            optimizer.register_gradient_hook(self.average_gradients)
            _REPLICAS[optimizer] = self

    @classmethod
    def of(cls, trainer: Trainer, **options: Any) -> DataParallel:
        """The DataParallel of a :class:`~traingraph.fit.Trainer`'s module and optimizer,
        made (broadcasting rank 0's parameters) on the first call only."""
        replica = _REPLICAS.get(trainer.optimizer)
        if replica is None:
            replica = cls(trainer.module, trainer.optimizer, **options)
        return replica

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that writes checkpoints and reports."""
        return self.rank == 0

    # ------------------------------------------------------------------ data
    def shard(self, batch: Any, *, allow_empty: bool = False, train: bool = True) -> Any:
        """This process's contiguous part of a global ``batch`` (a tuple, list or dict of
        arrays sharing their first dimension; other values are passed whole).

        A training part counts in the next gradient average by its share of the batch, so
        uneven parts (a batch that does not divide evenly) average exactly. Call it for each
        micro-batch right before that part's forward pass: with gradient accumulation the
        gradients accumulated so far are rescaled here, so that each micro-batch keeps its own
        weight.

        Args:
            batch: The global batch, the same in every process.
            allow_empty: Return an empty part where the batch has fewer samples than there are
                processes, instead of raising. A process with an empty training part skips
                its forward pass but still takes the optimizer step (its gradients count
                zero there).
            train: False for evaluation: the part is not counted in any average and may be
                empty.

        Raises:
            ModelError: The batch has fewer samples than there are processes (a training
                part without ``allow_empty``), or is not a tuple, list or dict of arrays.
        """
        part, count, total = _split(batch, self.rank, self.world_size, allow_empty or not train)
        if train:
            self.global_batch = total
            self._count(count, total)
        return part

    def _step(self) -> Any:
        """The model's :class:`~traingraph.runtime.step.TrainStep`."""
        return self.model.step

    def _count(self, count: int, total: int) -> None:
        """Count a training part of ``count`` samples of ``total`` in the next average."""
        parts, step = self._parts, self._step()
        state = step.state
        parts.samples += count
        parts.total += total
        if count == 0:
            # No forward pass here: the step averages zeros from this process.
            state.grads_valid = True
            return
        weight = count / total
        live = step.accumulate and state.grads_valid and not state.reset_grads_pending
        if parts.scale is not None and live and parts.scale != weight:
            # The accumulated gradients are in units of the last part's weight: carry them
            # into this part's, which the average multiplies by.
            self._scale_store(state.grads, parts.scale / weight)
        parts.scale = weight

    def _scale_store(self, store: TensorStore, factor: float) -> None:
        device = self._device()
        if device.type == "cuda":  # written and read on onnxruntime's stream
            self._torch.cuda.synchronize(device)
        for tensor in self._tensors(store):
            tensor.mul_(factor)
        if device.type == "cuda":
            self._torch.cuda.synchronize(device)

    # ------------------------------------------------------------- collectives
    def _device(self) -> Any:
        """The torch device of this group's small tensors: the gradients' device."""
        if self.device.kind == "cuda":
            return self._torch.device("cuda", self.device.index)
        return self._torch.device("cpu")

    def _tensors(self, store: TensorStore) -> list[Any]:
        """Torch tensors over ``store``'s memory, made once per store."""
        key = id(store)
        if key not in self._views or self._views[key][0] is not store:
            self._views[key] = (store, _store_tensors(self._torch, store))
        return self._views[key][1]

    def _buffers(self) -> list[Any]:
        """Torch tensors over the current updated buffers (floating-point ones) to average."""
        if not self.sync_buffers:
            return []
        store = self._step().state.buffers.cur
        if not len(store):
            return []
        return [t for t in self._tensors(store) if t.is_floating_point()]

    def average_gradients(self, grads: TensorStore, finite: bool) -> bool:
        """Average ``grads`` in place over the processes (and, with :attr:`sync_buffers`, the
        updated buffers); returns whether every process's step was ``finite``. This is the hook
        :class:`DataParallel` registers on the Optimizer.

        The gradients weigh by this process's share of the samples of the parts :meth:`shard`
        gave it since the last average (``1 / world_size`` without one); a process whose parts
        were all empty contributes zeros, and its ``finite`` does not count.

        Raises:
            DistributedError: The all-reduce failed or timed out (another process stopped).
        """
        torch, dist = self._torch, self._dist
        parts, self._parts = self._parts, _Parts()
        if parts.total:
            weight = parts.scale or 0.0
            share = parts.samples / parts.total
            finite = finite or parts.scale is None
        else:
            weight = share = 1.0 / self.world_size
        device = self._device()
        members = [(t, weight) for t in self._tensors(grads)]
        members += [(t, share) for t in self._buffers()]
        control = torch.tensor(
            [0.0 if finite else 1.0, 1.0 if self.stop_requested else 0.0],
            dtype=torch.float32,
            device=device,
        )
        size = sum(t.numel() * t.element_size() for t, _ in members)
        packed = size <= PACKED_BYTES and all(t.dtype == torch.float32 for t, _ in members)

        def scaled(tensor: Any, factor: float, out: Any) -> None:
            # zeros, not a product: an unused process's stale values may be inf or NaN
            if factor == 0.0:
                out.zero_()
            elif out is tensor:
                tensor.mul_(factor)
            else:
                torch.mul(tensor, factor, out=out)

        def reduce_packed() -> None:
            # A small model travels with the two flags in one buffer: one collective per step.
            key = tuple(id(t) for t, _ in members)
            staging = self._staging.get(key)
            if staging is None:
                count = sum(t.numel() for t, _ in members) + 2
                staging = self._staging[key] = torch.empty(
                    count, dtype=torch.float32, device=device
                )
            offset = 0
            for tensor, factor in members:
                scaled(tensor, factor, staging[offset : offset + tensor.numel()])
                offset += tensor.numel()
            staging[offset:] = control
            dist.all_reduce(staging)
            offset = 0
            for tensor, _ in members:
                tensor.copy_(staging[offset : offset + tensor.numel()])
                offset += tensor.numel()
            control.copy_(staging[offset:])

        def reduce() -> None:
            works = [dist.all_reduce(control, async_op=True)]
            groups: dict[Any, list[Any]] = {}
            for tensor, factor in members:
                scaled(tensor, factor, tensor)
                groups.setdefault(tensor.dtype, []).append(tensor)
            packed = []
            for group in groups.values():
                flat = group[0] if len(group) == 1 else torch.cat(group)
                packed.append((flat, group))
                works += [
                    dist.all_reduce(piece, async_op=True)
                    for piece in _buckets(flat, self.bucket_bytes)
                ]
            for work in works:
                work.wait()
            for flat, group in packed:
                if len(group) > 1:
                    offset = 0
                    for member in group:
                        member.copy_(flat[offset : offset + member.numel()])
                        offset += member.numel()

        def average() -> None:
            if device.type == "cuda":  # the gradients are written on onnxruntime's stream
                torch.cuda.synchronize(device)
            (reduce_packed if packed else reduce)()
            if device.type == "cuda":  # and read there by the update
                torch.cuda.synchronize(device)

        _collective(f"average the gradients of step {self.steps + 1}", average)
        self.steps += 1
        total = control.cpu().numpy()
        self.stop_agreed = bool(total[1] > 0)
        return bool(total[0] == 0)

    def sum(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        """The elementwise sum (or with ``op="max"``, maximum) of ``values`` (float64) over
        the processes."""
        torch, dist = self._torch, self._dist
        tensor = torch.from_numpy(np.array(values, np.float64)).to(self._device())
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        _collective(f"{op} values", lambda: dist.all_reduce(tensor, op=reduce_op))
        return np.asarray(tensor.cpu().numpy())

    def barrier(self) -> None:
        """Wait until every process gets here."""
        tensor = self._torch.zeros(1, device=self._device())
        _collective("wait for the other processes", lambda: self._dist.all_reduce(tensor))

    def broadcast_parameters(self) -> None:
        """Copy rank 0's parameters (trainable ones and buffers) to every process.

        Raises:
            DistributedError: A process holds a model of another size.
        """
        from traingraph.api import Module

        model = self.model
        if isinstance(model, Module):
            flat = np.asarray(model.get_contiguous_parameters(trainable_only=False).numpy())
            arrays = {"all": flat}
        else:
            arrays = model.get_parameters()
        sizes = np.array([float(a.size) for a in arrays.values()] + [float(len(arrays))])
        largest = self.sum(np.concatenate([sizes, -sizes]), op="max")
        if not np.array_equal(largest[: sizes.size], -largest[sizes.size :]):
            raise DistributedError(
                f"rank {self.rank}: the processes hold models of different sizes (this one:"
                f" {int(sum(sizes[:-1]))} parameter values); start every process from the same"
                " artifacts and checkpoint"
            )
        torch, dist = self._torch, self._dist
        device = self._device()
        by_dtype: dict[np.dtype, list[str]] = {}
        for name, array in arrays.items():
            by_dtype.setdefault(array.dtype, []).append(name)
        received: dict[str, np.ndarray] = {}
        for dtype, names in by_dtype.items():
            flat = np.concatenate([arrays[n].reshape(-1) for n in names]).astype(dtype)
            tensor = torch.from_numpy(flat).to(device)
            _collective("broadcast the parameters", partial(dist.broadcast, tensor, src=0))
            values = tensor.cpu().numpy()
            offset = 0
            for name in names:
                size = arrays[name].size
                received[name] = values[offset : offset + size].reshape(arrays[name].shape)
                offset += size
        if self.rank == 0:
            return
        if isinstance(model, Module):
            model.copy_buffer_to_parameters(received["all"], trainable_only=False)
        else:
            model.set_parameters(received)

    # ------------------------------------------------------------- graph API
    def execute(
        self,
        inputs: Mapping[str, Any],
        loss_labels: Mapping[str, Any] | None = None,
        loss_label_weights: Mapping[str, Any] | None = None,
    ) -> ExecutionResult:
        """One data-parallel step of the TrainingGraph: this process's shard of the global
        feeds forward and backward, the gradients averaged, then the optimizer update.

        Returns:
            The forward phase's result on this process's shard.
        """
        from traingraph.graph.training import TrainingGraph

        graph = self.model
        if not isinstance(graph, TrainingGraph):
            raise ModelError(
                "execute() runs a TrainingGraph; for an api.Module, call the module and"
                " optimizer.step() (the average happens in the step)"
            )
        groups = [dict(inputs), dict(loss_labels or {}), dict(loss_label_weights or {})]
        merged = {f"{i}:{k}": v for i, group in enumerate(groups) for k, v in group.items()}
        part = self.shard(merged)
        feeds = [{k: part[f"{i}:{k}"] for k in group} for i, group in enumerate(groups)]
        result = graph.execute_forward(feeds[0], feeds[1] or None, feeds[2] or None)
        assert not isinstance(result, Future)
        graph.execute_gradient()
        loss = result.loss
        finite = loss is None or bool(np.isfinite(loss).all())
        self.average_gradients(graph.gradient_store, finite)
        graph.execute_optimizer_update()
        return result


from traingraph.distributed.cuda_graph import cuda_graph_step  # noqa: E402  (it reads DataParallel)
