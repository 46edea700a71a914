"""Dynamic loss scaling for mixed-precision training (see :mod:`traingraph.precision`).

The training graph of a mixed-precision model takes the loss scale ``S`` as an input and
returns its gradients already divided by ``S``, with a flag that says whether they are all
finite. :class:`DynamicLossScaler` picks ``S`` the way ``torch.amp.GradScaler`` does: a
non-finite step is skipped and halves ``S``; every ``growth_interval`` finite steps in a row
double it.

Example:
    >>> scaler = DynamicLossScaler()
    >>> scaler.update(finite=False)  # skip this step
    False
    >>> scaler.scale
    32768.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    """The loss scale and its update rule.

    Attributes:
        scale: The current loss scale ``S`` (PyTorch's default start: 2**16).
        growth_factor: ``S`` is multiplied by this after ``growth_interval`` finite steps.
        backoff_factor: ``S`` is multiplied by this after a non-finite step.
        growth_interval: Finite steps in a row before ``S`` grows.
        good_steps: Finite steps since the last change of ``S``.
        skipped_steps: Non-finite steps so far (their updates were skipped).
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval!r}")

    def update(self, finite: bool) -> bool:
        """Account for one step whose gradients were ``finite`` (or not).

        Returns:
            Whether the optimizer should apply this step.
        """
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True
