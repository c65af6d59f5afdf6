"""The layout docs keep up with the package (issue 61): docs/layout.md names every module
of kvreplay and nothing that is gone, every page of docs/ is in the site's nav and in
layout.md, and docs/design.md's layer table is tests/layers.py's LAYERS, row for row.

Each check is a function of the text it reads, so a test can feed it an altered copy
and see it fail: a check that cannot fail guards nothing."""

from __future__ import annotations

import re
from itertools import zip_longest
from pathlib import Path

import layers

ROOT = Path(__file__).resolve().parents[1]
KVREPLAY = ROOT / "kvreplay"
DOCS = ROOT / "docs"


def _read(name: str) -> str:
    return (ROOT / name).read_text()


# --- layout.md: every module, and nothing that is gone ------------------------------

# A file name in a line of the tree: `growth.py`, `_capture.c`, or a path under the
# line's folder (`_site/sitecustomize.py`, `migrations/env.py`).
_NAME = re.compile(r"(?<![\w/.])(\w+(?:/\w+)*\.(?:py|c))\b")


def layout_names(text: str) -> set[str]:
    """Every path under kvreplay/ that layout.md's tree names, relative to the repository.

    A line that starts with ``kvreplay/...`` (its head) names that path and sets the
    folder: the head itself if it ends in ``/``, else the head's folder. The rest of the
    line and the lines below it that start with a space (its continuation) name files
    of that folder by their path relative to it: ``kvreplay/check/  rules.py, growth.py``
    names kvreplay/check/rules.py and kvreplay/check/growth.py. Any other line that does
    not start with a space ends the folder."""
    named: set[str] = set()
    folder = ""
    for line in text.splitlines():
        head = re.match(r"kvreplay/\S*", line)
        if head:
            path = head.group(0)
            named.add(path)
            folder = path if path.endswith("/") else path.rpartition("/")[0] + "/"
            rest = line[head.end():]
        elif folder and line[:1].isspace() and line.strip():
            rest = line
        else:
            folder = ""
            continue
        named |= {folder + name for name in _NAME.findall(rest)}
    return named


def package_files(root: Path = KVREPLAY) -> set[str]:
    """Every file and folder of the package, relative to the repository (folders end in /)."""
    out = set()
    for p in root.rglob("*"):
        if "__pycache__" in p.parts:
            continue
        out.add(p.relative_to(root.parent).as_posix() + ("/" if p.is_dir() else ""))
    return out


def module_files(files: set[str]) -> set[str]:
    """The modules layout.md must name: every .py and .c file of the package but the
    ``__init__.py`` files and the Alembic migrations (store/migrations/versions/)."""
    return {f for f in files if f.endswith((".py", ".c")) and not f.endswith("/__init__.py")
            and not f.startswith("kvreplay/store/migrations/versions/")}


def layout_problems(text: str, files: set[str]) -> list[str]:
    """A line per path the layout names that does not exist, and per module it does not name."""
    named = layout_names(text)
    return ([f"names what does not exist: {p}" for p in sorted(named - files)]
            + [f"does not name: {p}" for p in sorted(module_files(files) - named)])


def test_layout_names_every_module_and_only_what_exists():
    assert layout_problems(_read("docs/layout.md"), package_files()) == []


def _added(real: list[str], altered: list[str]) -> set[str]:
    """What a check finds in altered input that it does not find in the real one: a
    failure test then holds while the docs are being brought up to date."""
    return set(altered) - set(real)


def test_the_layout_check_fails_on_a_gone_module_and_on_a_missing_one():
    text = _read("docs/layout.md")
    files = package_files()
    # a module renamed in the doc only: the new name is not there, the old one is missing
    renamed = text.replace("growth.py", "grow.py", 1)
    real = layout_problems(text, files)
    assert _added(real, layout_problems(renamed, files)) == {"does not name: kvreplay/check/growth.py",
                                                             "names what does not exist: kvreplay/check/grow.py"}
    # a module added to the package that the doc does not know
    assert _added(real, layout_problems(text, files | {"kvreplay/jobs/new_job.py"})) == {
        "does not name: kvreplay/jobs/new_job.py"}
    # a name resolves in its own line's folder only: growth.py is no module of replay/
    moved = text.replace("diff.py", "diff.py, growth.py", 1)
    assert _added(real, layout_problems(moved, files)) == {"names what does not exist: kvreplay/replay/growth.py"}


