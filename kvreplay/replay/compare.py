"""What a call returned, compared and shown: the one definition of "the same
result" (strict: equal values; remap: what a caller can tell apart), and a value
as JSON (numbers, lists, null) or as one short line of text."""

from __future__ import annotations

from typing import Any

import torch

MAX_SHOWN = 16  # slots shown of a longer index tensor


def same(a: Any, b: Any) -> bool:
    """Strict equality: tensors element by element (any int dtype, any device)."""
    ta, tb = type(a) is torch.Tensor, type(b) is torch.Tensor
    if ta and tb:
        if a.dtype == b.dtype and a.device == b.device:
            return bool(torch.equal(a, b))  # also compares shapes
        return a.shape == b.shape and bool(torch.equal(a.to(torch.int64).cpu(), b.to(torch.int64).cpu()))
    if ta or tb or isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def exception_difference(recorded: str | None, raised: BaseException | None) -> tuple[str | None, str | None]:
    """(the exception type the build raised or None, why that differs from the recorded
    one, or None when it is the same): a raise against a return is a divergence in
    every mode."""
    got = type(raised).__name__ if raised is not None else None
    if got == recorded:
        return got, None
    return got, (f"recorded {recorded or 'a return'}, build gave {got or 'a return'}"
                 + (f": {raised}" if raised is not None else ""))


def block_remap_difference(recorded: Any, got: Any) -> str | None:
    """Remap equality for a block pool's answers: the block ids are the build's own and
    so are its prefix hits (their length, the tokens they cover), which another build or
    a trace with calls removed finds differently; what a caller can still tell apart is
    an answer against None (an allocation that did not fit)."""
    if (recorded is None) != (got is None):
        return "None where the recording has a value, or the reverse"
    return None


def remap_difference(recorded: Any, got: Any) -> str | None:
    """Remap equality, the one definition (the replayer's and ``diff``'s): what a caller
    can tell apart when slot numbers are the build's own. None where ``got`` is alike
    ``recorded``, else why not: a value where the recording has None or the reverse,
    an index tensor of another length, a tensor against something else, another value."""
    if (recorded is None) != (got is None):
        return "None where the recording has a value, or the reverse"
    rt, gt = isinstance(recorded, torch.Tensor), isinstance(got, torch.Tensor)
    if rt and gt:
        return None if recorded.numel() == got.numel() else "result length differs"
    if rt or gt:
        return "an index tensor where the recording has another kind of value, or the reverse"
    return None if recorded == got else "result differs from the recording"


def alike(a: Any, b: Any) -> bool:
    """Remap equality (``remap_difference``) as a yes or no."""
    return remap_difference(a, b) is None


def outcome_difference(a: tuple[BaseException | None, Any], b: tuple[BaseException | None, Any],
                       mode: str) -> str | None:
    """How two outcomes (raised, returned) of one call differ: ``exception``,
    ``result`` or None when they agree under ``mode``."""
    (ra, va), (rb, vb) = a, b
    if (ra is None) != (rb is None):
        return "exception"
    if ra is not None:
        return "exception" if type(ra) is not type(rb) else None
    return None if (same(va, vb) if mode == "strict" else alike(va, vb)) else "result"


def json_value(v: Any) -> Any:
    """A value as JSON: numbers and strings as they are, None as null, an index
    tensor as its list of slots (the first MAX_SHOWN and a count when longer),
    segments as [{"start", "slots"}], an exception as its type name."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, BaseException):
        return type(v).__name__
    if isinstance(v, torch.Tensor):
        flat = v.reshape(-1)
        n = flat.numel()
        if n <= MAX_SHOWN:
            return flat.tolist()
        return {"len": n, "first": flat[:MAX_SHOWN].tolist()}
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Tensor) for x in v):
            return [{"start": int(s), "slots": json_value(t)} for t, s in v]
        return [json_value(x) for x in v]
    return str(v)


def text_value(v: Any) -> str:
    """One short line for a value (or its JSON form), for people."""
    if isinstance(v, torch.Tensor) or (isinstance(v, list) and v and isinstance(v[0], tuple)):
        v = json_value(v)
    if isinstance(v, dict) and "len" in v:
        return f"{v['len']} values [{', '.join(map(str, v['first'][:8]))}, ...]"
    if isinstance(v, list) and v and isinstance(v[0], dict) and "slots" in v[0]:
        return f"{len(v)} segment(s)"
    if isinstance(v, list):  # slot indices, or a block pool's wire values: counted, not named
        shown = ", ".join(map(str, v[:8]))
        return f"{len(v)} values [{shown}{', ...' if len(v) > 8 else ''}]" if len(v) != 1 else f"[{shown}]"
    if v is None:
        return "None"
    return str(v)
