"""Only the C extensions live here; everything else is in pyproject.toml.

Both are optional: without a C compiler kvreplay installs, records with the Python
capture engine and checks invariants with numpy (slower, same results)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvreplay.recorder._capture",
            ["kvreplay/recorder/_capture.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvreplay.replayer._shadow",
            ["kvreplay/replayer/_shadow.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
