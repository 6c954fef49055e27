"""The real-vLLM backend's options: ``kvdiag sim prefill|decode --engine vllm`` and its own command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

USAGE = """The real-vLLM engine backend of the testbed: the emulated engines' HTTP API over vLLM's own
Scheduler, kvdiag's connector and NIXL, on CPU.

    python -m kvdiag.sim.vllm_backend prefill --port 0 --ready-file p.json --events-file p.jsonl
    python -m kvdiag.sim.vllm_backend decode  --port 0 --ready-file d.json --events-file d.jsonl

``kvdiag sim prefill|decode --engine vllm`` runs the same engine.
"""

MAX_PROMPT_TOKENS = 1800      # below the OPT-shaped model's 2048 positions, leaving room to decode
MAX_NEW_TOKENS = 200


@dataclass
class Options:
    """One engine's settings (the names follow ``kvdiag sim`` where they exist)."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    side_channel_port: int = 0
    model: str = "Qwen/Qwen3-32B"
    engine_id: str | None = None
    bidirectional: bool = True
    kv_recompute_threshold: int | None = None
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    num_blocks: int = 512
    events_file: str | None = None
    log_file: str | None = None
    log_level: str = "INFO"
    ready_file: str | None = None
    pull_matching_prefix: bool = True     # the connector's exact mode (kvdiag_pull_matching_prefix)
    prefix_digest: bool = True            # D returns kvdiag_digest (kvdiag_digest)
    seed: int = 0
    log_stats_interval: float | None = None   # seconds between stat lines; None: VLLM_LOG_STATS_INTERVAL (10)
    connector: str = "kvdiag"             # "kvdiag": KVDiagNixlConnector; "nixl": vLLM's own NixlConnector


CPU_MAX_BLOCKS = 2048   # 2,048 x 196,608 B = 384 MiB of KV per engine: plenty for the testbed's prompts


def options_from_sim(role: str, opts: dict[str, Any]) -> Options:
    """Map ``kvdiag sim prefill|decode`` options onto this backend (for ``--engine vllm``).

    ``--pull-matching-prefix`` and ``--prefix-digest`` map onto the connector's
    ``kvdiag_pull_matching_prefix`` and ``kvdiag_digest``. The time model, fault injection, stream
    switches, reasoning and tool-call parsers of the emulated engines do not apply: the
    real engine's behaviour is vLLM's own. ``--block-size`` is fixed at 32 (vLLM's CPU attention)
    and ``--num-blocks`` is capped at 2,048 (CPU memory).
    """
    return Options(role=role, host=opts.get("host", "127.0.0.1"), port=opts.get("port", 0),
                   side_channel_port=opts.get("side_channel_port", 0), model=opts.get("model", "Qwen/Qwen3-32B"),
                   engine_id=opts.get("engine_id"), bidirectional=not opts.get("no_bidirectional", False),
                   kv_recompute_threshold=opts.get("kv_recompute_threshold"),
                   decoder_kv_blocks_ttl=opts.get("decoder_kv_blocks_ttl", 480.0),
                   kv_lease_duration=opts.get("kv_lease_duration", 30.0),
                   prefix_caching=not opts.get("no_prefix_caching", False),
                   kv_load_failure_policy=opts.get("kv_load_failure_policy", "fail"),
                   num_blocks=min(int(opts.get("num_blocks") or 512), CPU_MAX_BLOCKS),
                   events_file=opts.get("events_file"), log_file=opts.get("log_file"),
                   log_level=str(opts.get("log_level", "INFO")).upper(), ready_file=opts.get("ready_file"),
                   pull_matching_prefix=bool(opts.get("pull_matching_prefix", True)),
                   prefix_digest=bool(opts.get("prefix_digest", True)),
                   log_stats_interval=opts.get("log_stats_interval"))


def parse_args(argv: list[str]) -> Options:
    """Command-line options (the names of ``kvdiag sim prefill|decode``)."""
    p = argparse.ArgumentParser(prog="python -m kvdiag.sim.vllm_backend", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--side-channel-port", type=int, default=0)
    p.add_argument("--model", default="Qwen/Qwen3-32B")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--no-bidirectional", action="store_true")
    p.add_argument("--kv-recompute-threshold", type=int, default=None)
    p.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0)
    p.add_argument("--kv-lease-duration", type=float, default=30.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--events-file", default=None)
    p.add_argument("--log-file", default=None)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--ready-file", default=None)
    p.add_argument("--pull-matching-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="exact mode: P reads only the prefix D's block-hash digest proves equal to its prompt")
    p.add_argument("--prefix-digest", action=argparse.BooleanOptionalAction, default=True,
                   help="D returns kvdiag_digest, its sequence's block hashes")
    p.add_argument("--connector", choices=("kvdiag", "nixl"), default="kvdiag",
                   help="kvdiag's instrumented connector, or vLLM's own NixlConnector (the stock side of a comparison)")
    p.add_argument("--log-stats-interval", type=float, default=None,
                   help="seconds between vLLM's stat lines (default: VLLM_LOG_STATS_INTERVAL, else 10)")
    a = p.parse_args(argv)
    return Options(role=a.role, host=a.host, port=a.port, side_channel_port=a.side_channel_port, model=a.model,
                   engine_id=a.engine_id, bidirectional=not a.no_bidirectional,
                   kv_recompute_threshold=a.kv_recompute_threshold, decoder_kv_blocks_ttl=a.decoder_kv_blocks_ttl,
                   kv_lease_duration=a.kv_lease_duration, prefix_caching=not a.no_prefix_caching,
                   kv_load_failure_policy=a.kv_load_failure_policy, num_blocks=a.num_blocks,
                   events_file=a.events_file, log_file=a.log_file, log_level=a.log_level, ready_file=a.ready_file,
                   pull_matching_prefix=a.pull_matching_prefix, prefix_digest=a.prefix_digest,
                   log_stats_interval=a.log_stats_interval, connector=a.connector)
