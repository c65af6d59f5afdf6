"""The corpus manifest (``manifest.json``): its schema, reading it and writing it.

The manifest lists, per trace, its file, how it was made, its hash and, per
build, what replaying it must show: ``"status": "clean"``, or the violations that
must appear, each named by invariant and rule and optionally pinned to the method
and the call (``call``, 1..N) of the first violation of that rule: the call that
creates the bad state; or, for a build that breaks no rule but answers otherwise
(another block order), ``"status": "divergence"`` and the first divergence's kind,
method and call. A violation expectation may pin a first divergence too: a build that
breaks a rule and, elsewhere, answers otherwise. Every command that reads a corpus reads
it here."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput, did_you_mean
from kvreplay.safe_files import read_regular, write_atomic
from kvreplay.trace.format import parse_json

MANIFEST = "manifest.json"
VERSION = 2  # 2: violations pinned by call number (1: by row seq)
# About 2,400 entries of 1.7 KB, far more than a corpus holds; parsing 4 MiB of the
# most costly JSON (empty objects) takes about 270 MB and 5 s, 16 MiB would take 900 MB.
MAX_MANIFEST_BYTES = 4 << 20


def _at(call: int | None, method: str | None) -> str:
    """`` at call #N method`` for an expectation pinned to a call, a method or both."""
    where = " ".join(x for x in (f"call #{call}" if call is not None else "", method or "") if x)
    return f" at {where}" if where else ""


@dataclass
class ExpectedViolation:
    invariant: str
    rule: str | None = None
    method: str | None = None
    call: int | None = None

    def describe(self) -> str:
        return self.invariant + (f"/{self.rule}" if self.rule else "") + _at(self.call, self.method)


@dataclass
class ExpectedDivergence:
    kind: str
    method: str | None = None
    call: int | None = None

    def describe(self) -> str:
        return self.kind + _at(self.call, self.method)


@dataclass
class Expectation:
    build: str
    status: str  # clean | violation | divergence
    modes: list[str] = field(default_factory=lambda: ["strict"])
    violations: list[ExpectedViolation] = field(default_factory=list)
    capacity_assert_call: int | None = None
    divergence: ExpectedDivergence | None = None  # the first one (status divergence, or beside violations)

    def describe(self) -> str:
        if self.status == "clean":
            return "clean"
        if self.status == "divergence" and self.divergence is not None:
            return "divergence: " + self.divergence.describe()
        also = f"; divergence: {self.divergence.describe()}" if self.divergence is not None else ""
        return "violation: " + ", ".join(v.describe() for v in self.violations) + also


@dataclass
class CorpusEntry:
    name: str
    file: Path
    command: str
    sha256: str
    summary: str
    expect: list[Expectation]


def manifest_path(corpus: str | Path) -> Path:
    root = Path(corpus)
    return root / MANIFEST if root.is_dir() else root


def read_document(corpus: str | Path, *, missing_ok: bool = False) -> dict[str, Any]:
    """The manifest as JSON (a new, empty one when ``missing_ok`` and there is none)."""
    path = manifest_path(corpus)
    if not os.path.lexists(path):  # a FIFO, a device or a dangling link there is not "no manifest"
        if missing_ok:
            return {"version": VERSION, "traces": []}
        raise BadInput(f"{path}: no corpus manifest")
    raw = read_regular(path, MAX_MANIFEST_BYTES, "corpus manifest")
    try:
        doc = parse_json(raw.decode(), "the manifest")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{path}: not a readable JSON manifest ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traces"), list):
        raise BadInput(f"{path}: a manifest is an object with a list of traces")
    return doc


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")
_TOP_KEYS = {"version": False, "traces": True}
_ENTRY_KEYS = {"name": True, "file": True, "sha256": True, "expect": True, "command": False, "summary": False}
_EXPECT_KEYS = {"build": True, "status": True, "modes": False, "violations": False, "capacity_assert_call": False,
                "divergence": False}
_VIOLATION_KEYS = {"invariant": True, "rule": False, "method": False, "call": False}
_DIVERGENCE_KEYS = {"kind": True, "method": False, "call": False}
_STATUSES = ("clean", "violation", "divergence")
_MODES = ("strict", "remap")


