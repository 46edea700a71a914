"""Build the optional native optimizer kernels; the metadata lives in pyproject.toml.

``traingraph.runtime._fusedc`` is optional: where no C compiler exists the build warns and
the package installs without it, and :mod:`traingraph.runtime.fused` uses numpy instead.
``-ffp-contract=off`` keeps every multiply and add a separate float operation, as in the
optimizer graph, so both give the same numbers; ``-fno-math-errno`` (sqrt sets no errno, its
results are unchanged) lets the loops with a square root vectorize.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "traingraph.runtime._fusedc",
            sources=["src/traingraph/runtime/_fusedc.c"],
            depends=["src/traingraph/runtime/_fusedc_kernels.h"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
