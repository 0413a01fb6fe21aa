"""``kvwatch demo``: the whole pipeline on the embedded SQLite default.

Starts a real collector on 127.0.0.1, points a real probe at it, emits a mixed multi-tenant
workload that walks into the incident's failure chain (a prefill pool smaller than the
advertised context, over-pool prompts rejected while their KV is still transferred, stale
page reads), then reads everything back through the HTTP API and prints it.

The workload is synthetic until the reference engine drives the demo (it will replace
``_workload``); every other part is the production code path.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from collector import migrate
from collector.app import create_app
from collector.db import Database
from collector.models import to_micros
from collector.settings import Settings
from collector.tokens import create_token
from engine_probe import Probe, ProbeSettings
from engine_probe import events as ev
from kvwatch.embedded import serve_in_thread

console = Console()

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class Node:
    deployment: str
    node: str
    role: ev.Role
    engine: str
    version: str
    model: str
    advertised: int
    pool: int
    disaggregated: bool


NODES = (
    Node(
        "glm-prod", "prefill-0", "prefill", "sglang", "0.5.21", "glm-5.3", 1_048_576, 681_280, True
    ),
    Node(
        "glm-prod", "decode-0", "decode", "sglang", "0.5.21", "glm-5.3", 1_048_576, 2_097_152, True
    ),
    Node(
        "llama-prod", "node-0", "both", "vllm", "0.11.0", "llama-3.1-70b", 131_072, 262_144, False
    ),
)


def run_demo(out_dir: Path | None) -> int:
    out = (out_dir or Path(tempfile.mkdtemp(prefix="kvwatch-demo-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("kvwatch.db*"):
        stale.unlink()
    db_path = out / "kvwatch.db"
    db_url = f"sqlite:///{db_path}"
    console.rule("[bold]kvwatch demo")
    console.print(f"database: {db_path}")

    migrate.upgrade(db_url)
    db = Database(db_url)
    now_us = to_micros(datetime.now(UTC))
    with db.write() as conn:
        _, ingest_token = create_token(conn, kind="ingest", now_us=now_us, name="demo probe")
        _, admin_token = create_token(conn, kind="admin", now_us=now_us, name="demo admin")
    db.dispose()
    token_file = out / "admin-token.txt"
    token_file.write_text(admin_token + "\n")
    token_file.chmod(0o600)

    settings = Settings(database_url=db_url, auto_migrate=False)
    with serve_in_thread(create_app(settings)) as url:
        console.print(f"collector: {url} (embedded)")
        probe = Probe(
            ProbeSettings(
                collector_url=url,
                ingest_token=ingest_token,
                probe_id="demo-probe-1",
                deployment_id="glm-prod",
                probe_spool_dir=out / "spool",
                probe_flush_interval_s=0.05,
            )
        )
        started = time.perf_counter()
        emitted = _workload(probe, random.Random(20260827))
        probe.force_flush(30)
        deadline = time.monotonic() + 30
        while probe.stats()["sent"] < emitted and time.monotonic() < deadline:
            time.sleep(0.05)
        probe.shutdown(10)
        elapsed = time.perf_counter() - started
        stats = probe.stats()
        summary = _report(url, admin_token, stats, emitted, elapsed)
    shutil.rmtree(out / "spool", ignore_errors=True)
    summary["artefacts"] = {"database": str(db_path), "admin_token": str(token_file)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    console.print(f"\nsummary: {out / 'summary.json'}")
    console.rule("explore the result")
    exe = _kvwatch_exe()
    # Plain print: commands must not be wrapped at the terminal width, or they break on paste.
    print(f"  KVWATCH_DATABASE_URL={db_url} {exe} serve")
    print(
        f'  curl -H "Authorization: Bearer $(cat {token_file})" '
        "'http://127.0.0.1:8700/v1/requests?min_prompt_tokens=500000'"
    )
    print(f"  KVWATCH_DATABASE_URL={db_url} {exe} dashboard   # once the dashboard lands")
    ok = stats["sent"] >= emitted and sum(stats["dropped"].values()) == 0
    return 0 if ok else 1


def _kvwatch_exe() -> str:
    """How this user reaches the CLI: the script that is running, when it is on no PATH."""
    script = Path(sys.argv[0])
    if script.name == "kvwatch" and shutil.which("kvwatch") != str(script.resolve()):
        return str(script.resolve())
    return "kvwatch"


def _workload(probe: Probe, rnd: random.Random) -> int:
    """Two hours of traffic on two deployments, five tenants. Returns events emitted."""
    t0 = datetime.now(UTC) - timedelta(hours=2)
    n = 0
    for node in NODES:
        probe.emit(
            ev.EngineConfig,
            ts=t0,
            deployment_id=node.deployment,
            engine=node.engine,
            engine_version=node.version,
            model_id=node.model,
            node=node.node,
            role=node.role,
            advertised_context=node.advertised,
            pool_capacity_tokens=node.pool,
            page_size=64,
            dtype="fp8" if node.engine == "sglang" else "bf16",
            tp_size=8,
            cuda_graphs=True,
            disaggregated=node.disaggregated,
            prefix_caching=True,
            prefix_cache_salting=False,
        )
        n += 1
    recent: list[tuple[str, str]] = []  # (request_id, tenant) whose pages decode may reuse
    for i in range(600):
        ts = t0 + timedelta(seconds=12 * i)
        glm = rnd.random() < 0.6
        dep, model = ("glm-prod", "glm-5.3") if glm else ("llama-prod", "llama-3.1-70b")
        tenant = rnd.choice(TENANTS)
        rid = f"req-{i:05d}"
        route = rnd.choice(ROUTES)
        limit = 681_280 if glm else 131_072
        prompt = min(int(rnd.lognormvariate(8.5, 1.6)), 120_000)
        if glm and i % 40 == 7:
            prompt = rnd.randint(560_000, 1_000_000)  # long-context traffic
        common: dict[str, Any] = {
            "ts": ts,
            "deployment_id": dep,
            "request_id": rid,
            "tenant": tenant,
        }
        cats = rnd.sample(["source_code", "pii", "financial", "health"], k=rnd.randint(0, 2))
        if prompt > limit:
            probe.emit(
                ev.RequestRejected,
                **common,
                route=route,
                model_id=model,
                reason="pool_exhausted",
                prompt_tokens=prompt,
                limit_tokens=limit,
                node="prefill-0",
                data_categories=cats,
            )
            # The legacy rejection path: partial KV still goes to decode, which reads
            # pages another tenant's request left behind.
            probe.emit(
                ev.KvTransfer,
                ts=ts,
                deployment_id=dep,
                request_id=rid,
                tenant=tenant,
                from_node="prefill-0",
                to_node="decode-0",
                pages=1,
                tokens=1,
                prefill_rejected=True,
            )
            n += 2
            victims = [r for r in recent if r[1] != tenant][-2:]
            for prev_rid, prev_tenant in victims:
                probe.emit(
                    ev.PageStaleRead,
                    ts=ts,
                    deployment_id=dep,
                    node="decode-0",
                    role="decode",
                    reader_request_id=rid,
                    reader_tenant=tenant,
                    page_ids=[rnd.randrange(32_768) for _ in range(4)],
                    previous_request_id=prev_rid,
                    previous_tenant=prev_tenant,
                )
                n += 1
            probe.emit(
                ev.RequestFinished,
                **common,
                completion_tokens=rnd.randint(20, 200),
                status="completed",
                node="decode-0",
            )
            n += 1
            continue
        probe.emit(
            ev.RequestAdmitted,
            **common,
            route=route,
            model_id=model,
            prompt_tokens=prompt,
            max_tokens=1024,
            node="prefill-0" if glm else "node-0",
            data_categories=cats,
        )
        probe.emit(
            ev.RequestFinished,
            **common,
            completion_tokens=rnd.randint(1, 1024),
            status="completed" if rnd.random() > 0.02 else "error",
        )
        n += 2
        if glm:
            recent = [*recent, (rid, tenant)][-16:]
        if i % 5 == 0:
            for node in NODES:
                used = min(node.pool, int(node.pool * rnd.uniform(0.2, 0.95)))
                probe.emit(
                    ev.PoolSample,
                    ts=ts,
                    deployment_id=node.deployment,
                    node=node.node,
                    role=node.role,
                    capacity_tokens=node.pool,
                    used_tokens=used,
                    free_tokens=node.pool - used,
                )
                n += 1
    return n


def _report(
    url: str, token: str, stats: dict[str, Any], emitted: int, elapsed: float
) -> dict[str, Any]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        deployments = c.get("/v1/deployments").raise_for_status().json()
        requests: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000} | ({"cursor": cursor} if cursor else {})
            page = c.get("/v1/requests", params=params).raise_for_status().json()
            requests += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        stale = (
            c.get("/v1/page-events", params={"kind": "page.stale_read", "limit": 1000})
            .raise_for_status()
            .json()["items"]
        )
        probes = c.get("/v1/probes").raise_for_status().json()

    t = Table(title="Deployments: advertised context against the KV pool")
    for col in ("deployment", "node", "engine", "model", "advertised", "pool", "pool/advertised"):
        t.add_column(col, justify="right" if col in ("advertised", "pool") else "left")
    safe: dict[str, int] = {}
    for d in deployments:
        for cfg in d["config"]:
            ratio = cfg["pool_capacity_tokens"] / cfg["advertised_context"]
            style = "red" if ratio < 1 else "green"
            t.add_row(
                d["deployment_id"],
                cfg["node"],
                f"{cfg['engine']} {cfg['engine_version']}",
                cfg["model_id"],
                f"{cfg['advertised_context']:,}",
                f"{cfg['pool_capacity_tokens']:,}",
                f"[{style}]{ratio:.2f}x[/]",
            )
            key = cfg["model_id"]
            cap = min(cfg["advertised_context"], cfg["pool_capacity_tokens"])
            safe[key] = min(safe.get(key, cap), cap)
    console.print(t)

    by: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    maxp: dict[tuple[str, str], int] = defaultdict(int)
    for r in requests:
        key = (r["model_id"] or "?", r["tenant"])
        by[key]["requests"] += 1
        by[key]["rejected"] += r["reject_reason"] is not None
        p = r["prompt_tokens"] or 0
        maxp[key] = max(maxp[key], p)
        if r["model_id"] in safe and p >= 0.8 * safe[r["model_id"]]:
            by[key]["over_80pct"] += 1
    t = Table(title="Requests per model and tenant (token counts only; no text is stored)")
    for col in ("model", "tenant", "requests", "max prompt", ">= 80% of safe", "rejected"):
        t.add_column(col, justify="left" if col in ("model", "tenant") else "right")
    for (model, tenant), cnt in sorted(by.items()):
        t.add_row(
            model,
            tenant,
            str(cnt["requests"]),
            f"{maxp[(model, tenant)]:,}",
            str(cnt["over_80pct"]),
            str(cnt["rejected"]),
        )
    console.print(t)

    t = Table(title="Stale KV page reads: whose pages ended up in whose answer")
    for col in ("reader request", "reader tenant", "exposed tenant", "exposed request", "pages"):
        t.add_column(col)
    for s in reversed(stale):
        t.add_row(
            s["request_id"],
            s["tenant"],
            f"[red]{s['other_tenant']}[/]",
            s["other_request_id"],
            str(s["page_count"]),
        )
    console.print(t)
    drops = sum(stats["dropped"].values())
    console.print(
        f"probe: {emitted} events emitted, {stats['sent']} delivered, {drops} dropped, "
        f"{sum(p['missing'] for p in probes)} missing by seq, in {elapsed:.2f}s"
    )
    exposed = sorted({s["other_tenant"] for s in stale if s["cross_tenant"]})
    readers = sorted({s["tenant"] for s in stale if s["cross_tenant"]})
    return {
        "events_emitted": emitted,
        "events_delivered": stats["sent"],
        "events_dropped": drops,
        "deployments": len(deployments),
        "requests": len(requests),
        "rejected_requests": sum(r["reject_reason"] is not None for r in requests),
        "max_prompt_tokens": max((r["prompt_tokens"] or 0) for r in requests),
        "stale_reads": len(stale),
        "cross_tenant_stale_reads": sum(s["cross_tenant"] for s in stale),
        "exposed_tenants": exposed,
        "tenants_who_received_foreign_kv": readers,
        "workload": "synthetic (the reference engine replaces it)",
    }
