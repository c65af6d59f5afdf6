"""A worker build's Triton kernels: interpreted on CPU, counted, and kept in bounds.

sglang releases before 0.5.22 launch Triton kernels from their paged allocators and
have no CPU path. On CPU the worker sets ``TRITON_INTERPRET=1`` before anything
imports Triton, and Triton's interpreter runs those same kernels on CPU tensors; on
CUDA they are compiled and run for real. Every launch is counted, so a run says
whether its allocator's kernels ran (``kernels: triton-interpreter | cuda | none``),
not just whether they could have.

Some of those kernels read past the end of a tensor: 0.5.x's ``alloc_decode_kernel``
loads the next free page before the caller checks that there is one, and discards
the value when there is not. On a GPU the read lands in the caching allocator's
block and is harmless; the interpreter copies each tensor argument to host memory of
exactly its size and, for an empty free list, dereferences nothing and kills the
process. That crash would be ours, not the build's, so under the interpreter each
one-dimensional tensor argument is passed as a longer buffer (the tensor followed by
zeroed slack; a kernel sees only a pointer, so the length changes nothing it
computes) and copied back after the launch: reads past the end see zeros, and a
write past the end (which would corrupt memory on a GPU too) fails the call with an
error naming the kernel and argument."""

from __future__ import annotations

import importlib
import os
from typing import Any

SLACK = 4096  # elements of zeroed slack after each staged tensor


def instrument(device: str) -> dict[str, Any]:
    """Set up Triton for ``device`` and count launches; returns the live counter
    ``{"launches": n, "kind": "triton-interpreter" | "cuda" | "none"}``."""
    counter: dict[str, Any] = {"launches": 0, "kind": "none"}
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    where = "triton.runtime.interpreter:InterpretedFunction" if interpret else "triton.runtime.jit:JITFunction"
    try:
        module, _, name = where.partition(":")
        fn = getattr(importlib.import_module(module), name)
    except Exception:  # no triton here: nothing can launch
        return counter
    original = fn.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter["launches"] += 1
        if not interpret:
            return original(self, *args, **kwargs)
        return _staged(original, self, args, kwargs)

    fn.run = run
    counter["kind"] = "triton-interpreter" if interpret else "cuda"
    return counter


def _staged(original: Any, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import torch

    staged: list[tuple[Any, Any, int, str]] = []

    def stage(value: Any, label: str) -> Any:
        if not (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 1
                and value.is_contiguous()):
            return value
        n = value.numel()
        buf = torch.zeros(n + SLACK, dtype=value.dtype)
        buf[:n] = value
        staged.append((value, buf, n, label))
        return buf

    new_args = tuple(stage(a, f"argument {i}") for i, a in enumerate(args))
    new_kwargs = {k: stage(v, k) for k, v in kwargs.items()}
    result = original(kernel, *new_args, **new_kwargs)
    for value, buf, n, label in staged:
        if bool(buf[n:].ne(0).any()):
            name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
            raise RuntimeError(f"Triton kernel {name} wrote past the end of its {label} "
                               f"({n} elements): an out-of-bounds write")
        value.copy_(buf[:n])
    return result
