"""``kvreplay serve``: a read-only web dashboard over the store, for one person on
their own machine (127.0.0.1 by default).

Pages: the runs, filtered by trace, build, status and date; one run's report; two
runs compared; one trace's history across builds. Every route is a GET that reads;
nothing here writes to the store. Pages are Flask's Jinja templates (autoescaped)
and the report pages of ``kvreplay.report``, whose assets are served once."""

from __future__ import annotations

import datetime as dt
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, abort, jsonify, render_template_string, request

from kvreplay.errors import BadInput
from kvreplay.replay.report import STATUSES
from kvreplay.report.page import ASSETS, asset, data_json
from kvreplay.report.reports import stored_compare_report, stored_run_report
from kvreplay.store.db import Store
from kvreplay.store.runs import build_specs, get_run, list_runs, run_to_dict, trace_by_hash

ASSET_URL = "/assets"
MAX_LISTED = 500
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

_LIST = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<link rel="stylesheet" href="{{ assets }}/report.css"></head><body>
<header><span class="brand">kvreplay</span> <nav><a href="/">runs</a></nav></header>
<main>
<h1>{{ title }}</h1>
{% if filters %}
<form class="filters" method="get" action="/" id="filters">
  <label>trace (path part or hash)<input name="trace" value="{{ f.trace }}"></label>
  <label>build<select name="build"><option value="">any</option>
    {% for b in builds %}<option value="{{ b }}" {% if b == f.build %}selected{% endif %}>{{ b }}</option>{% endfor %}
  </select></label>
  <label>status<select name="status"><option value="">any</option>
    {% for s in statuses %}<option value="{{ s }}" {% if s == f.status %}selected{% endif %}>{{ s }}</option>
    {% endfor %}
  </select></label>
  <label>stored from<input type="date" name="since" value="{{ f.since }}"></label>
  <label>until<input type="date" name="until" value="{{ f.until }}"></label>
  <button type="submit">filter</button> <a href="/">clear</a>
