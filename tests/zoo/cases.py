"""The zoo's one table of models: the vision cases and the language cases."""

from __future__ import annotations

from zoo.harness import ZooCase
from zoo.vision import VISION_CASES

try:
    from zoo.language import LANGUAGE_CASES
except ModuleNotFoundError as error:  # the language half is not there yet
    if error.name != "zoo.language":
        raise
    LANGUAGE_CASES = []

CASES: list[ZooCase] = [*VISION_CASES, *LANGUAGE_CASES]
"""Every model of the zoo, vision first."""
