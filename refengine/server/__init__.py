"""refengine's OpenAI-compatible HTTP server: ``create_app(engine, ...)`` builds it.

Endpoints
---------
``POST /v1/completions`` (``prompt``: one string, or a list holding one string),
``POST /v1/chat/completions`` (``messages``), both non-streaming and SSE streaming
(``"stream": true``: ``data: {chunk}\\n\\n`` lines ending with ``data: [DONE]\\n\\n``; with
``"stream_options": {"include_usage": true}`` a last chunk with empty ``choices`` carries
``usage``), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``POST /tokenize`` (vLLM's shape:
``prompt`` or chat ``messages`` in, ``{"count", "max_model_len", "tokens", "token_strs"}`` out;
the byte tokenizer and the chat template below, so ``count`` equals the ``prompt_tokens`` the
same prompt would be charged; nothing is queued or allocated), ``GET /health`` (no auth:
200 while the engine thread runs, 503 once it has stopped or failed), and ``GET /metrics``
(no auth: Prometheus metrics in vLLM's names, see :mod:`refengine.metrics`).

Shapes follow OpenAI's: ``id`` (the engine's request id, see below), ``object``, ``created``,
``model``, ``choices[0]`` with ``finish_reason`` (``stop`` on end of text, ``length`` on the
token budget), and ``usage`` {``prompt_tokens``, ``completion_tokens``, ``total_tokens``} (the
byte tokenizer's counts; completion tokens include the end-of-text token). Sampling fields
(``temperature``, ``top_p``, ``stop``, ...) are accepted and ignored: the lab model decodes
greedily. ``n`` must be 1. ``max_tokens`` defaults to 16 for completions (as OpenAI's) and to
"as much as fits" for chat; chat's ``max_completion_tokens`` wins over ``max_tokens``.

Prefix cache
------------
``cache_salt`` (vLLM's request field: a non-empty string) salts the prefix cache's keys, as
vLLM's does, whenever the cache is on (``shared`` or ``salted``; ``salted`` adds the tenant
itself); it is accepted and ignored with it off. ``usage`` also carries vLLM's
``prompt_tokens_details: {"cached_tokens": N}`` (the prompt tokens served from the cache, 0
with it off; the streamed final usage chunk too). The model card always says
``prefix_caching`` and ``prefix_cache`` (the mode).

Chat template
-------------
``messages`` become one prompt string, one line per message: ``f"{role}: {content}\\n"``
(a content list contributes its ``text`` parts, concatenated; ``null`` content is empty).
The lab model reads its KV cache back, so a chat answer is that templated prompt.

Tenants and auth
----------------
Every ``/v1`` call needs ``Authorization: Bearer KEY``. With ``tenant_keys`` (NAME -> KEY)
only those keys are accepted and the tenant is NAME; without, every key is accepted and is
its own tenant, named ``key-`` plus the first 16 hex digits of the key's SHA-256 (the key
itself never reaches the engine, its observers, or a log). A missing or unknown key is a 401.

Request ids
-----------
The server names every request (``cmpl-<hex>`` / ``chatcmpl-<hex>``) and hands that name to
the engine, so the response ``id``, the ``X-Request-Id`` response header and what a probe
records are one and the same. A client's own ``X-Request-Id`` header is ignored: ids must be
unique among live requests and must not be choosable by one tenant to collide with (or
probe for) another tenant's.

Errors
------
``{"error": {"message", "type", "param", "code"}}``, as OpenAI's: 400 ``invalid_request_error``
for a body that is not JSON or has bad fields (never a 500); 400 with code
``context_length_exceeded`` (param ``prompt`` or ``messages``) when the engine refuses the
prompt, before anything was generated (streaming too: the refusal comes as that JSON error,
not as a stream); 401 ``invalid_api_key``; 404 ``model_not_found`` when ``model`` names
another model (an absent ``model`` means the served one); 413 for a body over
``max_body_bytes``; 503 once the engine thread has stopped. In ``legacy`` mode a prompt the
engine rejected inside prefill is still answered 200, exactly as the incident's engine did,
and the response says nothing about it: observing that is the probe's job.

Threading
---------
One background thread (:class:`~refengine.server.driver.EngineDriver`, started in the app's
lifespan, stopped at shutdown) drives the engine: ``step()`` while it has work,
``wait_for_work()`` otherwise. Handlers call ``submit`` in a worker thread (it can wait up
to one step for the engine's lock); the engine hands each request's deltas to the event
loop with ``call_soon_threadsafe``. A client that goes away has its request aborted by the
engine thread, between steps.

Modules
-------
:mod:`~refengine.server.app` wires the app (``create_app``); each area is a router module
with its ``build_router``: :mod:`~refengine.server.completions` (both completion routes and
their streams), :mod:`~refengine.server.tokenize`, :mod:`~refengine.server.models` (the served
model: its card, and the check of a request's ``model``) and :mod:`~refengine.server.health`
(``/health`` and ``/metrics``). What they share: :mod:`~refengine.server.auth` (key ->
tenant), :mod:`~refengine.server.bodies` (read within the limit, parse),
:mod:`~refengine.server.schemas` (the bodies and the chat template),
:mod:`~refengine.server.errors` (``APIError`` and its handlers),
:mod:`~refengine.server.driver` (the engine thread) and :mod:`~refengine.server.openapi`.
"""

from refengine.server.app import create_app

__all__ = ["create_app"]
