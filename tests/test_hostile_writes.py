"""Hostile input, the files kvreplay writes: no write follows a link out of its
directory or replaces a FIFO or a device, every file read back is a regular file of
bounded size, and a recording whose disk is full from the start, or whose writer is
killed, harms neither the recorded program nor the end of ``kvreplay record``."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
from conftest import PythonPeak

from kvreplay.errors import BadInput
from kvreplay.safe_files import read_regular, write_atomic

CORPUS_TRACE = Path(__file__).resolve().parent.parent / "traces" / "decode-1000.parquet"
TARGET = "kvreplay.families.sglang.swa:SWAPool"


def _one_line_error(res) -> None:
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr.startswith("kvreplay: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr


def _nothing_but(directory: Path, *names: str) -> None:
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)


# -- corpus add / ci / corpus check -------------------------------------------------------------


def test_corpus_add_never_writes_through_a_link_in_the_corpus(tmp_path, cli):
    corpus, victim = tmp_path / "corpus", tmp_path / "outside.txt"
    corpus.mkdir()
    victim.write_text("not yours")
    (corpus / "foo.parquet").symlink_to(victim)
    res = cli("corpus", "add", str(CORPUS_TRACE), "--name", "foo", "--corpus", str(corpus))
    _one_line_error(res)
    assert "symbolic link" in res.stderr
    assert victim.read_text() == "not yours"
    _nothing_but(corpus, "foo.parquet")  # no manifest, no temporary file
    assert (corpus / "foo.parquet").is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-file"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_not_replaced(tmp_path, cli, kind):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    manifest = corpus / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        (tmp_path / "elsewhere.json").write_text('{"version": 2, "traces": []}\n')
        manifest.symlink_to(tmp_path / "elsewhere.json")
    t0 = time.monotonic()
    res = cli("corpus", "add", str(CORPUS_TRACE), "--name", "foo", "--corpus", str(corpus))
    _one_line_error(res)
    assert time.monotonic() - t0 < 10  # refused before the replay; a FIFO is never waited on
    _nothing_but(corpus, "manifest.json")
    assert manifest.is_symlink() or stat.S_ISFIFO(manifest.lstat().st_mode)
    if kind == "link-to-file":
        assert (tmp_path / "elsewhere.json").read_text() == '{"version": 2, "traces": []}\n'
        return
    for argv in (("ci", str(corpus), "--build", "builtin:paged", "--db", ""), ("corpus", "check", str(corpus))):
        _one_line_error(cli(*argv))
    _nothing_but(corpus, "manifest.json")


def test_a_huge_manifest_is_refused_before_it_is_read(tmp_path, cli):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "manifest.json", "wb") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse: a read of it would take 2 GiB and more to parse
    with PythonPeak() as peak:
        for argv in (("corpus", "add", str(CORPUS_TRACE), "--name", "foo", "--corpus", str(corpus)),
                     ("ci", str(corpus), "--build", "builtin:paged", "--db", ""), ("corpus", "check", str(corpus))):
            res = cli(*argv)
            _one_line_error(res)
            assert "larger than" in res.stderr
    assert peak.bytes < 200 << 20, peak.bytes  # a read of the manifest would take 2 GiB
    _nothing_but(corpus, "manifest.json")


def test_corpus_add_writes_new_files_0644_whatever_the_umask(tmp_path, cli, swa_trace_80):
    corpus = tmp_path / "corpus"
    old = os.umask(0)
    try:
        res = cli("corpus", "add", str(swa_trace_80), "--name", "swa80", "--corpus", str(corpus))
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    _nothing_but(corpus, "manifest.json", "swa80.parquet")
    for name in ("manifest.json", "swa80.parquet"):
        assert stat.S_IMODE((corpus / name).stat().st_mode) == 0o644
    assert (corpus / "swa80.parquet").read_bytes() == swa_trace_80.read_bytes()
    assert cli("corpus", "check", str(corpus)).returncode == 0


# -- safe_files -----------------------------------------------------------------------------------


def test_read_regular_takes_only_a_bounded_regular_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_bytes(b"x" * 100)
    assert read_regular(good, 100, "file") == b"x" * 100
    with pytest.raises(BadInput, match="larger than the 99 bytes"):
        read_regular(good, 99, "file")
    os.mkfifo(tmp_path / "fifo")
    cases = {tmp_path / "fifo": "a FIFO", Path("/dev/zero"): "a character device", tmp_path: "a directory",
             tmp_path / "missing": "cannot read"}
    for path, why in cases.items():
        with pytest.raises(BadInput, match=why) as info:
            read_regular(path, 1 << 20, "file")
        assert "\n" not in str(info.value)
    (tmp_path / "link").symlink_to(good)
    assert read_regular(tmp_path / "link", 100, "file") == b"x" * 100
    with pytest.raises(BadInput, match="symbolic link"):
        read_regular(tmp_path / "link", 100, "file", follow=False)


def test_write_atomic_refuses_links_and_special_files_and_leaves_nothing(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "fifo"):
        with pytest.raises(BadInput, match="symbolic link|FIFO"):
            write_atomic(tmp_path / name, b"new")
    assert victim.read_text() == "keep"
    _nothing_but(tmp_path, "victim", "link", "fifo")

    old = os.umask(0)
    try:
        write_atomic(tmp_path / "new", b"one")
        (tmp_path / "kept").write_bytes(b"")
        os.chmod(tmp_path / "kept", 0o600)
        write_atomic(tmp_path / "kept", [b"t", b"wo"])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o600  # a regular file keeps its mode
    assert (tmp_path / "kept").read_bytes() == b"two"

    def failing():
        yield b"half"
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(BadInput, match="No space left"):
        write_atomic(tmp_path / "new", failing())
    assert (tmp_path / "new").read_bytes() == b"one"  # the old file, whole
    _nothing_but(tmp_path, "victim", "link", "fifo", "new", "kept")


# -- the trace writer ------------------------------------------------------------------------------


class _Disk:
    """A disk that is full while ``full`` is set: a part's file is created, as on a
    full tmpfs, but no byte of it can be written (its first, the magic, included)."""

    def __init__(self, monkeypatch):
        import kvreplay.recorder.writer as writer

        self.full = True
        real = os

        class Full:
            def __init__(self, f, disk):
                self._f, self._disk = f, disk

            def write(self, data):
                if self._disk.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return self._f.write(data)

            def flush(self):
                if self._disk.full:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return self._f.flush()

            def __getattr__(self, name):
                return getattr(self._f, name)

        proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
        proxy.fdopen = lambda fd, *a, **k: Full(real.fdopen(fd, *a, **k), self)
        monkeypatch.setattr(writer, "os", proxy)


def _work(pool, n: int) -> None:
    import torch

    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    for _ in range(n):
        pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))


def _written(rec) -> None:
    """Wait until the writer thread has taken every batch handed to it."""
    deadline = time.monotonic() + 30
    while rec._writer._queued_rows and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("rotate_rows", [0, 100])
def test_a_disk_full_at_the_start_becomes_a_gap_and_leaves_no_tmp_part(tmp_path, monkeypatch, rotate_rows):
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.recorder.recording import record
    from kvreplay.trace.format import GAP_TARGET
    from kvreplay.trace.reader import TraceReader

    disk = _Disk(monkeypatch)
    path = tmp_path / "t.parquet"
    pool = SWAPool(256, 64, 4, need_sort=False)
    rec = record(pool, path, writer="thread", rows_per_batch=16, rows_per_group=16, rotate_rows=rotate_rows,
                 flush_s=0)
    _work(pool, 20)
    _written(rec)
    assert not list(tmp_path.rglob("*.tmp"))  # the part that could not be opened is not left
    disk.full = False
    _work(pool, 20)
    rec.close()
    assert not list(tmp_path.rglob("*.tmp"))
    reader = TraceReader(path)
    gaps = reader.gaps()
    assert gaps and gaps[0].args["first_seq"] == 0 and "No space left" in gaps[0].args["reason"]
    calls = [c for c in reader.calls(top_level_only=True) if c.target != GAP_TARGET]
    lost = sum(g.args["lost_calls"] for g in gaps)
    assert lost > 0 and calls and lost + len(calls) == 2 * 40  # every top-level call written or counted


@pytest.mark.parametrize("rotate_rows", [0, 100])
def test_a_disk_full_throughout_leaves_nothing_and_says_so_in_one_line(tmp_path, monkeypatch, caplog,
                                                                       rotate_rows):
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.recorder.recording import close_all, record

    _Disk(monkeypatch)
    pool = SWAPool(256, 64, 4, need_sort=False)
    record(pool, tmp_path / "t.parquet", writer="thread", rows_per_batch=16, rotate_rows=rotate_rows)
    _work(pool, 20)
    with caplog.at_level("ERROR"):
        close_all()  # as at the recorded program's exit
    assert list(tmp_path.iterdir()) == []  # no .tmp part, no empty directory of parts
    errors = [r for r in caplog.records if "could not finish trace" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is None and "No space left" in errors[0].getMessage()
    assert "\n" not in errors[0].getMessage()


def test_a_flight_dump_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    from kvreplay.families.sglang.variants import UnfilteredPage0SWAPool
    from kvreplay.recorder.flight import flight_recorder
    from kvreplay.workload.synth import SCENARIOS, SynthConfig, run_model

    _Disk(monkeypatch)
    pool = UnfilteredPage0SWAPool(2048, 512, 4, need_sort=True)  # its capacity assertion fires: a dump
    fr = flight_recorder(pool, tmp_path, calls=300, snapshot_every=100, signal=None)
    with caplog.at_level("ERROR"), pytest.raises(AssertionError):  # the program's own error, unchanged
        run_model(pool, SynthConfig(scenario="radix-swa", out="unused.parquet", requests=800, seed=1),
                  SCENARIOS["radix-swa"])
    fr.close()
    assert fr.dumps == [] and list(tmp_path.iterdir()) == []
    failed = [r for r in caplog.records if "dump failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None and "No space left" in failed[0].getMessage()


def test_the_writer_never_writes_through_a_link_planted_in_the_out_directory(tmp_path):
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.recorder.live import _check_writable
    from kvreplay.recorder.recording import record
    from kvreplay.recorder.rotation import Rotation
    from kvreplay.recorder.writer import ParquetSink
    from kvreplay.trace.reader import TraceReader

    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "t.parquet.tmp").symlink_to(victim)  # the temporary name of the next trace
    (out / f".kvreplay-probe-{os.getpid()}").symlink_to(victim)
    _check_writable(out)
    pool = SWAPool(256, 64, 4, need_sort=False)
    rec = record(pool, out / "t.parquet", writer="thread")
    _work(pool, 5)
    rec.close()
    assert victim.read_text() == "keep"
    assert TraceReader(out / "t.parquet").num_rows > 0
    (out / "parts").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(FileExistsError, match="link"):  # a directory of parts that is a link is not used
        ParquetSink(out / "parts", rec.meta, rotation=Rotation(rows=10))
    assert list((tmp_path / "elsewhere").iterdir()) == []


# -- kvreplay record: a real full disk, a killed writer ----------------------------------------------

PROGRAM = """
import os, time, torch
from kvreplay.families.sglang.swa import SWAPool

