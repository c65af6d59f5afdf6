"""Run by every Python process started under ``kvreplay record`` (this directory is
first on PYTHONPATH): start auto-recording, then run the sitecustomize this one
shadows, if there is one, so the program's own start-up stays as it was."""

import importlib.machinery
import importlib.util
import os
import sys

try:
    from kvreplay.recorder.compat import install_from_env as compat_from_env

    compat_from_env()  # opt-in patches (record --cpu-compat) before anything imports the engine
except Exception as exc:
    print(f"kvreplay: cpu-compat patches not applied in process {os.getpid()}: {type(exc).__name__}: {exc}",
          file=sys.stderr)

try:
    from kvreplay.recorder.autorecord import install_from_env

    install_from_env()
except Exception as exc:  # kvreplay missing in this interpreter, or broken: never stop the program
    print(f"kvreplay: not recording in process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