def test_the_layout_names_resolve_against_their_folder():
    text = ("```\nkvreplay/recorder/     capture.py + _capture.c, _site/sitecustomize.py,\n"
            "                       writer.py\nkvreplay/fanout.py     units (not a.py)\n"
            "docs/                  index.md\n  stray.py\n```\n")
    assert layout_names(text) == {
        "kvreplay/recorder/", "kvreplay/recorder/capture.py", "kvreplay/recorder/_capture.c",
        "kvreplay/recorder/_site/sitecustomize.py", "kvreplay/recorder/writer.py",
        "kvreplay/fanout.py", "kvreplay/a.py"}


# --- the pages of docs/: in the nav and in layout.md --------------------------------

def nav_pages(mkdocs_yml: str) -> set[str]:
    """The pages mkdocs.yml's nav links (``- Title: page.md`` or ``- page.md``), read as
    text: the nav is the ``nav:`` key and the indented or list lines under it."""
    block = re.search(r"^nav:\n((?:[ \t-].*\n?|\n)*)", mkdocs_yml, re.M)
    return set(re.findall(r"^[ \t]*-[ \t]*(?:[^\n:]*:[ \t]*)?([\w./-]+\.md)[ \t]*$", block.group(1), re.M)) \
        if block else set()


def layout_pages(text: str) -> set[str]:
    """The pages layout.md's ``docs/`` line and its continuation lines list."""
    found: set[str] = set()
    inside = False
    for line in text.splitlines():
        if line.startswith("docs/"):
            inside = True
            line = line[len("docs/"):]
        elif not (inside and line[:1].isspace() and line.strip()):
            inside = False
            continue
        found |= set(re.findall(r"[\w.-]+\.md", line))
    return found


def pages_problems(mkdocs_yml: str, layout: str, pages: set[str]) -> list[str]:
    """A line per page of docs/ missing from the nav or the layout, and per page either
    names that docs/ does not hold."""
    nav, listed = nav_pages(mkdocs_yml), layout_pages(layout)
    return ([f"not in mkdocs.yml's nav: {p}" for p in sorted(pages - nav)]
            + [f"mkdocs.yml's nav links a page docs/ lacks: {p}" for p in sorted(nav - pages)]
            + [f"not listed in layout.md: {p}" for p in sorted(pages - listed)]
            + [f"layout.md lists a page docs/ lacks: {p}" for p in sorted(listed - pages)])


def _pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def test_every_page_is_in_the_nav_and_the_layout():
    assert pages_problems(_read("mkdocs.yml"), _read("docs/layout.md"), _pages()) == []


def test_the_pages_check_fails_on_a_page_left_out():
    yml, layout, pages = _read("mkdocs.yml"), _read("docs/layout.md"), _pages()
    assert "design.md" in nav_pages(yml) and "design.md" in layout_pages(layout)
    real = pages_problems(yml, layout, pages)
    assert _added(real, pages_problems(yml, layout, pages | {"new.md"})) == {"not in mkdocs.yml's nav: new.md",
                                                                             "not listed in layout.md: new.md"}
    no_nav = re.sub(r"^.*: design\.md\n", "", yml, flags=re.M)
    assert _added(real, pages_problems(no_nav, layout, pages)) == {"not in mkdocs.yml's nav: design.md"}
    head, docs_line, rest = layout.partition("\ndocs/")
    no_listing = head + docs_line + rest.replace("design.md", "designs.md", 1)
    assert _added(real, pages_problems(yml, no_listing, pages)) == {"not listed in layout.md: design.md",
                                                                    "layout.md lists a page docs/ lacks: designs.md"}


# --- design.md's layer table: tests/layers.py's LAYERS ------------------------------