def _keys(d: Any, allowed: dict[str, bool], where: str) -> dict[str, Any]:
    """``d`` as an object with only the allowed keys and every required one."""
    if not isinstance(d, dict):
        raise BadInput(f"{where}: must be an object, not {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        hint = did_you_mean(unknown[0], allowed)
        raise BadInput(f"{where}: unknown key {unknown[0]!r}{hint}")
    missing = [k for k, required in allowed.items() if required and k not in d]
    if missing:
        raise BadInput(f"{where}: missing key {missing[0]!r}")
    return d


def _of(value: Any, kind: type | tuple[type, ...], what: str, where: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadInput(f"{where}: {what} has the wrong type ({type(value).__name__})")
    return value


def _violation(d: Any, where: str) -> ExpectedViolation:
    from kvreplay.check.rules import INVARIANTS, RULES  # the checker's vocabulary

    d = _keys(d, _VIOLATION_KEYS, where)
    inv = _of(d["invariant"], str, "invariant", where)
    if inv not in INVARIANTS:
        raise BadInput(f"{where}: unknown invariant {inv!r}{did_you_mean(inv, INVARIANTS)}")
    rule = d.get("rule")
    if rule is not None and f"{inv}/{_of(rule, str, 'rule', where)}" not in RULES:
        raise BadInput(f"{where}: {inv} has no rule {rule!r}")
    return ExpectedViolation(inv, rule, *_method_and_call(d, where))


def _method_and_call(d: dict[str, Any], where: str) -> tuple[str | None, int | None]:
    """The optional ``method`` and ``call`` that pin an expected violation or divergence."""
    method = d.get("method")
    if method is not None:
        _of(method, str, "method", where)
    call = d.get("call")
    if call is not None and (_of(call, int, "call", where) < 1):
        raise BadInput(f"{where}: call numbers start at 1")
    return method, call


def _divergence(d: Any, where: str) -> ExpectedDivergence:
    from kvreplay.replay.divergence import DIVERGENCE_KINDS  # the replayer's vocabulary

    d = _keys(d, _DIVERGENCE_KEYS, where)
    kind = _of(d["kind"], str, "kind", where)
    if kind not in DIVERGENCE_KINDS:
        raise BadInput(f"{where}: unknown divergence kind {kind[:40]!r}{did_you_mean(kind, DIVERGENCE_KINDS)}")
    return ExpectedDivergence(kind, *_method_and_call(d, where))


def _expectation(d: Any, where: str) -> Expectation:
    d = _keys(d, _EXPECT_KEYS, where)
    build = _of(d["build"], str, "build", where)
    status = d["status"]
    if status not in _STATUSES:
        raise BadInput(f"{where}: status must be clean, violation or divergence, not {str(status)[:40]!r}")
    if status == "divergence" and "divergence" not in d:
        raise BadInput(f"{where}: a divergence expectation names its first divergence")
    if status == "clean" and "divergence" in d:
        raise BadInput(f"{where}: a clean expectation names no divergence")
    modes = _of(d.get("modes", ["strict"]), list, "modes (a list)", where)
    if not modes or any(m not in _MODES for m in modes) or len(set(modes)) != len(modes):
        raise BadInput(f"{where}: modes must be a list of distinct modes among {', '.join(_MODES)}")
    vs = [_violation(v, f"{where}, violation {i + 1}")
          for i, v in enumerate(_of(d.get("violations", []), list, "violations (a list)", where))]
    if status == "violation" and not vs:
        raise BadInput(f"{where}: a violation expectation must name at least one violation")
    cap = d.get("capacity_assert_call")
    if cap is not None:
        _of(cap, int, "capacity_assert_call", where)
    div = _divergence(d["divergence"], f"{where}, divergence") if "divergence" in d else None
    return Expectation(build=build, status=status, modes=list(modes), violations=vs, capacity_assert_call=cap,
                       divergence=div)


def _entry(t: Any, path: Path, index: int) -> CorpusEntry:
    where = f"{path.name}: trace {index + 1}"
    t = _keys(t, _ENTRY_KEYS, where)
    name = _of(t["name"], str, "name", where)
    if not NAME.fullmatch(name):
        raise BadInput(f"{where}: name {name[:40]!r} must be 1-128 letters, digits, . _ @ + or -")
    where = f"{path.name}: trace {name}"
    file = _of(t["file"], str, "file", where)
    if not NAME.fullmatch(file) or not file.endswith(".parquet"):
        raise BadInput(f"{where}: file {file[:60]!r} must be a .parquet file name in the corpus directory")
    sha = _of(t["sha256"], str, "sha256", where)
    if not SHA256.fullmatch(sha):
        raise BadInput(f"{where}: sha256 must be 64 lower-case hex digits")
    expect = [_expectation(e, f"{where}, expectation {i + 1}")
              for i, e in enumerate(_of(t["expect"], list, "expect (a list)", where))]
    return CorpusEntry(name=name, file=path.parent / file, command=_of(t.get("command", ""), str, "command", where),
                       sha256=sha, summary=_of(t.get("summary", ""), str, "summary", where), expect=expect)


def check_entry(entry: dict[str, Any], corpus: str | Path) -> CorpusEntry:
    """A new entry held to the manifest's schema before it is written: what ``corpus
    add`` takes from a trace (its footer's command) must not make the manifest unreadable."""
    return _entry(entry, manifest_path(corpus), 0)


def load_manifest(corpus: str | Path) -> list[CorpusEntry]:
    """The manifest's entries, checked against its schema: unknown keys, wrong types,
    names that are not plain names, files outside the corpus and duplicate names are
    refused with a one-line error."""
    path = manifest_path(corpus)
    doc = _keys(read_document(path), _TOP_KEYS, path.name)
    version = doc.get("version", 1)
    if version == 1:
        raise BadInput(f"{path}: a version 1 manifest pins violations by row (seq); this kvreplay pins them by "
                       "call: add the traces again with kvreplay corpus add --force")
    if version != VERSION:
        raise BadInput(f"{path}: manifest version {version!r} is not one this kvreplay reads ({VERSION})")
    entries = [_entry(t, path, i) for i, t in enumerate(doc["traces"])]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise BadInput(f"{path.name}: trace {e.name} is listed twice")
        seen.add(e.name)
    return entries


def write_document(corpus: Path, doc: dict[str, Any]) -> None:
    """Write the manifest atomically (never half-written), keeping the permissions of
    the regular file it replaces; a link, a FIFO or a device there is refused."""
    write_atomic(corpus / MANIFEST, (json.dumps(doc, indent=2) + "\n").encode())
