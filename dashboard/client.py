"""A small typed client for the collector's HTTP API: the dashboard's only way to its data.

Every failure becomes one of a few exceptions a page can explain to a person (see
:mod:`dashboard.errors`): :class:`CollectorDown` (unreachable, timed out, 5xx),
:class:`TokenRejected` (401/403) and :class:`BadRequest` (other 4xx, with the collector's
own message).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import quote

import httpx

from dashboard.errors import BadRequest, CollectorDown, DashboardError, TokenRejected

JSON = dict[str, Any]
FileFormat = Literal["json", "csv", "pdf"]


def iso(dt: datetime) -> str:
    """UTC ISO 8601 with a Z, as the collector writes times."""
    aware = dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)
    return aware.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _params(**kw: Any) -> dict[str, Any]:
    """Query parameters without the unset ones: the collector refuses unknown or empty ones."""
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if v is None:
            continue
        out[k] = iso(v) if isinstance(v, datetime) else v
    return out


class CollectorClient:
    """One collector, one token. Use as a context manager (it holds a connection pool)."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url
        self._http = httpx.Client(
            base_url=base_url,
            headers=headers,
            # A dead collector should fail a page in seconds, not hang it for the read timeout.
            timeout=httpx.Timeout(timeout_s, connect=3.0),
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ plumbing

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        try:
            r = self._http.request(
                method,
                path,
                params=params,
                json=body,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s,
            )
        except httpx.TimeoutException as exc:
            raise CollectorDown(
                f"the collector at {self.base_url} did not answer in time ({type(exc).__name__})"
            ) from exc
        except httpx.TransportError as exc:
            raise CollectorDown(
                f"cannot reach the collector at {self.base_url}: {exc or type(exc).__name__}"
            ) from exc
        if r.status_code >= 400:
            raise _error(r)
        return r

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        r = self._send(method, path, **kw)
        try:
            return r.json()
        except ValueError:
            raise DashboardError(
                f"{self.base_url}{path} did not answer with JSON: is it a kvwatch collector?",
                status=r.status_code,
            ) from None

    # ------------------------------------------------------------------ reads

    def whoami(self) -> JSON:
        """Who the token (or signed-in person) is and what they may do (``may``)."""
        return dict(self._json("GET", "/v1/whoami"))

    def health(self) -> JSON:
        return dict(self._json("GET", "/healthz"))

    def fleet(self) -> JSON:
        return dict(self._json("GET", "/v1/fleet"))

    def deployments(self) -> list[JSON]:
        return list(self._json("GET", "/v1/deployments"))

    def prompt_stats(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        model_id: str | None = None,
        route: str | None = None,
        deployment_id: str | None = None,
        max_points: int = 200,
    ) -> JSON:
        p = _params(
            since=since,
            until=until,
            model_id=model_id,
            route=route,
            deployment_id=deployment_id,
            max_points=max_points,
        )
        return dict(self._json("GET", "/v1/stats/prompt-tokens", params=p))

    def top_prompts(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        model_id: str | None = None,
        route: str | None = None,
        deployment_id: str | None = None,
        limit: int = 20,
    ) -> list[JSON]:
        p = _params(
            since=since,
            until=until,
            model_id=model_id,
            route=route,
            deployment_id=deployment_id,
            limit=limit,
        )
        return list(self._json("GET", "/v1/stats/top-prompts", params=p)["items"])

    def page_event_stats(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
        max_points: int = 200,
    ) -> JSON:
        p = _params(since=since, until=until, deployment_id=deployment_id, max_points=max_points)
        return dict(self._json("GET", "/v1/stats/page-events", params=p))

    def pool_samples(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
        node: str | None = None,
        max_points: int = 200,
    ) -> JSON:
        p = _params(
            since=since, until=until, deployment_id=deployment_id, node=node, max_points=max_points
        )
        return dict(self._json("GET", "/v1/pool-samples", params=p))

    def page_events(
        self,
        *,
        kind: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> JSON:
        """One page of events (``items``, ``next_cursor``), newest first."""
        p = _params(
            kind=kind,
            since=since,
            until=until,
            deployment_id=deployment_id,
            limit=limit,
            cursor=cursor,
        )
        return dict(self._json("GET", "/v1/page-events", params=p))

    def alerts(
        self,
        *,
        state: str | None = None,
        severity: str | None = None,
        deployment_id: str | None = None,
        limit: int = 100,
    ) -> list[JSON]:
        p = _params(state=state, severity=severity, deployment_id=deployment_id, limit=limit)
        return list(self._json("GET", "/v1/alerts", params=p))

    def alert(self, alert_id: int) -> JSON:
        return dict(self._json("GET", f"/v1/alerts/{alert_id}"))

    def silences(self) -> list[JSON]:
        return list(self._json("GET", "/v1/silences"))

    def incidents(self, *, state: str | None = None, limit: int = 100) -> list[JSON]:
        return list(self._json("GET", "/v1/incidents", params=_params(state=state, limit=limit)))

    def incident(self, incident_id: int) -> JSON:
        """One incident: its alerts (operators), or its own side of it (a tenant's token)."""
        return dict(self._json("GET", f"/v1/incidents/{incident_id}"))

    def incident_assessment(self, incident_id: int) -> JSON:
        """The incident's breach assessment as it stands (not stored)."""
        path = f"/v1/incidents/{incident_id}/assessment"
        return dict(self._json("GET", path, timeout_s=120))

    def incident_case(self, incident_id: int) -> JSON:
        """The incident's case register: each party's notification status and the decisions
        (collector.cases)."""
        return dict(self._json("GET", f"/v1/incidents/{incident_id}/case"))

    def incident_notice(self, incident_id: int, tenant: str) -> bytes:
        """The PDF notice to one tenant (admin; audited)."""
        r = self._send(
            "GET",
            f"/v1/incidents/{incident_id}/notice",
            params={"tenant": tenant, "format": "pdf"},
            timeout_s=120,
        )
        return r.content

    def verification(self, verification_id: int) -> JSON:
        """One verification with its evidence (admin)."""
        return dict(self._json("GET", f"/v1/verifications/{verification_id}"))

    def verifications(self, *, deployment_id: str | None = None, limit: int = 200) -> list[JSON]:
        p = _params(deployment_id=deployment_id, limit=limit)
        return list(self._json("GET", "/v1/verifications", params=p))

    def rules(self) -> list[JSON]:
        return list(self._json("GET", "/v1/rules"))

    def runbook(self, kind: str) -> JSON:
        """A rule kind's runbook: ``{"kind", "markdown"}``."""
        return dict(self._json("GET", f"/v1/runbooks/{quote(kind, safe='')}"))

    def reports(self, *, kind: str | None = None, limit: int = 100) -> list[JSON]:
        """Stored reports (breach ``rpt_…`` and review ``rev_…``), newest first."""
        p = _params(kind=kind, limit=limit)
        return list(self._json("GET", "/v1/reports", params=p)["items"])

    def report(self, report_id: str) -> JSON:
        return dict(self._json("GET", f"/v1/reports/{report_id}", timeout_s=120))

    def report_file(self, report_id: str, fmt: FileFormat) -> bytes:
        """A stored report as JSON, CSV (a breach's affected requests, a review's rows) or
        its PDF."""
        r = self._send("GET", f"/v1/reports/{report_id}", params={"format": fmt}, timeout_s=120)
        return r.content

    def review(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
    ) -> JSON:
        p = _params(since=since, until=until, deployment_id=deployment_id)
        return dict(self._json("GET", "/v1/review", params=p, timeout_s=120))

    def review_file(
        self,
        fmt: FileFormat,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
    ) -> bytes:
        p = _params(since=since, until=until, deployment_id=deployment_id, format=fmt)
        return self._send("GET", "/v1/review", params=p, timeout_s=120).content

    # ------------------------------------------------------------------ actions

    def ack(self, alert_id: int, *, by: str | None = None, comment: str | None = None) -> JSON:
        body = _params(by=by, comment=comment)
        return dict(self._json("POST", f"/v1/alerts/{alert_id}/ack", body=body))

    def create_silence(
        self,
        matchers: list[JSON],
        *,
        duration: str,
        comment: str,
        created_by: str | None = None,
    ) -> JSON:
        body = _params(matchers=matchers, duration=duration, comment=comment, created_by=created_by)
        return dict(self._json("POST", "/v1/silences", body=body))

    def expire_silence(self, silence_id: int) -> JSON:
        return dict(self._json("DELETE", f"/v1/silences/{silence_id}"))

    def close_incident(self, incident_id: int, *, reason: str, by: str | None = None) -> JSON:
        body = _params(reason=reason, by=by)
        return dict(self._json("POST", f"/v1/incidents/{incident_id}/close", body=body))

    # the on-call workflow of one incident (collector/alerting/incident_workflow.py)

    def ack_incident(self, incident_id: int, *, by: str | None = None) -> JSON:
        return dict(self._json("POST", f"/v1/incidents/{incident_id}/ack", body=_params(by=by)))

    def assign_incident(self, incident_id: int, owner: str, *, by: str | None = None) -> JSON:
        body = _params(owner=owner, by=by)
        return dict(self._json("POST", f"/v1/incidents/{incident_id}/owner", body=body))

    def note_incident(self, incident_id: int, text: str, *, by: str | None = None) -> JSON:
        body = _params(text=text, by=by)
        return dict(self._json("POST", f"/v1/incidents/{incident_id}/notes", body=body))

    def link_alert(self, incident_id: int, alert_id: int, *, by: str | None = None) -> JSON:
        body = _params(alert_id=alert_id, by=by)
        return dict(self._json("POST", f"/v1/incidents/{incident_id}/links", body=body))

    def unlink_alert(self, incident_id: int, alert_id: int) -> JSON:
        return dict(self._json("DELETE", f"/v1/incidents/{incident_id}/links/{alert_id}"))

    def incident_timeline(self, incident_id: int) -> list[JSON]:
        return list(self._json("GET", f"/v1/incidents/{incident_id}/timeline"))

    def create_breach_report(
        self,
        *,
        incident_id: int | None = None,
        model_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        min_prompt_tokens: int | None = None,
        deployment_id: str | None = None,
    ) -> JSON:
        """Generate and store a breach report; returns its id, evidence hash and links."""
        body = _params(
            kind="breach",
            incident_id=incident_id,
            model_id=model_id,
            since=since,
            until=until,
            min_prompt_tokens=min_prompt_tokens,
            deployment_id=deployment_id,
        )
        return dict(self._json("POST", "/v1/reports", body=body, timeout_s=120))

    def create_review_report(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        deployment_id: str | None = None,
    ) -> JSON:
        """Generate and store a quarterly review (default window: the last 90 days)."""
        body = _params(kind="review", since=since, until=until, deployment_id=deployment_id)
        return dict(self._json("POST", "/v1/reports", body=body, timeout_s=120))


def _error(r: httpx.Response) -> DashboardError:
    """The collector's ``{"error": {code, message, details}}``, or the status line."""
    code: str | None = None
    details: Any = None
    message = f"HTTP {r.status_code} {r.reason_phrase}".strip()
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        code = err.get("code")
        message = str(err.get("message") or message)
        details = err.get("details")
    if r.status_code in (401, 403):
        return TokenRejected(message, status=r.status_code, code=code)
    if r.status_code >= 500:
        return CollectorDown(
            f"the collector answered {r.status_code}: {message}", status=r.status_code, code=code
        )
    return BadRequest(message, status=r.status_code, code=code, details=details)
