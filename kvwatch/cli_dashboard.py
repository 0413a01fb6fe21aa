"""``kvwatch dashboard``: the Streamlit dashboard (``dashboard/app.py``) in its own process.

It talks to the collector over HTTP only, so it needs the collector's address and a read or
admin token; both travel to the Streamlit process as ``KVWATCH_*`` environment variables.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvwatch.cli_common import err

if TYPE_CHECKING:
    from dashboard.settings import DashboardSettings


def _entry_script() -> Path:
    spec = find_spec("dashboard")
    if spec is None or spec.origin is None:
        err.print("[red]error:[/] the dashboard package is not installed")
        raise typer.Exit(2)
    return Path(spec.origin).parent / "app.py"


def _settings(overrides: dict[str, Any]) -> DashboardSettings:
    """The dashboard's settings from the environment with the options on top; a bad one is
    named by its environment variable and exits 2 (values are not echoed: one is a token)."""
    from pydantic import ValidationError

    from dashboard.settings import DashboardSettings

    try:
        return DashboardSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for e in exc.errors():
            msg = str(e["msg"]).removeprefix("Value error, ")
            if not e["loc"]:  # a rule across settings: its message names them
                err.print(f"[red]error:[/] {msg}")
                continue
            err.print(f"[red]error:[/] KVWATCH_{str(e['loc'][0]).upper()}: {msg}")
        raise typer.Exit(2) from None


def dashboard(
    host: Annotated[
        str | None, typer.Option(help="Bind address [KVWATCH_DASHBOARD_HOST; 127.0.0.1].")
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(min=1, max=65535, help="Port [KVWATCH_DASHBOARD_PORT; 8501]."),
    ] = None,
    collector_url: Annotated[
        str | None,
        typer.Option(
            help="The collector's root URL [KVWATCH_COLLECTOR_URL; http://127.0.0.1:8700]."
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="A read or admin token [KVWATCH_DASHBOARD_TOKEN]; prefer the variable: "
            "options show in the process list. A tenant-scoped read token shows one tenant.",
            show_default=False,
        ),
    ] = None,
    refresh_s: Annotated[
        float | None,
        typer.Option(
            min=0, help="Auto-refresh period, seconds; 0 = off [KVWATCH_DASHBOARD_REFRESH_S; 30]."
        ),
    ] = None,
) -> None:
    """Run the dashboard (Streamlit) against a collector's HTTP API."""
    settings = _settings(
        {
            "collector_url": collector_url,
            "dashboard_token": token,
            "dashboard_refresh_s": refresh_s,
            "dashboard_host": host,
            "dashboard_port": port,
        }
    )
    host, port = settings.dashboard_host, settings.dashboard_port
    env = dict(os.environ)
    env["KVWATCH_COLLECTOR_URL"] = settings.collector_url
    env["KVWATCH_DASHBOARD_REFRESH_S"] = f"{settings.dashboard_refresh_s:g}"
    secrets_dir: str | None = None
    extra: list[str] = []
    if settings.oidc:
        secrets_dir = tempfile.mkdtemp(prefix="kvwatch-dashboard-")  # 0700: it holds secrets
        extra = [f"--secrets.files={write_auth_secrets(settings, Path(secrets_dir))}"]
        err.print(
            f"people sign in at {settings.oidc_issuer} (return address {settings.redirect_uri})"
        )
    elif settings.token is not None:
        env["KVWATCH_DASHBOARD_TOKEN"] = settings.token
    else:
        err.print(
            "[yellow]warning:[/] KVWATCH_DASHBOARD_TOKEN is not set: each visitor is asked "
            "for a token"
        )
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(_entry_script()),
        "--server.headless=true",
        f"--server.address={host}",
        f"--server.port={port}",
        "--browser.gatherUsageStats=false",
        "--server.fileWatcherType=none",
        "--server.runOnSave=false",
        "--client.toolbarMode=viewer",
        "--global.developmentMode=false",
        *extra,
    ]
    err.print(f"kvwatch dashboard on http://{host}:{port} reading {settings.collector_url}")
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Stopping `kvwatch dashboard` must stop Streamlit too, not orphan it.
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        rc = proc.wait()
    finally:
        if secrets_dir is not None:
            shutil.rmtree(secrets_dir, ignore_errors=True)
    raise typer.Exit(rc if rc >= 0 else 128 - rc)


def write_auth_secrets(settings: DashboardSettings, into: Path) -> Path:
    """Streamlit's ``[auth]`` section (st.login reads only its secrets) from the
    ``KVWATCH_OIDC_*`` settings, in a file only this user can read. The ID token is exposed
    to the app (``expose_tokens``): the dashboard forwards it to the collector, which verifies
    it (collector/oidc.py)."""
    cookie = (
        settings.oidc_cookie_secret.get_secret_value()
        if settings.oidc_cookie_secret is not None
        else secrets.token_urlsafe(32)
    )
    client_secret = (
        settings.oidc_client_secret.get_secret_value()
        if settings.oidc_client_secret is not None
        else ""
    )
    assert settings.oidc_issuer is not None
    metadata = settings.oidc_issuer.rstrip("/") + "/.well-known/openid-configuration"
    kwargs = {"scope": settings.oidc_scopes}
    if settings.oidc_prompt.strip() and settings.oidc_prompt.strip() != "none":
        kwargs["prompt"] = settings.oidc_prompt.strip()

    def q(text: str) -> str:  # a TOML basic string takes JSON's escapes, but no surrogates
        return json.dumps(text, ensure_ascii=False)

    lines = [
        "[auth]",
        f"redirect_uri = {q(settings.redirect_uri)}",
        f"cookie_secret = {q(cookie)}",
        f"client_id = {q(settings.oidc_client_id or '')}",
        f"client_secret = {q(client_secret)}",
        f"server_metadata_url = {q(metadata)}",
        'expose_tokens = ["id"]',
        "",
        "[auth.client_kwargs]",
        *(f"{k} = {q(v)}" for k, v in kwargs.items()),
    ]
    path = into / "secrets.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