def t(*v):
    return torch.tensor(v, dtype=torch.int64)

def work(pool, n):
    for _ in range(n):
        pool.free(pool.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4))

def my_writers():
    # the writers kvreplay record adopted (its subreaper): this recording's, no other test's
    me, found = os.getppid(), []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and b"writer_child" in cmd:
            found.append(int(d))
    return found

pool = SWAPool(256, 64, 4, need_sort=False)
work(pool, 100)
"""


def _record(out: Path, body: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROGRAM) + textwrap.dedent(body))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), "--class", TARGET,
                          "--", sys.executable, str(prog)], capture_output=True, text=True, timeout=120)
    return res, time.monotonic() - t0


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled: an out directory on it takes no byte (root only)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        (disk / "out").mkdir()
        with open(disk / "fill", "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * 4096):
                    pass
            except OSError:
                pass  # full
        yield disk / "out"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow  # 5-11 s: kvreplay record of a Python program; the fast tier has the sink's own tests above
def test_record_on_a_disk_full_from_the_start_leaves_no_tmp_and_no_traceback(tmp_path, full_disk):
    res, _ = _record(full_disk, 'print("done", flush=True)\n', tmp_path)
    assert res.returncode == 0, res.stderr  # the recorded program's own exit
    assert res.stdout.strip() == "done"
    assert "Traceback" not in res.stderr
    assert "could not finish trace" in res.stderr and "No space left" in res.stderr
    assert "no traces written" in res.stderr
    assert list(full_disk.iterdir()) == []  # no .tmp part, no empty directory of parts


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_killed_writer_costs_no_traceback_and_no_stall(tmp_path):
    res, took = _record(tmp_path / "out", """
        import signal
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as many servers do: a write to a dead pipe kills
        time.sleep(0.3)
        writers = my_writers()
        assert writers, "no writer found"
        for pid in writers:
            os.kill(pid, 9)
        time.sleep(0.2)
        work(pool, 100)  # the program goes on as if nothing happened
        print("done", flush=True)
    """, tmp_path)
    assert res.returncode == 0, res.stderr  # not 141: SIGPIPE did not kill the program at its next write
    assert res.stdout.strip() == "done"
    assert "Traceback" not in res.stderr
    assert "could not finish trace" in res.stderr and "killed" in res.stderr
    assert "no traces written" in res.stderr  # its directory holds no finished part: not reported as a trace
    assert took < 25, took  # not the 30 s settle for a .tmp part no writer will finish

