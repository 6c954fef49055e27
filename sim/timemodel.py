"""The sim's time model: how long prefill, KV transfers and decode steps take, per model profile.

The sim sleeps ``time_scale`` times these durations, so the shape of real latency survives while
tests run in milliseconds. Two profiles are calibrated to the article's measurements (1P1D, one
8xH200 node per role, EFA): ``qwen3-32b`` and ``glm5-fp8``; :func:`calibrate` recomputes the
article's table from the model (no sleeping, no clock) and reports the error per row.

Model:

* prefill of ``n`` computed tokens after ``ctx`` already-present tokens:
  ``step_overhead + n * per_token + n * (ctx + n / 2) * attention`` (ms);
* a NIXL read of ``t`` tokens: ``xfer_overhead + t * kv_bytes_per_token / bandwidth`` (ms);
* one decode step: ``decode_step`` (ms).

The modelled TTFT of a later turn (P prefix caching off, as in the article's benchmark) is P's leg
(step overhead, the D->P read of the history when transfer is on, prefill of what is left) plus D's
first token (D pulls the turn's new tokens from P, recomputes the last prompt token, one decode
step). Both cases share D's part; only P's leg differs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError


class UnknownProfile(KVDiagError, KeyError):
    """No profile of that name."""


@dataclass(frozen=True)
class Profile:
    """Time-model parameters of one model deployment (durations in ms)."""

    name: str
    description: str
    kv_bytes_per_token: int
    kv_shape: str
    per_token_ms: float
    attention_ms: float
    step_overhead_ms: float
    xfer_overhead_ms: float
    bandwidth_gbps: float  # GB/s (1e9 bytes per second) of one D->P or P->D read
    decode_step_ms: float
    new_token_share: float  # calibration assumption: the share of a later turn's prompt that is new

    def prefill_ms(self, computed: int, context: int = 0) -> float:
        """Milliseconds to compute ``computed`` tokens after ``context`` tokens already in KV."""
        if computed <= 0:
            return 0.0
        return (self.step_overhead_ms + computed * self.per_token_ms
                + computed * (context + computed / 2.0) * self.attention_ms)

    def transfer_bytes(self, tokens: int) -> int:
        """Bytes of KV for ``tokens`` tokens."""
        return max(0, tokens) * self.kv_bytes_per_token

    def transfer_ms(self, tokens: int) -> float:
        """Milliseconds of one NIXL read of ``tokens`` tokens (fixed overhead + bytes / bandwidth)."""
        if tokens <= 0:
            return 0.0
        return self.xfer_overhead_ms + self.transfer_bytes(tokens) / (self.bandwidth_gbps * 1e6)

    def turn_ttft_ms(self, prompt_tokens: int, transfer_on: bool) -> dict[str, float]:
        """Modelled TTFT parts of a later turn with P prefix caching off (the article's setup)."""
        new = max(1, round(prompt_tokens * self.new_token_share))
        history = prompt_tokens - new
        d2p = self.transfer_ms(history) if transfer_on else 0.0
        p_computed = new if transfer_on else prompt_tokens
        p_prefill = self.prefill_ms(p_computed, prompt_tokens - p_computed)
        d_part = self.transfer_ms(new - 1) + self.prefill_ms(1, prompt_tokens - 1) + self.decode_step_ms
        return {"ttft_ms": d2p + p_prefill + d_part, "d2p_transfer_ms": d2p, "p_prefill_ms": p_prefill,
                "d_first_token_ms": d_part, "new_tokens": float(new), "history_tokens": float(history)}


# KV bytes per token from the model shapes (bf16 KV cache, vLLM's default "auto" dtype):
#  Qwen3-32B: 64 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes = 262,144 B.
#  GLM-5 (MLA, DeepSeek-V3.2 style): 78 layers x (512 latent + 64 rope) x 2 bytes = 89,856 B.
PROFILES: Final[dict[str, Profile]] = {
    p.name: p for p in (
        Profile("qwen3-32b", "Qwen3-32B, 1P1D, 8xH200 per node (TP8), EFA",
                kv_bytes_per_token=262_144, kv_shape="64 layers x 8 kv heads x 128 dim x K,V x bf16",
                per_token_ms=0.0225, attention_ms=3.0e-7, step_overhead_ms=30.0,
                xfer_overhead_ms=15.0, bandwidth_gbps=57.5, decode_step_ms=20.0, new_token_share=0.28),
        Profile("glm5-fp8", "zai-org/GLM-5-FP8, 1P1D, 8xH200 per node, EFA",
                kv_bytes_per_token=89_856, kv_shape="78 layers x (512 latent + 64 rope) x bf16 (MLA)",
                per_token_ms=0.095, attention_ms=3.0e-7, step_overhead_ms=130.0,
                xfer_overhead_ms=15.0, bandwidth_gbps=20.0, decode_step_ms=30.0, new_token_share=0.14),
    )
}

DEFAULT_PROFILE: Final = "qwen3-32b"


def get_profile(name: str) -> Profile:
    """The profile ``name``; raise UnknownProfile naming the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfile(f"unknown profile {name!r}; choose one of {', '.join(sorted(PROFILES))}") from None


@dataclass(frozen=True)
class ArticleRow:
    """One row of the article's table (1P1D, prefix caching off on P, on on D)."""

    profile: str
    label: str
    prompt_tokens: int
    ttft_off_ms: float
    ttft_on_ms: float


ARTICLE_TABLE: Final = (
    ArticleRow("qwen3-32b", "Qwen3-32B, 2k tokens", 2_048, 158.0, 122.0),
    ArticleRow("qwen3-32b", "Qwen3-32B, 24k tokens", 24_576, 778.0, 460.0),
    ArticleRow("glm5-fp8", "zai-org/GLM-5-FP8, 2k tokens", 2_048, 500.0, 358.0),
    ArticleRow("glm5-fp8", "zai-org/GLM-5-FP8, 20k tokens", 20_480, 2_334.0, 702.0),
)
# The article: "D->P transfer took roughly 30-130 ms (Qwen3-32B) and 29-110 ms (GLM-5-FP8)".
ARTICLE_TRANSFER_RANGE_MS: Final = {"qwen3-32b": (30.0, 130.0), "glm5-fp8": (29.0, 110.0)}
TOLERANCE: Final = 0.15


def calibrate(profile_name: str) -> dict[str, Any]:
    """Each article row for ``profile_name`` with the modelled figures and relative errors."""
    profile = get_profile(profile_name)
    rows = []
    for row in ARTICLE_TABLE:
        if row.profile != profile.name:
            continue
        off = profile.turn_ttft_ms(row.prompt_tokens, transfer_on=False)
        on = profile.turn_ttft_ms(row.prompt_tokens, transfer_on=True)
        err_off = (off["ttft_ms"] - row.ttft_off_ms) / row.ttft_off_ms
        err_on = (on["ttft_ms"] - row.ttft_on_ms) / row.ttft_on_ms
        rows.append({
            "row": row.label, "prompt_tokens": row.prompt_tokens,
            "new_tokens": int(on["new_tokens"]), "history_tokens": int(on["history_tokens"]),
            "article_ttft_off_ms": row.ttft_off_ms, "sim_ttft_off_ms": round(off["ttft_ms"], 1),
            "error_off": round(err_off, 4),
            "article_ttft_on_ms": row.ttft_on_ms, "sim_ttft_on_ms": round(on["ttft_ms"], 1),
            "error_on": round(err_on, 4),
            "sim_d2p_transfer_ms": round(on["d2p_transfer_ms"], 1),
            "sim_transfer_bytes": profile.transfer_bytes(int(on["history_tokens"])),
            "within_tolerance": abs(err_off) <= TOLERANCE and abs(err_on) <= TOLERANCE,
        })
    return {"profile": asdict(profile), "tolerance": TOLERANCE,
            "article_transfer_range_ms": ARTICLE_TRANSFER_RANGE_MS[profile.name],
            "rows": rows, "ok": all(r["within_tolerance"] for r in rows)}
