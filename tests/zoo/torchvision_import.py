"""Import ``torchvision.models`` beside a CPU build of torch whose ABI its ``_C`` does not match.

PyPI's torchvision wheel links its native ops against a CUDA build of torch. Beside the CPU
build, ``_C`` fails to load (torchvision tolerates that) and only the fake-kernel registrations
of ``torchvision::nms`` and ``torchvision::qnms`` then fail, because those two ops were never
declared. Declaring their schemas first lets the package import; the model definitions use
none of the native ops.
"""

from __future__ import annotations

import types

import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library: torch.library.Library | None = None


def _declared(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


def torchvision_models() -> types.ModuleType:
    """``torchvision.models``, importing torchvision with the missing schemas declared."""
    global _library
    if _library is None:
        _library = torch.library.Library("torchvision", "FRAGMENT")
        for name, schema in _SCHEMAS.items():
            if not _declared(name):
                _library.define(schema)
    import torchvision.models
    import torchvision.models.segmentation

    return torchvision.models