def entry_path(entry: str, root: Path = KVREPLAY) -> str:
    """A LAYERS entry as the table writes it: its dots become slashes, and a package (a
    folder of kvreplay/) ends in ``/``, anything else is a module (``.py``):
    ``jobs.bisect`` is `jobs/bisect.py`, ``families.sglang`` is `families/sglang/`,
    ``contract`` is `contract/`."""
    path = entry.replace(".", "/")
    return path + "/" if (root / path).is_dir() else path + ".py"


def layer_table(design: str) -> list[tuple[str, list[str]]]:
    """The rows of the table in design.md's "## Layout" section: (the layer's number,
    the backticked entries of its second column)."""
    section = re.search(r"^## Layout\n(.*?)(?=^#{1,3} )", design + "\n## end\n", re.M | re.S)
    if not section:
        return []
    rows = re.findall(r"^\|\s*(\d+\w*)\s*\|([^|]*)\|", section.group(1), re.M)
    return [(number, re.findall(r"`([^`]+)`", entries)) for number, entries in rows]


def layer_table_problems(design: str, layer_list: list[list[str]], root: Path = KVREPLAY) -> list[str]:
    """A line per row of the table that is not LAYERS' layer of that number (numbered from
    1, top first, the entries in LAYERS' order), and per layer the table lacks."""
    table = layer_table(design)
    want = [(str(i + 1), [entry_path(e, root) for e in layer]) for i, layer in enumerate(layer_list)]
    return [f"row {i + 1}: the table has {got or 'nothing'}, LAYERS {exp or 'nothing'}"
            for i, (got, exp) in enumerate(zip_longest(table, want)) if got != exp]


def test_the_design_layer_table_is_the_import_contract():
    assert layer_table_problems(_read("docs/design.md"), layers.LAYERS) == []


def _table(layer_list: list[list[str]]) -> str:
    """A design page whose layer table is ``layer_list``'s, written as design.md writes it."""
    rows = "".join(f"| {i + 1} | {', '.join(f'`{entry_path(e)}`' for e in layer)} | what it holds |\n"
                   for i, layer in enumerate(layer_list))
    return f"# Design\n\n## Layout\n\n| layer | package or module | holds |\n|---|---|---|\n{rows}\n## Next\n"


def test_the_layer_table_check_fails_on_a_renamed_entry_a_swap_and_a_missing_layer():
    assert entry_path("jobs.bisect") == "jobs/bisect.py"
    assert entry_path("families.sglang") == "families/sglang/"
    assert entry_path("contract") == "contract/"
    assert entry_path("fanout") == "fanout.py"
    # the real page's table is read: its rows, numbered from 1, with their backticked entries
    real = layer_table(_read("docs/design.md"))
    assert real[0] == ("1", ["cli/"]) and [n for n, _ in real] == [str(i + 1) for i in range(len(real))]
    good = _table(layers.LAYERS)
    assert layer_table_problems(good, layers.LAYERS) == []
    # an entry renamed in the doc
    renamed = good.replace("`jobs/watch.py`", "`jobs/wotch.py`", 1)
    assert len(layer_table_problems(renamed, layers.LAYERS)) == 1
    # two layers swapped in LAYERS and not in the doc
    swapped = [list(layer) for layer in layers.LAYERS]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert len(layer_table_problems(good, swapped)) == 2
    # entries of one layer in another order
    reordered = [list(layer) for layer in layers.LAYERS]
    reordered[2].reverse()
    assert len(layer_table_problems(good, reordered)) == 1
    # a layer added at the bottom of LAYERS, and one dropped from the doc
    assert layer_table_problems(good, [*layers.LAYERS, ["new"]]) == [
        f"row {len(layers.LAYERS) + 1}: the table has nothing, LAYERS ('{len(layers.LAYERS) + 1}', ['new.py'])"]
    cut = re.sub(r"^\| 2 \|.*\n", "", good, flags=re.M)
    assert len(layer_table_problems(cut, layers.LAYERS)) == len(layers.LAYERS) - 1
    # a layer numbered out of turn ("5b")
    assert len(layer_table_problems(good.replace("| 6 |", "| 5b |", 1), layers.LAYERS)) == 1
