"""The corpus manifest (``manifest.json``): its schema, reading it and writing it.

The manifest lists, per trace, its file, how it was made, its hash and, per
build, what replaying it must show: ``"status": "clean"``, or the violations that
must appear, each named by invariant and rule and optionally pinned to the method
and the call (``call``, 1..N) of the first violation of that rule: the call that
creates the bad state. Every command that reads a corpus reads it here."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput

MANIFEST = "manifest.json"
VERSION = 2  # 2: violations pinned by call number (1: by row seq)


@dataclass
class ExpectedViolation:
    invariant: str
    rule: str | None = None
    method: str | None = None
    call: int | None = None

    def describe(self) -> str:
        s = self.invariant + (f"/{self.rule}" if self.rule else "")
        where = " ".join(x for x in (f"call #{self.call}" if self.call is not None else "", self.method or "") if x)
        return s + (f" at {where}" if where else "")


@dataclass
class Expectation:
    build: str
    status: str  # clean | violation
    modes: list[str] = field(default_factory=lambda: ["strict"])
    violations: list[ExpectedViolation] = field(default_factory=list)
    capacity_assert_call: int | None = None

    def describe(self) -> str:
        if self.status == "clean":
            return "clean"
        return "violation: " + ", ".join(v.describe() for v in self.violations)


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
    if not path.is_file():
        if missing_ok:
            return {"version": VERSION, "traces": []}
        raise BadInput(f"{path}: no corpus manifest")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: not a readable JSON manifest ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traces"), list):
        raise BadInput(f"{path}: a manifest is an object with a list of traces")
    return doc


def _expectation(d: dict[str, Any], where: str) -> Expectation:
    try:
        status = d["status"]
        if status not in ("clean", "violation"):
            raise ValueError(f"status must be clean or violation, not {status!r}")
        vs = [ExpectedViolation(**v) for v in d.get("violations", [])]
        if status == "violation" and not vs:
            raise ValueError("a violation expectation must name at least one violation")
        return Expectation(build=d["build"], status=status, modes=list(d.get("modes", ["strict"])), violations=vs,
                           capacity_assert_call=d.get("capacity_assert_call"))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{where}: bad expectation ({exc})") from None


def load_manifest(corpus: str | Path) -> list[CorpusEntry]:
    path = manifest_path(corpus)
    doc = read_document(path)
    try:
        entries = []
        for t in doc["traces"]:
            where = f"{path}: trace {t.get('name', '?')}"
            entries.append(CorpusEntry(name=t["name"], file=path.parent / t["file"], command=t.get("command", ""),
                                       sha256=t.get("sha256", ""), summary=t.get("summary", ""),
                                       expect=[_expectation(e, where) for e in t["expect"]]))
        return entries
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadInput(f"{path}: bad manifest ({type(exc).__name__}: {exc})") from None


def write_document(corpus: Path, doc: dict[str, Any]) -> None:
    """Write the manifest atomically (never half-written), keeping its permissions."""
    path = corpus / MANIFEST
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=corpus)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.chmod(tmp, mode)
    os.replace(tmp, path)
