"""The import directions of docs/architecture.md, and what must import light (no torch, no
probe runtime)."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
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
    # engine_probe.scrape: the scheduled scraper translates engine /metrics as `kvwatch
    # scrape` does; it stands alone (see test_scrape_stands_alone).
    "collector": {"collector", "policies", "engine_probe.events", "engine_probe.scrape"},
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
            "collector.migrate",
            "collector.rollups.buckets",
            "collector.notify.payloads",
            "collector.notify.signing",
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
# drives a terminal belongs there (those are the collector's and kvwatch's).
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


def test_scrape_stands_alone() -> None:
    """engine_probe.scrape runs inside the collector: of ours it imports only the events and
    the package's exception classes (its errors are ProbeErrors)."""
    rules = {"engine_probe.events", "engine_probe.errors", "engine_probe.scrape"}
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "engine_probe" / "scrape").rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in OURS and not _allowed(name, rules)
    ]
    assert bad == []


def test_kv_events_stand_alone() -> None:
    """engine_probe.kv_events, like the scraper, imports of ours only the contract and the
    package's exception classes: a collector-side consumer may import it."""
    rules = {"engine_probe.events", "engine_probe.errors", "engine_probe.kv_events"}
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in (ROOT / "engine_probe" / "kv_events").rglob("*.py")
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
    """engine_probe.errors is what the contract and the scraper import beside the events: it
    must stay plain classes that import nothing (no runtime, no third-party package)."""
    assert _imports(ROOT / "engine_probe" / "errors.py") <= {"__future__.annotations"}


def test_nothing_imports_the_front_door() -> None:
    bad = [
        str(p.relative_to(ROOT))
        for pkg in ALLOWED
        for p in (ROOT / pkg).rglob("*.py")
        if any(n == "kvwatch" or n.startswith("kvwatch.") for n in _imports(p))
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
        "import engine_probe.scrape, engine_probe.kv_events\n"
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


@pytest.mark.parametrize("module", ["engine_probe.events", "policies"])
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
    "refengine": {"refengine/errors.py:RefEngineError", "refengine/server.py:APIError"},
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
