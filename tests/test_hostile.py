"""Hostile and broken input, one test per defect found by trying kvreplay as a
hostile user would: no code runs that the user did not name, nothing replays
"clean" that is not a trace, nothing crashes, nothing is written on bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hostile_checks import bad as _bad

CORPUS = Path(__file__).resolve().parents[1] / "traces"
PAGE0 = CORPUS / "sglang-0.5.23-swa-page0.parquet"


def _rows(path: Path) -> tuple[list[dict], pa.Schema]:
    t = pq.read_table(path)
    return t.to_pylist(), t.schema


def _write(rows: list[dict], schema: pa.Schema, path: Path, metadata: dict | None = None) -> Path:
    table = pa.Table.from_pylist(rows, schema=schema)
    if metadata is not None:
        md = dict(schema.metadata)
        md.update({f"kvreplay.{k}".encode(): v.encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(md)
    pq.write_table(table, path)
    return path




# 1 -- code execution through the emitted test ----------------------------------------
@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_hostile_trace_name_cannot_run_code_through_the_emitted_test(tmp_path, cli):
    name = 'x"""; __import__("os").system("touch PWNED"); """.parquet'
    trace = tmp_path / name
    trace.write_bytes(PAGE0.read_bytes())
    test_file = tmp_path / "test_repro.py"
    res = cli("minimize", str(trace), "-b", "builtin:swa@unfiltered-page0", "-o", str(tmp_path / "m.parquet"),
              "--emit-test", str(test_file))
    assert res.returncode == 0, res.stderr
    source = test_file.read_text()
    compile(source, str(test_file), "exec")
    namespace: dict = {}
    exec(compile(source.split("def test_")[0], "head", "exec"), namespace)  # the constants only
    assert namespace["SOURCE"] == name
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          str(test_file)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and not (tmp_path / "PWNED").exists(), run.stdout[-1500:]


# 2 -- a trace never chooses what is imported or called ----------------------------------
@pytest.mark.parametrize("method", ["__init__", "__class__", "__setattr__", "alloc_extend[/red]"])
def test_only_methods_of_the_allocator_api_are_replayed(method, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    rows[0]["method"] = method
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _bad(cli("replay", str(trace), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")), "not a method")
    assert not (tmp_path / "k.db").exists()


def test_the_recorded_class_never_names_a_module_to_import(tmp_path, monkeypatch):
    from kvreplay.errors import BuildUnloadable
    from kvreplay.families.sglang import release as adapter

    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "evil.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\nclass Pool: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(BuildUnloadable):
        adapter.spec_for("swa", "sglang.evil:Pool")
    assert not (tmp_path / "RAN").exists()


def test_a_build_that_is_not_a_class_is_bad_input(cli):
    _bad(cli("replay", str(PAGE0), "-b", "py:os:system", "--no-store"), "not an allocator class")


# 3 -- empty or unreadable content is bad input, never "clean" --------------------------
def _retyped(tmp_path: Path, column: str) -> Path:
    t = pq.read_table(PAGE0)
    i = t.schema.get_field_index(column)
    col = pa.array([str(x) for x in t.column(column).to_pylist()])
    return _write(t.set_column(i, pa.field(column, pa.string()), col).to_pylist(),
                  t.schema.set(i, pa.field(column, pa.string())), tmp_path / "t.parquet")


@pytest.mark.parametrize("damage, words", [
    ("depth-string", ["column depth"]),
    ("negative-seq", ["row numbers"]),
    ("no-rows", ["no call to replay"]),
    ("only-nested", ["the first row is a nested call"]),
])
def test_a_trace_with_nothing_replayable_is_bad_input_and_stores_nothing(damage, words, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    if damage == "depth-string":
        trace = _retyped(tmp_path, "depth")
    else:
        if damage == "negative-seq":
            for r in rows:
                r["seq"] = -1 - r["seq"]
        elif damage == "no-rows":
            rows = []
        else:
            rows = [r for r in rows if r["depth"] > 0]
        trace = _write(rows, schema, tmp_path / "t.parquet")
    db = tmp_path / "k.db"
    _bad(cli("replay", str(trace), "-b", "builtin:swa", "--db", str(db)), *words)
    assert not db.exists()


@pytest.mark.slow
def test_synth_stopped_by_a_signal_leaves_no_file_under_its_name(tmp_path):
    out = tmp_path / "big.parquet"
    child = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "synth", "disagg-mtp", "--requests",
                              "100000000", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(4)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=60)
    time.sleep(1.5)  # the writer process finishes what it was sent
    assert not out.exists()


# 4 -- bad values are one-line errors, not crashes --------------------------------------
def _first_free_arg(rows: list[dict]) -> dict:
    return next(a for r in rows if r["method"].startswith("free") and r["depth"] == 0 for a in r["args"]
                if a["kind"] == "tensor")


@pytest.mark.parametrize("damage", ["shape", "none", "str", "nan", "missing", "renamed"])
def test_bad_argument_values_are_bad_input(damage, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    arg = _first_free_arg(rows)
    if damage == "shape":
        arg["shape"] = [len(arg["data"]) + 3]
    elif damage == "none":
        arg.update(kind="none", data=None, shape=None)
    elif damage == "str":
        arg.update(kind="str", s="slots", data=None, shape=None)
    elif damage == "nan":
        arg.update(kind="float", f=float("nan"), data=None, shape=None)
    elif damage == "missing":
        for r in rows:
            if arg in r["args"]:
                r["args"].remove(arg)
    else:
        arg["name"] = "free_idx"
    trace = _write(rows, schema, tmp_path / "t.parquet")
    db = tmp_path / "k.db"
    res = cli("replay", str(trace), "-b", "builtin:swa", "--db", str(db))
    # the build itself may reject the call (a divergence: exit 1); what must not happen is a crash
    assert res.returncode in (1, 2) and "internal error" not in res.stderr, res.stderr
    if res.returncode == 2:
        _bad(res)
        assert not db.exists()


@pytest.mark.parametrize("key, value, words", [
    ("ctor_args", "[1, 2]", ["ctor_args must be a JSON object"]),
    ("ctor_args", json.dumps({"size": 2048, "size_swa": 512, "page_size": 4, "need_sort": "false"}), ["need_sort"]),
    ("ctor_args", json.dumps({"size": -4, "size_swa": 512, "page_size": 4}), ["size"]),
    ("extra", "3", ["extra must be a JSON object"]),
    ("source_version", "\"x\"", ["source_version"]),
    ("initial_state", "[]", ["initial_state"]),
    ("initial_state", json.dumps({"format": 1, "objects": {"full": {"free_pages": {
        "tensor": "int64", "shape": [2], "z": "bm90IHpsaWI="}}}}), ["snapshot is unreadable"]),
    ("initial_state", json.dumps({"format": 1, "objects": {"full": {"free_pages": {
        "tensor": "float99", "shape": [1], "z": "eJxjYAAAAAQAAQ=="}}}}), ["snapshot is unreadable"]),
    ("family", "tokn", ["pool family"]),
])
def test_damaged_metadata_is_bad_input(key, value, words, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    trace = _write(rows, schema, tmp_path / "t.parquet", {key: value})
    _bad(cli("replay", str(trace), "-b", "builtin:swa", "--no-store"), *words)
    _bad(cli("inspect", str(trace))) if key != "initial_state" else None


def test_a_gap_row_with_a_string_count_is_bad_input(tmp_path, cli):
    rows, schema = _rows(PAGE0)
    gap = {**rows[-1], "seq": rows[-1]["seq"] + 1, "parent": -1, "depth": 0, "target": "recorder", "method": "gap",
           "args": [{"name": "lost_calls", "kind": "str", "s": "many"}, {"name": "state", "kind": "str", "s": ""}],
           "result": {"kind": "none"}, "exc_type": None, "exc_msg": None}
    trace = _write([*rows, gap], schema, tmp_path / "t.parquet")
    _bad(cli("replay", str(trace), "-b", "builtin:swa", "--no-store", "--after-gap"), "gap row")


def test_a_flipped_footer_byte_and_a_flipped_data_page_are_bad_input(tmp_path, cli):
    fresh = tmp_path / "fresh.parquet"
    assert cli("synth", "disagg-mtp", "-n", "8", "-o", str(fresh)).returncode == 0
    data = bytearray(fresh.read_bytes())
    in_footer = len(data) - 1  # the closing magic: no Parquet footer can be found
    # the last byte of the largest column chunk: inside a data page's payload, which its checksum covers
    chunks = [pq.ParquetFile(fresh).metadata.row_group(0).column(i) for i in range(len(pq.read_schema(fresh)))]
    largest = max(chunks, key=lambda c: c.total_compressed_size)
    in_page = (largest.dictionary_page_offset or largest.data_page_offset) + largest.total_compressed_size - 1
    for where, flip in ((in_footer, 0x40), (in_page, 0x40)):
        damaged = bytearray(data)
        damaged[where] ^= flip
        path = tmp_path / f"flip-{where}.parquet"
        path.write_bytes(bytes(damaged))
        _bad(cli("replay", str(path), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")))
        assert not (tmp_path / "k.db").exists()


def test_footer_metadata_that_is_not_utf8_is_bad_input(tmp_path, cli):
    """A flipped bit in the footer's metadata once escaped as UnicodeDecodeError."""
    rows, schema = _rows(PAGE0)
    md = {**schema.metadata, b"kvreplay.fam\xc0ly": b"swa", b"kvreplay.family": b"\xffswa"}
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata(md)
    pq.write_table(table, tmp_path / "t.parquet")
    _bad(cli("replay", str(tmp_path / "t.parquet"), "-b", "builtin:swa", "--no-store"), "not a readable kvreplay trace")
    _bad(cli("inspect", str(tmp_path / "t.parquet")), "not a readable kvreplay trace")


