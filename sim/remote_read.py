"""The reader side of a KV pull, as vLLM's NIXL connector does it: validate, threshold, handshake, expiry, read.

P runs it with D's handle (D->P, bidirectional turn 2); D runs it with P's params (P->D). The
result records the facts (offered, read, bytes, ms, failure type); P turns them into the Contract 4
outcome with the rule it shares with the real connector (kvdiag.schema.prefill_outcome). Failures
are logged with vLLM's own lines; the caller applies ``kv_load_failure_policy``.

The read is positional, as in vLLM 0.33: the reader counts ``min(remote_num_tokens, prompt) -
local hit`` tokens, allocates blocks for them and pairs those blocks with the *end* of the
handle's block list (``_apply_prefix_caching``: ``remote[-n:]``). A handle whose list is longer
than the blocks the count needs (a full handle on a shorter prompt) therefore loads D's last
blocks into the reader's positions. The loaded blocks carry the token ids their KV was computed
for; the reader compares them with its prompt position by position and counts ``wrong_kv_tokens``.

In instrumented mode P first checks D's block-hash digest (``kvdiag_digest``) against its prompt,
as kvdiag's connector does, and in exact mode (``pull_matching_prefix``, on by default) cuts the
handle to the proven prefix before vLLM's count and end-trim see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvdiag.schema.prefill_outcome import DECLINED_EXPIRED
from kvdiag.schema.prefix_digest import DIGEST_KEY, DigestError, check_prefix
from kvdiag.sim import vllm_log_writer as vl
from kvdiag.sim.kvcache import blocks_for, chain_hashes
from kvdiag.sim.nixl import NixlFailure, RemoteAgent

if TYPE_CHECKING:
    from kvdiag.sim.emulated_engine import Engine, RequestState

_MAX_REMOTE_BLOCKS: Final = 1 << 20
_REQUIRED: Final = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_FAILURE_MSG: Final = {
    "transfer_failed": "Marking blocks as invalid",
    "transfer_setup_failed": "Marking blocks as invalid",
    "notification_failed": "P worker blocks will be freed after timeout. This may indicate network issues.",
}


@dataclass
class ReadResult:
    """What a pull did."""

    remote_num_tokens: int = 0
    offered: int = 0  # r: min(remote_num_tokens, prompt) - local hit (vLLM's count)
    invalid: str | None = None  # why the handle was unusable
    started: bool = False
    read_tokens: int = 0  # tokens actually loaded
    read_blocks: int = 0
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    failure_type: str | None = None  # vLLM's failure_type, or DECLINED_EXPIRED
    notification_failed: bool = False
    stale: bool = False  # the read found D no longer holding the blocks (sim-only knowledge)
    mismatch_block: int | None = None  # first block the digest check found diverging
    mismatch_tokens: int | None = None  # offered tokens past the proven prefix (None: no check ran)
    pull_limit_tokens: int | None = None  # remote_num_tokens after exact mode cut the handle
    digest_error: str | None = None
    wrong_kv_tokens: int = 0  # loaded positions whose KV was computed for other token ids
    failed: bool = False  # declined or failed: the caller applies kv_load_failure_policy
    reason: str | None = None
    affected_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def has_handle(params: dict[str, Any]) -> bool:
    """True if params name remote blocks to pull (vLLM: remote_block_ids non-empty)."""
    blocks = params.get("remote_block_ids")
    return isinstance(blocks, list | tuple) and len(blocks) > 0 and any(
        isinstance(g, list | tuple) and len(g) > 0 for g in blocks)


def validate_handle(params: dict[str, Any], allowed_hosts: tuple[str, ...]) -> str | None:
    """Why ``params`` cannot be used (None if it can). Client-supplied: every field is checked."""
    for key in _REQUIRED:
        if params.get(key) is None:
            return f"missing {key}"
    if not isinstance(params["remote_engine_id"], str) or not isinstance(params["remote_request_id"], str):
        return "remote_engine_id and remote_request_id must be strings"
    if len(params["remote_engine_id"]) > 256 or len(params["remote_request_id"]) > 512:
        return "id too long"
    port = params["remote_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return "remote_port must be an integer port"
    if params["remote_host"] not in allowed_hosts:
        return f"remote_host {params['remote_host']!r} is not an allowed side-channel host"
    groups = params["remote_block_ids"]
    group = groups[0]
    if len(group) > _MAX_REMOTE_BLOCKS or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                  for b in group):
        return "remote_block_ids must be lists of non-negative integers"
    num = params.get("remote_num_tokens")
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        return "remote_num_tokens must be a non-negative integer"
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, int | float)):
        return "remote_blocks_expiry_time must be a number or null"
    return None


def _context(engine: Engine, state: RequestState, params: dict[str, Any], ftype: str,
             request_id: str | None, n_local: int, **extra: Any) -> dict[str, Any]:
    ctx: dict[str, Any] = {"failure_type": ftype, "request_id": request_id, "engine_id": engine.engine_id}
    if request_id is None:
        ctx["remote_engine_id"] = params.get("remote_engine_id")
        return ctx
    remote = params.get("remote_block_ids") or [[]]
    ctx.update({"remote_engine_id": params.get("remote_engine_id"),
                "remote_request_id": params.get("remote_request_id"), "remote_host": params.get("remote_host"),
                "remote_port": params.get("remote_port"), "num_local_blocks": n_local,
                "num_remote_blocks": len(remote[0]),
                "local_block_ids_sample": list(range(1, n_local + 1))[:8]})
    ctx.update(extra)
    return ctx


def log_failure(engine: Engine, state: RequestState, params: dict[str, Any], ftype: str, n_local: int,
                exc_line: str | None = None, **extra: Any) -> None:
    """vLLM's ``NIXL transfer failure: %s | Context: %s`` line(s) for ``ftype``."""
    log = engine.log
    if ftype in ("handshake_failed", "handshake_setup_failed"):
        tb = ("Traceback (most recent call last):",
              '  File "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py", line 1429, in '
              "_background_nixl_handshake", exc_line or "RuntimeError: handshake failed")
        log.log("ERROR", "handshake_setup_failed", vl.MSG_TRANSFER_FAILURE, "handshake_setup_failed",
                _context(engine, state, params, "handshake_setup_failed", None, n_local), extra_lines=tb)
        if ftype == "handshake_failed":
            log.log("ERROR", "handshake_failed", vl.MSG_TRANSFER_FAILURE, "handshake_failed",
                    _context(engine, state, params, "handshake_failed", state.internal_id, n_local))
        return
    msg = _FAILURE_MSG.get(ftype)
    first = f"{ftype}. {msg}" if msg else ftype
    log.log("ERROR", ftype, vl.MSG_TRANSFER_FAILURE, first,
            _context(engine, state, params, ftype, state.internal_id, n_local, **extra))


