"""``engine_version_advisory``: engine versions with known defects, under the configuration in
which they bite (e.g. SGLang below 0.5.22 with prefill/decode disaggregation)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Iterator
from datetime import datetime
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from policies.facts import BatchFacts, NodeConfig, TimerFacts
from policies.kinds.base import RuleKind
from policies.kinds.pool import all_configs, touched_configs
from policies.rule import Rule
from policies.signals import Severity, Signal
from policies.yamlfile import YamlDoc, checked

_CONDITIONS = {
    "disaggregated": bool,
    "prefix_caching": bool,
    "prefix_cache_salting": bool,
    "cuda_graphs": bool,
    "role": str,
    "quantization": str,
    "tp_size": int,
}


class Advisory(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")]
    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    affected: str
    summary: str
    severity: Severity = "warning"
    when: dict[str, Any] = {}
    references: list[str] = []

    def matches(self, cfg: NodeConfig) -> bool:
        if cfg.engine.lower() != self.engine.lower():
            return False
        try:
            if Version(cfg.engine_version) not in SpecifierSet(self.affected, prereleases=True):
                return False
        except InvalidVersion:
            return False  # a version nobody can compare; config_drift/inventory show it
        return all(getattr(cfg, k) == v for k, v in self.when.items())


class AdvisoryFile(msgspec.Struct, forbid_unknown_fields=True):
    advisories: list[Advisory]


def load_advisories(path: Path) -> tuple[Advisory, ...]:
    """An advisory file, validated (file, line and field in every error)."""
    doc = YamlDoc.read(path)
    parsed = doc.convert(doc.data, AdvisoryFile)
    seen: set[str] = set()
    for i, a in enumerate(parsed.advisories):
        at = ("advisories", i)
        checked(doc, at, partial(_check, a, seen))
    return tuple(parsed.advisories)


def _check(a: Advisory, seen: set[str]) -> None:
    if a.id in seen:
        raise ValueError(f"id: {a.id!r} appears twice")
    seen.add(a.id)
    try:
        SpecifierSet(a.affected)
    except InvalidSpecifier:
        raise ValueError(
            f"affected: not a version specifier such as '<0.5.22': {a.affected!r}"
        ) from None
    for key, value in a.when.items():
        want = _CONDITIONS.get(key)
        if want is None:
            raise ValueError(f"when.{key}: unknown condition; known: {sorted(_CONDITIONS)}")
        if type(value) is not want:
            raise ValueError(f"when.{key}: expected {want.__name__}, got {value!r}")


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
        "A node runs an engine version with a known advisory under its configuration "
        "(builtin: SGLang < 0.5.22 with disaggregation); the advisory's severity wins."
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
                        "summary": f"{c.engine} {c.engine_version} on node {c.node}: {a.summary}",
                        "references": " ".join(a.references),
                    },
                )

    def on_batch(self, rule: Rule, facts: BatchFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, touched_configs(facts))

    def on_timer(self, rule: Rule, facts: TimerFacts, now: datetime) -> Iterable[Signal]:
        return self._eval(rule, all_configs(facts))
