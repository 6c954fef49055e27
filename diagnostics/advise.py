"""`kvdiag advise`: TTL and threshold recommendations, and configuration checks, from the user's own traffic.

Every recommendation states the data it rests on; where the data is missing the section says
which data, and gives no number. docs/advise.md documents the JSON schema (``SCHEMA``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

import numpy as np
import pandas as pd

from kvdiag.diagnostics.advise_config import ConfigFact, DeploymentConfig
from kvdiag.diagnostics.humanize import human_bytes
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report import TurnData, as_frame, build_turn_table, open_turns
from kvdiag.diagnostics.report_sections import EXPIRY_SAFETY_MARGIN_S
from kvdiag.diagnostics.report_trims import EXPECTED_TRIMS, trim_summary
from kvdiag.schema.verdicts import TRIM_INFO, TrimReason, Verdict

SCHEMA: Final = "kvdiag.advise/v1"
GIB: Final = float(1 << 30)
COVERAGE: Final = (("p90", 0.90), ("p95", 0.95), ("p99", 0.99))
MIN_FIT_POINTS: Final = 5
MIN_GAPS: Final = 20  # fewer gaps than this make a percentile a guess, not advice
VLLM_DEFAULT_FAILURE_POLICY: Final = "fail"

Severity = Literal["ok", "info", "warning", "error", "missing_data"]


@dataclass
class Finding:
    """One configuration check: what was found, how bad, and the fix."""

    id: str
    severity: Severity
    message: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class TTLAdvice:
    """Gaps against D's block TTL, and what longer retention would cost in accelerator memory."""

    current_s: float | None
    current_source: str | None
    turns_considered: int
    gaps_known: int
    share_after_expiry: float | None
    share_declined: float | None
    recommended_s: dict[str, float | None]
    share_after_expiry_at: dict[str, float | None]
    retained_gib_seconds: dict[str, float | None]
    mean_retained_gib: dict[str, float | None]
    kv_bytes_per_token: float | None
    missing: list[str] = field(default_factory=list)
    summary: str = ""


@dataclass
class ThresholdAdvice:
    """Transfer and recompute cost models fitted to observed turns, and the break-even point."""

    transfer_overhead_ms: float | None
    bandwidth_gbps: float | None
    transfer_fit: dict[str, Any]
    prefill_ms_per_token: float | None
    prefill_fit: dict[str, Any]
    kv_bytes_per_token: float | None
    break_even_tokens: float | None
    recommended_tokens: int | None
    current_tokens: int | None
    missing: list[str] = field(default_factory=list)
    summary: str = ""


@dataclass
class Advice:
    """The full `kvdiag advise` result."""

    ttl: TTLAdvice
    threshold: ThresholdAdvice
    checks: list[Finding]

    def to_json_dict(self) -> dict[str, Any]:
        """The documented --json document (docs/advise.md)."""
        return {"schema": SCHEMA, "ttl": asdict(self.ttl), "threshold": asdict(self.threshold),
                "checks": [asdict(c) for c in self.checks]}

    def to_json(self) -> str:
        """JSON text of :meth:`to_json_dict`."""
        return json.dumps(self.to_json_dict(), indent=2)


# --------------------------------------------------------------------------------------------
# Fits

def _fit_poly(x: np.ndarray, y: np.ndarray, degree: int = 1) -> tuple[list[float], float]:
    """Least-squares y = c0 + c1·x (+ c2·x²), weighted 1/y so proportional jitter on large values does
    not drown the intercept; returns (coefficients, r²)."""
    sw = np.sqrt(1.0 / np.maximum(y, 1e-6))
    design = np.column_stack([x ** k for k in range(degree + 1)])
    coef, *_ = np.linalg.lstsq(design * sw[:, None], y * sw, rcond=None)
    pred = design @ coef
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return [float(c) for c in coef], (1.0 - ss_res / ss_tot) if ss_tot > 0 else 0.0


def _spread_ok(x: np.ndarray) -> bool:
    # A line through points that all sit at one x has no slope to find.
    return len(x) >= MIN_FIT_POINTS and float(np.std(x)) > 0.05 * max(float(np.mean(x)), 1e-9)


def kv_bytes_per_token(df: pd.DataFrame) -> float | None:
    """Median bytes moved per remote token over observed D→P reads (whole blocks: slightly above true)."""
    ok = df[(df["transfer_bytes"].fillna(0) > 0) & (df["remote_tokens"].fillna(0) > 0)]
    if ok.empty:
        return None
    return float((ok["transfer_bytes"].astype("float64") / ok["remote_tokens"].astype("float64")).median())


