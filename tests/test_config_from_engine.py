"""The configuration scan reads the vLLM logs' marker lines from the verdict engine's own grep.

``kvdiag report`` and ``advise`` need both the turn table and the DeploymentConfig; the engine's vLLM grep
also keeps the configuration lines, so scan_config does not read those logs a second time. These tests pin
that the shortcut changes nothing: the same DeploymentConfig as a scan of its own, the same lines in the
engine (a marker line the prefilter would not keep does not reach the rules), on every way a grep output
is read (DuckDB; Python for carriage returns, invalid UTF-8, over-long lines).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdiag.diagnostics import advise_config
from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.advise_config import MARKERS, scan_config
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.linestats import MAX_LINE_CHARS
from kvdiag.diagnostics.report import load_turn_table
from kvdiag.diagnostics.turn_loader import run_all

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
HEAD = "(EngineCore_DP0 pid=7) {level} 11-29 10:05:{s:02d} [{where}] "
# Marker lines the engine's prefilter does not keep: a request id without chatcmpl-/cmpl- (the hang), a
# DEBUG message about a KV load failure (a DEBUG line on P would tell the rules P logs at DEBUG).
NOT_PREFILTERED = (
    HEAD.format(level="WARNING", s=1, where="scheduler.py:900") + "req-77aa is still in WAITING_FOR_REMOTE_KVS state.",
    HEAD.format(level="DEBUG", s=2, where="nixl.py:12") + "retry after KV load failure: failure_policy=recompute",
)
# Marker lines it keeps, repeated (each repeat a line whose effect an earlier line already had).
PREFILTERED = (
    HEAD.format(level="INFO", s=3, where="scheduler.py:3770")
    + "Recovered from KV load failure: 1 request(s) rescheduled (12 tokens affected).",
    HEAD.format(level="INFO", s=4, where="scheduler.py:3770")
    + "Recovered from KV load failure: 2 request(s) rescheduled (40 tokens affected).",
)
HOLD = (HEAD.format(level="DEBUG", s=5, where="nixl_connector.py:800")
        + "NIXLConnector request_finished(chatcmpl-x-1) waiting for 300 seconds before releasing blocks")
# The proxy's stale entries: the first says no age (it sets nothing), the second the router TTL, the third
# repeats the kind (ignored).
PROXY_HEAD = "2026-11-29 10:06:{s:02d} [INFO] disagg_proxy: "
STALE = (PROXY_HEAD.format(s=1) + "conv=agent-a: stale cache entry (age=?s > ttl=120.0s)",
         PROXY_HEAD.format(s=2) + "conv=agent-a: stale cache entry (age=500.1s > ttl=450.0s)",
         PROXY_HEAD.format(s=3) + "conv=agent-b: stale cache entry (age=301.0s > ttl=300.0s)")


def _folder(tmp_path: Path, edit: Callable[[str], str] = lambda s: s,
            proxy_edit: Callable[[str], str] = lambda s: s) -> Path:
    out = tmp_path / "logs"
    shutil.copytree(FIXTURES / "real_vllm_info", out)
    for name, extra, change in (("prefill.log", (*NOT_PREFILTERED, *PREFILTERED), edit),
                                ("decode.log", (HOLD, HOLD), edit), ("proxy.log", STALE, proxy_edit)):
        path = out / name
        path.write_bytes(change(path.read_text(encoding="utf-8") + "".join(line + "\n" for line in extra))
                         .encode("utf-8", errors="surrogateescape"))
    return out


def _engine_lines(paths: list[str], side: bool) -> tuple[list[tuple[object, ...]], dict[int, list[tuple[int, str]]]]:
    """The vLLM lines the rules read, and every side line by file (those left in a lines table read back)."""
    run = engine.new_run(detect(paths))
    if side:
        run.side_needles = MARKERS
    try:
        engine.load_files(run)
        side_lines = {f: list(engine.marker_lines(run, f)) for f in run.side_markers}
        return run.con.execute("SELECT f, n, line FROM lines_vllm ORDER BY f, n").fetchall(), side_lines
    finally:
        run.con.close()


def _with_cr(text: str) -> str:  # a CR in a kept line: DuckDB would split there, Python reads the grep output
    return text.replace("(12 tokens affected).", "(12 tokens affected).\r", 1)


def _with_bad_utf8(text: str) -> str:
    return text.replace("Recovered from KV load failure: 2", "Recovered from KV load failure: \udcff2", 1)


def _with_long_line(text: str) -> str:
    return text + HEAD.format(level="INFO", s=9, where="x.py:1") + "Received request " + "y" * MAX_LINE_CHARS + "\n"


@pytest.mark.parametrize("edit", [lambda s: s, _with_cr, _with_bad_utf8, _with_long_line],
                         ids=["duckdb", "carriage-return", "invalid-utf8", "over-long"])
def test_engine_lines_equal_a_scan_of_its_own(tmp_path: Path, edit: Callable[[str], str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    folder = [str(_folder(tmp_path, edit))]
    alone = scan_config(folder)
    # every fact the extra lines give is found, from the line a scan of its own names
    assert alone.recompute_hang is not None and alone.recompute_hang.value is True
    assert alone.failure_policy is not None and alone.decoder_ttl is not None
    assert alone.router_ttl is not None and alone.router_ttl.value == 450.0

    plain, no_side = _engine_lines(folder, side=False)
    kept, side = _engine_lines(folder, side=True)
    assert not no_side
    assert kept == plain  # the rules see the same lines: the marker lines only grep's -e kept are gone
    texts = [t for lines in side.values() for _, t in lines]
    assert all(any(line in t for t in texts) for line in NOT_PREFILTERED)  # (so the deletion above mattered)

    table = load_turn_table(folder, config_lines=True)
    reads: list[str] = []
    real = advise_config._lines

    def counted(path: Path, needles: tuple[str, ...]) -> Iterator[tuple[int, str]]:
        reads.append(str(path))
        return real(path, needles)

    monkeypatch.setattr(advise_config, "_lines", counted)
    after = scan_config(folder)
    assert after == alone
    engine_read = ("prefill.log", "decode.log", "proxy.log")
    assert not [p for p in reads if p.endswith(engine_read)]  # taken from the engine's grep and lines
    # once: the next scan reads the files again (the remembered lines are not held)
    assert scan_config(folder) == alone
    assert {Path(p).name for p in reads if p.endswith(engine_read)} == set(engine_read)
    assert table.equals(load_turn_table(folder))
    # a table loaded without config_lines keeps none: the scan reads every log itself
    reads.clear()
    assert scan_config(folder) == alone
    assert {Path(p).name for p in reads if p.endswith(engine_read)} == set(engine_read)


@pytest.mark.parametrize("byte", ["\x01", "\x00", "\\x01"])
def test_a_proxy_log_with_odd_bytes_gives_the_same_facts(tmp_path: Path, byte: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # \x01 is the column delimiter of DuckDB's line reader and NUL no text (the four characters "\\x01" were once
    # the delimiter); the router TTL sits after them, so a line cut there would lose it
    folder = [str(_folder(tmp_path, proxy_edit=lambda s: s.replace("stale cache entry (age=500.1s",
                                                                   f"{byte}stale cache entry (age=500.1s")))]
    alone = scan_config(folder)
    assert alone.router_ttl is not None and alone.router_ttl.value == 450.0
    load_turn_table(folder, config_lines=True)
    reads: list[str] = []
    real = advise_config._lines
    monkeypatch.setattr(advise_config, "_lines", lambda path, needles: reads.append(str(path)) or real(path, needles))
    assert scan_config(folder) == alone
    assert not [p for p in reads if p.endswith("proxy.log")]  # (taken from the engine's lines)


def test_marker_lines_read_in_pages_give_every_line_in_order() -> None:
    run = engine.new_run([])
    try:
        run.side_needles = MARKERS
        run.con.execute("INSERT INTO lines_proxy SELECT 0, n, CASE WHEN n % 3 = 0 THEN 'x ' || n || "
                        "' stale cache entry' WHEN n % 3 = 1 THEN 'no marker' END FROM range(1, 5000) t(n)")
        engine._keep_side_lines(run, 0, "lines_proxy")
        assert run.side_markers[0] == (MARKERS[3],)
        every = run.con.execute("SELECT n, line FROM lines_proxy WHERE contains(line, 'stale cache entry') "
                                "ORDER BY n").fetchall()
        assert len(every) > 1000  # several pages
        assert list(engine.marker_lines(run, 0)) == every
    finally:
        run.con.close()


def test_a_changed_file_is_scanned_again(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    files = detect([str(folder)])
    run_all(files, config_lines=True).con.close()  # remembers the marker lines of prefill.log and decode.log
    log = folder / "prefill.log"
    log.write_text(log.read_text(encoding="utf-8").replace("failure_policy=fail", "failure_policy=gone"),
                   encoding="utf-8")
    cfg = scan_config([str(folder)])
    assert cfg.failure_policy is not None and cfg.failure_policy.value == "gone"


def test_repeated_effects_keep_the_first_line() -> None:
    lines = [(1, "x stale cache entry (age=9.0s > ttl=450.0s)"), (2, "y stale cache entry (age=3.0s > ttl=450.0s)"),
             (3, "z stale cache entry (age=3.0s > ttl=300.0s)"), (4, "no marker here")]
    assert advise_config.line_effects(lines, "router") == [(1, ("stale", 450.0))]


def test_dropping_repeats_gives_what_every_line_gives() -> None:
    pool = [
        "Bidirectional KV transfer is enabled and the kv recompute threshold is set to 64 tokens.",
        "Bidirectional KV transfer is enabled and the kv recompute threshold is set to 32 tokens.KV blocks on D are "
        "released after a TTL of 300 seconds.",
        "Bidirectional KV transfer is enabled (no threshold said)",
        "NIXLConnector request_finished(r1) waiting for 480 seconds before releasing blocks",
        "NIXLConnector request_finished(r2) waiting for 90 seconds before releasing blocks",
        "Failing 1 request(s) due to KV load failure (failure_policy=fail, 12 tokens affected).",
        "Recovered from KV load failure: 1 request(s) rescheduled (3 tokens affected).",
        "r9 is still in WAITING_FOR_REMOTE_KVS state.",
        "conv=c1: stale cache entry (age=500.0s > ttl=450.0s), discarding",
        "conv=c2: stale cache entry (age=99.0s > ttl=60.0s), discarding",
        "stale cache entry after KV load failure (failure_policy=recompute, 1 tokens affected)",
        "Bidirectional KV transfer is enabled; stale cache entry (age=1.0s > ttl=5.0s) WAITING_FOR_REMOTE_KVS",
        "no marker at all",
    ]
    roles: list[advise_config.Role] = ["prefill", "decode", "router", "unknown"]
    rng = random.Random(13)
    for _ in range(400):
        files = [(f"f{i}", rng.choice(roles), [(n, rng.choice(pool)) for n in range(1, rng.randint(1, 12))])
                 for i in range(rng.randint(1, 4))]
        every, reduced = advise_config.DeploymentConfig(), advise_config.DeploymentConfig()
        for name, role, lines in files:
            for n, line in lines:
                e = advise_config._effect(line, role)
                if e is not None:
                    advise_config._apply(every, e, role, f"{name}:{n}")
            for n, e in advise_config.line_effects(lines, role):
                advise_config._apply(reduced, e, role, f"{name}:{n}")
        assert reduced == every
        # told which markers the file holds, it stops once each one's kind is seen: the same effects
        for _name, role, lines in files:
            held = [m for m in MARKERS if any(m in line for _, line in lines)]
            stopped = advise_config.line_effects(iter(lines), role, held)
            assert stopped == advise_config.line_effects(lines, role)
            if held and any(advise_config.line_effects(lines, role)):
                # (negative control: told of none, it reads nothing)
                assert advise_config.line_effects(lines, role, []) == []
