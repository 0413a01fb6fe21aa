"""Relaying an upstream's server-sent events: whole events, as they arrive, unchanged.

:class:`SseScanner` cuts the byte stream into events and reads each one's JSON on the way
past: the ``usage`` (which the gateway asked for with ``stream_options.include_usage``), the
finish reason, an error, the ``[DONE]`` marker. The one event it may hold back is the final
usage-only chunk (``"choices": []`` with ``usage``) when the client did not ask for it.
"""

from __future__ import annotations

from typing import Any

import msgspec


def _boundary(buf: bytearray) -> int:
    """The end (exclusive) of the first complete event in ``buf``, or -1."""
    ends = [i + n for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
    return min(ends) if ends else -1


class SseScanner:
    def __init__(self, *, strip_usage_chunk: bool) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.error = False
        self.done = False
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete events ``chunk`` finished, less any held back."""
        self._buf += chunk
        out = []
        while (end := _boundary(self._buf)) >= 0:
            event = bytes(self._buf[:end])
            del self._buf[:end]
            if self._keep(event):
                out.append(event)
        return out

    def close(self) -> bytes:
        """What is left after the stream ended (an event without its blank line)."""
        event, self._buf = bytes(self._buf), bytearray()
        return event if event and self._keep(event) else b""

    @property
    def ended_cleanly(self) -> bool:
        return not self.error and (self.done or self.finish_reason is not None)

    def _keep(self, event: bytes) -> bool:
        parts = []
        for line in event.splitlines():
            if line.startswith(b"data:"):
                value = line[5:]
                parts.append(value[1:] if value.startswith(b" ") else value)
        if not parts:
            return True  # a comment or keep-alive
        data = b"\n".join(parts)
        if data.strip() == b"[DONE]":
            self.done = True
            return True
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return True
        if not isinstance(obj, dict):
            return True
        if obj.get("error"):
            self.error = True
        if self.model is None and isinstance(obj.get("model"), str):
            self.model = obj["model"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str) and reason:
                    self.finish_reason = reason
            if self.strip_usage_chunk and not choices and isinstance(usage, dict):
                return False
        return True
