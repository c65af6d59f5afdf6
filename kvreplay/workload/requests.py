"""Request streams that drive the workload model: Mooncake JSONL, Azure CSV, or a
seeded generator with shared prefixes. Formats: workloads/README.md."""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreplay.errors import BadInput

# Bounds on what a workload file may ask for, checked as each record is read: a line is
# read at most MAX_LINE bytes at a time (a file of one endless line is not read whole),
# a length is a token count a request can have, an arrival time a finite number.
MAX_LINE = 1 << 20
MAX_TOKENS = 1 << 24
MAX_BLOCKS_PER_REQUEST = 1 << 16
_BAD_VALUES = (ValueError, KeyError, TypeError, OverflowError, RecursionError, IndexError, csv.Error)


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_ms: float
    input_len: int
    output_len: int
    # One id per prompt block; equal leading runs mean a shared (cacheable) prefix.
    blocks: tuple[int, ...]


def load_requests(
    path: str | Path | None,
    *,
    count: int,
    seed: int,
    block_tokens: int,
    length_scale: float = 1.0,
    output_scale: float | None = None,
) -> list[Request]:
    """The first ``count`` requests of a workload file, or ``count`` generated ones.
    ``length_scale`` scales prompt lengths, ``output_scale`` (default: the same)
    output lengths."""
    if count <= 0:
        raise BadInput(f"--requests must be positive, got {count}")
    if path is None:
        return generate(count, seed=seed, block_tokens=block_tokens)
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"workload file {p}: no such file")
    try:
        with p.open("rb") as f:
            head = f.read(4096).decode(errors="replace").lstrip()
    except OSError as exc:
        raise BadInput(f"workload file {p}: cannot read it ({exc.strerror or exc})") from None
    if head.startswith("{"):
        reqs = _mooncake(p, count, block_tokens, length_scale, output_scale)
    elif head.upper().startswith("TIMESTAMP"):
        reqs = _azure(p, count, block_tokens, length_scale, output_scale)
    else:
        raise BadInput(f"workload file {p}: neither Mooncake JSONL nor Azure CSV (formats: workloads/README.md)")
    if not reqs:
        raise BadInput(f"workload file {p}: no requests")
    return reqs


def _lines(f: Any, p: Path) -> Iterator[str]:
    """The file's lines, each read at most MAX_LINE bytes at a time: a longer one is
    refused, never read whole (a workload of one endless line is a hostile file)."""
    lineno = 0
    while True:
        try:
            line = f.readline(MAX_LINE + 1)
        except UnicodeDecodeError as exc:
            raise BadInput(f"{p}: not UTF-8 text (after line {lineno}: {exc.reason})") from None
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE:
            raise BadInput(f"{p}:{lineno}: a line longer than {MAX_LINE:,} characters; not a workload record")
        yield line


def _tokens(value: Any, what: str) -> int:
    """A token count from a record: a whole number in 0..MAX_TOKENS (10.0 is 10)."""
    n = int(value) if not isinstance(value, bool) and float(value) == int(value) else None
    if n is None or not 0 <= n <= MAX_TOKENS:
        raise ValueError(f"{what} must be a whole number of tokens in 0..{MAX_TOKENS:,}, not {str(value)[:30]}")
    return n


def _time(value: Any) -> float:
    t = float(value)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"timestamp must be a finite number >= 0, not {str(value)[:30]}")
    return t


# Azure's stamps carry 7 fractional digits; datetime takes 6 (and Python 3.10 no more).
_LONG_FRACTION = re.compile(r"(\.\d{6})\d+")


def _azure_time(value: Any) -> _dt.datetime:
    """An Azure TIMESTAMP: ISO 8601, with or without a zone (Z or +HH:MM)."""
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"TIMESTAMP must be an ISO 8601 date and time, not {str(value)[:30]!r}")
    text = _LONG_FRACTION.sub(r"\1", value.strip(), count=1)
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        return _dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"TIMESTAMP must be an ISO 8601 date and time, not {value.strip()[:30]!r}") from None


def _block_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS_PER_REQUEST:
        raise ValueError(f"hash_ids must be a list of at most {MAX_BLOCKS_PER_REQUEST:,} ids")
    out = []
    for h in value:
        if type(h) is not int or not 0 <= h < 1 << 48:
            raise ValueError(f"hash_ids must be whole numbers in 0..2^48, not {str(h)[:30]}")
        out.append(h)
    return tuple(out)


