"""Measured TTFT of the emulated engines against the time model (and so the article's table).

Runs, per profile and article row, real P and D engines on loopback (P prefix caching off, as in
the article), a turn 1, then turn 2 with transfer ON (D's handle) and OFF (P's bidirectional switch
off), and measures the client-side TTFT of turn 2 (P leg + D's first token). Prints JSON with the
measured figure, the modelled one (kvdiag sim calibrate) and their ratio.

    .venv/bin/python benchmarks/sim_ttft.py [--time-scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import start_engine
from kvdiag.sim.timemodel import ARTICLE_TABLE, get_profile
from kvdiag.sim.tokenizer import generate_text, render_chat


async def _ttft(session: aiohttp.ClientSession, p_url: str, d_url: str, messages: list[dict[str, Any]],
                handle: dict[str, Any] | None, rid: str, max_tokens: int) -> tuple[float, str, dict[str, Any]]:
    params: dict[str, Any] = dict(handle or {})
    params.update(do_remote_decode=True, do_remote_prefill=False)
    t0 = time.perf_counter()
    async with session.post(f"{p_url}/v1/chat/completions", headers={"X-Request-Id": rid},
                            json={"messages": messages, "max_tokens": 1, "kv_transfer_params": params}) as r:
        p_body = await r.json()
    p_params = {k: v for k, v in p_body["kv_transfer_params"].items() if k != "kvdiag"}
    first = 0.0
    reply, d_params = "", {}
    async with session.post(f"{d_url}/v1/chat/completions", headers={"X-Request-Id": rid},
                            json={"messages": messages, "max_tokens": max_tokens, "stream": True,
                                  "kv_transfer_params": p_params}) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not first and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    reply += c.get("delta", {}).get("content") or ""
                d_params = chunk.get("kv_transfer_params") or d_params
    return (first - t0) * 1000.0, reply, d_params


async def run_row(profile_name: str, prompt_tokens: int, time_scale: float) -> dict[str, Any]:
    profile = get_profile(profile_name)
    new = max(1, round(prompt_tokens * profile.new_token_share))
    reply_tokens = 4
    overhead = len(render_chat([{"role": "user", "content": ""}]))
    history_user = prompt_tokens - new - reply_tokens - 2 * overhead
    p = await start_engine(EngineConfig(role="prefill", profile=profile_name, prefix_caching=False,
                                        time_scale=time_scale, log_stats_interval_s=0))
    d = await start_engine(EngineConfig(role="decode", profile=profile_name, time_scale=time_scale,
                                        log_stats_interval_s=0))
    out: dict[str, Any] = {"profile": profile_name, "prompt_tokens_target": prompt_tokens}
    try:
        async with aiohttp.ClientSession() as session:
            for mode in ("on", "off"):
                msgs = [{"role": "user", "content": generate_text(len(mode), history_user)}]
                _, reply, handle = await _ttft(session, p.url, d.url, msgs, None, f"{mode}-t1", reply_tokens)
                msgs2 = [*msgs, {"role": "assistant", "content": reply},
                         {"role": "user", "content": generate_text(99, new)}]
                async with session.post(f"{p.url}/kvdiag/admin/faults",
                                        json={"bidirectional_kv_xfer": mode == "on"}) as r:
                    r.raise_for_status()
                ttft, _, _ = await _ttft(session, p.url, d.url, msgs2, handle, f"{mode}-t2", 2)
                model = profile.turn_ttft_ms(len(render_chat(msgs2)), transfer_on=mode == "on")["ttft_ms"]
                out[f"measured_{mode}_ms"] = round(ttft / time_scale, 1)
                out[f"model_{mode}_ms"] = round(model, 1)
                out[f"ratio_{mode}"] = round(ttft / time_scale / model, 3)
                out["prompt_tokens"] = len(render_chat(msgs2))
    finally:
        await p.close()
        await d.close()
    return out


async def main(time_scale: float) -> None:
    rows = [await run_row(r.profile, r.prompt_tokens, time_scale) for r in ARTICLE_TABLE]
    print(json.dumps({"time_scale": time_scale, "rows": rows}, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=1.0)
    asyncio.run(main(parser.parse_args().time_scale))