def _transfer_fit(df: pd.DataFrame) -> tuple[float | None, float | None, dict[str, Any], list[str]]:
    xf = df[(df["transfer_bytes"].fillna(0) > 0) & df["transfer_ms"].notna()]
    x = xf["transfer_bytes"].astype("float64").to_numpy()
    y = xf["transfer_ms"].astype("float64").to_numpy()
    info: dict[str, Any] = {"n": len(x), "basis": "D->P reads with bytes and duration (reported by P)"}
    if not _spread_ok(x):
        return None, None, info, [
            f"at least {MIN_FIT_POINTS} D->P reads of different sizes with transfer bytes and ms "
            f"(found {len(x)}{', too alike in size' if len(x) >= MIN_FIT_POINTS else ''}); these come from "
            "kvdiag events (router/prefill) or P's DEBUG logs"]
    (a, b), r2 = _fit_poly(x, y)
    info.update(r2=round(r2, 4), bytes_min=float(x.min()), bytes_max=float(x.max()))
    if b <= 0:
        return None, None, info, ["transfer time does not grow with bytes in the observed reads; "
                                  "need more varied sizes"]
    return max(a, 0.0), 1000.0 / b / 1e9, info, []


def _prefill_fit(df: pd.DataFrame) -> tuple[float | None, float, dict[str, Any], list[str]]:
    ok = df[(df["transfer_bytes"].fillna(0) == 0) & (df["computed_tokens"].fillna(0) > 0)
            & (df["status"].fillna("ok") == "ok")]
    basis = "prefill_ms"
    pts = ok[ok["prefill_ms"].notna()]
    if len(pts) < MIN_FIT_POINTS:
        # Stock logs without the proxy's "Prefill done" lines: TTFT still scales with computed tokens.
        basis, pts = "ttft_ms", ok[ok["ttft_ms"].notna()]
    x = pts["computed_tokens"].astype("float64").to_numpy()
    y = pts[basis].astype("float64").to_numpy()
    info: dict[str, Any] = {"n": len(x), "basis": f"{basis} of turns that read nothing from D, vs computed tokens"}
    if not _spread_ok(x):
        alike = ", too alike in length" if len(x) >= MIN_FIT_POINTS else ""
        return None, 0.0, info, [f"at least {MIN_FIT_POINTS} recomputed turns of different lengths with "
                                 f"computed tokens and prefill or TTFT times (found {len(x)}{alike})"]
    # Attention makes prefill grow faster than linearly; the quadratic keeps the small-n slope honest.
    (_, b, c), r2 = _fit_poly(x, y, 2)
    if c < 0:
        (_, b), r2 = _fit_poly(x, y)
        c = 0.0
    info.update(r2=round(r2, 4), quadratic_ms_per_token2=c)
    if b <= 0:
        return None, 0.0, info, ["prefill time does not grow with computed tokens in the observed turns"]
    return b, c, info, []


def advise_threshold(df: pd.DataFrame, cfg: DeploymentConfig, bytes_per_token: float | None) -> ThresholdAdvice:
    """Fit transfer = overhead + bytes / bandwidth and prefill ms/token; derive the break-even remote tokens."""
    overhead, gbps, tinfo, missing = _transfer_fit(df)
    per_token, quad, pinfo, pmissing = _prefill_fit(df)
    missing += pmissing
    if bytes_per_token is None:
        missing.append("KV bytes per token: observed D->P reads with remote token counts, or --kv-bytes-per-token")
    current = cfg.recompute_threshold.value if cfg.recompute_threshold else None
    adv = ThresholdAdvice(
        transfer_overhead_ms=_r(overhead, 4), bandwidth_gbps=_r(gbps, 4), transfer_fit=tinfo,
        prefill_ms_per_token=_r(per_token, 6), prefill_fit=pinfo, kv_bytes_per_token=_r(bytes_per_token, 1),
        break_even_tokens=None, recommended_tokens=None, current_tokens=int(current) if current is not None else None,
        missing=missing)
    if overhead is None or gbps is None or per_token is None or bytes_per_token is None:
        adv.summary = "No threshold recommendation: " + "; ".join(missing)
        return adv
    xfer_ms_per_token = bytes_per_token / (gbps * 1e6)
    saved = per_token - xfer_ms_per_token
    # Reading r tokens saves r·b + c·r² of recompute and costs overhead + r·bytes/bandwidth.
    if quad > 0:
        r = (-saved + math.sqrt(saved * saved + 4 * quad * overhead)) / (2 * quad)
    elif saved > 0:
        r = overhead / saved
    else:
        adv.summary = (f"Reading a token back ({xfer_ms_per_token:.4f} ms) costs more than recomputing it "
                       f"({per_token:.4f} ms): D->P reuse does not pay at any length on this hardware.")
        return adv
    adv.break_even_tokens = round(r, 1)
    adv.recommended_tokens = max(1, math.ceil(r))
    now = f" (currently {adv.current_tokens})" if adv.current_tokens is not None else ""
    adv.summary = (f"A D->P read costs {overhead:.2f} ms + {xfer_ms_per_token:.4f} ms/token "
                   f"({gbps:.2f} GB/s, {human_bytes(bytes_per_token)} a token); recompute costs {per_token:.4f} "
                   "ms/token. "
                   f"Break-even at {adv.break_even_tokens} remote tokens: set kv_recompute_threshold="
                   f"{adv.recommended_tokens}{now}.")
    return adv


