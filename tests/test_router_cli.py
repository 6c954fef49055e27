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
from router_support import fake_backends, read_jsonl, redis_server, wait_for

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
    result = runner.invoke(cli, ["router", "--block-size", "0"])
    assert result.exit_code == 1 and "--block-size 0" in result.output and "KV block size" in result.output
    result = runner.invoke(cli, ["router", "--template-margin-tokens", "-1"])
    assert result.exit_code == 1 and "--template-margin-tokens" in result.output


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


async def test_sigkilled_router_on_redis_keeps_the_handle(tmp_path: Path) -> None:
    from kvdiag.sim.config import EngineConfig
    from kvdiag.sim.server import start_engine

    p = await start_engine(EngineConfig(role="prefill", time_scale=0, mode="instrumented", prefix_caching=False))
    d = await start_engine(EngineConfig(role="decode", time_scale=0, mode="instrumented"))
    messages = [{"role": "user", "content": "Summarise the trade-offs of a stateful router. " * 20}]

    def start(n: int, redis_url: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        ready, events = tmp_path / f"r{n}.ready", tmp_path / f"r{n}.jsonl"
        proc = subprocess.Popen([KVDIAG, "router", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
                                 "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(p.port),
                                 "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d.port),
                                 "--state", redis_url, "--events-file", str(events)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return proc, ready, events

    async def turn(url: str, msgs: list[dict[str, str]]) -> str:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json={
                "messages": msgs, "max_tokens": 16, "stream": False, "conversation_id": "survives"}) as resp:
            assert resp.status == 200
            return str((await resp.json())["choices"][0]["message"]["content"])

    try:
        with redis_server(tmp_path) as redis_url:
            first, ready1, _ = start(1, redis_url)
            try:
                await wait_for(ready1.exists, timeout=20)
                reply = await turn(json.loads(ready1.read_text())["url"], messages)
            finally:
                first.kill()  # SIGKILL: no shutdown, nothing flushed
                first.wait()
            second, ready2, events2 = start(2, redis_url)
            try:
                await wait_for(ready2.exists, timeout=20)
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
                await turn(json.loads(ready2.read_text())["url"], messages)
                await wait_for(lambda: len(read_jsonl(events2)) >= 1)
            finally:
                second.terminate()
                try:
                    second.wait(20)
                except subprocess.TimeoutExpired:
                    second.kill()
                    second.wait()
        ev = read_jsonl(events2)[0]
        assert ev["outcome"] == "remote_hit" and ev["turn"] == 2 and ev["lookup"] == "hit"
    finally:
        await p.close()
        await d.close()
