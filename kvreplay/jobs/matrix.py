"""One trace (or a corpus) on many builds: "which of our releases are affected?"

Each build is one unit of work: a worker process that imports the build's code once
and replays every trace on it (replay/worker.py), so a release's whole server is
imported once per matrix, not once per trace. Units run in parallel (``jobs`` at a
time); the driver stores every result, so the store sees one writer. A build that
names its code exactly (a release, a builtin of this kvreplay) is looked up in the
store first, and a matrix asked again replays only what it has not seen.

The table a release manager reads is build x invariant: in each cell the first call
that broke the invariant and the rule it broke, next to the run's status and the
call where the build's own capacity assertion fired, if it did."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvreplay.builds.releases import expand_all
from kvreplay.builds.spec import BuildSpec
from kvreplay.check.rules import INVARIANTS
from kvreplay.errors import EXIT_CLEAN, EXIT_FOUND, EXIT_UNLOADABLE, BadInput
from kvreplay.fanout import iter_threads, iter_units
from kvreplay.jobs.stored_replay import trace_info
from kvreplay.replay.dispatch import run_many
from kvreplay.replay.report import UNTESTABLE, ReplayReport, firsts_by_rule
from kvreplay.store.db import Store, check_store, open_store
from kvreplay.store.runs import TraceInfo, get_run, record_run, reusable_run, run_to_dict
from kvreplay.trace import location
from kvreplay.trace.hashing import content_hash
from kvreplay.trace.reader import TraceReader


@dataclass
class Cell:
    """One trace on one build, as stored."""

    trace: str
    build: str
    run_id: int
    status: str
    kernels: str
    calls_replayed: int
    firsts: dict[str, dict[str, Any]]  # invariant -> {"call", "rule", "method"} of its first violation
    rules: dict[str, int]  # invariant/rule -> first call
    divergences: dict[str, int]  # kind -> count
    capacity_assert_call: int | None
    message: str
    wall_s: float
    cached: bool

    @classmethod
    def of_run(cls, d: dict[str, Any], cached: bool) -> Cell:
        rules = {k: v["call"] for k, v in firsts_by_rule(d["violations"]).items()}
        firsts: dict[str, dict[str, Any]] = {}
        for v in d["violations"]:
            firsts.setdefault(v["invariant"], {"call": v["call"], "rule": v["rule"], "method": v["method"]})
        return cls(d["trace"], d["build"], d["run_id"], d["status"], d["kernels"], d["calls_replayed"], firsts,
                   rules, dict(d["divergence_counts"]), d["capacity_assert_call"], d["message"], d["wall_s"], cached)


@dataclass
class MatrixResult:
    traces: list[str]
    builds: list[str]
    cells: list[Cell] = field(default_factory=list)
    partitions: dict[str, dict[str, str]] = field(default_factory=dict)  # trace -> its hive keys, if any
    wall_s: float = 0.0

    def cell(self, trace: str, build: str) -> Cell | None:
        return next((c for c in self.cells if c.trace == trace and c.build == build), None)

    @property
    def invariants(self) -> list[str]:
        """The invariants broken anywhere, in the checker's order."""
        seen = {inv for c in self.cells for inv in c.firsts}
        return [i for i in INVARIANTS if i in seen]

    @property
    def exit_code(self) -> int:
        """1 when any build shows a violation or divergence, 0 when every tested
        build is clean, 125 when none could be tested."""
        if any(c.status in ("violation", "divergence") for c in self.cells):
            return EXIT_FOUND
        if self.cells and all(c.status in UNTESTABLE for c in self.cells):
            return EXIT_UNLOADABLE
        return EXIT_CLEAN

    def to_dict(self) -> dict[str, Any]:
        return {"traces": self.traces, "partitions": self.partitions, "builds": self.builds,
                "invariants": self.invariants,
                "cells": [asdict(c) for c in self.cells], "wall_s": round(self.wall_s, 3),
                "exit_code": self.exit_code}


def matrix_traces(paths: list[str | Path]) -> list[tuple[Path, dict[str, str], str]]:
    """Trace files from the command line, each with its hive partition keys: a file,
    a rotated trace directory, a corpus directory (one holding manifest.json: every
    Parquet trace in it), or any other directory of traces (host=.../rank=...
    partitions); paths or URIs (a remote one is mirrored locally first)."""
    found: list[tuple[Path, dict[str, str], str]] = []
    for given in paths:
        p = location.local_path(given)
        remote = location.is_remote(str(given))
        if p.is_dir() and (p / "manifest.json").is_file():
            found += [(f, {}, f"{str(given).rstrip('/')}/{f.name}" if remote else str(f))
                      for f in sorted(p.glob("*.parquet"))]
        elif p.is_dir() and not location.is_rotated_trace(p):
            found += [(location.local_path(t.location), t.partition, t.location)
                      for t in location.corpus_traces(given)]
        elif p.exists():
            found.append((p, {}, str(given) if remote else str(p)))
        else:
            raise BadInput(f"{given}: no such trace or corpus")
    if not found:
        raise BadInput("no traces to replay")
    return found


