"""``torch.compile`` (inductor, default mode) of the benchmark model; the optimizer stays eager.

The first warm-up steps include compilation; they are not timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_eager import run

if __name__ == "__main__":
    run("torch_compile", compile_model=True)