# --------------------------------------------------------------------------------------------
# TTL

def _r(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)


def retained_byte_seconds(df: pd.DataFrame, ttl: float, bytes_per_token: float) -> tuple[float, float]:
    """Bytes × seconds D holds finished turns under ``ttl``, and the observed time span.

    After each turn D holds prompt + reply tokens until P reads them (the next turn, if it comes
    before the 5 s decline margin) or until the TTL runs out (last turn, late turn)."""
    d = df.sort_values(["conversation_id", "turn"])
    tokens = (d["prompt_tokens"].fillna(0) + d["completion_tokens"].fillna(0)).astype("float64").to_numpy()
    next_gap = d.groupby("conversation_id", sort=False)["gap_s"].shift(-1).astype("float64").to_numpy()
    hold = np.where(np.isnan(next_gap) | (next_gap >= ttl - EXPIRY_SAFETY_MARGIN_S), ttl,
                    np.minimum(np.nan_to_num(next_gap), ttl))
    total = float(np.sum(tokens * bytes_per_token * hold))
    start, end = d["start_ts"].min(), d["end_ts"].max()
    span = float(end - start) + ttl if pd.notna(start) and pd.notna(end) else float("nan")
    return total, span


def advise_ttl(df: pd.DataFrame, cfg: DeploymentConfig, bytes_per_token: float | None) -> TTLAdvice:
    """Share of later turns that came after D's blocks expired, TTLs covering 90/95/99% of gaps, and their cost."""
    later = df[df["turn"] > 1]
    gaps = later["gap_s"].dropna().astype("float64")
    ttl = float(cfg.decoder_ttl.value) if cfg.decoder_ttl is not None else None
    missing: list[str] = []
    if ttl is None:
        missing.append("the decode TTL: D's startup log line (\"...released after a TTL of N seconds\") "
                       "or --decoder-ttl")
    if gaps.empty:
        missing.append("inter-turn gaps: each turn's start and end time (client stats or kvdiag client/router events)")
    rec: dict[str, float | None] = {k: None for k, _ in COVERAGE}
    at: dict[str, float | None] = {k: None for k, _ in COVERAGE}
    if 0 < len(gaps) < MIN_GAPS:
        missing.append(f"at least {MIN_GAPS} inter-turn gaps for TTL percentiles (found {len(gaps)})")
    if len(gaps) >= MIN_GAPS:
        for key, q in COVERAGE:
            # P declines a read whose deadline is within 5 s, so covering a gap g needs TTL > g + 5.
            rec[key] = float(math.ceil(float(gaps.quantile(q)) + EXPIRY_SAFETY_MARGIN_S))
            at[key] = round(float((gaps >= rec[key]).mean()), 4)
    gib_s: dict[str, float | None] = {"current": None, **{k: None for k, _ in COVERAGE}}
    mean_gib: dict[str, float | None] = dict(gib_s)
    if bytes_per_token is None:
        missing.append("KV bytes per token (for the memory cost): observed D->P reads, or --kv-bytes-per-token")
    elif len(gaps) >= MIN_GAPS:
        for key, t in (("current", ttl), *((k, rec[k]) for k, _ in COVERAGE)):
            if t is None:
                continue
            total, span = retained_byte_seconds(df, t, bytes_per_token)
            gib_s[key] = round(total / GIB, 1)
            mean_gib[key] = round(total / GIB / span, 3) if span and not math.isnan(span) else None
    adv = TTLAdvice(
        current_s=ttl, current_source=cfg.decoder_ttl.source if cfg.decoder_ttl else None,
        turns_considered=len(later), gaps_known=len(gaps),
        share_after_expiry=round(float((gaps >= ttl).mean()), 4) if ttl is not None and len(gaps) else None,
        share_declined=(round(float((gaps >= ttl - EXPIRY_SAFETY_MARGIN_S).mean()), 4)
                        if ttl is not None and len(gaps) else None),
        recommended_s=rec, share_after_expiry_at=at, retained_gib_seconds=gib_s, mean_retained_gib=mean_gib,
        kv_bytes_per_token=_r(bytes_per_token, 1), missing=missing)
    adv.summary = _ttl_summary(adv)
    return adv


