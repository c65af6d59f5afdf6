"""The one place that defines a kvreplay trace on disk (docs/trace-format.md explains it).

A trace is a Parquet file with one row per allocator call (top-level and nested), in
call-start order. Argument and result values share one struct type, so a value of
any kind (None, bool, int, float, str, integer/bool tensor, list of ints, list of
``(tensor, start_pos)`` segments) round-trips losslessly."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from kvreplay.contract.record import DEFAULT_COUNTER_READS
from kvreplay.contract.registry import family, family_names, is_family, sub_allocators
from kvreplay.limits import MAX_POOL_SLOTS, limit

# 2: counter reads that told nothing new are folded into the row before them
# (``folded_reads``, ``folded_pattern``); a version 1 trace reads as one without folds.
# 3: so is an empty free group (``folded_group_at``, ``folded_group_targets``); a
# version 1 or 2 trace reads as one without folded groups.
# 4: so are the begin and end of a free group that holds calls (``folded_group_bounds``,
# ``folded_group_bounds_targets``); an older trace reads as one without such folds.
SCHEMA_VERSION = 4
META_PREFIX = "kvreplay."
# The pools a row can target: the allocator itself, the recorder (gap rows), and the
# sub-allocators the families' records name (targets()).
BASE_TARGETS = frozenset({"root", "recorder"})


def targets() -> frozenset[str]:
    """Every target a row may name."""
    return BASE_TARGETS | {t for t, _ in sub_allocators()}

# -- bounds on what a trace can make kvreplay allocate (limits.py) ---------------------------
_limit = limit
# One recorded string (a request id, a reason, an exception's message): recorders cut
# theirs far below this, so a longer one is damage, and decoding it would copy it per call.
MAX_STRING_BYTES = _limit("KVREPLAY_MAX_STRING_BYTES", 1 << 16)
# Index values one row group may list (data and shape lists of every argument and result):
# 2^26 is 512 MB decoded; real row groups (16,384 calls) list a few million.
MAX_GROUP_VALUES = _limit("KVREPLAY_MAX_GROUP_VALUES", 1 << 26)
# ...and one row group of a family whose calls name ids, not token slots (vLLM's blocks
# and hashes, the mamba family's requests and state slots): a replay makes each a Python
# int (~40 bytes, not a tensor's 8), so 2^22 is ~200 MB decoded; their real row groups
# (16,384 calls) list a few hundred thousand.
MAX_GROUP_IDS = _limit("KVREPLAY_MAX_GROUP_IDS", 1 << 22)
# Element types a recorded tensor may name (a segment list joins one per segment with ","):
# the reader refuses any other, the decoder maps these, and nothing else, to torch's.
TENSOR_DTYPES = ("torch.int64", "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.bool")
# Counter reads one row may fold (format version 2): a live server reads its counters
# ~10,000 times a second, and its recorder starts a new row at least every flush.
MAX_FOLDED_READS = _limit("KVREPLAY_MAX_FOLDED_READS", 1 << 24)
# ...and a whole trace: each folded read is a call replay makes (an hour of an idle
# server polling is ~35 million), so a few rows cannot ask for days of replay.
MAX_TRACE_FOLDED_READS = _limit("KVREPLAY_MAX_TRACE_FOLDED_READS", 1 << 28)
# Parts of one rotated trace: each is opened (a file and its footer, ~80 KB) before any
# replays. Ten-minute parts kept for two weeks are ~2,000.
MAX_TRACE_PARTS = _limit("KVREPLAY_MAX_TRACE_PARTS", 2048)
FOLD_MAX = 8  # distinct counter reads in a fold's pattern (recorder/layout.py's)
# An empty free group folded into a row: its two top-level calls, and at most this many
# nested calls on sub-allocators per call (recorder/layout.py's GROUP_NESTED_MAX).
GROUP_NESTED_MAX = 3
MAX_JSON_DEPTH = 32  # of any JSON a trace or manifest holds; real ones nest 4 deep
SCHEMA_VERSION_TEXT = re.compile(r"^[1-9][0-9]{0,5}$")


def parse_json(text: str, what: str) -> Any:
    """JSON from untrusted input, as ValueError when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds an integer too long to read."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # not JSON, or an integer of more digits than Python converts
        raise ValueError(f"{what} is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return value
# A pool's ``dtype`` is what the server passes: sglang hands its allocators the KV
# cache's element type (bfloat16 on a GPU server, float32 on CPU, float8 when the
# cache is quantised), not the type of the slot indices, which are int64 whatever it
# is. The names are a fixed list, so a trace never makes kvreplay look up an
# arbitrary attribute of torch.
POOL_DTYPES = (
    "torch.int64", "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.bool",
    "torch.float64", "torch.float32", "torch.float16", "torch.bfloat16",
    "torch.float8_e4m3fn", "torch.float8_e4m3fnuz", "torch.float8_e5m2", "torch.float8_e5m2fnuz",
    "torch.float8_e8m0fnu", "torch.float4_e2m1fn_x2", "torch.uint16", "torch.uint32", "torch.uint64",
)

# Value kinds. Tensors keep dtype, shape and device; their elements go to ``data``.
NONE, BOOL, INT, FLOAT, STR, TENSOR, INTS, SEGMENTS, OPAQUE = (
    "none", "bool", "int", "float", "str", "tensor", "ints", "segments", "opaque",
)
VALUE_KINDS = (NONE, BOOL, INT, FLOAT, STR, TENSOR, INTS, SEGMENTS, OPAQUE)

_VALUE_FIELDS = [
    pa.field("kind", pa.string(), nullable=False),
    pa.field("i", pa.int64()),
    pa.field("f", pa.float64()),
    pa.field("s", pa.string()),
    pa.field("dtype", pa.string()),
    pa.field("device", pa.string()),
    pa.field("shape", pa.list_(pa.int64())),
    pa.field("data", pa.list_(pa.int64())),
]
VALUE_TYPE = pa.struct(_VALUE_FIELDS)
ARG_TYPE = pa.struct([pa.field("name", pa.string(), nullable=False), *_VALUE_FIELDS])

SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("parent", pa.int64(), nullable=False),
        pa.field("depth", pa.int8(), nullable=False),
        pa.field("target", pa.string(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("t_start_ns", pa.int64(), nullable=False),
        pa.field("t_end_ns", pa.int64(), nullable=False),
        pa.field("args", pa.list_(ARG_TYPE), nullable=False),
        pa.field("result", VALUE_TYPE),
        pa.field("exc_type", pa.string()),
        pa.field("exc_msg", pa.string()),
        pa.field("available", pa.int64()),
        pa.field("full_available", pa.int64()),
        pa.field("swa_available", pa.int64()),
        # Counter reads after this row that returned what was already known (the pool's
        # state had not changed since): how many, and which counters in what order, as
        # base-4 digits (1 available_size, 2 full_available_size, 3 swa_available_size;
        # the first read in the lowest digit), the pattern repeating up to the count.
        # Null or 0: none. Readers hand them back as calls (reader.py).
        pa.field("folded_reads", pa.int64()),
        pa.field("folded_pattern", pa.int32()),
        # An empty free group (free_group_begin then free_group_end, nothing in between,
        # nothing freed) after this row: after how many of its folded reads it came
        # (0..folded_reads), and the targets its nested calls went to, comma-separated
        # ("" none; the same targets for the begin's and the end's). Null: none.
        pa.field("folded_group_at", pa.int32()),
        pa.field("folded_group_targets", pa.string()),
        # The bounds of a free group that holds calls, folded into its first and last
        # call's rows: 1, the group's begin came right before this call; 2, its end came
        # right after this call's nested calls, before its folded reads, and the row's
        # counters are the ones read after that end (the call's own, inside the group,
        # are unknown); 3, both. The targets the begin's and end's nested calls went to,
        # comma-separated ("" none). Null: none.
        pa.field("folded_group_bounds", pa.int32()),
        pa.field("folded_group_bounds_targets", pa.string()),
    ]
)
# Columns added after version 1, with the version that added them: an older part reads
# as null there (no folds).
ADDED_COLUMNS = {"folded_reads": 2, "folded_pattern": 2, "folded_group_at": 3, "folded_group_targets": 3,
                 "folded_group_bounds": 4, "folded_group_bounds_targets": 4}
# The calls an empty free group folds into a row: one begin and one end, top-level.
GROUP_FOLD_METHODS = ("free_group_begin", "free_group_end")


GROUP_OPENED, GROUP_CLOSED = 1, 2  # folded_group_bounds' bits (recorder/layout.py's)


def folded_calls(folded_reads: Any, group_at: Any, bounds: Any) -> Any:
    """Top-level calls folded into each row (numpy arrays of the three columns, nulls as
    0, -1 and 0): its folded reads, two more where it folds an empty free group, and one
    per folded bound of a group around it."""
    return folded_reads + 2 * (group_at >= 0) + (bounds & GROUP_OPENED) + ((bounds & GROUP_CLOSED) >> 1)

# Columns that must be identical for two runs of the same seeded workload.
CALL_COLUMNS = [f.name for f in SCHEMA if f.name not in ("t_start_ns", "t_end_ns")]
COUNTERS = ("available", "full_available", "swa_available")
# the reads that fill them by default, in the same order (a family names its own reads,
# its record's counter_reads, and which column each sub-pool's is, its sub_counters)
COUNTER_READS = DEFAULT_COUNTER_READS

# Parquet settings: delta-encode index data (runs of consecutive slots shrink to a
# few bits) and dictionary-encode the small string columns.
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": ["target", "method", "exc_type", "args.list.element.name",
                       "args.list.element.kind", "args.list.element.dtype",
                       "args.list.element.device", "result.kind", "result.dtype", "result.device"],
    "column_encoding": {
        "args.list.element.data.list.element": "DELTA_BINARY_PACKED",
        "result.data.list.element": "DELTA_BINARY_PACKED",
        "seq": "DELTA_BINARY_PACKED",
        "t_start_ns": "DELTA_BINARY_PACKED",
        "t_end_ns": "DELTA_BINARY_PACKED",
    },
    "write_statistics": False,
    # A checksum per data page, verified on read: a flipped bit in index data is a
    # one-line error, not a plausible trace with wrong slots in it.
    "write_page_checksum": True,
}


