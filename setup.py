"""Build the optional native kernels; the metadata lives in pyproject.toml.

Both extensions are optional: where no C compiler exists the build warns and the package
installs without them. Without ``traingraph.runtime._fusedc`` the optimizer update runs as
the optimizer's graph in onnxruntime (:mod:`traingraph.runtime.optimizer.fused` has no fused
form); without ``traingraph.runtime._convc`` every native kernel is left to the training graph
(:mod:`traingraph.runtime.cpu.native`).

For ``_fusedc``, ``-ffp-contract=off`` keeps every multiply and add a separate float
operation, as in the optimizer graph, so both give the same numbers; ``-fno-math-errno``
(sqrt sets no errno, its results are unchanged) lets the loops with a square root vectorize.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "traingraph.runtime._fusedc",
            sources=["src/traingraph/runtime/csrc/optimizer.c"],
            depends=[
                "src/traingraph/runtime/csrc/optimizer_kernels.h",
                "src/traingraph/runtime/csrc/pool.h",
            ],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "traingraph.runtime._convc",
            sources=["src/traingraph/runtime/csrc/kernels.c"],
            depends=[
                "src/traingraph/runtime/csrc/pool.h",
                "src/traingraph/runtime/csrc/winograd.h",
                "src/traingraph/runtime/csrc/gelu.h",
                "src/traingraph/runtime/csrc/gelu_lanes.h",
                "src/traingraph/runtime/csrc/silu_lanes.h",
                "src/traingraph/runtime/csrc/lstm_lanes.h",
                "src/traingraph/runtime/csrc/widths.h",
                "src/traingraph/runtime/csrc/layernorm.h",
                "src/traingraph/runtime/csrc/permute.h",
                "src/traingraph/runtime/csrc/clip.h",
                "src/traingraph/runtime/csrc/maxpool.h",
                "src/traingraph/runtime/csrc/activation_grads.h",
                "src/traingraph/runtime/csrc/depthwise.h",
                "src/traingraph/runtime/csrc/depthwise_weight.h",
                "src/traingraph/runtime/csrc/lstm_cell.h",
                "src/traingraph/runtime/csrc/unfold.h",
            ],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["m"],
            optional=True,
        ),
    ]
)
