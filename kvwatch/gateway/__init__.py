"""kvwatch's gateway: an OpenAI-compatible reverse proxy for endpoints that cannot carry the
probe (hosted APIs, engines without it).

Per request it records tenant, route, model id, token counts, status and latency through the
probe core (never text, never keys), and refuses prompts above the model's verified safe
context with OpenAI's 400 ``context_length_exceeded`` before the upstream sees them.

Public API: :func:`create_app`, :class:`GatewaySettings`, the errors in
:mod:`kvwatch.gateway.errors`. Nothing is built at import time.
"""

from kvwatch.gateway.app import create_app
from kvwatch.gateway.errors import GatewayError
from kvwatch.gateway.settings import GatewaySettings

__all__ = ["GatewayError", "GatewaySettings", "create_app"]
