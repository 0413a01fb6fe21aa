"""A real OpenID Connect provider on loopback for the tests: oidc-provider (Node.js, pinned in
tests/oidc/package.json) run as `node tests/oidc/provider.mjs CONFIG.json`.

    with OidcProvider(users={"alice": {"email": "a@x.test", "name": "A", "groups": ["admin"]}},
                      clients=[{"client_id": "dash", "client_secret": "s",
                                "redirect_uris": ["http://localhost:8501/oauth2callback"]}]) as op:
        tokens = op.login("dash", "alice")          # a real authorization-code flow over HTTP
        op.sign({...})                              # a JWT signed with the published key
        op.rotate()                                 # new signing key; the old one stays published

Sign-in uses oidc-provider's development interactions: any password is accepted, and the
login becomes the account id (`sub`). A login not in `users` signs in too, with the email
`<login>@unknown.test` and an empty `groups` claim. There is no consent page: every client
here is first-party and is granted what it asks for.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, NoReturn
from urllib.parse import parse_qs, quote, urljoin, urlsplit

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import Key, RSAKey

OIDC_DIR = Path(__file__).resolve().parent / "oidc"
PROVIDER_SCRIPT = OIDC_DIR / "provider.mjs"
PACKAGE = "oidc-provider"

READY_TIMEOUT_S = 30.0
# provider.mjs exits with this status when its port is taken (EADDRINUSE)
_EXIT_ADDRESS_IN_USE = 98

DEFAULT_SCOPE = "openid email profile groups"
UNKNOWN_EMAIL_DOMAIN = "unknown.test"

__all__ = [
    "DEFAULT_SCOPE",
    "OIDC_DIR",
    "UNKNOWN_EMAIL_DOMAIN",
    "OidcProvider",
    "b64url",
    "ensure_node_modules",
    "unsigned",
]


def b64url(data: bytes) -> str:
    """Base64url without padding (RFC 7515 section 2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _compact_json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def unsigned(claims: Mapping[str, Any], *, header_extra: Mapping[str, Any] | None = None) -> str:
    """An `alg: none` JWT: header {"alg":"none","typ":"JWT"}, the claims, an empty signature."""
    header: dict[str, Any] = {"alg": "none", "typ": "JWT", **(header_extra or {})}
    return f"{b64url(_compact_json(header))}.{b64url(_compact_json(claims))}."


# --- node_modules ---------------------------------------------------------------------------


def _locked_version() -> str:
    lock = json.loads((OIDC_DIR / "package-lock.json").read_text())
    return str(lock["packages"][f"node_modules/{PACKAGE}"]["version"])


def _installed_version() -> str | None:
    manifest = OIDC_DIR / "node_modules" / PACKAGE / "package.json"
    try:
        return str(json.loads(manifest.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


@contextlib.contextmanager
def _install_lock() -> Iterator[None]:
    """One `npm ci` at a time across pytest-xdist workers (and checkouts' test runs). The lock
    file lives outside tests/oidc: npm ci deletes node_modules, and nothing may be left
    untracked in the checkout."""
    digest = hashlib.sha256(str(OIDC_DIR).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"kvwatch-oidc-npm-{digest}.lock"
    try:
        from filelock import FileLock
    except ImportError:
        import fcntl

        with path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    else:
        with FileLock(str(path), timeout=300):
            yield


def ensure_node_modules() -> Path:
    """tests/oidc/node_modules, installed with `npm ci` from package-lock.json when
    oidc-provider is missing there (or is not the locked version). Safe to call from several
    pytest-xdist workers at once; fails the test with npm's output when npm fails."""
    node_modules = OIDC_DIR / "node_modules"
    wanted = _locked_version()
    if _installed_version() == wanted:
        return node_modules
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"npm is not on PATH: cannot install {PACKAGE} {wanted} into {node_modules}")
    with _install_lock():
        if _installed_version() == wanted:  # another worker installed it meanwhile
            return node_modules
        try:
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"],
                cwd=OIDC_DIR,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
            pytest.fail(f"`npm ci` in {OIDC_DIR} ran over {exc.timeout} s:\n{stderr}")
        if done.returncode != 0 or _installed_version() != wanted:
            pytest.fail(
                f"`npm ci --no-audit --no-fund` in {OIDC_DIR} failed (exit {done.returncode}); "
                f"{PACKAGE} {wanted} is needed.\n"
                f"stderr:\n{done.stderr[-4000:]}\nstdout:\n{done.stdout[-2000:]}"
            )
    return node_modules


# --- the provider ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _new_signing_key() -> RSAKey:
    kid = f"kvw-test-{secrets.token_hex(6)}"
    return RSAKey.generate_key(
        2048, parameters={"kid": kid, "use": "sig", "alg": "RS256"}, private=True
    )


class _FormParser(HTMLParser):
    """The first <form> of a page: its action and its inputs' default values."""

    def __init__(self) -> None:
        super().__init__()
        self.action: str | None = None
        self.fields: dict[str, str] = {}
        self._in_form = False
        self._done = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "form" and not self._done and self.action is None:
            self.action = values.get("action", "")
            self._in_form = True
        elif tag == "input" and self._in_form and values.get("name"):
            self.fields[values["name"]] = values.get("value", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form" and self._in_form:
            self._in_form = False
            self._done = True


class OidcProvider:
    """oidc-provider on 127.0.0.1, in a node process this object starts and stops.

    clients: [{client_id, client_secret, redirect_uris, post_logout_redirect_uris?, ...}]
    (any other client metadata is passed to oidc-provider; token_endpoint_auth_method
    defaults to client_secret_basic, and client_secret_post works for the same client).
    users: {login: {email, name, groups}}. workdir: where the config and the node process's
    logs go (default: a temporary directory removed by stop()).
    """

    def __init__(
        self,
        *,
        clients: Sequence[Mapping[str, Any]] | None = None,
        users: Mapping[str, Mapping[str, Any]] | None = None,
        id_token_ttl_s: int = 300,
        access_token_ttl_s: int = 300,
        workdir: Path | None = None,
    ) -> None:
        if clients is None:
            clients = [
                {
                    "client_id": "kvwatch-test",
                    "client_secret": secrets.token_urlsafe(24),
                    "redirect_uris": ["http://127.0.0.1/oidc-callback"],
                }
            ]
        self.clients: list[dict[str, Any]] = [dict(c) for c in clients]
        self.users: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (users or {}).items()}
        self.id_token_ttl_s = id_token_ttl_s
        self.access_token_ttl_s = access_token_ttl_s
        self.keys: list[RSAKey] = []
        self.port: int = 0
        self.issuer: str = ""
        self.discovery: dict[str, Any] = {}
        self._workdir = workdir
        self._own_workdir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdout: IO[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._starts = 0

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> OidcProvider:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start node on a free port with a new RSA-2048 signing key; return once it serves."""
        if self._proc is not None:
            raise RuntimeError("the OIDC provider is already running")
        ensure_node_modules()
        if shutil.which("node") is None:
            pytest.fail("node is not on PATH: the OIDC provider cannot run")
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="kvwatch-oidc-"))
            self._own_workdir = True
        self._workdir.mkdir(parents=True, exist_ok=True)
        if not self.keys:
            self.keys = [_new_signing_key()]
        try:
            for attempt in range(5):
                self.port = _free_port()
                self.issuer = f"http://127.0.0.1:{self.port}"
                if self._launch(retry_if_port_taken=attempt < 4):
                    break
            self._load_discovery()
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ fails
            raise

    def stop(self) -> None:
        """Stop node (SIGTERM, then SIGKILL after 5 s); remove the own temporary directory."""
        self._terminate()
        for handle in (self._stdout, self._stderr):
            if handle is not None:
                handle.close()
        self._stdout = self._stderr = None
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            self._own_workdir = False

    def rotate(self, *, keep_old: bool = True) -> None:
        """Key rotation as a real provider does it: restart node on the same port with a new
        signing key first and the current one still published second (keep_old=False: the
        new key alone). Keys older than the current one are no longer published. Sessions
        and grants live in node's memory, so they are gone after a rotation (a browser signs
        in again); tokens already issued stay valid while their key is published."""
        if self._proc is None:
            raise RuntimeError("the OIDC provider is not running")
        self._terminate()
        self.keys = [_new_signing_key(), *self.keys[:1]] if keep_old else [_new_signing_key()]
        self._launch(retry_if_port_taken=False)
        self._load_discovery()

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise RuntimeError("the OIDC provider has not been started")
        return self._workdir

    def config(self) -> dict[str, Any]:
        """The JSON provider.mjs reads."""
        return {
            "port": self.port,
            "issuer": self.issuer,
            "clients": self.clients,
            "users": self.users,
            "jwks": {"keys": [key.as_dict(private=True) for key in self.keys]},
            "id_token_ttl_s": self.id_token_ttl_s,
            "access_token_ttl_s": self.access_token_ttl_s,
        }

    def _launch(self, *, retry_if_port_taken: bool) -> bool:
        """Run node with the current config; False when its port was taken (and retrying)."""
        workdir = self.workdir
        self._starts += 1
        config_path = workdir / f"config-{self._starts}.json"
        config_path.write_text(json.dumps(self.config(), indent=2))
        config_path.chmod(0o600)
        if self._stdout is None:
            self._stdout = (workdir / "stdout.log").open("ab")
            self._stderr = (workdir / "stderr.log").open("ab")
        ready_line = f"oidc-provider listening on {self.issuer}"
        seen = self.stdout().count(ready_line)
        self._proc = subprocess.Popen(
            ["node", str(PROVIDER_SCRIPT), str(config_path)],
            cwd=OIDC_DIR,
            stdin=subprocess.DEVNULL,
            stdout=self._stdout,
            stderr=self._stderr,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.stdout().count(ready_line) <= seen:
            code = self._proc.poll()
            if code == _EXIT_ADDRESS_IN_USE and retry_if_port_taken:
                self._proc = None
                return False
            if code is not None or time.monotonic() > deadline:
                what = f"exited with {code}" if code is not None else "is not ready after 30 s"
                self._terminate()
                pytest.fail(
                    f"the OIDC provider (node {PROVIDER_SCRIPT.name}, {self.issuer}) {what}\n"
                    f"stdout:\n{self.stdout()[-3000:]}\nstderr:\n{self.stderr()[-3000:]}"
                )
            time.sleep(0.02)
        return True

    def _load_discovery(self) -> None:
        url = f"{self.issuer}/.well-known/openid-configuration"
        response = httpx.get(url, timeout=30)
        response.raise_for_status()
        self.discovery = response.json()
        if self.discovery.get("issuer") != self.issuer:
            pytest.fail(f"{url} names issuer {self.discovery.get('issuer')!r}, not {self.issuer}")

    # -- what tests read -------------------------------------------------------------------

    def stdout(self) -> str:
        """All the node processes' stdout so far (rotations append)."""
        path = self.workdir / "stdout.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stderr(self) -> str:
        path = self.workdir / "stderr.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logins(self) -> list[str]:
        """The accounts that completed a sign-in, in order (provider.mjs's `login X` lines)."""
        return [
            line.removeprefix("login ")
            for line in self.stdout().splitlines()
            if line.startswith("login ")
        ]

    @property
    def jwks_url(self) -> str:
        return str(self.discovery["jwks_uri"])

    @property
    def authorization_endpoint(self) -> str:
        return str(self.discovery["authorization_endpoint"])

    @property
    def token_endpoint(self) -> str:
        return str(self.discovery["token_endpoint"])

    @property
    def userinfo_endpoint(self) -> str:
        return str(self.discovery["userinfo_endpoint"])

    @property
    def end_session_endpoint(self) -> str:
        return str(self.discovery["end_session_endpoint"])

    @property
    def metadata_url(self) -> str:
        """The discovery document (what Streamlit's server_metadata_url wants)."""
        return f"{self.issuer}/.well-known/openid-configuration"

    @property
    def signing_key(self) -> RSAKey:
        return self.keys[0]

    def jwks(self) -> dict[str, Any]:
        """The published key set, fetched over HTTP."""
        response = httpx.get(self.jwks_url, timeout=30)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def client(self, client_id: str) -> dict[str, Any]:
        for client in self.clients:
            if client["client_id"] == client_id:
                return client
        raise KeyError(
            f"no client {client_id!r} (clients: {[c['client_id'] for c in self.clients]})"
        )

    # -- tokens made here ------------------------------------------------------------------

    def id_token_claims(
        self, user: str, client_id: str, *, ttl_s: int | None = None, **overrides: Any
    ) -> dict[str, Any]:
        """The claims an ID token from this provider carries for `user` (for sign()), with
        `overrides` applied (a value of None removes that claim)."""
        now = int(time.time())
        known = self.users.get(user)
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": user,
            "aud": client_id,
            "iat": now,
            "exp": now + (self.id_token_ttl_s if ttl_s is None else ttl_s),
            "email": known.get("email") if known else f"{user}@{UNKNOWN_EMAIL_DOMAIN}",
            "email_verified": known is not None,
            "name": known.get("name", user) if known else user,
            "groups": list(known.get("groups", [])) if known else [],
        }
        for name, value in overrides.items():
            if value is None:
                claims.pop(name, None)
            else:
                claims[name] = value
        return claims

    def sign(
        self,
        claims: Mapping[str, Any],
        *,
        key: Key | None = None,
        alg: str = "RS256",
        header_extra: Mapping[str, Any] | None = None,
    ) -> str:
        """A JWT of `claims` signed with the provider's current signing key (or `key`); the
        header names the key's kid when it has one. Nothing is added to the claims."""
        key = self.signing_key if key is None else key
        header: dict[str, Any] = {"alg": alg, "typ": "JWT"}
        if key.kid:
            header["kid"] = key.kid
        header.update(header_extra or {})
        return jwt.encode(header, dict(claims), key, algorithms=[alg])

    unsigned = staticmethod(unsigned)

    # -- a real sign-in --------------------------------------------------------------------

    def login(
        self,
        client_id: str,
        user: str,
        *,
        redirect_uri: str | None = None,
        scope: str = DEFAULT_SCOPE,
        auth_method: Literal["client_secret_basic", "client_secret_post"] = "client_secret_basic",
        password: str = "any-password",
        pkce: bool = True,
    ) -> dict[str, Any]:
        """The authorization-code flow over HTTP, as a browser and a confidential client do
        it: /auth (state, nonce, PKCE S256), the login form, the redirect to redirect_uri
        (not followed), then /token with the client's secret (pkce=False: no code_challenge,
        as a confidential client may do). Returns the token response (id_token, access_token,
        expires_in, token_type, scope)."""
        client = self.client(client_id)
        redirect_uri = redirect_uri or str(client["redirect_uris"][0])
        state = secrets.token_urlsafe(16)
        nonce = secrets.token_urlsafe(16)
        verifier = secrets.token_urlsafe(48)
        challenge = b64url(hashlib.sha256(verifier.encode("ascii")).digest())
        params = {
            "client_id": client_id,
            "response_type": "code",
            "redirect_uri": redirect_uri,
            "scope": scope,
            "state": state,
            "nonce": nonce,
        }
        if pkce:
            params.update(code_challenge=challenge, code_challenge_method="S256")
        target = urlsplit(redirect_uri)
        with httpx.Client(follow_redirects=False, timeout=30) as browser:
            response = browser.get(self.authorization_endpoint, params=params)
            query: dict[str, list[str]] | None = None
            submitted = False
            for _hop in range(20):
                if response.is_redirect:
                    location = urljoin(str(response.url), response.headers["location"])
                    where = urlsplit(location)
                    if (where.scheme, where.netloc, where.path) == (
                        target.scheme,
                        target.netloc,
                        target.path,
                    ):
                        query = parse_qs(where.query)
                        break
                    response = browser.get(location)
                elif response.status_code == 200 and not submitted:
                    form = _FormParser()
                    form.feed(response.text)
                    if form.action is None or "login" not in form.fields:
                        self._login_failed("no login form", response)
                    fields = {**form.fields, "login": user, "password": password}
                    action = urljoin(str(response.url), form.action)
                    response = browser.post(action, data=fields)
                    submitted = True
                else:
                    self._login_failed("unexpected answer", response)
            if query is None:
                self._login_failed("too many redirects", response)
        if "error" in query:
            pytest.fail(
                f"sign-in of {user!r} at {client_id!r} failed: {query['error'][0]}: "
                f"{query.get('error_description', [''])[0]}"
            )
        if query.get("state") != [state]:
            pytest.fail(f"the provider returned state {query.get('state')}, not {state!r}")
        if query.get("iss", [self.issuer]) != [self.issuer]:
            pytest.fail(f"the provider returned iss {query.get('iss')}, not {self.issuer}")
        code = query["code"][0]

        form_data = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
        }
        if pkce:
            form_data["code_verifier"] = verifier
        headers: dict[str, str] = {}
        secret = str(client["client_secret"])
        if auth_method == "client_secret_basic":
            # RFC 6749 section 2.3.1: both parts form-urlencoded before base64
            pair = f"{quote(client_id, safe='')}:{quote(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form_data.update(client_id=client_id, client_secret=secret)
        answer = httpx.post(self.token_endpoint, data=form_data, headers=headers, timeout=30)
        if answer.status_code != 200:
            pytest.fail(f"POST {self.token_endpoint}: {answer.status_code} {answer.text[:1000]}")
        tokens: dict[str, Any] = answer.json()
        id_token = tokens.get("id_token")
        if isinstance(id_token, str):
            payload = json.loads(base64.urlsafe_b64decode(id_token.split(".")[1] + "=="))
            if payload.get("nonce") != nonce:
                pytest.fail(f"the ID token carries nonce {payload.get('nonce')!r}, not {nonce!r}")
        return tokens

    def _login_failed(self, what: str, response: httpx.Response) -> NoReturn:
        pytest.fail(
            f"sign-in at {self.issuer}: {what}: {response.request.method} {response.url} -> "
            f"{response.status_code}\n{response.text[:2000]}\nprovider stderr:\n"
            f"{self.stderr()[-2000:]}"
        )
