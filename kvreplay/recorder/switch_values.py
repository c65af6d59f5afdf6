"""The recorder's switches (switches.py) as the values they must hold, read in one place
by both sides: ``kvreplay record`` refuses the environment it would hand the recorded
program (exit 2, before the program starts), and each recorded process reads its
switches once at start-up, where a bad one turns recording off with one line on
stderr instead of raising into the server (autorecord.py).

Every switch is typed and bounded: a rank is a plain name (it becomes part of a file
name), counts are whole numbers in range, modes are one of their words."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvreplay.errors import BadInput
from kvreplay.limits import env_choice, env_int, number, recorder_backend, shown, tensor_shim, whole, writer_kind
from kvreplay.recorder.rotation import Rotation
from kvreplay.recorder.switches import (
    CHECKPOINT_ENV,
    CLASSES_ENV,
    COUNTERS_ENV,
    CPUS_ENV,
    DIR_ENV,
    FLIGHT_ENV,
    FOLD_ENV,
    PARTS_ENV,
    RANK_ENV,
    WATCH_ENV,
)

FLIGHT_MAX = 100_000_000  # calls a flight recorder keeps per allocator (about 100 bytes each)
COUNT_MAX = (1 << 31) - 1  # every Nth call, a checkpoint every N calls, rows of a part
PART_S_MIN, PART_S_MAX = 0.1, 1e9  # a part every batch would be a file per flush
KEEP_BYTES_MAX = 1 << 62
# A rank is a file name's part (kvreplay-PID-RANK-N.parquet): a plain name, never a path's.
RANK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
TARGET = re.compile(rf"{_NAME}(\.{_NAME})*:{_NAME}")  # MODULE:CLASS
_CPUS = re.compile(r"[0-9]{1,5}(,[0-9]{1,5}){0,4095}")


@dataclass(frozen=True)
class Switches:
    out: str  # "": not recording
    classes: tuple[str, ...]
    rank: str
    flight: int
    counters_every: int
    fold: bool
    checkpoint_every: int
    rotation: Rotation
    watch: str
    cpus: tuple[int, ...]
    backend: str
    writer: str


def read_switches(env: Mapping[str, str] | None = None) -> Switches:
    """The switches in ``env`` (default: this process's), or BadInput naming the first
    variable whose value is not one the recorder takes."""
    env = os.environ if env is None else env
    classes = tuple(c.strip() for c in env.get(CLASSES_ENV, "").split(",") if c.strip())
    for spec in classes:
        if not TARGET.fullmatch(spec):
            raise BadInput(f"{CLASSES_ENV}: {shown(spec)} is not MODULE:CLASS (--class)")
    rank = env.get(RANK_ENV, "").strip()
    if rank and not RANK.fullmatch(rank):
        raise BadInput(f"{RANK_ENV}={shown(rank)}: want a plain name (letters, digits, '_', '.', '-'; "
                       "at most 64, not starting with '.'), never a path")
    cpus = env.get(CPUS_ENV, "").strip()
    if cpus and not _CPUS.fullmatch(cpus):
        raise BadInput(f"{CPUS_ENV}={shown(cpus)}: want CPU numbers separated by commas")
    tensor_shim(env)
    return Switches(
        out=env.get(DIR_ENV, ""),
        classes=classes,
        rank=rank,
        flight=env_int(FLIGHT_ENV, 0, 0, FLIGHT_MAX, f"0 (off) or the calls to keep, at most {FLIGHT_MAX}", env),
        counters_every=env_int(COUNTERS_ENV, 1, 0, COUNT_MAX, f"0 (never) or N, at most {COUNT_MAX}", env),
        fold=env_choice(FOLD_ENV, ("0", "1"), env) != "0",
        checkpoint_every=env_int(CHECKPOINT_ENV, 0, 0, COUNT_MAX, f"0 (none) or N, at most {COUNT_MAX}", env),
        rotation=parts(env.get(PARTS_ENV, "")),
        watch=env_choice(WATCH_ENV, ("check", "metrics"), env),
        cpus=tuple(int(c) for c in cpus.split(",")) if cpus else (),
        backend=recorder_backend(env),
        writer=writer_kind(env),
    )


def parts(text: str) -> Rotation:
    """KVREPLAY_PARTS (ROWS,SECONDS,KEEP_PARTS,KEEP_BYTES, as Rotation.to_env writes it;
    "": one file per trace), or BadInput."""
    text = text.strip()
    if not text:
        return Rotation()
    fields = text.split(",")
    if len(fields) != 4:
        fields = ["-1", "nan", "-1", "-1"]
    rows, keep_parts, keep_bytes = (whole(f) for f in (fields[0], fields[2], fields[3]))
    seconds = number(fields[1])
    ok = (rows is not None and keep_parts is not None and keep_bytes is not None
          and 0 <= rows <= COUNT_MAX and 0 <= keep_parts <= COUNT_MAX and 0 <= keep_bytes <= KEEP_BYTES_MAX
          and (seconds == 0 or PART_S_MIN <= seconds <= PART_S_MAX))
    if not ok:
        raise BadInput(f"{PARTS_ENV}={shown(text)}: want ROWS,SECONDS,KEEP_PARTS,KEEP_BYTES (whole numbers "
                       f">= 0; SECONDS 0 or {PART_S_MIN:g} to {PART_S_MAX:g}), as kvreplay record --part-rows, "
                       "--part-s, --keep-parts and --keep-mb set it")
    return Rotation(rows, seconds, keep_parts, keep_bytes)  # type: ignore[arg-type]  # (checked above)


def check_compat(env: Mapping[str, str]) -> None:
    """KVREPLAY_CPU_COMPAT names patches this kvreplay has (record --cpu-compat sets it)."""
    from kvreplay.recorder.compat import COMPAT_ENV, patches

    names = [n for n in env.get(COMPAT_ENV, "").split(",") if n.strip()]
    if names:
        known = {p.name for p in patches()}
        for n in names:
            if n.strip() not in known:
                raise BadInput(f"{COMPAT_ENV}: {shown(n)} is not a patch of this kvreplay "
                               f"(it has {', '.join(sorted(known)) or 'none'})")