@dataclass
class TraceMeta:
    """File-level metadata: what pool was recorded, where and when."""

    pool_class: str
    family: str
    ctor_args: dict[str, Any]
    source_version: dict[str, str] = field(default_factory=dict)
    host: str = ""
    pid: int = 0
    rank: str = ""
    start_time: str = ""
    initial_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_parquet_metadata(self) -> dict[bytes, bytes]:
        plain = {
            "schema_version": str(self.schema_version),
            "pool_class": self.pool_class,
            "family": self.family,
            "host": self.host,
            "pid": str(self.pid),
            "rank": self.rank,
            "start_time": self.start_time,
        }
        as_json = {
            "ctor_args": self.ctor_args,
            "source_version": self.source_version,
            "extra": self.extra,
        }
        if self.initial_state is not None:
            as_json["initial_state"] = self.initial_state
        out = {(META_PREFIX + k).encode(): v.encode() for k, v in plain.items()}
        out.update({(META_PREFIX + k).encode(): json.dumps(v, sort_keys=True).encode() for k, v in as_json.items()})
        return out

    @classmethod
    def from_parquet_metadata(cls, md: dict[bytes, bytes]) -> TraceMeta:
        """Parse and check footer metadata. KeyError: not a kvreplay trace;
        ValueError/TypeError: a kvreplay trace whose metadata is damaged."""
        get = {k.decode()[len(META_PREFIX):]: v.decode() for k, v in md.items() if k.startswith(META_PREFIX.encode())}
        meta = cls(
            pool_class=get["pool_class"],
            family=get["family"],
            ctor_args=_json_object("ctor_args", get["ctor_args"]),
            source_version=_json_object("source_version", get.get("source_version", "{}")),
            host=get.get("host", ""),
            pid=int(get.get("pid", "0") or 0),
            rank=get.get("rank", ""),
            start_time=get.get("start_time", ""),
            initial_state=_json_object("initial_state", get["initial_state"]) if "initial_state" in get else None,
            extra=_json_object("extra", get.get("extra", "{}")),
            schema_version=_schema_version(get["schema_version"]),
        )
        if not is_family(meta.family):
            raise ValueError(f"pool family {meta.family[:40]!r} is not one of {', '.join(family_names())}")
        check_ctor_args(meta.family, meta.ctor_args)
        return meta


