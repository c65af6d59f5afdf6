"""pytest plugin: the corpus as test items, for teams that live in pytest.

    pytest --kvreplay-corpus traces/ --kvreplay-build builtin:swa

adds one item per trace (and replay mode) with the same expectations as
``kvreplay ci``: the manifest's for that build, else a clean replay. Runs are not
stored. Registered through the ``pytest11`` entry point, so installing kvreplay is
all it takes; without ``--kvreplay-corpus`` it adds nothing."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvreplay", "replay a kvreplay trace corpus")
    group.addoption("--kvreplay-corpus", default=None, metavar="DIR",
                    help="corpus directory (with manifest.json): one test item per trace")
    group.addoption("--kvreplay-build", default="builtin:swa", metavar="BUILD",
                    help="build to replay the corpus on (default: builtin:swa)")
    group.addoption("--kvreplay-device", default="cpu", metavar="DEVICE", help="cpu, cuda or auto")


class CorpusMismatch(Exception):
    """A corpus expectation that did not hold."""


class CorpusItem(pytest.Item):
    def __init__(self, *, case: Any, device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case
        self.device = device

    def runtest(self) -> None:
        from kvreplay.corpus_ci import run_case

        res = run_case(self.case, db="", device=self.device)
        if res.outcome == "skip":
            pytest.skip(res.problems[0] if res.problems else "not this build's pool family")
        if res.outcome != "pass":
            raise CorpusMismatch(f"expected {self.case.expected()}, replay status {res.status or 'none'}:\n"
                                 + "\n".join(res.problems))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CorpusMismatch):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"kvreplay corpus {self.case.name} on {self.case.build}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    corpus = config.getoption("kvreplay_corpus")
    if not corpus:
        return
    from kvreplay.corpus_ci import plan

    build = config.getoption("kvreplay_build")
    device = config.getoption("kvreplay_device")
    for case in plan(corpus, build):
        items.append(CorpusItem.from_parent(session, name=f"kvreplay::{case.name}", case=case, device=device))
