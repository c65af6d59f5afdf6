"""Only the C extensions live here; everything else is in pyproject.toml.

Both are optional: without a C compiler kvreplay installs, records with the Python
capture engine and checks invariants with numpy (slower, same results)."""

import runpy
from pathlib import Path

from setuptools import Extension, setup

# The capture buffers' layout has one source, kvreplay/recorder/layout.py; the C
# capture gets it as macros rather than a copy.
LAYOUT = runpy.run_path(str(Path(__file__).parent / "kvreplay" / "recorder" / "layout.py"))["c_macros"]()

setup(
    ext_modules=[
        Extension(
            "kvreplay.recorder._capture",
            ["kvreplay/recorder/_capture.c"],
            define_macros=LAYOUT,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "kvreplay.check._shadow",
            ["kvreplay/check/_shadow.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
