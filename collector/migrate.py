"""Run Alembic migrations (``migrations/``) against a database URL."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config


def _script_location() -> str:
    spec = importlib.util.find_spec("migrations")
    if spec is None or spec.origin is None:
        raise RuntimeError("the kvwatch 'migrations' package is not installed")
    return str(Path(spec.origin).parent)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    # Escape % for ConfigParser interpolation (URL-encoded passwords contain %).
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["kvwatch_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def current_heads(url: str) -> set[str]:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        eng.dispose()
