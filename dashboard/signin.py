"""Signing people in, where KVWATCH_OIDC_ISSUER is set (docs/sign-in.md).

Streamlit's own ``st.login`` runs the OpenID Connect flow (with Authlib: discovery, PKCE,
state, nonce and the ID token's checks) and keeps the person in a signed cookie; ``kvwatch
dashboard`` writes its ``[auth]`` secrets from the ``KVWATCH_OIDC_*`` settings. The
dashboard forwards the person's ID token to the collector on every call; the collector
verifies it and decides the person's role (``GET /v1/whoami``), so nothing here decides
what anyone may see.

A session ends when the ID token expires (Streamlit's cookie does not: it would outlive
the token) or on sign-out (``st.logout``, which also ends the session at the issuer where it
publishes an ``end_session_endpoint``).
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import streamlit as st


def id_token() -> str | None:
    """The signed-in person's ID token, or None."""
    if not st.user.is_logged_in:
        return None
    try:
        token = st.user.tokens.get("id")
    except Exception:
        return None
    return str(token) if token else None


def _claims(token: str) -> dict[str, Any]:
    """The token's claims, unverified: only to tell the person when their sign-in ends (the
    collector verifies every token it is sent)."""
    try:
        part = token.split(".")[1]
        doc = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (IndexError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def expires_at(token: str) -> datetime | None:
    exp = _claims(token).get("exp")
    return datetime.fromtimestamp(exp, UTC) if isinstance(exp, int | float) else None


def gate(issuer: str) -> None:
    """Stop the page unless a person is signed in with an ID token that has not expired."""
    if not st.user.is_logged_in:
        st.title("kvwatch")
        st.markdown(
            "Sign in with your organisation's account to see the fleet, its alerts and "
            f"incidents. You will be sent to **{issuer}** and back."
        )
        st.button("Sign in", icon=":material/login:", type="primary", on_click=st.login)
        st.stop()
    why = why_ended()
    if why is not None:
        ended(why)


def why_ended() -> str | None:
    """Why a signed-in person's session has ended (no ID token, or it has expired), or None
    while it is live. The page's gate and every auto-refreshing section ask this."""
    token = id_token()
    if token is None:
        return "The sign-in gave the dashboard no ID token."
    ends = expires_at(token)
    if ends is not None and ends <= datetime.now(UTC):
        return f"It expired at {ends:%Y-%m-%d %H:%M:%S} UTC."
    return None


def ended(why: str) -> None:
    """The page of a person whose sign-in no longer lets them in: sign in again (their role
    is read afresh from the issuer) or out."""
    st.title("kvwatch")
    st.warning(f"**Your sign-in has ended.** {why}", icon=":material/lock_clock:")
    left, right, _ = st.columns([1, 1, 4])  # side by side, not half a page apart
    left.button("Sign in again", icon=":material/login:", type="primary", on_click=st.login)
    right.button("Sign out", icon=":material/logout:", on_click=st.logout)
    st.stop()


def refused(message: str) -> None:
    """The page a signed-in person without a kvwatch role sees, with the collector's reason."""
    st.title("kvwatch")
    st.error(
        f"**You are signed in, but kvwatch gives you no access.** {message}",
        icon=":material/block:",
    )
    st.button("Sign out", icon=":material/logout:", on_click=st.logout)
    st.stop()


def sign_out_button() -> None:
    st.button("Sign out", icon=":material/logout:", on_click=st.logout, key="sign_out")
