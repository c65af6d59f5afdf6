"""What every hostile-input test asks of a command's answer to bad input."""

from __future__ import annotations

import subprocess


def bad(res: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one line on stderr that starts ``kvreplay: error:`` and holds ``words``."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.startswith("kvreplay: error:") and res.stderr.count("\n") == 1, res.stderr
    for w in words:
        assert w in res.stderr, (w, res.stderr)
