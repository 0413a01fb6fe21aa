"""The import directions of docs/architecture.md, and what must import light (no torch, no
probe runtime)."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"collector", "engine_probe", "policies", "dashboard", "refengine", "kvwatch",
        "migrations", "deploy"}  # fmt: skip

# package -> which of our packages it may import
ALLOWED = {
    "refengine": set(),
    "engine_probe": {"engine_probe"},
    "policies": {"engine_probe.events"},
    # the scheduled scraper's scraper is handed in by `kvwatch serve`, never imported
    "collector": {"collector", "policies", "engine_probe.events"},
    "migrations": {"collector"},
    "dashboard": {"dashboard"},
    # the dashboards are bound to kvwatch by metric names, checked in a real Prometheus
    "deploy": set(),
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a import b` counts as importing a.b: b may be a module or a name in a
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _allowed(name: str, rules: set[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in rules)


def test_import_direction() -> None:
    bad = []
    for pkg, rules in ALLOWED.items():
        for path in (ROOT / pkg).rglob("*.py"):
            for name in _imports(path):
                top = name.split(".")[0]
                if top not in OURS or (top == pkg and pkg != "engine_probe"):
                    continue
                if pkg == "engine_probe" and name.startswith("engine_probe"):
                    continue
                if not _allowed(name, rules):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


# Layers inside collector/, top to bottom. An import may run down or sideways, never up:
# routes call services, services call repositories, and nothing below the routes knows HTTP.
# A module belongs to the layer of its longest listed prefix; "collector" (services) is the
# default for anything not named.
COLLECTOR_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wiring", ("collector.app",)),
    ("routes", ("collector.api",)),
    ("services", ("collector",)),
    (
        "repositories",
        (
            "collector.store",
            "collector.queries",
            "collector.alerting.repository",
            "collector.notify.outbox",
            "collector.audit",
            "collector.deployment_facts",
            "collector.partitions",
            "collector.reports.breach_rows",
            "collector.lost_rows",
            "collector.cases.repository",
        ),
    ),
    (
        "foundation",
        (
            "collector.models",
            "collector.db",
            "collector.errors",
            "collector.settings",
            "collector.timefmt",
            "collector.grace",  # a rotation's grace: constants and their check
            "collector.migrate",
            "collector.rollups.buckets",
            "collector.notify.payloads",
            "collector.notify.signing",
            "collector.signing",  # keys and JWS, no database: what settings names
        ),
    ),
)


def _collector_layer(name: str) -> tuple[int, str]:
    """(rank, layer) of a module or imported name under collector/: longest prefix wins."""
    best = (-1, 0, "")
    for rank, (layer, prefixes) in enumerate(COLLECTOR_LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), rank, layer)
    return best[1], best[2]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_collector_imports_never_run_back_up() -> None:
    bad = []
    for path in (ROOT / "collector").rglob("*.py"):
        here = _module_name(path)
        rank, layer = _collector_layer(here)
        for name in _imports(path):
            if not name.startswith("collector."):
                continue
            their_rank, their_layer = _collector_layer(name)
            if their_rank < rank:
                bad.append(f"{here} ({layer}) imports {name} ({their_layer})")
    assert bad == []


# engine_probe runs inside other people's engines: nothing that serves HTTP, stores, or
# drives a terminal belongs there (those are the collector's and kvwatch's), nor what
# observes an engine from outside (kvwatch's, see STANDING_ALONE).
NOT_IN_AN_ENGINE = {"fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "streamlit",
                    "typer", "rich", "pandas", "collector", "kvwatch", "dashboard"}  # fmt: skip


def test_engine_probe_holds_only_what_observes_an_engine() -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "engine_probe").rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in NOT_IN_AN_ENGINE
    ]
    assert bad == []


# Where an observer lives (docs/architecture.md): inside an engine's process, engine_probe
# (its adapters); talking to an engine or an endpoint from outside, kvwatch/ (the gateway, the
# verifier, the scraper, the KV-events consumer). The two that only translate what an engine
# publishes into the wire contract stand alone: of ours they import the contract, engine_probe's
# plain exception classes, the node id rule (engine_probe.node, as light as the contract), the
# reading of where KV goes past the pool (engine_probe.kv_destinations: the contract and the
# standard library) and themselves, never the collector, the probe's runtime or the rest
# of kvwatch. The collector runs the scraper without importing it: `kvwatch serve` hands it in
# (kvwatch/scheduled_scrape.py wires it, beside the package rather than in it).
STANDING_ALONE = ("kvwatch.scrape", "kvwatch.kv_events")


@pytest.mark.parametrize("package", STANDING_ALONE)
def test_engine_translators_stand_alone(package: str) -> None:
    rules = {"engine_probe.events", "engine_probe.errors", "engine_probe.node",
             "engine_probe.kv_destinations", package}  # fmt: skip
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in ROOT.joinpath(*package.split(".")).rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in OURS and not _allowed(name, rules)
    ]
    assert bad == []


def test_adapter_bookkeeping_imports_no_engine() -> None:
    """An engine adapter's bookkeeping works on plain values: only its hooks (and plugin)
    import or read the engine (docs/architecture.md, adding an engine adapter)."""
    paths = sorted((ROOT / "engine_probe" / "adapters").glob("*/bookkeeping.py"))
    assert [p.parent.name for p in paths] == ["sglang", "vllm"]
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in _imports(path)
        if name.split(".")[0] in {"vllm", "sglang"}
    ]
    assert bad == []


def test_probe_errors_are_a_leaf() -> None:
    """engine_probe.errors is what the contract, kvwatch.scrape and kvwatch.kv_events import
    beside the events: it must stay plain classes that import nothing (no runtime, no
    third-party package)."""
    assert _imports(ROOT / "engine_probe" / "errors.py") <= {"__future__.annotations"}


def test_nothing_imports_the_front_door() -> None:
    """The collector least of all: what it runs of kvwatch's (the scheduled verifier and
    scraper) is handed in by `kvwatch serve` (create_app(settings, verifier=, scraper=))."""
    bad = [
        str(p.relative_to(ROOT))
        for pkg in ALLOWED
        for p in (ROOT / pkg).rglob("*.py")
        if any(n == "kvwatch" or n.startswith("kvwatch.") for n in _imports(p))
    ]
    assert bad == []


# What `pip install kvwatch` puts into site-packages: the product, nothing of the checkout's
# own (bench/ runs from the checkout, tests/, deploy/'s generators). A top-level `bench` or
# `tests` there would shadow another project's.
SHIPPED = OURS - {"deploy"}
CHECKOUT_ONLY = {"bench", "tests", "deploy"}


def test_the_package_ships_the_product_only() -> None:
    """pyproject's package list, resolved as setuptools resolves it when it builds the wheel
    (namespace packages included: policies/packs and policies/data hold no __init__.py)."""
    from setuptools import find_namespace_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = find_namespace_packages(str(ROOT), include=config["packages"]["find"]["include"])
    assert {name.split(".")[0] for name in found} == SHIPPED
    assert set(config["package-data"]) <= set(found)


def test_the_product_never_imports_what_is_not_shipped() -> None:
    """It would work in the checkout and fail in every installation."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for pkg in SHIPPED
        for path in (ROOT / pkg).rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in CHECKOUT_ONLY
    ]
    assert bad == []


