"""Record every allocator a process builds, without touching the server's code.

``kvreplay record --out DIR -- CMD`` runs CMD with this module's ``sitecustomize``
directory first on ``PYTHONPATH`` and ``KVREPLAY_RECORD_DIR=DIR`` set. Every Python
process of the server (including the scheduler subprocesses sglang spawns, which
inherit the environment) then calls ``install_from_env()`` at start-up: the target
allocator classes get an ``__init__`` wrapper, and each instance built outside
another target's constructor (so an SWA allocator is recorded once, with its full
and SWA sub-allocators as nested rows) is recorded to its own trace in DIR, named
``kvreplay-<pid>[-<rank>]-<n>.parquet``.

Targets: ``KVREPLAY_RECORD_CLASSES`` (comma-separated ``MODULE:CLASS``), by default
sglang's token, paged and SWA allocators and vLLM's KV-cache manager (recorded through
its wire, families/vllm/wire.py). A target module imported later is patched
when it is imported (an import hook); one already imported is patched at once.

With ``KVREPLAY_FLIGHT=N`` each allocator gets a flight recorder instead, keeping
its last N calls in memory and writing ``kvreplay-flight-<pid>-<n>.parquet`` only
when an allocator call raises or the process gets SIGUSR2.

Normal exit and Ctrl-C finish the traces (atexit); SIGTERM does too when the process
has no handler of its own. Even a process killed outright keeps every batch its
writer process had received. Any failure here is logged once and disables recording;
the server runs on."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvreplay.builds.engines import record_classes, recordable
from kvreplay.errors import BadInput
from kvreplay.recorder.import_hook import after_import
from kvreplay.recorder.switch_values import Switches, read_switches
from kvreplay.recorder.switches import DIR_ENV

log = logging.getLogger("kvreplay.autorecord")

DEFAULT_CLASSES = record_classes()  # every family's engine classes (sglang's allocators, vLLM's manager)

_state = threading.local()
_counter = itertools.count()
_targets: dict[str, list[str]] = {}  # module -> class names still to patch
_out: Path | None = None
_switches: Switches | None = None  # read once, at start-up (install_from_env)
_failed = False
_defaults = False  # targets are the default layouts: a module without one of them is expected


def install_from_env() -> None:
    """Start auto-recording if ``KVREPLAY_RECORD_DIR`` is set; a no-op otherwise. A
    switch whose value the recorder does not take turns recording off in this
    process, said in one line on stderr: the server starts as if not recorded."""
    if not os.environ.get(DIR_ENV):
        return
    global _defaults, _switches, _failed
    try:
        _switches = read_switches()
    except BadInput as exc:
        _failed = True
        _off(exc)
        return
    _defaults = not _switches.classes
    try:
        install(Path(_switches.out), _switches.classes or list(DEFAULT_CLASSES))
    except Exception:
        _fail()


def install(out: Path, classes: Sequence[str]) -> None:
    global _out
    _out = out
    for spec in classes:
        module, _, name = spec.partition(":")
        if not module or not name:
            log.warning("kvreplay: ignoring record target %r (want MODULE:CLASS)", spec)
            continue
        _targets.setdefault(module, []).append(name)
    for module in list(_targets):
        if module in sys.modules:
            _patch_module(sys.modules[module])  # here a failure reaches the caller (install_from_env logs it)
        else:
            after_import(module, _patch_imported)


def _fail() -> None:
    global _failed
    if not _failed:
        exc = sys.exc_info()[1]
        if isinstance(exc, BadInput):  # a setting, not a bug: its one line says which
            _off(exc)
        else:
            log.exception("kvreplay autorecord failed; recording disabled in process %d", os.getpid())
    _failed = True


def _off(why: BadInput) -> None:
    print(f"kvreplay: not recording in process {os.getpid()}: {why}", file=sys.stderr, flush=True)


def _patch_imported(module: ModuleType) -> None:
    # Runs inside the server's own import statement: a failure turns recording off, never the import.
    if _failed:
        return
    try:
        _patch_module(module)
    except Exception:
        _fail()


def _patch_module(module: ModuleType) -> None:
    for name in _targets.pop(module.__name__, []):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _patch_class(cls)
        elif not _defaults:
            log.warning("kvreplay: %s has no class %s to record", module.__name__, name)


def _patch_class(cls: type) -> None:
    # A class that inherits its constructor (a bug variant of a pool) gets a wrapper of
    # its own around the inherited one: naming it records its instances.
    original = cls.__dict__.get("__init__") or getattr(cls, "__init__", None)
    if original is None or original is object.__init__ or (
            "__init__" in cls.__dict__ and getattr(original, "_kvreplay_autorecord", False)):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0 and not _failed:
            _start(self)

    __init__._kvreplay_autorecord = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__  # type: ignore[misc]


def _start(pool: Any) -> None:
    # Pools kvreplay builds while it starts a recording (the flight recorder compares
    # the pool with a fresh one) are its own, not the program's: they are not recorded,
    # or each would start another recording, and so on.
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        _start_recording(pool)
    finally:
        _state.depth = depth


def _start_recording(pool: Any) -> None:
    from kvreplay.recorder.recording import record

    try:
        assert _out is not None
        sw = _switches or read_switches()  # install() called directly: the environment's, as they are now
        _out.mkdir(parents=True, exist_ok=True)
        rank = _rank(sw.rank)
        extra = {"autorecord": {"argv": sys.argv[:8]}}
        pool = recordable(pool)
        flight, every, fold = sw.flight, sw.counters_every, sw.fold
        if flight > 0:
            from kvreplay.recorder.flight import flight_recorder

            flight_recorder(pool, _out, calls=flight, rank=rank, extra=extra, counters_every=every, fold_reads=fold)
            return
        name = f"kvreplay-{os.getpid()}{'-' + rank if rank else ''}-{next(_counter)}.parquet"
        checkpoints, parts = sw.checkpoint_every, sw.rotation
        record(pool, _out / name, rank=rank, extra=extra, counters_every=every, checkpoint_every=checkpoints,
               snapshot=False, fold_reads=fold, rotate_rows=parts.rows, rotate_s=parts.seconds,
               keep_parts=parts.keep_parts, keep_bytes=parts.keep_bytes)  # from its constructor: nothing before
        _chain_sigterm()
    except Exception:
        _fail()


def _rank(given: str) -> str:
    """TP/DP rank where known: KVREPLAY_RANK (``given``, a plain name), else the
    ``tp_rank``/``dp_rank`` of the scheduler object or function that is building the
    allocator, else torch's RANK."""
    if given:
        return given
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        parts = []
        for key in ("tp_rank", "dp_rank", "pp_rank"):
            value = frame.f_locals.get(key, getattr(owner, key, None))
            if isinstance(value, int):
                parts.append(f"{key[:2]}{value}")
        if parts:
            return "".join(parts)
        frame = frame.f_back
    torch_rank = os.environ.get("RANK", "")
    return f"rank{torch_rank}" if torch_rank.isascii() and torch_rank.isdigit() and len(torch_rank) < 8 else ""


_sigterm_chained = False


def _chain_sigterm() -> None:
    """Finish traces on SIGTERM when nobody else handles it (default: die unflushed)."""
    global _sigterm_chained
    if _sigterm_chained or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the program handles SIGTERM itself; it exits through atexit or not at all
    _sigterm_chained = True

    def on_term(signum: int, frame: Any) -> None:
        from kvreplay.recorder.recording import close_all

        close_all()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