def _ttl_summary(a: TTLAdvice) -> str:
    if a.current_s is None or a.share_after_expiry is None:
        return "No TTL recommendation: need " + "; ".join(a.missing)
    parts = [f"{a.share_after_expiry:.1%} of {a.gaps_known:,} later turns arrived after D's blocks expired "
             f"(TTL {a.current_s:g} s{_cost(a, 'current')})."]
    if a.recommended_s["p90"] is None:
        return " ".join([*parts, "No TTL recommendation: need", "; ".join(a.missing)])
    for key, _ in COVERAGE:
        parts.append(f"{key}: TTL {a.recommended_s[key]:g} s → {a.share_after_expiry_at[key]:.1%} expired"
                     f"{_cost(a, key)}.")
    return " ".join(parts)


def _cost(a: TTLAdvice, key: str) -> str:
    if a.mean_retained_gib.get(key) is None:
        return ""
    return f"; holds {a.mean_retained_gib[key]:,.1f} GiB on average ({a.retained_gib_seconds[key]:,.0f} GiB·s)"


# --------------------------------------------------------------------------------------------
# Configuration checks

def _count(df: pd.DataFrame, verdict: Verdict) -> int:
    return int((df["verdict"] == verdict.value).sum())


def _fact(f: ConfigFact | None) -> dict[str, Any]:
    return {"value": f.value, "source": f.source} if f is not None else {}


def config_checks(df: pd.DataFrame, cfg: DeploymentConfig) -> list[Finding]:
    """The configuration findings, each from a log line or from the verdict counts."""
    out: list[Finding] = []
    later = df[df["turn"] > 1]
    ttl = float(cfg.decoder_ttl.value) if cfg.decoder_ttl else None
    rttl = float(cfg.router_ttl.value) if cfg.router_ttl else None
    if ttl is None:
        out.append(Finding("decoder_ttl", "missing_data", "Decode TTL unknown.",
                           "Include D's startup log (INFO) or pass --decoder-ttl."))
    elif ttl <= EXPIRY_SAFETY_MARGIN_S:
        out.append(Finding("decoder_ttl", "error", f"decoder_kv_blocks_ttl={ttl:g} s: P declines every read "
                           "whose deadline is within 5 s, so no turn can ever reuse D's KV.",
                           "Set decoder_kv_blocks_ttl well above 5 s (vLLM default 480).", _fact(cfg.decoder_ttl)))
    if rttl is None:
        out.append(Finding("router_ttl", "missing_data", "Router TTL unknown.",
                           "Include the router's events or proxy log, or pass --router-ttl."))
    elif ttl is not None:
        limit = ttl - EXPIRY_SAFETY_MARGIN_S
        if rttl > limit:
            out.append(Finding("router_ttl", "error",
                               f"Router TTL {rttl:g} s is not below decode TTL {ttl:g} s minus vLLM's 5 s decline "
                               f"margin: handles aged {limit:g}–{rttl:g} s are offered and declined as expired.",
                               f"Set the router TTL to at most {limit:g} s (the example proxy uses 450 against 480).",
                               {"router_ttl_s": rttl, "decoder_ttl_s": ttl}))
        else:
            out.append(Finding("router_ttl", "ok", f"Router TTL {rttl:g} s is below decode TTL {ttl:g} s − 5 s.",
                               data={"router_ttl_s": rttl, "decoder_ttl_s": ttl}))
    out += _feature_checks(df, later, cfg)
    out += _policy_checks(df, cfg)
    out += reuse_checks(df)
    return out


