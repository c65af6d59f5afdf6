"""Build specs, parsed once: what the user's ``--build`` names.

``builtin:NAME[@VARIANT]``  a reference pool or bug variant of this kvreplay
``py:MODULE:CLASS``        any importable allocator class, in this process
``sglang``                 the installed sglang's allocator of the trace's family
``vllm``                   the installed vLLM's KV-cache manager (the vllm family)
``sglang==VERSION``         that sglang release's allocator, fetched once, in a worker process
``vllm==VERSION``           that vLLM release's KV-cache manager, fetched once, in a worker process
``git:REPO@REV[:MODULE:CLASS]``  pool code at a revision, in a worker process

Every command that takes a build parses it here, so what a spec means (where it
runs, whether its code is pinned exactly, which correct pool a variant breaks) is
answered in one place; so is what a build resolved to (``BuildSpec.resolved``)."""

from __future__ import annotations

import re
import string
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvreplay.builds.releases import check_version, engine_of
from kvreplay.contract.registry import BUILTINS, engines
from kvreplay.contract.registry import engine as engine_record
from kvreplay.errors import UnknownBuild, did_you_mean
from kvreplay.version import __version__

# builtin | py | release | git, and each engine's name (the installed engine's pool)
KINDS = ("builtin", "py", "release", "git")
_HEX = frozenset(string.hexdigits.lower())
# Longest build spec taken: a git: spec's path and ref fit in it many times over.
MAX_SPEC = 4096
_LOOKS_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+]*$")


@dataclass(frozen=True)
class BuildSpec:
    text: str
    kind: str  # builtin | py | release | git | an engine's name (its installed pool)
    name: str = ""  # builtin: NAME[@VARIANT]
    cls: str = ""  # py: and git: MODULE:CLASS ("" for git: the tree's sglang allocator)
    repo: Path | None = None  # git:
    rev: str = ""  # git:
    version: str = ""  # release (ENGINE==VERSION)
    engine: str = ""  # release: sglang or vllm

    @classmethod
    def parse(cls, text: str) -> BuildSpec:
        """The spec, or UnknownBuild naming what exists (and the closest match)."""
        if engine_record(text) is not None:
            return cls(text, text)
        if len(text) > MAX_SPEC:  # echoed in errors, and a path or a ref of this length is no build
            raise UnknownBuild(f"a build spec of {len(text):,} characters ({text[:60]!r}...): at most {MAX_SPEC:,}")
        engine = engine_of(text)
        if engine is not None:
            version = text.removeprefix(f"{engine}==")
            lo, _, hi = version.partition("..")
            if ".." in version and not (_LOOKS_VERSION.match(lo) and _LOOKS_VERSION.match(hi)):
                check_version(version, engine)  # not a range of versions either: say what a version is
            if ".." in version:
                raise UnknownBuild(f"{text} is a range of builds; this option takes one (ranges go to "
                                   "bisect --builds and matrix --builds)")
            return cls(text, "release", version=check_version(version, engine), engine=engine)
        kind, _, rest = text.partition(":")
        if kind == "builtin":
            if rest not in BUILTINS:
                known = [f"builtin:{n}" for n in BUILTINS]
                raise UnknownBuild(f"unknown build {text!r}{did_you_mean(text, known)}; builtin builds are: "
                                   + ", ".join(known))
            return cls(text, "builtin", name=rest)
        if kind == "py":
            module, _, attr = rest.partition(":")
            if not module or not attr or ":" in attr:
                raise UnknownBuild(f"bad build spec {text!r}: expected py:MODULE:CLASS")
            return cls(text, "py", cls=rest)
        if kind == "git":
            repo, at, tail = rest.partition("@")
            if not at or not repo or not tail:
                raise UnknownBuild(f"bad build spec {text!r}: expected git:REPO@REV or git:REPO@REV:MODULE:CLASS")
            rev, _, target = tail.partition(":")
            if target and ":" not in target:
                raise UnknownBuild(f"bad build spec {text!r}: the class must be MODULE:CLASS")
            return cls(text, "git", cls=target, repo=Path(repo).expanduser(), rev=rev)
        names = [e.name for e in engines()]
        hint = did_you_mean(text, [f"builtin:{n}" for n in BUILTINS] + names)
        raise UnknownBuild(f"unknown build {text!r}{hint}: use builtin:NAME, py:MODULE:CLASS, "
                           + ", ".join(names + [f"{n}==VERSION" for n in names])
                           + " or git:REPO@REV[:MODULE:CLASS] (see `kvreplay builds`)")

    @property
    def in_process(self) -> bool:
        """Replayed in kvreplay's own process (git: and release builds get a worker each)."""
        return self.kind not in ("git", "release")

    @property
    def exact(self) -> bool:
        """Does the spec pin its code exactly, so an old result for it still holds?
        A git: build at a full commit, a builtin of this kvreplay version (stored runs
        carry the version), a release (PyPI never replaces a release's files). py: and
        sglang builds can change under the same spec."""
        if self.kind == "release":
            return True
        if self.kind == "git":
            return len(self.rev) == 40 and set(self.rev.lower()) <= _HEX
        return self.kind == "builtin"

    def resolved(self, *, pool: Any = None, code_id: str = "") -> str:
        """What the build resolved to, as a stored run says it: a release's version or a
        git build's commit (``code_id``, from its worker), else the package the pool's
        class comes from (kvreplay's own version for builtins). The one answer, for
        replay, bisect, matrix and ci alike."""
        if self.kind == "release":
            return f"{self.engine} {code_id}"
        if self.kind == "git":
            return f"git {code_id}"
        if pool is not None:  # a wire over an engine's object names the engine
            top = getattr(pool, "engine", None) or type(pool).__module__.split(".")[0]
        else:
            top = "kvreplay" if self.kind == "builtin" else self.kind if engine_record(self.kind) is not None else ""
        if top == "kvreplay":
            return f"kvreplay {__version__}"
        if not top:
            return ""
        ver = getattr(sys.modules.get(top), "__version__", "")
        if not ver:
            try:
                ver = metadata.version(top)
            except metadata.PackageNotFoundError:
                ver = ""
        return f"{top} {ver}".strip()

    @property
    def base(self) -> str | None:
        """For a builtin bug variant, the correct pool it breaks; else None."""
        if self.kind != "builtin" or "@" not in self.name:
            return None
        return f"builtin:{BUILTINS[self.name].base}"

    def __str__(self) -> str:
        return self.text