def test_record_reports_a_command_it_cannot_run_and_an_out_it_cannot_create(tmp_path, cli):
    script = tmp_path / "not-executable.py"
    script.write_text("print('hi')\n")
    _bad(cli("record", "--out", str(tmp_path / "o"), "--", str(script)), "cannot run")
    (tmp_path / "file").write_text("")
    _bad(cli("record", "--out", str(tmp_path / "file" / "sub"), "--", "true"), "cannot create")
    for flag, value in (("--part-s", "-1"), ("--part-s", "inf"), ("--part-rows", "-5"), ("--keep-mb", "nan"),
                        ("--keep-parts", "-1")):
        _bad(cli("record", "--out", str(tmp_path / "o2"), flag, value, "--", "true"), "must be >= 0")
    assert not (tmp_path / "o2").exists()


def test_a_database_made_by_a_newer_kvreplay_is_refused(tmp_path, cli):
    import sqlite3

    db = tmp_path / "k.db"
    assert cli("replay", str(PAGE0), "-b", "builtin:swa", "--db", str(db)).returncode == 0
    with sqlite3.connect(db) as con:
        con.execute("update alembic_version set version_num = '0099'")
    _bad(cli("runs", "--db", str(db)), "made by a newer kvreplay")
    _bad(cli("replay", str(PAGE0), "-b", "builtin:swa", "--db", str(db)), "made by a newer kvreplay")


