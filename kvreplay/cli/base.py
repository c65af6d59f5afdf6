"""What every command module shares: the Typer app, the two consoles, JSON output,
progress, and the help texts that recur. Values that come from data (paths,
method names, build specs, messages) are always printed as plain text: nothing
here interprets them as markup."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from kvreplay.errors import BadInput
from kvreplay.text import printable_lines


def _flags_as_typed() -> None:
    """Show an on/off option as the flag it is (``--json``), not ``--json <bool>``:
    this typer's help gives every option a type column, and a user who reads
    ``<bool>`` types ``--json true``, which is refused."""
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - depends on the installed typer
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_kvreplay", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich._kvreplay = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_as_typed()

# The bounds most numeric options share: past them a value is a typo or an attack, and
# a timer, a sleep or an allocation that takes it fails where the user cannot see why.
WEEK_S = 7 * 86400.0
MANY = (1 << 31) - 1  # calls, rows, requests
SEED_BITS = 63
MAX_JOBS = 1024


def within(lo: float, hi: float, accepts: str, *, or_zero: bool = False) -> Callable[..., Any]:
    """A numeric option's callback: its value must lie in lo..hi (or be 0, with
    ``or_zero``; NaN never does), else BadInput naming the option and ``accepts``
    ("--part-s must be ACCEPTS, not inf"), before the command has done anything."""

    def check(param: typer.CallbackParam, value: Any) -> Any:
        if value is None or (or_zero and value == 0) or lo <= value <= hi:
            return value
        flags = [o for o in param.opts if o.startswith("-")]
        flag = max(flags, key=len) if flags else str(param.name).upper()  # an argument: as its usage shows it
        raise BadInput(f"{flag} must be {accepts}, not {_as_typed(value)}")

    check.bounds = (lo, hi)  # type: ignore[attr-defined]  # tests/test_hostile_config.py looks for it
    return check


def _as_typed(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 30 else text[:30] + "..."


# The callbacks that recur (a timer takes seconds up to a week; the store's ids are int64).
TIMEOUT_S = within(0.001, WEEK_S, f"a number of seconds from 0.001 to {WEEK_S:g} (a week)")
JOBS = within(1, MAX_JOBS, f"a number of worker processes from 1 to {MAX_JOBS}")
RUN_ID = within(1, (1 << 63) - 1, "a run id (kvreplay runs lists them; there is no run past 2^63-1)")
SEED = within(-(1 << SEED_BITS), (1 << SEED_BITS) - 1, "a whole number that fits in 64 bits")
REQUESTS = within(1, 10_000_000, "a number of requests from 1 to 10000000")
SCALE = within(1e-9, 1e6, "a positive factor, at most 1e6")
SPEEDUP = within(1e-9, 1e12, "a positive factor, at most 1e12")  # arrivals divided by it: 1e9 means all at once


EPILOG = (
    "Exit codes: 0 clean, 1 violation or divergence found, 2 bad input or usage, "
    "125 build could not be tested: unloadable, unsupported, crashed or timed out (git bisect skips it), "
    "128 bad input under replay --git-bisect, >128 kvreplay crashed."
)
DB_HELP = (
    "Results database: SQLAlchemy URL or SQLite file "
    "(default: $KVREPLAY_DB, else ~/.local/share/kvreplay/kvreplay.db)."
)
BUILD_HELP = ("Build: builtin:NAME[@VARIANT], py:MODULE:CLASS, sglang or vllm (the installed one), "
              "sglang==VERSION or vllm==VERSION (that release, fetched once) or git:REPO@REV[:MODULE:CLASS]; "
              "`kvreplay builds` lists them.")
JSON_HELP = "Print the result as JSON (fields: docs/json.md)."
URI_HELP = " A path or a URI (s3://, gs://, hdfs://, file://)."
JOBS_HELP = ("Worker processes: the trace's segments (between the checkpoints synth/record --checkpoint-every "
             "wrote) replay in parallel and merge into the serial run.")
RAY_HELP = ("Send the work to Ray: --ray alone starts a local instance, --ray ADDRESS joins a cluster "
            "(auto, HOST:PORT, ray://HOST:PORT). Needs pip install 'kvreplay\\[ray]'.")
# Seconds between progress lines when stderr is not a terminal (CI logs); None:
# KVREPLAY_PROGRESS_S's, read when progress starts (limits.py checks it, not an import).
PROGRESS_EVERY_S: float | None = None

app = typer.Typer(
    name="kvreplay",
    help="Record, replay and check the KV-cache pool calls of LLM decode servers.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped or redirected, a table gets the room its cells need (rich would assume 80
# columns and cut names to "built…"): a script or a log reads whole names.
_PIPED_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 400


class _PlainConsole(Console):
    """A console that shows text from data as text: a string is never markup (a file
    named ``[link=...]`` stays a name), and every control, bidi or surrogate
    character that reaches the output (a trace's host, a stored message, a server's
    answer) is written escaped (kvreplay.text), whichever command printed it. Only
    rich's own control codes (styles, a progress bar's cursor moves) pass as they are."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, highlight=False, emoji=False, **kwargs)

    def _render_buffer(self, buffer: Any) -> str:
        # Every print, log and live refresh of rich ends here, once laid out.
        return super()._render_buffer(
            seg if seg.control else Segment(printable_lines(seg.text), seg.style) for seg in buffer)


out = _PlainConsole(width=_PIPED_WIDTH)
err = _PlainConsole(stderr=True)
# The arguments of this invocation, so a trace can record the command that made it.
argv: list[str] = []


def say(text: str, style: str | None = None, *, to_err: bool = False) -> None:
    """Print one line of plain text (never markup), optionally styled."""
    (err if to_err else out).print(Text(printable_lines(text), style=style or ""), soft_wrap=True)


def emit_json(obj: Any) -> None:
    # ensure_ascii: every control, bidi or surrogate character in a value is written as
    # a \uXXXX escape, so JSON on a terminal is as safe as the text output.
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str, ensure_ascii=True) + "\n")


@contextmanager
def progress(label: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A ``callback(done, total)`` for long work: a live bar on a terminal, else one
    line on stderr every PROGRESS_EVERY_S seconds (so CI logs show it is alive)."""
    if err.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn(label, markup=False), BarColumn(),
                      TextColumn(f"{{task.completed}}/{{task.total}} {unit}"), TimeRemainingColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("", total=1)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    from kvreplay.limits import progress_every_s

    every = progress_every_s() if PROGRESS_EVERY_S is None else PROGRESS_EVERY_S
    t0 = last = time.monotonic()
    shown = [False]

    def line(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every or (shown[0] and done >= total):
            last = now
            shown[0] = True
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            say(f"{label}: {done}/{total} {unit}{pct}, {now - t0:.0f} s", to_err=True)

    yield line