def check_digest(engine: Engine, state: RequestState, params: dict[str, Any], res: ReadResult) -> dict[str, Any]:
    """P's block-hash check of D's handle; in exact mode return the handle cut to the proven prefix."""
    bs = engine.config.block_size
    prompt_hashes = [bytes.fromhex(h) for h in state.block_hashes or chain_hashes(state.prompt, bs)]
    try:
        check = check_prefix(params[DIGEST_KEY], prompt_hashes, state.prompt, bs, res.remote_num_tokens)
    except DigestError as exc:
        res.digest_error = str(exc)
        return params
    res.mismatch_tokens = check.mismatch_tokens
    res.mismatch_block = check.mismatch_block
    if not engine.faults.pull_matching_prefix:
        return params
    target, need = check.proven_tokens, blocks_for(check.proven_tokens, bs)
    groups = params["remote_block_ids"]
    if target == res.remote_num_tokens and not any(len(g) > need for g in groups):
        return params
    res.pull_limit_tokens = target
    return {**params, "remote_num_tokens": target, "remote_block_ids": [list(g)[:need] for g in groups]}


def place_loaded(state: RequestState, res: ReadResult, block_tokens: Any, first: int, count: int, bs: int) -> None:
    """Write the loaded blocks' token ids into the reader's KV positions ``first..first+count`` and count
    the positions whose KV was computed for another token."""
    blocks = block_tokens if isinstance(block_tokens, list) else []
    base = first // bs
    wrong = 0
    for pos in range(first, first + count):
        j, off = pos // bs - base, pos % bs
        block = blocks[j] if j < len(blocks) and isinstance(blocks[j], list) else []
        tok = block[off] if off < len(block) and isinstance(block[off], int) else -1
        state.kv[pos] = tok
        wrong += tok != state.prompt[pos]
    res.wrong_kv_tokens = wrong


