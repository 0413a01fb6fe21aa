"""``engine_version_advisory``: engine versions with known defects, under the configuration in
which they bite (e.g. SGLang below 0.5.22 with prefill/decode disaggregation)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from engine_probe import events as ev
from policies.facts import BatchFacts, NodeConfig, TimerFacts, connector_family
from policies.kinds.base import RuleKind
from policies.kinds.pool import all_configs, touched_configs
from policies.rule import Rule
from policies.signals import Severity, Signal
from policies.yamlfile import YamlDoc, checked

# Conditions an advisory's ``when`` may name: a node config's settings, and three read off
# its offload tiers (``tier``: a tier on that medium; ``tier_backend``: a tier held by that
# backend; ``tier_unsalted``: a tier whose key does not carry the request's cache_salt).
# A value may be a list: one of them.
_CONDITIONS: dict[str, type] = {
    "disaggregated": bool,
    "prefix_caching": bool,
    "prefix_cache_salting": bool,
    "cuda_graphs": bool,
    "role": str,
    "quantization": str,
    "tp_size": int,
    "dtype": str,
    "tier": str,
    "tier_backend": str,
    "tier_unsalted": bool,
}


def _observed(cfg: NodeConfig, key: str) -> frozenset[object]:
    """What a node config shows for a condition: one value, or one per offload tier."""
    match key:
        case "tier":
            return frozenset(t.medium for t in cfg.kv_tiers)
        case "tier_backend":
            return frozenset((t.backend or "").lower() for t in cfg.kv_tiers)
        case "tier_unsalted":
            return frozenset({any(t.salted is False for t in cfg.kv_tiers)})
        case "role" | "quantization" | "dtype":
            value = getattr(cfg, key)
            return frozenset({value.lower() if isinstance(value, str) else value})
        case _:
            return frozenset({getattr(cfg, key)})


def _wanted(value: Any) -> frozenset[object]:
    values = value if isinstance(value, list) else [value]
    return frozenset(v.lower() if isinstance(v, str) else v for v in values)


def _in(version: str | None, spec: str) -> bool:
    if version is None:
        return False  # a version nobody reported cannot be said affected
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False  # a version nobody can compare; config_drift/inventory show it


class Examples(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Node configs the advisory must fire on, and near misses it must stay quiet on: each a
    map of ``engine.config`` fields over a plain config of the advisory's engine (checked
    when the file is loaded, so a row that cannot fire is refused with its line)."""

    fires: list[dict[str, Any]] = []
    quiet: list[dict[str, Any]] = []


