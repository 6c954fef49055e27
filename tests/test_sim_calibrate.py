"""The time model against the article's table, and the calibrate / engine CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.sim.timemodel import ARTICLE_TABLE, PROFILES, calibrate, get_profile


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_calibrate_within_15_percent(profile: str) -> None:
    result = calibrate(profile)
    rows = result["rows"]
    assert len(rows) == sum(1 for r in ARTICLE_TABLE if r.profile == profile) == 2
    for row in rows:
        art = next(r for r in ARTICLE_TABLE if r.label == row["row"])
        assert abs(row["sim_ttft_off_ms"] / art.ttft_off_ms - 1) <= 0.15
        assert abs(row["sim_ttft_on_ms"] / art.ttft_on_ms - 1) <= 0.15
        assert row["sim_ttft_on_ms"] < row["sim_ttft_off_ms"]
    assert result["ok"] is True


def test_transfer_is_overhead_plus_bytes_over_bandwidth() -> None:
    p = get_profile("qwen3-32b")
    assert p.transfer_bytes(1000) == 1000 * 262_144
    slope = p.transfer_ms(2000) - p.transfer_ms(1000)
    assert slope == pytest.approx(1000 * 262_144 / (p.bandwidth_gbps * 1e6))
    assert p.transfer_ms(1) > p.xfer_overhead_ms and p.transfer_ms(0) == 0.0
    assert p.prefill_ms(2000, 10_000) > p.prefill_ms(2000, 0) > p.prefill_ms(1000, 0)


def test_calibrate_cli_json() -> None:
    out = CliRunner().invoke(cli, ["sim", "calibrate", "--profile", "glm5-fp8", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert [r["row"] for r in data["rows"]] == ["zai-org/GLM-5-FP8, 2k tokens", "zai-org/GLM-5-FP8, 20k tokens"]
    assert all(r["within_tolerance"] for r in data["rows"])


def test_engine_cli_ready_file_and_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    log = tmp_path / "decode.log"
    stderr = tmp_path / "stderr.txt"
    kvdiag = Path(sys.executable).parent / "kvdiag"
    with stderr.open("wb") as err:
        proc = subprocess.Popen([str(kvdiag), "sim", "decode", "--port", "0", "--ready-file", str(ready),
                                 "--log-file", str(log), "--time-scale", "0"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, "engine did not write its ready file"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert set(info) == {"port", "side_channel_port", "pid", "engine_id"} and info["pid"] == proc.pid
        with urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/health", timeout=5) as resp:
            assert resp.status == 200
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Bidirectional KV transfer is enabled" in log.read_text()


def test_engine_cli_rejects_bad_switch() -> None:
    out = CliRunner().invoke(cli, ["sim", "prefill", "--fail-transfers", "nope"])
    assert out.exit_code != 0 and "unknown failure type 'nope'" in out.output
