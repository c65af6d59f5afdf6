"""Text from data made safe to show: what a terminal (or a log, or a metrics label)
would act on instead of printing is written out as an escape.

A trace's footer, a stored run, a server's answer or a file name can hold anything:
an ESC that starts a cursor move or an OSC 8 link, a C1 control (0x9b is a CSI on
some terminals), a bidi override that shows a line's characters in another order,
a lone surrogate (a file name that is not UTF-8) that no encoder writes. Each is
shown as Python writes it in a string literal (``\\x1b``, ``\\u202e``, ``\\udcff``),
so a reader sees that it was there. Backslashes themselves are left alone: a
Windows path stays readable, and nothing a terminal does is hidden by that."""

from __future__ import annotations

import re

# C0 controls, DEL and C1; the bidi embeddings, overrides, isolates and marks; the
# Unicode line and paragraph separators (a new line to some terminals and editors);
# surrogates (a str holds them only from bytes that were not UTF-8).
_CONTROLS = "\x00-\x1f\x7f-\x9f"
_OTHERS = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ud800-\udfff"
_UNSAFE = re.compile(f"[{_CONTROLS}{_OTHERS}]")
_UNSAFE_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f\x7f-\x9f{_OTHERS}]")


_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    code = ord(c)
    return _SHORT.get(c) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: object) -> str:
    """``text`` (anything: ``str()`` of it) with every control, bidi and surrogate
    character escaped, newlines and tabs included: one line, shown as it is."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE.sub(_escaped, s) if _UNSAFE.search(s) else s


def printable_lines(text: object) -> str:
    """As :func:`printable`, but a newline stays a newline: for output made of lines
    (a table, a message of several lines), escaped after it was laid out."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE_BUT_NEWLINE.sub(_escaped, s) if _UNSAFE_BUT_NEWLINE.search(s) else s
