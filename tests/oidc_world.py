"""What the sign-in tests share: a real OIDC provider's people and their groups, the role map
that gives the groups kvwatch roles, a collector that trusts the provider, and an incident to
look at (globex's request read acme's KV pages)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from tests import factories as f
from tests.conftest import Collector, make_token
from tests.oidc_provider import OidcProvider

CLIENT_ID, CLIENT_SECRET = "kvwatch-dashboard", "dashboard-secret"
ACME, GLOBEX = "acme", "globex"

# login -> who they are at the provider; their groups are what the role map reads
USERS: dict[str, dict[str, Any]] = {
    "ada": {"email": "ada@operator.test", "name": "Ada Admin", "groups": ["kvwatch-admins"]},
    "olive": {"email": "olive@operator.test", "name": "Olive Oncall", "groups": ["oncall"]},
    "audrey": {"email": "audrey@operator.test", "name": "Audrey Audit", "groups": ["dpo"]},
    "tess": {"email": "tess@acme.test", "name": "Tess Acme", "groups": ["acme-security"]},
    "nemo": {"email": "nemo@operator.test", "name": "Nemo", "groups": ["marketing"]},
}

ROLE_MAP = """\
# which of the identity provider's groups is which kvwatch role
roles:
  kvwatch-admins: admin
  oncall: operator
  dpo: auditor
  acme-security: tenant:acme
"""


def provider(
    tmp: Path, *, redirect_uris: list[str] | None = None, id_token_ttl_s: int = 600
) -> OidcProvider:
    return OidcProvider(
        users=USERS,
        clients=[
            {
                "client_id": CLIENT_ID,
                "client_secret": CLIENT_SECRET,
                "redirect_uris": redirect_uris or ["http://127.0.0.1:9/oauth2callback"],
                # Streamlit's st.logout sends people back to the redirect URI
                "post_logout_redirect_uris": redirect_uris or [],
            }
        ],
        id_token_ttl_s=id_token_ttl_s,
        workdir=tmp / "oidc",
    )


def role_map(tmp: Path) -> Path:
    path = tmp / "roles.yaml"
    path.write_text(ROLE_MAP, encoding="utf-8")
    return path


@contextmanager
def collector(db_url: str, op: OidcProvider, tmp: Path, **settings: Any) -> Iterator[Collector]:
    """The real collector app on 127.0.0.1, trusting ``op``'s people."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread

    migrate.upgrade(db_url)
    s = Settings(
        database_url=db_url,
        auto_migrate=False,
        rollup_interval_s=0.2,
        dpo_contact="Data protection officer, dpo@operator.test",
        oidc_issuer=op.issuer,
        oidc_client_id=CLIENT_ID,
        oidc_role_map=role_map(tmp),
        **settings,
    )
    with serve_in_thread(create_app(s)) as url:
        yield Collector(url, db_url, make_token(db_url, "admin"), make_token(db_url, "ingest"))


def seed_incident(c: Collector) -> dict[str, Any]:
    """A cross-tenant stale read (globex's request read acme's pages): a critical alert and
    the incident it opens. Returns the alert."""
    now = datetime.now(UTC) - timedelta(seconds=5)
    at = {"ts": now}
    traffic = [
        f.admitted(1, "r-acme-0", tenant=ACME, prompt=6000, **at),
        f.finished(2, "r-acme-0", tenant=ACME, **at),
        f.admitted(3, "r-globex-0", tenant=GLOBEX, prompt=4000, **at),
        f.stale_read(
            4,
            reader_request_id="r-globex-0",
            reader_tenant=GLOBEX,
            previous_request_id="r-acme-0",
            previous_tenant=ACME,
            **at,
        ),
        f.finished(5, "r-globex-0", tenant=GLOBEX, **at),
    ]
    with httpx.Client(base_url=c.url, timeout=30) as h:
        r = h.post(
            "/v1/events",
            json=[f.as_json(e) for e in traffic],
            headers={"Authorization": f"Bearer {c.ingest}"},
        )
        assert r.status_code == 200, r.text
        r = h.get(
            "/v1/alerts",
            params={"rule": "stale_page_read"},
            headers={"Authorization": f"Bearer {c.admin}"},
        )
        assert r.status_code == 200 and r.json(), r.text
        return dict(r.json()[0])


def audit_rows(db_url: str) -> list[dict[str, Any]]:
    """The audit log, oldest first: actor, action, subject and detail of each entry."""
    import json

    from sqlalchemy import select

    from collector import models as m
    from collector.db import Database

    db = Database(db_url)
    try:
        with db.read() as conn:
            a = m.AuditEntry
            rows = conn.execute(select(a.actor, a.action, a.subject, a.detail).order_by(a.id))
            return [
                {
                    "actor": r.actor,
                    "action": r.action,
                    "subject": r.subject,
                    "detail": json.loads(r.detail) if isinstance(r.detail, str) else r.detail,
                }
                for r in rows
            ]
    finally:
        db.dispose()
