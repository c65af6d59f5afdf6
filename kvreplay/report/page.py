"""The HTML shell every report and dashboard page shares: the charting library and
kvreplay's own script and style, inlined for a file that must open offline (or
linked, for the dashboard, which serves them once), and the page's data as JSON.

Data from traces and stores (paths, messages, build specs) is never markup: it is
written as JSON inside a non-executable script element, with ``<`` escaped so no
value can close that element, and the page's script puts it on the page as text."""

from __future__ import annotations

import html
import json
from functools import cache
from importlib import resources
from typing import Any

ASSETS = ("plotly-cartesian.min.js", "report.js", "report.css")


@cache
def asset(name: str) -> str:
    if name not in ASSETS:
        raise KeyError(name)
    return resources.files("kvreplay.report").joinpath("assets", name).read_text(encoding="utf-8")


def licence() -> str:
    """The charting library's licence, shipped beside every copy of it."""
    return resources.files("kvreplay.report").joinpath("assets", "plotly-LICENSE.txt").read_text(encoding="utf-8")


def data_json(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"), sort_keys=True, default=str, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(title: str, data: dict[str, Any], *, asset_url: str | None = None, nav: list[tuple[str, str]] = ()
           ) -> str:
    """One page. ``asset_url``: link the scripts and style from there (the dashboard)
    instead of inlining them (a report file)."""
    if asset_url is None:
        head = (f"<style>{asset('report.css')}</style>\n"
                f"<script>{asset('plotly-cartesian.min.js')}</script>")
        tail = f"<script>{asset('report.js')}</script>"
    else:
        head = (f'<link rel="stylesheet" href="{asset_url}/report.css">\n'
                f'<script src="{asset_url}/plotly-cartesian.min.js"></script>')
        tail = f'<script src="{asset_url}/report.js"></script>'
    links = " ".join(f'<a href="{html.escape(href, quote=True)}">{html.escape(label)}</a>' for label, href in nav)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
{head}
</head><body>
<header><span class="brand">kvreplay</span> <nav>{links}</nav></header>
<main id="app"><noscript>This report draws with JavaScript.</noscript></main>
<script type="application/json" id="kvreplay-data">{data_json(data)}</script>
{tail}
</body></html>
"""


__all__ = ["ASSETS", "asset", "data_json", "licence", "render"]