def run_matrix(traces: list[str | Path], builds: list[str], *, db: str | None = None, mode: str = "strict",
               device: str = "cpu", jobs: int = 2, timeout_s: float = 1800.0, use_cache: bool = True,
               ray: str | None = None, on_cell: Callable[[Cell], None] | None = None) -> MatrixResult:
    """Replay every trace on every build (ranges expanded), store each run, and
    return the table. Bad input (a trace, a spec, the store) fails before any replay."""
    specs = expand_all([b.strip() for b in builds if b.strip()])
    if not specs:
        raise BadInput("--builds names no build")
    parsed = {s: BuildSpec.parse(s) for s in specs}  # bad specs fail here, before any replay
    listed = matrix_traces(list(traces))
    paths = [p for p, _, _ in listed]
    infos = {}
    for p in paths:
        reader = TraceReader(p)
        infos[str(p.resolve())] = (trace_info(reader, reader.check_calls()), content_hash(p))
    check_store(db)
    result = MatrixResult([str(p.resolve()) for p in paths], specs,
                          partitions={str(p.resolve()): keys for p, keys, _ in listed if keys})
    t0 = time.perf_counter()
    st = open_store(db)
    try:
        filler = _Filler(st, result, parsed, infos, {str(p.resolve()): src for p, _, src in listed}, on_cell)
        todo = filler.from_store(specs, mode, use_cache)
        if ray is not None:
            filler.on_ray(todo, ray, mode, device, timeout_s)
            todo = {}
        filler.in_threads(todo, jobs, mode, device, timeout_s)
    finally:
        st.close()
    order = {(t, b): i for i, (t, b) in enumerate((t, b) for t in result.traces for b in specs)}
    result.cells.sort(key=lambda c: order[(c.trace, c.build)])
    result.wall_s = time.perf_counter() - t0
    return result


@dataclass
class _Filler:
    """Fills a matrix's cells, from runs the store has or from replays of the rest. Every
    replay is stored here, from this thread: the store sees one writer."""

    st: Store
    result: MatrixResult
    parsed: dict[str, BuildSpec]  # each build's spec, parsed
    infos: dict[str, tuple[TraceInfo, str]]  # trace -> (its record in the store, its content hash)
    # What a Ray node is handed for each trace: its URI when remote (the node fetches
    # it), else its path; and back (``given``) from that to the trace's key here.
    sources: dict[str, str]
    on_cell: Callable[[Cell], None] | None
    given: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.given = {src: key for key, src in self.sources.items()}

    def from_store(self, specs: list[str], mode: str, use_cache: bool) -> dict[str, list[str]]:
        """Fills the cells the store has a run for (with ``use_cache``); returns each
        build's traces it has none for, to replay."""
        todo: dict[str, list[str]] = {}
        for spec in specs:
            for trace, (_, digest) in self.infos.items():
                run = reusable_run(self.st, digest, self.parsed[spec], mode) if use_cache else None
                if run is not None:
                    cell = Cell.of_run(run_to_dict(get_run(self.st, run.id), details=True), cached=True)
                    cell.trace = trace
                    _add(self.result, cell, self.on_cell)
                else:
                    todo.setdefault(spec, []).append(trace)
        return todo

    def store(self, spec: str, trace: str, report: ReplayReport, code_id: str) -> None:
        trace = self.given.get(trace, str(Path(trace).resolve()))
        info, _ = self.infos[trace]
        report.build = spec
        run_id = record_run(self.st, report, info, build_version=self.parsed[spec].resolved(code_id=code_id))
        cell = Cell.of_run(run_to_dict(get_run(self.st, run_id), details=True), cached=False)
        cell.trace = trace
        _add(self.result, cell, self.on_cell)

    def on_ray(self, todo: dict[str, list[str]], ray: str, mode: str, device: str, timeout_s: float) -> None:
        # One Ray task per build (its worker imports the build once and replays its
        # traces); a task's reports come back together, and are stored here.
        units = [MatrixUnit(spec, [self.sources[t] for t in trs], mode, device, timeout_s)
                 for spec, trs in todo.items()]
        for got in iter_units(matrix_unit, units, ray=ray):
            for spec, trace, report, code_id in got:
                self.store(spec, trace, report, code_id)

    def in_threads(self, todo: dict[str, list[str]], jobs: int, mode: str, device: str, timeout_s: float) -> None:
        """Each build's traces replayed in its worker, ``jobs`` builds at a time; each report
        is stored as its worker answers, by this thread only."""

        def unit(item: tuple[str, list[str]], put: Callable[[Any], None]) -> None:
            spec, trs = item
            run_many(trs, self.parsed[spec], lambda r, code_id: put((spec, r.trace, r, code_id)),
                     mode=mode, device=device, timeout_s=timeout_s)

        for got in iter_threads(unit, list(todo.items()), jobs=jobs):
            self.store(*got)


@dataclass(frozen=True)
class MatrixUnit:
    """One build's share of a matrix, as a unit of work for a Ray task."""

    spec: str
    traces: list[str]  # as the node reads them: a URI for a remote trace, else a path
    mode: str
    device: str
    timeout_s: float


def matrix_unit(u: MatrixUnit) -> list[tuple[str, str, ReplayReport, str]]:
    """Replay a build's traces in its worker: (spec, trace, report, code id) for each."""
    out: list[tuple[str, str, ReplayReport, str]] = []
    run_many(u.traces, u.spec, lambda r, code_id: out.append((u.spec, r.trace, r, code_id)), mode=u.mode,
             device=u.device, timeout_s=u.timeout_s)
    return out


def _add(result: MatrixResult, cell: Cell, on_cell: Callable[[Cell], None] | None) -> None:
    result.cells.append(cell)
    if on_cell is not None:
        on_cell(cell)


__all__ = ["Cell", "MatrixResult", "matrix_traces", "run_matrix"]
