"""What ``kvreplay inspect`` reports about a trace, computed column-wise in one
streaming pass (only the columns it needs are read)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvreplay.contract.registry import family
from kvreplay.trace.format import CHECKPOINT_METHOD, GAP_METHOD, GAP_TARGET, GROUP_FOLD_METHODS
from kvreplay.trace.location import CorpusTrace, corpus_traces, is_rotated_trace, local_path
from kvreplay.trace.reader import TraceReader

_COLUMNS = ["depth", "target", "method", "t_start_ns", "t_end_ns", "exc_type", "result", "args",
            "available", "full_available", "swa_available", "folded_reads", "folded_pattern", "folded_group_at",
            "folded_group_bounds"]


@dataclass
class TraceSummary:
    path: str
    meta: dict[str, Any]
    rows: int
    calls: int  # top-level calls, numbered 1..N in every report (gap rows not counted)
    nested_rows: int  # sub-allocator calls made inside them
    calls_per_method: dict[str, int]
    exceptions: int
    none_results: int
    time_span_s: float
    peak_used: dict[str, int]
    file_bytes: int
    recorded_indices: int
    bytes_per_index: float | None
    notes: list[str] = field(default_factory=list)
    folded_reads: int = 0  # counter reads among the calls that have no row of their own (schema version 2)
    folded_groups: int = 0  # empty free groups among them, two calls each (schema version 3)
    folded_bounds: int = 0  # begins and ends of free groups folded into the groups' calls (schema version 4)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _extremes(batch: pa.RecordBatch, counter_col: dict[str, str], held: frozenset[str], min_avail: dict[str, int],
              max_held: dict[str, int]) -> None:
    """Fold a batch into each sub-pool's least free count, or, for a counter that counts
    what it holds, its largest count."""
    for sub, col in counter_col.items():
        if sub in held:
            m = pc.max(batch[col]).as_py()
            if m is not None:
                max_held[sub] = max(max_held.get(sub, m), m)
            continue
        m = pc.min(batch[col]).as_py()
        if m is not None:
            min_avail[sub] = min(min_avail.get(sub, m), m)


def summarize(path: str | os.PathLike[str]) -> TraceSummary:
    reader = TraceReader(path)
    meta = reader.meta
    fam = family(meta.family)
    sizes = fam.sizes_of(meta.ctor_args)
    methods: Counter[str] = Counter()
    # the recorder's own rows (gaps, checkpoints), apart: a family may name a method "checkpoint" too
    marks: Counter[str] = Counter()
    rows = top = exceptions = nones = indices = folded = groups = bounds = 0
    t_min: int | None = None
    t_max: int | None = None
    min_avail: dict[str, int] = {}
    counter_col = fam.counter_of
    held = fam.held_counters
    max_held: dict[str, int] = {}
    void = pa.array(sorted(fam.void_methods), pa.string())
    for batch in reader.iter_batches(columns=_COLUMNS):
        rows += batch.num_rows
        is_top = pc.equal(batch["depth"], 0)
        top += int(pc.sum(is_top).as_py() or 0)
        is_mark = pc.and_(is_top, pc.equal(batch["target"], GAP_TARGET))
        marks.update(_value_counts(pc.filter(batch["method"], is_mark)))
        methods.update(_value_counts(pc.filter(batch["method"], pc.and_(is_top, pc.invert(is_mark)))))
        for n, packed in _folds(batch):
            methods.update(reader.fold_methods(n, packed))
            folded += n
        g = len(batch) - batch["folded_group_at"].null_count
        if g:
            methods.update(dict.fromkeys(GROUP_FOLD_METHODS, g))
            groups += g
        if batch["folded_group_bounds"].null_count < len(batch):
            b = batch["folded_group_bounds"].fill_null(0).to_numpy(zero_copy_only=False)
            opened, closed = int((b & 1).sum()), int((b >> 1 & 1).sum())
            methods.update({GROUP_FOLD_METHODS[0]: opened, GROUP_FOLD_METHODS[1]: closed})
            bounds += opened + closed
        exceptions += batch.num_rows - batch["exc_type"].null_count
        result = batch["result"]
        kinds = pc.struct_field(result, "kind")
        nones += _out_of_memory_answers(batch, is_top, kinds, void)
        indices += _list_total(pc.struct_field(result, "data"))
        indices += _list_total(pc.struct_field(pc.list_flatten(batch["args"]), "data"))
        lo, hi = pc.min(batch["t_start_ns"]).as_py(), pc.max(batch["t_end_ns"]).as_py()
        t_min = lo if t_min is None else min(t_min, lo)
        t_max = hi if t_max is None else max(t_max, hi)
        _extremes(batch, {k: v for k, v in counter_col.items() if k in sizes}, held, min_avail, max_held)
    notes = []
    if rows == 0:
        notes.append("trace holds no calls")
    part = meta.extra.get("part") if isinstance(meta.extra.get("part"), dict) else None
    if part is not None and meta.initial_state is not None:
        notes.append(f"starts at part {part.get('index')} of a rotated recording (its call #{part.get('first_call')}), "
                     "from the pool's snapshot there: the parts before it were retired or are not here")
    elif meta.initial_state is not None:
        notes.append("starts from a snapshot of a pool already in use (attach or flight-recorder dump)")
    if marks.get(GAP_METHOD):
        methods[GAP_METHOD] = marks[GAP_METHOD]  # (gaps are listed with the calls, as they always were)
    gaps = reader.gaps() if marks.get(GAP_METHOD) else []
    if gaps:
        lost = sum(max(0, g.args.get("lost_calls", 0)) for g in gaps)
        notes.append(f"{len(gaps)} gap(s): the recorder lost {lost or 'an unknown number of'} calls "
                     f"(last: {gaps[-1].args.get('reason', '?')}); replay with --after-gap")
    checkpoints = marks.get(CHECKPOINT_METHOD, 0)
    if checkpoints:
        notes.append(f"{checkpoints} checkpoint(s): replay --jobs N replays the segments between them in parallel")
    size = reader.file_size
    return TraceSummary(
        path=reader.source, meta=asdict(meta), rows=rows,
        calls=top + folded + 2 * groups + bounds - marks.get(GAP_METHOD, 0) - checkpoints, folded_reads=folded,
        folded_groups=groups, folded_bounds=bounds,
        nested_rows=rows - top,
        calls_per_method=dict(methods.most_common()), exceptions=exceptions, none_results=nones,
        time_span_s=((t_max or 0) - (t_min or 0)) / 1e9,
        peak_used={k: max_held[k] if k in held else sizes[k] - min_avail[k]
                   for k in counter_col if k in min_avail or k in max_held},
        file_bytes=size, recorded_indices=indices,
        bytes_per_index=(size / indices) if indices else None, notes=notes,
    )


def _folds(batch: pa.RecordBatch) -> list[tuple[int, int | None]]:
    """(count, pattern) of each row that folds counter reads."""
    n = batch["folded_reads"]
    if n.null_count == len(n):
        return []
    at = pc.indices_nonzero(n.fill_null(0))
    return list(zip(pc.take(n, at).to_pylist(), pc.take(batch["folded_pattern"], at).to_pylist(), strict=True))


def _out_of_memory_answers(batch: pa.RecordBatch, is_top: pa.Array, kinds: pa.Array, void_methods: pa.Array) -> int:
    """Top-level calls that returned None without raising, other than void ones."""
    void = pc.is_in(batch["method"], value_set=void_methods)
    hit = pc.and_(pc.and_(is_top, pc.invert(void)), pc.and_(pc.equal(kinds, "none"), pc.is_null(batch["exc_type"])))
    return int(pc.sum(hit).as_py() or 0)


def _value_counts(arr: pa.Array) -> dict[str, int]:
    vc = pc.value_counts(arr)
    return {v["values"]: v["counts"] for v in vc.to_pylist()}


def _list_total(arr: pa.Array) -> int:
    lengths = pc.list_value_length(arr)
    return int(pc.sum(lengths).as_py() or 0)


def is_trace_directory_corpus(location: str | os.PathLike[str]) -> bool:
    """A directory of traces (a fleet's dump, hive-partitioned or not), as opposed to
    a trace file or one rotated trace's directory of parts."""
    root = local_path(location)
    return root.is_dir() and not is_rotated_trace(root)


def summarize_corpus(location: str | os.PathLike[str]) -> list[tuple[CorpusTrace, TraceSummary]]:
    """Each trace of a directory corpus with its summary (and partition keys)."""
    return [(t, summarize(t.location)) for t in corpus_traces(location)]
