"""The reports: one run, two runs compared, a diff, a bisect, a matrix and a CI
corpus run, each one self-contained HTML page (see page.py).

Every builder takes what the command it belongs to already has (a stored run's
dict, a fresh report's, a DiffReport, ...) in the vocabulary of docs/json.md, plus
the run's timeline; the trace, where it can still be read, adds the recorded
occupancy and the calls around each finding."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput, KvreplayError
from kvreplay.replay.timeline import MAX_MARKS
from kvreplay.report.gather import TraceGone, call_contexts, open_trace, recorded_occupancy, summarise
from kvreplay.report.page import ASSETS, asset, licence, render
from kvreplay.store.db import Store
from kvreplay.store.runs import get_run, run_timeline, run_to_dict

# What a report file may weigh; the README states it. A run's page is the charting
# library (1.5 MB) and data bounded by the timeline's buckets, the kept findings
# and their contexts.
BUDGET_BYTES = 5 * 1024 * 1024

_META = (("trace", "trace"), ("trace_hash", "trace hash"), ("build", "build"), ("build_version", "build version"),
         ("mode", "mode"), ("status", "status"), ("kernels", "kernels"), ("device", "device"),
         ("calls_replayed", "calls replayed"), ("wall_s", "wall s"), ("cpu_s", "cpu s"),
         ("calls_per_s", "calls/s"), ("violation_total", "violations"), ("divergence_total", "divergences"),
         ("capacity_assert_call", "build's assertion at call"), ("kvreplay_version", "kvreplay"),
         ("started_at", "stored at"), ("run_id", "run"), ("message", "message"))


def _meta(run: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for key, label in _META:
        v = run.get(key)
        if v is None or v == "":
            continue
        if isinstance(v, float):
            v = round(v, 3)
        rows.append([label, v])
    return rows


def _findings(run: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for v in run.get("violations") or []:
        out.append({"group": "violation", "key": f"{v['invariant']}/{v['rule']}", "call": v["call"],
                    "detected_call": v.get("detected_call", v["call"]), "method": v["method"],
                    "sub_pool": v.get("sub_pool", ""), "indices": summarise(v.get("indices") or []),
                    "message": v.get("message", "")})
    for d in run.get("divergences") or []:
        out.append({"group": "divergence", "key": d["kind"], "call": d["call"], "detected_call": d["call"],
                    "method": d["method"], "expected": summarise(d.get("expected")),
                    "actual": summarise(d.get("actual")), "message": d.get("message", "")})
    out.sort(key=lambda f: (f["call"], f["group"], f["key"]))
    return out


def _marks(run: dict[str, Any], timeline: dict[str, Any], findings: list[dict[str, Any]]) -> dict[str, Any]:
    """Every finding's call number from the timeline; from the kept findings alone for
    runs stored before timelines were kept."""
    if timeline.get("marks"):
        return timeline["marks"]
    marks: dict[str, dict[str, list[int]]] = {"violation": {}, "divergence": {}}
    for f in findings:
        marks[f["group"]].setdefault(f["key"], []).append(f["call"])
    return marks


def run_entry(run: dict[str, Any], timeline: dict[str, Any], *, label: str = "") -> dict[str, Any]:
    """One run as a report draws it."""
    findings = _findings(run)
    firsts: dict[str, int] = {}
    for i, f in enumerate(findings):
        firsts.setdefault(f"{f['group']}:{f['key']}", i)
    marks = _marks(run, timeline, findings)
    counts = {"violation": run.get("violation_counts") or {}, "divergence": run.get("divergence_counts") or {}}
    capped = [k for g in marks.values() for k, v in g.items() if len(v) >= MAX_MARKS]
    return {"label": label or run.get("build", ""), "meta": _meta(run), "status": run.get("status", ""),
            "build": run.get("build", ""), "run_id": run.get("run_id"),
            "occupancy": ({k: timeline[k] for k in ("stride", "sizes", "lo", "hi")} if timeline.get("lo") else None),
            "marks": marks, "counts": counts, "capped": capped, "findings": findings, "firsts": firsts,
            "capacity_call": run.get("capacity_assert_call"), "calls": run.get("calls_replayed") or 0}


def _with_trace(data: dict[str, Any], trace: str | None, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The recorded side, from the trace: occupancy and the calls around the findings."""
    data.setdefault("notes", [])
    data["recorded"] = None
    data["contexts"], data["around"] = {}, {}
    if not trace:
        return data
    try:
        reader = open_trace(trace)
        stride = next((e["occupancy"]["stride"] for e in entries if e["occupancy"]), None)
        data["recorded"] = recorded_occupancy(reader, stride)
        wanted = {f[k] for e in entries for f in e["findings"] for k in ("call", "detected_call")}
        contexts, around = call_contexts(reader, wanted)
        data["contexts"] = {str(k): v for k, v in contexts.items()}
        data["around"] = {str(k): v for k, v in around.items()}
    except TraceGone as exc:
        data["notes"].append(f"{exc}: the recorded occupancy and the calls around each finding are not shown")
    except KvreplayError as exc:  # readable at first, damaged further on
        data["recorded"], data["contexts"], data["around"] = None, {}, {}
        data["notes"].append(f"the trace could not be read to the end ({' '.join(str(exc).split())}): the "
                             "recorded occupancy and the calls around each finding are not shown")
    return data


