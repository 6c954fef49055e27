"""Every path gives the same verdicts: explain of one conversation, explain --all, report and advise read one
engine, on every log fixture (real vLLM 0.33 runs included) and on a run of the emulated P/D testbed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest
from gen_logs_support import load_gen_logs

import kvdiag
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report import build_turn_table, normalize_table

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")
KEY = ["conversation_id", "turn"]
COMPARED = ["conversation_id", "turn", "verdict", "confidence", "reason", "prompt_tokens", "remote_tokens",
            "ttft_ms"]


def _files(run: Path) -> list[str]:
    return sorted(str(p) for p in run.iterdir() if p.is_file())


def _rows(df: pd.DataFrame) -> list[tuple[object, ...]]:
    out = df.loc[:, COMPARED].sort_values(KEY).astype(object)
    return [tuple(None if pd.isna(v) else v for v in row) for row in out.itertuples(index=False)]


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_explain_all_report_and_explain_one_agree(run: Path) -> None:
    files = _files(run)
    table = kvdiag.load_turn_table(files)                       # report, advise
    records = kvdiag.load_turns(files)                          # explain --all
    assert len(table) > 0 and len(table) == sum(len(c.turns) for c in records)
    assert _rows(table) == _rows(build_turn_table(records))
    # every column, in the same order (both come out sorted by conversation, turn and place)
    pd.testing.assert_frame_equal(normalize_table(table), build_turn_table(records), check_exact=True)
    _one_by_one_equals(files, records)
    advice = kvdiag.advise(table)
    assert advice.checks, "advise reads the same table"


def _one_by_one_equals(files: list[str], records: list[ConversationRecord]) -> None:
    """explain --conversation-id (prefiltered lines) gives each conversation's records as explain --all does:
    every field of every turn, numbers and evidence included."""
    for conv in records:
        one = kvdiag.explain_conversation(files, conv.conversation_id)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns], conv.conversation_id


def test_one_conversation_reads_the_lines_only_its_request_ids_name(tmp_path: Path) -> None:
    # benchmarks/gen_logs.py's shape: router events state no prefill time, the proxy's "[rid] Prefill done in
    # N ms" line (no conversation on it) does; one conversation's lines must include it
    load_gen_logs().generate(tmp_path, 200_000, seed=3, noise_per_turn=1)
    files = _files(tmp_path)
    records = kvdiag.load_turns(files)
    assert any(t.prefill_ms is not None for c in records for t in c.turns)
    _one_by_one_equals(files, records)
    pd.testing.assert_frame_equal(normalize_table(kvdiag.load_turn_table(files)), build_turn_table(records),
                                  check_exact=True)


def test_the_comparison_sees_a_changed_verdict() -> None:
    # Control: a single verdict changed in one table is a difference the comparison reports.
    run = FIXTURES / "real_vllm_info"
    table = kvdiag.load_turn_table(_files(run))
    changed = table.copy()
    changed.loc[changed.index[-1], "verdict"] = "unknown" if changed["verdict"].iloc[-1] != "unknown" else "local_hit"
    assert _rows(changed) != _rows(table)


# Ids as logs carry them: escaped by JSON writers (quotes and backslashes always; non-ASCII as Python's \u00df or
# C#'s \u00DF; "<>&+" and "/" as Go and C# write them), or with too few plain characters to search for.
_ODD_IDS = ('conv "ß\\{i}" ☃ {i}', "会話{i}", "a/b<{i}>&c", "user+{i}@x.org", "tab\t{i}")


def _write_like_another_writer(obj: dict[str, object], rng: random.Random) -> str:
    mode = rng.randrange(3)
    text = json.dumps(obj, ensure_ascii=mode == 0)
    if mode == 2:  # "<>&+" and non-ASCII as \uXXXX (upper case), "/" as "\/"
        text = "".join(f"\\u{ord(ch):04X}" if ord(ch) > 127 or ch in "<>&+" else "\\/" if ch == "/" else ch
                       for ch in text)
    return text


def _damaged(src: Path, out: Path, rng: random.Random) -> None:
    """``src``'s logs as a deployment may leave them: a few lines lost, a file missing, client and router events
    without request ids, and some conversations renamed in the JSON logs only (so one request has two ids)."""
    odd = {f"CONV_ID_{i}": rng.choice(_ODD_IDS).format(i=i) for i in rng.sample(range(1, 20), 5)}
    missing = rng.choice([None, *sorted(p.name for p in src.iterdir())])
    for path in sorted(src.iterdir()):
        if path.name == missing:
            continue
        lines = []
        for line in path.read_bytes().splitlines(keepends=True):
            if rng.random() < 0.04:
                continue
            if path.suffix == ".jsonl":
                obj = json.loads(line)
                if rng.random() < 0.3:
                    obj.pop("request_id", None)
                obj["conversation_id"] = odd.get(obj.get("conversation_id"), obj.get("conversation_id"))
                line = (_write_like_another_writer(obj, rng) + "\n").encode()
            lines.append(line)
        (out / path.name).write_bytes(b"".join(lines))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_conversation_agrees_with_all_on_damaged_logs(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    load_gen_logs().generate(tmp_path / "src", 150_000, seed=seed, noise_per_turn=1)
    (tmp_path / "logs").mkdir()
    _damaged(tmp_path / "src", tmp_path / "logs", rng)
    files = _files(tmp_path / "logs")
    records = kvdiag.load_turns(files)
    assert any(not c.conversation_id.isascii() for c in records), "an escaped id is among them"
    _one_by_one_equals(files, records)


def test_a_conversation_whose_events_carry_no_request_id_is_found(tmp_path: Path) -> None:
    # a client that sets no request id still logs its turns: explain finds them as explain --all does
    with (tmp_path / "client-events.jsonl").open("w") as fh:
        for turn in (1, 2):
            fh.write(json.dumps({"v": 1, "source": "client", "event": "client_turn", "conversation_id": "conv-a",
                                 "turn": turn, "ts": 1_764_400_000.0 + turn, "prompt_tokens": 100 * turn}) + "\n")
    files = _files(tmp_path)
    records = kvdiag.load_turns(files)
    assert [len(c.turns) for c in records] == [2]
    _one_by_one_equals(files, records)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_conversation_agrees_with_all_when_real_vllm_lines_are_lost(tmp_path: Path, seed: int) -> None:
    # a real INFO run with P's stats windows deciding turns, a tenth of every log's lines lost
    rng = random.Random(seed)
    for path in (FIXTURES / "real_vllm_info").iterdir():
        lines = path.read_bytes().splitlines(keepends=True)
        (tmp_path / path.name).write_bytes(b"".join(ln for ln in lines if rng.random() >= 0.1))
    files = _files(tmp_path)
    records = kvdiag.load_turns(files)
    assert len(records) >= 5
    _one_by_one_equals(files, records)
