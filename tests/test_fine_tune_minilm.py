"""Fine-tuning the pretrained all-MiniLM-L6-v2 (examples/fine_tune_minilm.py) in traingraph
follows PyTorch's loss curve step by step and classifies unseen sentences as well."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from zoo.torchvision_import import torchvision_models

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fine_tune_minilm.py"
STEPS = 24
RTOL = 1e-3


def _example() -> ModuleType:
    torchvision_models()  # transformers imports torchvision; see zoo/torchvision_import.py
    spec = importlib.util.spec_from_file_location("fine_tune_minilm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fine_tuning_follows_torch(tmp_path: Path) -> None:
    example = _example()
    reference, trained = example.main(tmp_path, steps=STEPS)
    tests = len(example.topic_sentences()[3])

    assert len(trained.losses) == len(reference.losses) == STEPS
    off = [
        (k, a, b)
        for k, (a, b) in enumerate(zip(reference.losses, trained.losses))
        if not abs(a - b) <= RTOL * abs(a)
    ]
    assert not off, f"traingraph's loss leaves torch's (rtol {RTOL}) at {off} (step, torch, ours)"
    assert trained.losses[-1] < 0.1 * trained.losses[0], (
        f"the loss fell from {trained.losses[0]:.4f} to {trained.losses[-1]:.4f} only;"
        " expected it to fall below a tenth"
    )
    assert reference.accuracy >= 0.9
    assert abs(trained.accuracy - reference.accuracy) <= 1 / tests, (
        f"test accuracy {trained.accuracy:.1%} in traingraph, {reference.accuracy:.1%} in torch"
    )
