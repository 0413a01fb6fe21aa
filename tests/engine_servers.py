"""Real engine servers for main-suite tests: ONE vLLM OpenAI server per test run.

Use it from a test module with ``from tests.engine_servers import vllm_server  # noqa: F401`` and
a ``vllm_server: VllmServer`` argument. The first test that asks starts, in this order:

1. a real kvwatch collector (SQLite, served on 127.0.0.1 in a thread, its own ingest and
   admin tokens): the probe inside vLLM must have somewhere to send from its first event;
2. the tiny model (``tests/engines/vllm/tiny_model.py``: a 2-layer random Llama with a
   300-token BPE tokenizer), written once into a temporary directory by ``.venv-vllm``;
3. ``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` with kvwatch's plugin
   active (``KVWATCH_COLLECTOR_URL``/``KVWATCH_INGEST_TOKEN``/``KVWATCH_DEPLOYMENT_ID`` set;
   the plugin is found through the ``vllm.general_plugins`` entry point of the kvwatch
   installed in that venv), ``--block-size 32``, ``--optimization-level 0`` (no
   torch.compile), ``--max-num-batched-tokens 128`` (chunked prefill: a long prompt takes
   many steps), ``VLLM_CPU_KVCACHE_SPACE=1``, ``HF_HUB_OFFLINE=1``, and the plugin's
   test-only fault injection for :data:`FAULT_TENANT` (the positive control); and vLLM's own
   OpenTelemetry tracing (``--otlp-traces-endpoint``) exporting over OTLP/HTTP to the same
   collector's ``/v1/traces`` with the same ingest token, as :data:`OTLP_DEPLOYMENT` (its
   ``OTEL_SERVICE_NAME``) with the served model on the resource: one ``llm_request`` span per
   request that finishes in vLLM's output processor (at its length, an EOS or a stop
   string; none for one aborted because its client left), whether or not it carried a
   ``traceparent`` (vLLM traces every request once an endpoint is set); and vLLM's KV-cache
   events (``--kv-events-config``: its ZMQ publisher, topic :data:`KV_EVENTS_TOPIC`, on
   :attr:`VllmServer.kv_events_endpoint`, its replay socket on
   :attr:`VllmServer.kv_events_replay_endpoint`), which ``kvwatch kv-events`` reads.

Every later test (any module) gets the same running server: the fixture is session scoped
and the server a process-wide singleton, so importing the fixture into several modules
still starts one. It is stopped (SIGTERM to its process group) when the session ends.

Tests may send requests with :meth:`VllmServer.complete` (prompts as token ids, so prompt
token counts are exact; ``tenant`` becomes the ``kvwatch_tenant`` vLLM extra arg the probe
reads) and scrape :meth:`VllmServer.metrics_text`. Events from the probe arrive in
``vllm_server.collector`` a flush interval (0.2 s) after the engine emits them.

Without ``.venv-vllm`` the tests skip (``make engines`` builds it); with ``CI`` set they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL_SCRIPT = ROOT / "tests" / "engines" / "vllm" / "tiny_model.py"
SERVED_MODEL = "kvwatch-tiny-llama"
DEPLOYMENT = "vllm-tiny"
#: the deployment vLLM's own OTLP spans name (its OTEL_SERVICE_NAME): a deployment of its own,
#: so the rows the spans become are never merged with, or mistaken for, the probe's rows of
#: the same requests (the ids differ: the span names vLLM's external id, the probe the engine
#: core's, which adds a random suffix), and the probe's deployment keeps its one probe
OTLP_DEPLOYMENT = f"{DEPLOYMENT}-otlp"
#: how often vLLM's span processor exports (OTEL_BSP_SCHEDULE_DELAY, ms; the SDK's default is
#: 5 s): a span is at the collector a fraction of a second after its request ends
OTLP_EXPORT_DELAY_MS = 200
BLOCK_SIZE = 32
#: the topic of the server's KV-cache events (vLLM's default is empty: a topic tests that the
#: consumer subscribes to the one it is given)
KV_EVENTS_TOPIC = "kvwatch-tiny"
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 420.0
#: every test of a live engine server: the first to run starts the server in its setup, which
#: on a loaded 2-core machine can take longer than the suite's 300 s per test
SERVER_TEST_TIMEOUT = pytest.mark.timeout(int(START_TIMEOUT_S) + 180)
#: the tenant whose first request's KV writes the probe is told to lose (a test-only fault:
#: reads of those blocks must be reported as stale reads); no other test may use it
FAULT_TENANT = "vsrv-injected-fault"
#: what every test-only fault injection must be armed with (engine_probe/adapters/common.py)
FAULT_GUARD = "i-know-this-probe-will-report-false-stale-reads"


@dataclass
class EngineCollector:
    """The real collector the engine's probe sends to (url, database, tokens)."""

    url: str
    db_url: str
    admin: str
    ingest: str
    #: the ingest token's lineage (its own id): OTLP ingest stores spans under a probe of
    #: that lineage (``collector.otlp.service.probe_id``)
    ingest_lineage: int

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@dataclass
class VllmServer:
    """One running vLLM OpenAI server with kvwatch's plugin active (and vLLM's tracing
    exporting to the same collector, as ``otlp_deployment_id``)."""

    base_url: str
    model: str
    max_model_len: int
    block_size: int
    deployment_id: str
    otlp_deployment_id: str
    collector: EngineCollector
    log_path: Path
    #: where vLLM's KV-cache events are published (its PUB socket, bound on every address)
    #: and replayed (its ROUTER socket, bound on loopback), as a subscriber connects to them
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def node(self) -> str:
        """The node id its plugin reports, by the documented rule (engine_probe/node.py,
        docs/vllm.md): ``--host 127.0.0.1`` is loopback, so the machine's name, and its port."""
        port = self.base_url.rsplit(":", 1)[1]
        return f"{socket.gethostname()}:{port}"

    def complete(
        self,
        prompt: list[int] | str,
        *,
        tenant: str | None = None,
        max_tokens: int = 4,
        cache_salt: str | None = None,
        route: str | None = None,
        stop: list[str] | None = None,
        n: int = 1,
        session_id: str | None = None,
        xargs: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> httpx.Response:
        """POST /v1/completions (greedy, ``ignore_eos``: exactly ``max_tokens`` tokens, unless
        the output matches one of the ``stop`` strings first); ``n > 1``: that many samples
        of one prompt (seeded sampling: vLLM's parallel sampling). ``session_id``: vLLM's
        session (its KV-cache events name it); ``xargs``: more vLLM extra args."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if n != 1:
            body.update(n=n, temperature=0.8, seed=7)
        if stop is not None:
            body["stop"] = stop
        xargs = dict(xargs or {})
        if session_id is not None:
            body["session_id"] = session_id
        if tenant is not None:
            xargs["kvwatch_tenant"] = tenant
        if route is not None:
            xargs["kvwatch_route"] = route
        if xargs:
            body["vllm_xargs"] = xargs
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=timeout_s)

    def abandon(
        self,
        prompt: list[int],
        *,
        tenant: str,
        after_s: float,
        stream: bool = False,
        max_tokens: int = 64,
    ) -> None:
        """Send a completion and disconnect ``after_s`` seconds later, as a client that
        gives up does (vLLM's front end then aborts the request in the engine core)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
            "vllm_xargs": {"kvwatch_tenant": tenant},
        }
        # a raw socket: the client is gone exactly ``after_s`` after sending, whatever
        # the server has sent meanwhile
        payload = json.dumps(body).encode()
        host, _, port = self.base_url.removeprefix("http://").partition(":")
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(head.encode() + payload)
            time.sleep(after_s)
            # Gone at once and for certain: shutdown ends the connection even where another
            # process holds a copy of this descriptor (a fork elsewhere in the test process),
            # and a zero linger makes the close a reset rather than a FIN the server may
            # read only after it has written the whole answer.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def metrics_text(self) -> str:
        """The server's Prometheus exposition (GET /metrics)."""
        r = httpx.get(f"{self.base_url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


_server: VllmServer | None = None
_stack: list[Any] = []


def _need_venv() -> None:
    if not (ROOT / ".venv-vllm" / ".kvwatch-installed").exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-vllm is missing (make engines builds it)")
        pytest.skip(".venv-vllm is missing: `make engines` builds it")


def _start_collector(workdir: Path, stack: list[Any] | None = None) -> EngineCollector:
    from collector import migrate
    from collector.app import create_app
    from collector.db import Database
    from collector.settings import Settings
    from collector.timefmt import to_micros
    from collector.tokens import create_token
    from engine_probe.events import utcnow
    from kvwatch.embedded import serve_in_thread

    db_url = f"sqlite:///{workdir / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    db = Database(db_url)
    try:
        with db.write() as conn:
            now = to_micros(utcnow())
            admin = create_token(conn, kind="admin", now_us=now)[1]
            ingest_id, ingest = create_token(conn, kind="ingest", now_us=now)
    finally:
        db.dispose()
    settings = Settings(database_url=db_url, auto_migrate=False, rollup_interval_s=0.2)
    serving = serve_in_thread(create_app(settings))
    url = serving.__enter__()
    (_stack if stack is None else stack).append(serving)
    return EngineCollector(url, db_url, admin, ingest, ingest_id)


def _start_server(
    workdir: Path,
    collector: EngineCollector,
    *,
    replica_args: tuple[str, ...] | None = None,
) -> VllmServer:
    """The run's shared server; with ``replica_args``, another engine of the same deployment
    (those vLLM arguments added) reporting to the same collector: no tracing, KV-cache
    events or fault injection, its own log (see :func:`start_replica`)."""
    from kvwatch.embedded import free_port

    written = workdir / "tiny-llama"
    model_dir = written if replica_args is not None and written.exists() else _tiny_model(workdir)
    port, kv_port, kv_replay_port = free_port(), free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KVWATCH_", "OTEL_"))},
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "KVWATCH_COLLECTOR_URL": collector.url,
        "KVWATCH_INGEST_TOKEN": collector.ingest,
        "KVWATCH_DEPLOYMENT_ID": DEPLOYMENT,
        "KVWATCH_PROBE_FLUSH_INTERVAL_S": "0.2",
        # the collector runs in a thread of the test process, beside an engine that keeps a
        # 2-core machine busy: a slow answer is load, not an outage (10 s, the default, sent
        # the probe into backoff for the whole of a loaded CI run's wait)
        "KVWATCH_PROBE_REQUEST_TIMEOUT_S": "60",
        # the plugin's default spool/journal directory is per user: keep this server's in
        # its own workdir (another test's killed engine must not be adopted here)
        "XDG_STATE_HOME": str(workdir / "state"),
        # TEST ONLY: the positive control's injected fault (engine_probe/adapters/vllm/
        # plugin.py): the first request of FAULT_TENANT has its KV writes left unrecorded
        "KVWATCH_TEST_FAULT_INJECTION": FAULT_GUARD,
        "KVWATCH_TEST_LOSE_KV_WRITE_OF_TENANT": FAULT_TENANT,
        # vLLM's tracing (with --otlp-traces-endpoint below): OTLP/HTTP, not its default gRPC
        # (the collector takes OTLP/HTTP only), authenticated as the probe is; the deployment
        # as service.name, the model on the resource (vLLM's span names none)
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"Authorization=Bearer%20{collector.ingest}",
        "OTEL_SERVICE_NAME": OTLP_DEPLOYMENT,
        "OTEL_RESOURCE_ATTRIBUTES": f"gen_ai.request.model={SERVED_MODEL}",
        "OTEL_BSP_SCHEDULE_DELAY": str(OTLP_EXPORT_DELAY_MS),
    }
    observed: tuple[str, ...] = (
        "--otlp-traces-endpoint",
        f"{collector.url}/v1/traces",
        # vLLM's KV-cache events: a PUB socket (vLLM binds an endpoint with '*' and
        # connects to any other) and a replay socket (always bound: loopback here)
        "--kv-events-config",
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{kv_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{kv_replay_port}",
                "topic": KV_EVENTS_TOPIC,
            }
        ),
    )
    log_path = workdir / "vllm-server.log"
    if replica_args is not None:
        observed = replica_args
        log_path = workdir / f"vllm-replica-{port}.log"
        for name in ("KVWATCH_TEST_FAULT_INJECTION", "KVWATCH_TEST_LOSE_KV_WRITE_OF_TENANT"):
            env.pop(name)
        env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    proc = _popen(
        [
            str(VLLM_PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            # chunked prefill in steps of at most 128 tokens: a long prompt takes many
            # steps, as one of tens of thousands of tokens does on a real model (this one
            # prefills 2k tokens in milliseconds), so a client can leave mid-prefill
            "--max-num-batched-tokens",
            "128",
            # no torch.compile: on 2 CPU cores it costs over a minute of start-up and changes
            # nothing the probe sees (the scheduler and its KV cache manager are the same)
            "--optimization-level",
            "0",
            *observed,
        ],
        log_path,
        env,
        workdir,
    )
    server = VllmServer(
        base_url=f"http://127.0.0.1:{port}",
        model=SERVED_MODEL,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        deployment_id=DEPLOYMENT,
        otlp_deployment_id=OTLP_DEPLOYMENT,
        collector=collector,
        log_path=log_path,
        kv_events_endpoint=f"tcp://127.0.0.1:{kv_port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{kv_replay_port}",
        process=proc,
    )
    _wait_healthy("vLLM", proc, server.base_url, server.log_tail)
    return server


#: the tiny model this process has written (seeded: every write is the same model), which
#: every later server of the process loads (~5 s of CPU each to write it again)
_tiny: Path | None = None


def _tiny_model(workdir: Path) -> Path:
    """The tests' tiny Llama, written by .venv-vllm into ``workdir`` the first time a process
    asks, and that copy afterwards (servers only read it)."""
    global _tiny
    if _tiny is not None and (_tiny / "config.json").exists():
        return _tiny
    model_dir = workdir / "tiny-llama"
    subprocess.run(
        [str(VLLM_PY), str(TINY_MODEL_SCRIPT), str(model_dir)],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    _tiny = model_dir
    return model_dir


def _wait_healthy(name: str, proc: subprocess.Popen[bytes], base_url: str, log_tail: Any) -> None:
    """Until the server's /health answers 200; RuntimeError (with its log) if it exits or
    does not start in START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the {name} server exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"the {name} server did not start:\n{log_tail()}")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _shutdown() -> None:
    global _server
    if _server is not None:
        _stop(_server.process)
        _server = None
    while _stack:
        _stack.pop().__exit__(None, None, None)


def start_replica(server: VllmServer, *args: str) -> VllmServer:
    """Another engine of ``server``'s deployment (the same model, on its own port, its plugin
    reporting to the same collector), with ``args`` added to vLLM's: a second start (tens
    of seconds of both cores), so a module that needs one starts one and stops it
    (:func:`stop_replica`) before it ends."""
    return _start_server(server.log_path.parent, server.collector, replica_args=args)


def stop_replica(replica: VllmServer) -> None:
    _stop(replica.process)


#: the probe ids of replicas started in this run (tests/test_vllm_replicas.py): they report
#: into the shared server's deployment, and a module counting that deployment's probes
#: leaves them out
REPLICA_PROBES: set[str] = set()


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """The run's one real vLLM server with kvwatch's plugin and its own collector."""
    global _server
    _need_venv()
    if _server is None:
        workdir = tmp_path_factory.mktemp("vllm-server")
        request.config.add_cleanup(_shutdown)
        collector = _start_collector(workdir)
        _server = _start_server(workdir, collector)
    yield _server


SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_SITE = ROOT / "engines" / "sglang" / "site"
SGLANG_DEPLOYMENT = "sglang-tiny"
SGLANG_POOL_TOKENS = 16384


@dataclass
class SglangServer:
    """One running SGLang OpenAI server (single node) with kvwatch's plugin active."""

    base_url: str
    model: str
    deployment_id: str
    collector: EngineCollector
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def complete(
        self,
        prompt: list[int],
        *,
        tenant: str | None = None,
        max_tokens: int = 4,
        timeout_s: float = 120.0,
    ) -> httpx.Response:
        """POST /v1/completions (greedy, ``ignore_eos``); the tenant as SGLang's routing key
        (the ``x-smg-routing-key`` header a gateway or SGLang's router sets), which the
        probe reads as the request's tenant."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        headers = {"x-smg-routing-key": tenant} if tenant else {}
        return httpx.post(
            f"{self.base_url}/v1/completions", json=body, headers=headers, timeout=timeout_s
        )

    def server_info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base_url}/get_server_info", timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


_sglang: SglangServer | None = None


def _start_sglang(workdir: Path, collector: EngineCollector) -> SglangServer:
    from kvwatch.embedded import free_port

    model_dir = _tiny_model(workdir)
    port = free_port()
    env = _sglang_env(collector, SGLANG_DEPLOYMENT, workdir / "state", fault_injection=True)
    log_path = workdir / "sglang-server.log"
    proc = _popen(
        _sglang_command(SGLANG_PY, model_dir, port, pool_tokens=SGLANG_POOL_TOKENS),
        log_path,
        env,
        workdir,
    )
    server = SglangServer(
        base_url=f"http://127.0.0.1:{port}",
        model=SERVED_MODEL,
        deployment_id=SGLANG_DEPLOYMENT,
        collector=collector,
        log_path=log_path,
        process=proc,
    )
    _wait_healthy("SGLang", proc, server.base_url, server.log_tail)
    return server


def _sglang_env(
    collector: EngineCollector, deployment: str, state: Path, *, fault_injection: bool
) -> dict[str, str]:
    """The environment of an SGLang server process with kvwatch's plugin active."""
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            # SGLANG_USE_CPU_ENGINE selects SGLang's official CPU backend, which needs a CPU
            # sgl-kernel build PyPI does not have (and AVX-512/AMX): the plain PyTorch
            # paths below are what runs here
            if not k.startswith(("KVWATCH_", "SGLANG_USE_CPU_ENGINE"))
        },
        # sitecustomize: stubs in every SGLang process; then this checkout, so the plugin
        # that runs is the code under test (the venv's kvwatch may be another checkout's)
        "PYTHONPATH": os.pathsep.join((str(SGLANG_SITE), str(ROOT))),
        "HF_HUB_OFFLINE": "1",
        # every address SGLang advertises to its peers (bootstrap, Mooncake, ZMQ): loopback
        "SGLANG_HOST_IP": "127.0.0.1",
        "KVWATCH_SGLANG_PROBE": "1",
        "KVWATCH_COLLECTOR_URL": collector.url,
        "KVWATCH_INGEST_TOKEN": collector.ingest,
        "KVWATCH_DEPLOYMENT_ID": deployment,
        "KVWATCH_PROBE_FLUSH_INTERVAL_S": "0.2",
        # the plugin's default spool/journal directory is per user: one per server here, in
        # its work directory (removed with it)
        "XDG_STATE_HOME": str(state),
    }
    if fault_injection:
        # TEST ONLY: the positive control's injected fault (engine_probe/adapters/common.py):
        # the first request of FAULT_TENANT has its KV writes left unrecorded
        env["KVWATCH_TEST_FAULT_INJECTION"] = FAULT_GUARD
        env["KVWATCH_TEST_LOSE_KV_WRITE_OF_TENANT"] = FAULT_TENANT
    return env


