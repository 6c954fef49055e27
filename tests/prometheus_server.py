"""A real Prometheus (Debian's /usr/bin/prometheus) on a free loopback port, for integration tests.

Usage::

    with PrometheusServer(tmp_path, {"kvdiag-router": ["127.0.0.1:8000"]}, rule_files=[rules]) as prom:
        prom.wait_for_targets_up()
        prom.query('up{job="kvdiag-router"}')
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml


class PrometheusError(RuntimeError):
    """Prometheus did not start, answered with an error, or a wait timed out; the message says which."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    """One Prometheus process with a temporary config and storage; stop() always reaps it."""

    def __init__(self, workdir: Path, jobs: dict[str, list[str]], *, rule_files: list[Path] | None = None,
                 scrape_interval: str = "1s", evaluation_interval: str = "1s") -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError("prometheus not found: `make sysdeps` (apt-get install prometheus) installs it")
        self.binary = binary
        self.workdir = workdir
        self.jobs = jobs
        self.rule_files = rule_files or []
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        config = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in self.jobs.items()],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=True), encoding="utf-8")
        return path

    def start(self, timeout: float = 30.0) -> None:
        """Start Prometheus and wait until /-/ready answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        self.port = free_port()
        argv = [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.process.returncode}: {self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready within {timeout:.0f} s: {self._tail()}")

    def _tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 10 s."""
        proc = self.process
        if proc is None:
            return
        self.process = None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                proc.wait(timeout=10)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; return ``data`` or raise PrometheusError with Prometheus's error text."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise PrometheusError(f"GET {path} {params}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now; the result vector (raises if the expression is rejected)."""
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else [data]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        """Values of ``label`` on series matching ``match`` (what Grafana's label_values() asks)."""
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": match})
        return values

    def alert_states(self, alertname: str) -> set[str]:
        """States (pending/firing) of the active alerts named ``alertname``."""
        return {a["state"] for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == alertname}

    def wait_for_targets_up(self, timeout: float = 30.0) -> None:
        """Wait until every configured target has been scraped successfully."""
        wanted = sum(len(t) for t in self.jobs.values())
        deadline = time.monotonic() + timeout
        last: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            last = self.api("targets")["activeTargets"]
            if len(last) == wanted and all(t["health"] == "up" for t in last):
                return
            time.sleep(0.25)
        states = [(t["labels"].get("job"), t["scrapeUrl"], t["health"], t.get("lastError")) for t in last]
        raise PrometheusError(f"targets not up within {timeout:.0f} s: {states}")
