"""Only the native capture extension lives here; everything else is in pyproject.toml.

The extension is optional: without a C compiler kvreplay installs and records with
the pure-Python capture engine (slower, same traces)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvreplay.recorder._capture",
            ["kvreplay/recorder/_capture.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
