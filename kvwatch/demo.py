"""``kvwatch demo``: the incident, replayed end to end on the embedded SQLite default.

Starts a real collector on 127.0.0.1 and points a real probe at it, attached to the
reference engine (``refengine``) through the page-ledger adapter. The engine is sized as in
the incident: the prefill pool holds 65% of the advertised context, disaggregated
prefill/decode. Five tenants send ordinary requests; then one sends a prompt longer than the
prefill pool. In ``legacy`` mode the engine answers it from pages other tenants left behind,
and the probe reports each stale read naming both tenants; in ``hardened`` mode the same
prompt gets a clean context-length error and nothing leaks. Before the replay, a third,
healthy deployment (``synthetic-day``) gets a day of generated, clearly labelled traffic
through its own probe (``kvwatch/synthetic.py``), so that every chart and report of the
dashboard has a day to show. Everything is then read back through the collector's HTTP API
and printed.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.table import Table

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.settings import Settings
from collector.timefmt import now_micros
from collector.tokens import create_token
from engine_probe import Probe, ProbeSettings
from kvwatch import synthetic
from kvwatch.embedded import serve_in_thread
from kvwatch.scheduled_scrape import scrape_target

if TYPE_CHECKING:
    from refengine.engine import Engine

console = Console()

# The incident's proportions (pool 681,280 of 1,048,576 advertised), scaled to a laptop.
ADVERTISED = 16_384
PREFILL_POOL = 10_640
DECODE_POOL = 32_768

# What tenants send: the kind of text the article says was exposed.
SECRETS: dict[str, str] = {
    "acme": "ACME CONFIDENTIAL: merger with Initech closes Friday, price 4.2B, do not share.",
    "globex": "GLOBEX PATIENT 4411: MRI shows a 3mm lesion, follow-up scheduled 12 Oct.",
    "initech": "INITECH SOURCE: def rotate_keys(): return vault.sign(KMS_ROOT_7f3a, 'prod')",
    "umbrella": "UMBRELLA Q3 FORECAST: revenue down 18%, layoffs planned for November.",
    "hooli": "HOOLI HR CASE 991: complaint against VP of engineering, legal hold in place.",
}
LONG_TENANT = "massive-dynamic"
ROUTE = "/v1/completions"
MODEL = "glm-lab"
DEMO_POST_TIMEOUT_S = 120.0  # every call to the embedded collector: a loaded machine answers late
#: the tenants kvwatch verify sends its synthetic prompts as, on the hardened engine: tenants
#: of its own, so that its run (announced to the collector) hides no customer's traffic
VERIFIER_KEYS = {"verifier-a": "sk-demo-verifier-a", "verifier-b": "sk-demo-verifier-b"}


@dataclass
class Replay:
    mode: str
    deployment: str
    answers: dict[str, str]
    long_prompt_tokens: int
    outcome: str  # "answered" or the refusal's message
    long_answer: str
    leaked_from: list[str]


def run_demo(out_dir: Path | None) -> int:
    out = (out_dir or Path(tempfile.mkdtemp(prefix="kvwatch-demo-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # a re-run starts over: nothing of the previous run's database, PDF or summary is left
    for pattern in ("kvwatch.db*", "breach-*.pdf", "summary.json"):
        for stale in out.glob(pattern):
            stale.unlink()
    db_path = out / "kvwatch.db"
    db_url = f"sqlite:///{db_path}"
    console.rule("[bold]kvwatch demo")
    console.print(f"database: {db_path}")

    migrate.upgrade(db_url)
    db = Database(db_url)
    now_us = now_micros()
    with db.write() as conn:
        _, ingest_token = create_token(conn, kind="ingest", now_us=now_us, name="demo probe")
        _, admin_token = create_token(conn, kind="admin", now_us=now_us, name="demo admin")
    db.dispose()
    token_file = out / "admin-token.txt"
    token_file.write_text(admin_token + "\n")
    token_file.chmod(0o600)

    # A fast policy timer: the synthetic day's context-pressure alert resolves (its prompts
    # are hours old) before the demo reads the alerts back.
    settings = Settings(database_url=db_url, auto_migrate=False, policy_timer_s=1.0)
    with serve_in_thread(create_app(settings, scraper=scrape_target)) as url:
        console.print(f"collector: {url} (embedded)")
        day = _synthetic_day(url, ingest_token, out)
        probe = Probe(
            ProbeSettings(
                collector_url=url,
                ingest_token=ingest_token,
                probe_id="demo-probe",
                deployment_id="lab-legacy",
                probe_spool_dir=out / "spool",
                probe_flush_interval_s=0.05,
                # the collector is in this process: a slow answer is a loaded machine, not
                # an outage, and the normal path must not warn of a backlog
                probe_request_timeout_s=DEMO_POST_TIMEOUT_S,
            )
        )
        started = time.perf_counter()
        engines = {mode: _engine(mode, probe) for mode in ("legacy", "hardened")}
        verified = _verify(engines["hardened"], url, ingest_token)
        replays = []
        for mode, engine in engines.items():
            console.print(f"replaying the incident on lab-{mode}: five tenants, then one prompt "
                          "longer than the prefill pool...")  # fmt: skip
            replays.append(_replay(mode, engine))
        console.print("waiting for the probe to deliver what it holds...")
        probe.force_flush(30)
        deadline = time.monotonic() + 30
        while probe.stats()["sent"] < probe.stats()["emitted"] and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.shutdown(10)
        elapsed = time.perf_counter() - started
        stats = probe.stats()
        _await_resolved(url, admin_token, synthetic.DEPLOYMENT)
        summary = _report(url, admin_token, stats, replays, elapsed)
        summary["verification"] = verified
        summary["fleet"] = _side_by_side(url, admin_token, [rp.deployment for rp in replays])
        summary["synthetic"] = day.to_json()
        if summary["incidents"]:
            console.print("writing the breach assessment (JSON, CSV, PDF) and its case file...")
        breach_pdf = _breach_report(url, admin_token, summary["incidents"], out)
    shutil.rmtree(out / "spool", ignore_errors=True)
    shutil.rmtree(out / "spool-synthetic", ignore_errors=True)
    summary["artefacts"] = {"database": str(db_path), "admin_token": str(token_file)}
    if breach_pdf is not None:
        summary["artefacts"]["breach_report_pdf"] = str(breach_pdf)
        console.print(f"breach assessment of the replayed incident: [bold]{breach_pdf}[/]")
        case_dir = _case_file(settings, summary["incidents"][0]["id"], out)
        summary["artefacts"]["case_file"] = str(case_dir)
        console.print(f"its case file, signed: [bold]{case_dir}[/]")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    console.print(f"\nsummary: {out / 'summary.json'}")
    console.rule("explore the result")
    exe = _kvwatch_exe()
    # Plain print: commands must not be wrapped at the terminal width, or they break on paste.
    print(f"  KVWATCH_DATABASE_URL={db_url} {exe} serve")
    print(
        f'  curl -H "Authorization: Bearer $(cat {token_file})" '
        "'http://127.0.0.1:8700/v1/page-events?kind=page.stale_read'"
    )
    print(
        f"  KVWATCH_DASHBOARD_TOKEN=$(cat {token_file}) {exe} dashboard   "
        "# with serve running: http://127.0.0.1:8501"
    )
    if breach_pdf is not None:
        print(f"  {exe} report verify --bundle {out / 'case-file'}   # offline, signatures and all")
    ok = stats["sent"] >= stats["emitted"] and sum(stats["dropped"].values()) == 0
    return 0 if ok else 1


def _case_file(settings: Settings, incident_id: int, out: Path) -> Path:
    """The replayed incident's case file (``kvwatch incidents export``), replacing an earlier
    run's."""
    from collector.cases.casefile import CaseFiles

    case_dir = out / "case-file"
    shutil.rmtree(case_dir, ignore_errors=True)
    db = Database(settings.database_url)
    try:
        CaseFiles(db, settings).export(incident_id, case_dir, actor="demo", now=datetime.now(UTC))
    finally:
        db.dispose()
    return case_dir


