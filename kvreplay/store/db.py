"""Where results are stored and how to open it.

Default: a SQLite file at ``$XDG_DATA_HOME/kvreplay/kvreplay.db`` (usually
``~/.local/share/kvreplay/kvreplay.db``); ``KVREPLAY_DB`` or ``--db`` take any
SQLAlchemy URL or a plain file path. Opening a store brings its schema to the
newest Alembic revision. SQLite runs in WAL mode with a busy timeout and takes
the write lock when a transaction begins, so several replays writing at once
queue instead of failing."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kvreplay.errors import BadInput

ENV_VAR = "KVREPLAY_DB"
MIGRATIONS = Path(__file__).with_name("migrations")


def default_db_path() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "kvreplay" / "kvreplay.db"


def resolve_url(db: str | None = None, *, create_dirs: bool = True) -> str:
    """``--db`` wins over ``KVREPLAY_DB``, which wins over the default file."""
    value = db or os.environ.get(ENV_VAR) or str(default_db_path())
    if "://" in value:
        return value
    path = Path(value).expanduser()
    if path.is_dir():
        raise BadInput(f"database {path} is a directory; give a file path or a SQLAlchemy URL")
    if path == default_db_path():
        if create_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.parent.exists():
            return f"sqlite:///{path}"
    return f"sqlite:///{path}"


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # let the "begin" hook below issue BEGIN
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout = 60000")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Take the write lock up front: two writers never deadlock upgrading a read lock.
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass
class Store:
    url: str
    engine: Engine
    sessions: sessionmaker[Session]

    def session(self) -> Session:
        return self.sessions()

    def close(self) -> None:
        self.engine.dispose()


def safe_url(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def check_store(db: str | None = None) -> None:
    """Fail now (BadInput) on a database that ``open_store`` would refuse, without
    creating or changing anything: commands check it before long work and open it
    only when there is a result to write."""
    url = resolve_url(db, create_dirs=False)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            # the default file's directory is made when there is a result to write (resolve_url)
            if not path.parent.is_dir() and path != default_db_path():
                raise BadInput(f"cannot open database {path}: no directory {path.parent} to create it in")
            return
        if not path.is_file():
            raise BadInput(f"database {path} is not a regular file")
    open_store(db, migrate=False).close()


def _refuse_newer(engine: Engine, url: str) -> None:
    """A database whose schema revision this kvreplay does not know was made by a newer one."""
    from alembic.script import ScriptDirectory

    try:
        with engine.connect() as conn:
            if "alembic_version" not in inspect(conn).get_table_names():
                return
            rev = conn.exec_driver_sql("select version_num from alembic_version").scalar()
    except SQLAlchemyError:
        return  # not readable as ours: the upgrade below reports it
    known = {r.revision for r in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if rev is not None and rev not in known:
        raise BadInput(f"database {safe_url(url)} was made by a newer kvreplay (schema revision {rev}); "
                       "upgrade kvreplay to use it")


def _driver_hint(url: str, exc: BaseException) -> str:
    """What to install or type when SQLAlchemy cannot load the URL's driver."""
    scheme = url.split("://", 1)[0].lower()
    if scheme == "postgres":  # SQLAlchemy's name for it is postgresql
        return "; write postgresql:// (with pip install 'psycopg[binary]'), not postgres://"
    if scheme.startswith("postgresql") and isinstance(exc, ImportError):
        driver = scheme.partition("+")[2] or "psycopg2"
        package = {"psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary"}.get(driver, driver)
        return f"; PostgreSQL needs a driver here: pip install {package} (or postgresql+psycopg:// with psycopg)"
    return ""


def open_store(db: str | None = None, *, migrate: bool = True, existing: bool = False) -> Store:
    """Open (creating or migrating as needed) the store; BadInput if it cannot be.
    ``existing``: a command that only reads (show, runs, report, serve) opens a SQLite
    file only if it is there, so a mistyped --db is an error, not a new empty store."""
    url = resolve_url(db, create_dirs=not existing)
    if existing and url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url.removeprefix("sqlite:///"))
        if not path.is_file():
            raise BadInput(f"no database at {path}: nothing has been stored there (check --db or $KVREPLAY_DB)")
    try:
        engine = create_engine(url)
    except (SQLAlchemyError, ValueError, ImportError) as exc:
        raise BadInput(f"cannot open database {safe_url(url)}: {exc}{_driver_hint(url, exc)}") from None
    if engine.dialect.name == "sqlite":
        _sqlite_pragmas(engine)
    try:
        _refuse_newer(engine, url)
        if migrate:
            upgrade(engine)
        else:
            with engine.connect():
                pass
    except BadInput:
        engine.dispose()
        raise
    except SQLAlchemyError as exc:
        engine.dispose()
        first = str(exc.orig if getattr(exc, "orig", None) else exc).splitlines()[0]
        raise BadInput(f"cannot open database {safe_url(url)}: {first}") from None
    return Store(url, engine, sessionmaker(engine, expire_on_commit=False))


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def tables(engine: Engine) -> list[str]:
    return sorted(inspect(engine).get_table_names())
