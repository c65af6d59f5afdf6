"""How reports look on a terminal: a replay report, a stored run, a violation."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from kvreplay.cli.base import out, say
from kvreplay.contract.registry import unit_of
from kvreplay.replay.report import describe, firsts_by_rule
from kvreplay.text import printable

STATUS_STYLE = {"clean": "green", "violation": "red", "divergence": "yellow"}


def row(t: Table, *cells: Any, style: str | None = None) -> None:
    """Add a row of plain-text cells (data never becomes markup), each one line with its
    control characters escaped (kvreplay.text); a cell given as a Text is the caller's
    own layout (lines of escaped values) and is kept. On a narrow terminal a cell wraps
    onto more lines; it is never cut short with an ellipsis (a cut name is another
    name: "builtin:swa@stale-…" could be any variant)."""
    for col in t.columns:
        col.overflow = "fold"
    # Escaped before the table measures its cells, so columns fit what is shown.
    t.add_row(*(_cell(c) for c in cells), style=style)


def _cell(c: Any) -> Text:
    if isinstance(c, Text):
        c.overflow = "fold"
        return c
    return Text(printable(c), overflow="fold")


def render_report(r: Any) -> None:
    kernels = f", kernels: {r.kernels}" if getattr(r, "kernels", "none") != "none" else ""
    # What a report holds came from a trace, a build or a store: each line is one line.
    p = printable
    head = Text.assemble((p(r.trace), "bold"), " on ", (p(r.build), "bold"), p(f" ({r.mode}, {r.device}{kernels}): "),
                         (p(r.status), STATUS_STYLE.get(r.status, "magenta")),
                         f"  {r.calls_replayed} calls in {r.wall_s:.2f} s ({r.calls_per_s:,.0f} calls/s)")
    out.print(head, soft_wrap=True)
    if r.message:
        say("  " + p(r.message))
    if r.violation_counts:
        firsts = firsts_by_rule(r.violations)
        t = Table("invariant/rule", "count", "first at call")
        for k, n in sorted(r.violation_counts.items(), key=lambda kv: firsts[kv[0]].call if kv[0] in firsts else 0):
            row(t, k, n, f"#{firsts[k].call}" if k in firsts else "")
        out.print(t)
    if r.first_violation:
        say("first violation:")
        say("  " + p(describe(r.first_violation, long=True)), "red")
        if unit_of(r.first_violation.sub_pool) == "slots":  # sglang's capacity assertion: slot pools only
            _capacity_line(r.capacity_assert_call, r.capacity_assert_after_calls)
    if r.divergence_counts:
        say(p("divergences: " + ", ".join(f"{k} {n}" for k, n in r.divergence_counts.items())))
        say("  first: " + p(describe(r.first_divergence, long=True)), "yellow")
    if r.translated:
        say("replayed through API translations (the build lacks these methods): "
            + ", ".join(f"{m} x{n}" for m, n in r.translated.items()))
    if any(r.held_at_end.values()):
        say("still held by the caller at the end: " + ", ".join(f"{k} {v} {unit_of(k)}"
                                                                for k, v in r.held_at_end.items()))


def _capacity_line(call: int | None, after: int | None) -> None:
    # The call where the condition of sglang's capacity assertion (available_size() <=
    # size) first fails, or where the build raised it: a release asserts only where it
    # checks, so it may raise calls later (or never) on the same broken state.
    if call is None:
        say("capacity: no available count ever exceeds its pool's size on this trace")
    elif after is None:
        say(f"capacity: an available count exceeds its pool's size from call #{call} (the condition the "
            "build's own assertion checks, where it checks)")
    else:
        say(f"capacity: an available count exceeds its pool's size from call #{call}, {after} calls after the "
            "first violation (the condition the build's own assertion checks, where it checks)")


def render_stored(d: dict[str, Any], *, show_all: bool = False) -> None:
    # A stored run is data: each of its lines is shown as one line.
    p = printable
    say(p(f"run {d['run_id']}: {d['trace']} on {d['build']} ({d['mode']}, {d['device']}, kernels: "
          f"{d.get('kernels', 'none')}) -> {d['status']}, "
          f"{d['calls_replayed']} calls, {d['violation_total']} violations, {d['divergence_total']} divergences"))
    if d.get("message"):
        say("  " + p(d["message"]))
    if d["violation_total"] or d["capacity_assert_call"] is not None:
        _capacity_line(d["capacity_assert_call"], d["capacity_assert_after_calls"])
    shown = list(d["violations"]) if show_all else list(firsts_by_rule(d["violations"]).values())
    for v in shown:
        say("  " + p(describe(v, long=True)), "red")
    if d["violations"]:
        say(p("counts: " + ", ".join(f"{k} {n}" for k, n in d["violation_counts"].items())))
        if not show_all and d["violation_total"] > len(shown):
            say(f"(first of each rule shown; kvreplay show {d['run_id']} --all for the {len(d['violations'])} kept)")
    for x in d["divergences"] if show_all else d["divergences"][:5]:
        say("  " + p(describe(x, long=True)), "yellow")
