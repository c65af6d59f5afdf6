"""Errors a user can cause, each with the exit code DESIGN.md documents.

0 clean, 1 violation or divergence, 2 bad input or usage, 125 the build could not
be tested: it does not load, or its worker crashed or timed out (``git bisect run``
skips it), 128 bad input under ``replay --git-bisect`` (git aborts the bisect),
>128 kvreplay itself crashed."""

from __future__ import annotations

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


class PoolFailed(KvreplayError):
    """The pool under the workload model raised (its own assertion, usually): a
    finding, reported like a violation."""

    exit_code = EXIT_FOUND
