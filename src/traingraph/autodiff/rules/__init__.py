"""Gradient rules, one module per op family; importing a module registers its rules."""

import importlib

FAMILIES = (
    "elementwise",
    "matrix",
    "softmax",
    "reduction",
    "shape",
    "indexing",
    "conv",
    "pool",
    "normalization",
    "loss",
    "recurrent",
)


def load_all() -> None:
    """Import every rule module (each registers its rules on import)."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
