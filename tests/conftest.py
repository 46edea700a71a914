import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def dense_weight_gradients_native(monkeypatch):
    """The native weight-gradient kernel takes dense Convs on every machine in the tests, so
    that its forms are tested where the CPU lacks AVX-512 too (there it leaves them to the
    graph by default: ``conv_grads.DENSE_ON_NARROW``, tested on its own)."""
    from traingraph.runtime.cpu.kernels import conv_grads

    monkeypatch.setattr(conv_grads, "DENSE_ON_NARROW", True)
