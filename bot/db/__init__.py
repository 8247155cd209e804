"""The store's two backends behind one interface (``bot.db.store.Store``): SQLite under
``DEJAFIX_DATA_DIR`` by default, PostgreSQL when ``DATABASE_URL`` or ``DEJAFIX_DATABASE_URL`` is
set."""

from __future__ import annotations

from pathlib import Path

from bot.db.store import Store


def open_store(data_dir: Path, database_url: str | None, *, max_attempts: int = 5) -> Store:
    """The store the settings name. Blocking (it connects and migrates): call it in a thread
    from async code."""
    if database_url:
        from bot.db.postgres import PostgresStore

        return PostgresStore(database_url, max_attempts=max_attempts)
    from bot.db.sqlite import SQLiteStore

    return SQLiteStore(data_dir, max_attempts=max_attempts)
