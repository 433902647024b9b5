"""Builds the optional C kernels (codec, merges) and installs the git-theta command;
everything else is in pyproject.toml.

The kernels (the codec's, the merge step's) are optional: without a C compiler the
install still succeeds and each uses its NumPy code path (same bytes, slower).

The command is a shell script (bin/git-theta) rather than an entry point's generated
wrapper, so that its interpreter starts with -E -P (see git_theta/interpreter.py); it
finds that interpreter on the first line of bin/git-theta-python, which pip rewrites.
"""

from setuptools import Extension, setup

setup(
    scripts=["bin/git-theta", "bin/git-theta-python"],
    ext_modules=[
        Extension(
            "git_theta._planes",
            ["src/git_theta/_planes.c"],
            # No fused multiply-add: low-rank reproduction must round exactly like NumPy.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "git_theta._merge",
            ["src/git_theta/_merge.c"],
            # The merge step must round exactly like its NumPy definition: no fused
            # multiply-add either. No trapping math: lets GCC vectorise the branch-free
            # selects (no exception flags are read; values are unchanged).
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math"],
            libraries=["m"],
            optional=True,
        ),
    ]
)
