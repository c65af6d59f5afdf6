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
from rich.text import Text


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
# Seconds between progress lines when stderr is not a terminal (CI logs).
PROGRESS_EVERY_S = float(os.environ.get("KVREPLAY_PROGRESS_S", "5"))

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
out = Console(highlight=False, emoji=False, width=_PIPED_WIDTH)
err = Console(stderr=True, highlight=False, emoji=False)
# The arguments of this invocation, so a trace can record the command that made it.
argv: list[str] = []


def say(text: str, style: str | None = None, *, to_err: bool = False) -> None:
    """Print one line of plain text (never markup), optionally styled."""
    (err if to_err else out).print(Text(text, style=style or ""), soft_wrap=True)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextmanager
def progress(label: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A ``callback(done, total)`` for long work: a live bar on a terminal, else one
    line on stderr every PROGRESS_EVERY_S seconds (so CI logs show it is alive)."""
    if err.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn(label.replace("[", r"\[")), BarColumn(),
                      TextColumn(f"{{task.completed}}/{{task.total}} {unit}"), TimeRemainingColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("", total=1)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    t0 = last = time.monotonic()
    shown = [False]

    def line(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S or (shown[0] and done >= total):
            last = now
            shown[0] = True
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            say(f"{label}: {done}/{total} {unit}{pct}, {now - t0:.0f} s", to_err=True)

    yield line

