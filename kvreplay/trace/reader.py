"""Read a trace back one row group batch at a time, so a large file never has to
fit in memory; every problem with the file becomes a one-line TraceFormatError.

Opening a trace and scanning its columns needs no torch; decoding calls into
tensors (decode.py) imports it on first use, so commands that only look at a
trace (inspect, hashing, a git: build's parent process) start fast."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvreplay.contract.registry import all_methods, family
from kvreplay.errors import TraceFormatError
from kvreplay.limits import limit
from kvreplay.trace.bounds import COLUMNS as VALUE_COLUMNS
from kvreplay.trace.bounds import check_values
from kvreplay.trace.footer import row_group_counts
from kvreplay.trace.format import (
    ADDED_COLUMNS,
    BASE_TARGETS,
    CHECKPOINT_METHOD,
    COUNTER_READS,
    FOLD_MAX,
    GAP_METHOD,
    GAP_TARGET,
    GROUP_CLOSED,
    GROUP_FOLD_METHODS,
    GROUP_NESTED_MAX,
    GROUP_OPENED,
    MAX_FOLDED_READS,
    MAX_GROUP_IDS,
    MAX_GROUP_VALUES,
    MAX_STRING_BYTES,
    MAX_TRACE_FOLDED_READS,
    MAX_TRACE_PARTS,
    PART_GLOB,
    PART_NAME,
    SCHEMA,
    SCHEMA_VERSION,
    TENSOR_DTYPES,
    Call,
    TopCall,
    TraceMeta,
    folded_calls,
    part_name,
)
from kvreplay.trace.format import (
    targets as row_targets,
)
from kvreplay.trace.location import local_path

if TYPE_CHECKING:
    import torch


# A row is the pool's own call (depth 0) or one it made into a sub-allocator (depth 1):
# sub-allocators have none of their own, and a pool's calls on itself are not rows.
MAX_DEPTH = 1



def _regular_file(path: Path) -> None:
    """Only regular files are read: a FIFO or a device would block or never end."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise TraceFormatError(f"{path}: not a regular file")


# Rows decoded at a time for a replay: a 4,096-row batch of a production trace holds
# tens of MB of index tensors, so every batch landed in fresh memory the kernel had
# to fault in and zero; half that keeps the decoded batch warm in memory already
# used, and smaller batches start paying the per-batch set-up.
REPLAY_BATCH_ROWS = 2048

# A folded group's targets: at most GROUP_NESTED_MAX pool names (64 bytes at most, as a row's).
_TARGET_LIST_BYTES = GROUP_NESTED_MAX * 65
# The columns of names, and the most bytes a value of each holds: the footer says what
# reading them allocates, so a file whose few rows hold 200 MB of names is refused unread.
_NAME_BYTES = {"target": 64, "method": 64, "folded_group_targets": _TARGET_LIST_BYTES,
               "folded_group_bounds_targets": _TARGET_LIST_BYTES}


# The string columns: a recorded string is at most MAX_STRING_BYTES, and a row group of
# them (16,384 calls: request ids, a rare exception's message) holds a few MB.
_TEXT_COLUMNS = ("args.list.element.s", "result.s", "exc_type", "exc_msg")
MAX_GROUP_TEXT_BYTES = limit("KVREPLAY_MAX_GROUP_TEXT_BYTES", 64 << 20)


def _check_sizes(part: Path, f: pq.ParquetFile, meta: TraceMeta) -> None:
    """Refuse, from the footer alone, a row group that lists more values than any call of
    this pool could: none lists more slots than the pool has, and no group more than
    MAX_GROUP_VALUES (MAX_GROUP_IDS where the values are ids). Decoding such a group would
    allocate gigabytes from a small file."""
    fam = family(meta.family)
    slots = sum(fam.sizes_of(meta.ctor_args).values()) + int(meta.ctor_args.get("page_size", 1)) + 2
    most, env = (MAX_GROUP_VALUES, "KVREPLAY_MAX_GROUP_VALUES") if fam.slots else \
        (MAX_GROUP_IDS, "KVREPLAY_MAX_GROUP_IDS")
    try:
        groups = row_group_counts(part)
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"{part}: corrupt footer ({exc})") from None
    if len(groups) != f.metadata.num_row_groups:
        raise TraceFormatError(f"{part}: corrupt footer (it lists {len(groups)} row groups, pyarrow read "
                               f"{f.metadata.num_row_groups})")
    for g, rg in enumerate(groups):
        counts = rg.values
        values = sum(n for name, n in counts.items() if name.endswith(("data.list.element", "shape.list.element")))
        entries = counts.get("args.list.element.name", 0) + rg.num_rows
        bound = min(most, entries * slots)
        if values > bound:
            raise TraceFormatError(
                f"{part}: row group {g} lists {values:,} values for {rg.num_rows:,} calls, more than a pool of "
                f"{slots - 2:,} {fam.unit} can (at most {bound:,}; {env} raises the limit)")
        for name, per in _NAME_BYTES.items():
            # (a value's length prefix and levels, and the pages' headers, beside its bytes)
            if rg.sizes.get(name, 0) > counts.get(name, 0) * (per + 16) + (1 << 20):
                raise TraceFormatError(f"{part}: row group {g} holds {rg.sizes[name]:,} bytes of {name} for "
                                       f"{rg.num_rows:,} calls, more than names of pools can")
        for name in _TEXT_COLUMNS:  # request ids, exception messages: read whole before each is checked
            if rg.sizes.get(name, 0) > min(counts.get(name, 0) * (MAX_STRING_BYTES + 16) + (1 << 20),
                                           MAX_GROUP_TEXT_BYTES):
                raise TraceFormatError(f"{part}: row group {g} holds {rg.sizes[name]:,} bytes of {name} for "
                                       f"{rg.num_rows:,} calls, more than recorded strings can (at most "
                                       f"{MAX_GROUP_TEXT_BYTES:,}; KVREPLAY_MAX_GROUP_TEXT_BYTES raises the limit)")


