"""KV equivalence on real vLLM: the KV P holds after a D->P read equals the KV P computes from scratch.

    python -m vllm_harness.kv_equivalence OUT_DIR      (cwd: tests/)

One process, nine engines (tests/vllm_harness/engine.py: vLLM's real v1 Scheduler, real NIXL/UCX
agents, CPU KV tensors): D runs KVDiagNixlConnector (it returns the block-hash digest); P runs the
stock NixlConnector, KVDiagNixlConnector in its default exact mode, or KVDiagNixlConnector with
exact mode off; and the same again with prefix caching on (vLLM's default, P and D must agree on
it), where P's cache holds the system prompt so vLLM reads D's blocks after a local hit (stock P
for the router's trim and the negative control, exact mode for the full handle). Every engine
writes the same deterministic "model" KV (writer tag 0): each slot is a function of the position,
its token id and all earlier token ids, so KV is byte-equal exactly when the token prefixes are.

For each agent scenario, turn k runs P->D with D retaining its sequence (prompt + reply); turn
k+1's prompt is rendered by a Qwen3-like template over token ids (reasoning dropped from history,
tool calls re-rendered, the thinking-off generation prompt); P gets D's handle as kvdiag's router
would give it (trimmed to whole blocks the previous prompt proves, ``MARGIN`` tokens short of it),
or untrimmed (the negative controls). P's KV for every prompt position is then compared with a
from-scratch prefill of the same prompt; the read itself is recorded three ways: the D block ids
vLLM's scheduler handed the worker, which of D's blocks the received bytes are, and NIXL's bytes.
Where the injection is meant to be safe, turn k+1 then completes on D (P->D read, a short reply).
Results go to ``OUT_DIR/results.json``; tests/test_kv_equivalence.py asserts on them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_AFFINITY = os.sched_getaffinity(0)

from kvdiag.router.reuse_rule import DEFAULT_MARGIN, trim_handle  # noqa: E402
from vllm_harness.engine import BLOCK_SIZE, PAGE_BYTES, PLAIN_CONNECTOR, CpuEngine, write_model_dir  # noqa: E402

LAYERS = 2
BLOCK_BYTES = LAYERS * PAGE_BYTES
MARGIN = DEFAULT_MARGIN  # the router's generation-prompt margin (--template-margin-tokens default)

# --- a Qwen3-like chat template over token ids ------------------------------------------------
_NAMES = ("im_start", "im_end", "system", "user", "assistant", "think", "end_think", "tool_call", "end_tool_call",
          "tool_response", "end_tool_response", "nl", "nlnl")
TOK = {name: 50100 + i for i, name in enumerate(_NAMES)}
GEN = [TOK["im_start"], TOK["assistant"], TOK["nl"]]
# Qwen3's generation prompt with enable_thinking false; its history rendering has no empty think block
GEN_NO_THINK = [*GEN, TOK["think"], TOK["nlnl"], TOK["end_think"], TOK["nlnl"]]


def words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def message(role: str, body: list[int]) -> list[int]:
    return [TOK["im_start"], TOK[role], TOK["nl"], *body, TOK["im_end"], TOK["nl"]]


def reasoning_reply(reasoning: list[int], content: list[int]) -> list[int]:
    """What a reasoning model generates: the trace, then the answer (the history keeps only the answer)."""
    return [TOK["think"], TOK["nl"], *reasoning, TOK["nl"], TOK["end_think"], TOK["nlnl"], *content, TOK["im_end"]]


def tool_call(call: list[int]) -> list[int]:
    return [TOK["tool_call"], TOK["nl"], *call, TOK["nl"], TOK["end_tool_call"]]


@dataclass(frozen=True)
class Scenario:
    """Turn k's prompt, D's reply, turn k+1's prompt, and the prompt length the router proves reproduced."""

    name: str
    prompt: list[int]
    reply: list[int]
    next_prompt: list[int]
    rung_tokens: int | None          # None: the router gives the full handle (clean continuation)
    no_margin_control: bool = False  # also inject a trim without the margin (must be caught)

    @property
    def system_tokens(self) -> int:
        """Length of the first message (the system prompt): what a P's prefix cache shares across turns."""
        return self.prompt.index(TOK["im_end"]) + 2


