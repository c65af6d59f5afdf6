"""Errors a user can cause, each with its exit code (docs/design.md, "Exit codes").

0 clean, 1 violation or divergence, 2 bad input or usage, 125 the build could not
be tested: it does not load, or its worker crashed or timed out (``git bisect run``
skips it), 128 bad input under ``replay --git-bisect`` (git aborts the bisect),
>128 kvreplay itself crashed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_CLEAN = 0
EXIT_FOUND = 1
EXIT_BAD_INPUT = 2
EXIT_UNLOADABLE = 125
EXIT_ABORT_BISECT = 128  # replay --git-bisect on bad input: git bisect run stops instead of marking bad
EXIT_CRASH = 134


class KvreplayError(Exception):
    """A problem with what the user asked for; the CLI prints it on one line."""

    exit_code = EXIT_BAD_INPUT


class BadInput(KvreplayError):
    exit_code = EXIT_BAD_INPUT


class TraceFormatError(BadInput):
    """The file is not a kvreplay trace this version can read."""


class UnknownBuild(BadInput):
    pass


class BuildUnloadable(KvreplayError):
    exit_code = EXIT_UNLOADABLE


class BuildUnsupported(BuildUnloadable):
    """The build loads but lacks what the trace needs (its pool family, a page size)."""


class PoolFailed(KvreplayError):
    """The pool under the workload model raised (its own assertion, usually): a
    finding, reported like a violation."""

    exit_code = EXIT_FOUND


class FamilyMismatch(BadInput):
    """The trace records one pool family and the build is another: not this build's trace."""

    def __init__(self, trace_family: str, build: str, build_family: str) -> None:
        super().__init__(f"the trace records a {trace_family} pool but {build} is a {build_family} pool")
        self.trace_family, self.build, self.build_family = trace_family, build, build_family


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest choice, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def one_of(what: str, value: str, choices: Iterable[str]) -> str:
    """``value`` when it is one of ``choices``, else BadInput naming them and the closest."""
    options = list(choices)
    if value in options:
        return value
    raise BadInput(f"unknown {what} {value!r}{did_you_mean(value, options)}; use one of: {', '.join(options)}")
