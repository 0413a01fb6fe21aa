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
        runbook_url: https://wiki.example/kv  # optional: replaces the kind's runbook link
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

from policies.durations import parse_duration
from policies.errors import PackError
from policies.kinds import KINDS
from policies.rule import Rule
from policies.signals import Severity
from policies.yamlfile import Problems, YamlDoc, checked

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
    runbook_url: str | None = None


class PackSpec(msgspec.Struct, forbid_unknown_fields=True):
    """A pack's top level. ``rules`` (each a :class:`RuleSpec`) and ``incidents`` (an
    :class:`IncidentSpec`) are converted one by one, so that every rule's problems are
    reported, not the first rule's only."""

    pack: Name
    rules: list[Any]
    description: str = ""
    group_by: list[str] = msgspec.field(default_factory=lambda: ["alertname", "deployment_id"])
    repeat_interval: Duration = "4h"
    incidents: dict[str, Any] = {}


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
        unique (each clash names both files; all are reported together)."""
        by_name: dict[str, RulePack] = {}
        for p in packs:
            by_name[p.name] = p
        seen: dict[str, Rule] = {}
        problems = Problems()
        for p in by_name.values():
            for r in p.rules:
                if r.name in seen:
                    first = seen[r.name]
                    path, _, line = r.source.rpartition(":")
                    problems.add(
                        PackError(
                            path,
                            int(line) if line.isdigit() else None,
                            "name",
                            f"rule {r.name!r} is already defined at {first.source}",
                            rule=r.name,
                        )
                    )
                    continue
                seen[r.name] = r
        problems.raise_any()
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
    """A parsed document as a validated pack. Every problem is found in one pass: a
    :class:`PackError` names one, a :class:`~policies.errors.PackErrors` several (each
    naming its line, field and, inside a rule, the rule's name)."""
    if not isinstance(doc.data, dict):
        raise PackError(
            doc.path, doc.line_of(()), None, "a rule pack is a mapping with 'pack' and 'rules'"
        )
    problems = Problems()
    spec = doc.convert_fields(doc.data, PackSpec, (), problems)
    group_by: tuple[str, ...] = ("alertname", "deployment_id")
    repeat = 4 * 3600.0
    if spec is not None:
        group_by = tuple(spec.group_by)
        for i, label in enumerate(group_by):
            if not LABEL_NAME.match(label):
                problems.add(doc.error(("group_by", i), f"not a label name: {label!r}"))
        seconds = problems.attempt(
            partial(_seconds, doc, ("repeat_interval",), spec.repeat_interval)
        )
        if seconds is not None and seconds <= 0:
            problems.add(doc.error(("repeat_interval",), "must be positive"))
        elif seconds is not None:
            repeat = seconds
    deadline, reminders = _incidents(doc, problems)
    rules: list[Rule] = []
    raw_rules = doc.data.get("rules")
    names: set[str] = set()
    for i, data in enumerate(raw_rules if isinstance(raw_rules, list) else []):
        found = len(problems.errors)
        rule = _rule(doc, base_dir, i, data, names, problems)
        name = data.get("name") if isinstance(data, dict) else None
        for e in problems.errors[found:]:
            if isinstance(name, str) and e.path == doc.path and e.rule is None:
                e.rule = name
        if rule is not None:
            rules.append(rule)
    problems.errors.sort(key=lambda e: e.line or 0)  # in file order (stable within a line)
    problems.raise_any()
    assert spec is not None
    pack_rules = tuple(
        replace(
            r,
            group_by=group_by,
            repeat_interval_s=repeat,
            incident_deadline_s=deadline,
            reminders_before_s=reminders,
            pack=spec.pack,
        )
        for r in rules
    )
    return RulePack(name=spec.pack, path=doc.path, description=spec.description, rules=pack_rules)


def _incidents(doc: YamlDoc, problems: Problems) -> tuple[float, tuple[float, ...]]:
    """The incident deadline and reminders (seconds, reminders latest first)."""
    at: tuple[str | int, ...] = ("incidents",)
    default = IncidentSpec()
    spec = default
    if isinstance(doc.data.get("incidents"), dict):
        spec = doc.convert_fields(doc.data["incidents"], IncidentSpec, at, problems) or default
    deadline = problems.attempt(partial(_seconds, doc, (*at, "deadline"), spec.deadline))
    if deadline is None:
        deadline = parse_duration(default.deadline)
    reminders = []
    for i, v in enumerate(spec.reminders_before):
        seconds = problems.attempt(partial(_seconds, doc, (*at, "reminders_before", i), v))
        if seconds is not None and not 0 < seconds < deadline:
            problems.add(
                doc.error(
                    (*at, "reminders_before", i),
                    "a reminder must fall between awareness and the deadline",
                )
            )
        elif seconds is not None:
            reminders.append(seconds)
    return deadline, tuple(sorted(reminders, reverse=True))


def _rule(
    doc: YamlDoc,
    base_dir: Path,
    i: int,
    data: Any,
    names: set[str],
    problems: Problems,
) -> Rule | None:
    """Rule ``i`` of the pack, or None with its problems recorded: the rule's fields, then
    (whenever its kind is known, even if another field is wrong) its parameters."""
    at: tuple[str | int, ...] = ("rules", i)
    rs = doc.convert_fields(data, RuleSpec, at, problems)
    kind_name = data.get("kind") if isinstance(data, dict) else None
    kind = KINDS.get(kind_name) if isinstance(kind_name, str) else None
    if isinstance(kind_name, str) and kind is None:
        problems.add(
            doc.error((*at, "kind"), f"unknown kind {kind_name!r}; known: {sorted(KINDS)}")
        )
    name = data.get("name") if isinstance(data, dict) else None
    if isinstance(name, str):
        if name in names:
            problems.add(doc.error((*at, "name"), f"rule {name!r} appears twice in this pack"))
        names.add(name)
    labels = data.get("labels") if isinstance(data, dict) else None
    if isinstance(labels, dict):
        for key in labels:
            if not LABEL_NAME.match(str(key)) or key in ("alertname", "severity"):
                problems.add(
                    doc.error((*at, "labels", key), f"label name {key!r} is not allowed", key=True)
                )
    params = None
    raw_params = data.get("params", {}) if isinstance(data, dict) else None
    if kind is not None and isinstance(raw_params, dict):
        pat = (*at, "params")
        params = doc.convert_fields(raw_params, kind.params, pat, problems)
        if params is not None:
            found = len(problems.errors)
            problems.attempt(partial(checked, doc, pat, partial(kind.check, params)))
            if len(problems.errors) == found:
                params = problems.attempt(
                    partial(checked, doc, pat, partial(kind.prepare, params, base_dir))
                )
            else:
                params = None
    bad_url = rs is not None and rs.runbook_url is not None and not _is_http_url(rs.runbook_url)
    if bad_url:
        assert rs is not None
        problems.add(doc.error((*at, "runbook_url"), f"not an http(s) URL: {rs.runbook_url!r}"))
    durations = {}
    if rs is not None:
        durations["for"] = problems.attempt(partial(_seconds, doc, (*at, "for"), rs.for_))
        if rs.resolve_after is not None:
            durations["resolve_after"] = problems.attempt(
                partial(_seconds, doc, (*at, "resolve_after"), rs.resolve_after)
            )
    if rs is None or bad_url or kind is None or params is None or None in durations.values():
        return None
    resolve = durations.get("resolve_after")
    return Rule(
        name=rs.name,
        kind=rs.kind,
        severity=rs.severity or kind.default_severity,
        params=params,
        for_s=durations["for"] or 0.0,
        resolve_after_s=kind.default_resolve_after_s if resolve is None else resolve,
        enabled=rs.enabled,
        labels=dict(rs.labels),
        annotations=dict(rs.annotations),
        source=f"{doc.path}:{doc.line_of(at)}",
        runbook_url=rs.runbook_url,
    )


def _is_http_url(value: str) -> bool:
    """A link a person's browser and a receiver can follow: http(s) with a host."""
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and value.strip() == value


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
    """The default pack, then every ``*.yaml``/``*.yml`` in ``directory`` (sorted by name).
    Every problem of every file is reported together (then the clashes between files)."""
    packs = [default_pack()] if include_default else []
    if directory is not None:
        problems = Problems()
        for path in pack_files(directory):
            pack = problems.attempt(partial(load_pack, path))
            if pack is not None:
                packs.append(pack)
        problems.raise_any()
    return RuleSet.of(packs)


def check_path(path: str | Path) -> RuleSet:
    """What ``kvwatch policies check PATH`` validates: a pack file together with the default
    pack (a rule name clashing with the default pack's is an error; a pack named ``default``
    replaces it), or a directory as the collector loads ``KVWATCH_POLICY_PACKS_DIR``. Raises
    :class:`PackError` with every problem found."""
    p = Path(path)
    if p.is_dir():
        return load_ruleset(p)
    return RuleSet.of([default_pack(), load_pack(p)])
