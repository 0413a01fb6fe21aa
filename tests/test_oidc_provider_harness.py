"""The OIDC test harness (tests/oidc_provider.py) against the real oidc-provider it starts:
sign-ins over HTTP, ID tokens that verify against the published JWKS, key rotation."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.errors import BadSignatureError, JoseError
from joserfc.jwk import KeySet, RSAKey

from tests.oidc_provider import OidcProvider, b64url, unsigned

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None, reason="node is not on PATH: the OIDC provider is a Node.js app"
)

CLIENT = "kvwatch-dashboard"
SECRET = "dashboard-secret-for-tests"
REDIRECT = "http://localhost:8501/oauth2callback"
USERS = {
    "alice": {"email": "alice@example.test", "name": "Alice Admin", "groups": ["kvwatch-admins"]},
    "victor": {"email": "victor@example.test", "name": "Victor Viewer", "groups": ["viewers", "x"]},
}
ID_TOKEN_TTL_S = 123


@pytest.fixture(scope="module")
def op() -> Iterator[OidcProvider]:
    provider = OidcProvider(
        clients=[
            {
                "client_id": CLIENT,
                "client_secret": SECRET,
                "redirect_uris": [REDIRECT],
                "post_logout_redirect_uris": ["http://localhost:8501/"],
            },
            {
                "client_id": "kvwatch-collector",
                "client_secret": "collector-secret",
                "redirect_uris": ["http://127.0.0.1:9/cb"],
                "token_endpoint_auth_method": "client_secret_post",
            },
        ],
        users=USERS,
        id_token_ttl_s=ID_TOKEN_TTL_S,
        access_token_ttl_s=600,
    )
    with provider:
        yield provider


def verified(op: OidcProvider, token: str) -> dict[str, Any]:
    """The claims of `token` once its signature checks out against the JWKS served now."""
    keys = KeySet.import_key_set(httpx.get(op.jwks_url).json())
    decoded = jwt.decode(token, keys, algorithms=["RS256"])
    return dict(decoded.claims) | {"__kid__": decoded.header.get("kid")}


def test_login_returns_an_id_token_that_verifies_against_the_published_jwks(
    op: OidcProvider,
) -> None:
    tokens = op.login(CLIENT, "alice")
    assert tokens["token_type"].lower() == "bearer"
    assert tokens["access_token"]
    assert tokens["expires_in"] == 600
    claims = verified(op, tokens["id_token"])
    assert claims["__kid__"] == op.keys[0].kid
    assert claims["iss"] == op.issuer
    assert claims["aud"] == CLIENT
    assert claims["sub"] == "alice"
    assert claims["email"] == "alice@example.test"
    assert claims["email_verified"] is True
    assert claims["name"] == "Alice Admin"
    assert claims["groups"] == ["kvwatch-admins"]
    # the issuer's discovery document names the JWKS the token was checked against
    assert op.jwks_url == f"{op.issuer}/jwks"
    assert op.end_session_endpoint.startswith(op.issuer)
    assert "alice" in op.logins()
    # the access token is good at the userinfo endpoint
    me = httpx.get(
        op.userinfo_endpoint, headers={"Authorization": f"Bearer {tokens['access_token']}"}
    )
    assert me.status_code == 200, me.text
    assert me.json()["groups"] == ["kvwatch-admins"]


def test_id_token_lifetime_is_the_configured_one(op: OidcProvider) -> None:
    claims = verified(op, op.login(CLIENT, "victor")["id_token"])
    assert claims["exp"] - claims["iat"] == ID_TOKEN_TTL_S
    assert claims["groups"] == ["viewers", "x"]


def test_an_unknown_login_signs_in_with_no_groups(op: OidcProvider) -> None:
    claims = verified(op, op.login(CLIENT, "mallory")["id_token"])
    assert claims["sub"] == "mallory"
    assert claims["email"] == "mallory@unknown.test"
    assert claims["groups"] == []


def test_client_secret_post_and_a_scope_without_groups(op: OidcProvider) -> None:
    tokens = op.login(
        "kvwatch-collector",
        "alice",
        scope="openid email",
        auth_method="client_secret_post",
        pkce=False,
    )
    claims = verified(op, tokens["id_token"])
    assert claims["aud"] == "kvwatch-collector"
    assert claims["email"] == "alice@example.test"
    assert "groups" not in claims
    assert "name" not in claims
    # the dashboard's client, registered for client_secret_basic, may use client_secret_post
    tokens = op.login(CLIENT, "alice", auth_method="client_secret_post")
    assert verified(op, tokens["id_token"])["groups"] == ["kvwatch-admins"]


def test_tokens_made_by_the_harness(op: OidcProvider) -> None:
    good = op.sign(op.id_token_claims("alice", CLIENT))
    claims = verified(op, good)
    assert (claims["iss"], claims["aud"], claims["groups"]) == (
        op.issuer,
        CLIENT,
        ["kvwatch-admins"],
    )
    expired = op.sign(op.id_token_claims("alice", CLIENT, iat=int(time.time()) - 600, ttl_s=-300))
    assert verified(op, expired)["exp"] < time.time()  # signature good, lifetime over
    stranger = RSAKey.generate_key(2048, parameters={"kid": str(op.keys[0].kid)}, private=True)
    forged = op.sign(op.id_token_claims("alice", CLIENT), key=stranger)
    with pytest.raises(BadSignatureError):
        verified(op, forged)
    none = unsigned(op.id_token_claims("alice", CLIENT))
    assert none.startswith(b64url(b'{"alg":"none","typ":"JWT"}') + ".")
    assert none.endswith(".")
    with pytest.raises((JoseError, ValueError)):
        verified(op, none)


def test_rotation_signs_with_a_new_key_and_still_publishes_the_old_one(
    op: OidcProvider,
) -> None:
    before = op.login(CLIENT, "alice")["id_token"]
    old_kid = op.keys[0].kid
    port = op.port
    op.rotate()
    assert op.port == port
    new_kid = op.keys[0].kid
    assert new_kid != old_kid
    assert [k.kid for k in op.keys] == [new_kid, old_kid]
    published = [key["kid"] for key in op.jwks()["keys"]]
    assert published == [new_kid, old_kid]
    assert all("d" not in key for key in op.jwks()["keys"])  # public halves only
    after = op.login(CLIENT, "alice")["id_token"]
    assert verified(op, after)["__kid__"] == new_kid
    # a token from before the rotation still verifies: its key is still published
    assert verified(op, before)["__kid__"] == old_kid
    assert op.sign({"sub": "x"}).count(".") == 2
    assert verified(op, op.sign({"sub": "x"}))["__kid__"] == new_kid