def run_report(run: dict[str, Any], timeline: dict[str, Any], *, asset_url: str | None = None,
               nav: Iterable[tuple[str, str]] = ()) -> str:
    """The report of one run (a stored run's details, or a fresh report's dict)."""
    entry = run_entry(run, timeline)
    title = f"kvreplay: {Path(str(run.get('trace', ''))).name} on {run.get('build', '')} ({run.get('status', '')})"
    data = {"kind": "run", "title": title, "runs": [entry]}
    if not timeline:
        data["notes"] = ["this run was stored by a kvreplay that kept no timeline: the replayed occupancy "
                         "is not shown, findings only where kept"]
    return render(title, _with_trace(data, run.get("trace"), [entry]), asset_url=asset_url, nav=list(nav))


def stored_run_report(store: Store, run_id: int, *, asset_url: str | None = None,
                      nav: Iterable[tuple[str, str]] = ()) -> str:
    """The report of stored run ``run_id``."""
    return run_report(run_to_dict(get_run(store, run_id), details=True), run_timeline(store, run_id),
                      asset_url=asset_url, nav=nav)


def stored_compare_report(store: Store, a: int, b: int, *, asset_url: str | None = None,
                          nav: Iterable[tuple[str, str]] = ()) -> str:
    """Stored runs ``a`` and ``b`` on one axis."""
    runs = [(run_to_dict(get_run(store, i), details=True), run_timeline(store, i)) for i in (a, b)]
    return compare_report(runs[0], runs[1], asset_url=asset_url, nav=nav)


def compare_report(a: tuple[dict[str, Any], dict[str, Any]], b: tuple[dict[str, Any], dict[str, Any]], *,
                   asset_url: str | None = None, nav: Iterable[tuple[str, str]] = ()) -> str:
    """Two runs on one axis (of the same trace, or not: then on call numbers alone)."""
    ea = run_entry(*a, label=f"A: run {a[0].get('run_id')} {a[0].get('build', '')}")
    eb = run_entry(*b, label=f"B: run {b[0].get('run_id')} {b[0].get('build', '')}")
    title = f"kvreplay: run {a[0].get('run_id')} against run {b[0].get('run_id')}"
    data = {"kind": "compare", "title": title, "runs": [ea, eb]}
    same_trace = a[0].get("trace_hash") == b[0].get("trace_hash")
    if not same_trace:
        data["notes"] = ["the two runs replayed different traces: calls are compared by number only"]
    return render(title, _with_trace(data, a[0].get("trace") if same_trace else None, [ea, eb]),
                  asset_url=asset_url, nav=list(nav))