async def pull(engine: Engine, state: RequestState, params: dict[str, Any], *, d2p: bool) -> ReadResult:
    """Pull the remote blocks ``params`` name for ``state`` (already matched locally)."""
    res = ReadResult()
    bs = engine.config.block_size
    prompt_len = len(state.prompt)
    hit = state.hit_tokens
    log = engine.log
    if log.enabled("DEBUG"):
        log.log("DEBUG", "get_num_new_matched", vl.MSG_GET_NUM_NEW_MATCHED, hit, _params_repr(params))
    reason = validate_handle(params, engine.config.allowed_remote_hosts)
    if reason is not None:
        log.log("WARNING", "invalid_params", vl.MSG_INVALID_PARAMS, _params_repr(params))
        res.invalid = f"invalid kv_transfer_params ({reason}): not used"
        return res
    res.remote_num_tokens = int(params["remote_num_tokens"])
    if d2p and engine.config.instrumented and DIGEST_KEY in params:
        params = check_digest(engine, state, params, res)
    remote_num = int(params["remote_num_tokens"])
    res.offered = min(remote_num, prompt_len) - hit
    # vLLM never uses the loaded KV of the last prompt token: it is recomputed to produce the first output token.
    want = max(0, min(remote_num, prompt_len - 1) - hit)
    threshold = engine.faults.kv_recompute_threshold
    remote_group = list(params["remote_block_ids"][0])
    if threshold > 0 and 0 < res.offered < threshold:
        log.log("DEBUG", "skip_pull", vl.MSG_SKIP_PULL, state.internal_id, res.offered, threshold)
        engine.count_threshold_skip()
        want = 0
    if want <= 0:
        # Notify-only: vLLM still handshakes and notifies, so the owner frees its blocks at once.
        log.log("DEBUG", "start_load_kv", vl.MSG_START_LOAD_KV, state.internal_id, params["remote_engine_id"],
                0, 1)
        try:
            agent = await engine.nixl.handshake(params["remote_engine_id"], params["remote_host"],
                                                int(params["remote_port"]))
            await engine.nixl.notify(agent, params["remote_request_id"])
        except NixlFailure as exc:
            log_failure(engine, state, params, exc.failure_type, 0, exc.exc_line)
            engine.count_failed_transfer(notification=exc.failure_type == "notification_failed")
        return res
    # The worker pairs the blocks allocated for the counted tokens with the END of D's list.
    n_local = blocks_for(hit + res.offered, bs) - hit // bs
    res.affected_tokens = res.offered
    res.started = True
    if n_local > len(remote_group):
        # vLLM asserts here (_apply_prefix_caching): a handle whose count needs more blocks than it lists.
        log_failure(engine, state, params, "transfer_setup_failed", n_local)
        engine.count_failed_transfer()
        return _failed(res, "transfer_setup_failed", f"the handle lists {len(remote_group)} blocks for "
                       f"{res.offered} tokens that need {n_local} (vLLM's worker asserts on it)")
    read_ids = remote_group[len(remote_group) - n_local:]
    injected = engine.faults.transfer_failure()
    try:
        if injected in ("handshake_failed", "handshake_setup_failed"):
            raise NixlFailure(injected, "injected", "zmq.error.Again: Resource temporarily unavailable")
        agent = await engine.nixl.handshake(params["remote_engine_id"], params["remote_host"],
                                            int(params["remote_port"]))
        engine.note_handshake(agent)
    except NixlFailure as exc:
        log_failure(engine, state, params, exc.failure_type, n_local, exc.exc_line)
        engine.count_failed_transfer()
        return _failed(res, exc.failure_type, f"{exc.failure_type}: {exc}")
    if not await _check_expiry(engine, state, params, agent, res):
        return res
    if log.enabled("DEBUG"):
        log.log("DEBUG", "start_load_kv", vl.MSG_START_LOAD_KV, state.internal_id, agent.engine_id, 1, 1)
        log.log("DEBUG", "remote_agent", vl.MSG_REMOTE_AGENT, agent.engine_id, 0, bs, state.internal_id)
    if injected in ("transfer_setup_failed", "transfer_failed"):
        extra = ({"dst_engine_id": agent.engine_id, "remote_rank": 0} if injected == "transfer_setup_failed"
                 else {"xfer_state": "ERR"})
        log_failure(engine, state, params, injected, n_local, **extra)
        engine.count_failed_transfer()
        return _failed(res, injected, f"{injected}: injected by --fail-transfers")
    res.transfer_ms = engine.profile.transfer_ms(want)
    res.transfer_bytes = engine.profile.transfer_bytes(want)  # the issue: bytes = tokens x KV bytes per token
    t0 = time.perf_counter()
    await engine.advance(state, res.transfer_ms)
    notify = injected != "notification_failed"
    try:
        data = await engine.nixl.read(agent, params["remote_request_id"], read_ids, state.internal_id, notify)
    except NixlFailure as exc:
        log_failure(engine, state, params, exc.failure_type, n_local, xfer_state="ERR")
        engine.count_failed_transfer()
        return _failed(res, exc.failure_type, f"{exc.failure_type}: {exc}")
    if not notify:
        log_failure(engine, state, params, "notification_failed", n_local, dst_engine_id=agent.engine_id,
                    remote_rank=0, remote_agent_name=agent.engine_id)
        engine.count_failed_transfer(notification=True)
        res.notification_failed = True
    res.read_tokens, res.read_blocks = want, len(read_ids)
    engine.record_transfer(res.transfer_ms, time.perf_counter() - t0, res.transfer_bytes, len(read_ids))
    log.log("DEBUG", "get_finished", vl.MSG_GET_FINISHED, 0, 0, 1, 0)
    log.log("DEBUG", "finished_recving", vl.MSG_FINISHED_RECVING, state.internal_id)
    if not data.get("held", False):
        # Real NIXL reads whatever the memory holds; D then logs "Potentially invalid KV blocks".
        res.stale = True
    place_loaded(state, res, data.get("block_tokens"), hit, want, bs)
    return res




async def _check_expiry(engine: Engine, state: RequestState, params: dict[str, Any], agent: RemoteAgent,
                        res: ReadResult) -> bool:
    """Decline a read of blocks that expire within the safety margin (PR #47021); False if declined."""
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is None:
        return True
    deadline_local = float(expiry) - agent.clock_offset
    if time.perf_counter() + engine.config.expiry_safety_margin_s < deadline_local:
        return True
    engine.log.log("WARNING", "declining", vl.MSG_DECLINING, state.internal_id, agent.engine_id)
    engine.count_expired()  # vLLM 0.33: an expiry, not a transport failure
    _failed(res, DECLINED_EXPIRED, "read declined: D's blocks expire within the safety margin "
            f"({engine.config.expiry_safety_margin_s:g} s)")
    return False


def _failed(res: ReadResult, ftype: str, reason: str) -> ReadResult:
    res.failed = True
    res.failure_type = ftype
    res.reason = reason
    return res


def _params_repr(params: dict[str, Any]) -> str:
    shown = dict(params)
    shown.pop("kvdiag", None)
    if isinstance(shown.get("remote_block_ids"), list):
        shown["remote_block_ids"] = tuple(shown["remote_block_ids"])
    return repr(shown)
