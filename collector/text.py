"""What text may enter the API, and how text an older version stored leaves it.

Entering: every JSON request body, every string in it at any depth (keys too), is checked
once, before the route runs (:func:`check_document`): no lone surrogate (it cannot be
encoded as UTF-8, so it breaks every later response that carries it), no NUL (PostgreSQL
can neither store nor compare it) nor other control character but tab, newline and carriage
return, no number that is not finite (``NaN``, ``Infinity``, ``1e400``) and no integer
beyond 64 bits. The answer is a 422 naming the field (``evidence.leak_pairs.0``), and
nothing is stored.

Leaving: a lone surrogate that a version before this check stored (JSON escapes it, so the
database accepted it) is shown as U+FFFD, the replacement character, and never turns the
response into a 500 (:func:`scrub`, :func:`encode`). The scrub runs only when encoding
failed, so a response without such text costs nothing more.
"""

from __future__ import annotations

import math
import re
from typing import Any

from collector.errors import InvalidInput

# tab, newline and carriage return are text; the other C0 controls, DEL and lone surrogates
# are not (a well-formed surrogate pair never reaches Python as two surrogates)
_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_INT = 2**63 - 1
_MAX_DEPTH = 64
REPLACEMENT = "\ufffd"


def _why(text: str) -> str | None:
    found = _BAD.search(text)
    if found is None:
        return None
    c = found.group()
    if "\ud800" <= c <= "\udfff":
        return f"contains a lone surrogate (U+{ord(c):04X}), which is not text"
    if c == "\x00":
        return "contains a NUL character"
    return f"contains the control character U+{ord(c):04X}"


def _refuse(path: list[str | int], message: str) -> InvalidInput:
    field = ".".join(str(p) for p in path) or "body"
    return InvalidInput(f"{field}: {message}", {"field": field})


def check_document(doc: Any) -> None:
    """Raise :class:`InvalidInput` naming the first string, key or number in ``doc`` (a
    parsed JSON document) that cannot be stored and served back as it came."""
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if (why := _why(value)) is not None:
                raise _refuse(path, why)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not -_MAX_INT - 1 <= value <= _MAX_INT:
                raise _refuse(path, "is out of range (more than 64 bits)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _refuse(path, f"is not a finite number ({value!r})")
        elif len(path) >= _MAX_DEPTH:
            raise _refuse(path, f"nests deeper than {_MAX_DEPTH} levels")
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):  # reversed: the first field is reported first
                if (why := _why(k)) is not None:
                    raise _refuse(path, f"a key {why}")
                stack.append((v, [*path, k]))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in reversed(list(enumerate(value))))


def scrub(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (keys too) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    return value


def encode(text: str) -> bytes:
    """``text`` as UTF-8, a lone surrogate in it shown as U+FFFD."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub(REPLACEMENT, text).encode("utf-8")
