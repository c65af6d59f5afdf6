"""Real servers for the tests that need one, started by the tests themselves when
.ci/run has not started them already: PostgreSQL (scripts/postgres.sh; .ci/run
exports KVREPLAY_TEST_PG) and an S3-compatible object store (moto's server mode;
.ci/run exports KVREPLAY_TEST_S3). With KVREPLAY_REQUIRE_SERVICES=1 (.ci/run) a
server that cannot be had fails the test instead of skipping it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def unavailable(why: str) -> None:
    if os.environ.get("KVREPLAY_REQUIRE_SERVICES") == "1":
        pytest.fail(why)
    pytest.skip(why)


@contextmanager
def postgres(tmp: Path) -> Iterator[str]:
    """The URL of a PostgreSQL server's admin database (its own, or .ci/run's)."""
    given = os.environ.get("KVREPLAY_TEST_PG")
    if given:
        yield given
        return
    if not (shutil.which("initdb") or list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))):
        unavailable("PostgreSQL is not installed (no initdb)")
    # A short path: a Unix socket's name has a length limit.
    where = Path(f"/tmp/kvpg-{uuid.uuid4().hex[:8]}")
    script = ROOT / "scripts" / "postgres.sh"
    try:
        out = subprocess.run(["bash", str(script), "start", str(where)], capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            unavailable(f"PostgreSQL did not start: {out.stderr.strip()[:300]}")
        yield out.stdout.strip().split("=", 1)[1].strip("'")
    finally:
        subprocess.run(["bash", str(script), "stop", str(where)], capture_output=True, timeout=60)
        shutil.rmtree(where, ignore_errors=True)


def fresh_database(admin_url: str) -> str:
    """A new, empty database on the server; its URL."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"kv_{uuid.uuid4().hex[:12]}"
    eng = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    eng.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """The endpoint URL of an S3-compatible server (moto's server mode, or .ci/run's)."""
    given = os.environ.get("KVREPLAY_TEST_S3")
    if given:
        yield given
        return
    try:
        import moto.server  # noqa: F401
    except ImportError:
        unavailable("moto (with flask) is not installed (pip install -e '.[s3test]')")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    unavailable("the local S3 server (moto) did not start")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_available() -> str:
    """Chromium's path, once Playwright is known to be there; skips (or fails) if not."""
    exe = chromium_path()
    if exe is None:
        unavailable("no Chromium on this machine (Debian's chromium package; .ci/run installs it)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        unavailable("Playwright is not installed (pip install -e '.[browser]'; .ci/run installs it)")
    return exe


@contextmanager
def browser() -> Iterator[object]:
    """Headless Chromium (the system's, driven by Playwright); .ci/run installs both."""
    exe = browser_available()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def screenshot_dir(tmp: Path) -> Path:
    """Where page screenshots go: .ci/run keeps them as artefacts (KVREPLAY_SCREENSHOTS)."""
    d = Path(os.environ.get("KVREPLAY_SCREENSHOTS") or tmp)
    d.mkdir(parents=True, exist_ok=True)
    return d



def pids(where: str, *parts: bytes, under: int | None = None) -> list[int]:
    """Processes whose /proc/PID/<where> file (cmdline, environ, comm) holds every one
    of ``parts``; processes that end while being read are passed over. ``under``: only
    descendants of that process (another server on the machine, the soak's beside the
    live tier, has processes of the same names)."""
    from pathlib import Path

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                text = Path(f"/proc/{d}/{where}").read_bytes()
            except OSError:
                continue
            if all(p in text for p in parts) and (under is None or _descends(int(d), under)):
                out.append(int(d))
    return out


def _descends(pid: int, ancestor: int) -> bool:
    for _ in range(64):
        if pid == ancestor:
            return True
        try:
            stat = open(f"/proc/{pid}/stat").read()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])  # the field after the state: the parent
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def run_page_block(block: str, tmp: Path, work: Path, port_written: str, timeout: float) -> dict[str, tuple[int, str]]:
    """A docs page's shell block run line by line in one shell, as a reader runs it, in
    ``work`` (with the repository's scripts/ and workloads/ linked in): ``/tmp/`` becomes
    ``tmp``, the written port a free one, a line ending in ``&`` runs in the background.
    Returns each line's (exit status, the end of what it printed)."""
    import signal

    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", "").splitlines() if line.strip()]
    for shared in ("scripts", "workloads"):
        if not (work / shared).exists():
            (work / shared).symlink_to(ROOT / shared)
    port = str(free_port())
    body = ["set -u"]
    for i, line in enumerate(lines):
        line = line.replace("/tmp/", f"{tmp}/").replace(port_written, port)
        if line.endswith("&"):
            body.append(f"{line[:-1]} > {tmp}/step{i}.out 2>&1 &")
            body.append(f"echo 0 > {tmp}/step{i}.rc")
        else:
            body.append(f"{line} > {tmp}/step{i}.out 2>&1; echo \"$?\" > {tmp}/step{i}.rc")
    (tmp / "block.sh").write_text("\n".join(body) + "\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "KVREPLAY_DB": str(tmp / "k.db")}
    proc = subprocess.Popen(["bash", str(tmp / "block.sh")], cwd=work, env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = {}
    for i, line in enumerate(lines):
        rc = tmp / f"step{i}.rc"
        said = tmp / f"step{i}.out"
        out[line] = (int(rc.read_text()) if rc.exists() else -1,
                     said.read_text(errors="replace")[-1500:] if said.exists() else "")
    return out


class RecordedServer:
    """``kvreplay record --out DIR -- SERVER...`` in its own process group, up once its
    ``/health`` answers; ``stop(sig)`` signals kvreplay record as a terminal would, and
    ``kill`` takes the whole group down. The live tiers' sglang and vLLM servers are
    this with their own command line (``server(port)``) and load."""

    def __init__(self, out: Path, server: Callable[[int], list[str]], *, start_s: float, name: str = "server",
                 env: dict[str, str] | None = None, record_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.out = out
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out.parent / f"{name}-{self.port}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - kept for the test's life
        cmd = [sys.executable, "-m", "kvreplay.cli.app", "record", "--out", str(out), *record_args, "--",
               *server(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} while starting: {self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
            except OSError:
                time.sleep(1)
                continue
            if b"No module named 'kvreplay'" in self.log_path.read_bytes():
                # the engine's environment has no kvreplay (an editable install of a checkout
                # since removed): nothing is recorded, and every check after would say only that
                self.kill()
                pytest.fail(f"kvreplay is not importable in the server's environment ({sys.executable}): "
                            "install this checkout there (pip install -e .)")
            return
        self.kill()
        pytest.fail(f"server not up within {start_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-3000:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 180) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"kvreplay record did not end {timeout:.0f} s after signal {sig}: {self.tail()}")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def finished_traces(out: Path) -> list[Path]:
    """The traces a recording left in ``out``, none of them unfinished."""
    assert not list(out.glob("*.tmp")) and not list(out.glob("*/*.tmp")), "a trace was left unfinished"
    return sorted(out.glob("kvreplay-*.parquet"))


# The project's way to load a bug into a real server: a sitecustomize of the user's, which
# kvreplay record's own start-up runs after itself. The finder below lets MODULE import as
# it is, then runs the patch with ``module`` bound to it, before anything else sees it.
_ON_IMPORT = '''
import importlib.abc, importlib.util, os, sys

class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {module!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, s):
                return inner.create_module(s)

            def exec_module(self, module):
                inner.exec_module(module)
                _patch(module)
        spec.loader = Loader()
        return spec

sys.meta_path.insert(0, _Patch())
'''


def sitecustomize_patching(module: str, patch: str) -> str:
    """A sitecustomize that, when ``module`` is imported, calls ``patch``'s ``_patch(module)``."""
    return patch + _ON_IMPORT.format(module=module)
