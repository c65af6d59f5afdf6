"""Write a trace as a standalone pytest file a pool engineer can read: it builds the
pool, makes the calls one per line, and asserts the invariant through CheckedPool.

Slots the pool handed out are not written as numbers: a call that frees or extends
them names them as slices of the earlier result (``r3[4:8]``), so the test means the
same on a build that hands out other slots. Only values no call handed out (``-1``
for "no prefix", SWA-side slots, page ids) are literals."""

from __future__ import annotations

import keyword
import re
from pathlib import Path
from typing import Any

import torch

from kvreplay.check.rules import INVARIANTS
from kvreplay.contract.record import Vocabulary
from kvreplay.contract.registry import all_methods, family
from kvreplay.errors import BadInput
from kvreplay.trace.format import TopCall
from kvreplay.trace.reader import TraceReader

MAX_LITERAL = 64  # longer literal tensors are written as ranges where they are ones


class _Slots:
    """Which earlier result (variable, position) each full-pool slot came from."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.where: dict[int, tuple[str, int]] = {}
        self.vocabulary = vocabulary  # the family's: which calls hand out slots, which arguments name them

    def learn(self, var: str, result: torch.Tensor) -> None:
        for pos, slot in enumerate(result.reshape(-1).tolist()):
            self.where[slot] = (var, pos)

    def expr(self, t: torch.Tensor) -> str:
        values = t.reshape(-1).tolist()
        pieces: list[str] = []
        i = 0
        while i < len(values):
            src = self.where.get(values[i])
            j = i + 1
            if src is None:
                while j < len(values) and self.where.get(values[j]) is None:
                    j += 1
                pieces.append(_literal(values[i:j]))
            else:
                var, pos = src
                while j < len(values) and self.where.get(values[j]) == (var, pos + (j - i)):
                    j += 1
                pieces.append(f"{var}[{pos}:{pos + j - i}]")
            i = j
        if not pieces:
            return "torch.empty(0, dtype=torch.int64)"
        e = pieces[0] if len(pieces) == 1 else f"torch.cat([{', '.join(pieces)}])"
        if t.dtype != torch.int64:
            e += f".to({t.dtype})"
        return e if t.dim() <= 1 else f"{e}.reshape({tuple(t.shape)})"


def _literal(values: list[int]) -> str:
    if len(values) > 2 and values == list(range(values[0], values[0] + len(values))):
        return f"torch.arange({values[0]}, {values[0] + len(values)})"
    return f"torch.tensor({values})"


def _value(name: str, v: Any, slots: _Slots) -> str:
    if isinstance(v, torch.Tensor):
        if name in slots.vocabulary.slot_args:
            return slots.expr(v)
        vals = v.reshape(-1).tolist()
        dtype = "" if v.dtype == torch.int64 else f", dtype={v.dtype}"
        if v.dtype == torch.bool:
            return f"torch.tensor({vals}{dtype})"
        lit = _literal(vals) if not dtype else f"torch.tensor({vals}{dtype})"
        return lit if v.dim() <= 1 else f"{lit}.reshape({tuple(v.shape)})"
    if isinstance(v, list) and v and isinstance(v[0], tuple):  # segments
        return "[" + ", ".join(f"({slots.expr(t)}, {s})" for t, s in v) + "]"
    return repr(v)


def _comment(text: str) -> str:
    """Text for a one-line comment: no line breaks (a newline would end the comment)."""
    return " ".join(text.split())


def _call_line(i: int, tc: TopCall, slots: _Slots, note: str = "") -> tuple[list[str], str | None]:
    c = tc.call
    if c.method not in all_methods():
        raise BadInput(f"call #{tc.number} names {c.method!r}, not a method of the allocator API")
    bad = [k for k in c.args if not k.isidentifier() or keyword.iskeyword(k)]
    if bad:
        raise BadInput(f"call #{tc.number} has an argument named {bad[0]!r}, which is not a Python name")
    args = [f"{k}={_value(k, v, slots)}" for k, v in c.args.items()]
    var = f"r{i}" if c.method in slots.vocabulary.allocs and isinstance(c.result, torch.Tensor) else None
    head = f"    {var} = pool.{c.method}(" if var else f"    pool.{c.method}("
    one_line = head + ", ".join(args) + ")"
    lines = [f"    # {_comment(note)}"] if note else []
    if len(one_line) <= 110:
        lines.append(one_line)
    else:
        lines += [head, *(f"        {a}," for a in args), "    )"]
    if var:
        n = c.result.numel()
        lines.append(f'    assert {var} is not None and {var}.numel() == {n}, "{c.method} should hand out {n} slot(s)"')
    return lines, var


def _test_name(failure: Any) -> str:
    name = re.sub(r"\W+", "_", f"test_{failure.id}_on_{failure.method_kind}").lower()
    return name + "_" if keyword.iskeyword(name) else name


def render(trace: str | Path, *, build: str, failure: Any, source: str = "", failing_call: int | None = None,
           shows: str = "") -> str:
    """The pytest source for ``trace`` (a minimal one: every call becomes a line);
    the call numbered ``failing_call`` gets a comment saying what ``build`` does there."""
    reader = TraceReader(trace)
    meta = reader.meta
    calls = [tc for tc in reader.top_calls() if tc.number]
    if len(calls) > 500:
        raise BadInput(f"{Path(trace).name} has {len(calls)} calls; write a test from a minimized trace")
    slots = _Slots(family(meta.family).vocabulary)
    body: list[str] = []
    for i, tc in enumerate(calls):
        note = f"on {build}: {shows}" if tc.number == failing_call and shows else ""
        lines, var = _call_line(i, tc, slots, note)
        body.extend(lines)
        if var:
            slots.learn(var, tc.call.result)
    rule = INVARIANTS.get(failure.id, failure.id)
    # Every value that comes from the trace, its file name or the command line enters the
    # file as a Python literal (repr) or a one-line comment: never as code or docstring text.
    return f'''"""Reproducer written by `kvreplay minimize` ({len(calls)} calls).

It fails on MINIMIZED_ON with FAILURE (RULE says what the invariant is). Run it on
another build with KVREPLAY_BUILD, e.g. `KVREPLAY_BUILD=builtin:swa pytest THIS_FILE`;
the minimal trace TRACE replays the same calls with `kvreplay replay`.
"""

import os

import torch

from kvreplay import CheckedPool

SOURCE = {Path(source).name if source else ""!r}
TRACE = {Path(trace).name!r}
MINIMIZED_ON = {build!r}
FAILURE = {str(failure)!r}
RULE = {rule!r}
BUILD = os.environ.get("KVREPLAY_BUILD", MINIMIZED_ON)
CTOR = {meta.ctor_args!r}


def {_test_name(failure)}():
    pool = CheckedPool(BUILD, family={meta.family!r}, ctor=CTOR, invariant={failure.id!r})
{chr(10).join(body)}
    pool.finish()
'''


def write_reproducer(trace: str | Path, path: str | Path, *, build: str, failure: Any, source: str = "",
                     failing_call: int | None = None, shows: str = "") -> Path:
    path = Path(path)
    if not path.parent.is_dir():
        raise BadInput(f"{path.parent}: no such directory for --emit-test")
    text = render(trace, build=build, failure=failure, source=source, failing_call=failing_call, shows=shows)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    tmp.replace(path)
    return path


__all__ = ["render", "write_reproducer"]