def _scaled(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


def _mooncake(p: Path, count: int, block_tokens: int, scale: float, out_scale: float | None) -> list[Request]:
    out_scale = scale if out_scale is None else out_scale
    out: list[Request] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(_lines(f, p), 1):
            if len(out) >= count:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                inp = _scaled(_tokens(d["input_length"], "input_length"), scale)
                blocks = _block_ids(d.get("hash_ids", []))
                out.append(Request(len(out), _time(d["timestamp"]), inp,
                                   _scaled(_tokens(d["output_length"], "output_length"), out_scale),
                                   _rescale_blocks(blocks, inp, block_tokens)))
            except _BAD_VALUES as exc:
                raise BadInput(f"{p}:{lineno}: bad Mooncake record ({str(exc)[:200]})") from None
    return out


def _rescale_blocks(blocks: tuple[int, ...], input_len: int, block_tokens: int) -> tuple[int, ...]:
    """Mooncake hashes 512-token blocks; after scaling, one block is ``block_tokens``.
    Keep the sharing structure: a scaled block is identified by the original block
    it falls in plus its position inside it."""
    n = math.ceil(input_len / block_tokens)
    if not blocks:
        return ()
    per = max(1, math.ceil(n / len(blocks)))
    return tuple(blocks[min(i // per, len(blocks) - 1)] * 4096 + i % per for i in range(n))


def _azure(p: Path, count: int, block_tokens: int, scale: float, out_scale: float | None) -> list[Request]:
    out_scale = scale if out_scale is None else out_scale
    out: list[Request] = []
    t0: _dt.datetime | None = None
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(_lines(f, p))
        lineno = 1
        while len(out) < count:
            lineno += 1
            try:
                row = next(reader, None)
                if row is None:
                    break
                ts = _azure_time(row["TIMESTAMP"])
                t0 = t0 or ts
                # A stamp with a zone and one without cannot be ordered: no arrival time.
                if (ts.tzinfo is None) != (t0.tzinfo is None):
                    which = "a zone and the first has none" if ts.tzinfo else "no zone and the first has one"
                    raise ValueError(f"timestamps mix zones: {row['TIMESTAMP'].strip()[:40]!r} has {which}")
                arrival_ms = (ts - t0).total_seconds() * 1000.0
                inp = _scaled(_tokens(row["ContextTokens"], "ContextTokens"), scale)
                outp = _scaled(_tokens(row["GeneratedTokens"], "GeneratedTokens"), out_scale)
            except _BAD_VALUES as exc:
                raise BadInput(f"{p}:{lineno}: bad Azure record ({str(exc)[:200]})") from None
            rid = len(out)
            # No prefix information: every block is unique to its request.
            blocks = tuple(-(rid * 100_000 + i) - 1 for i in range(math.ceil(inp / block_tokens)))
            out.append(Request(rid, arrival_ms, inp, outp, blocks))
    return out


def generate(count: int, *, seed: int, block_tokens: int, mean_gap_ms: float = 8.0) -> list[Request]:
    """Poisson arrivals; prompts share prefixes drawn from a few popular documents
    (Zipf-like), so prefix caching has hits, and outputs are short-tailed."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(1 << 30) for _ in range(rng.randint(1, 6))) for _ in range(24)]
    weights = [1.0 / (i + 1) for i in range(len(docs))]
    t = 0.0
    out = []
    for rid in range(count):
        t += rng.expovariate(1.0 / mean_gap_ms)
        doc = rng.choices(docs, weights)[0]
        shared = doc[: rng.randint(0, len(doc))]
        own = tuple(rng.randrange(1 << 30) for _ in range(rng.randint(0, 3)))
        blocks = shared + own
        tail = rng.randint(1, block_tokens)
        input_len = max(1, len(blocks) * block_tokens - (block_tokens - tail) if blocks else tail)
        if not blocks:
            blocks = (rng.randrange(1 << 30),)
        output_len = min(256, max(1, int(rng.lognormvariate(3.0, 0.8))))
        out.append(Request(rid, t, input_len, output_len, blocks))
    return out
