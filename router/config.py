"""The router's configuration: one frozen value, validated once at startup.

Usage::

    config = RouterConfig(prefill=(Upstream("127.0.0.1", 8100),), decode=(Upstream("127.0.0.1", 8200),))
    config.validate()   # raises RouterConfigError naming the option and the fix
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvdiag.schema.errors import KVDiagError

DEFAULT_DECODER_KV_BLOCKS_TTL: Final = 480.0  # vLLM's default decoder_kv_blocks_ttl (seconds)
DEFAULT_TTL_MARGIN: Final = 30.0  # 480 - 30 = 450 s, the example proxy's TTL
# P declines a D->P read when D's deadline is within this many seconds (vLLM pull_worker.py).
P_EXPIRY_SAFETY_MARGIN: Final = 5.0
POLICIES: Final = ("round-robin", "kv-aware")  # placement policies (router/placement.py)


class RouterConfigError(KVDiagError, ValueError):
    """The router cannot start with these options; the message names the option and the fix."""


@dataclass(frozen=True)
class Upstream:
    """One vLLM engine's HTTP endpoint."""

    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port``: the instance's identity across router replicas."""
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://host:port`` (IPv6 literals bracketed)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; build it in the CLI, validate it, never mutate it."""

    prefill: tuple[Upstream, ...]
    decode: tuple[Upstream, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    # state
    state: str = "memory"  # "memory" or a redis:// / rediss:// / unix:// URL
    decoder_kv_blocks_ttl: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    entry_ttl: float | None = None  # None: decoder_kv_blocks_ttl - DEFAULT_TTL_MARGIN
    max_entries: int = 100_000
    # the per-conversation "last turn" record outlives the handle so a later turn can say why it missed
    last_turn_ttl: float = 3600.0
    # timeouts (seconds)
    prefill_timeout: float = 120.0
    decode_timeout: float = 120.0  # connect + time between two reads of the decode stream
    connect_timeout: float = 5.0
    # connection pools
    max_connections: int = 1000
    max_connections_per_host: int = 500
    # telemetry
    events_file: Path | None = None
    proxy_log: Path | None = None
    hash_ids: bool = False
    otlp_endpoint: str | None = None
    service_name: str = "kvdiag-router"
    # how many distinct `model` label values metrics keep before folding the rest into "other"
    max_model_labels: int = 16
    # reuse rule (docs/router.md "Which tokens a handle may cover")
    block_size: int | None = None  # D's KV block size; None: inferred per engine from the handles seen
    template_margin_tokens: int = 8  # generation-prompt tokens a history rendering may not reproduce
    verify_tokens: bool = False  # prove reuse token by token (P's /tokenize, D's token ids)
    # a prompt that diverges at a clean boundary without a token count: ask P's /tokenize for it
    tokenize_shared_prefix: bool = True
    shared_prefix_timeout: float = 1.0  # seconds; a slower /tokenize falls back to the turn boundaries
    max_reply_bytes: int = 8 << 20  # a decode stream recorded beyond this is unverifiable
    # placement (docs/router.md "Placement"): where each turn's prefill and decode run
    policy: str = "round-robin"  # or "kv-aware"
    prefill_locality: bool = True  # kv-aware: P caches prefixes, so the conversation's last P holds its history
    load_factor: float = 2.0  # kv-aware: an instance holding more than this times the mean load loses its affinity
    branch_wait: float = 5.0  # kv-aware: longest wait of a concurrent turn for its leader's prefill (s; capped by
    # the prefill timeout)
    # upstream health (docs/router.md "Upstream health")
    eject_after: int = 5  # consecutive connect errors, timeouts or 5xx that eject an instance (0: never)
    eject_seconds: float = 30.0  # the first ejection; doubled on each repeat without a success in between
    max_eject_seconds: float = 300.0
    health_check_interval: float = 0.0  # active GET /health on every instance this often (0: off)
    health_check_timeout: float = 2.0

    @property
    def handle_ttl(self) -> float:
        """The router's entry TTL in seconds (explicit or derived from D's block TTL)."""
        if self.entry_ttl is not None:
            return self.entry_ttl
        return max(self.decoder_kv_blocks_ttl - DEFAULT_TTL_MARGIN, self.decoder_kv_blocks_ttl / 2)

    @property
    def lock_ttl(self) -> float:
        """How long a turn's in-flight claim lives if its router dies mid-turn."""
        return self.prefill_timeout + self.decode_timeout + 30.0

    def validate(self) -> RouterConfig:
        """Check every option; raise RouterConfigError naming the first bad one and the fix. Returns self."""
        if not self.prefill:
            raise RouterConfigError("no prefill instance: pass --prefiller-hosts/--prefiller-ports")
        if not self.decode:
            raise RouterConfigError("no decode instance: pass --decoder-hosts/--decoder-ports")
        for role, ups in (("prefiller", self.prefill), ("decoder", self.decode)):
            for up in ups:
                if not 0 < up.port < 65536:
                    raise RouterConfigError(f"--{role}-ports: {up.port} is not a TCP port (1-65535)")
        if self.decoder_kv_blocks_ttl <= 0:
            raise RouterConfigError("--decoder-kv-blocks-ttl must be positive (vLLM's default is 480)")
        ttl = self.handle_ttl
        if ttl <= 0:
            raise RouterConfigError("--entry-ttl must be positive")
        if ttl >= self.decoder_kv_blocks_ttl:
            raise RouterConfigError(
                f"--entry-ttl {ttl:g}s must be below decoder_kv_blocks_ttl ({self.decoder_kv_blocks_ttl:g}s): "
                "D frees a conversation's blocks after that TTL (not renewed), so a handle the router still "
                "holds would point at released blocks and every late turn would fail or recompute. "
                f"Use --entry-ttl {max(self.decoder_kv_blocks_ttl - DEFAULT_TTL_MARGIN, 1):g} or raise "
                "--decoder-kv-blocks-ttl to match D's kv_connector_extra_config")
        if self.max_entries < 1:
            raise RouterConfigError("--max-entries must be at least 1")
        if self.last_turn_ttl < ttl:
            raise RouterConfigError("--last-turn-ttl must be at least the entry TTL, or expiry cannot be told apart")
        for name in ("prefill_timeout", "decode_timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise RouterConfigError(f"--{name.replace('_', '-')} must be positive (seconds)")
        if self.max_connections < 1 or self.max_connections_per_host < 1:
            raise RouterConfigError("--max-connections must be at least 1")
        if self.block_size is not None and not 1 <= self.block_size <= 1 << 20:
            raise RouterConfigError(f"--block-size {self.block_size}: use the engines' KV block size (e.g. 16)")
        if not 0 <= self.template_margin_tokens <= 1 << 16:
            raise RouterConfigError("--template-margin-tokens must be between 0 and 65536")
        if not 0 < self.shared_prefix_timeout <= 60:
            raise RouterConfigError("shared_prefix_timeout must be between 0 and 60 seconds")
        if self.max_reply_bytes < 1 << 16:
            raise RouterConfigError("max_reply_bytes must be at least 64 KiB")
        if self.policy not in POLICIES:
            raise RouterConfigError(f"--policy {self.policy!r}: use {' or '.join(POLICIES)}")
        if not 1.0 <= self.load_factor <= 100.0:
            raise RouterConfigError(f"--load-factor {self.load_factor:g}: use 1.0-100 (an instance holding more than "
                              "this times the mean load loses its affinity)")
        if not 0 <= self.branch_wait <= 3600:
            raise RouterConfigError("--branch-wait must be between 0 and 3600 seconds")
        if self.eject_after < 0:
            raise RouterConfigError("--eject-after must be 0 (never eject) or a number of failures in a row")
        if not 0 < self.eject_seconds <= self.max_eject_seconds:
            raise RouterConfigError("--eject-seconds must be positive and at most --max-eject-seconds")
        if self.health_check_interval < 0 or self.health_check_timeout <= 0:
            raise RouterConfigError("--health-check-interval must be >= 0 (0: off) and --health-check-timeout positive")
        if self.state != "memory" and not self.state.startswith(("redis://", "rediss://", "unix://", "redis+cluster://",
                                                                   "rediss+cluster://")):
            raise RouterConfigError(f"--state {self.state!r}: use 'memory', a redis://host:port/db URL or "
                              "redis+cluster://host:port[,host:port...] for Redis or Valkey Cluster")
        return self