def _feature_checks(df: pd.DataFrame, later: pd.DataFrame, cfg: DeploymentConfig) -> list[Finding]:
    out: list[Finding] = []
    off_p = _count(df, Verdict.FEATURE_DISABLED_ON_PREFILL)
    hits = _count(later, Verdict.REMOTE_HIT)
    reasons = later.loc[later["verdict"] == Verdict.METADATA_NOT_RETURNED.value, "metadata_reason"].astype(str)
    off_d, not_streamed = int((reasons == "bidirectional_off_on_decode").sum()), int((reasons == "not_streamed").sum())
    for side, n, fact in (("prefill", off_p, cfg.bidirectional_prefill), ("decode", off_d, cfg.bidirectional_decode)):
        if n:
            out.append(Finding(f"bidirectional_{side}", "error",
                               f"bidirectional_kv_xfer is off on {side}: {n} turns could not reuse KV.",
                               f"Set bidirectional_kv_xfer: true in the {side} engine's kv_connector_extra_config.",
                               {"turns": n}))
        elif fact is not None and fact.value:
            out.append(Finding(f"bidirectional_{side}", "ok", f"bidirectional_kv_xfer is on on {side}.",
                               data=_fact(fact)))
        elif hits:
            # A D->P read needs D to retain and return params and P to read them: both sides are on.
            out.append(Finding(f"bidirectional_{side}", "ok",
                               f"bidirectional_kv_xfer is on on {side} ({hits:,} turns read KV back from D).",
                               data={"remote_hit_turns": hits}))
        else:
            out.append(Finding(f"bidirectional_{side}", "missing_data",
                               f"No evidence whether bidirectional_kv_xfer is on on {side}.",
                               f"Include the {side} engine's startup log (INFO)."))
    if not_streamed:
        out.append(Finding("streaming_params", "error",
                           f"{not_streamed:,} turns followed a streamed decode response without kv_transfer_params.",
                           "Apply vLLM PR #40186 on D (streamed final chunk carries kv_transfer_params).",
                           {"turns": not_streamed}))
    elif hits:
        out.append(Finding("streaming_params", "ok", "Decode responses carried kv_transfer_params."))
    else:
        unknown = _count(later, Verdict.UNKNOWN)
        # (stock logs at INFO show no successful D->P read: those turns are unknown, not misses)
        seen = (f"No later turn was shown to reuse KV ({unknown:,} later turns are unknown)" if unknown
                else "No later turn reused KV")
        fix = ("Decide the unknown turns: run P with VLLM_LOGGING_LEVEL=DEBUG or load kvdiag's connector on P "
               "(explain names what each turn lacks)." if unknown else "Run explain on a later turn to see why it "
               "missed.")
        out.append(Finding("streaming_params", "missing_data", f"{seen}, so params delivery is unproven.", fix,
                           {"unknown_turns": unknown}))
    no_id = _count(df, Verdict.NO_CONVERSATION_ID)
    if no_id:
        out.append(Finding("conversation_ids", "warning",
                           f"{no_id:,} turns ({no_id / max(len(df), 1):.1%}) carried no conversation_id.",
                           "Send a top-level conversation_id (benchmark: --send-conversation-id).", {"turns": no_id}))
    else:
        out.append(Finding("conversation_ids", "ok", "Every turn carried a conversation_id."))
    return out


