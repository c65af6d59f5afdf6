"""pytest plugin: the corpus as test items, for teams that live in pytest.

    pytest --kvreplay-corpus traces/ --kvreplay-build builtin:swa

collects the corpus's ``manifest.json`` as a test file with one item per trace
and replay mode (node ids such as ``traces/manifest.json::decode-1000[strict]``),
holding each to the same expectations as ``kvreplay ci``: the manifest's for that
build, else a clean replay. Runs are not stored. Given only ``--kvreplay-corpus``,
pytest collects the corpus alone; name test paths as well to run both. Registered
through the ``pytest11`` entry point; without ``--kvreplay-corpus`` it adds nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MANIFEST = "manifest.json"  # the name corpus/manifest.py gives it; imported lazily there


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvreplay", "replay a kvreplay trace corpus")
    group.addoption("--kvreplay-corpus", default=None, metavar="DIR",
                    help="corpus directory (with manifest.json): one test item per trace and mode")
    group.addoption("--kvreplay-build", default="builtin:swa", metavar="BUILD",
                    help="build to replay the corpus on (default: builtin:swa)")
    group.addoption("--kvreplay-device", default="cpu", metavar="DEVICE", help="cpu, cuda or auto")


def _manifest(config: pytest.Config) -> Path | None:
    corpus = config.getoption("kvreplay_corpus", None)
    if not corpus:
        return None
    path = Path(corpus)
    return (path / MANIFEST if path.is_dir() else path).resolve()


def pytest_configure(config: pytest.Config) -> None:
    manifest = _manifest(config)
    if manifest is None:
        return
    if not manifest.is_file():
        raise pytest.UsageError(f"--kvreplay-corpus: {manifest} does not exist")
    # Paths named on the command line run too; otherwise (testpaths, the current
    # directory) only the corpus is collected.
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(str(manifest))
    else:
        config.args[:] = [str(manifest)]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    manifest = _manifest(parent.config)
    if manifest is not None and file_path.resolve() == manifest:
        return CorpusFile.from_parent(parent, path=file_path)
    return None


class CorpusFile(pytest.File):
    """The manifest: one item per (trace, expectation, mode) for the chosen build."""

    def collect(self) -> Iterator[pytest.Item]:
        from kvreplay.corpus.ci import plan

        build = self.config.getoption("kvreplay_build")
        device = self.config.getoption("kvreplay_device")
        for case in plan(self.path.parent, build):
            yield CorpusItem.from_parent(self, name=case.name, case=case, device=device)


class CorpusMismatch(Exception):
    """A corpus expectation that did not hold."""


class CorpusItem(pytest.Item):
    def __init__(self, *, case: Any, device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case
        self.device = device

    def runtest(self) -> None:
        from kvreplay.corpus.ci import CaseUnit, run_case

        res = run_case(CaseUnit(self.case, self.device, None)).result
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