def _check_strings(path: Path, target: pa.Array, method: pa.Array, *texts: pa.Array) -> None:
    """Refuse a name longer than any method or pool has, or a string value longer than any
    recorder writes, before anything copies them (a call per row would copy each)."""
    for col, most, what in ((target, 64, "a pool name"), (method, 64, "a method name")):
        longest = pc.max(pc.binary_length(col)).as_py() if len(col) else 0
        if longest and longest > most:
            raise TraceFormatError(f"{path}: {what} of {longest:,} bytes (no method or pool has a name that long)")
    for col in texts:
        longest = pc.max(pc.binary_length(col)).as_py() if len(col) and col.null_count < len(col) else 0
        if longest and longest > MAX_STRING_BYTES:
            raise TraceFormatError(f"{path}: a recorded string of {longest:,} bytes, more than {MAX_STRING_BYTES:,} "
                                   "(KVREPLAY_MAX_STRING_BYTES raises the limit)")


def _check_dtypes(path: Path, *columns: pa.Array) -> None:
    for col in columns:
        for name in pc.unique(col.drop_null()).to_pylist():
            if name and not all(part in TENSOR_DTYPES for part in name.split(",")):
                raise TraceFormatError(f"{path}: a value names element type {name[:40]!r}, not one of "
                                       f"{', '.join(TENSOR_DTYPES)}")