def diff_report(d: Any) -> str:
    """``kvreplay diff``: both builds' occupancy on one axis, the calls where they part,
    the first in its context."""
    differing = d.differing
    entries = []
    for label, spec, tl in (("base", d.base, d.timelines.get("base", {})),
                            ("candidate", d.candidate, d.timelines.get("candidate", {}))):
        run = {"trace": d.trace, "build": spec, "mode": d.mode, "calls_replayed": d.calls,
               "status": "differs" if d.differing_calls else "agrees"}
        e = run_entry(run, {**tl, "marks": {"violation": {}, "divergence": {}}}, label=f"{label}: {spec}")
        entries.append(e)
    first = d.first
    parted = {"violation": {}, "divergence": {f"differs ({d.first_kind})": differing}} if differing else \
        {"violation": {}, "divergence": {}}
    entries[1]["marks"] = parted
    if first is not None:
        entries[1]["findings"] = [{"group": "divergence", "key": f"differs ({d.first_kind})", "call": first.call,
                                   "detected_call": first.call, "method": first.method,
                                   "expected": summarise(first.base), "actual": summarise(first.candidate),
                                   "message": f"{d.base} and {d.candidate} part here ({d.first_kind})"}]
        entries[1]["firsts"] = {f"divergence:differs ({d.first_kind})": 0}
    title = f"kvreplay diff: {d.base} against {d.candidate} on {Path(d.trace).name}"
    data = {"kind": "diff", "title": title, "runs": entries,
            "summary": [["trace", d.trace], ["mode", d.mode], ["calls", d.calls],
                        ["differing calls", d.differing_calls],
                        ["first difference", f"call #{first.call} {first.method} ({d.first_kind})" if first else "-"],
                        *[[f"differing {m}", n] for m, n in d.per_method.items()]]}
    return render(title, _with_trace(data, d.trace, entries))


def bisect_report(result: dict[str, Any]) -> str:
    """``kvreplay bisect``: the step log as a line of builds, good, bad or skipped."""
    title = f"kvreplay bisect: {result.get('verdict') or result.get('first_bad') or ''}".strip()
    return render(title, {"kind": "bisect", "title": title, "bisect": result, "notes": []})


def matrix_report(result: dict[str, Any], links: dict[str, str]) -> str:
    """``kvreplay matrix``: build x rule counts as a heat map, each build linking to
    its run's report (``links``: build spec -> href)."""
    title = "kvreplay matrix"
    return render(title, {"kind": "matrix", "title": title, "matrix": result, "links": links, "notes": []})


def ci_index(results: list[dict[str, Any]], links: dict[str, str], build: str) -> str:
    """``kvreplay ci``: the corpus run, one line per trace linking to its page."""
    title = f"kvreplay ci on {build}"
    return render(title, {"kind": "ci", "title": title, "ci": results, "links": links, "notes": []})


def check_report_path(path: str | os.PathLike[str], what: str = "report path") -> Path:
    """Refuse an output file (a report, a JUnit file, a summary) that cannot be
    written, before any long work starts; its directory is never created."""
    out = Path(path)
    if out.is_dir():
        raise BadInput(f"{what} {out} is a directory; give a file name")
    if not out.parent.is_dir():
        raise BadInput(f"{what} {out}: the directory {out.parent} does not exist")
    return out


def write_report(text: str, path: str | os.PathLike[str]) -> Path:
    """Write a page where asked, whole or not at all."""
    out = check_report_path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def pages_dir(index: str | os.PathLike[str]) -> Path:
    """Where the run pages an index page links to go: beside it, ``NAME-runs/``."""
    p = Path(index)
    return p.with_name(f"{p.stem}-runs")


def write_run_pages(store: Store, run_ids: Iterable[int], index: str | os.PathLike[str]) -> dict[int, str]:
    """Each stored run's report beside the index page; run id -> its href from there.
    The pages of one folder share one copy of the scripts (``assets/``): a corpus of a
    hundred traces is not a hundred copies of the charting library."""
    folder = pages_dir(index)
    folder.mkdir(exist_ok=True)
    shared = folder / "assets"
    shared.mkdir(exist_ok=True)
    for name in ASSETS:
        (shared / name).write_text(asset(name), encoding="utf-8")
    (shared / "plotly-LICENSE.txt").write_text(licence(), encoding="utf-8")
    links = {}
    for run_id in sorted(set(run_ids)):
        write_report(stored_run_report(store, run_id, asset_url="assets", nav=[("back", f"../{Path(index).name}")]),
                     folder / f"run-{run_id}.html")
        links[run_id] = f"{folder.name}/run-{run_id}.html"
    return links


__all__ = ["BUDGET_BYTES", "bisect_report", "check_report_path", "ci_index", "compare_report", "diff_report",
           "matrix_report", "pages_dir", "run_entry", "run_report", "stored_compare_report", "stored_run_report",
           "write_report", "write_run_pages"]
