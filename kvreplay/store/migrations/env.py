"""Alembic environment: kvreplay runs migrations itself (store.db.open_store), on
the connection it already holds, so this only wires that connection in."""

from __future__ import annotations

from alembic import context

from kvreplay.store.models import Base

connection = context.config.attributes.get("connection")
if connection is None:  # `alembic` command line: build an engine from the URL
    from sqlalchemy import create_engine

    connection = create_engine(context.config.get_main_option("sqlalchemy.url")).connect()

context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
