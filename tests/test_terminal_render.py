"""explain and report read well at 80, 100 and 120 columns: no line overflows, no verdict or number is split.

Rendered with rich at a fixed width (kvdiag.diagnostics.terminal.render_text, what the CLI prints).
The split check is shown to catch the old full-width table (--wide), which folds cells mid-word.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.diagnostics.humanize import human_bytes, human_count, human_ms, human_s, human_share
from kvdiag.diagnostics.records import ConversationRecord, Evidence, TurnRecord
from kvdiag.diagnostics.report import build_report, build_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations, write_router_events
from kvdiag.diagnostics.terminal import clip, explain_all_renderables, explain_renderables, render_text, verdict_label
from kvdiag.diagnostics.terminal_report import report_renderables
from kvdiag.schema.verdicts import TRIM_INFO, Confidence, TrimReason, Verdict

WIDTHS = (80, 100, 120)
_NUMBER_RE = re.compile(r"\d[\d,.]*\d|\d")


def _conversation() -> ConversationRecord:
    conv = ConversationRecord(conversation_id="agent-7f3e9c2a-coding")
    long_reason = ("declined expired remote read; the request failed; read declined: D's blocks expire within the "
                   "safety margin (5 s); retried without the handle (failure_type=expired_declined); gap 512.5 s vs "
                   "decoder_kv_blocks_ttl 480 s, 256,901 bytes pending")
    rows = [
        (1, Verdict.FIRST_TURN, Confidence.CONFIRMED, {}),
        (2, Verdict.REMOTE_HIT, Confidence.CONFIRMED,
         {"remote_tokens": 131_056, "transfer_bytes": 17_179_869_184, "transfer_ms": 1234.5, "handle_tokens": 131_185,
          "reuse_limit_tokens": 131_056, "trimmed_tokens": 129, "trim_reason": "history_reasoning",
          "wrong_kv_tokens": 0}),
        (3, Verdict.FEATURE_DISABLED_ON_PREFILL, Confidence.INFERRED, {}),
        (4, Verdict.EXPIRED_REMOTE_READ, Confidence.CONFIRMED, {"local_hit_tokens": 48, "gap_s": 512.5}),
        (5, Verdict.METADATA_NOT_RETURNED, Confidence.INFERRED, {}),
        (6, Verdict.REMOTE_HIT, Confidence.CONFIRMED,
         {"remote_tokens": 2048, "transfer_bytes": 25_690_112, "transfer_ms": 15.2, "wrong_kv_tokens": 37,
          "mismatch_tokens": 64}),
    ]
    for turn, verdict, confidence, extra in rows:
        conv.turns.append(TurnRecord(
            conversation_id=conv.conversation_id, turn=turn, request_id=f"req-{turn:03d}",
            start_ts=1_796_121_215.0 + turn * 3600, ttft_ms=12.3 * turn ** 3, prompt_tokens=131_072 + turn,
            verdict=verdict, confidence=confidence, reason=long_reason if turn == 4 else "reported by P",
            fix=("gap 512 s vs decoder_kv_blocks_ttl 480 s (P declines within 5 s of expiry): raise the TTL or expect "
                 "recompute"),
            evidence=[Evidence("/var/log/pods/llm_vllm-prefill-0_7c1d/vllm/0.log:1234567",
                               '{"v":1,"ts":1796121215.449,"source":"router","event":"router_turn","turn":2,'
                               '"outcome":"remote_hit","remote_read_tokens":131056}')],
            **extra))  # type: ignore[arg-type]
    return conv


def _lines(text: str) -> list[str]:
    return text.splitlines()


def _assert_fits(text: str, width: int) -> None:
    too_long = [line for line in _lines(text) if len(line) > width]
    assert not too_long, too_long[:3]


def _row(text: str, turn: int) -> str:
    rows = [line for line in _lines(text) if re.match(rf"\s*{turn}\s", line)]
    assert rows, f"no table row for turn {turn}"
    return rows[0]


def _split_tokens(text: str, tokens: list[str]) -> list[str]:
    """Tokens (verdicts, numbers) that no single rendered line holds whole."""
    lines = _lines(text)
    return [tok for tok in tokens if not any(tok in line for line in lines)]


def _numbers(text: str) -> list[str]:
    return _NUMBER_RE.findall(text)


@pytest.mark.parametrize("width", WIDTHS)
def test_explain_table_keeps_every_verdict_and_number_whole(width: int) -> None:
    conv = _conversation()
    text = render_text(explain_renderables(conv, width=width), width)
    _assert_fits(text, width)
    for t in conv.turns:
        row = _row(text, t.turn)
        # the compact table's cells, each on the turn's own row, never folded onto a second line
        for cell in (verdict_label(t), human_ms(t.ttft_ms), human_count(t.prompt_tokens)):
            assert cell in row, (cell, row)
        assert ("*" in row) == (t.confidence is Confidence.INFERRED)
    # below the table: the reason and fix paragraphs wrap at spaces, numbers stay whole
    prose = " ".join(t.reason + " " + t.fix for t in conv.turns)
    assert not _split_tokens(text, _numbers(prose))
    assert not _split_tokens(text, [t.verdict.value for t in conv.turns])
    # partial reuse with its reason and TRIM_INFO's fix, humanized sizes and durations
    info = TRIM_INFO[TrimReason.HISTORY_REASONING]
    flat = " ".join(text.split())
    assert info.fix in flat and "trimmed 129 (history_reasoning)" in flat
    assert "(16.0 GiB in 1.2 s)" in flat and "(24.5 MiB in 15 ms)" in flat
    assert "P loaded 37 tokens of KV computed for other tokens" in flat
    assert "refused 64 offered tokens" in flat
    # evidence: the source whole, its text cut at a boundary onto one line
    assert "/var/log/pods/llm_vllm-prefill-0_7c1d/vllm/0.log:1234567" in flat
    assert "router/router_turn turn=2 outcome=remote_hit" in flat


def test_the_split_check_catches_the_full_table() -> None:
    # the negative control: the full-width table folds reason and fix into narrow columns at 80 columns
    conv = _conversation()
    text = render_text(explain_renderables(conv, width=80, wide=True), 80)
    prose = " ".join(t.reason + " " + t.fix for t in conv.turns)
    split = _split_tokens(text, _numbers(prose) + [t.verdict.value for t in conv.turns])
    assert split, "the check should have found a folded verdict or number"


@pytest.mark.parametrize("width", WIDTHS)
def test_explain_all_keeps_verdicts_whole(width: int) -> None:
    convs = [_conversation(), *synthetic_conversations(SynthParams(conversations=5, seed=3))]
    text = render_text(explain_all_renderables([c.summary() for c in convs]), width)
    _assert_fits(text, width)
    assert not _split_tokens(text, sorted({t.verdict.value for c in convs for t in c.turns}))


def test_explain_all_says_what_unknown_turns_are() -> None:
    convs = synthetic_conversations(SynthParams(conversations=5, seed=3))
    convs[0].turns[-1].verdict = convs[1].turns[-1].verdict = Verdict.UNKNOWN
    n = sum(t.verdict is Verdict.UNKNOWN for c in convs for t in c.turns)
    text = " ".join(render_text(explain_all_renderables([c.summary() for c in convs]), 100).split())
    assert f"{n} turns are unknown: the logs do not decide them" in text
    for c in convs:  # the control: none unknown, nothing said
        for t in c.turns:
            if t.verdict is Verdict.UNKNOWN:
                t.verdict = Verdict.TRANSFER_FAILED
    assert "are unknown" not in render_text(explain_all_renderables([c.summary() for c in convs]), 100)


@pytest.mark.parametrize("width", WIDTHS)
def test_report_sections_fit_and_keep_numbers_whole(width: int) -> None:
    convs = synthetic_conversations(SynthParams(conversations=120, seed=11, trim_share=0.4,
                                                missing_metadata_share=0.1))
    rep = build_report(build_turn_table(convs), 480.0)
    text = render_text(report_renderables(rep), width)
    _assert_fits(text, width)
    verdicts = [str(c) for c in rep.by_turn.columns if c not in ("turns", "reused_share")]
    assert not _split_tokens(text, verdicts)
    for name in verdicts:  # every verdict row holds its five counts
        row = next(line for line in _lines(text) if line.startswith(name + " "))
        assert [human_count(v) for v in rep.by_turn[name]] == row.split()[1:]
    ttft = rep.ttft.loc["2-8k"]
    row = next(line for line in _lines(text) if line.startswith("2-8k ") and "x" in line)
    assert human_ms(ttft["reused_p50_ms"]) in row and human_ms(ttft["recomputed_p95_ms"]) in row
    xfer = rep.transfer.loc["8-16k"]
    row = next(line for line in _lines(text) if line.startswith("8-16k ") and "iB" in line)
    assert human_bytes(xfer["bytes_p50"]) in row and human_bytes(xfer["bytes_total"]) in row
    t = rep.trims
    assert t.trimmed_turns and t.dominant is None  # three reasons, none over half
    for reason, r in t.by_reason.iterrows():
        row = next(line for line in _lines(text) if line.startswith(f"{reason} "))
        assert row.split()[1:] == [human_count(r["turns"]), human_count(r["trimmed_tokens"]),
                                   human_share(r["share_of_trimmed"])]
    flat = " ".join(text.split())
    assert f"p95 {human_s(rep.gaps.quantiles_s['p95'])}" in flat
    assert f"{human_count(t.trimmed_tokens)} tokens ({human_share(t.trimmed_share, 1)}) trimmed" in flat
    assert not _split_tokens(text, _numbers(" ".join(str(r["fix"]) for _, r in t.by_reason.iterrows())))


def test_advise_renders_at_the_width_given_and_keeps_its_checks_whole(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=8, seed=5, trim_share=0.5))
    write_router_events(convs, tmp_path / "router-events.jsonl")
    doc = CliRunner().invoke(cli, ["advise", str(tmp_path), "--no-cache", "--json"])
    checks = sorted(c["id"] for c in json.loads(doc.output)["checks"])
    assert len(checks) >= 4
    for width in WIDTHS:
        result = CliRunner().invoke(cli, ["advise", str(tmp_path), "--no-cache", "--width", str(width)])
        assert result.exit_code == 0, result.output
        _assert_fits(result.output, width)
        rows = [ln.split() for ln in _lines(result.output)]
        # each check's row opens with its severity and id, whole: a finding wraps inside its own column
        ids = [r[1] for r in rows if len(r) > 1 and r[0] in ("ok", "info", "warning", "error", "missing_data")]
        assert sorted(ids) == checks


def test_report_headline_gives_the_unknown_share_beside_the_reused() -> None:
    # stock logs at INFO leave hits unknown: "0% reused" alone would read as "no reuse"
    convs = synthetic_conversations(SynthParams(conversations=60, seed=5))
    for conv in convs[::3]:
        for t in conv.turns[1:]:
            t.verdict = Verdict.UNKNOWN
    later = [t for c in convs for t in c.turns[1:]]
    unknown = sum(t.verdict is Verdict.UNKNOWN for t in later) / len(later)
    head = _lines(render_text(report_renderables(build_report(build_turn_table(convs), 480.0)), 120))[0]
    assert unknown > 0 and f"of {human_count(len(later))} ({human_share(round(unknown, 4), 1)} unknown)" in head
    for conv in convs:  # the control: nothing unknown, nothing said
        for t in conv.turns[1:]:
            if t.verdict is Verdict.UNKNOWN:
                t.verdict = Verdict.TRANSFER_FAILED
    head = _lines(render_text(report_renderables(build_report(build_turn_table(convs), 480.0)), 120))[0]
    assert "later turns reused" in head and "unknown" not in head


def test_humanized_units() -> None:
    assert human_bytes(25_690_112) == "24.5 MiB" and human_bytes(512) == "512 B" and human_bytes(None) == "-"
    assert human_bytes(17_179_869_184) == "16.0 GiB" and human_bytes(205_520_896) == "196 MiB"
    assert human_ms(15.2) == "15 ms" and human_ms(0.4) == "0.4 ms" and human_ms(1234.5) == "1.2 s"
    assert human_s(0.004) == "4 ms" and human_s(38) == "38 s" and human_s(150) == "2.5 min"
    assert human_s(float("nan")) == "-" and human_count(131_072) == "131,072"
    assert human_share(0.8912) == "89%" and human_share(0.8912, 1) == "89.1%"


def test_clip_never_cuts_inside_a_number() -> None:
    text = "a" * 40 + " 256,901 bytes 1,234,567 more"
    for width in range(42, len(text)):
        out = clip(text, width)
        assert len(out) <= width
        assert out == text or out.endswith("…")
        assert all(n in text.split() for n in _numbers(out.rstrip("…")))


@pytest.mark.parametrize("command", ["explain", "report"])
def test_the_cli_renders_at_the_width_given(tmp_path: Path, command: str) -> None:
    convs = synthetic_conversations(SynthParams(conversations=8, seed=5, trim_share=0.5))
    write_router_events(convs, tmp_path / "router-events.jsonl")
    target = ["--conversation-id", convs[0].conversation_id] if command == "explain" else ["--no-cache"]
    for width in WIDTHS:
        result = CliRunner().invoke(cli, [command, str(tmp_path), *target, "--width", str(width)])
        assert result.exit_code == 0, result.output
        _assert_fits(result.output, width)
        assert ("verdict" in result.output) and ("turn" in result.output)
    wide = CliRunner().invoke(cli, [command, str(tmp_path), *target, "--wide", "--width", "200"])
    assert wide.exit_code == 0 and ("reason" in wide.output or "reused_share" in wide.output)