def scenarios() -> list[Scenario]:
    out = []
    # 1. A reasoning reply; the template drops the trace from history: D's sequence has <think>...
    #    where the next prompt has the answer, from the first reply token on.
    prompt = message("system", words(1, 40)) + message("user", words(2, 53)) + GEN
    content = words(4, 20)
    out.append(Scenario("reasoning_stripped", prompt, reasoning_reply(words(3, 30), content),
                        prompt + content + [TOK["im_end"], TOK["nl"]] + message("user", words(5, 25)) + GEN,
                        rung_tokens=len(prompt)))
    # 2. A tool call, thinking off: the parser turns the model's call into JSON arguments the template
    #    re-renders (same name, other argument tokens), and the history lacks the generation prompt's
    #    empty think block, so the prompts diverge 4 tokens before turn k's prompt ends (162 = 5 x 32 + 2:
    #    a trim without the margin would take 2 wrong tokens).
    prompt = message("system", words(11, 80)) + message("user", words(12, 65)) + GEN_NO_THINK
    call = words(13, 18)
    rerendered = call[:6] + words(14, 20)
    tool_out = [TOK["tool_response"], TOK["nl"], *words(15, 60), TOK["nl"], TOK["end_tool_response"]]
    out.append(Scenario("tool_call_rerendered", prompt, [*tool_call(call), TOK["im_end"]],
                        prompt[:-4] + tool_call(rerendered) + [TOK["im_end"], TOK["nl"]] + message("user", tool_out)
                        + GEN_NO_THINK, rung_tokens=len(prompt), no_margin_control=True))
    # 3. include_reasoning false: the client never saw the trace, so it cannot send it back. Turn k is
    #    the second turn and its prompt ends on a block boundary (160 tokens); the trace is longer than
    #    what the next turn adds, so the next prompt is shorter than D's sequence.
    prompt = (message("system", words(21, 30)) + message("user", words(22, 40)) + message("assistant", words(23, 25))
              + message("user", words(24, 42)) + GEN)
    content = words(26, 24)
    out.append(Scenario("include_reasoning_false", prompt, reasoning_reply(words(25, 40), content),
                        prompt + content + [TOK["im_end"], TOK["nl"]] + message("user", words(27, 20)) + GEN,
                        rung_tokens=len(prompt)))
    # 4. Edited history: the client rewrites its turn-k message; only turn k-1's prompt still matches.
    head = message("system", words(31, 50)) + message("user", words(32, 60))
    asst1, user2 = message("assistant", words(33, 30)), words(34, 40)
    prompt = head + asst1 + message("user", user2) + GEN
    reply = words(35, 30)
    edited = user2[:10] + words(36, 5) + user2[15:]
    out.append(Scenario("edited_history", prompt, [*reply, TOK["im_end"]],
                        head + asst1 + message("user", edited) + message("assistant", reply)
                        + message("user", words(37, 20)) + GEN, rung_tokens=len(head + GEN)))
    # 5. Regenerate: the same prompt again, shorter than D's sequence (vLLM end-trims D's block list).
    prompt = message("system", words(41, 40)) + message("user", words(42, 70)) + GEN
    out.append(Scenario("regenerate", prompt, [*words(43, 40), TOK["im_end"]], list(prompt),
                        rung_tokens=len(prompt)))
    # 6. Clean continuation: the reply comes back verbatim, the full handle is right.
    prompt = message("system", words(51, 45)) + message("user", words(52, 60)) + GEN
    reply = words(53, 35)
    out.append(Scenario("clean_continuation", prompt, [*reply, TOK["im_end"]],
                        prompt + reply + [TOK["im_end"], TOK["nl"]] + message("user", words(54, 30)) + GEN,
                        rung_tokens=None))
    return out


@dataclass(frozen=True)
class Variant:
    """One injection: which P, and how D's handle is cut."""

    name: str
    p: str              # the P engine of turn k+1 (Bed.p)
    trim: str           # "router", "full" or "no_margin"

    @property
    def prefix_caching(self) -> bool:
        """On the prefix-caching engines (vLLM's default): P's cache holds the system prompt, so vLLM
        reads D's blocks after P's local hit (its end pairing of D's list), turn k runs on ``pc_leg``."""
        return self.p.startswith("pc_")

    @property
    def leg(self) -> str:
        return "pc_leg" if self.prefix_caching else self.p


