"""P's stats windows read the proxy's records from the engine's own classification (``pl``): the same records,
fields and order as the proxy parser gives for the same lines (but for an optional group that matched nothing,
which the engine reads as absent and the parser as ''; the windows read no optional group)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.engine_proxy import _optional_groups
from kvdiag.diagnostics.engine_windows import proxy_records
from kvdiag.diagnostics.proxy_log_parser import CLASSIFIERS, ProxyRecord, parse_proxy_numbered
from kvdiag.diagnostics.windows import OFFER_KINDS

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__"
              and any(f.name.startswith("proxy") for f in p.iterdir()))

ODD = [
    "2026-11-29 07:00:00 [INFO] disagg_proxy: Ready: 2 prefill, 1 decode instances",
    "2026-11-29 07:00:01,250 [INFO] disagg_proxy: [r1] conv=c1: sending D's cached blocks to P "
    "(remote_request_id=chatcmpl-r0-0f0f0f0f)",
    "2026-11-29T07:00:02 [WARNING] disagg_proxy: [r1] Prefill request failed: boom (with: colons)\r",
    "2026-11-29 07:00:03 [INFO] disagg_proxy: conv=c:1:x: cached D blocks (remote_request_id=chatcmpl-r1-1, blocks=7)",
    "2026-11-29 07:00:04 [INFO] disagg_proxy: [r2] conv=c2: cache MISS (history changed)",
    "2026-11-29 07:00:04 [INFO] disagg_proxy: [r3] conv=c3: cache MISS ()",
    "2026-11-29 07:00:05 [INFO] disagg_proxy: conv=c2: stale cache entry (age=5.0s > ttl=4.0s), discarding",
    "2026-11-29 07:00:06 [INFO] disagg_proxy: [r2] Prefill done in 12ms " + "x" * 700,
    "2026-11-29 07:00:07 [INFO] disagg_proxy: an unclassified line",
    "not a proxy line at all",
    "",
    "2026-11-29 07:00:08 [INFO] disagg_proxy: [ré] Decode request failed: caf\u00e9 \u00a0 \u3000 ok",
]


def _both(tmp_path: Path, folder: Path | None) -> tuple[list[ProxyRecord], list[ProxyRecord]]:
    if folder is None:
        folder = tmp_path / "odd"
        folder.mkdir()
        (folder / "proxy.log").write_text("\n".join(ODD) + "\n")
    files = detect([str(folder)])
    with engine.opened(files) as run:
        engine.load_files(run)
        engine.parse(run)
        got = proxy_records(run)
    want = []
    for lf in files:
        if lf.fmt == "proxy":
            lines = list(enumerate(Path(lf.path).read_bytes().split(b"\n"), start=1))
            want.extend(parse_proxy_numbered(lines, lf.path))
    for rec in want:
        rec.fields = {k: v for k, v in rec.fields.items() if not (v == "" and k in _OPTIONAL[rec.kind])}
    return got, want


_OPTIONAL = {kind: set() for kind, _r in CLASSIFIERS}
for _kind, _regex in CLASSIFIERS:
    _OPTIONAL[_kind] |= _optional_groups(_regex)


@pytest.mark.parametrize("folder", [None, *RUNS], ids=lambda p: "odd-lines" if p is None else p.name)
def test_the_engine_gives_the_parser_s_proxy_records(tmp_path: Path, folder: Path | None) -> None:
    got, want = _both(tmp_path, folder)
    assert want  # every case has proxy records
    assert got == want


def test_the_kinds_the_ledger_reads_alone(tmp_path: Path) -> None:
    """For every conversation the windows take only the kinds the ledger reads: the parser's records of them."""
    folder = next(p for p in RUNS if p.name == "real_vllm_info")
    files = detect([str(folder)])
    with engine.opened(files) as run:
        engine.load_files(run)
        engine.parse(run)
        got = proxy_records(run, OFFER_KINDS)
    _all, want = _both(tmp_path, folder)
    assert got == [r for r in want if r.kind in OFFER_KINDS] and len(got) < len(want)


def test_a_field_lost_on_the_way_is_caught(tmp_path: Path) -> None:
    """Negative control: the comparison sees one group value missing from one record."""
    got, want = _both(tmp_path, None)
    assert got == want
    broken = [ProxyRecord(path=r.path, lineno=r.lineno, ts=r.ts, level=r.level, kind=r.kind, text=r.text,
                          fields={k: v for k, v in r.fields.items() if k != "remote"}) for r in got]
    assert broken != want


def test_the_d_lines_the_windows_read_are_one_kind() -> None:
    """Of D's lines the windows read only vLLM's 'Potentially invalid KV blocks for unrecognized request' (P read
    blocks D had released): the string D's lines are filtered by opens that kind's pattern."""
    import re

    from kvdiag.diagnostics.engine_windows import D_LINES_READ
    from kvdiag.diagnostics.vllm_log_parser import classify_message

    kind, fields = classify_message(f"{D_LINES_READ} chatcmpl-r1-0f0f0f0f were retrieved")
    assert kind == "invalid_unrecognized" and fields["request_id"] == "chatcmpl-r1-0f0f0f0f"
    assert classify_message(f"{D_LINES_READ[:-1]}X chatcmpl-r1-0f0f0f0f")[0] != "invalid_unrecognized"
    source = Path(__file__).resolve().parents[1] / "diagnostics" / "windows.py"
    # (the ledger reads, of a file that is not P's, that kind alone)
    assert re.findall(r'if rec\.path not in p_paths:\n\s+if rec\.kind == "(\w+)"', source.read_text()) == [
        "invalid_unrecognized"]
