"""Counting a prompt's tokens before it is sent on, and saying how it was counted.

In order: the upstream's own tokenizer (``POST /tokenize``, vLLM's and SGLang's shape) where
it has one; else the configured tokenizer (``bytes``: one token per UTF-8 byte, chat rendered
as refengine's ``"role: content\\n"`` lines); else a conservative estimate that is never below
the real count for byte-level BPE or SentencePiece tokenizers: UTF-8 bytes plus a margin for
special tokens, and for chat the UTF-8 bytes of the messages' JSON (which holds every role,
content and tool call plus room for the template's tokens, and of the request's own template
fields: ``chat_template``, ``documents``, ``tools``...). Prompts given as token ids count as
their length, exactly, whatever the method; a batch of more than ``MAX_TOKENIZE_CALLS`` text
prompts is counted locally rather than with one upstream call per prompt.

Input the counter cannot count (chat content parts other than text, ``prompt_embeds``) is
named by :func:`uncountable`; the guard refuses it.

An upstream without ``/tokenize`` is asked again only every ``ENDPOINT_RECHECK_S``; a request
the endpoint cannot count (an unknown model, a timeout) is counted locally on its own.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

from engine_probe.events import PromptCountMethod
from kvwatch.gateway.auth import Caller
from kvwatch.gateway.errors import NoTokenizeEndpoint
from kvwatch.gateway.settings import GatewaySettings
from kvwatch.gateway.upstream import Upstream

log = logging.getLogger("engine_probe.gateway")  # its name before the move: log filters use it

Kind = Literal["completion", "chat"]

# How long a missing tokenize endpoint is taken as missing before it is asked for again.
ENDPOINT_RECHECK_S: Final = 300
# Room for special tokens (BOS, EOS, a generation prompt) in an estimate.
ESTIMATE_MARGIN: Final = 16
# Most upstream /tokenize calls for one request; a larger batch is counted locally.
MAX_TOKENIZE_CALLS: Final = 16
# Fields of a chat request that shape what the upstream's chat template renders: passed to
# /tokenize with the messages, and added to the estimate.
_CHAT_TEMPLATE_FIELDS: Final = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
)


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: int
    method: PromptCountMethod


def _json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(prompt: Any) -> list[Any]:
    """The prompts of a completion request: a string, a token-id list, or a list of either."""
    if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):
        return list(prompt)
    return [prompt]


def _text_of(content: Any) -> str | None:
    """A message's text: a string, or the concatenated ``text`` parts (None: other parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None


def uncountable(kind: Kind, body: dict[str, Any]) -> str | None:
    """Where ``body`` holds input no method can count (the ``param`` to name), else None."""
    if body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    if kind == "chat" and isinstance(messages := body.get("messages"), list):
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text":
                        return f"messages.{i}.content.{j}"
    return None


def token_ids_only(kind: Kind, body: dict[str, Any]) -> int | None:
    """The exact count of a completion request whose prompts are all token ids, else None."""
    if kind != "completion":
        return None
    prompts = _prompts(body.get("prompt"))
    if not all(_is_token_ids(p) for p in prompts):
        return None
    return max(len(p) for p in prompts)


def count_bytes(kind: Kind, body: dict[str, Any]) -> int | None:
    """The byte tokenizer's count (None when the body holds something it cannot render)."""
    if kind == "completion":
        counts = []
        for p in _prompts(body.get("prompt")):
            if isinstance(p, str):
                counts.append(len(p.encode()))
            elif _is_token_ids(p):
                counts.append(len(p))
            else:
                return None
        return max(counts)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    total = 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        text = _text_of(m.get("content"))
        if text is None:
            return None
        total += len(f"{m['role']}: {text}\n".encode())
    return total


def estimate(kind: Kind, body: dict[str, Any]) -> int:
    """An over-estimate of any byte-level tokenizer's count: never fails."""
    if kind == "completion":
        counts = []
        for p in _prompts(body.get("prompt")):
            if isinstance(p, str):
                counts.append(len(p.encode()) + ESTIMATE_MARGIN)
            elif _is_token_ids(p):
                counts.append(len(p))  # exact: token ids are tokens
            else:
                counts.append(_json_size(p) + ESTIMATE_MARGIN)
        return max(counts)
    size = _json_size(body.get("messages"))
    for field in _CHAT_TEMPLATE_FIELDS:
        if field in body:
            size += _json_size(body[field])
    return size + ESTIMATE_MARGIN


class PromptCounter:
    """Counts prompts for the guard. The only state it keeps is whether the upstream has a
    tokenize endpoint at all."""

    def __init__(self, settings: GatewaySettings, upstream: Upstream) -> None:
        self._upstream = upstream
        self._use_endpoint = settings.gateway_tokenize_endpoint
        self._tokenizer = settings.gateway_tokenizer
        # When the endpoint was found missing: it is asked for again after a while (an
        # upstream being redeployed can answer 404 for a moment).
        self._absent_since: float | None = None

    def _endpoint_usable(self) -> bool:
        if not self._use_endpoint:
            return False
        since = self._absent_since
        return since is None or time.monotonic() - since > ENDPOINT_RECHECK_S

    async def count(
        self, kind: Kind, body: dict[str, Any], caller: Caller, request_id: str
    ) -> PromptCount:
        ids = token_ids_only(kind, body)
        if ids is not None:
            # Exact whatever the method; the record names the local one (no upstream call).
            return PromptCount(ids, "bytes" if self._tokenizer == "bytes" else "estimate")
        if self._endpoint_usable():
            n = await self._via_endpoint(kind, body, caller, request_id)
            if n is not None:
                return PromptCount(n, "tokenize_endpoint")
        if self._tokenizer == "bytes":
            n = count_bytes(kind, body)
            if n is not None:
                return PromptCount(n, "bytes")
        return PromptCount(estimate(kind, body), "estimate")

    async def _via_endpoint(
        self, kind: Kind, body: dict[str, Any], caller: Caller, request_id: str
    ) -> int | None:
        requests: list[dict[str, Any]] = []
        counts: list[int] = []
        model = body.get("model")
        base: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
        if kind == "completion":
            for p in _prompts(body.get("prompt")):
                if isinstance(p, str):
                    requests.append(base | {"prompt": p})
                elif _is_token_ids(p):
                    counts.append(len(p))  # exact without asking
                else:
                    return None  # something odd: counted locally
            if len(requests) > MAX_TOKENIZE_CALLS:
                log.debug("a batch of %d prompts: counted locally", len(requests))
                return None
        else:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            extra = {f: body[f] for f in _CHAT_TEMPLATE_FIELDS if f in body}
            requests.append(base | {"messages": messages, "add_generation_prompt": True} | extra)
        for req in requests:
            try:
                n = await self._upstream.tokenize(req, caller, request_id)
            except NoTokenizeEndpoint:
                if self._absent_since is None:
                    log.warning(
                        "the upstream has no POST /tokenize; counting prompts with %s "
                        "(asking again every %d s)",
                        "the byte tokenizer" if self._tokenizer == "bytes" else "an over-estimate",
                        ENDPOINT_RECHECK_S,
                    )
                self._absent_since = time.monotonic()
                return None
            if n is None:
                return None
            if self._absent_since is not None:
                log.info("the upstream's POST /tokenize answers again")
                self._absent_since = None
            counts.append(n)
        return max(counts) if counts else None