def variants(s: Scenario) -> list[Variant]:
    if s.rung_tokens is None:
        return [Variant("full@stock", "stock", "full"), Variant("full@exact", "exact", "full"),
                Variant("full@stock_pc", "pc_stock_full", "full"), Variant("full@exact_pc", "pc_exact", "full")]
    out = [Variant("router_trim@stock", "stock", "router"), Variant("router_trim@exact", "exact", "router"),
           Variant("full@stock", "stock", "full"), Variant("full@exact", "exact", "full"),
           Variant("full@exact_off", "exact_off", "full"),
           # each prefix-caching P serves one injection per scenario, so its cache holds only the system prompt
           Variant("router_trim@stock_pc", "pc_stock_trim", "router"), Variant("full@exact_pc", "pc_exact", "full"),
           Variant("full@stock_pc", "pc_stock_full", "full")]
    if s.no_margin_control:
        out.append(Variant("trim_no_margin@stock", "stock", "no_margin"))
    return out


def trimmed(params: dict[str, Any], tokens: int) -> dict[str, Any]:
    """D's handle cut by the router's own function: T tokens, every block group and D's digest with it."""
    # The router sees D's params as JSON (block groups are lists there, tuples in-process).
    handle = trim_handle(json.loads(json.dumps(params)), tokens, BLOCK_SIZE)
    if handle is None:
        raise AssertionError(f"the router refuses to cut D's handle to {tokens} tokens: {params!r}")
    return handle


def injected(s: Scenario, v: Variant, params: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    if v.trim == "full" or s.rung_tokens is None:
        return dict(params), None
    margin = MARGIN if v.trim == "router" else 0
    t = (s.rung_tokens - margin) // BLOCK_SIZE * BLOCK_SIZE
    return trimmed(params, t), t


def _sha(blobs: list[bytes]) -> list[str]:
    return [hashlib.sha256(b).hexdigest()[:16] for b in blobs]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=list)) if obj is not None else None


