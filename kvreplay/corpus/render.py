"""A corpus run for CI systems: JUnit XML (one testcase per trace and mode) and a
Markdown summary for a pull-request comment."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from urllib.parse import quote

from kvreplay.corpus.ci import CaseResult, ok

# Characters XML 1.0 cannot hold at all (a name with one made the file unparseable).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")
# What Markdown (GitHub's included) would read as markup, a link, HTML or a table cell's end.
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#+!|<>~&\-])")


def xml_text(text: object) -> str:
    """Any text as XML 1.0 can carry it: characters it forbids become U+FFFD."""
    return _NOT_XML.sub("\ufffd", str(text))


def md_text(text: object) -> str:
    """Text from data as literal Markdown: every markup character escaped, line breaks
    and control characters made spaces, so that it stays in its table cell."""
    flat = re.sub(r"[\x00-\x1f\x7f]", " ", str(text))
    return _MARKDOWN.sub(r"\\\1", flat)


def junit_xml(results: list[CaseResult], build: str) -> str:
    """JUnit XML: one testsuite per build, one testcase per trace and mode."""
    suite = ET.Element("testsuite", name=xml_text(f"kvreplay {build}"), tests=str(len(results)),
                       failures=str(sum(r.outcome == "fail" for r in results)),
                       errors=str(sum(r.outcome == "error" for r in results)),
                       skipped=str(sum(r.outcome == "skip" for r in results)),
                       time=f"{sum(r.wall_s for r in results):.3f}")
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=xml_text(f"kvreplay.{build}"), name=xml_text(r.case.name),
                           time=f"{r.wall_s:.3f}")
        if r.outcome in ("fail", "error"):
            el = ET.SubElement(tc, "failure" if r.outcome == "fail" else "error",
                               message=xml_text(r.problems[0] if r.problems else r.outcome))
            el.text = xml_text(f"expected {r.case.expected()}; replay status {r.status or 'none'}\n"
                               + "\n".join(r.problems))
        elif r.outcome == "skip":
            ET.SubElement(tc, "skipped", message=xml_text(r.problems[0] if r.problems else "skipped"))
        ET.SubElement(tc, "system-out").text = f"{r.calls} calls, status {r.status}, run {r.run_id}"
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def markdown_summary(results: list[CaseResult], build: str, links: dict[int, str] | None = None) -> str:
    """The corpus run for a PR comment; ``links`` (run id -> href) adds each run's report."""
    links = links or {}
    mark = {"pass": "✅", "fail": "❌", "error": "💥", "skip": "⏭️"}
    n = {k: sum(r.outcome == k for r in results) for k in mark}
    lines = [f"### kvreplay corpus on {md_text(build)}: {'all expectations hold' if ok(results) else 'FAILED'}", "",
             f"{n['pass']} passed, {n['fail']} failed, {n['error']} errors, {n['skip']} skipped", "",
             "| | trace | mode | expected | got | calls |" + (" report |" if links else ""),
             "|---|---|---|---|---|---|" + ("---|" if links else "")]
    for r in results:
        page = links.get(r.run_id) if r.run_id is not None else None
        lines.append(f"| {mark[r.outcome]} | {md_text(r.case.trace)} | {md_text(r.case.mode)} | "
                     f"{md_text(r.case.expected())} | {md_text(r.status or '-')} | {r.calls} |"
                     + ((f" [run {r.run_id}]({quote(page, safe='/._-')}) |" if page else " - |")
                                                        if links else ""))
    bad = [r for r in results if r.outcome in ("fail", "error")]
    if bad:
        lines += ["", "**What did not hold:**", ""]
        lines += [f"- {md_text(r.case.name)}: {md_text(p)}" for r in bad for p in r.problems]
    return "\n".join(lines) + "\n"