def reuse_checks(df: pd.DataFrame) -> list[Finding]:
    """Partial reuse (router events): wrongly loaded KV, and the fix for a trim reason that dominates."""
    with open_turns(df) as tt:
        t = trim_summary(tt)
    out: list[Finding] = []
    if t.wrong_kv_tokens:
        out.append(Finding("wrong_kv", "error",
                           f"P loaded {t.wrong_kv_tokens:,} tokens of KV computed for other tokens: those answers may "
                           "be wrong, with no error.",
                           "Route through kvdiag router (it injects only the tokens the prompt reproduces) and keep "
                           "P's exact mode on.", {"wrong_kv_tokens": t.wrong_kv_tokens}))
    if not t.handle_turns:
        return out
    data: dict[str, Any] = {"handle_turns": t.handle_turns, "handle_tokens": t.handle_tokens,
                            "trimmed_turns": t.trimmed_turns, "trimmed_tokens": t.trimmed_tokens,
                            "trimmed_share": t.trimmed_share, "dominant": t.dominant}
    if t.dominant is None:
        share = f"{t.trimmed_share:.1%}" if t.trimmed_share is not None else "none"
        out.append(Finding("partial_reuse", "ok" if not t.trimmed_tokens else "info",
                           f"{t.trimmed_turns:,} of {t.handle_turns:,} handles trimmed ({share} of D's tokens), "
                           "no single reason dominating.", data=data))
        return out
    reason = TrimReason(t.dominant)
    row = t.by_reason.loc[t.dominant]
    out.append(Finding("partial_reuse", "info" if reason in EXPECTED_TRIMS else "warning",
                       f"{t.trimmed_turns:,} of {t.handle_turns:,} handles trimmed ({t.trimmed_share or 0:.1%} of D's "
                       f"tokens); {reason.value} accounts for {float(row['share_of_trimmed']):.0%} of the trimmed "
                       f"tokens ({int(row['turns']):,} turns): {TRIM_INFO[reason].summary}",
                       TRIM_INFO[reason].fix, data))
    return out


def _policy_checks(df: pd.DataFrame, cfg: DeploymentConfig) -> list[Finding]:
    bad_reads = df[df["verdict"].isin([Verdict.EXPIRED_REMOTE_READ.value, Verdict.TRANSFER_FAILED.value])]
    failed = int(bad_reads["status"].isin(["error"]).sum())
    hung = int(df["status"].isin(["hung"]).sum())
    policy = cfg.failure_policy.value if cfg.failure_policy else None
    data = {"expired_or_failed_reads": len(bad_reads), "failed_turns": failed, "hung_turns": hung, **_fact(
        cfg.failure_policy)}
    if policy == "recompute" or hung or cfg.recompute_hang is not None:
        return [Finding("kv_load_failure_policy", "error",
                        f"kv_load_failure_policy=recompute: vLLM 0.33 can hang the request in WAITING_FOR_REMOTE_KVS "
                        f"after a declined or failed D->P read ({hung:,} hung turns seen).",
                        "Use kv_load_failure_policy=fail and keep reads from expiring (router TTL < decode TTL − 5 s), "
                        "or upgrade to a vLLM release that fixes the hang.", data)]
    if policy == "fail" or (policy is None and failed):
        return [Finding("kv_load_failure_policy", "warning" if len(bad_reads) else "ok",
                        f"kv_load_failure_policy=fail (vLLM's default): every expired or failed D->P read fails the "
                        f"turn ({len(bad_reads):,} such reads in these logs).",
                        "Prevent expired reads (router TTL below decode TTL − 5 s) and fix transfer failures.", data)]
    return [Finding("kv_load_failure_policy", "missing_data",
                    f"kv_load_failure_policy not seen in the logs (vLLM's default is {VLLM_DEFAULT_FAILURE_POLICY}: "
                    "an expired or failed read fails the turn; recompute can hang on vLLM 0.33).",
                    "Include P's log around a failed read, or check --kv-transfer-config.", data)]


def advise(conversations: Sequence[ConversationRecord] | TurnData, decoder_ttl: float | None = None, *,
           config: DeploymentConfig | None = None, router_ttl: float | None = None,
           bytes_per_token: float | None = None) -> Advice:
    """Advise from turns (records or the report's turn table); explicit TTL options override the logs."""
    df = build_turn_table(conversations) if isinstance(conversations, Sequence) else as_frame(conversations)
    cfg = config or DeploymentConfig()
    conflicts: list[Finding] = []
    # The logs are what the engines really ran with; an option only fills a gap (and a clash is reported).
    options = (("decoder_ttl", decoder_ttl, "--decoder-ttl"), ("router_ttl", router_ttl, "--router-ttl"))
    for name, value, flag in options:
        if value is None:
            continue
        fact: ConfigFact | None = getattr(cfg, name)
        if fact is None:
            setattr(cfg, name, ConfigFact(float(value), flag))
        elif float(fact.value) != float(value):
            conflicts.append(Finding(f"{name}_option", "info", f"{flag} {value:g} ignored: the logs say "
                                     f"{float(fact.value):g} s ({fact.source}).", data=_fact(fact)))
    bpt = bytes_per_token if bytes_per_token is not None else kv_bytes_per_token(df)
    return Advice(ttl=advise_ttl(df, cfg, bpt), threshold=advise_threshold(df, cfg, bpt),
                  checks=config_checks(df, cfg) + conflicts)