class Advisory(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    affected: str
    summary: str
    severity: Severity = "warning"
    when: dict[str, Any] = {}
    connector: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    connector_affected: str | None = None
    action: str = ""
    references: list[str] = []
    examples: Examples = Examples()

    def matches(self, cfg: NodeConfig) -> bool:
        if cfg.engine.lower() != self.engine.lower():
            return False
        if not _in(cfg.engine_version, self.affected):
            return False
        if self.connector is not None:
            if connector_family(self.connector) != cfg.kv_connector_family():
                return False
            if self.connector_affected is not None and not _in(
                cfg.kv_connector_version, self.connector_affected
            ):
                return False
        return all(_observed(cfg, k) & _wanted(v) for k, v in self.when.items())

    def example(self, overrides: dict[str, Any]) -> NodeConfig:
        """A plain node config of this advisory's engine with ``overrides`` applied."""
        values: dict[str, Any] = {
            "deployment_id": "example",
            "node": "node-0",
            "role": "both",
            "engine": self.engine,
            "engine_version": "0",
            "model_id": "example",
            "advertised_context": 8192,
            "pool_capacity_tokens": 8192,
            "dtype": "auto",
            "quantization": None,
            "tp_size": 1,
            "cuda_graphs": False,
            "disaggregated": False,
            "prefix_caching": False,
            "prefix_cache_salting": False,
            "ts": _EPOCH,
        }
        for key, value in overrides.items():
            if key not in values and key not in _EXAMPLE_EXTRA:
                raise ValueError(f"{key}: not an engine.config field an example can set")
            values[key] = value
        values["kv_tiers"] = tuple(
            msgspec.convert(t, ev.KvTier, strict=True) for t in values.get("kv_tiers", ())
        )
        return NodeConfig(**values)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EXAMPLE_EXTRA = frozenset({"kv_connector", "kv_connector_version", "kv_tiers"})


class AdvisoryFile(msgspec.Struct, forbid_unknown_fields=True):
    advisories: list[Advisory]


def load_advisories(path: Path) -> tuple[Advisory, ...]:
    """An advisory file, validated (file, line and field in every error), each row's
    examples run: it fires on every ``examples.fires`` and on no ``examples.quiet``."""
    doc = YamlDoc.read(path)
    parsed = doc.convert(doc.data, AdvisoryFile)
    seen: set[str] = set()
    for i, a in enumerate(parsed.advisories):
        at = ("advisories", i)
        checked(doc, at, partial(_check, a, seen))
    return tuple(parsed.advisories)


def _spec(field: str, spec: str, example: str) -> None:
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        raise ValueError(
            f"{field}: not a version specifier such as {example!r}: {spec!r}"
        ) from None


def _check(a: Advisory, seen: set[str]) -> None:
    if a.id in seen:
        raise ValueError(f"id: {a.id!r} appears twice")
    seen.add(a.id)
    _spec("affected", a.affected, "<0.5.22")
    if a.connector_affected is not None:
        if a.connector is None:
            raise ValueError("connector_affected: needs connector (whose versions it names)")
        _spec("connector_affected", a.connector_affected, "<=0.5.2")
    for key, value in a.when.items():
        want = _CONDITIONS.get(key)
        if want is None:
            raise ValueError(f"when.{key}: unknown condition; known: {sorted(_CONDITIONS)}")
        values = value if isinstance(value, list) else [value]
        if not values or any(type(v) is not want for v in values):
            raise ValueError(
                f"when.{key}: expected {want.__name__} or a list of them, got {value!r}"
            )
    for group, want_hit in (("fires", True), ("quiet", False)):
        for j, overrides in enumerate(getattr(a.examples, group)):
            try:
                hit = a.matches(a.example(overrides))
            except (ValueError, TypeError, msgspec.ValidationError) as exc:
                raise ValueError(f"examples.{group}.{j}: {exc}") from None
            if hit != want_hit:
                said = "does not fire" if want_hit else "fires"
                raise ValueError(f"examples.{group}.{j}: the advisory {said} on this config")


@cache
def builtin_advisories() -> tuple[Advisory, ...]:
    ref = importlib.resources.files("policies") / "data" / "advisories.yaml"
    with importlib.resources.as_file(ref) as path:
        return load_advisories(path)


class AdvisoryParams(msgspec.Struct, forbid_unknown_fields=True):
    include_builtin: bool = True
    files: list[str] = []
    # filled in at load from the files above (relative paths: to the pack's directory)
    loaded: tuple[Advisory, ...] = ()


class EngineVersionAdvisory(RuleKind):
    name = "engine_version_advisory"
    params = AdvisoryParams
    default_severity = "warning"
    mode = "state"
    description = (
        "A node runs an engine version (and KV connector version) with a known advisory "
        "under its configuration (builtin: policies/data/advisories.yaml); the advisory's "
        "severity wins."
    )

    def prepare(self, params: AdvisoryParams, base_dir: Path) -> AdvisoryParams:
        loaded: list[Advisory] = []
        for i, name in enumerate(params.files):
            path = Path(name) if Path(name).is_absolute() else base_dir / name
            if not path.is_file():
                raise ValueError(f"files.{i}: no such advisory file: {path}")
            loaded.extend(load_advisories(path))  # its own errors name its own file
        return msgspec.structs.replace(params, loaded=tuple(loaded))

    def _eval(self, rule: Rule, configs: Iterable[NodeConfig]) -> Iterator[Signal]:
        p: AdvisoryParams = rule.params
        advisories = (*builtin_advisories(), *p.loaded) if p.include_builtin else p.loaded
        for c in configs:
            for a in advisories:
                hit = a.matches(c)
                yield rule.signal(
                    "state",
                    {"deployment_id": c.deployment_id, "node": c.node, "advisory": a.id},
                    severity=a.severity,
                    firing=hit,
                    annotations={
                        "summary": f"{_what(c, a)} on node {c.node}: {a.summary}",
                        "action": a.action,
                        "references": " ".join(a.references),
                    },
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, touched_configs(facts))

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, all_configs(facts))


def _what(c: NodeConfig, a: Advisory) -> str:
    """The versions the advisory fired on, as the summary names them."""
    out = f"{c.engine} {c.engine_version}"
    if a.connector is not None and c.kv_connector:
        out += f" with {c.kv_connector} {c.kv_connector_version or '(version unknown)'}"
    return out
