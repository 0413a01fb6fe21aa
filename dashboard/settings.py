"""The dashboard's settings: where the collector is, the token it reads with, how often pages
refresh. ``kvwatch dashboard`` passes its options through these environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# `kvwatch serve`'s default address: the two commands work together out of the box.
_DEFAULT_URL = "http://127.0.0.1:8700"


class DashboardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVWATCH_", extra="ignore", frozen=True)

    collector_url: str = Field(
        default=_DEFAULT_URL,
        description="Root URL of the collector's HTTP API [KVWATCH_COLLECTOR_URL].",
    )
    dashboard_token: SecretStr | None = Field(
        default=None,
        description="A read or admin token [KVWATCH_DASHBOARD_TOKEN]; a tenant-scoped read "
        "token shows only its tenant.",
    )
    dashboard_refresh_s: float = Field(
        default=30.0, ge=0, le=86_400, description="Auto-refresh period in seconds; 0 = off."
    )
    dashboard_host: str = Field(
        default="127.0.0.1", description="Address `kvwatch dashboard` binds."
    )
    dashboard_port: int = Field(
        default=8501, ge=1, le=65535, description="Port `kvwatch dashboard` binds."
    )

    @field_validator("dashboard_token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # An exported-but-empty variable means "not set", as for the producers' settings.
        if isinstance(value, str):
            return value.strip() or None
        return value

    @field_validator("collector_url", mode="before")
    @classmethod
    def _http_url(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        value = value.strip().rstrip("/") or _DEFAULT_URL
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @property
    def token(self) -> str | None:
        return None if self.dashboard_token is None else self.dashboard_token.get_secret_value()