def test_torch_free_packages_import_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import collector.app, collector.store, engine_probe, engine_probe.events\n"
        "import kvwatch.scrape, kvwatch.kv_events\n"
        "import policies, dashboard\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# What the wire contract and the pure policy engine must never pull in: the probe's runtime
# (exporter, spool, its HTTP client and settings, its atexit hook), the collector's web and
# database stack, and torch.
HEAVY = (
    "httpx",
    "torch",
    "fastapi",
    "sqlalchemy",
    "pydantic_settings",
    "engine_probe.exporter",
    "engine_probe.probe",
    "engine_probe.spool",
)


@pytest.mark.parametrize("module", ["engine_probe.events", "engine_probe.node", "policies"])
def test_contract_and_policies_import_light(module: str) -> None:
    """In a fresh interpreter: importing the contract or the policies loads none of HEAVY
    and registers no atexit hook (engine_probe's top level is lazy)."""
    code = (
        "import atexit, sys\n"
        "before = atexit._ncallbacks()\n"
        f"import {module}\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, f'loaded {heavy}'\n"
        "assert atexit._ncallbacks() == before, 'an atexit hook was registered'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_probe_api_still_reachable_from_the_top_level() -> None:
    """The lazy top level still hands out the public API, and only on first use."""
    code = (
        "import sys, engine_probe\n"
        "assert 'engine_probe.probe' not in sys.modules\n"
        "from engine_probe import Probe, ProbeSettings, get_probe\n"
        "assert Probe.__module__ == 'engine_probe.probe'\n"
        "assert ProbeSettings.__module__ == 'engine_probe.settings'\n"
        "try:\n"
        "    engine_probe.nothing_here\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('an unknown name did not raise AttributeError')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


# Each package's one exception root (httpx's model: one documented base per package, errors
# translated at the boundaries), and the boundary types that are deliberately not under it.
EXCEPTION_ROOTS = {
    "collector": {"collector/errors.py:CollectorError"},
    "engine_probe": {"engine_probe/errors.py:ProbeError"},
    "policies": {"policies/errors.py:PolicyError"},
    # APIError is the HTTP answer (see RefEngineError's docstring)
    "refengine": {"refengine/errors.py:RefEngineError", "refengine/server/errors.py:APIError"},
    "dashboard": {"dashboard/errors.py:DashboardError"},
    "kvwatch": {"kvwatch/errors.py:KvwatchError"},
}


def _builtin_exception(base: ast.expr) -> bool:
    value = getattr(builtins, base.id, None) if isinstance(base, ast.Name) else None
    return isinstance(value, type) and issubclass(value, BaseException)


def test_one_exception_root_per_package() -> None:
    """No class in our packages derives from builtin exceptions only (``Exception``,
    ``ValueError``, ...) except the package's documented base: everything else hangs under
    it (and may add a builtin base beside it, as ``ProbeConfigError(ProbeError, ValueError)``)."""
    roots = set()
    for pkg in EXCEPTION_ROOTS:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.ClassDef)
                    and node.bases
                    and all(_builtin_exception(b) for b in node.bases)
                ):
                    roots.add(f"{path.relative_to(ROOT)}:{node.name}")
    assert roots == set().union(*EXCEPTION_ROOTS.values())