</form>
{% endif %}
{% if error %}<div class="notes"><p>{{ error }}</p></div>{% endif %}
{% if history %}<div id="app"></div>
<script type="application/json" id="kvreplay-data">{{ history|safe }}</script>
<script src="{{ assets }}/plotly-cartesian.min.js"></script><script src="{{ assets }}/report.js"></script>{% endif %}
<form method="get" action="/compare" id="compare">
<p class="muted">{{ runs|length }} run(s){% if runs|length >= limit %} (the newest {{ limit }}){% endif %}.
Pick A and B to compare two runs: <button type="submit">compare</button></p>
<table id="runs"><thead><tr><th>A</th><th>B</th><th>run</th><th>trace</th><th>build</th><th>mode</th>
<th>status</th><th>calls</th><th>violations</th><th>divergences</th><th>first violation</th><th>stored</th></tr></thead>
<tbody>
{% for r in runs %}<tr class="run" data-run="{{ r.run_id }}" data-status="{{ r.status }}">
<td><input type="radio" name="a" value="{{ r.run_id }}" aria-label="A"></td>
<td><input type="radio" name="b" value="{{ r.run_id }}" aria-label="B"></td>
<td><a class="run-link" href="/runs/{{ r.run_id }}">{{ r.run_id }}</a></td>
<td><a href="/traces/{{ r.trace_hash }}" title="{{ r.trace }}">{{ r.trace_name }}</a></td>
<td>{{ r.build }}</td><td>{{ r.mode }}</td><td class="status">{{ r.status }}</td><td>{{ r.calls_replayed }}</td>
<td>{{ r.violation_total }}</td><td>{{ r.divergence_total }}</td>
<td>{% if r.first_violation %}#{{ r.first_violation.call }} {{ r.first_violation.invariant }}{% else %}-{% endif %}</td>
<td>{{ (r.started_at or "")[:19] }}</td></tr>
{% endfor %}
</tbody></table></form>
</main></body></html>
"""


def _day(value: str | None, name: str) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.combine(dt.date.fromisoformat(value), dt.time(), tzinfo=dt.timezone.utc)
    except ValueError:
        raise BadInput(f"{name} must be a date (YYYY-MM-DD), not {value!r}") from None


def _listed(runs: list[Any]) -> list[dict[str, Any]]:
    out = []
    for r in runs:
        d = run_to_dict(r)
        d["trace_name"] = d["trace"].rstrip("/").rsplit("/", 1)[-1]
        out.append(d)
    return out


def create_app(store: Store, *, hosts: frozenset[str] | None = None) -> Flask:
    """The dashboard over an open store (tests call it with Flask's test client too).
    ``hosts``: the only Host headers answered. A page elsewhere on the web can point a
    name of its own at 127.0.0.1 (DNS rebinding) and read what this serves; such
    requests carry that name, and get a 400 instead."""
    app = Flask("kvreplay.jobs.dashboard")
    _guard(app, hosts)
    _add_run_pages(app, store)
    _add_trace_history(app, store)
    _add_files(app, store)
    return app


def _guard(app: Flask, hosts: frozenset[str] | None) -> None:
    """Every answer: to a known Host only, and with headers that keep a page to its own scripts."""

    @app.before_request
    def _host() -> None:
        if hosts is not None and request.host.lower() not in hosts:
            abort(400, "unknown Host header: open the dashboard by the address it printed")

    @app.after_request
    def _headers(resp: Response) -> Response:
        # The pages run only their own scripts; nothing is fetched from elsewhere.
        resp.headers["Content-Security-Policy"] = ("default-src 'self'; script-src 'self' 'unsafe-inline' "
                                                   "'unsafe-eval'; style-src 'self' 'unsafe-inline'; img-src 'self' "
                                                   "data:")
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp


def _add_run_pages(app: Flask, store: Store) -> None:
    """/ (the runs, filtered), /runs/ID (one run's report) and /compare (two runs)."""

    @app.get("/")
    def runs() -> tuple[str, int]:
        f = {k: request.args.get(k, "").strip() for k in ("trace", "build", "status", "since", "until")}
        rows, error = _filtered_runs(store, f)
        page = render_template_string(_LIST, title="Runs", runs=rows, f=f, builds=build_specs(store),
                                      statuses=STATUSES, assets=ASSET_URL, filters=True, error=error,
                                      limit=MAX_LISTED, history=None)
        return page, 400 if error else 200

    @app.get("/runs/<int:run_id>")
    def run(run_id: int) -> str:
        r = _run_or_404(store, run_id)
        return stored_run_report(store, run_id, asset_url=ASSET_URL,
                                 nav=[("runs", "/"), ("trace history", f"/traces/{r.trace.content_hash[:12]}")])

    @app.get("/compare")
    def compare() -> str:
        try:
            a, b = int(request.args.get("a", "")), int(request.args.get("b", ""))
        except ValueError:
            abort(400, "pick two runs: /compare?a=RUN&b=RUN")
        _run_or_404(store, a)
        _run_or_404(store, b)
        return stored_compare_report(store, a, b, asset_url=ASSET_URL,
                                     nav=[("runs", "/"), (f"run {a}", f"/runs/{a}"), (f"run {b}", f"/runs/{b}")])


def _filtered_runs(store: Store, f: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
    """(the runs the list's filters let through, "") or ([], why a filter is refused)."""
    try:
        if f["status"] and f["status"] not in STATUSES:
            raise BadInput(f"status must be one of {', '.join(STATUSES)}")
        until = _day(f["until"], "until")
        if until is not None:  # the day's end; there is none after 9999-12-31
            until = until + dt.timedelta(days=1) if until.date() < dt.date.max else None
        return _listed(list_runs(store, trace=f["trace"] or None, build=f["build"] or None,
                                 status=f["status"] or None, since=_day(f["since"], "from"),
                                 until=until, limit=MAX_LISTED)), ""
    except BadInput as exc:
        return [], str(exc)


def _add_trace_history(app: Flask, store: Store) -> None:
    """/traces/HASH: one trace's runs across builds, drawn as a history."""

    @app.get("/traces/<trace_hash>")
    def trace(trace_hash: str) -> str:
        # a content hash, or a prefix of one: 64 hex digits at most (a longer name is no trace's)
        ok = 0 < len(trace_hash) <= 64 and all(c in "0123456789abcdefABCDEF" for c in trace_hash)
        t = trace_by_hash(store, trace_hash.lower()) if ok else None
        if t is None:
            abort(404, "no such trace in this database")
        rows = _listed(list_runs(store, trace_hash=t.content_hash, limit=MAX_LISTED))
        points = [{k: r[k] for k in ("run_id", "build", "status", "mode", "violation_total", "divergence_total",
                                     "started_at")} for r in reversed(rows)]
        history = data_json({"kind": "history", "runs": points, "links": {str(r["run_id"]): f"/runs/{r['run_id']}"
                                                                            for r in rows}})
        return render_template_string(_LIST, title=f"History of {t.path} ({t.content_hash[:12]}) across builds",
                                      runs=rows, f={}, assets=ASSET_URL, filters=False, error="",
                                      limit=MAX_LISTED, history=history)


def _add_files(app: Flask, store: Store) -> None:
    """The favicon (none), /api/runs (the runs as JSON) and the report pages' assets."""

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status=204)

    @app.get("/api/runs")
    def api_runs() -> Response:
        return jsonify(_listed(list_runs(store, limit=MAX_LISTED)))

    @app.get(f"{ASSET_URL}/<name>")
    def assets(name: str) -> Response:
        if name not in ASSETS:
            abort(404)
        resp = Response(asset(name), mimetype=_TYPES[name[name.rfind("."):]].split(";")[0])
        resp.headers["Cache-Control"] = "max-age=3600"
        return resp


def _run_or_404(store: Store, run_id: int) -> Any:
    try:
        return get_run(store, run_id)
    except BadInput:
        abort(404, f"no run {run_id} in this database")


def serve(store: Store, *, host: str = "127.0.0.1", port: int = 8765,
          listening: Callable[[str], None] | None = None) -> int | None:
    """Serve until interrupted (Werkzeug's server: for one user, not the internet).
    ``port`` 0 takes a free one; ``listening`` is told the URL once the socket is bound.
    Returns the signal that stopped it (SIGINT, SIGTERM), if one did."""
    from werkzeug.serving import make_server

    # Werkzeug answers a busy port by printing and exiting; try it first, as it would bind.
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        app: dict[str, Any] = {}
        server = make_server(host, port, lambda environ, start: app["wsgi"](environ, start), threaded=True)
    except (OSError, SystemExit) as exc:
        why = getattr(exc, "strerror", None) or "the address is in use or not this machine's"
        raise BadInput(f"cannot listen on {host}:{port} ({why})") from None
    port = server.server_port  # the one bound (port 0 asks the system for a free one)
    names = {host, "localhost", "127.0.0.1", "[::1]"} if host in ("127.0.0.1", "localhost", "::1") else None
    app["wsgi"] = create_app(store, hosts=frozenset(f"{n}:{port}" for n in names) if names else None)
    if listening is not None:
        listening(f"http://{'[' + host + ']' if ':' in host else host}:{port}/")
    stopped_by: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        raise KeyboardInterrupt  # Werkzeug's loop ends on it (and keeps it to itself)

    own = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)} if own else {}
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        server.server_close()
    return stopped_by[0] if stopped_by else None


__all__ = ["create_app", "serve"]
