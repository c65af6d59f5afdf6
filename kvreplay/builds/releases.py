"""Engine releases as builds: ``sglang==VERSION`` and ``vllm==VERSION``, and ranges
``ENGINE==A..B``.

A release's code is fetched the way pip gets it (``pip download --no-deps``: its
wheel, or its sdist where there is no wheel for this machine), unpacked once under
the kvreplay cache, and replayed in a worker process with the release's package
first on ``sys.path``. Only the engine's package and the requirement list are kept;
the archive is deleted. An sglang release also gets its import-time pins in an
overlay (builds/overlay.py). A vLLM release keeps its Python files only (its wheel's
compiled kernels are CUDA's, and the KV-cache manager needs none of them) and
imports with the dependencies of the vLLM installed where kvreplay runs: a vLLM
build replays where a vLLM is installed. A range expands to every final and post
release between its ends, inclusive, in version order, from the package index's
own list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from kvreplay.builds.cache import cache_root, made_once, size_of
from kvreplay.builds.overlay import Overlay, exact_pins, overlay_for
from kvreplay.contract.registry import engine as engine_record
from kvreplay.contract.registry import engines, git_engine
from kvreplay.errors import BadInput, BuildUnloadable

# Digits, dots and a post segment: what a release spec may hand to pip, nothing else.
_VERSION = re.compile(r"^\d+(\.\d+){1,3}(\.post\d+)?$")
_INDEX_TTL_S = 24 * 3600


def check_version(text: str, engine: str | None = None) -> str:
    """The version of ``ENGINE==VERSION``, or BadInput."""
    engine = engine or git_engine()
    if not _VERSION.match(text):
        rec = engine_record(engine)
        e = rec.example if rec is not None else "1.0"
        raise BadInput(f"{engine}=={text}: not a release version (expected e.g. {engine}=={e} or {e}.post1)")
    return text


def engine_of(spec: str) -> str | None:
    """The engine a release spec (or range) names, else None."""
    return next((e.name for e in engines() if spec.startswith(f"{e.name}==")), None)


def is_range(spec: str) -> bool:
    return engine_of(spec) is not None and ".." in spec


def available_versions(engine: str | None = None) -> list[str]:
    """The engine's final and post releases on the package index, oldest first (cached a day)."""
    engine = engine or git_engine()
    cached = cache_root() / "releases" / f"{engine}-index.json"
    if cached.is_file() and time.time() - cached.stat().st_mtime < _INDEX_TTL_S:
        return json.loads(cached.read_text())
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", engine,
                              "--disable-pip-version-check"], capture_output=True, text=True, timeout=300)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("Available versions:")), "")
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    if not line:
        if cached.is_file():  # offline: yesterday's list is better than none
            return json.loads(cached.read_text())
        raise BadInput(f"cannot list {engine} releases: `pip index versions {engine}` gave no answer (offline?)")
    versions = []
    for v in line.partition(":")[2].split(","):
        try:
            parsed = Version(v.strip())
        except InvalidVersion:
            continue
        if not (parsed.is_prerelease or parsed.is_devrelease):
            versions.append(v.strip())
    versions.sort(key=Version)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(versions))
    return versions


def expand(spec: str) -> list[str]:
    """``ENGINE==A..B`` as the release specs it covers; any other spec as itself."""
    engine = engine_of(spec)
    if engine is None or ".." not in spec:  # not a range (is_range)
        return [spec]
    lo_text, _, hi_text = spec.removeprefix(f"{engine}==").partition("..")
    lo, hi = Version(check_version(lo_text, engine)), Version(check_version(hi_text, engine))
    if lo > hi:
        raise BadInput(f"{spec}: the range runs backwards (oldest first, e.g. {engine}==A..B with A before B)")
    covered = [f"{engine}=={v}" for v in available_versions(engine) if lo <= Version(v) <= hi]
    if not covered:
        raise BadInput(f"{spec}: no {engine} release in that range")
    return covered


def check_release(engine: str, version: str) -> None:
    """BadInput when the package index answers and has no such final release: a spec
    naming a version that does not exist is the user's mistake, not an untestable build.
    A pre-release is not listed, and an index that does not answer cannot tell: both pass."""
    try:
        known = available_versions(engine)
        wanted = Version(version)
    except (BadInput, InvalidVersion):
        return
    if known and version not in known and not (wanted.is_prerelease or wanted.is_devrelease):
        raise BadInput(f"{engine}=={version} is not a release on the package index (its latest: {known[-1]})")


def expand_all(specs: list[str]) -> list[str]:
    """Every range in ``specs`` expanded, order kept."""
    return [s for spec in specs for s in expand(spec)]


@dataclass(frozen=True)
class Release:
    version: str
    root: Path  # holds the engine's package and release.json
    info: dict[str, Any]
    overlay: Overlay

    @property
    def paths(self) -> list[str]:
        """What goes first on the worker's sys.path, in order."""
        return [str(p) for p in (self.overlay.path, self.root) if p is not None]