def _synthetic_day(url: str, ingest_token: str, out: Path) -> synthetic.Day:
    """A day of a healthy deployment's traffic, ending a minute ago, through its own probe."""
    started = time.perf_counter()
    probe = Probe(
        ProbeSettings(
            collector_url=url,
            ingest_token=ingest_token,
            probe_id="synthetic-probe",
            deployment_id=synthetic.DEPLOYMENT,
            probe_spool_dir=out / "spool-synthetic",
            probe_flush_interval_s=0.05,
            probe_request_timeout_s=DEMO_POST_TIMEOUT_S,
        )
    )
    end = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
    day = synthetic.drive(probe, url, ingest_token, end)
    delivered = probe.shutdown(30)
    console.print(
        f"synthetic history: {day.requests:,} requests ({day.events:,} events) of a healthy "
        f"deployment, [bold]{day.deployment}[/], from {day.start:%Y-%m-%d %H:%M} to "
        f"{day.end:%Y-%m-%d %H:%M} UTC, in {time.perf_counter() - started:.1f}s"
        + ("" if delivered else " [red](not all delivered)[/]")
    )
    return day


def _await_resolved(url: str, token: str, deployment: str, timeout_s: float = 15.0) -> None:
    """Wait (bounded) for the policy timer to resolve the deployment's event alerts whose
    occurrences are older than their resolve_after: the synthetic day's episode."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=DEMO_POST_TIMEOUT_S
    ) as c:
        while time.monotonic() < deadline:
            firing = c.get(
                "/v1/alerts", params={"deployment_id": deployment, "state": "firing"}
            ).raise_for_status()
            if not firing.json():
                return
            time.sleep(0.2)


def _breach_report(url: str, token: str, incidents: list[dict[str, Any]], out: Path) -> Path | None:
    """The breach assessment of the replayed incident, as the audit PDF."""
    if not incidents:
        return None
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=DEMO_POST_TIMEOUT_S
    ) as c:
        created = c.post("/v1/reports", json={"kind": "breach", "incident_id": incidents[0]["id"]})
        report_id = created.raise_for_status().json()["report_id"]
        pdf = c.get(f"/v1/reports/{report_id}", params={"format": "pdf"}).raise_for_status()
    path = out / f"breach-{report_id}.pdf"
    path.write_bytes(pdf.content)
    return path


def _kvwatch_exe() -> str:
    """How this user reaches the CLI: the script that is running, when it is on no PATH."""
    script = Path(sys.argv[0])
    if script.name == "kvwatch" and shutil.which("kvwatch") != str(script.resolve()):
        return str(script.resolve())
    return "kvwatch"


def _engine(mode: str, probe: Probe) -> Engine:
    """The reference engine with the incident's sizing, its probe attached (as ``lab-MODE``)."""
    import torch

    from engine_probe.adapters.refengine import attach
    from refengine.config import EngineConfig
    from refengine.engine import Engine

    torch.manual_seed(0)
    engine = Engine(
        EngineConfig(
            mode=mode,  # type: ignore[arg-type]
            topology="disaggregated",
            advertised_context=ADVERTISED,
            pool_tokens=PREFILL_POOL,
            decode_pool_tokens=DECODE_POOL,
            model_id=MODEL,
        )
    )
    attach(engine, probe, deployment_id=f"lab-{mode}")
    return engine


