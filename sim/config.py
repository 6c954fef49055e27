"""Static configuration of one emulated engine (what ``kvdiag sim prefill|decode`` flags set)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvdiag.schema.errors import KVDiagError

ROLES: Final = ("prefill", "decode")
REASONING_PARSERS: Final = ("qwen3",)
TOOL_CALL_PARSERS: Final = ("hermes",)
REASONING_FIELDS: Final = ("reasoning", "reasoning_content")  # vLLM 0.33's name, then the older one
MODES: Final = ("stock", "instrumented")
LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "::1")


class EngineConfigError(KVDiagError, ValueError):
    """An engine option out of range; the message names the option and the fix."""


@dataclass
class EngineConfig:
    """Options of one engine. Defaults follow the article's deployment (bidirectional on, 64, 480 s)."""

    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = 0
    side_channel_port: int = 0
    model: str = "Qwen/Qwen3-32B"
    engine_id: str | None = None
    block_size: int = 16
    num_blocks: int = 16384
    bidirectional_kv_xfer: bool = True
    kv_recompute_threshold: int | None = None  # None: vLLM's default, 64 if bidirectional else 0
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    hang_on_recompute: bool = False
    stream_kv_params: bool = True
    fail_transfers: dict[str, float] = field(default_factory=dict)
    fail_requests: float = 0.0
    profile: str = "qwen3-32b"
    time_scale: float = 1.0
    mode: str = "stock"
    log_file: str | None = None
    log_level: str = "INFO"
    enable_log_requests: bool = False
    events_file: str | None = None
    seed: int = 0
    default_max_tokens: int = 16
    # vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN (5.0 s); only tests shrink it, to keep TTL tests fast.
    expiry_safety_margin_s: float = 5.0
    log_stats_interval_s: float = 10.0  # VLLM_LOG_STATS_INTERVAL
    # instrumented mode: D adds kvdiag_digest to its params; P reads only the prefix it proves (exact mode)
    prefix_digest: bool = True
    pull_matching_prefix: bool = True
    # the emulated model and vLLM's output parsers (docs/sim.md, "Agent traffic")
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_tokens: int | None = None  # None: the model never thinks unless a request hint asks
    tool_call_style: str = "compact"
    reasoning_field: str = "reasoning"
    max_model_len: int = 131_072
    # Side-channel peers the engine may connect to (kv_transfer_params come from clients: never trusted).
    allowed_remote_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EngineConfigError(f"role {self.role!r}: use prefill or decode")
        if self.mode not in MODES:
            raise EngineConfigError(f"--mode {self.mode!r}: use stock or instrumented")
        if self.block_size < 1 or self.num_blocks < 2:
            raise EngineConfigError("--block-size must be >= 1 and --num-blocks >= 2")
        if self.time_scale < 0:
            raise EngineConfigError("--time-scale must be >= 0 (0 disables the modelled sleeps)")
        if self.decoder_kv_blocks_ttl <= 0 or self.kv_lease_duration <= 0:
            raise EngineConfigError("--decoder-kv-blocks-ttl and --kv-lease-duration must be > 0 seconds")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise EngineConfigError(f"--reasoning-parser {self.reasoning_parser!r}: use {', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise EngineConfigError(f"--tool-call-parser {self.tool_call_parser!r}: use {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise EngineConfigError("--enable-auto-tool-choice requires --tool-call-parser (as in vLLM)")
        if self.reasoning_tokens is not None and not 0 <= self.reasoning_tokens <= 100_000:
            raise EngineConfigError("--reasoning-tokens must be between 0 and 100000")
        if self.tool_call_style not in ("compact", "template"):
            raise EngineConfigError(f"--tool-call-style {self.tool_call_style!r}: use compact or template")
        if self.reasoning_field not in REASONING_FIELDS:
            raise EngineConfigError(f"--reasoning-field {self.reasoning_field!r}: use {' or '.join(REASONING_FIELDS)}")
        if self.max_model_len < 1:
            raise EngineConfigError("--max-model-len must be a positive number of tokens")
        if self.kv_recompute_threshold is None:
            self.kv_recompute_threshold = 64 if self.bidirectional_kv_xfer else 0

    @property
    def instrumented(self) -> bool:
        """True in instrumented mode (events and the kvdiag report)."""
        return self.mode == "instrumented"

    @property
    def threshold(self) -> int:
        """The configured kv_recompute_threshold (resolved)."""
        return int(self.kv_recompute_threshold or 0)