def _safe_members(names: list[str]) -> None:
    for n in names:
        if n.startswith("/") or ".." in Path(n).parts:
            raise BuildUnloadable(f"the release archive holds an unsafe path: {n!r}")


def _unpack_wheel(archive: Path, dest: Path, engine: str) -> list[str]:
    suffixes = _engine(engine).wheel_suffixes
    with zipfile.ZipFile(archive) as zf:
        names = zf.namelist()
        _safe_members(names)
        keep = [n for n in names if n.startswith(f"{engine}/") and (suffixes is None or n.endswith(suffixes))]
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        zf.extractall(dest, members=keep)
        text = zf.read(meta).decode("utf-8", "replace") if meta else ""
    return HeaderParser().parsestr(text).get_all("Requires-Dist") or []


def _unpack_sdist(archive: Path, dest: Path, engine: str) -> list[str]:
    if not _engine(engine).sdists:
        raise BuildUnloadable(f"{archive.name}: {engine} releases are replayed from wheels only")
    src = dest / ".src"
    with tarfile.open(archive) as tar:
        _safe_members(tar.getnames())
        tar.extractall(src, filter="data")
    pkg = next(iter(sorted(src.glob(f"*/python/{engine}/__init__.py")) + sorted(src.glob(f"*/{engine}/__init__.py"))),
               None)
    if pkg is None:
        raise BuildUnloadable(f"{archive.name}: no {engine} package inside")
    shutil.move(str(pkg.parent), dest / engine)
    reqs = requirements_of_tree(pkg.parent.parent, engine)
    shutil.rmtree(src)
    return reqs


def requirements_of_tree(tree: Path, engine: str | None = None) -> list[str]:
    """An engine checkout's requirements (sglang's by default: git: builds are its
    trees), from its own pyproject.toml (``python/`` or the root), runtime extras
    included; [] for a tree that is not that engine's."""
    engine = engine or git_engine()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    for candidate in (tree / "python" / "pyproject.toml", tree / "pyproject.toml"):
        if candidate.is_file():
            try:
                project = tomllib.loads(candidate.read_text()).get("project", {})
            except (tomllib.TOMLDecodeError, UnicodeDecodeError):
                return []
            if project.get("name") != engine:
                return []
            reqs = list(project.get("dependencies", []))
            for extra, items in project.get("optional-dependencies", {}).items():
                reqs += [f'{r}; extra == "{extra}"' if ";" not in r else r for r in items]
            return reqs
    return []


def _not_a_release(pip_err: str) -> str | None:
    """What to tell a user whose version pip's index does not have ("its latest: X"), or
    None when pip failed for another reason (no network, no disk: not the spec's fault)."""
    if "No matching distribution found" not in pip_err and "Could not find a version" not in pip_err:
        return None
    m = re.search(r"\(from versions: ([^)]*)\)", pip_err)
    versions = [v.strip() for v in m.group(1).split(",") if v.strip()] if m else []
    if not versions or versions == ["none"]:
        return "the index has no release of it at all"
    return f"its latest: {versions[-1][:40]}"


def _fetch(version: str, engine: str, dest: Path) -> None:
    t0 = time.perf_counter()
    dl = dest / ".download"
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                          "--no-deps", "-d", str(dl), f"{engine}=={version}"],
                         capture_output=True, text=True, timeout=1800)
    files = sorted(dl.glob(f"{engine}-*")) if dl.is_dir() else []
    if res.returncode != 0 or not files:
        why = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()[-1:]
        no_such = _not_a_release(res.stderr)
        if no_such is not None:  # the index answered, and has no such version: the spec is wrong
            raise BadInput(f"{engine}=={version} is not a release on the package index ({no_such})")
        raise BuildUnloadable(f"{engine}=={version} could not be fetched: {why[0][:300] if why else 'pip failed'}")
    archive = files[0]
    if archive.suffix == ".whl":
        reqs = _unpack_wheel(archive, dest, engine)
    else:
        reqs = _unpack_sdist(archive, dest, engine)
    shutil.rmtree(dl)
    info = {"version": version, "archive": archive.name, "requires": reqs,
            "fetch_s": round(time.perf_counter() - t0, 1), "bytes": size_of(dest)}
    (dest / "release.json").write_text(json.dumps(info, indent=1))


def _engine(name: str) -> Any:
    rec = engine_record(name)
    if rec is None:
        raise BadInput(f"{name} is not an engine whose releases are builds")
    return rec


def fetch(version: str, engine: str | None = None) -> Release:
    """The release's code (and, where its engine says so, its overlay of pinned
    dependencies), fetched and made on first use."""
    engine = engine or git_engine()
    check_version(version, engine)
    root = made_once(cache_root() / "releases" / f"{engine}-{version}", lambda tmp: _fetch(version, engine, tmp))
    info = json.loads((root / "release.json").read_text())
    overlay = overlay_for(exact_pins(info["requires"])) if _engine(engine).overlay else Overlay(None, (), ())
    return Release(version, root, info, overlay)