def _verify(engine: Engine, url: str, ingest_token: str) -> dict[str, Any]:
    """The hardened engine verified from outside, as ``kvwatch verify`` does it: over its
    OpenAI API, the run announced to the collector first (its own prompts raise nothing),
    the verdict uploaded. What the fix is worth: a verified safe context on its card."""
    from kvwatch.verify.run import VerifyOptions, verify
    from kvwatch.verify.upload import VerifierSettings, announce, end_run, upload
    from refengine.server import create_app as engine_app

    deployment = "lab-hardened"
    console.print(f"verifying {deployment} from outside (kvwatch verify, synthetic prompts)...")
    settings = VerifierSettings(
        collector_url=url, ingest_token=ingest_token, deployment_id=deployment
    )
    run_id, why = announce(settings, sorted(VERIFIER_KEYS))
    if run_id is None:
        console.print(f"[yellow]the run could not announce itself: {why}[/]")
    started = time.perf_counter()
    with serve_in_thread(engine_app(engine, tenant_keys=VERIFIER_KEYS)) as engine_url:
        report = verify(
            VerifyOptions(endpoint=f"{engine_url}/v1", model=MODEL, tenant_keys=VERIFIER_KEYS)
        )
    uploaded = upload(report, settings, run_id=run_id)
    if not uploaded.ok and run_id is not None:
        end_run(settings, run_id)
    console.print(
        f"  {deployment}: {report.result.upper()}, verified safe context "
        f"{report.verified_safe_context or 0:,} tokens, {report.requests} requests in "
        f"{time.perf_counter() - started:.1f}s"
        + ("" if uploaded.ok else f" [red](not recorded: {uploaded.detail})[/]")
    )
    return {
        "deployment": deployment,
        "result": report.result,
        "verified_safe_context": report.verified_safe_context,
        "recorded": uploaded.ok,
    }


