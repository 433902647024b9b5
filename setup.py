"""Builds the optional C kernel for the codec; everything else is in pyproject.toml.

The kernel is optional: without a C compiler the install still succeeds and the codec
uses its NumPy code path (same bytes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "git_theta._planes",
            ["src/git_theta/_planes.c"],
            # No fused multiply-add: low-rank reproduction must round exactly like NumPy.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            libraries=["m"],
            optional=True,
        )
    ]
)
