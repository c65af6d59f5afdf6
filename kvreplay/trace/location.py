"""Where traces live: a local path, or a URI that pyarrow's filesystems understand
(s3://, gs://, hdfs://, abfs://, file://), and hive-partitioned corpora
(``host=a/date=2026-11-30/rank=3/trace.parquet``).

A remote trace is fetched once into a local mirror (``~/.cache/kvreplay/remote/
SCHEME/BUCKET/KEY``, or ``$KVREPLAY_REMOTE_CACHE``) and read from there: a replay
reads every row group anyway, segments and workers reread it, and a mirrored file
whose size and modification time still match the store's is not fetched again.
Credentials and endpoints are pyarrow's (for S3: the AWS_* environment, including
AWS_ENDPOINT_URL for an S3-compatible server); a URI's query options
(``?endpoint_override=...``) are passed to the filesystem as pyarrow reads them."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvreplay.errors import BadInput

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_PARTITION = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.*)$")
TRACE_SUFFIX = ".parquet"


def scheme_of(location: str | os.PathLike[str]) -> str | None:
    m = _SCHEME.match(str(location))
    return m.group(1).lower() if m else None


def is_remote(location: str | os.PathLike[str]) -> bool:
    """A URI of a filesystem other than this machine's."""
    return scheme_of(location) not in (None, "file")


def _filesystem(uri: str):  # noqa: ANN202 - pyarrow.fs types, imported lazily
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError, TypeError) as exc:
        raise BadInput(f"{uri}: not a location pyarrow can open ({_first_line(exc)})") from None


def cache_root() -> Path:
    return Path(os.environ.get("KVREPLAY_REMOTE_CACHE") or Path.home() / ".cache" / "kvreplay" / "remote")


def _mirror_of(uri: str) -> Path:
    scheme = scheme_of(uri) or "file"
    rest = uri.split("://", 1)[1].split("?", 1)[0].strip("/")
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
    return cache_root().joinpath(scheme, *parts)


def local_path(location: str | os.PathLike[str]) -> Path:
    """A path on this machine holding ``location``: the path itself, a file:// URI's
    path, or the local mirror of a remote file or directory (fetched as needed)."""
    text = str(location)
    if scheme_of(text) == "file":
        return Path(text.split("://", 1)[1].split("?", 1)[0])
    if not is_remote(text):
        return Path(location)
    import pyarrow.fs as pafs

    fs, path = _filesystem(text)
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        raise BadInput(f"{text}: cannot read it ({_first_line(exc)})") from None
    if info.type == pafs.FileType.NotFound:
        raise BadInput(f"{text}: no such file or directory")
    mirror = _mirror_of(text)
    if info.type == pafs.FileType.Directory:
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        except OSError as exc:
            raise BadInput(f"{text}: cannot list it ({_first_line(exc)})") from None
        mirror.mkdir(parents=True, exist_ok=True)
        for f in infos:
            if f.type == pafs.FileType.File:
                rel = f.path[len(path.rstrip("/")) + 1:]
                _fetch(fs, f, mirror / rel, text)
        return mirror
    _fetch(fs, info, mirror, text)
    return mirror


def _fetch(fs, info, dest: Path, uri: str) -> None:  # noqa: ANN001
    """Copy one remote file to ``dest`` unless the mirror already has this version."""
    stamp = dest.with_name(f".{dest.name}.source")
    version = {"size": info.size, "mtime_ns": info.mtime_ns}
    if dest.is_file() and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == version:
                return
        except (OSError, ValueError):
            pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as out, fs.open_input_stream(info.path) as src:
            shutil.copyfileobj(src, out, 1 << 22)
        os.replace(tmp, dest)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise BadInput(f"{uri}: cannot fetch {info.path} ({_first_line(exc)})") from None
    stamp.write_text(json.dumps(version))


def publish(local: Path, location: str) -> None:
    """Put a finished local file (or directory of parts) at a remote ``location``."""
    if not is_remote(location):
        return
    fs, path = _filesystem(location)
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    try:
        for f in files:
            key = path if local.is_file() else f"{path.rstrip('/')}/{f.relative_to(local).as_posix()}"
            with open(f, "rb") as src, fs.open_output_stream(key) as out:
                shutil.copyfileobj(src, out, 1 << 22)
    except OSError as exc:
        raise BadInput(f"{location}: cannot write it ({_first_line(exc)})") from None


def output_path(location: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """Where a command writes a trace asked for at ``location``: the local path, and
    the remote URI to ``publish`` it to afterwards (None for a local one)."""
    text = str(location)
    if scheme_of(text) == "file":
        return Path(text.split("://", 1)[1]), None
    if not is_remote(text):
        return Path(location), None
    _filesystem(text)  # a bad URI fails before any work
    staging = cache_root() / "outgoing" / uuid.uuid4().hex
    staging.mkdir(parents=True, exist_ok=True)
    return staging / Path(text.split("?", 1)[0]).name, text


@dataclass(frozen=True)
class CorpusTrace:
    """One trace of a directory corpus: where it is (as given: a path or a URI), its
    name inside the corpus, and the hive partition keys on its path."""

    location: str
    name: str
    partition: dict[str, str] = field(default_factory=dict)


def partition_of(relative: str) -> dict[str, str]:
    """``{"host": "a", "rank": "3"}`` from ``host=a/rank=3/t.parquet``."""
    out = {}
    for part in relative.split("/")[:-1]:
        m = _PARTITION.match(part)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def is_rotated_trace(directory: Path) -> bool:
    from kvreplay.trace.format import PART_GLOB

    return any(directory.glob(PART_GLOB))


def corpus_traces(location: str | os.PathLike[str]) -> list[CorpusTrace]:
    """The traces of a directory corpus, in path order: every *.parquet file under it
    (a directory of rotated parts is one trace), each with its partition keys."""
    root = local_path(location)
    if not root.is_dir():
        raise BadInput(f"{location}: not a directory of traces")
    base = str(location).rstrip("/")
    found: list[CorpusTrace] = []
    seen_rotated: set[Path] = set()
    rotated: dict[Path, bool] = {}  # asked once a directory: a trace of 20,000 parts is one question
    for p in sorted(root.rglob(f"*{TRACE_SUFFIX}")):
        if any(part.startswith(".") for part in p.relative_to(root).parts):
            continue  # the mirror's bookkeeping, partial files
        if p.parent not in rotated:
            rotated[p.parent] = is_rotated_trace(p.parent)
        where = p.parent if rotated[p.parent] and p.parent != root else p
        if where in seen_rotated:
            continue
        if where is not p:
            seen_rotated.add(where)
        rel = where.relative_to(root).as_posix()
        loc = f"{base}/{rel}" if is_remote(base) else str(where)
        found.append(CorpusTrace(loc, rel, partition_of(rel + ("/x" if where is not p else ""))))
    if not found:
        raise BadInput(f"{location}: holds no traces (*{TRACE_SUFFIX})")
    return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["CorpusTrace", "cache_root", "corpus_traces", "is_remote", "local_path", "output_path",
           "partition_of", "publish"]
