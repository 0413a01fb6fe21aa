"""Connecting to the bus with the settings' credentials, and making sure the stream and its
consumers exist as the settings describe them. Credentials are never printed: what a person
sees of the bus URL is :func:`servers_shown` (no user, no password)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, BadRequestError, NotFoundError

from collector.bus.layout import Layout
from collector.errors import BusUnavailable
from collector.settings import Settings

log = logging.getLogger("kvwatch.bus")


def servers(settings: Settings) -> list[str]:
    if settings.bus_url is None:
        raise ValueError("KVWATCH_BUS_URL is not set")
    return [u.strip() for u in settings.bus_url.get_secret_value().split(",") if u.strip()]


def servers_shown(settings: Settings) -> str:
    """The bus URL as it may be printed or logged: host and port, no credentials."""
    shown = []
    for url in servers(settings):
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        shown.append(urlunsplit((parts.scheme, netloc, "", "", "")))
    return ",".join(shown)


def _tls(settings: Settings) -> ssl.SSLContext | None:
    if settings.bus_tls_ca_file is None and settings.bus_tls_cert_file is None:
        if any(u.startswith("tls://") for u in servers(settings)):
            return ssl.create_default_context()
        return None
    ctx = ssl.create_default_context(
        cafile=str(settings.bus_tls_ca_file) if settings.bus_tls_ca_file else None
    )
    if settings.bus_tls_cert_file is not None:
        ctx.load_cert_chain(
            str(settings.bus_tls_cert_file),
            str(settings.bus_tls_key_file) if settings.bus_tls_key_file else None,
        )
    return ctx


async def connect(
    settings: Settings,
    name: str,
    *,
    on_state: Callable[[str], Awaitable[None]] | None = None,
    timeout_s: float | None = None,
) -> Client:
    """A connection that reconnects for ever (a NATS node restarting, an election) and says
    so in the log; raises :class:`BusUnavailable` if no server answers within
    ``timeout_s`` (default ``bus_connect_timeout_s``)."""
    timeout_s = settings.bus_connect_timeout_s if timeout_s is None else timeout_s

    async def said(what: str) -> None:
        log.warning("bus %s (%s)", what, servers_shown(settings))
        if on_state is not None:
            await on_state(what)

    async def error_cb(exc: Exception) -> None:
        log.warning("bus error: %s", exc)

    opened: list[Client] = []

    async def disconnected_cb() -> None:
        if opened and (opened[0].is_closed or opened[0].is_draining):
            return  # closed on purpose
        await said("disconnected")

    async def reconnected_cb() -> None:
        await said("reconnected")

    options: dict[str, object] = {
        "servers": servers(settings),
        "name": name,
        "connect_timeout": 2,
        "reconnect_time_wait": 0.5,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
    }
    if settings.bus_user is not None:
        options["user"] = settings.bus_user
    if settings.bus_password is not None:
        options["password"] = settings.bus_password.get_secret_value()
    if settings.bus_nkey_seed_file is not None:
        options["nkeys_seed"] = str(settings.bus_nkey_seed_file)
    if settings.bus_creds_file is not None:
        options["user_credentials"] = str(settings.bus_creds_file)
    tls = _tls(settings)
    if tls is not None:
        options["tls"] = tls
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            # the first connect does not retry by itself: an unreachable bus at start is
            # retried here, then refused with the servers named (never their credentials)
            # bounded here: with reconnects unlimited, nats-py's first connect would retry
            # an unreachable server for ever
            left = max(0.5, deadline - time.monotonic())
            nc = await asyncio.wait_for(nats.connect(**options), left)  # type: ignore[arg-type]
            opened.append(nc)
            return nc
        except Exception as exc:
            last = exc
            await asyncio.sleep(0.5)
    raise BusUnavailable(
        f"no NATS server of {servers_shown(settings)} answered in {timeout_s:.0f} s: "
        f"{type(last).__name__}: {last}",
        settings.bus_retry_after_s,
    )


def stream_config(settings: Settings, layout: Layout, replicas: int) -> js_api.StreamConfig:
    """A work queue: a batch leaves the stream once a writer acknowledged it (after commit),
    so the stream holds only what is not stored yet, and its limits are the backlog allowed
    before ingest answers 503 (discard new: nothing accepted is ever dropped to make room)."""
    return js_api.StreamConfig(
        name=layout.stream,
        subjects=[layout.wildcard],
        retention=js_api.RetentionPolicy.WORK_QUEUE,
        discard=js_api.DiscardPolicy.NEW,
        storage=js_api.StorageType.FILE,
        max_bytes=settings.bus_max_bytes,
        max_msgs=settings.bus_max_msgs if settings.bus_max_msgs is not None else -1,
        max_age=settings.bus_max_age_s or 0,
        duplicate_window=settings.bus_dedupe_window_s,
        num_replicas=replicas,
    )


def consumer_config(settings: Settings, layout: Layout, partition: int) -> js_api.ConsumerConfig:
    """One batch in flight per partition (``max_ack_pending=1``): the partition's batches are
    stored in order, whichever writer fetches them, and a writer that dies holding one loses
    it to the next after ``ack_wait``."""
    return js_api.ConsumerConfig(
        durable_name=layout.consumer(partition),
        filter_subject=layout.subject(partition),
        ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL,
        max_ack_pending=1,
        ack_wait=settings.bus_ack_wait_s,
        max_deliver=-1,
    )


async def ensure(js: JetStreamContext, settings: Settings, layout: Layout) -> int:
    """The stream and every partition's consumer, as the settings describe them; returns the
    stream's replica count. Retried while the cluster elects its leaders, up to
    ``bus_connect_timeout_s``."""
    deadline = time.monotonic() + settings.bus_connect_timeout_s
    while True:
        try:
            replicas = await _ensure_stream(js, settings, layout)
            for p in range(layout.partitions):
                await _ensure_consumer(js, settings, layout, p)
            return replicas
        except (TimeoutError, APIError, nats.errors.Error) as exc:
            if isinstance(exc, BadRequestError) or time.monotonic() > deadline:
                raise BusUnavailable(
                    f"the stream {layout.stream} could not be set up on "
                    f"{servers_shown(settings)}: {describe(exc)}",
                    settings.bus_retry_after_s,
                ) from None
            await asyncio.sleep(0.5)


async def _ensure_stream(js: JetStreamContext, settings: Settings, layout: Layout) -> int:
    try:
        info = await js.stream_info(layout.stream)
    except NotFoundError:
        pass
    else:
        have = info.config
        want = stream_config(settings, layout, settings.bus_replicas or have.num_replicas or 1)
        if (
            have.max_bytes != want.max_bytes
            or have.max_msgs != want.max_msgs
            or (have.max_age or 0) != (want.max_age or 0)
            or have.num_replicas != want.num_replicas
            or have.subjects != want.subjects
        ):
            log.warning("bus: updating the limits of stream %s", layout.stream)
            await js.update_stream(want)
        return want.num_replicas or 1
    # Unset: 3 replicas where the cluster has the nodes, else as many as it has.
    for replicas in [settings.bus_replicas] if settings.bus_replicas else [3, 2, 1]:
        try:
            await js.add_stream(stream_config(settings, layout, replicas))
            return replicas
        except APIError as exc:  # BadRequestError among them: too few nodes for replicas
            if settings.bus_replicas or replicas == 1 or not _too_few_nodes(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _too_few_nodes(exc: APIError) -> bool:
    text = f"{exc.description or ''}".lower()
    return "replicas" in text or "insufficient" in text or "peers" in text


async def _ensure_consumer(
    js: JetStreamContext, settings: Settings, layout: Layout, partition: int
) -> None:
    want = consumer_config(settings, layout, partition)
    try:
        have = await js.consumer_info(layout.stream, layout.consumer(partition))
    except NotFoundError:
        await js.add_consumer(layout.stream, want)
        return
    if have.config.ack_wait != want.ack_wait:
        await js.add_consumer(layout.stream, want)  # an update of the durable's ack_wait


def describe(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        return f"{exc.description or type(exc).__name__} (code {exc.code}, {exc.err_code})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