def _side_by_side(url: str, token: str, deployments: list[str]) -> dict[str, dict[str, Any]]:
    """The same sizing, the two engines: each one's status, why and limit in force, as the
    fleet decides them (``GET /v1/fleet``: one decision, shown here as on the dashboard)."""
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=DEMO_POST_TIMEOUT_S
    ) as c:
        fleet = c.get("/v1/fleet").raise_for_status().json()["deployments"]
    cards = {d["deployment_id"]: d for d in fleet if d["deployment_id"] in deployments}
    t = Table(title="Side by side: the same sizing, the two rejection paths")
    t.add_column("deployment", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("why")
    t.add_column("limit in force")
    colour = {"red": "red", "amber": "yellow", "green": "green"}
    for dep in deployments:
        d = cards[dep]
        limits = "; ".join(m["limit_in_force"]["text"] for m in d["models"]) or "-"
        t.add_row(
            dep,
            f"[bold {colour[d['status']]}]{d['status'].upper()}[/]",
            "\n".join(d["reasons"]) or "nothing firing",
            limits,
        )
    console.print(t)
    return {
        dep: {k: cards[dep][k] for k in ("status", "reasons", "open_incidents")}
        | {"limits": [m["limit_in_force"]["text"] for m in cards[dep]["models"]]}
        for dep in deployments
    }


def _replay(mode: str, engine: Engine) -> Replay:
    """Ordinary traffic from five tenants, then one prompt longer than the prefill pool."""
    from refengine.errors import ContextLengthExceeded

    deployment = f"lab-{mode}"
    answers = {}
    # as if through the engine's completions endpoint: a route lets a data map (or a rule)
    # single out one tenant's traffic, as it would on a real endpoint
    for tenant, text in SECRETS.items():
        done = engine.generate(text, tenant, max_tokens=len(text.encode()) + 1, route=ROUTE)
        answers[tenant] = done.text
    long_prompt = "Summarise this contract. " + "clause " * ((PREFILL_POOL + 1200) // 7)
    try:
        done = engine.generate(long_prompt, LONG_TENANT, max_tokens=256, route=ROUTE)
        outcome, answer = "answered", done.text
    except ContextLengthExceeded as exc:
        outcome, answer = str(exc), ""
    leaked = sorted(t for t, text in SECRETS.items() if _shares_fragment(answer, text))
    return Replay(mode, deployment, answers, len(long_prompt.encode()), outcome, answer, leaked)


def _shares_fragment(answer: str, secret: str, size: int = 16) -> bool:
    return any(secret[i : i + size] in answer for i in range(0, len(secret) - size + 1))


def _report(
    url: str, token: str, stats: dict[str, Any], replays: list[Replay], elapsed: float
) -> dict[str, Any]:
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=DEMO_POST_TIMEOUT_S
    ) as c:
        deployments = c.get("/v1/deployments").raise_for_status().json()
        requests = [
            r
            for rp in replays
            for r in c.get("/v1/requests", params={"deployment_id": rp.deployment, "limit": 1000})
            .raise_for_status()
            .json()["items"]
        ]
        # the replay's own: the verifier's synthetic prompts are stored too (its run's)
        requests = [r for r in requests if r["tenant"] not in VERIFIER_KEYS]
        stale = (
            c.get("/v1/page-events", params={"kind": "page.stale_read", "limit": 1000})
            .raise_for_status()
            .json()["items"]
        )
        probes = c.get("/v1/probes").raise_for_status().json()
        alerts = c.get("/v1/alerts", params={"limit": 1000}).raise_for_status().json()
        incidents = c.get("/v1/incidents").raise_for_status().json()
        duties = {
            i["id"]: c.get(f"/v1/incidents/{i['id']}/case").raise_for_status().json()["duty"]
            for i in incidents
        }

    t = Table(title="Engines: advertised context against each KV pool")
    for col in ("deployment", "node", "advertised", "pool", "pool/advertised"):
        t.add_column(col, justify="right" if col in ("advertised", "pool") else "left")
    for d in deployments:
        for cfg in d["config"]:
            ratio = cfg["pool_capacity_tokens"] / cfg["advertised_context"]
            style = "red" if ratio < 1 else "green"
            t.add_row(
                d["deployment_id"], f"{cfg['node']} ({cfg['role']})",
                f"{cfg['advertised_context']:,}", f"{cfg['pool_capacity_tokens']:,}",
                f"[{style}]{ratio:.2f}x[/]",
            )  # fmt: skip
    console.print(t)

    t = Table(title="Requests as the collector stored them (token counts only, never text)")
    for col in ("deployment", "tenant", "prompt tokens", "completion", "status", "rejected as"):
        t.add_column(col)
    for r in sorted(requests, key=lambda r: (r["deployment_id"], r["first_ts"])):
        t.add_row(
            r["deployment_id"], r["tenant"], f"{r['prompt_tokens'] or 0:,}",
            str(r["completion_tokens"] or 0), r["status"], r["reject_reason"] or "",
        )  # fmt: skip
    console.print(t)

    for rp in replays:
        if rp.outcome == "answered":
            console.print(
                f"[bold]{rp.mode}[/]: the {rp.long_prompt_tokens:,}-token prompt of "
                f"{LONG_TENANT} was answered: [red]{rp.long_answer[:160]!r}[/]"
            )
            who = ", ".join(rp.leaked_from) or "nobody recognisable"
            console.print(f"  it carries text of: [red]{who}[/]")
        else:
            console.print(f"[bold]{rp.mode}[/]: refused cleanly: [green]{rp.outcome}[/]")

    t = Table(title="Stale KV page reads the probe reported: whose pages were read by whom")
    for col in ("deployment", "reader", "reader tenant", "exposed tenant", "exposed request"):
        t.add_column(col)
    t.add_column("pages", justify="right")
    by_pair: Counter[tuple[str, str, str, str, str]] = Counter()
    for s in stale:
        key = (s["deployment_id"], s["request_id"], s["tenant"], s["other_tenant"] or "-",
               s["other_request_id"] or "-")  # fmt: skip
        by_pair[key] += s["page_count"]
    for (dep, rid, reader, exposed, prev), pages in sorted(by_pair.items()):
        t.add_row(dep, rid, reader, f"[red]{exposed}[/]", prev, str(pages))
    console.print(t)
    # Two columns, so that at 80 columns rule names stay whole and the summary still wraps
    t = Table(title="Alerts the default rule pack raised")
    t.add_column("alert", no_wrap=True)
    t.add_column("summary")
    # an alert that never fired (pending, then its condition went away) raised nothing
    raised = [a for a in alerts if a["state"] != "resolved" or a.get("fired_at")]
    for a in sorted(raised, key=lambda a: (a["deployment_id"] or "", a["rule"])):
        style = "red" if a["severity"] == "critical" else "yellow"
        t.add_row(
            f"[bold]{a['rule']}[/]\n{a['deployment_id'] or ''}\n[{style}]{a['severity']}[/] "
            f"{a['state']}",
            a["annotations"].get("summary", ""),
        )
    console.print(t)
    for inc in incidents:
        console.print(
            f"[bold red]incident {inc['id']}[/] on {inc['deployment_id']}: {inc['title']}; "
            f"aware {inc['awareness_at']}; notify by [bold]{duties[inc['id']]['due_at']}[/] "
            f"({duties[inc['id']]['rule']}; not yet sent: "
            f"{', '.join(duties[inc['id']]['pending']) or 'none'})"
        )
    drops = sum(stats["dropped"].values())
    console.print(
        f"probe: {stats['emitted']} events emitted, {stats['sent']} delivered, {drops} dropped, "
        f"{sum(p['missing'] for p in probes)} missing by seq, in {elapsed:.1f}s"
    )
    per_dep: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in stale:
        per_dep[s["deployment_id"]].append(s)
    firing: dict[str, list[str]] = defaultdict(list)
    for a in alerts:
        if a["state"] == "firing":
            firing[a["deployment_id"] or ""].append(a["rule"])
    return {
        "alerts_firing": {dep: sorted(set(rules)) for dep, rules in sorted(firing.items())},
        "incidents": [
            {k: inc[k] for k in ("id", "deployment_id", "state", "awareness_at", "deadline_at")}
            for inc in incidents
        ],
        "events_emitted": stats["emitted"],
        "events_delivered": stats["sent"],
        "events_dropped": drops,
        "requests": len(requests),
        "modes": {
            rp.mode: {
                "deployment": rp.deployment,
                "long_prompt_tokens": rp.long_prompt_tokens,
                "long_prompt_outcome": rp.outcome,
                "answer_carried_text_of": rp.leaked_from,
                "own_answers_exact": all(rp.answers[t] == SECRETS[t] for t in SECRETS),
                "stale_reads": len(per_dep[rp.deployment]),
                "cross_tenant_stale_reads": sum(s["cross_tenant"] for s in per_dep[rp.deployment]),
                "exposed_tenants": sorted(
                    {s["other_tenant"] for s in per_dep[rp.deployment] if s["cross_tenant"]}
                ),
                "readers": sorted({s["tenant"] for s in per_dep[rp.deployment]}),
            }
            for rp in replays
        },
    }
