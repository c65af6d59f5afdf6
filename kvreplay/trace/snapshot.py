"""Pool state snapshots: what a trace that does not start at the pool's birth (a
mid-life attach, a flight-recorder dump) needs to replay.

A snapshot holds the plain state of the pool and its sub-allocators: tensors (free
lists, the SWA mapping), lists of them (staged pages, free groups), ints, bools and
None. Objects (the KV cache, dtypes, devices) are left out: the constructor
arguments rebuild them. It is JSON (tensors as zlib-compressed base64), stored in
the trace's ``initial_state`` metadata, and restored by setting the same attributes
on a freshly built pool, so it fits any build that keeps its state under the names
sglang uses (the builtin pools and sglang's allocators do).

Taking one copies the tensors to the host, so on CUDA it waits for the GPU: fine for
an attach or a periodic flight-recorder snapshot, not for every call."""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np
import torch

from kvreplay.contract.registry import sub_allocators
from kvreplay.trace.format import MAX_POOL_SLOTS

FORMAT = 1
_SKIP = frozenset({"device", "dtype"})
_SCALARS = (bool, int, float, type(None))


def _objects(pool: Any) -> dict[str, Any]:
    out = {"root": pool}
    for name, attr in sub_allocators():
        sub = getattr(pool, attr, None)
        if sub is not None and sub is not pool:
            out[name] = sub
    return out


def _walk(v: Any, tensor: Any, seq: Any) -> Any:
    """``v`` rebuilt with ``tensor(t)`` for each tensor and ``seq(items, was_tuple)`` for
    each list or tuple; _UNSUPPORTED when anything in it is not plain state."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, torch.Tensor):
        return tensor(v)
    if isinstance(v, (list, tuple)):
        items = [_walk(x, tensor, seq) for x in v]
        if any(x is _UNSUPPORTED for x in items):
            return _UNSUPPORTED
        return seq(items, isinstance(v, tuple))
    return _UNSUPPORTED


def _tensor_json(v: torch.Tensor) -> dict[str, Any]:
    a = v.detach().to("cpu").contiguous().numpy()
    return {"tensor": str(v.dtype).removeprefix("torch."), "shape": list(a.shape),
            "z": base64.b64encode(zlib.compress(a.tobytes(), 1)).decode()}


def _encode(v: Any) -> Any:
    return _walk(v, _tensor_json, lambda items, was_tuple: {"list": items, "tuple": was_tuple})


def _copy(v: Any) -> Any:
    return _walk(v, lambda t: t.detach().clone(), lambda items, was_tuple: tuple(items) if was_tuple else items)


_UNSUPPORTED = object()
# What a pool's state holds: index and mapping tensors, flags.
_SNAPSHOT_DTYPES = {"int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
                    "bool": np.bool_, "float32": np.float32, "float64": np.float64}
# A pool's state is a few tensors of at most a slot (or page) each, and some padding.
MAX_SNAPSHOT_ELEMENTS = 4 * MAX_POOL_SLOTS + 1024


def _inflate(text: Any, size: int) -> bytes:
    """Decompress a snapshot tensor, stopping at its declared size: a compression bomb
    is refused when it passes that, not after it has filled memory."""
    if not isinstance(text, str) or len(text) > 2 * size + 1024:  # base64 of zlib never grows that much
        raise ValueError("snapshot tensor data is not the size its shape declares")
    inflater = zlib.decompressobj()
    out = inflater.decompress(base64.b64decode(text, validate=True), size)
    if inflater.unconsumed_tail or len(out) != size or not inflater.eof:
        raise ValueError("snapshot tensor data is not the size its shape declares")
    return out


def _decode(v: Any, device: torch.device | str, budget: list[int] | None = None) -> Any:
    """``budget``: elements the snapshot may still hold, spent by each tensor decoded."""
    if not isinstance(v, dict):
        return v
    if "tensor" in v:
        np_dtype = _SNAPSHOT_DTYPES.get(v["tensor"]) if isinstance(v["tensor"], str) else None
        if np_dtype is None:  # a fixed list: the snapshot never names what torch looks up
            raise ValueError(f"snapshot tensor type {str(v['tensor'])[:40]!r} is not one kvreplay writes")
        shape = v["shape"]
        if not (isinstance(shape, list) and len(shape) <= 4 and all(type(n) is int and n >= 0 for n in shape)):
            raise ValueError("snapshot tensor shape must be a short list of whole numbers")
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if n > MAX_SNAPSHOT_ELEMENTS:
            raise ValueError(f"snapshot tensor of {n:,} elements is larger than any pool's state "
                             f"(KVREPLAY_MAX_POOL_SLOTS raises the limit)")
        if budget is not None:
            budget[0] -= n
            if budget[0] < 0:
                raise ValueError(f"the snapshot holds more than a pool of this size keeps (a tensor of {n:,} "
                                 "elements past the rest)")
        raw = _inflate(v["z"], n * np.dtype(np_dtype).itemsize)
        a = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        return torch.from_numpy(a.copy()).to(device)
    items = [_decode(x, device, budget) for x in v["list"]]
    return tuple(items) if v.get("tuple") else items


def capture(pool: Any) -> dict[str, dict[str, Any]]:
    """The pool's state now, as copies that stay on the pool's device: no host sync,
    cheap enough for a flight recorder's periodic snapshot. ``encode`` makes it JSON.
    Call it between allocator calls, never inside one."""
    state: dict[str, dict[str, Any]] = {}
    for name, obj in _objects(pool).items():
        attrs = {}
        for key, value in vars(obj).items():
            if key in _SKIP or callable(value) and not isinstance(value, torch.Tensor):
                continue
            copied = _copy(value)
            if copied is not _UNSUPPORTED:
                attrs[key] = copied
        state[name] = attrs
    return state


def encode(captured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A ``capture`` as the JSON a trace's ``initial_state`` holds (copies to the host)."""
    return {"format": FORMAT, "objects": {name: {k: _encode(v) for k, v in attrs.items()}
                                          for name, attrs in captured.items()}}