# 5 -- wild SWA frees are violations, not checker crashes --------------------------------
@pytest.mark.parametrize("slot", [4000, 2**62, -7])
def test_a_wild_swa_free_is_a_violation(slot, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    arg = _first_free_arg(rows)
    arg["data"] = [slot] * len(arg["data"])
    trace = _write(rows, schema, tmp_path / "t.parquet")
    res = cli("replay", str(trace), "-b", "builtin:swa", "--no-store", "--json")
    assert res.returncode in (1, 2) and "internal error" not in res.stderr, res.stderr
    if res.returncode == 1:
        assert json.loads(res.stdout)["status"] in ("violation", "divergence")


# 6 -- data is printed as text, never as markup -----------------------------------------
def test_markup_in_paths_and_hosts_is_printed_as_text(tmp_path, cli):
    rows, schema = _rows(PAGE0)
    (tmp_path / "a[").mkdir()
    trace = _write(rows, schema, tmp_path / "a[" / "bold]b.parquet", {"host": "[/]"})  # .../a[/bold]b.parquet
    db = str(tmp_path / "k.db")
    res = cli("replay", str(trace), "-b", "builtin:swa@unfiltered-page0", "--db", db)
    assert res.returncode == 1 and "a[/bold]b.parquet" in res.stdout, res.stderr
    shown = cli("show", "1", "--db", db)
    assert shown.returncode == 0 and "a[/bold]b.parquet" in shown.stdout
    seen = cli("inspect", str(trace))
    assert seen.returncode == 0 and "host [/]" in seen.stdout
    res = cli("replay", str(trace), "-b", "builtin:swa", "--device", "cuda:x", "--no-store")
    assert res.returncode == 2 and "cuda:x" in res.stderr


# 7 -- special files never hang ----------------------------------------------------------
def test_a_fifo_named_like_a_trace_is_refused_at_once(tmp_path, cli):
    fifo = tmp_path / "t.parquet"
    os.mkfifo(fifo)
    for argv in (["replay", str(fifo), "-b", "builtin:swa", "--no-store"], ["inspect", str(fifo)]):
        _bad(cli(*argv), "not a regular file")


def _corpus(tmp_path: Path) -> tuple[Path, dict]:
    doc = json.loads((CORPUS / "manifest.json").read_text())
    doc["traces"] = [e for e in doc["traces"] if e["name"] == "sglang-0.5.23-swa-page0"]
    (tmp_path / PAGE0.name).write_bytes(PAGE0.read_bytes())
    return tmp_path, doc


def test_ci_gives_up_on_a_case_past_its_timeout(tmp_path, cli, monkeypatch):
    root, doc = _corpus(tmp_path)
    (root / "manifest.json").write_text(json.dumps(doc))
    (tmp_path / "looping_pool.py").write_text(textwrap.dedent("""
        from kvreplay.families.sglang.swa import SWAPool

        class Pool(SWAPool):
            def alloc_extend(self, *args, **kwargs):
                while True:
                    pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.monotonic()
    res = cli("ci", str(root), "-b", "py:looping_pool:Pool", "--timeout", "2", "--db", str(root / "k.db"))
    assert res.returncode == 1 and "no result after 2 s" in res.stdout, res.stdout + res.stderr
    assert time.monotonic() - t0 < 60


def test_corpus_check_does_not_read_a_device(tmp_path, cli):
    root, doc = _corpus(tmp_path)
    (root / "zero.parquet").symlink_to("/dev/zero")
    doc["traces"][0]["file"] = "zero.parquet"
    (root / "manifest.json").write_text(json.dumps(doc))
    res = cli("corpus", "check", str(root))
    assert res.returncode == 1 and "not a regular file" in res.stdout


# 8 -- manifests are validated against one schema ----------------------------------------
@pytest.mark.parametrize("damage, words", [
    (lambda d: d["traces"][0]["expect"][0].update(mode=["strict"]), ["unknown key 'mode'"]),
    (lambda d: d["traces"][0]["expect"][0].update(capacity_asert_call=1), ["did you mean capacity_assert_call"]),
    (lambda d: d["traces"][0]["expect"][0].update(modes="strict"), ["modes"]),
    (lambda d: d["traces"].append(dict(d["traces"][0])), ["listed twice"]),
    (lambda d: d["traces"][0].update(file="../x.parquet"), ["file"]),
    (lambda d: d["traces"][0].update(file="/etc/passwd"), ["file"]),
    (lambda d: d["traces"].append("a string"), ["must be an object"]),
    (lambda d: d["traces"][0].update(name="a\nb"), ["name"]),
    (lambda d: d["traces"][0].update(name="n" * 300), ["name"]),
    (lambda d: d.update(version=1), ["version 1"]),
])
def test_a_manifest_that_breaks_its_schema_is_bad_input(damage, words, tmp_path, cli):
    root, doc = _corpus(tmp_path)
    damage(doc)
    (root / "manifest.json").write_text(json.dumps(doc))
    for argv in (["ci", str(root), "-b", "builtin:swa", "--db", str(root / "k.db")], ["corpus", "check", str(root)]):
        _bad(cli(*argv), *words)
    assert not (root / "k.db").exists()


def test_ci_verifies_the_hash_and_corpus_add_keeps_the_manifest_mode(tmp_path, cli):
    root, doc = _corpus(tmp_path)
    doc["traces"][0]["sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(doc))
    res = cli("ci", str(root), "-b", "builtin:swa", "--db", str(root / "k.db"))
    assert res.returncode == 1 and "sha256 differs" in res.stdout
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "manifest.json").write_text(json.dumps({"version": 2, "traces": []}))
    os.chmod(fresh / "manifest.json", 0o644)
    assert cli("corpus", "add", str(PAGE0), "--name", "p0", "--corpus", str(fresh)).returncode == 0
    assert oct((fresh / "manifest.json").stat().st_mode & 0o777) == oct(0o644)


# 9 -- bad input writes nothing --------------------------------------------------------------
def test_a_zero_length_file_creates_no_database(tmp_path, cli):
    (tmp_path / "empty.parquet").write_bytes(b"")
    db = tmp_path / "k.db"
    _bad(cli("replay", str(tmp_path / "empty.parquet"), "-b", "builtin:swa", "--db", str(db)))
    assert not db.exists()


# 10 -- the parts of a rotated trace must agree ------------------------------------------------
@pytest.mark.parametrize("meta, words", [({"family": "paged", "ctor_args": json.dumps({"size": 2048, "page_size": 4})},
                                          ["another pool"]),
                                         ({"schema_version": "99"}, ["newer"])])
def test_a_foreign_part_in_a_rotated_trace_is_refused(meta, words, tmp_path, cli):
    rows, schema = _rows(PAGE0)
    parts = tmp_path / "rotated"
    parts.mkdir()
    _write(rows[:200], schema, parts / "part-000000.parquet")
    _write(rows[200:], schema, parts / "part-000001.parquet", meta)
    _bad(cli("replay", str(parts), "-b", "builtin:swa", "--no-store"), *words)


# 11 -- one signal, one flight dump per allocator that has calls -------------------------
@pytest.mark.slow
def test_one_sigusr2_writes_one_dump(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent("""
        import time, torch
        from kvreplay.families.sglang.swa import SWAPool
        pool = SWAPool(2048, 512, 1, need_sort=False)
        print("ready", flush=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pool.free(pool.alloc(4))
            time.sleep(0.001)
    """))
    out = tmp_path / "dumps"
    child = subprocess.Popen([sys.executable, "-m", "kvreplay.cli.app", "record", "--flight", "5000", "--out",
                              str(out), "--class", "kvreplay.families.sglang.swa:SWAPool", "--", sys.executable,
                              str(prog)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        grandchildren = subprocess.run(["pgrep", "-f", str(prog)], capture_output=True, text=True).stdout.split()
        target = next(int(p) for p in grandchildren if int(p) != child.pid)
        os.kill(target, signal.SIGUSR2)
        time.sleep(2.0)
        dumps = sorted(out.glob("kvreplay-flight-*.parquet"))
        assert len(dumps) == 1, dumps
    finally:
        child.kill()
        child.wait(timeout=30)


# 12 -- and the smaller ones ------------------------------------------------------------------
def test_need_sort_as_a_string_and_a_negative_size_are_bad_input_not_untestable(tmp_path, cli):
    rows, schema = _rows(PAGE0)
    for args in ({"size": 2048, "size_swa": 512, "page_size": 4, "need_sort": "false"},
                 {"size": 2048, "size_swa": -1, "page_size": 4}):
        trace = _write(rows, schema, tmp_path / "t.parquet", {"ctor_args": json.dumps(args)})
        _bad(cli("replay", str(trace), "-b", "builtin:swa", "--no-store"))


# -- second round: memory bombs and damaged footers ----------------------------------------
CAP_BYTES = 3 << 30  # address space for a command under attack: torch's import fits, a bomb does not


def _capped(*argv: str) -> subprocess.CompletedProcess:
    """The CLI in a process whose memory is capped: a bomb that got through would fail
    it with MemoryError or a kill, not the one-line refusal."""
    import tempfile

    # A small launcher sets the cap, starts the command and reaps it (wait4) for its
    # peak resident memory. Started from this test process directly, the command's peak
    # would count this process's pages: Linux charges a forked or vforked child with the
    # parent's resident set until it execs.
    launch = ("import os, resource, sys; cap, report = int(sys.argv[1]), sys.argv[2]; "
              "resource.setrlimit(resource.RLIMIT_AS, (cap, cap)); "
              "pid = os.posix_spawn(sys.executable, [sys.executable, '-m', 'kvreplay.cli.app', *sys.argv[3:]], "
              "os.environ); _, status, usage = os.wait4(pid, 0); open(report, 'w').write(str(usage.ru_maxrss)); "
              "code = os.waitstatus_to_exitcode(status); sys.exit(code if code >= 0 else 128 - code)")
    with tempfile.TemporaryDirectory() as where, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        report = Path(where) / "maxrss"
        code = subprocess.run([sys.executable, "-c", launch, str(CAP_BYTES), str(report), *argv], stdout=out,
                              stderr=err, text=True).returncode
        out.seek(0)
        err.seek(0)
        res = subprocess.CompletedProcess(argv, code, out.read(), err.read())
        peak_kib = int(report.read_text())
    assert peak_kib < 1 << 20, f"peak RSS {peak_kib / 1024:.0f} MB"  # KiB on Linux: under 1 GiB
    return res


@pytest.fixture(scope="module")
def index_bomb(tmp_path_factory):
    """A small file whose one call lists 2 * 10^7 slots of a 2,048-slot pool."""
    rows, schema = _rows(PAGE0)
    arg = next(a for r in rows if r["depth"] == 0 for a in r["args"] if a["data"])
    arg["data"] = [1] * 20_000_000
    arg["shape"] = [20_000_000]
    path = tmp_path_factory.mktemp("bomb") / "bomb.parquet"
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, compression="zstd", use_dictionary=True)
    assert path.stat().st_size < 1 << 20
    return path


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
@pytest.mark.parametrize("command", ["inspect", "replay"])
def test_a_call_listing_more_slots_than_the_pool_has_is_refused_before_it_is_decoded(index_bomb, command, tmp_path):
    argv = [command, str(index_bomb)] + (["--build", "builtin:swa", "--db", str(tmp_path / "k.db")]
                                         if command == "replay" else [])
    _bad(_capped(*argv), "lists 20,00", "more than a pool of")
    assert not (tmp_path / "k.db").exists()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_snapshot_that_inflates_past_its_declared_shape_is_refused(tmp_path, cli):
    import base64
    import zlib

    rows, schema = _rows(PAGE0)
    bomb = base64.b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()  # 64 MB of zeros, 65 KB packed
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.trace import snapshot

    state = snapshot.take(SWAPool(2048, 512, 16))  # a real state, one tensor of it made a bomb
    state["objects"]["full"]["free_pages"] = {"tensor": "int64", "shape": [16], "z": bomb}
    trace = _write(rows, schema, tmp_path / "t.parquet", {"initial_state": json.dumps(state)})
    _bad(_capped("replay", str(trace), "--build", "builtin:swa", "--db", str(tmp_path / "k.db")),
         "not the size its shape declares")
    assert not (tmp_path / "k.db").exists()


@pytest.mark.parametrize("field", ["extra", "initial_state", "ctor_args"])
def test_json_nested_too_deep_in_a_footer_is_one_line(tmp_path, cli, field):
    rows, schema = _rows(PAGE0)
    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    trace = _write(rows, schema, tmp_path / "t.parquet", {field: deep})
    _bad(cli("inspect", str(trace)), "nests deeper than")


@pytest.mark.parametrize("version", ["-1", "0", " 1", "1.0", "9" * 5000])
def test_a_schema_version_that_is_not_a_version_number_is_refused(tmp_path, cli, version):
    rows, schema = _rows(PAGE0)
    trace = _write(rows, schema, tmp_path / "t.parquet", {"schema_version": version})
    _bad(cli("inspect", str(trace)), "schema version")


@pytest.mark.parametrize("text", ['{"version": ' + "7" * 5000 + ', "traces": []}',
                                  '{"version": 2, "traces": [' + "[" * 5000 + "]" * 5000 + "]}"],
                         ids=["long-integer", "deep-nesting"])
def test_a_manifest_integer_too_long_to_read_is_one_line(tmp_path, cli, text):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(text)
    res = cli("corpus", "check", str(corpus))
    _bad(res, "not a readable JSON manifest")


def test_ci_summary_and_junit_carry_hostile_trace_names_as_text(tmp_path, cli):
    import re
    import xml.etree.ElementTree as ET

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    name = 'x|y<a href="http:evil.example">z<b>[l](e)\x01\x1b.parquet'
    (corpus / name).write_bytes(PAGE0.read_bytes())
    md, junit = tmp_path / "s.md", tmp_path / "j.xml"
    res = cli("ci", str(corpus), "--build", "builtin:swa", "--db", str(tmp_path / "k.db"), "--summary", str(md),
              "--junit", str(junit))
    assert res.returncode in (0, 1), res.stderr
    root = ET.parse(junit).getroot()  # parses: no control character got in
    assert any("evil.example" in tc.get("name", "") for tc in root.iter("testcase"))
    text = md.read_text()
    row = next(line for line in text.splitlines() if "evil" in line)
    assert not re.search(r"(?<!\\)[<>\[\]()]", row.split("|", 3)[2]), row  # no markup left unescaped
    assert len(re.findall(r"(?<!\\)\|", row)) == 7, row  # the table's own bars, none from the name


def test_rows_deeper_than_a_sub_allocator_call_are_refused(tmp_path, cli):
    rows, schema = _rows(PAGE0)
    nested = next(i for i, r in enumerate(rows) if r["depth"] == 1)
    rows[nested]["depth"] = 7
    _bad(cli("replay", str(_write(rows, schema, tmp_path / "t.parquet")), "--build", "builtin:swa",
             "--db", str(tmp_path / "k.db")), "call depth outside 0..1")
    assert not (tmp_path / "k.db").exists()


def test_a_value_naming_an_element_type_kvreplay_does_not_write_is_refused(tmp_path, cli):
    rows, schema = _rows(PAGE0)
    arg = next(a for r in rows for a in r["args"] if a["kind"] == "tensor")
    arg["dtype"] = "os.system"
    _bad(cli("replay", str(_write(rows, schema, tmp_path / "t.parquet")), "--build", "builtin:swa",
             "--db", str(tmp_path / "k.db")), "element type 'os.system'")
    assert not (tmp_path / "k.db").exists()


def test_corpus_add_never_writes_what_the_manifest_schema_refuses(tmp_path, cli):
    # The footer's extra.command is the trace author's: a number there used to go into
    # the manifest, and every later corpus check and ci failed on it.
    rows, schema = _rows(PAGE0)
    trace = _write(rows, schema, tmp_path / "t.parquet", {"extra": json.dumps({"command": 12345})})
    corpus = tmp_path / "corpus"
    assert cli("corpus", "add", str(trace), "--name", "t", "--corpus", str(corpus)).returncode == 0
    res = cli("corpus", "check", str(corpus))
    assert res.returncode == 0, res.stderr
    assert json.loads((corpus / "manifest.json").read_text())["traces"][0]["command"].startswith("kvreplay corpus add")


def test_a_gap_row_whose_lost_call_count_is_text_is_one_line_in_inspect(tmp_path, cli):
    from kvreplay.trace.format import GapRecord

    rows, schema = _rows(PAGE0)
    gap = GapRecord(5, 9, 5, "queue full", "", 0).to_table().to_pylist()[0]
    for a in gap["args"]:
        if a["name"] == "lost_calls":
            a.update(kind="str", i=None, s="many")
    rows.insert(10, {**gap, "seq": rows[9]["seq"]})
    trace = _write(rows, schema, tmp_path / "t.parquet")
    _bad(cli("inspect", str(trace)), "gap row", "damaged")


@pytest.mark.parametrize("value", ["abc", 7, None, [1, 2], {"list": "x"}])
def test_a_snapshot_attribute_of_the_wrong_kind_is_one_line(tmp_path, cli, value):
    from kvreplay.families.sglang.swa import SWAPool
    from kvreplay.trace import snapshot

    rows, schema = _rows(PAGE0)
    state = snapshot.take(SWAPool(2048, 512, 16))
    state["objects"]["full"]["free_pages"] = value
    trace = _write(rows, schema, tmp_path / "t.parquet", {"initial_state": json.dumps(state)})
    res = cli("replay", str(trace), "--build", "builtin:swa", "--db", str(tmp_path / "k.db"))
    assert res.returncode in (1, 2), res.stderr  # refused, or replayed into a state the checker then flags
    assert res.stderr.count("\n") <= 1 and "internal error" not in res.stderr, res.stderr


def test_bit_flips_in_a_corpus_trace_are_refused_not_replayed(tmp_path, cli):
    # The corpus carries a checksum per data page: a flipped bit in index data is a
    # one-line refusal, never a plausible trace with other slots that replays to a finding.
    import random

    data = PAGE0.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little") + 8
    rng = random.Random(7)
    for i in range(40):  # without page checksums, 4 of these 40 replayed to a false finding (exit 1)
        damaged = bytearray(data)
        pos = rng.randrange(4, len(data) - footer)
        damaged[pos] ^= 1 << rng.randrange(8)
        trace = tmp_path / f"flip{i}.parquet"
        trace.write_bytes(bytes(damaged))
        res = cli("replay", str(trace), "--build", "builtin:swa", "--no-store")
        assert res.returncode in (0, 2), (pos, res.returncode, res.stdout[-300:])
        assert res.returncode == 2 or "clean" in res.stdout, (pos, res.stdout[-300:])


def test_a_batch_that_lost_call_columns_is_bad_input_not_a_crash(tmp_path, cli, monkeypatch):
    """Flipped bytes in a fuzzed radix-swa trace left a record batch without some of the
    columns the call check asked for: an IndexError (exit 134) instead of one line."""
    import pyarrow as pa

    from kvreplay.trace.reader import TraceReader

    real = TraceReader.iter_batches

    def short(self, columns=None, batch_size=8192):  # type: ignore[no-untyped-def]
        for batch in real(self, columns=columns, batch_size=batch_size):
            yield pa.RecordBatch.from_arrays(batch.columns[:-1], names=batch.schema.names[:-1]) if columns else batch

    monkeypatch.setattr(TraceReader, "iter_batches", short)
    _bad(cli("replay", str(PAGE0), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")), "call columns cannot be read")
    assert not (tmp_path / "k.db").exists()


HOSTILE = Path(__file__).resolve().parent / "hostile"


def test_a_footer_whose_size_statistics_abort_pyarrow_is_bad_input(tmp_path):
    """A bit flipped in a column chunk's level histogram (found by flipping each bit of a
    six-row trace's footer): pyarrow 26 aborts the process when it builds that chunk's
    metadata object, so the value-count check reads the footer itself."""
    trace = HOSTILE / "footer-histogram-abort.parquet"
    replay = ["replay", str(trace), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")]
    # a process of its own: an abort must fail this test, not end the test run
    _bad(subprocess.run([sys.executable, "-m", "kvreplay.cli.app", *replay], capture_output=True, text=True,
                        timeout=120), "histogram")
    assert not (tmp_path / "k.db").exists()


def _not_utf8(column: pa.Array, row: int) -> pa.Array:
    """``column`` (strings) with row ``row`` replaced by bytes that are not UTF-8,
    built from buffers so that nothing validates them on the way to the file."""
    values = [(v or "").encode() for v in column.to_pylist()]
    values[row] = b"fr\xf2e"
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    offset_bytes = pa.array(offsets, pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.string(), len(values), [None, offset_bytes, pa.py_buffer(b"".join(values))])


@pytest.mark.parametrize("column", ["method", "exc_msg", "target"])
def test_strings_that_are_not_utf8_are_bad_input(column, tmp_path, cli):
    """A flipped byte in a string page of a file written without page checksums escaped
    as UnicodeDecodeError (exit 134) from the first row turned into Python."""
    table = pq.read_table(PAGE0)
    i = table.schema.get_field_index(column)
    bad = _not_utf8(table.column(column).combine_chunks(), 3)
    table = table.set_column(i, table.schema.field(i), bad)
    pq.write_table(table, tmp_path / "t.parquet")
    _bad(cli("replay", str(tmp_path / "t.parquet"), "-b", "builtin:swa", "--db", str(tmp_path / "k.db")), "UTF8")
    assert not (tmp_path / "k.db").exists()


# Round 3: the vLLM family's sizes and values ---------------------------------------------
VLLM_LIVE = CORPUS / "live-vllm-0.32.0-prefix-mooncake300.parquet"


def _vllm_variant(tmp_path: Path, name: str, ctor: dict | None = None, edit=None) -> Path:
    rows, schema = _rows(VLLM_LIVE)
    rows = rows[:400]
    if edit is not None:
        edit(rows)
    md = None
    if ctor is not None:
        args = json.loads(schema.metadata[b"kvreplay.ctor_args"])
        md = {"ctor_args": json.dumps({**args, **ctor})}
    return _write(rows, schema, tmp_path / name, md)


@pytest.mark.slow_cases("134217728", "4194304")
@pytest.mark.parametrize("blocks", [1 << 22, 1 << 27])
def test_a_vllm_pool_too_big_to_build_is_refused_before_it_is_built(tmp_path, cli, blocks):
    trace = _vllm_variant(tmp_path, "big.parquet", ctor={"num_blocks": blocks})
    _bad(cli("replay", str(trace), "-b", "builtin:vllm", "--db", str(tmp_path / "k.db")), "num_blocks",
         "KVREPLAY_MAX_BLOCKS")
    assert not (tmp_path / "k.db").exists()


def _first_with(rows: list[dict], kind: str) -> dict:
    for r in rows:
        for a in r["args"]:
            if a["kind"] == kind:
                return a
    raise AssertionError(f"no {kind} argument")


@pytest.mark.slow
def test_a_huge_request_id_or_method_name_is_refused_not_copied(tmp_path, cli):
    def long_id(rows):
        _first_with(rows, "str")["s"] = "r" * (1 << 20)

    def long_method(rows):
        rows[5]["method"] = "m" * (1 << 20)

    for name, edit, said in (("id.parquet", long_id, "a recorded string of 1,048,576 bytes"),
                             ("method.parquet", long_method, "a method name of 1,048,576 bytes")):
        trace = _vllm_variant(tmp_path, name, edit=edit)
        _bad(cli("replay", str(trace), "-b", "builtin:vllm", "--db", str(tmp_path / "k.db")), said)
    assert not (tmp_path / "k.db").exists()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_an_id_list_whose_shape_disagrees_with_its_values_is_damage(tmp_path, cli):
    def lie(rows):
        _first_with(rows, "ints")["shape"] = [10 ** 8]

    trace = _vllm_variant(tmp_path, "shape.parquet", edit=lie)
    _bad(cli("replay", str(trace), "-b", "builtin:vllm", "--db", str(tmp_path / "k.db")),
         "id list of shape [100000000]")
    assert not (tmp_path / "k.db").exists()


def test_a_release_that_does_not_exist_is_bad_input_and_nothing_is_stored(tmp_path, cli, monkeypatch):
    # The index's answer, as kvreplay caches it for a day: no network needed here.
    cache = tmp_path / "cache"
    (cache / "releases").mkdir(parents=True)
    (cache / "releases" / "sglang-index.json").write_text(json.dumps(["0.5.12", "0.5.23"]))
    (cache / "releases" / "vllm-index.json").write_text(json.dumps(["0.31.0", "0.32.0"]))
    monkeypatch.setenv("KVREPLAY_CACHE", str(cache))
    db = tmp_path / "k.db"
    _bad(cli("replay", str(PAGE0), "-b", "sglang==0.5.999", "--db", str(db)),
         "sglang==0.5.999 is not a release on the package index (its latest: 0.5.23)")
    _bad(cli("ci", str(CORPUS), "--build", "vllm==0.99.0", "--db", f"sqlite:///{db}"), "vllm==0.99.0 is not a release")
    assert not db.exists()


@pytest.mark.parametrize("spec, said", [
    ("vllm==../../x", "not a release version"),
    ("git:" + "a" * 100_000 + "@HEAD", "a build spec of 100,009 characters"),
    ("git:/tmp/" + "a" * 300 + "@HEAD", "not a repository"),
])
def test_a_build_spec_that_names_nothing_is_one_line_before_any_case_runs(tmp_path, cli, spec, said):
    db = tmp_path / "k.db"
    res = cli("ci", str(CORPUS), "--build", spec, "--db", f"sqlite:///{db}")
    _bad(res, said)
    assert len(res.stderr) < 400 and not db.exists()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_a_snapshot_bigger_than_its_pool_is_refused_before_it_is_inflated(tmp_path, cli):
    """A zlib bomb of the right shape: 2^26 zeros (512 MB) in a few hundred KB, for a pool
    of a few hundred slots. Refused from its declared size, not after inflating it."""
    import base64
    import zlib

    rows, schema = _rows(PAGE0)
    z = base64.b64encode(zlib.compress(bytes(8 << 26), 9)).decode()
    state = {"format": 1, "objects": {"full": {"free_pages": {"tensor": "int64", "shape": [1 << 26], "z": z}}}}
    trace = _write(rows, schema, tmp_path / "bomb.parquet", {"initial_state": json.dumps(state)})
    t0 = time.monotonic()
    res = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "kvreplay.cli.app", "replay", str(trace),
                          "-b", "builtin:swa", "--db", str(tmp_path / "k.db")], capture_output=True, text=True,
                         timeout=120)
    peak_kb = int(res.stderr.strip().splitlines()[-1])
    err = "".join(f"{ln}\n" for ln in res.stderr.strip().splitlines()[:-1] if not ln.startswith("Command exited"))
    assert res.returncode == 2 and "snapshot" in err and err.count("\n") == 1, res.stderr[-500:]
    assert peak_kb < 600_000 and time.monotonic() - t0 < 60 and not (tmp_path / "k.db").exists()


@pytest.mark.slow  # (the fast tier holds the README's three minutes)
def test_profile_refuses_damage_and_traces_that_do_not_compare(tmp_path, cli):
    src = CORPUS / "decode-1000.parquet"
    rows, schema = _rows(src)

    def variant(name: str, edit) -> Path:
        changed = [dict(r) for r in rows]  # copies of what an edit changes
        for r in changed:
            r["args"] = [dict(a) for a in r["args"]]
        edit(changed)
        return _write(changed, schema, tmp_path / name)

    def first(rs, method):
        return next(r for r in rs if r["method"] == method)

    def text_lengths(rs):
        a = first(rs, "alloc_extend")["args"][0]
        a.update(kind="str", s="many", data=None, shape=None, dtype=None)

    def bool_lengths(rs):
        a = first(rs, "alloc_extend")["args"][2]
        a.update(kind="bool", i=1, data=None, shape=None, dtype=None)

    def unknown(rs):
        rs[3]["method"] = "frobnicate"

    for name, edit in (("text.parquet", text_lengths), ("bool.parquet", bool_lengths), ("unknown.parquet", unknown)):
        _bad(cli("profile", str(variant(name, edit))), name)
    _bad(cli("profile", str(src), "--against", str(VLLM_LIVE)), "do not compare")
    marked = tmp_path / "[bold]x[link=https:" / "evil]y.parquet"  # markup a terminal would act on
    marked.parent.mkdir()
    marked.write_bytes(src.read_bytes())
    res = cli("profile", str(marked))
    assert res.returncode == 0 and "[bold]x[link=https:/evil]y.parquet" in "".join(res.stdout.split())
    assert "\x1b]8;" not in res.stdout


@pytest.mark.parametrize("kind", ["dir", "fifo", "dangling"])
def test_a_manifest_that_is_not_a_file_is_bad_input_not_a_folder_of_traces(tmp_path, cli, kind):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / PAGE0.name).write_bytes(PAGE0.read_bytes())
    manifest = corpus / "manifest.json"
    if kind == "dir":
        manifest.mkdir()
    elif kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to(tmp_path / "gone.json")
    db = tmp_path / "k.db"
    _bad(cli("ci", str(corpus), "--build", "builtin:swa", "--db", f"sqlite:///{db}"), "not a manifest file")
    assert not db.exists()


@pytest.mark.slow_cases("sliding_window:", "sliding_window:-5", "sliding_window:0", "sliding_window", "full,,full",
                        "full;rm -rf", "sliding_window:abc")
@pytest.mark.parametrize("attention", ["sliding_window:abc", "sliding_window:-5", "sliding_window:", "sliding_window",
                                       "sliding_window:0", "full,,full", "full;rm -rf"])
def test_a_damaged_attention_spec_is_the_traces_fault_not_the_builds(tmp_path, cli, attention):
    trace = _vllm_variant(tmp_path, "att.parquet", ctor={"attention": attention})
    _bad(cli("replay", str(trace), "-b", "builtin:vllm", "--db", str(tmp_path / "k.db")), "attention")
    assert not (tmp_path / "k.db").exists()


@pytest.mark.slow_cases("0-get_new_blocks-trace3-builtin:swa", "50-free_group_begin-trace1-builtin:vllm",
                        "0-alloc_extend-trace0-builtin:vllm")
@pytest.mark.parametrize("row, method, trace, build", [
    (0, "alloc_extend", VLLM_LIVE, "builtin:vllm"), (50, "free_group_begin", VLLM_LIVE, "builtin:vllm"),
    (3, "allocate_slots", PAGE0, "builtin:swa"), (0, "get_new_blocks", PAGE0, "builtin:swa")])
def test_rows_of_the_other_engines_methods_are_damage(tmp_path, cli, row, method, trace, build):
    rows, schema = _rows(trace)
    rows[row] = {**rows[row], "method": method, "args": []}
    bad = _write(rows, schema, tmp_path / "mixed.parquet")
    _bad(cli("replay", str(bad), "-b", build, "--db", str(tmp_path / "k.db")), "another engine's pools")
    assert not (tmp_path / "k.db").exists()


def test_a_database_url_without_its_driver_says_what_to_install_or_type(tmp_path, cli):
    _bad(cli("show", "1", "--db", "postgres://u@localhost/kv"), "write postgresql://")
    _bad(cli("show", "1", "--db", "postgresql+pg8000://u@localhost/kv"), "pip install pg8000")


def test_tiny_model_without_transformers_is_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here")
    script = Path(__file__).resolve().parents[1] / "scripts" / "tiny_model.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "m")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1 and "needs transformers" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1


def test_a_recorded_prefix_hit_on_a_block_never_handed_out_is_no_remap_clean(tmp_path):
    """Remap issues the build's own lookups, so a recording whose pool answered a prefix
    hit with a block it never handed out (never filled, so never cached) passed clean:
    now the hit itself is the divergence, in remap as in strict mode."""
    from kvreplay.replay.dispatch import replay
    from kvreplay.workload.synth import SynthConfig, synthesize

    good = tmp_path / "good.parquet"
    synthesize(SynthConfig(scenario="vllm-prefix", out=good, requests=120))
    table = pq.read_table(good)
    rows = table.to_pylist()
    handed = {b for r in rows if r["method"] == "get_new_blocks" for b in r["result"]["data"]}
    never = next(b for b in range(1, 10**6) if b not in handed)
    (at, row) = next((i, r) for i, r in enumerate(rows) if r["method"] == "get_computed_blocks"
                     and r["result"]["data"][0] > 0)
    data = row["result"]["data"]
    data[-1] = never  # the hit's last block: one the pool never gave anyone
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), bad)
    number = sum(1 for r in rows[:at + 1] if r["depth"] == 0)
    assert replay(good, "builtin:vllm", mode="remap", device="cpu").status == "clean"
    for mode in ("remap", "strict"):
        got = replay(bad, "builtin:vllm", mode=mode, device="cpu")
        first = got.first_divergence
        assert got.status == "divergence" and first.call == number and first.method == "get_computed_blocks", mode
    assert "never handed out" in replay(bad, "builtin:vllm", mode="remap", device="cpu").first_divergence.message
