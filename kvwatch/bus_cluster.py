"""A NATS JetStream cluster on this machine, from the installed ``nats-server``: the local
example of docs/scaling.md (``kvwatch bus cluster``), and what the tests and ``bench/bus.py``
run the bus on. Loopback only; each node keeps its store under one directory.

Not for production: a real cluster runs one node per machine (docs/scaling.md says how)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.errors import KvwatchError


class ClusterError(KvwatchError):
    """``nats-server`` is missing, or a node did not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalCluster:
    """``nodes`` nats-server processes with JetStream, routed to each other as one cluster.

    Invariants: ``client_ports[i]`` and ``route_ports[i]`` belong to node ``i`` for the
    cluster's life (a node killed and started again comes back on the same ports and store,
    as a restarted server would); :meth:`stop` kills every node it started."""

    directory: Path
    nodes: int = 3
    client_ports: list[int] = field(default_factory=list)
    route_ports: list[int] = field(default_factory=list)
    name: str = "kvwatch"
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.client_ports:
            self.client_ports = [free_port() for _ in range(self.nodes)]
        if not self.route_ports:
            self.route_ports = [free_port() for _ in range(self.nodes)]
        if len(self.client_ports) != self.nodes or len(self.route_ports) != self.nodes:
            raise ClusterError(f"{self.nodes} nodes need {self.nodes} client and route ports")

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (``KVWATCH_BUS_URL``)."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)

    def node_url(self, i: int) -> str:
        return f"nats://127.0.0.1:{self.client_ports[i]}"

    def _config(self, i: int) -> Path:
        routes = ", ".join(f"nats://127.0.0.1:{p}" for p in self.route_ports)
        path = self.directory / f"n{i}.conf"
        lines = [
            f"server_name: n{i}",
            f"listen: 127.0.0.1:{self.client_ports[i]}",
            # kvwatch's batches can be larger than NATS's 1 MB default (docs/scaling.md)
            "max_payload: 8MB",
            f'jetstream {{ store_dir: "{self.directory / f"n{i}"}" }}',
        ]
        if self.nodes > 1:
            lines += [
                "cluster {",
                f"  name: {self.name}",
                f"  listen: 127.0.0.1:{self.route_ports[i]}",
                f"  routes: [{routes}]",
                "}",
            ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        binary = shutil.which("nats-server") or (
            "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
        )
        if binary is None:
            raise ClusterError("nats-server is not installed (Debian: apt install nats-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        for i in range(self.nodes):
            self.start_node(i, binary)
        self.wait(timeout_s)
        return self

    def start_node(self, i: int, binary: str | None = None) -> None:
        exe = binary or shutil.which("nats-server") or "/usr/sbin/nats-server"
        log = (self.directory / f"n{i}.log").open("ab")
        self._procs[i] = subprocess.Popen(
            [exe, "-c", str(self._config(i))], stdout=log, stderr=subprocess.STDOUT
        )

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` (a crashed server: no goodbye to its peers)."""
        proc = self._procs.pop(i, None)
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until every running node accepts connections."""
        deadline = time.monotonic() + timeout_s
        for i in sorted(self._procs):
            while True:
                proc = self._procs[i]
                if proc.poll() is not None:
                    log = (self.directory / f"n{i}.log").read_text(errors="replace")[-1500:]
                    raise ClusterError(f"nats-server node n{i} exited: {log}")
                try:
                    socket.create_connection(("127.0.0.1", self.client_ports[i]), 0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"node n{i} did not listen in {timeout_s:g} s") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        for i in list(self._procs):
            self.kill_node(i)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