def take(pool: Any) -> dict[str, Any]:
    """``encode(capture(pool))``: the pool's state now, as JSON."""
    return encode(capture(pool))


def restore(pool: Any, snapshot: dict[str, Any]) -> list[str]:
    """Set the snapshot's state on a freshly built ``pool``; returns the attributes
    the build does not have (restored anyway is wrong: they are reported, not set)."""
    if snapshot.get("format") != FORMAT:
        raise ValueError(f"snapshot format {snapshot.get('format')!r} is not {FORMAT}")
    missing = []
    objects = _objects(pool)
    budget = [_state_elements(objects)]
    for name, attrs in snapshot["objects"].items():
        obj = objects.get(name)
        if obj is None:
            missing.append(name)
            continue
        device = getattr(obj, "device", "cpu")
        own = vars(obj)
        for key, enc in attrs.items():
            if key not in own:  # state the build keeps elsewhere (or not at all): setting it would do nothing
                missing.append(f"{name}.{key}")
                continue
            value = _decode(enc, device, budget)
            if not _same_kind(own[key], value):
                raise ValueError(f"snapshot {name}.{key} is a {type(value).__name__}, where the pool keeps a "
                                 f"{type(own[key]).__name__}")
            setattr(obj, key, value)
    return missing


def _state_elements(objects: dict[str, Any]) -> int:
    """What a snapshot of these pools can hold at most: each keeps a few tensors of at
    most a slot (or page) each, so eight times the largest pool's slots, and some slack.
    A snapshot past it is damage (decoding it is what a compression bomb wants)."""
    sizes = [int(v) for o in objects.values() for k in ("size", "size_swa")
             if isinstance(v := getattr(o, k, 0), int) and not isinstance(v, bool)]
    return 8 * max(sizes, default=0) + 4096


def _same_kind(now: Any, restored: Any) -> bool:
    """A snapshot value may replace a pool's attribute only with one of its kind: a tensor
    of the same element type and rank, a number, a flag, a list, or what was None."""
    if isinstance(now, torch.Tensor):
        return isinstance(restored, torch.Tensor) and restored.dtype == now.dtype and restored.dim() == now.dim()
    if now is None or restored is None:
        return True
    if isinstance(now, bool) or isinstance(restored, bool):
        return type(now) is type(restored)
    if isinstance(now, (int, float)):
        return isinstance(restored, (int, float))
    if isinstance(now, (list, tuple)):
        return isinstance(restored, (list, tuple))
    return type(now) is type(restored)


def matches(pool: Any, snapshot: dict[str, Any]) -> bool:
    """Whether ``pool`` holds exactly the snapshot's state (every attribute it names)."""
    if snapshot.get("format") != FORMAT:
        return False
    objects = _objects(pool)
    for name, attrs in snapshot["objects"].items():
        obj = objects.get(name)
        if obj is None:
            return False
        own = vars(obj)
        for key, enc in attrs.items():
            if key not in own or not _same(own[key], _decode(enc, "cpu")):
                return False
    return True


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach().cpu(), b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


__all__ = ["FORMAT", "capture", "encode", "matches", "restore", "take"]
