"""Signatures over what kvwatch concludes: Ed25519 JWS (RFC 7515, with RFC 9864's fully
specified ``Ed25519`` algorithm), keys as JWKs (RFC 7517/8037), the public ones published as a
JWK set.

Why JWS and not a format of our own: a regulator or a customer can check a kvwatch signature
with any JOSE library and the published key set, without kvwatch. Why ``joserfc``: one
maintained library for JWS, JWK and JWK sets (it signs with ``cryptography``'s Ed25519).

A *statement* is the JWS payload: a JSON object naming what is signed (``sub``), when
(``iat``), the SHA-256 of every file it covers (``files``) and the conclusions themselves
(``conclusions``), so a verifier can say which conclusion a forged file changed, not only that
its bytes differ.

The key directory (:func:`key_dir`) holds:

- ``keys.jwks``: the public key set, every key ever used, oldest first; a retired key keeps
  its public half here (``kvwatch_retired_at``), so what it signed stays verifiable;
- ``private/<kid>.jwk`` (mode 0600): the private half of the current key only. Rotation
  writes the new key and then deletes the old private half: nothing can sign with it again.

Invariants: exactly one key of ``keys.jwks`` has no ``kvwatch_retired_at`` and it is the one
with a private file; a key's ``kid`` is its RFC 7638 thumbprint, so a key set cannot name two
keys alike, and a file cannot claim a key it was not signed with.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from joserfc import jws
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, OKPKey

from collector.errors import CollectorError, InvalidInput
from collector.timefmt import iso

ALG = "Ed25519"
TYP = "kvwatch-statement+jws"
STATEMENT = "kvwatch-statement/1"
JWKS_FILE = "keys.jwks"
_PRIVATE = "private"
_LOCK = ".lock"


class SigningError(CollectorError):
    """The key directory cannot be read or written (permissions, a corrupt key file)."""


class SignatureInvalid(CollectorError):
    """A signature does not verify: unknown key, bad signature, or not a kvwatch statement."""


@dataclass(frozen=True, slots=True)
class Verified:
    """A statement whose signature verified, and the key that signed it."""

    claims: dict[str, Any]
    kid: str
    retired_at: str | None  # when the signing key was retired (None: it is the current one)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def key_dir(database_url: str, configured: Path | None) -> Path:
    """Where the keys live: ``KVWATCH_SIGNING_KEY_DIR`` when set; beside an embedded SQLite
    database (``<db dir>/signing-keys``), so the demo's and a test's keys stay with their
    data; else ``$XDG_STATE_HOME/kvwatch/signing-keys`` (``~/.local/state``)."""
    if configured is not None:
        return configured
    if database_url.startswith("sqlite:///") and ":memory:" not in database_url:
        return Path(database_url.removeprefix("sqlite:///")).resolve().parent / "signing-keys"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvwatch" / "signing-keys"


def statement(
    *,
    sub: str,
    iat: datetime,
    files: Mapping[str, str] | None = None,
    conclusions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A statement's claims: ``sub`` what it is about (``report:rpt_…``, ``notice:ntc_…``,
    ``audit:head``, ``case:incident:N``), ``files`` name -> SHA-256, ``conclusions`` the values
    the files state (JSON types)."""
    return {
        "typ": STATEMENT,
        "sub": sub,
        "iat": iso(iat),
        "files": dict(files or {}),
        "conclusions": dict(conclusions or {}),
    }


