"""sglang releases as builds: ``sglang==VERSION``, and ranges ``sglang==A..B``.

A release's code is fetched the way pip gets it (``pip download --no-deps``: its
wheel, or its sdist where there is no wheel for this machine), unpacked once under
the kvreplay cache, and replayed in a worker process with the release's package
first on ``sys.path`` and its import-time pins in an overlay (builds/overlay.py).
Only the ``sglang`` package and the requirement list are kept; the archive is
deleted. A range expands to every final and post release between its ends,
inclusive, in version order, from the package index's own list."""

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
from kvreplay.errors import BadInput, BuildUnloadable

PREFIX = "sglang=="
# Digits, dots and a post segment: what a release spec may hand to pip, nothing else.
_VERSION = re.compile(r"^\d+(\.\d+){1,3}(\.post\d+)?$")
_INDEX_TTL_S = 24 * 3600


def check_version(text: str) -> str:
    """The version of ``sglang==VERSION``, or BadInput."""
    if not _VERSION.match(text):
        raise BadInput(f"sglang=={text}: not a release version (expected e.g. sglang==0.5.12 or 0.5.12.post1)")
    return text


def is_range(spec: str) -> bool:
    return spec.startswith(PREFIX) and ".." in spec


def available_versions() -> list[str]:
    """sglang's final and post releases on the package index, oldest first (cached a day)."""
    cached = cache_root() / "releases" / "index.json"
    if cached.is_file() and time.time() - cached.stat().st_mtime < _INDEX_TTL_S:
        return json.loads(cached.read_text())
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang",
                              "--disable-pip-version-check"], capture_output=True, text=True, timeout=300)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("Available versions:")), "")
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    if not line:
        if cached.is_file():  # offline: yesterday's list is better than none
            return json.loads(cached.read_text())
        raise BadInput("cannot list sglang releases: `pip index versions sglang` gave no answer (offline?)")
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
    """``sglang==A..B`` as the release specs it covers; any other spec as itself."""
    if not is_range(spec):
        return [spec]
    lo_text, _, hi_text = spec.removeprefix(PREFIX).partition("..")
    lo, hi = Version(check_version(lo_text)), Version(check_version(hi_text))
    if lo > hi:
        raise BadInput(f"{spec}: the range runs backwards (oldest first, e.g. sglang==0.5.11..0.5.23)")
    covered = [f"{PREFIX}{v}" for v in available_versions() if lo <= Version(v) <= hi]
    if not covered:
        raise BadInput(f"{spec}: no sglang release in that range")
    return covered


def expand_all(specs: list[str]) -> list[str]:
    """Every range in ``specs`` expanded, order kept."""
    return [s for spec in specs for s in expand(spec)]


@dataclass(frozen=True)
class Release:
    version: str
    root: Path  # holds sglang/ and release.json
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


def _unpack_wheel(archive: Path, dest: Path) -> list[str]:
    with zipfile.ZipFile(archive) as zf:
        names = zf.namelist()
        _safe_members(names)
        keep = [n for n in names if n.startswith("sglang/")]
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        zf.extractall(dest, members=keep)
        text = zf.read(meta).decode("utf-8", "replace") if meta else ""
    return HeaderParser().parsestr(text).get_all("Requires-Dist") or []


def _unpack_sdist(archive: Path, dest: Path) -> list[str]:
    src = dest / ".src"
    with tarfile.open(archive) as tar:
        _safe_members(tar.getnames())
        tar.extractall(src, filter="data")
    pkg = next(iter(sorted(src.glob("*/python/sglang/__init__.py")) + sorted(src.glob("*/sglang/__init__.py"))),
               None)
    if pkg is None:
        raise BuildUnloadable(f"{archive.name}: no sglang package inside")
    shutil.move(str(pkg.parent), dest / "sglang")
    reqs = requirements_of_tree(pkg.parent.parent)
    shutil.rmtree(src)
    return reqs


def requirements_of_tree(tree: Path) -> list[str]:
    """An sglang checkout's requirements, from its own pyproject.toml (``python/`` or
    the root), runtime extras included; [] for a tree that is not sglang."""
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
            if project.get("name") != "sglang":
                return []
            reqs = list(project.get("dependencies", []))
            for extra, items in project.get("optional-dependencies", {}).items():
                reqs += [f'{r}; extra == "{extra}"' if ";" not in r else r for r in items]
            return reqs
    return []


def _fetch(version: str, dest: Path) -> None:
    t0 = time.perf_counter()
    dl = dest / ".download"
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                          "--no-deps", "-d", str(dl), f"sglang=={version}"],
                         capture_output=True, text=True, timeout=1800)
    files = sorted(dl.glob("sglang-*")) if dl.is_dir() else []
    if res.returncode != 0 or not files:
        why = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()[-1:]
        raise BuildUnloadable(f"sglang=={version} could not be fetched: {why[0] if why else 'pip failed'}")
    archive = files[0]
    reqs = _unpack_wheel(archive, dest) if archive.suffix == ".whl" else _unpack_sdist(archive, dest)
    shutil.rmtree(dl)
    info = {"version": version, "archive": archive.name, "requires": reqs,
            "fetch_s": round(time.perf_counter() - t0, 1), "bytes": size_of(dest)}
    (dest / "release.json").write_text(json.dumps(info, indent=1))


def fetch(version: str) -> Release:
    """The release's code and overlay, fetched and made on first use."""
    check_version(version)
    root = made_once(cache_root() / "releases" / f"sglang-{version}", lambda tmp: _fetch(version, tmp))
    info = json.loads((root / "release.json").read_text())
    return Release(version, root, info, overlay_for(exact_pins(info["requires"])))