def test_alerting_parts_sit_under_their_facade() -> None:
    """collector.alerting.service is the one object the app, ingest and the CLI hold; the
    parts it delegates to (evaluation, notifications, incidents, commands, queries, the facts
    cache) never import it."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "collector" / "alerting").rglob("*.py")
        if path.name != "service.py"
        for name in _imports(path)
        if _allowed(name, {"collector.alerting.service"})
    ]
    assert bad == []


def import_graph() -> dict[str, set[str]]:
    """Package-level edges, read from the same AST walk the tests use: who imports whom.
    engine_probe and kvwatch are split into their subpackages, their ``errors`` and the
    contract (``engine_probe.events``), collector into its layers."""

    def node(name: str) -> str:
        parts = name.split(".")
        if (
            parts[0] in {"engine_probe", "kvwatch"}
            and len(parts) > 1
            and (ROOT.joinpath(*parts[:2]).is_dir() or parts[1] in {"events", "errors"})
        ):
            return ".".join(parts[:2])
        if parts[0] == "collector":
            return f"collector/{_collector_layer(name)[1]}"
        return parts[0]

    graph: dict[str, set[str]] = {}
    for pkg in sorted(OURS):
        for path in (ROOT / pkg).rglob("*.py"):
            here = node(_module_name(path))
            for name in _imports(path):
                if name.split(".")[0] in OURS and node(name) != here:
                    graph.setdefault(here, set()).add(node(name))
    return graph


if __name__ == "__main__":
    # `python tests/test_architecture.py`: the import graph, one line per importer.
    for src, dsts in sorted(import_graph().items()):
        print(f"{src} -> {', '.join(sorted(dsts))}")


# -- the limit in force is decided in one place ------------------------------------------------

# What deciding a prompt limit reads: a verification's verified safe context, the engine's
# advertised context and pool sizes. Outside policies/limits.py, code may show these figures,
# but never combine them into a limit (a min/max over them, a staleness check of a
# verification): that is policies.limits.limit_in_force's, which every consumer reads.
_LIMIT_INPUTS = {
    "verified_safe_context",
    "safe_context",
    "advertised_context",
    "pool_capacity_tokens",
    "prefill_pool_tokens",
    "smallest_leaking_prompt",
}
_DECIDES = {"stale_against", "verified_nodes", "limit_in_force", "with_configured"}
_THE_DECISION = {"policies/limits.py", "policies/facts.py"}
_CONSUMERS = ("collector", "kvwatch", "dashboard", "policies")
# Inside kvwatch, what translates an engine's own figures measures it, like the probe; the
# verifier measures the verified safe context the decision takes as an input, and the demo's
# synthetic day generates prompts against a bound of its own making.
_MEASURE_AN_ENGINE = (
    "kvwatch/scrape/",
    "kvwatch/kv_events/",
    "kvwatch/verify/",
    "kvwatch/synthetic.py",
)


def _names_in(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def limit_deciders(root: Path = ROOT) -> list[str]:
    """Places outside policies.limits that decide a limit: a min() or max() over a limit's
    inputs, or a call of the staleness checks (``stale_against``, ``verified_nodes``)."""
    found = []
    # The consumers of the limit; refengine and the probe measure an engine (its own
    # admission bound, a pool's size), they do not decide what kvwatch holds prompts to.
    for pkg in _CONSUMERS:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in _THE_DECISION or rel.startswith(_MEASURE_AN_ENGINE):
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            # A name bound to an expression over a limit's inputs carries them (``pools =
            # [c.pool_capacity_tokens ...]``, then ``min(pools)``): a pass in source order.
            carried: set[str] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and _names_in(node.value) & (
                    _LIMIT_INPUTS | carried
                ):
                    carried |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
                if name in ("min", "max") and isinstance(fn, ast.Name):
                    used = set().union(*(_names_in(a) for a in node.args)) if node.args else set()
                    inputs = used & (_LIMIT_INPUTS | carried)
                    if inputs:
                        found.append(f"{rel}:{node.lineno}: {name}() over {sorted(inputs)}")
                elif name in _DECIDES - {"limit_in_force", "with_configured"}:
                    found.append(f"{rel}:{node.lineno}: {name}()")
    return found


def test_only_policies_decides_the_limit_in_force() -> None:
    """The rule, the card, the fleet, the reports, the dashboard, /metrics and the gateway
    read policies.limits' one decision (through the collector's collector.limits, or
    GET /v1/limits); a second rule, even one that agrees today, is how they came to disagree."""
    assert limit_deciders() == []


def test_the_limit_check_sees_a_second_rule(tmp_path: Path) -> None:
    """The check above catches the shapes the old rules had (the breach report's own
    min over pools, the gateway's min over verified and configured, a staleness check)."""
    for pkg in _CONSUMERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "collector" / "report.py").write_text(
        "def safe(cfgs, v):\n"
        "    pools = [c.pool_capacity_tokens for c in cfgs]\n"
        "    return min([v.verified_safe_context, *pools])\n"
    )
    (tmp_path / "collector" / "record.py").write_text(
        "def clamp(cfgs, safe):\n"
        "    pools = [c.pool_capacity_tokens for c in cfgs]\n"
        "    return min(pools) if safe > min(pools) else safe\n"
    )
    (tmp_path / "kvwatch" / "guard.py").write_text(
        "def stale(v, c):\n    return bool(v.stale_against(c))\n"
    )
    assert sorted({f.split(":")[0] for f in limit_deciders(tmp_path)}) == [
        "collector/record.py",
        "collector/report.py",
        "kvwatch/guard.py",
    ]