def _json_object(name: str, text: str) -> dict[str, Any]:
    value = parse_json(text, name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, not {type(value).__name__}")
    return value


def _schema_version(text: str) -> int:
    if not SCHEMA_VERSION_TEXT.match(text):
        raise ValueError(f"schema version {text[:20]!r} is not a version number (1, 2, ...)")
    return int(text)


def check_ctor_args(name_of_family: str, args: dict[str, Any]) -> None:
    """The constructor arguments a trace records, as its family needs them: sizes
    whole numbers in range, need_sort a bool, dtype a torch dtype name."""
    fam = family(name_of_family)
    for name in fam.sizes:
        v = args.get(name)
        if type(v) is not int or not 0 <= v <= MAX_POOL_SLOTS:
            raise ValueError(f"constructor argument {name} must be a whole number in 0..{MAX_POOL_SLOTS}, not {v!r}")
    for name in fam.units:
        if args[name] < 1:
            raise ValueError(f"constructor argument {name} must be at least 1")
    if "need_sort" in args and type(args["need_sort"]) is not bool:
        raise ValueError(f"constructor argument need_sort must be true or false, not {args['need_sort']!r}")
    if "dtype" in args and args["dtype"] not in POOL_DTYPES:
        raise ValueError(f"constructor argument dtype must be a torch dtype name (torch.bfloat16, torch.int64, ...), "
                         f"not {str(args['dtype'])[:80]!r}")
    if fam.check_ctor is not None:
        fam.check_ctor(args)


@dataclass(slots=True)
class Call:
    """One recorded allocator call, decoded."""

    seq: int
    parent: int
    depth: int
    target: str
    method: str
    args: dict[str, Any]
    result: Any
    exc_type: str | None
    exc_msg: str | None
    counters: dict[str, int | None]
    t_start_ns: int
    t_end_ns: int
    has_opaque: bool = False  # an argument could not be recorded losslessly
    folded_reads: int = 0  # counter reads folded after this call (the reader hands them back as calls)
    folded_pattern: int | None = None
    folded_group_at: int | None = None  # an empty free group folded after this many of those reads
    folded_group_targets: str | None = None  # ...and where its nested calls went
    folded_group_bounds: int | None = None  # a free group's begin (1) or end (2) or both folded here (SCHEMA)
    folded_group_bounds_targets: str | None = None  # ...and where their nested calls went
    from_fold: bool = False  # one of those reads: a call with no row of its own

    @property
    def top_level(self) -> bool:
        return self.depth == 0


@dataclass(slots=True)
class TopCall:
    """A recorded top-level call, its number (1..N among the trace's top-level
    calls; reports name calls by it) and the sub-allocator calls it made."""

    call: Call
    number: int
    nested: list[Call] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """The trace rows this call takes (a folded read takes none)."""
        return 0 if self.call.from_fold else 1 + len(self.nested)


# A trace recorded with rotation is a directory of closed parts, read in name order
# as one trace; the first part's metadata is the trace's.
PART_GLOB = "part-*.parquet"


def part_name(n: int) -> str:
    return f"part-{n:06d}.parquet"


PART_NAME = re.compile(r"^part-([0-9]{6,9})\.parquet$")


# Where the recorder lost calls (its queue was full, the writer failed, the recorder
# stopped), a row with this target and method stands in for them. Its arguments say
# how many (``lost_calls``, -1 when unknown), which (``first_seq``..``last_seq``), why
# (``reason``), and, when the recorder could take one, the pool's state right after
# them (``state``, snapshot JSON), from which a replay can start.
GAP_TARGET, GAP_METHOD = "recorder", "gap"
# Every N calls (when asked) the recorder also writes a checkpoint row with the same
# target: the pool's state there (``state``), what the invariant checker knew
# (``checker``) and how many top-level calls came before it (``calls``). A long trace
# splits at checkpoints into segments that replay independently (replay --jobs).
CHECKPOINT_METHOD = "checkpoint"


@dataclass(frozen=True)
class GapRecord:
    first_seq: int
    last_seq: int
    lost_calls: int
    reason: str
    state: str = ""  # snapshot JSON after the lost calls, or "" if none was taken
    t_ns: int = 0
    # The state not yet encoded: a call that returns its JSON. The recorded program's
    # thread only captures (device copies, no host sync); the writer's side encodes.
    pending_state: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    def merged(self, later: GapRecord) -> GapRecord:
        n = -1 if self.lost_calls < 0 or later.lost_calls < 0 else self.lost_calls + later.lost_calls
        # The state after both is the later one's: an earlier snapshot misses what the
        # later lost calls did, so none is better than it.
        return GapRecord(self.first_seq, later.last_seq, n, later.reason, later.state, later.t_ns,
                         later.pending_state)

    def settled(self) -> GapRecord:
        """This gap with its state encoded (off the recorded program's thread)."""
        if self.pending_state is None:
            return self
        try:
            state = self.pending_state()
        except Exception:  # the snapshot could not be encoded: the gap is still marked
            state = ""
        return replace(self, state=state, pending_state=None)

    def to_table(self) -> pa.Table:
        def arg(name: str, kind: str, **v: Any) -> dict[str, Any]:
            return {"name": name, "kind": kind, **v}

        row = {
            "seq": self.last_seq, "parent": -1, "depth": 0, "target": GAP_TARGET, "method": GAP_METHOD,
            "t_start_ns": self.t_ns, "t_end_ns": self.t_ns,
            "args": [arg("lost_calls", INT, i=self.lost_calls), arg("first_seq", INT, i=self.first_seq),
                     arg("last_seq", INT, i=self.last_seq), arg("reason", STR, s=self.reason[:2000]),
                     arg("state", STR, s=self.state)],
            "result": {"kind": NONE},
        }
        return pa.Table.from_pylist([row], schema=SCHEMA)


@dataclass(frozen=True)
class Opaque:
    """A value kvreplay could not record losslessly; replay refuses to pass it on."""

    text: str


@dataclass(frozen=True)
class CheckpointRecord(GapRecord):
    """A checkpoint row, carried through the recorder's queue and writer as a gap is
    (it loses no call: ``lost_calls`` is 0)."""

    calls: int = 0
    checker: str = ""

    def to_table(self) -> pa.Table:
        row = {
            "seq": self.last_seq, "parent": -1, "depth": 0, "target": GAP_TARGET, "method": CHECKPOINT_METHOD,
            "t_start_ns": self.t_ns, "t_end_ns": self.t_ns,
            "args": [{"name": "calls", "kind": INT, "i": self.calls},
                     {"name": "state", "kind": STR, "s": self.state},
                     {"name": "checker", "kind": STR, "s": self.checker}],
            "result": {"kind": NONE},
        }
        return pa.Table.from_pylist([row], schema=SCHEMA)
