"""The optimizer update on a device, in its two forms.

- :mod:`~traingraph.runtime.optimizer.update`: :class:`OptimizerUpdate` chooses the form and
  applies it to a :class:`~traingraph.runtime.state.TrainingState`: the portable optimizer
  graph (per tensor, or over the state's flat blocks in chunks) run by onnxruntime, writing
  the state in place where no other reader needs the old values.
- :mod:`~traingraph.runtime.optimizer.fused`: the native kernel (AdamW, SGD) that computes the
  graph's numbers in place on the CPU.
"""

from traingraph.runtime.optimizer.update import (
    FlatLayout,
    InPlace,
    OptimizerUpdate,
    flat_equivalent,
    flat_layout,
    optimizer_io,
    optimizer_step,
    writes_in_place,
)

__all__ = [
    "FlatLayout",
    "InPlace",
    "OptimizerUpdate",
    "flat_equivalent",
    "flat_layout",
    "optimizer_io",
    "optimizer_step",
    "writes_in_place",
]