def _part_files(directory: Path) -> list[Path]:
    """A rotated trace's parts, counted before any is opened."""
    parts = []
    for p in directory.glob(PART_GLOB):
        if len(parts) >= MAX_TRACE_PARTS:
            raise TraceFormatError(f"{directory}: holds more than {MAX_TRACE_PARTS:,} parts "
                                   "(KVREPLAY_MAX_TRACE_PARTS raises the limit)")
        if not PART_NAME.match(p.name):
            raise TraceFormatError(f"{directory}: {p.name[:80]!r} is not a part's name (part-NNNNNN.parquet)")
        parts.append(p)
    if not parts:
        raise TraceFormatError(f"{directory}: is a directory without trace parts ({PART_GLOB}), not a trace")
    return sorted(parts, key=lambda p: int(PART_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def _check_sequence(directory: Path, parts: list[Path], metas: list[TraceMeta]) -> None:
    """The parts of a rotated trace are one recording's, each where its name says, none
    missing between the first and the last, and the first one replays without those
    before it. Anything else would replay calls that never followed each other: a part
    missing in the middle shows as frees of slots nobody allocated, false violations."""
    ids = set()
    prev = None
    for part, meta in zip(parts, metas, strict=True):
        index = int(PART_NAME.match(part.name).group(1))  # type: ignore[union-attr]
        info = meta.extra.get("part") if isinstance(meta.extra.get("part"), dict) else {}
        ids.add(info.get("recording") if isinstance(info.get("recording"), str) else None)
        if len(ids) > 1:
            raise TraceFormatError(f"{directory}: holds parts of more than one recording ({part.name} is of "
                                   "another); keep each recording's parts in a directory of its own")
        # a part recorded before parts named their place carries no part metadata at all:
        # its name is all there is (a recording id beside it still refuses the mix above)
        said = info.get("index", 0) if info else index
        if type(said) is not int or said != index:
            raise TraceFormatError(f"{part}: says it is part {str(said)[:20]} of its recording, not {index}")
        if prev is None:
            fresh = index == 0
            if not fresh and meta.initial_state is None and info.get("standalone") is not True:
                raise TraceFormatError(f"{directory}: starts at {part.name}, which needs the parts before it "
                                       "(its pool has no snapshot there), and they are not here")
        elif index != prev + 1:
            missing = part_name(prev + 1) + ("" if index == prev + 2 else f" to {part_name(index - 1)}")
            raise TraceFormatError(f"{directory}: {missing} of the recording is missing (between "
                                   f"{part_name(prev)} and {part.name}): the calls in it are unknown; replay the "
                                   f"parts before it, or those from {part.name} on, as a trace of their own")
        prev = index


class TraceReader:
    """An open trace: its footer checked against the trace contract when opened
    (schema, metadata, and across the parts of a rotated trace); ``check_calls``
    scans what the rows name before anything replays them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # A URI (s3://...) is read from its local mirror; ``source`` keeps what was asked for.
        self.source = str(path)
        self.path = local_path(path)
        self._layout: tuple[list[Checkpoint], int, bool] | None = None  # checkpoints, calls, gaps? (one scan)
        self._entries: int | None = None
        if not self.path.exists():
            raise TraceFormatError(f"{self.path}: no such file")
        if self.path.is_dir():
            self.parts = _part_files(self.path)
        else:
            self.parts = [self.path]
        for part in self.parts:
            _regular_file(part)
        self._files = [self._open(p) for p in self.parts]
        metas = [self._meta(part, f) for part, f in zip(self.parts, self._files, strict=True)]
        self.meta = metas[0]
        # Per part, the columns its schema version predates: read as null (no folds).
        self._absent: list[list[str]] = []
        for part, f, meta in zip(self.parts, self._files, metas, strict=True):
            if meta.schema_version > SCHEMA_VERSION:
                raise TraceFormatError(
                    f"{part}: trace schema version {meta.schema_version} is newer than this "
                    f"kvreplay reads (up to {SCHEMA_VERSION}); upgrade kvreplay")
            self._absent.append([c for c, since in ADDED_COLUMNS.items() if meta.schema_version < since])
            if (meta.family, meta.pool_class, meta.ctor_args) != (self.meta.family, self.meta.pool_class,
                                                                  self.meta.ctor_args):
                raise TraceFormatError(f"{part}: a part of another pool ({meta.pool_class}, {meta.family}) than "
                                       f"the trace's first part ({self.meta.pool_class}, {self.meta.family})")
            _check_schema(part, f.schema_arrow, self._absent[-1])
            _check_sizes(part, f, self.meta)
        if self.path.is_dir():
            _check_sequence(self.path, self.parts, metas)

    def _meta(self, part: Path, f: pq.ParquetFile) -> TraceMeta:
        try:
            return TraceMeta.from_parquet_metadata(f.schema_arrow.metadata or {})
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
            detail = f" ({exc})" if isinstance(exc, (ValueError, TypeError)) else " (no kvreplay metadata)"
            raise TraceFormatError(f"{part}: a Parquet file but not a readable kvreplay trace{detail}") from None

    def _open(self, part: Path) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(str(part), page_checksum_verification=True)
        except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as exc:
            raise TraceFormatError(f"{part}: not a readable Parquet file ({_first_line(exc)})") from None

    def check_calls(self) -> int:
        """Scan what the rows name, before any of them is replayed: known methods and
        targets, sane nesting, row numbers that only grow, and at least one call.
        Returns the number of calls (top-level, not gaps)."""
        calls = folds = 0
        last_seq = -1
        first = True
        # the methods of this trace's family: another family's rows are damage, not calls a build lacks
        fam = family(self.meta.family)
        names = frozenset(fam.methods) | {GAP_METHOD, CHECKPOINT_METHOD}
        # ...and the pools it has: another family's sub-allocator in a row, or in a folded
        # group's nested calls, is damage too (a build would be handed calls it has no pool for)
        subs = frozenset(t for t, _ in fam.sub_allocators)
        # (the columns a version 1 trace lacks come last: the reader adds them there)
        for batch in self.iter_batches(columns=["seq", "depth", "target", "method", "args.list.element.dtype",
                                                "result.dtype", "args.list.element.s", "result.s", "exc_type",
                                                "exc_msg", "folded_reads", "folded_pattern", "folded_group_at",
                                                "folded_group_targets", "folded_group_bounds",
                                                "folded_group_bounds_targets"]):
            # (an argument's and the result's fields come as one struct column each)
            if batch.num_columns != 14:  # damaged bytes can leave a batch without some of them
                raise TraceFormatError(f"{self.path}: corrupt trace data (the call columns cannot be read)")
            (seq, depth, target, method, args, result, exc_type, exc_msg, folded, pattern, group_at, group_targets,
             bounds, bounds_targets) = batch.columns
            arg_fields = args.flatten()
            if arg_fields.type.num_fields != 2 or result.type.num_fields != 2:
                raise TraceFormatError(f"{self.path}: corrupt trace data (the call columns cannot be read)")
            arg_dtypes, result_dtypes = arg_fields.field("dtype"), result.field("dtype")
            _check_strings(self.path, target, method, arg_dtypes, result_dtypes, arg_fields.field("s"),
                           result.field("s"), exc_type, exc_msg)
            folds += _check_folds(self.path, folded, pattern, depth)
            _check_target_lists(self.path, group_targets, bounds_targets)
            folds += _check_groups(self.path, folded, group_at, group_targets, depth, names, subs)
            folds += _check_bounds(self.path, bounds, bounds_targets, depth, method, names, subs)
            if folds > MAX_TRACE_FOLDED_READS:
                raise TraceFormatError(f"{self.path}: the rows fold more than {MAX_TRACE_FOLDED_READS:,} calls "
                                       "in all (KVREPLAY_MAX_TRACE_FOLDED_READS raises the limit)")
            _check_dtypes(self.path, arg_dtypes, result_dtypes)
            recorded = pc.filter(depth, pc.not_equal(target, GAP_TARGET))
            if first and len(recorded):
                first = False
                if recorded[0].as_py() != 0:
                    raise TraceFormatError(f"{self.path}: the first row is a nested call, with no call it was made in")
            # gap rows carry the lost calls' numbers (or -1): only recorded rows must grow
            rows = pc.filter(seq, pc.not_equal(target, GAP_TARGET))
            if len(rows) and (pc.min(rows).as_py() <= last_seq or not _increasing(rows)):
                raise TraceFormatError(f"{self.path}: row numbers (seq) must start at 0 or more and only grow")
            last_seq = pc.max(rows).as_py() if len(rows) else last_seq
            if len(depth) and (pc.min(depth).as_py() < 0 or pc.max(depth).as_py() > MAX_DEPTH):
                raise TraceFormatError(f"{self.path}: call depth outside 0..{MAX_DEPTH}")
            unknown = set(pc.unique(method).to_pylist()) - names
            if unknown:
                name = sorted(unknown)[0]
                whose = f"a method of another engine's pools, not of a {self.meta.family} pool" \
                    if name in all_methods() else "not a method of the allocator API"
                raise TraceFormatError(f"{self.path}: rows name {name[:64]!r}, {whose}")
            odd = set(pc.unique(target).to_pylist()) - BASE_TARGETS - subs
            if odd:
                name = sorted(odd)[0]
                whose = f"a pool of another family, not of a {self.meta.family} pool" if name in row_targets() \
                    else "not a pool"
                raise TraceFormatError(f"{self.path}: rows target {name[:64]!r}, {whose} (one of "
                                       f"{', '.join(sorted(BASE_TARGETS | subs))})")
            top = pc.equal(depth, 0)
            calls += int(pc.sum(pc.and_(top, pc.not_equal(target, GAP_TARGET))).as_py() or 0)
        if calls == 0:
            raise TraceFormatError(f"{self.path}: the trace holds no call to replay")
        if fam.value_bounds is not None:  # before a row is decoded: requests, slots, counts in range
            check_values(self.path, self.iter_batches(columns=VALUE_COLUMNS), fam.value_bounds(self.meta.ctor_args))
        return calls + folds

    @property
    def num_rows(self) -> int:
        return sum(f.metadata.num_rows for f in self._files)

    @property
    def num_entries(self) -> int:
        """Rows plus the calls folded into them: what a replay walks through, and a bound
        on its call numbers. A scan of two small columns, once."""
        if self._entries is None:
            self._entries = self.num_rows + sum(int(folded_per_row(*b.columns).sum())
                                                for b in self.iter_batches(columns=list(FOLD_COLUMNS)))
        return self._entries

    @property
    def file_size(self) -> int:
        return sum(p.stat().st_size for p in self.parts)

    def iter_batches(self, columns: list[str] | None = None, batch_size: int = 8192) -> Iterator[pa.RecordBatch]:
        try:
            for f, absent in zip(self._files, self._absent, strict=True):
                for batch in f.iter_batches(batch_size=batch_size, columns=_present(columns, absent)):
                    yield _upgraded(_valid(batch), columns, absent)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None

    def row_range(self, start: int, end: int, batch_size: int = 4096,
                  columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """Rows start..end-1 of the whole trace (across parts), reading only the row
        groups that hold them."""
        offset = 0
        try:
            for f, absent in zip(self._files, self._absent, strict=True):
                for g in range(f.metadata.num_row_groups):
                    n = f.metadata.row_group(g).num_rows
                    lo, hi = max(start - offset, 0), min(end - offset, n)
                    if lo < hi:
                        at = 0
                        for batch in f.iter_batches(batch_size=batch_size, row_groups=[g],
                                                    columns=_present(columns, absent)):
                            b_lo, b_hi = max(lo - at, 0), min(hi - at, batch.num_rows)
                            if b_lo < b_hi:
                                yield _upgraded(_valid(batch), columns, absent).slice(b_lo, b_hi - b_lo)
                            at += batch.num_rows
                    offset += n
                    if offset >= end:
                        return
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceFormatError(f"{self.path}: corrupt trace data ({_first_line(exc)})") from None

    def fold_methods(self, count: int, packed: int | None) -> dict[str, int]:
        """How many reads of each counter a fold of ``count`` reads with this pattern holds."""
        pattern = _fold_pattern(self.path, count, packed)
        per, extra = divmod(count, len(pattern))
        reads = family(self.meta.family).counter_reads
        return {reads[s]: per + (k < extra) for k, s in enumerate(pattern)}

    def count_calls(self) -> int:
        """Top-level calls (reports number them 1..N), folded counter reads among them,
        by a scan of three columns."""
        if self._layout is not None:
            return self._layout[1]
        n = 0
        for batch in self.iter_batches(columns=["depth", "target", *FOLD_COLUMNS]):
            top = pc.equal(batch.column(0), 0)
            n += int(pc.sum(pc.and_(top, pc.not_equal(batch.column(1), GAP_TARGET))).as_py() or 0)
            n += int(folded_per_row(*batch.columns[2:]).sum())
        return n

    def gaps(self) -> list[Call]:
        """The gap rows (where the recorder lost calls), in order; a cheap column scan
        first, since almost every trace has none."""
        found = self._layout[2] if self._layout is not None else False
        for batch in self.iter_batches(columns=["target", "method"]) if self._layout is None else ():
            if pc.any(pc.and_(pc.equal(batch.column(0), GAP_TARGET), pc.equal(batch.column(1), GAP_METHOD))).as_py():
                found = True
                break
        if not found:
            return []
        gaps = [c for c in self.calls(top_level_only=True) if c.target == GAP_TARGET and c.method == GAP_METHOD]
        for g in gaps:  # what every reader of a gap relies on, checked once here
            lost, state, reason = g.args.get("lost_calls", 0), g.args.get("state"), g.args.get("reason", "")
            if type(lost) is not int or not (state is None or isinstance(state, str)) or not isinstance(reason, str):
                raise TraceFormatError(f"{self.path}: a gap row at row {g.seq} is damaged (lost_calls must be a "
                                       "number, state a snapshot, reason text)")
        return gaps

    def checkpoints(self) -> list[Checkpoint]:
        """The trace's checkpoint rows, in order: where each is (row) and after how many
        top-level calls, both from a scan of three small columns. Their states are read
        only by the replay that starts there."""
        if self._layout is not None:
            return self._layout[0]
        out, offset, calls, gaps = [], 0, 0, False
        for batch in self.iter_batches(columns=["method", "target", "depth", *FOLD_COLUMNS]):
            method, target, depth = (batch.column(i) for i in range(3))
            gap = pc.equal(target, GAP_TARGET)
            hit = pc.and_(pc.equal(method, CHECKPOINT_METHOD), gap).to_numpy(zero_copy_only=False)
            gaps = gaps or bool(pc.any(pc.and_(pc.equal(method, GAP_METHOD), gap)).as_py())
            call = pc.and_(pc.equal(depth, 0), pc.invert(gap)).to_numpy(zero_copy_only=False).astype(np.int64)
            call += folded_per_row(*batch.columns[3:])  # folded reads and groups are calls too
            before = calls + np.cumsum(call) - call  # calls before each row
            out.extend(Checkpoint(offset + int(i), int(before[i])) for i in np.flatnonzero(hit))
            offset += batch.num_rows
            calls += int(call.sum())
        self._layout = (out, calls, gaps)  # one scan answers count_calls and "any gaps?" too
        return out

    def top_calls(self, device: str | torch.device = "cpu", *, rows: tuple[int, int] | None = None,
                  number_from: int = 0, nested_args: bool = True) -> Iterator[TopCall]:
        """Top-level calls with the sub-allocator calls each made, numbered 1..N in
        trace order (gap and checkpoint rows are passed on unnumbered). ``rows``: only
        rows start..end-1 (a segment from a checkpoint), numbered from ``number_from``+1.
        ``nested_args=False``: sub-allocator calls without their arguments (a replay's
        need; decoding them is a third of the work)."""
        return grouped(self._decoded(False, device, REPLAY_BATCH_ROWS, rows, nested_args), number_from)

    def calls(self, *, top_level_only: bool = False, device: str | torch.device = "cpu",
              batch_size: int = 4096, rows: tuple[int, int] | None = None) -> Iterator[Call]:
        """Decoded calls in recorded order (nested rows follow their parent)."""
        return self._decoded(top_level_only, device, batch_size, rows)

    def _decoded(self, top_level_only: bool, device: str | torch.device, batch_size: int,
                 rows: tuple[int, int] | None = None, nested_args: bool = True) -> Iterator[Call]:
        batches = self.iter_batches(batch_size=batch_size) if rows is None else self.row_range(*rows, batch_size)
        return decoded(batches, self.path, top_level_only, device, nested_args,
                       family(self.meta.family).counter_reads)


def decoded(batches: Iterable[pa.RecordBatch], path: Path, top_level_only: bool = False,
            device: str | torch.device = "cpu", nested_args: bool = True,
            reads: tuple[str, ...] = COUNTER_READS) -> Iterator[Call]:
    """Decoded calls of trace rows in order (nested rows follow their parent), the
    counter reads folded into rows handed back as calls; any trouble with the data is a
    TraceFormatError naming ``path``."""
    from kvreplay.trace.decode import decode_batch

    folds = _Unfolder(path, reads)
    for batch in batches:
        try:
            # Nested rows are decoded (without arguments) even when not wanted: the
            # reads folded after a call take their numbers after its nested rows'.
            for c in decode_batch(batch, False, device, nested_args and not top_level_only):
                if not c.depth:
                    yield from _unfolded(folds, top_level_only)
                    if c.folded_group_bounds:
                        yield from (b for b in folds.opening(c) if not (top_level_only and b.depth))
                    folds.after(c)
                else:
                    folds.nested(c)
                    if top_level_only:
                        continue
                yield c
        except Exception as exc:  # whatever damaged data makes decoding raise, it is the data's fault
            if isinstance(exc, TraceFormatError):
                raise
            raise TraceFormatError(f"{path}: corrupt trace data ({_first_line(exc)})") from None
    yield from _unfolded(folds, top_level_only)


def _unfolded(folds: _Unfolder, top_level_only: bool) -> Iterator[Call]:
    return (c for c in folds.pending() if not (top_level_only and c.depth))


def calls_in(table: pa.Table) -> tuple[int, int]:
    """(calls, latest end in ns) of a table of trace rows: its top-level rows that are
    not gaps or checkpoints, and the counter reads folded into them."""
    top = pc.and_(pc.equal(table.column("depth"), 0), pc.not_equal(table.column("target"), GAP_TARGET))
    folded = folded_per_row(*(table.column(c) for c in FOLD_COLUMNS))
    n = int(pc.sum(top).as_py() or 0) + int(folded.sum())
    return n, int(pc.max(table.column("t_end_ns")).as_py() or 0)


def grouped(calls: Iterable[Call], number_from: int = 0) -> Iterator[TopCall]:
    """Top-level calls with their nested ones, numbered from ``number_from`` + 1 (gap
    and checkpoint rows unnumbered)."""
    current: TopCall | None = None
    number = number_from
    for c in calls:
        if c.depth:
            if current is not None:
                current.nested.append(c)
            continue
        if current is not None:
            yield current
        if c.target != GAP_TARGET:
            number += 1
            current = TopCall(c, number, [])
        else:
            current = TopCall(c, 0, [])
    if current is not None:
        yield current


class _Unfolder:
    """Hands back the counter reads a recorder folded into rows (format.py) as the calls
    they were: after a row's nested rows, numbered on from them, each returning what
    the counter was last known to be. What is known follows the recorder's rule: a
    clean read row tells its counter, any other call sets all three to the counters
    read after it (unknown where none were read)."""

    def __init__(self, path: Path, reads: tuple[str, ...]) -> None:
        self.path = path
        self.reads = reads  # the family's counter reads, one per counter column
        self.cur: list[int | None] = [None, None, None]
        self.anchor: Call | None = None
        self.end_counters: dict[str, int | None] = {}  # what the anchor's folded group end read
        self.last_seq = -1

    def opening(self, c: Call) -> Iterator[Call]:
        """The begin of a free group folded into ``c`` (its first call), handed back
        before it; where ``c`` also folds the group's end, the counters its row holds
        are that end's, and ``c`` itself (inside the group) read none."""
        if c.folded_group_bounds & GROUP_CLOSED:
            self.end_counters, c.counters = c.counters, dict(_NO_COUNTERS)
        if c.folded_group_bounds & GROUP_OPENED:
            yield from _bound_calls(c, GROUP_FOLD_METHODS[0], self.last_seq)
            self.last_seq += 1 + _count_targets(c.folded_group_bounds_targets)

    def after(self, c: Call) -> None:
        self.last_seq = c.seq
        if c.target == GAP_TARGET:
            self.cur, self.anchor = [None, None, None], None
            return
        closed = bool(c.folded_group_bounds and c.folded_group_bounds & GROUP_CLOSED)
        slot = self.reads.index(c.method) if c.method in self.reads else -1
        if closed:
            self.cur = [self.end_counters.get(k) for k in ("available", "full_available", "swa_available")]
        elif slot >= 0 and c.exc_type is None and type(c.result) is int:
            self.cur[slot] = c.result
        else:
            self.cur = [c.counters.get(k) for k in ("available", "full_available", "swa_available")]
        self.anchor = c if c.folded_reads or c.folded_group_at is not None or closed else None

    def nested(self, c: Call) -> None:
        self.last_seq = max(self.last_seq, c.seq)

    def pending(self) -> Iterator[Call]:
        a = self.anchor
        if a is None:
            return
        self.anchor = None
        pattern = _fold_pattern(self.path, a.folded_reads, a.folded_pattern) if a.folded_reads else [0]
        seq = self.last_seq
        if a.folded_group_bounds and a.folded_group_bounds & GROUP_CLOSED:  # the group's end came first
            for c in _bound_calls(a, GROUP_FOLD_METHODS[1], seq, self.end_counters):
                yield c
                seq = c.seq
        for i in range(a.folded_reads + 1):
            if i == a.folded_group_at:
                for c in _group_calls(a, seq):
                    yield c
                    seq = c.seq
            if i == a.folded_reads:
                break
            slot = pattern[i % len(pattern)]
            value = self.cur[slot]
            if value is None:
                raise TraceFormatError(f"{self.path}: row {a.seq} folds reads of {self.reads[slot]} whose value "
                                       "the trace never gave")
            seq += 1
            yield Call(seq, -1, 0, "root", self.reads[slot], {}, value, None, None,
                       {"available": None, "full_available": None, "swa_available": None}, a.t_end_ns, a.t_end_ns,
                       from_fold=True)
        self.last_seq = seq


def _group_calls(a: Call, seq: int) -> Iterator[Call]:
    """The calls of an empty free group folded after ``a``: begin, its nested begins,
    end, its nested ends, numbered on from ``seq``."""
    for method in GROUP_FOLD_METHODS:
        calls = list(_folded_call(method, seq, a.folded_group_targets, (a.t_end_ns, a.t_end_ns), a.t_end_ns))
        yield from calls
        seq = calls[-1].seq


# The columns that say how many calls a row folds, in folded_per_row's order.
FOLD_COLUMNS = ("folded_reads", "folded_group_at", "folded_group_bounds")


_NO_COUNTERS = {"available": None, "full_available": None, "swa_available": None}


def _count_targets(targets: str | None) -> int:
    return len(targets.split(",")) if targets else 0


def _bound_calls(a: Call, method: str, seq: int, counters: dict[str, int | None] | None = None) -> Iterator[Call]:
    """A free group's begin or end folded into ``a``'s row, with its nested calls,
    numbered on from ``seq``; ``counters``: what the top-level one read after it."""
    top_end = a.t_start_ns if method == GROUP_FOLD_METHODS[0] else a.t_end_ns
    return _folded_call(method, seq, a.folded_group_bounds_targets, (a.t_start_ns, top_end), a.t_end_ns, counters)


def _folded_call(method: str, seq: int, targets: str | None, top_times: tuple[int, int], nested_end: int,
                 counters: dict[str, int | None] | None = None) -> Iterator[Call]:
    """A folded group begin or end as the calls it was: the top-level one, numbered
    ``seq`` + 1, then its nested calls on ``targets`` (comma-separated), each none of
    them returning anything; ``counters``: what was read after the top-level one."""
    top = seq + 1
    t0, t1 = top_times
    yield Call(top, -1, 0, "root", method, {}, None, None, None, dict(counters or _NO_COUNTERS), t0, t1,
               from_fold=True)
    for k, t in enumerate(targets.split(",") if targets else []):
        yield Call(top + 1 + k, top, 1, t, method, {}, None, None, None, dict(_NO_COUNTERS), t0, nested_end,
                   from_fold=True)


def folded_per_row(reads: pa.Array | pa.ChunkedArray, group_at: pa.Array | pa.ChunkedArray,
                   bounds: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Top-level calls folded into each row (reads, two per empty free group, one per
    folded bound of a group), from its FOLD_COLUMNS."""
    return folded_calls(reads.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64),
                        group_at.fill_null(-1).to_numpy(zero_copy_only=False),
                        bounds.fill_null(0).to_numpy(zero_copy_only=False))


def _check_groups(path: Path, folded: pa.Array, group_at: pa.Array, targets: pa.Array, depth: pa.Array,
                  names: frozenset[str], subs: frozenset[str]) -> int:
    """Top-level calls the rows' folded free groups hold (2 each), once each is sane: on
    top-level rows of a family that has free groups, after at most the row's folded reads,
    nested calls to known sub-allocators only."""
    if group_at.null_count == len(group_at):
        return 0
    at = group_at.fill_null(-1).to_numpy(zero_copy_only=False)
    some = np.flatnonzero(at >= 0)
    if (at < -1).any() or (at < 0).sum() != group_at.null_count:
        raise TraceFormatError(f"{path}: a row's folded free group comes after a negative number of reads")
    if not len(some):
        return 0
    if not set(GROUP_FOLD_METHODS) <= names:
        raise TraceFormatError(f"{path}: rows fold free groups, which a pool of this family does not have")
    if (depth.to_numpy(zero_copy_only=False)[some] != 0).any():
        raise TraceFormatError(f"{path}: a nested row folds a free group (only top-level calls can)")
    n = folded.fill_null(0).to_numpy(zero_copy_only=False)
    if (at[some] > n[some]).any():
        raise TraceFormatError(f"{path}: a row's folded free group comes after more reads than the row folds")
    _check_group_targets(path, pc.take(targets, pa.array(some)), subs)
    return 2 * len(some)


def _check_bounds(path: Path, bounds: pa.Array, targets: pa.Array, depth: pa.Array, method: pa.Array,
                  names: frozenset[str], subs: frozenset[str]) -> int:
    """Top-level calls the rows' folded group bounds hold (one per bound), once each is
    sane: on top-level rows of a family that has free groups, calls other than a group's
    begin or end, nested calls to known sub-allocators only."""
    if bounds.null_count == len(bounds):
        return 0
    b = bounds.fill_null(0).to_numpy(zero_copy_only=False)
    some = np.flatnonzero(b != 0)
    if ((b < 0) | (b > GROUP_OPENED + GROUP_CLOSED)).any() or len(some) != len(b) - bounds.null_count:
        raise TraceFormatError(f"{path}: a row's folded group bounds are not 1 (begin), 2 (end) or 3 (both)")
    if not set(GROUP_FOLD_METHODS) <= names:
        raise TraceFormatError(f"{path}: rows fold free groups, which a pool of this family does not have")
    if (depth.to_numpy(zero_copy_only=False)[some] != 0).any():
        raise TraceFormatError(f"{path}: a nested row folds a free group's bounds (only top-level calls can)")
    if set(pc.take(method, pa.array(some)).to_pylist()) & set(GROUP_FOLD_METHODS):
        raise TraceFormatError(f"{path}: a free group's begin or end folds another group's bounds")
    _check_group_targets(path, pc.take(targets, pa.array(some)), subs)
    return int(((b & GROUP_OPENED) + ((b & GROUP_CLOSED) >> 1)).sum())




def _check_target_lists(path: Path, *columns: pa.Array) -> None:
    """Refuse a folded group's target list longer than any names before it is copied or
    split: a 19 KB file can hold one of 200 MB (40 million names)."""
    for col in columns:
        longest = pc.max(pc.binary_length(col)).as_py() if len(col) and col.null_count < len(col) else 0
        if longest and longest > _TARGET_LIST_BYTES:
            raise TraceFormatError(f"{path}: a row's folded free group names sub-allocators in {longest:,} bytes "
                                   f"(at most {GROUP_NESTED_MAX} names of a pool)")


def _check_group_targets(path: Path, targets: pa.Array, subs: frozenset[str]) -> None:
    """A folded group's nested calls go to the trace's own family's sub-allocators only."""
    for t in set(targets.to_pylist()):
        parts = t.split(",") if t else []
        if t is None or len(parts) > GROUP_NESTED_MAX or not set(parts) <= subs:
            which = f"up to {GROUP_NESTED_MAX} of {', '.join(sorted(subs))}" if subs else "none (the pool has none)"
            raise TraceFormatError(f"{path}: a row's folded free group names sub-allocators {str(t)[:80]!r}, not "
                                   f"{which}")


def _fold_pattern(path: Path, count: int, packed: int | None) -> list[int]:
    """The counter slots a fold reads, in order, from its packed pattern; damaged ones refused."""
    if not 0 < count <= MAX_FOLDED_READS:
        raise TraceFormatError(f"{path}: a row folds {count:,} counter reads, outside 1..{MAX_FOLDED_READS:,} "
                               "(KVREPLAY_MAX_FOLDED_READS raises the limit)")
    out: list[int] = []
    p = packed or 0
    while p and len(out) <= FOLD_MAX:
        digit = p % 4
        if digit == 0 or digit - 1 in out:
            break
        out.append(digit - 1)
        p //= 4
    if not out or p or len(out) > FOLD_MAX:
        raise TraceFormatError(f"{path}: a row's folded-read pattern {packed!r} names no counters in order")
    return out


def _check_folds(path: Path, folded: pa.Array, pattern: pa.Array, depth: pa.Array) -> int:
    """Counter reads folded into these rows, once each fold is known to be sane: on
    top-level rows only, counts in range, patterns that decode."""
    if not len(folded) or not folded.null_count < len(folded):
        return 0
    n = folded.fill_null(0).to_numpy(zero_copy_only=False)
    some = np.flatnonzero(n != 0)
    if not len(some):
        return 0
    d = depth.to_numpy(zero_copy_only=False)
    if (d[some] != 0).any():
        raise TraceFormatError(f"{path}: a nested row folds counter reads (only top-level calls can)")
    pats = pattern.to_numpy(zero_copy_only=False)
    for i in some:  # one per fold, not per read: a few thousand an hour of a live server
        _fold_pattern(path, int(n[i]), None if pattern[int(i)].as_py() is None else int(pats[i]))
    return int(n.sum())


@dataclass(frozen=True)
class Checkpoint:
    row: int  # the checkpoint row's place among the trace's rows
    calls: int  # top-level calls before it: the first call after it is number calls + 1


def _valid(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The batch, once its strings are known to be UTF-8 and its offsets in bounds.
    Parquet readers hand back string bytes unchecked; damaged ones would otherwise
    fail wherever a row is first turned into Python, far from the trace's name."""
    batch.validate(full=True)  # ArrowInvalid: the caller's corrupt-data error
    return batch


def _increasing(seq: pa.Array) -> bool:
    if len(seq) < 2:
        return True
    values = seq.to_numpy(zero_copy_only=False)
    return bool((values[1:] > values[:-1]).all())


def _present(columns: list[str] | None, absent: list[str]) -> list[str] | None:
    """The columns to ask a part for: those it has (its schema version may predate some)."""
    if not absent:
        return columns
    return [c for c in (SCHEMA.names if columns is None else columns) if c not in absent]


def _upgraded(batch: pa.RecordBatch, columns: list[str] | None, absent: list[str]) -> pa.RecordBatch:
    """A batch of an older part as the current schema has it: the columns added since
    its version, where asked for, as nulls (a version 1 trace folds no reads)."""
    if not absent:
        return batch
    want = SCHEMA.names if columns is None else columns
    added = [name for name in want if name in absent]
    # The added columns are the schema's last, and callers ask for them last, so they
    # go at the end (a nested path like args.list.element.dtype is one column of the batch).
    assert want[len(want) - len(added):] == added, "ask for the columns added since version 1 last"
    arrays = [*batch.columns, *(pa.nulls(batch.num_rows, SCHEMA.field(n).type) for n in added)]
    fields = [*batch.schema, *(SCHEMA.field(n) for n in added)]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=batch.schema.metadata))


def _check_schema(part: Path, schema: pa.Schema, absent: list[str]) -> None:
    """Every column of the trace contract (less those its version predates), with exactly its type."""
    for want in SCHEMA:
        if want.name in absent:
            continue
        if want.name not in schema.names:
            raise TraceFormatError(f"{part}: trace lacks column {want.name}")
        got = schema.field(want.name).type
        if got != want.type:
            raise TraceFormatError(f"{part}: column {want.name} is {got}, not {want.type}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