class Bed:
    """D and the kinds of P, without and with prefix caching (P and D must agree on it), stepped together."""

    def __init__(self, work: Path) -> None:
        model = write_model_dir(work / "opt")
        bidir = {"bidirectional_kv_xfer": True}

        def d(name: str, pc: bool) -> CpuEngine:
            return CpuEngine(name, model, work, writer_tag=0, num_blocks=1024, prefix_caching=pc,
                          extra={**bidir, "kvdiag_role": "decode",
                                 "kvdiag_events_file": str(work / f"{name.lower()}-events.jsonl")})

        def p(name: str, pc: bool, kvdiag: dict[str, Any] | None = None) -> CpuEngine:
            if kvdiag is None:
                return CpuEngine(name, model, work, writer_tag=0, num_blocks=512 if pc else 1024, prefix_caching=pc,
                              connector=PLAIN_CONNECTOR, extra=bidir)
            return CpuEngine(name, model, work, writer_tag=0, num_blocks=512 if pc else 1024, prefix_caching=pc,
                          extra={**bidir, **kvdiag, "kvdiag_role": "prefill",
                                 "kvdiag_events_file": str(work / f"{name.lower()}-events.jsonl")})

        self.d = d("D", False)
        self.d_pc = d("Dpc", True)
        self.p = {
            "stock": p("Pstock", False), "exact": p("Pexact", False, {}),
            "exact_off": p("Poff", False, {"kvdiag_pull_matching_prefix": False}),
            "pc_leg": p("PpcLeg", True), "pc_stock_trim": p("PpcTrim", True), "pc_stock_full": p("PpcFull", True),
            "pc_exact": p("PpcExact", True, {}),
        }
        os.sched_setaffinity(0, _AFFINITY)
        for eng in self.p.values():
            eng.record_reads = True
        self.engines = [self.d, self.d_pc, *self.p.values()]

    def d_for(self, v: Variant) -> CpuEngine:
        return self.d_pc if v.prefix_caching else self.d

    def until(self, done: Callable[[], bool], engines: list[CpuEngine] | None = None, timeout_s: float = 120.0) -> None:
        """Step ``engines`` (default: all) until ``done()``. A NIXL READ needs only the reader stepping."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"did not converge in {timeout_s} s")
            for eng in engines or self.engines:
                eng.step()
            time.sleep(0.0005)   # yield the core to NIXL's progress thread and the other engines' work

    def pump(self, steps: int, engines: list[CpuEngine] | None = None) -> None:
        for _ in range(steps):
            for eng in engines or self.engines:
                eng.step()

    def shutdown(self) -> None:
        for eng in self.engines:
            if eng.connector is not None and hasattr(eng.connector, "kvdiag_flush"):
                eng.connector.kvdiag_flush()
            eng.shutdown()


def _prefill_positions(p: CpuEngine, rid: str, n: int) -> tuple[Any, list[bytes]]:
    out = p.finished[rid]
    blocks = list(out.kv_transfer_params["remote_block_ids"][0])   # P's own blocks, held for a D
    return out, p.position_bytes(blocks, n)


def run(work: Path) -> dict[str, Any]:
    bed = Bed(work)
    scns = scenarios()
    plan = [(s, v) for s in scns for v in variants(s)]
    results: dict[str, Any] = {"block_size": BLOCK_SIZE, "block_bytes": BLOCK_BYTES, "margin": MARGIN,
                               "scenarios": {}, "variants": []}
    try:
        # Turn k, P->D, every injection's own copy at once (each D->P read consumes one retained copy).
        t0 = time.monotonic()
        ids = {}
        for s, v in plan:
            key = f"{s.name}.{v.name}"
            ids[key] = (f"cmpl-{s.name}-{v.name}-tk-p-0", f"cmpl-{s.name}-{v.name}-tk-d-0")
            bed.p[v.leg].add(ids[key][0], s.prompt, max_tokens=1,
                             kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        bed.until(lambda: all(ids[f"{s.name}.{v.name}"][0] in bed.p[v.leg].finished for s, v in plan))
        for s, v in plan:
            p_rid, d_rid = ids[f"{s.name}.{v.name}"]
            d = bed.d_for(v)
            d.reply_plans[d_rid] = list(s.reply)
            d.add(d_rid, s.prompt, max_tokens=len(s.reply),
                  kv_transfer_params=bed.p[v.leg].finished[p_rid].kv_transfer_params)
        bed.until(lambda: all(ids[f"{s.name}.{v.name}"][1] in bed.d_for(v).finished for s, v in plan))
        results["turn_k_seconds"] = round(time.monotonic() - t0, 2)
        for s in scns:
            d_seq = s.prompt + s.reply[:-1]       # the last sampled token has no KV yet
            ref_rid = f"cmpl-{s.name}-reference-0"
            bed.p["stock"].add(ref_rid, s.next_prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            bed.until(lambda rid=ref_rid: rid in bed.p["stock"].finished, [bed.p["stock"]])
            _out, ref = _prefill_positions(bed.p["stock"], ref_rid, len(s.next_prompt))
            common = _common_prefix(d_seq, s.next_prompt)
            results["scenarios"][s.name] = {
                "prompt_tokens": len(s.prompt), "reply_tokens": len(s.reply), "d_tokens": len(d_seq),
                "next_prompt_tokens": len(s.next_prompt), "rung_tokens": s.rung_tokens, "common_prefix": common,
                "system_tokens": s.system_tokens,
                # positions past the divergence where the token id itself equals D's (only its prefix differs)
                "same_token_after_divergence": sum(1 for a, b in zip(d_seq[common:], s.next_prompt[common:],
                                                                    strict=False) if a == b)}
            for v in variants(s):
                results["variants"].append(_inject(bed, s, v, ids[f"{s.name}.{v.name}"][1], d_seq, ref))
    finally:
        bed.shutdown()
    return results


def _inject(bed: Bed, s: Scenario, v: Variant, d_rid: str, d_seq: list[int], ref: list[bytes]) -> dict[str, Any]:
    started = time.monotonic()
    d_eng = bed.d_for(v)
    d_out = d_eng.finished[d_rid]
    d_params = d_out.kv_transfer_params
    d_blocks = list(d_params["remote_block_ids"][0])
    d_sha = _sha(d_eng.block_bytes(d_blocks))
    handle, router_t = injected(s, v, d_params)
    p = bed.p[v.p]
    rid = f"cmpl-{s.name}-{v.name}-tk1-p-0"
    if v.prefix_caching:   # P has served this system prompt before: its blocks are in P's prefix cache
        warm = f"cmpl-{s.name}-{v.name}-warm-0"
        p.add(warm, s.prompt[:s.system_tokens], max_tokens=1)
        bed.until(lambda: warm in p.finished, [p])
    stats_before = len(p.stats)
    p.add(rid, s.next_prompt, max_tokens=1, kv_transfer_params=handle)
    bed.until(lambda: rid in p.finished, [p, d_eng])
    bed.pump(3, [p, d_eng])     # NIXL's stats for the read reach the scheduler's stats within a step or two
    out, got = _prefill_positions(p, rid, len(s.next_prompt))
    received = p.received.get(rid, {})
    read_tokens = int(received.get("tokens", 0))
    wrong = [i for i in range(len(s.next_prompt)) if got[i] != ref[i]]
    read_plan = p.read_plans.get(rid)
    vllm_read = None
    if read_plan is not None:   # vLLM's own pairing: P's allocated blocks with the END of D's list
        local, remote = read_plan["local"][0], read_plan["remote"][0]   # local: P's blocks for the read
        vllm_read = [d_blocks.index(b) if b in d_blocks else None for b in remote[-len(local):]]
    nixl_bytes = [b for st in p.stats[stats_before:] for b in st.get("bytes_transferred", [])]
    safe = v.trim == "router" or v.p in ("exact", "pc_exact") or s.rung_tokens is None
    turn = _finish_turn(bed, s, v, p, out) if safe else {}
    return {**turn,
        "scenario": s.name, "variant": v.name, "p": v.p, "trim": v.trim, "prefix_caching": v.prefix_caching,
        "d_finish": str(d_out.finish_reason), "d_generated_ok": d_eng.tokens.get(d_rid) == s.reply,
        "handle_tokens": d_params["remote_num_tokens"], "handle_blocks": len(d_blocks),
        "injected_tokens": handle["remote_num_tokens"], "injected_blocks": len(handle["remote_block_ids"][0]),
        "router_t": router_t, "digest": d_params.get("kvdiag_digest"),
        "read_tokens": read_tokens,
        "read_d_blocks": [d_sha.index(x) if x in d_sha else None for x in _sha(received.get("bytes", []))],
        "vllm_read_d_blocks": vllm_read, "vllm_remote_num_tokens": read_plan["num_tokens"] if read_plan else None,
        "vllm_read_local_blocks": len(read_plan["local"][0]) if read_plan else 0,
        "nixl_bytes": nixl_bytes,
        "wrong_positions": len(wrong), "wrong_in_read": sum(1 for i in wrong if i < read_tokens),
        "first_wrong": wrong[0] if wrong else None,
        "p_finish": str(out.finish_reason), "report": _jsonable((out.kv_transfer_params or {}).get("kvdiag")),
        "seconds": round(time.monotonic() - started, 2)}


def _finish_turn(bed: Bed, s: Scenario, v: Variant, p: CpuEngine, out: Any) -> dict[str, Any]:
    """Turn k+1's decode leg on D (P->D read of P's blocks, a few tokens): the turn completes."""
    rid = f"cmpl-{s.name}-{v.name}-tk1-d-0"
    p_sha = _sha(p.block_bytes(list(out.kv_transfer_params["remote_block_ids"][0])))  # before D frees them
    d = bed.d_for(v)
    d.reply_plans[rid] = words(99, 4)
    d.add(rid, s.next_prompt, max_tokens=4, kv_transfer_params=out.kv_transfer_params)
    bed.until(lambda: rid in d.finished, [d, p])
    got = _sha(d.received.get(rid, {}).get("bytes", []))
    return {"next_d_finish": str(d.finished[rid].finish_reason), "next_d_ok": d.tokens.get(rid) == words(99, 4),
            "next_d_read_blocks": len(got), "next_d_read_matches_p": bool(got) and got == p_sha[:len(got)]}


def main(out: Path) -> int:
    import faulthandler

    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging, set_vllm_process_name

    configure_logging(LoggingConfig(log_level="INFO"))
    set_vllm_process_name("EngineCore")
    faulthandler.dump_traceback_later(150, repeat=True)  # a hang leaves every thread's stack in the log
    started = time.monotonic()
    try:
        results = run(out)
    except Exception:
        results = {"error": traceback.format_exc()}
    results["seconds"] = round(time.monotonic() - started, 2)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    log = os.open(out_dir / "engine.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.exit(main(out_dir))
