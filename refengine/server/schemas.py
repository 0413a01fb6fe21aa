"""The request bodies, as pydantic models (strict: a wrong JSON type is a 400, never coerced;
fields not listed are accepted and ignored), and the chat template that turns ``messages``
into the one prompt string the engine takes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from refengine.server.errors import APIError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class CompletionBody(BaseModel):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    cache_salt: str | None = Field(default=None, min_length=1)


class CompletionRequest(CompletionBody):
    """``POST /v1/completions``; fields not listed are accepted and ignored."""

    prompt: str | list[str]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(CompletionBody):
    """``POST /v1/chat/completions``; fields not listed are accepted and ignored."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``prompt``, or chat ``messages`` rendered with the
    chat template. ``add_generation_prompt`` and ``add_special_tokens`` are accepted and change
    nothing (the template has no generation prompt; no special token is ever added)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The chat template: one ``"{role}: {content}\\n"`` line per message."""
    lines = []
    for i, m in enumerate(messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported; "
                        "only 'text' parts are",
                        param=f"messages.{i}.content.{j}",
                    )
                texts.append(part.text)
            content = "".join(texts)
        lines.append(f"{m.role}: {content}\n")
    return "".join(lines)