def _sglang_command(
    python: Path,
    model_dir: Path,
    port: int,
    *,
    pool_tokens: int,
    extra: tuple[str, ...] = (),
    warmup: bool = False,
) -> list[str]:
    """``python -m sglang.launch_server`` on the CPU with the tests' tiny model."""
    from kvwatch.embedded import free_port

    return [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--nccl-port",
        str(free_port()),
        "--device",
        "cpu",
        # An idle SGLang scheduler otherwise spins a core at 100% for as long as the server
        # lives (the session-scoped one: the rest of a worker's run), halving the other tests'
        # share of a 2-core machine; this sleeps on its sockets until a request comes.
        "--sleep-on-idle",
        # SGLang's plain-PyTorch paths (no sgl-kernel, no CUDA graphs, no grammar)
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--grammar-backend",
        "none",
        *(() if warmup else ("--skip-server-warmup",)),
        "--enable-cache-report",
        "--enable-metrics",
        "--context-length",
        str(MAX_MODEL_LEN),
        # SGLang sizes a CPU KV pool from the machine's memory (29M tokens, 14 GB here):
        # a second server beside it, or the vLLM one, would be killed for memory
        "--max-total-tokens",
        str(pool_tokens),
        *extra,
    ]


def _popen(
    command: list[str], log_path: Path, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    """A server process in its own process group (its children too), output to its log."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )


def _shutdown_sglang() -> None:
    global _sglang
    if _sglang is not None:
        _stop(_sglang.process)
        _sglang = None


@pytest.fixture(scope="session")
def sglang_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SglangServer]:
    """The run's one real SGLang server with kvwatch's plugin and its own collector (the
    tiny model is built by .venv-vllm's script, so both engine venvs are needed)."""
    global _sglang
    for venv in (".venv-sglang", ".venv-vllm"):
        if not (ROOT / venv / ".kvwatch-installed").exists():
            if os.environ.get("CI"):
                pytest.fail(f"{venv} is missing (make engines builds it)")
            pytest.skip(f"{venv} is missing: `make engines` builds it")
    if _sglang is None:
        workdir = tmp_path_factory.mktemp("sglang-server")
        request.config.add_cleanup(_shutdown_sglang)
        request.config.add_cleanup(_shutdown)  # its collector is on the shared stack
        collector = _start_collector(workdir)
        _sglang = _start_sglang(workdir, collector)
    yield _sglang


# Lists that take no deployment filter (the collector refuses a parameter a route does not
# take); each live server has a collector of its own, so they hold only its deployment.
_UNFILTERED = frozenset({"/v1/deployments", "/v1/probes"})


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary (300 tokens; 0 and 1 are special),
    the same for the same ``seed``: the live servers' prompts."""
    rng = random.Random(seed)
    return [rng.randrange(2, 290) for _ in range(n)]


@contextlib.contextmanager
def gateway_in_front(base_url: str, keys: dict[str, str], **settings: Any) -> Iterator[str]:
    """kvwatch's gateway in front of a live server, with these tenant keys. Its own records
    go nowhere: the live tests look at the probe's inside the engine."""
    from engine_probe.probe import NoopProbe
    from kvwatch.embedded import serve_in_thread
    from kvwatch.gateway import GatewaySettings, create_app

    config = GatewaySettings(gateway_upstream=base_url, gateway_tenant_keys=keys, **settings)
    with serve_in_thread(create_app(config, probe=NoopProbe())) as url:
        yield url


def collector_get(server: Any, path: str, **params: Any) -> Any:
    """GET ``path`` from a live server's collector (admin token), for that server's
    deployment; the decoded JSON."""
    scope = {} if path in _UNFILTERED else {"deployment_id": server.deployment_id}
    with server.collector.client() as c:
        r = c.get(path, params={**scope, **params})
        r.raise_for_status()
        return r.json()


def wait_for(fetch: Any, ready: Any, timeout_s: float = 30.0) -> Any:
    """Poll ``fetch()`` until ``ready(value)``; the last value (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if ready(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting; last value: {json.dumps(value)[:2000]}")
        time.sleep(0.2)


# -- a disaggregated SGLang deployment: prefill, decode and SGLang's router ---------------------

#: the incident's sizing, scaled down: the prefill pool is smaller than the advertised context
#: (MAX_MODEL_LEN), so a prompt between the two reaches SGLang's rejection path on prefill;
#: the decode pool holds such a prompt, and is small enough that its pages are reused soon
PD_PREFILL_POOL_TOKENS = 1024
PD_DECODE_POOL_TOKENS = 2048
#: how long decode waits for a transfer that prefill will never send (SGLang's default: 300 s)
PD_WAITING_TIMEOUT_S = 15


@dataclass
class SglangPair:
    """A running disaggregated SGLang deployment: a prefill server and a decode server, each
    with kvwatch's plugin, and SGLang's router in front (the only address clients use)."""

    router_url: str
    urls: dict[str, str]  # role -> the server's own address
    model: str
    deployment_id: str
    version: str
    collector: EngineCollector
    workdir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(repr=False)

    @property
    def nodes(self) -> dict[str, str]:
        """role -> the node id its plugin reports, by the documented rule (engine_probe/
        node.py): the loopback host is the machine's name, then the port and the role."""
        return {
            role: f"{socket.gethostname()}:{url.rsplit(':', 1)[1]}/{role}"
            for role, url in self.urls.items()
        }

    def complete(
        self, prompt: str, *, tenant: str, max_tokens: int = 4, timeout_s: float = 120.0
    ) -> httpx.Response:
        """POST /v1/completions through the router (greedy, ``ignore_eos``). The router
        takes text prompts only; the tenant travels as SGLang's routing key header, which
        the router passes to both servers."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        return httpx.post(
            f"{self.router_url}/v1/completions",
            json=body,
            headers={"x-smg-routing-key": tenant},
            timeout=timeout_s,
        )

    def server_info(self, role: str) -> dict[str, Any]:
        r = httpx.get(f"{self.urls[role]}/get_server_info", timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def log_tail(self, name: str, chars: int = 4000) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to every process group at once, then wait for each (an SGLang server
        takes ~5 s to exit: it waits for crash diagnostics that never come on the CPU)."""
        for proc in self.processes.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            _stop(proc)


def _start_pair(
    workdir: Path,
    collector: EngineCollector,
    *,
    venv: str,
    deployment: str,
    decode_args: tuple[str, ...] = (),
    env: dict[str, dict[str, str]] | None = None,
) -> SglangPair:
    """Prefill and decode side by side (SGLang 0.5.23's decode asks prefill's bootstrap
    server for its layout at each request until it has it, so the order does not matter;
    0.5.21's kept failing after an early miss), then the router, polled until it reports
    both workers healthy (its own /health says ready earlier)."""
    from kvwatch.embedded import free_port

    python = ROOT / venv / "bin" / "python"
    model_dir = _tiny_model(workdir)
    ports = {role: free_port() for role in ("prefill", "decode", "router", "bootstrap")}
    common = ("--disaggregation-transfer-backend", "mooncake_tcp")
    roles = {
        "prefill": (
            PD_PREFILL_POOL_TOKENS,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(ports["bootstrap"]),
            # the CPU setup known to transfer KV here (the overlap schedule is untried)
            "--disable-overlap-schedule",
        ),
        "decode": (PD_DECODE_POOL_TOKENS, "--disaggregation-mode", "decode", *decode_args),
    }
    pair = SglangPair(
        router_url=f"http://127.0.0.1:{ports['router']}",
        urls={role: f"http://127.0.0.1:{ports[role]}" for role in roles},
        model=SERVED_MODEL,
        deployment_id=deployment,
        version="",
        collector=collector,
        workdir=workdir,
        processes={},
    )
    try:
        for role, (pool, *extra) in roles.items():
            role_env = _sglang_env(
                collector, deployment, workdir / f"state-{role}", fault_injection=False
            )
            role_env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(PD_WAITING_TIMEOUT_S)
            role_env.update((env or {}).get(role, {}))
            # SGLang's own warm-up, as a user's server runs it: on decode, a fake transfer
            # that writes nothing (the probe must neither flag it nor count it a request)
            command = _sglang_command(
                python,
                model_dir,
                ports[role],
                pool_tokens=pool,
                extra=(*common, *extra),
                warmup=True,
            )
            log = workdir / f"{role}.log"
            pair.processes[role] = _popen(command, log, role_env, workdir)
        for role in roles:
            proc = pair.processes[role]
            _wait_healthy(f"SGLang {role}", proc, pair.urls[role], lambda r=role: pair.log_tail(r))
        router = [
            str(python),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            pair.urls["prefill"],
            str(ports["bootstrap"]),
            "--decode",
            pair.urls["decode"],
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["router"]),
            # the router opens a metrics listener of its own: pinned to loopback
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            # one attempt per client request: by default the router retries a failed request
            # up to 5 times, each with a new bootstrap room (5 requests to SGLang, 5 rows)
            "--disable-retries",
        ]
        router_env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATCH_")}
        proc = pair.processes["router"] = _popen(
            router, workdir / "router.log", router_env, workdir
        )
        _wait_workers(proc, pair)
    except BaseException:
        pair.stop()
        raise
    pair.version = str(pair.server_info("prefill").get("version", ""))
    return pair


def _wait_workers(proc: subprocess.Popen[bytes], pair: SglangPair) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited:\n{pair.log_tail('router')}")
        try:
            workers = httpx.get(f"{pair.router_url}/workers", timeout=5).json()["workers"]
            if len(workers) == 2 and all(w.get("is_healthy") for w in workers):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router saw no healthy pair:\n{pair.log_tail('router')}")
        time.sleep(1.0)


def _need_venvs(*venvs: str) -> None:
    for venv in venvs:
        if not (ROOT / venv / ".kvwatch-installed").exists():
            if os.environ.get("CI"):
                pytest.fail(f"{venv} is missing (make engines builds it)")
            pytest.skip(f"{venv} is missing: `make engines` builds it")


def sglang_pair_fixture(
    venv: str,
    deployment: str,
    *,
    decode_args: tuple[str, ...] = (),
    env: dict[str, dict[str, str]] | None = None,
) -> Any:
    """A module-scoped fixture: one pair (and its own collector) for the module's tests,
    stopped when the module is done (a pair takes ~4.5 GB: two at once would crowd out the
    other live servers). ``env``: more environment per role (``prefill``, ``decode``)."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangPair]:
        _need_venvs(venv, ".venv-vllm")
        workdir = tmp_path_factory.mktemp(deployment)
        stack: list[Any] = []
        try:
            collector = _start_collector(workdir, stack)
            pair = _start_pair(
                workdir,
                collector,
                venv=venv,
                deployment=deployment,
                decode_args=decode_args,
                env=env,
            )
            try:
                yield pair
            finally:
                pair.stop()
        finally:
            while stack:
                stack.pop().__exit__(None, None, None)

    return fixture
