"""Corpus hygiene: ``kvreplay corpus add`` and ``kvreplay corpus check``.

``add`` copies a trace into the corpus, checks it reads, replays it on the builds
given (default: the builtin pool of its family) and writes what they show into the
manifest as its expectations, with the trace's provenance and hash. ``check`` finds
what would make ``kvreplay ci`` meaningless: files without entries, entries without
files, changed files, unreadable files, files over the size limit."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.contract.registry import family
from kvreplay.corpus.expectations import expectation_of
from kvreplay.corpus.manifest import MANIFEST, NAME, check_entry, load_manifest, read_document, write_document
from kvreplay.errors import BadInput
from kvreplay.replay.dispatch import replay
from kvreplay.safe_files import check_destination, open_regular, write_atomic
from kvreplay.trace.hashing import CHUNK, content_hash
from kvreplay.trace.reader import TraceReader

DEFAULT_MAX_MB = 5.0


def add_trace(trace: str | Path, name: str, corpus: str | Path = "traces", builds: list[str] | None = None,
              force: bool = False, max_mb: float = DEFAULT_MAX_MB) -> dict[str, Any]:
    """Copy ``trace`` into ``corpus`` as NAME.parquet and give it a manifest entry."""
    corpus, trace = Path(corpus), Path(trace)
    if not NAME.fullmatch(name):
        raise BadInput(f"bad corpus name {name[:40]!r}: use 1-128 letters, digits, . _ @ + or -")
    if corpus.exists() and not corpus.is_dir():
        raise BadInput(f"--corpus {corpus}: not a directory")
    dest = corpus / f"{name}.parquet"
    # Refused before the replays, not after: nothing is written through a link or over a FIFO.
    check_destination(dest, "corpus trace")
    check_destination(corpus / MANIFEST, "corpus manifest")
    reader = TraceReader(trace)  # unreadable input fails here, before anything is copied
    if trace.is_dir():  # a recording's trace is a directory of parts; the corpus holds files
        if len(reader.parts) > 1:
            raise BadInput(f"{trace} is a rotated trace of {len(reader.parts)} parts; the corpus holds one file "
                           f"per entry: add a part ({reader.parts[0].name}, ...) or record a shorter run")
        trace = reader.parts[0]  # one part is the whole trace, footer and all
    size_mb = trace.stat().st_size / 1e6
    if size_mb > max_mb:
        raise BadInput(f"{trace} is {size_mb:.1f} MB, over the corpus limit of {max_mb} MB (--max-mb)")
    manifest = read_document(corpus, missing_ok=True)
    if any(e["name"] == name for e in manifest["traces"]) and not force:
        raise BadInput(f"{name} is already in {corpus / MANIFEST} (--force replaces it)")
    builds = builds or [family(reader.meta.family).default_build]
    expect = [expectation_of(replay(trace, b, device="cpu")) for b in builds]
    extra = reader.meta.extra or {}
    command = extra.get("command")  # the trace's own footer says it: a string, or not used
    entry = {"name": name, "file": dest.name,
             "command": command[:2000] if isinstance(command, str) and command else
             f"kvreplay corpus add {trace} --name {name}",
             "summary": f"added from {trace}: {reader.meta.pool_class} ({reader.meta.family}), "
                        f"{reader.num_rows} rows, recorded on {reader.meta.host or '?'} at {reader.meta.start_time}",
             "expect": expect, "sha256": content_hash(Path(trace))}
    check_entry(entry, corpus)  # before anything is written
    made = not corpus.exists()
    try:
        corpus.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--corpus {corpus}: cannot create it ({exc.strerror or exc})") from None
    existed = os.path.lexists(dest)
    try:
        _copy(trace, dest, entry["sha256"])
        manifest["traces"] = [e for e in manifest["traces"] if e["name"] != name] + [entry]
        write_document(corpus, manifest)
    except BaseException:
        if not existed:  # a trace no entry names would fail corpus check
            dest.unlink(missing_ok=True)
        if made:
            _remove_empty(corpus)
        raise
    return entry


def _remove_empty(directory: Path) -> None:
    try:
        directory.rmdir()  # only when empty: whatever else is there stays
    except OSError:
        pass


def _copy(trace: Path, dest: Path, sha256: str) -> None:
    """Copy the trace that was checked and replayed, and only it: read from a regular
    file, its bytes hashed on the way, the copy refused when they are not the bytes of
    the hash in its entry (the file changed meanwhile). Written beside ``dest`` and
    renamed into place (safe_files.write_atomic)."""
    fd, st = open_regular(trace, "trace")
    digest = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        left = st.st_size  # what was measured against --max-mb; more is another file
        while left > 0 and (chunk := os.read(fd, min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
            yield chunk
        if digest.hexdigest() != sha256:
            raise BadInput(f"{trace} changed while it was being added; add it again")

    try:
        write_atomic(dest, chunks())
    finally:
        os.close(fd)


@dataclass
class CheckResult:
    corpus: str
    entries: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_corpus(corpus: str | Path = "traces", max_mb: float = DEFAULT_MAX_MB) -> CheckResult:
    corpus = Path(corpus)
    if not os.path.lexists(corpus / MANIFEST):
        raise BadInput(f"{corpus}: no {MANIFEST}")
    entries = load_manifest(corpus)
    res = CheckResult(str(corpus), len(entries))
    named = {e.file.name for e in entries}
    for p in sorted(corpus.glob("*.parquet")):
        if p.name not in named and not p.name.startswith("."):
            res.problems.append(f"{p.name}: no manifest entry")
    for e in entries:
        if not e.file.exists():
            res.problems.append(f"{e.name}: {e.file.name} is missing")
            continue
        if not e.file.is_file():
            res.problems.append(f"{e.name}: {e.file.name} is not a regular file")
            continue
        if e.file.stat().st_size > max_mb * 1e6:
            res.problems.append(f"{e.name}: {e.file.stat().st_size / 1e6:.1f} MB, over the {max_mb} MB limit")
            continue
        if content_hash(e.file) != e.sha256:
            res.problems.append(f"{e.name}: {e.file.name} changed since it was added (sha256 differs)")
        try:
            TraceReader(e.file).num_rows  # noqa: B018 - reading the footer is the check
        except BadInput as exc:
            res.problems.append(f"{e.name}: {exc}")
        if not e.expect:
            res.problems.append(f"{e.name}: no expectations")
    return res
