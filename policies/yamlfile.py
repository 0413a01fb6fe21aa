"""YAML files validated into typed structs, with errors that name file, line and field.

PyYAML builds the node tree (which knows each value's line); msgspec converts the plain data
into the target struct and says where it failed as a path (``$.rules[2].params.x``); the
path is looked up in the node tree to give the line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from policies.errors import PackError

T = TypeVar("T")
PathKey = tuple[str | int, ...]
_AT = re.compile(r" - at `\$(.*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_FIELD_IN_MESSAGE = re.compile(r"(?:unknown|missing required) field `([^`]+)`")


class YamlDoc:
    """A parsed YAML document and the line of every value in it."""

    def __init__(self, path: str, text: str):
        self.path = path
        self.lines: dict[PathKey, int] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            self.data: Any = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            raise PackError(path, line, None, f"not valid YAML: {exc.problem or exc}") from None
        except yaml.YAMLError as exc:
            raise PackError(path, None, None, f"not valid YAML: {exc}") from None
        if node is not None:
            self._walk(node, ())

    @classmethod
    def read(cls, path: Path) -> YamlDoc:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PackError(str(path), None, None, f"cannot read: {exc}") from None
        return cls(str(path), text)

    def _walk(self, node: yaml.Node, at: PathKey) -> None:
        self.lines[at] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                k = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
                self.lines[(*at, k, "<key>")] = key.start_mark.line + 1
                self._walk(value, (*at, k))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, (*at, i))

    def line_of(self, at: PathKey, key: bool = False) -> int | None:
        """The line of the value at ``at`` (of its key, with ``key``), or of the nearest
        enclosing value that has one."""
        if key and (*at, "<key>") in self.lines:
            return self.lines[(*at, "<key>")]
        while at:
            if at in self.lines:
                return self.lines[at]
            at = at[:-1]
        return self.lines.get(())

    def error(self, at: PathKey, message: str, key: bool = False) -> PackError:
        return PackError(self.path, self.line_of(at, key), dotted(at) or None, message)

    def convert(self, data: Any, type_: type[T], at: PathKey = ()) -> T:
        """``data`` (found at ``at`` in this document) as ``type_``, or a PackError."""
        try:
            return msgspec.convert(data, type_, strict=True)
        except msgspec.ValidationError as exc:
            raise self._translate(str(exc), at) from None

    def convert_fields(
        self,
        data: Any,
        type_: type[T],
        at: PathKey,
        problems: Problems,
        skip: tuple[str, ...] = (),
    ) -> T | None:
        """``data`` (found at ``at``) as ``type_``, each field checked on its own so that every
        bad, unknown or missing field lands in ``problems`` (msgspec stops at the first);
        None when any did. Fields named in ``skip`` are the caller's to check (they must have
        defaults: they are left out of the struct built here)."""
        if not isinstance(data, dict):
            return problems.attempt(lambda: self.convert(data, type_, at))
        fields = msgspec.structs.fields(type_)  # type: ignore[arg-type]
        known = {f.encode_name for f in fields}
        bad = False
        for key in data:
            if key not in known:
                problems.add(
                    self.error((*at, str(key)), f"object contains unknown field `{key}`", key=True)
                )
                bad = True
        for f in fields:
            name = f.encode_name
            if name in skip:
                continue
            if name not in data:
                if f.required:
                    problems.add(
                        PackError(
                            self.path,
                            self.line_of(at),
                            dotted((*at, name)),
                            f"object missing required field `{name}`",
                        )
                    )
                    bad = True
                continue
            try:
                msgspec.convert(data[name], f.type, strict=True)
            except msgspec.ValidationError as exc:
                problems.add(self._translate(str(exc), (*at, name)))
                bad = True
        if bad:
            return None
        rest = {k: v for k, v in data.items() if k not in skip}
        return problems.attempt(lambda: self.convert(rest, type_, at))

    def _translate(self, message: str, at: PathKey) -> PackError:
        m = _AT.search(message)
        text = message[: m.start()] if m else message
        path: PathKey = at
        if m:
            for name, index in _STEP.findall(m.group(1)):
                path = (*path, int(index) if index else name)
        named = _FIELD_IN_MESSAGE.search(text)
        if named and "unknown" in text:  # point at the offending key itself
            return self.error((*path, named.group(1)), _lower(text), key=True)
        if named:
            return PackError(
                self.path, self.line_of(path), dotted((*path, named.group(1))), _lower(text)
            )
        return self.error(path, _lower(text))


def dotted(at: PathKey) -> str:
    out = ""
    for step in at:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:] if text else text


def checked(doc: YamlDoc, at: PathKey, check: Callable[[], T]) -> T:
    """Run a semantic check; its ``ValueError("field: message")`` becomes a PackError at
    ``at`` + field."""
    try:
        return check()
    except ValueError as exc:
        text = str(exc)
        field, sep, rest = text.partition(": ")
        if sep and re.fullmatch(r"[A-Za-z_][\w.]*", field):
            return _raise(doc.error((*at, *field.split(".")), rest))
        return _raise(doc.error(at, text))


def _raise(exc: PackError) -> Any:
    raise exc


class Problems:
    """The errors found while validating a document, gathered so that one pass reports them
    all (:meth:`raise_any` raises them as one :class:`PackError`)."""

    def __init__(self) -> None:
        self.errors: list[PackError] = []

    def add(self, exc: PackError) -> None:
        self.errors.extend(exc.errors)

    def attempt(self, step: Callable[[], T]) -> T | None:
        """``step()``, or None with its PackError(s) recorded."""
        try:
            return step()
        except PackError as exc:
            self.add(exc)
            return None

    def raise_any(self) -> None:
        if self.errors:
            raise PackError.of(self.errors)
