"""Hand the native capture engine torch's stable C shim, once it is shown to work.

libtorch exports ``aoti_torch_*`` functions (the C ABI that ahead-of-time compiled
models call) that read a tensor's dtype, device, contiguity, sizes and data pointer
in a few nanoseconds. Through Python the same reads cost ~350 ns per tensor, which
was most of the recorder's overhead on the decode-server model.

The shim takes a pointer to an ``at::Tensor``; a ``torch.Tensor`` object holds one
at a fixed offset after its Python header (where depends on the torch version). The
offset is found by comparing the words after the header with
``torch._C._tensor_impl_raw_handle``, and the whole path is then checked against
the Python reads on sample tensors of every index dtype, shape and layout the
recorder meets. Anything missing or different leaves the Python reads in place:
slower, same rows. ``KVREPLAY_TENSOR_SHIM=0`` turns it off."""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kvreplay.recorder")

_FUNCS = ("get_dtype", "get_device_type", "is_contiguous", "get_dim", "get_numel", "get_data_ptr", "get_sizes")
_DTYPES = {torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
           torch.uint8: "uint8", torch.bool: "bool"}


def _library() -> ctypes.CDLL | None:
    names = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib"}
    name = names.get(sys.platform)
    path = Path(torch.__file__).parent / "lib" / (name or "")
    if name is None or not path.exists():
        return None
    return ctypes.CDLL(str(path))  # already loaded by torch: this only returns its handle


def _impl_pointer(t: torch.Tensor) -> int | None:
    """The address of the tensor's TensorImpl, as torch reports it (a capsule in
    recent versions, an int in some)."""
    got = torch._C._tensor_impl_raw_handle(t)
    if isinstance(got, int):
        return got
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    ptr = ctypes.pythonapi.PyCapsule_GetPointer
    ptr.restype, ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ptr(got, name(got))


def _offset(samples: list[torch.Tensor]) -> int | None:
    if not hasattr(torch._C, "_tensor_impl_raw_handle"):
        return None
    impls = [(id(t), _impl_pointer(t)) for t in samples]
    head = object.__basicsize__  # the Python object header
    for off in range(head, torch.Tensor.__basicsize__ - ctypes.sizeof(ctypes.c_void_p) + 1, 8):
        if all(ctypes.c_void_p.from_address(obj + off).value == impl for obj, impl in impls):
            return off
    return None


def _samples() -> list[torch.Tensor]:
    base = torch.arange(24, dtype=torch.int64)
    out = [base, base[3:9], base.reshape(4, 6), base.reshape(4, 6).t(), base[::2], base[:0],
           torch.tensor(7), torch.ones(3, 2, dtype=torch.float32)]
    out += [base.to(d) for d in _DTYPES]
    return out


def _python_view(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.device.type == "cpu", t.is_contiguous(), t.dim(), t.numel(),
            t.data_ptr() if t.numel() else None, tuple(t.shape))


def uninstall(native: Any) -> None:
    """Back to the Python reads, for captures built from now on."""
    native.set_tensor_shim(0, (), {}, 0)


def install(native: Any) -> bool:
    """Give ``native`` (the ``_capture`` module) the shim if it reads every sample as
    Python does; True when it does."""
    from kvreplay.errors import BadInput
    from kvreplay.limits import tensor_shim

    try:
        if not tensor_shim():
            return False
    except BadInput:  # read at import, so not raised here: the command refuses it (limits.check_environment)
        return False
    try:
        lib = _library()
        samples = _samples()
        off = _offset(samples) if lib is not None else None
        if lib is None or off is None:
            return False
        fns = tuple(ctypes.cast(getattr(lib, f"aoti_torch_{f}"), ctypes.c_void_p).value for f in _FUNCS)

        def code(fn: str) -> int:
            f = getattr(lib, fn)
            f.restype = ctypes.c_int32
            return int(f())

        codes = {d: code(f"aoti_torch_dtype_{n}") for d, n in _DTYPES.items()}
        cpu = code("aoti_torch_device_type_cpu")
        native.set_tensor_shim(off, fns, codes, cpu)
        dtype_of = {v: k for k, v in codes.items()}
        for t in samples:
            got = native.shim_probe(t)
            want = _python_view(t)
            seen = None
            if got is not None:
                # Only index dtypes have a code to check; another dtype only must not read as one.
                dtype = dtype_of.get(got[0], None if t.dtype in codes else t.dtype)
                seen = (dtype, got[1] == cpu, bool(got[2]), got[3], got[4], got[5] if got[4] else None, got[6])
            if seen != want:
                uninstall(native)
                log.debug("kvreplay: torch's C shim reads %s as %s, Python as %s; not used", t, seen, want)
                return False
        return True
    except (AttributeError, OSError, ValueError, TypeError) as exc:  # another torch, another platform
        try:
            uninstall(native)
        except Exception:
            pass
        log.debug("kvreplay: torch's C shim not used: %s", exc)
        return False
