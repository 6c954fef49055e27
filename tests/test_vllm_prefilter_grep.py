"""The vLLM prefilter's Perl form (grep -P, when nothing else is searched for) keeps exactly the lines its
POSIX form keeps: on every fixture vLLM log and on lines with colours, invalid UTF-8, NUL, CR, odd spacing and
an over-long line."""

from __future__ import annotations

from pathlib import Path

from kvdiag.diagnostics import verdict_engine as ve
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


def _kept(tmp_path: Path, lines: list[bytes], pcre: str | None) -> bytes:
    log = tmp_path / "in.log"
    log.write_bytes(b"\n".join(lines))
    out = tmp_path / "out.txt"
    grep_ere_to_file(str(log), ve.VLLM_PREFILTER, str(out), pcre=pcre)
    return out.read_bytes()


def test_perl_and_posix_prefilters_keep_the_same_lines(tmp_path: Path) -> None:
    assert has_pcre()
    lines = [line for p in sorted(FIXTURES.rglob("*.log")) if "proxy" not in p.name
             for line in p.read_bytes().split(b"\n")] + _ODD
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
