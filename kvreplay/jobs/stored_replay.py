"""A replay that becomes a stored run: ``replay_and_store``, what replay, bisect's
steps and the demo go through (ci's cases too, which replay here without
storing and are stored by ci's driver as they come back). Where the replay runs is
``replay.dispatch.run``'s answer.

Who writes a run: one function, ``store.runs.record_run``, called from here, from
matrix's driver and from ci's driver, each with what the build resolved to from
``BuildSpec.resolved``. Whether a stored run may stand in for a replay is
``store.runs.reusable_run``'s one rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvreplay.builds.spec import BuildSpec
from kvreplay.errors import BadInput
from kvreplay.replay.dispatch import run
from kvreplay.replay.report import ReplayReport
from kvreplay.trace.hashing import content_hash
from kvreplay.trace.location import is_remote
from kvreplay.trace.reader import TraceReader

if TYPE_CHECKING:  # the store (SQLAlchemy, Alembic) loads only for a run that is stored
    from kvreplay.store.runs import TraceInfo


def trace_info(reader: TraceReader, calls: int | None = None) -> TraceInfo:
    from kvreplay.store.runs import TraceInfo

    where = reader.source if is_remote(reader.source) else str(reader.path.resolve())
    return TraceInfo(path=where, content_hash=content_hash(reader.path),
                     pool_class=reader.meta.pool_class, family=reader.meta.family, meta=asdict(reader.meta),
                     rows=reader.num_rows, calls=calls)


@dataclass
class StoredReplay:
    report: ReplayReport
    run_id: int | None
    build_version: str = ""
    reader: TraceReader | None = None

    @cached_property
    def trace(self) -> TraceInfo | None:
        """What a caller storing the run itself (ci's driver) needs; made on demand,
        as it hashes the trace and loads the store's record types."""
        if self.reader is None:
            return None
        r = self.report
        return trace_info(self.reader, None if r.stopped_early or r.calls_replayed == 0 else r.calls_replayed)

    def __getstate__(self) -> dict[str, Any]:
        # Sent back from a worker (ci): the trace's record travels, the open reader does not.
        self.trace  # noqa: B018 - made here, where the reader is
        return {**self.__dict__, "reader": None}


def replay_and_store(trace: str | Path, build: str | BuildSpec, *, db: str | None = None, store: bool = True,
                     progress: Callable[[int, int], None] | None = None, jobs: int = 1, ray: str | None = None,
                     **options: Any) -> StoredReplay:
    """Replay and, unless ``store`` is False, write the run to the database.

    The trace and the database are checked first, so bad input fails before any work;
    the database is created or migrated, and the run written in one transaction, only
    once the replay has a result: bad input anywhere leaves nothing behind.

    ``jobs`` > 1 or ``ray`` (an address, "" for a local instance): the trace's segments
    (between its checkpoints) replay in parallel workers, or on Ray, and merge into
    the run a serial replay gives (replay/segments.py); the run is stored from here."""
    if jobs < 1:
        raise BadInput(f"--jobs must be at least 1, not {jobs}")
    spec = build if isinstance(build, BuildSpec) else BuildSpec.parse(build)  # parsed once, then handed down
    reader = TraceReader(trace)
    reader.check_calls()
    if store:
        from kvreplay.store.db import check_store, open_store
        from kvreplay.store.runs import record_run

        check_store(db)
    ran = run(trace, spec, jobs=jobs, ray=ray, progress=progress, reader=reader, checked=True, **options)
    replayed = StoredReplay(ran.report, None, ran.version, reader)
    if not store:
        return replayed
    st = open_store(db)
    try:
        replayed.run_id = record_run(st, ran.report, replayed.trace, build_version=ran.version)
        return replayed
    finally:
        st.close()
