"""Bounds on what a trace can make kvreplay allocate, each overridable by an
environment variable for the rare user who needs more, and the one reader of
kvreplay's own environment variables.

Every reader checks these before it allocates (trace/reader.py, trace/snapshot.py): a
trace from another machine may be damaged or hostile, and a 19 KB file can declare
10^8 indices. A family's record may add its own (a vLLM block pool's blocks).

A variable's value is configuration, and configuration is input: each is read through
``env_int``, ``env_float`` or ``env_choice``, which take nothing but a value in range and
otherwise raise BadInput naming the variable and what it accepts (exit 2). A limit is
read when its module is imported, where raising would break every command (``--help``
too): ``limit`` then uses the default and ``check_environment``, which the CLI runs
before any command, refuses the value. Imports nothing but the standard library and
kvreplay.errors: the recorded server's processes read their switches through it."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping

from kvreplay.errors import BadInput

# Any KVREPLAY_MAX_* is a limit: a positive whole number, at most this (past it a size
# no longer fits the int64 columns and tensors it bounds).
LIMIT_PREFIX = "KVREPLAY_MAX_"
LIMIT_MAX = 1 << 62
_SHOWN = 40  # of a bad value in a message: a hostile one may be megabytes
# int() would also take "1_000", " 7" and other digits than ASCII's, and raises past 4,300 digits
_WHOLE = re.compile(r"-?[0-9]{1,19}")
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]{1,3})?")  # never nan, inf, 1_000


def shown(raw: object) -> str:
    """A bad value as a message quotes it: repr (escapes included), cut short."""
    text = repr(raw)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "...'"


def whole(raw: str) -> int | None:
    """``raw`` as a whole number written in ASCII digits (an optional minus), else None."""
    return int(raw) if _WHOLE.fullmatch(raw) else None


def number(raw: str) -> float:
    """``raw`` as a decimal number (1, 0.5, 1e3), else NaN, which no range holds."""
    return float(raw) if len(raw) <= 40 and _NUMBER.fullmatch(raw) else math.nan


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    return (os.environ if env is None else env).get(name, "").strip()


def env_int(name: str, default: int, lo: int, hi: int, accepts: str = "",
            env: Mapping[str, str] | None = None) -> int:
    """The whole number in ``name`` (unset or empty: ``default``), which must lie in lo..hi;
    else BadInput naming the variable and ``accepts`` (by default the range)."""
    raw = _raw(name, env)
    if not raw:
        return default
    value = whole(raw)
    if value is None or not lo <= value <= hi:
        raise BadInput(f"{name}={shown(raw)}: want {accepts or f'a whole number from {lo} to {hi}'}")
    return value


def env_float(name: str, default: float, lo: float, hi: float, accepts: str = "",
              env: Mapping[str, str] | None = None) -> float:
    """The finite number in ``name`` (unset or empty: ``default``) in lo..hi, else BadInput."""
    raw = _raw(name, env)
    if not raw:
        return default
    value = number(raw)
    if not lo <= value <= hi:  # NaN is in no range, and 1e999 is inf
        raise BadInput(f"{name}={shown(raw)}: want {accepts or f'a number of seconds from {lo:g} to {hi:g}'}")
    return value


def env_choice(name: str, choices: Iterable[str], env: Mapping[str, str] | None = None) -> str:
    """``name``'s value, lower-cased, when it is one of ``choices`` ("" when unset or empty),
    else BadInput listing them."""
    options = list(choices)
    raw = _raw(name, env)
    if raw and raw.lower() not in options:
        raise BadInput(f"{name}={shown(raw)}: want one of {', '.join(options)} (or unset)")
    return raw.lower()


def limit(env: str, default: int) -> int:
    """``env``'s value when it is a positive whole number, else ``default``: read at
    import, so a bad value cannot raise here; ``check_environment`` refuses it."""
    try:
        return env_int(env, default, 1, LIMIT_MAX, _LIMIT_ACCEPTS)
    except BadInput:
        return default


_LIMIT_ACCEPTS = "a positive whole number (a bound on what a trace may declare), at most 2^62"

# A pool's slots: 2^27 tokens is several times the KV capacity of today's largest GPUs.
MAX_POOL_SLOTS = limit("KVREPLAY_MAX_POOL_SLOTS", 1 << 27)


# -- the variables kvreplay's commands read, checked before any command runs ---------------
def progress_every_s() -> float:
    """KVREPLAY_PROGRESS_S: seconds between progress lines when stderr is no terminal."""
    return env_float("KVREPLAY_PROGRESS_S", 5.0, 0.0, 86400.0, "a number of seconds from 0 to 86400")


def torch_threads() -> str:
    """KVREPLAY_TORCH_THREADS: torch's intra-op threads (OMP_NUM_THREADS) for a command."""
    return str(env_int("KVREPLAY_TORCH_THREADS", 1, 1, 1024, "a whole number of threads from 1 to 1024"))


def start_method() -> str:
    """KVREPLAY_START_METHOD: how worker processes start ("": kvreplay's choice)."""
    import multiprocessing

    return env_choice("KVREPLAY_START_METHOD", multiprocessing.get_all_start_methods())


def recorder_backend(env: Mapping[str, str] | None = None) -> str:
    """KVREPLAY_RECORDER: the capture engine ("": native where built, else python)."""
    return env_choice("KVREPLAY_RECORDER", ("python", "native"), env)


def writer_kind(env: Mapping[str, str] | None = None) -> str:
    """KVREPLAY_WRITER: where a recording's trace writer runs ("": its own process)."""
    return env_choice("KVREPLAY_WRITER", ("process", "thread"), env)


def tensor_shim(env: Mapping[str, str] | None = None) -> bool:
    """KVREPLAY_TENSOR_SHIM: 0 turns the native recorder's fast tensor reads off."""
    return env_choice("KVREPLAY_TENSOR_SHIM", ("0", "1"), env) != "0"


def _limits() -> None:
    for name in sorted(k for k in os.environ if k.startswith(LIMIT_PREFIX)):
        env_int(name, 0, 1, LIMIT_MAX, _LIMIT_ACCEPTS)


_CHECKS: tuple[Callable[[], object], ...] = (_limits, progress_every_s, torch_threads, start_method, recorder_backend,
                                             writer_kind, tensor_shim)


def check_environment() -> None:
    """BadInput for the first of kvreplay's variables whose value is not one it takes."""
    for check in _CHECKS:
        check()
