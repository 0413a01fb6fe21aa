"""Rule packs: YAML files of rules, validated on load.

A pack::

    pack: default                       # its name; a later pack of the same name replaces it
    description: ...
    group_by: [alertname, deployment_id]  # notifications group alerts by these labels
    repeat_interval: 4h                 # re-notify a firing, unacknowledged alert this often
    incidents:
      deadline: 72h                     # GDPR Art. 33: from awareness
      reminders_before: [48h, 24h, 6h, 1h]
    rules:
      - name: context_pressure          # unique across the loaded packs; the alertname
        kind: context_pressure          # one of policies.kinds.KINDS
        severity: warning               # default: the kind's
        for: 0s                         # pending this long before firing
        resolve_after: 1h               # event rules: resolve after this long without one
        enabled: true
        labels: {team: platform}
        annotations: {runbook: "https://...?deployment={deployment_id}"}
        params: {warn_ratio: 0.8}       # the kind's parameters
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Annotated, Any

import msgspec

from policies.durations import parse_duration
from policies.errors import PackError
from policies.kinds import KINDS
from policies.rule import Rule
from policies.signals import Severity
from policies.yamlfile import YamlDoc, checked

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
Duration = str | int | float


class IncidentSpec(msgspec.Struct, forbid_unknown_fields=True):
    deadline: Duration = "72h"
    reminders_before: list[Duration] = msgspec.field(
        default_factory=lambda: ["48h", "24h", "6h", "1h"]
    )


class RuleSpec(msgspec.Struct, forbid_unknown_fields=True, rename={"for_": "for"}):
    name: Name
    kind: str
    severity: Severity | None = None
    enabled: bool = True
    for_: Duration = 0
    resolve_after: Duration | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    params: dict[str, Any] = {}


class PackSpec(msgspec.Struct, forbid_unknown_fields=True):
    pack: Name
    rules: list[RuleSpec]
    description: str = ""
    group_by: list[str] = msgspec.field(default_factory=lambda: ["alertname", "deployment_id"])
    repeat_interval: Duration = "4h"
    incidents: IncidentSpec = msgspec.field(default_factory=IncidentSpec)


@dataclass(frozen=True, slots=True)
class RulePack:
    name: str
    path: str
    description: str
    rules: tuple[Rule, ...]


@dataclass(frozen=True)
class RuleSet:
    """The rules in force: every loaded pack's, names unique."""

    packs: tuple[RulePack, ...] = ()
    rules: tuple[Rule, ...] = field(default=())

    @classmethod
    def of(cls, packs: Iterable[RulePack]) -> RuleSet:
        """Later packs replace earlier ones of the same name; rule names must then be
        unique (a clash names both files)."""
        by_name: dict[str, RulePack] = {}
        for p in packs:
            by_name[p.name] = p
        seen: dict[str, Rule] = {}
        for p in by_name.values():
            for r in p.rules:
                if r.name in seen:
                    first = seen[r.name]
                    path, _, line = r.source.rpartition(":")
                    raise PackError(
                        path,
                        int(line) if line.isdigit() else None,
                        "name",
                        f"rule {r.name!r} is already defined at {first.source}",
                    )
                seen[r.name] = r
        return cls(packs=tuple(by_name.values()), rules=tuple(seen.values()))

    def enabled(self) -> Iterator[Rule]:
        return (r for r in self.rules if r.enabled)

    def rule(self, name: str) -> Rule | None:
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Rule]:
        return {r.name: r for r in self.rules}


def _seconds(doc: YamlDoc, at: tuple[str | int, ...], value: Duration) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise doc.error(at, str(exc)) from None


def parse_pack(doc: YamlDoc, base_dir: Path) -> RulePack:
    """A parsed document as a validated pack (PackError on the first problem)."""
    if not isinstance(doc.data, dict):
        raise PackError(
            doc.path, doc.line_of(()), None, "a rule pack is a mapping with 'pack' and 'rules'"
        )
    spec = doc.convert(doc.data, PackSpec)
    for i, label in enumerate(spec.group_by):
        if not LABEL_NAME.match(label):
            raise doc.error(("group_by", i), f"not a label name: {label!r}")
    repeat = _seconds(doc, ("repeat_interval",), spec.repeat_interval)
    if repeat <= 0:
        raise doc.error(("repeat_interval",), "must be positive")
    deadline = _seconds(doc, ("incidents", "deadline"), spec.incidents.deadline)
    reminders = tuple(
        sorted(
            (
                _seconds(doc, ("incidents", "reminders_before", i), v)
                for i, v in enumerate(spec.incidents.reminders_before)
            ),
            reverse=True,
        )
    )
    for i, r in enumerate(reminders):
        if not 0 < r < deadline:
            raise doc.error(
                ("incidents", "reminders_before", i),
                "a reminder must fall between awareness and the deadline",
            )
    rules = []
    names: set[str] = set()
    for i, rs in enumerate(spec.rules):
        at: tuple[str | int, ...] = ("rules", i)
        kind = KINDS.get(rs.kind)
        if kind is None:
            raise doc.error((*at, "kind"), f"unknown kind {rs.kind!r}; known: {sorted(KINDS)}")
        if rs.name in names:
            raise doc.error((*at, "name"), f"rule {rs.name!r} appears twice in this pack")
        names.add(rs.name)
        for key in rs.labels:
            if not LABEL_NAME.match(key) or key in ("alertname", "severity"):
                raise doc.error(
                    (*at, "labels", key), f"label name {key!r} is not allowed", key=True
                )
        params = doc.convert(rs.params, kind.params, (*at, "params"))
        checked(doc, (*at, "params"), partial(kind.check, params))
        params = checked(doc, (*at, "params"), partial(kind.prepare, params, base_dir))
        resolve = (
            kind.default_resolve_after_s
            if rs.resolve_after is None
            else _seconds(doc, (*at, "resolve_after"), rs.resolve_after)
        )
        rules.append(
            Rule(
                name=rs.name,
                kind=rs.kind,
                severity=rs.severity or kind.default_severity,
                params=params,
                for_s=_seconds(doc, (*at, "for"), rs.for_),
                resolve_after_s=resolve,
                enabled=rs.enabled,
                labels=dict(rs.labels),
                annotations=dict(rs.annotations),
                group_by=tuple(spec.group_by),
                repeat_interval_s=repeat,
                incident_deadline_s=deadline,
                reminders_before_s=reminders,
                pack=spec.pack,
                source=f"{doc.path}:{doc.line_of(at)}",
            )
        )
    return RulePack(name=spec.pack, path=doc.path, description=spec.description, rules=tuple(rules))


def load_pack(path: str | Path) -> RulePack:
    """One pack file, validated."""
    p = Path(path)
    return parse_pack(YamlDoc.read(p), p.parent)


def default_pack() -> RulePack:
    """The pack that ships inside the package."""
    ref = importlib.resources.files("policies") / "packs" / "default.yaml"
    with importlib.resources.as_file(ref) as path:
        return load_pack(path)


def pack_files(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        raise PackError(str(d), None, None, "not a directory of rule packs")
    return sorted([*d.glob("*.yaml"), *d.glob("*.yml")])


def load_ruleset(directory: str | Path | None = None, *, include_default: bool = True) -> RuleSet:
    """The default pack, then every ``*.yaml``/``*.yml`` in ``directory`` (sorted by name)."""
    packs = [default_pack()] if include_default else []
    if directory is not None:
        packs.extend(load_pack(p) for p in pack_files(directory))
    return RuleSet.of(packs)
