"""The dashboard's settings: where the collector is, the token it reads with, how often pages
refresh. ``kvwatch dashboard`` passes its options through these environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator, model_validator
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

    oidc_issuer: str | None = Field(
        default=None,
        description="OpenID Connect issuer people sign in at; set, "
        "the dashboard asks each visitor to sign in (st.login) instead of for a token, and "
        "forwards the person's ID token to the collector (docs/sign-in.md).",
    )
    oidc_client_id: str | None = Field(
        default=None, description="The dashboard's client id at the issuer."
    )
    oidc_client_secret: SecretStr | None = Field(
        default=None, description="The dashboard's client secret at the issuer."
    )
    oidc_scopes: str = Field(
        default="openid profile email",
        description="Scopes asked for at sign-in; add the one that puts the roles claim in "
        "the ID token where the issuer needs one (groups, roles).",
    )
    oidc_prompt: str = Field(
        default="login",
        description="The prompt parameter of the sign-in request: login asks for the "
        "person's credentials each time (every provider supports it); select_account or "
        "consent where the issuer supports them; none to leave it out.",
    )
    oidc_redirect_uri: str | None = Field(
        default=None,
        description="Where the issuer sends people back; unset: "
        "http://<KVWATCH_DASHBOARD_HOST>:<KVWATCH_DASHBOARD_PORT>/oauth2callback. Register "
        "it with the issuer as a redirect URI and as a post-logout redirect URI.",
    )
    oidc_cookie_secret: SecretStr | None = Field(
        default=None,
        description="Secret signing the dashboard's sign-in cookie; unset: a new one each "
        "start (everyone signs in again after a restart). Same on every replica.",
    )

    @field_validator(
        "dashboard_token",
        "oidc_issuer",
        "oidc_client_id",
        "oidc_client_secret",
        "oidc_redirect_uri",
        "oidc_cookie_secret",
        mode="before",
    )
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

    @model_validator(mode="after")
    def _one_way_in(self) -> DashboardSettings:
        if self.oidc_issuer is None:
            return self
        if self.oidc_client_id is None:
            raise ValueError("KVWATCH_OIDC_ISSUER is set without KVWATCH_OIDC_CLIENT_ID")
        if self.oidc_redirect_uri is None and self.dashboard_host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"KVWATCH_DASHBOARD_HOST is {self.dashboard_host!r}, which no browser can be "
                "sent back to: set KVWATCH_OIDC_REDIRECT_URI to the dashboard's address "
                "(http(s)://host:port/oauth2callback)"
            )
        if self.dashboard_token is not None:
            # the shared token would let in whoever reaches the page, signed in or not
            raise ValueError(
                "KVWATCH_DASHBOARD_TOKEN and KVWATCH_OIDC_ISSUER are both set: with sign-in, "
                "each person reads with their own identity; unset the token"
            )
        return self

    @property
    def oidc(self) -> bool:
        """People sign in (OIDC): no token box, no shared token."""
        return self.oidc_issuer is not None

    @property
    def redirect_uri(self) -> str:
        return self.oidc_redirect_uri or (
            f"http://{self.dashboard_host}:{self.dashboard_port}/oauth2callback"
        )

    @property
    def token(self) -> str | None:
        return None if self.dashboard_token is None else self.dashboard_token.get_secret_value()
