"""``kvdiag router``: the example proxy's flags, clear errors, and a real process serving a turn."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from click.testing import CliRunner
from router_support import fake_backends, read_jsonl, wait_for

from kvdiag.cli.cmd_router import router
from kvdiag.cli.main import cli

KVDIAG = str(Path(sys.executable).parent / "kvdiag")


def test_space_separated_lists_and_singular_aliases_parse_like_the_example_proxy() -> None:
    ctx = router.make_context("router", ["--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports", "8100",
                                         "8101", "--decoder-host", "10.0.0.3", "--decoder-port", "8200", "--port",
                                         "9000", "--hash-ids"])
    assert ctx.params["prefiller_hosts"] == ("10.0.0.1", "10.0.0.2")
    assert ctx.params["prefiller_ports"] == (8100, 8101)
    assert ctx.params["decoder_hosts"] == ("10.0.0.3",) and ctx.params["decoder_ports"] == (8200,)
    assert ctx.params["port"] == 9000 and ctx.params["hash_ids"] is True


def test_bad_options_fail_with_a_fix_it_message() -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["router", "--entry-ttl", "500"])
    assert result.exit_code == 1 and "must be below decoder_kv_blocks_ttl" in result.output
    result = runner.invoke(cli, ["router", "--prefiller-hosts", "a", "b", "c", "--prefiller-ports", "1", "2"])
    assert result.exit_code == 1 and "one port per host" in result.output
    result = runner.invoke(cli, ["router", "--state", "memcached://x"])
    assert result.exit_code == 1 and "redis://" in result.output


async def test_router_process_serves_and_stops_cleanly(tmp_path: Path) -> None:
    ready = tmp_path / "router.ready"
    events = tmp_path / "events.jsonl"
    async with fake_backends() as (ps, ds):
        proc = subprocess.Popen([KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                                 "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(ps[0].port),
                                 "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(ds[0].port),
                                 "--events-file", str(events), "--proxy-log", str(tmp_path / "proxy.log")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            await wait_for(ready.exists, timeout=20)
            url = json.loads(ready.read_text())["url"]
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "conversation_id": "cli"}) as resp:
                assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        finally:
            proc.send_signal(signal.SIGTERM)
            out = await asyncio.to_thread(proc.communicate, timeout=20)
    assert proc.returncode == 0, out
    assert read_jsonl(events)[0]["outcome"] == "first_turn"
    assert "cache MISS" in (tmp_path / "proxy.log").read_text()