class KeyRing:
    """The key directory: signs with the current key, publishes every key's public half."""

    def __init__(self, directory: Path):
        self.directory = directory

    # ------------------------------------------------------------------ reading

    def public_set(self) -> dict[str, Any]:
        """The published JWK set (``{"keys": [...]}``), oldest first; empty when no key was
        ever made."""
        path = self.directory / JWKS_FILE
        try:
            doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"keys": []}
        except (OSError, ValueError) as exc:
            raise SigningError(f"{path}: not a readable JWK set ({exc})") from None
        return doc

    def current_kid(self) -> str | None:
        live = [k["kid"] for k in self.public_set()["keys"] if not k.get("kvwatch_retired_at")]
        return live[0] if live else None

    # ------------------------------------------------------------------ signing

    def sign(self, claims: Mapping[str, Any], *, now: datetime) -> str:
        """A compact JWS of ``claims`` with the current key (made on first use)."""
        key = self._current_private(now)
        payload = json.dumps(claims, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        header = {"alg": ALG, "kid": key.kid, "typ": TYP}
        return jws.serialize_compact(header, payload.encode(), key, algorithms=[ALG])

    def generate(self, now: datetime) -> str:
        """Make the first key; an error when there is one already (rotate instead)."""
        with self._locked():
            if self.current_kid() is not None:
                raise InvalidInput(
                    f"{self.directory} already holds a signing key ({self.current_kid()}): "
                    "rotate it instead"
                )
            return self._add_key(now)

    def rotate(self, now: datetime) -> tuple[str | None, str]:
        """A new current key; the old one is retired (its public half stays published, its
        private half is deleted). Returns (old kid, new kid)."""
        with self._locked():
            old = self.current_kid()
            new = self._add_key(now, retire=old)
            if old is not None:
                (self.directory / _PRIVATE / f"{old}.jwk").unlink(missing_ok=True)
            return old, new

    def _current_private(self, now: datetime) -> OKPKey:
        kid = self.current_kid()
        if kid is None:
            with self._locked():
                kid = self.current_kid() or self._add_key(now)
        path = self.directory / _PRIVATE / f"{kid}.jwk"
        try:
            return OKPKey.import_key(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise SigningError(
                f"{path}: the current signing key's private half is missing (restore it, or "
                "`kvwatch keys rotate` to make a new one)"
            ) from None
        except (OSError, ValueError, JoseError) as exc:
            raise SigningError(f"{path}: not a readable private key ({exc})") from None

    def _add_key(self, now: datetime, retire: str | None = None) -> str:
        key = OKPKey.generate_key("Ed25519", private=True)
        kid = key.thumbprint()
        private = self.directory / _PRIVATE
        private.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(private / f"{kid}.jwk", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**key.as_dict(private=True), "kid": kid}, f)
        doc = self.public_set()
        keys = []
        for k in doc["keys"]:
            if k["kid"] == retire:
                k = {**k, "kvwatch_retired_at": iso(now)}
            keys.append(k)
        public = {**key.as_dict(private=False), "kid": kid, "alg": ALG, "use": "sig"}
        keys.append({**public, "kvwatch_created_at": iso(now)})
        tmp = self.directory / f"{JWKS_FILE}.part"
        tmp.write_text(json.dumps({"keys": keys}, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.directory / JWKS_FILE)
        return kid

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer of the key directory at a time (two collectors making the first key at
        once would otherwise each make one)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise SigningError(f"{self.directory}: cannot write the key directory: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def load_key_set(path: Path) -> dict[str, Any]:
    """A published JWK set from a file (``kvwatch keys public``'s output), or a key
    directory."""
    if path.is_dir():
        return KeyRing(path).public_set()
    try:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc.get("keys"), list):
            raise ValueError("no 'keys' list")
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{path}: not a JWK set ({exc})") from None
    return doc


def verify(token: str, key_set: Mapping[str, Any]) -> Verified:
    """Check ``token`` against the published ``key_set``; raises :class:`SignatureInvalid`
    naming why (unknown key, bad signature, not a kvwatch statement)."""
    token = token.strip()
    try:
        header = json.loads(_b64(token.split(".", 1)[0]))
        kid = str(header["kid"])
    except (ValueError, KeyError, IndexError) as exc:
        raise SignatureInvalid(f"not a JWS compact signature ({exc})") from None
    entry = next((k for k in key_set.get("keys", []) if k.get("kid") == kid), None)
    if entry is None:
        raise SignatureInvalid(
            f"signed with key {kid}, which is not in the published key set "
            f"({', '.join(k.get('kid', '?') for k in key_set.get('keys', [])) or 'empty'})"
        )
    public = {k: v for k, v in entry.items() if k in ("kty", "crv", "x", "kid")}
    try:
        key = OKPKey.import_key(public)
        obj = jws.deserialize_compact(token, KeySet([key]), algorithms=[ALG])
        claims = json.loads(obj.payload)
    except JoseError as exc:
        raise SignatureInvalid(f"the signature does not verify with key {kid} ({exc})") from None
    except ValueError as exc:
        raise SignatureInvalid(f"the signed payload is not JSON ({exc})") from None
    if not isinstance(claims, dict) or claims.get("typ") != STATEMENT:
        raise SignatureInvalid(f"signed, but not a {STATEMENT}")
    return Verified(claims, kid, entry.get("kvwatch_retired_at"))


def _b64(part: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
