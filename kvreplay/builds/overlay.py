"""Dependency overlays: an old release's pure-Python pins, in front of this environment.

An sglang release imports its model configs and tokenizer glue when its pool code is
imported, so it needs the ``transformers`` (and friends) it pinned, not the newer one
installed here. Installing each release into its own multi-GB environment would
repeat torch, Triton and CUDA for every release; instead a release gets an overlay:
the pins of its that differ from what is installed, ``pip install --no-deps``-ed into
a directory that goes first on the worker's ``sys.path``, plus whatever those pins
need that the environment does not satisfy. Platform packages (torch, Triton, CUDA
kernels) are never overlaid: every release runs on the installed ones.

Overlays are keyed by the exact set of packages they hold, so releases with the same
pins share one."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kvreplay.builds.cache import cache_root, made_once
from kvreplay.errors import BuildUnloadable

# Compiled against torch or CUDA, or the runtime itself: taken from the environment.
PLATFORM = ("torch", "torch-*", "torchaudio", "torchvision", "torchao", "torchcodec", "triton", "triton-*",
            "nvidia-*", "cuda-*", "cupy*", "flashinfer*", "sgl-*", "sglang*", "tilelang", "xgrammar",
            "apache-tvm-ffi", "humming-kernels", "quack-kernels", "tokenspeed*", "deepseek-*", "numba",
            "llvmlite", "decord*", "av", "tml-*", "vllm", "xformers", "mooncake*", "nixl*", "flash-*",
            "sentencepiece", "torchcodec", "llguidance", "outlines*", "soundfile", "pillow", "numpy")
# Extras that carried sglang's runtime pins before they moved to the base requirements.
RUNTIME_EXTRAS = ("srt", "runtime-common")
_ROUNDS = 4


@dataclass(frozen=True)
class Overlay:
    path: Path | None  # None: nothing to overlay
    packages: tuple[str, ...]  # name==version, as installed there
    hidden: tuple[str, ...] = ()  # top-level modules of installed packages the overlay breaks


def is_platform(name: str) -> bool:
    n = canonicalize_name(name)
    return any(fnmatch.fnmatch(n, pat) for pat in PLATFORM)


def exact_pins(requirements: list[str], extras: tuple[str, ...] = RUNTIME_EXTRAS) -> list[str]:
    """``name==version`` for each exact, non-platform pin that applies on this
    machine, from requirement strings (a wheel's ``Requires-Dist`` or a pyproject's
    dependencies), with the runtime extras taken as requested."""
    pins: dict[str, str] = {}
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # a release's metadata is not ours to validate; skip what we cannot read
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        exact = [s.version for s in req.specifier if s.operator == "==" and "*" not in s.version]
        if len(exact) == 1 and not is_platform(req.name):
            pins[canonicalize_name(req.name)] = exact[0]
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def _installed() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.setdefault(canonicalize_name(name), dist.version)
    return found


def _in(path: Path) -> dict[str, metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(path)])}


def _satisfied(req: Requirement, version: str | None) -> bool:
    if version is None:
        return False
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def _pip_install(target: Path, reqs: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--no-compile", "--target", str(target), *reqs]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        why = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")] or res.stderr.splitlines()[-1:]
        raise BuildUnloadable(f"pip could not install {' '.join(reqs)}: {why[0] if why else 'failed'}")


def overlay_for(pins: list[str]) -> Overlay:
    """The overlay that makes ``pins`` true in front of this environment (made once)."""
    have = _installed()
    wanted = [p for p in pins if have.get(canonicalize_name(p.split("==")[0])) != p.split("==")[1]]
    if not wanted:
        return Overlay(None, ())
    key = hashlib.sha256(json.dumps(sorted(wanted)).encode()).hexdigest()[:16]
    dest = cache_root() / "overlays" / key

    def make(tmp: Path) -> None:
        _settle(tmp, wanted, have)
        # Installed packages the overlay breaks: a version of each that fits it, if
        # there is one (pip's resolver picks it); the rest are hidden at run time.
        inside = {n: d.version for n, d in _in(tmp).items()}
        fits = _resolve(_broken_names(inside), [f"{n}=={v}" for n, v in inside.items()])
        if fits:
            _settle(tmp, fits, have)

    made_once(dest, make)
    inside = _in(dest)
    return Overlay(dest, tuple(sorted(f"{n}=={d.version}" for n, d in inside.items())),
                   _broken_by({n: d.version for n, d in inside.items()}))


def _settle(tmp: Path, wanted: list[str], have: dict[str, str]) -> None:
    """Install ``wanted`` into ``tmp``, then what they need that neither ``tmp`` nor
    the environment satisfies, until nothing is missing."""
    todo = wanted
    for _ in range(_ROUNDS):
        _pip_install(tmp, todo)
        dists = _in(tmp)
        inside = {n: d.version for n, d in dists.items()}
        todo = []
        for dist in dists.values():
            for text in dist.requires or []:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                name = canonicalize_name(req.name)
                if is_platform(name) or _satisfied(req, inside.get(name, have.get(name))):
                    continue
                if name in inside:  # two overlaid pins disagree: the release's pin wins
                    continue
                todo.append(str(Requirement(f"{req.name}{req.specifier}")))
        if not todo:
            return
    raise BuildUnloadable(f"the dependencies of {' '.join(wanted)} did not settle in {_ROUNDS} rounds")


def _resolve(names: list[str], pins: list[str]) -> list[str]:
    """``name==version`` for each of ``names`` that pip's resolver can fit to
    ``pins``; names it cannot fit are left out."""
    fits: list[str] = []
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            report = Path(d) / "report.json"
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--dry-run",
                   "--ignore-installed", "--report", str(report), name, *pins]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0 or not report.is_file():
                continue
            for item in json.loads(report.read_text()).get("install", []):
                meta = item.get("metadata", {})
                if canonicalize_name(meta.get("name", "")) == name:
                    fits.append(f"{name}=={meta['version']}")
    return fits


def _broken_by(overlaid: dict[str, str]) -> tuple[str, ...]:
    """Top-level modules of installed packages that need a newer (or older) version
    of something the overlay replaces, e.g. a package built for huggingface-hub 1.x
    when the overlay holds the 0.x an old transformers pins, and for which no
    fitting version could be overlaid. The release's own environment would not have
    had them at those versions; the worker hides them, so an optional import of one
    fails as "not installed" instead of breaking the import."""
    hidden: set[str] = set()
    for dist in _breakable(overlaid):
        hidden |= _top_level(dist)
    return tuple(sorted(hidden))


def _broken_names(overlaid: dict[str, str]) -> list[str]:
    return sorted(canonicalize_name(d.metadata["Name"]) for d in _breakable(overlaid))


def _breakable(overlaid: dict[str, str]) -> list[metadata.Distribution]:
    """Installed distributions (not overlaid, not platform) with a requirement on an
    overlaid package that the overlaid version does not meet."""
    found = []
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata.get("Name") or "")
        if not name or name in overlaid or is_platform(name):
            continue
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            dep = canonicalize_name(req.name)
            if dep in overlaid and (req.marker is None or req.marker.evaluate({"extra": ""})) \
                    and not _satisfied(req, overlaid[dep]):
                found.append(dist)
                break
    return found


def _top_level(dist: metadata.Distribution) -> set[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return {ln.strip() for ln in text.splitlines() if ln.strip()}
    tops = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__"):
            continue
        tops.add(first.removesuffix(".py") if len(f.parts) == 1 else first)
    return {t for t in tops if t.isidentifier()}
