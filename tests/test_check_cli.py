"""The ``kvdiag check`` command: JSON and text output, exit codes, widths, usage errors.

The cluster runs in a background event loop (the CLI runs its own), on real sockets.
"""

from __future__ import annotations

import json
import re

import pytest
from check_support import cluster_in_thread
from click.testing import CliRunner

from kvdiag.check.findings import CHECKS, Finding, Status
from kvdiag.check.render import render_finding, render_text
from kvdiag.cli.main import cli

pytestmark = pytest.mark.timeout(120)


def _args(urls: dict[str, str]) -> list[str]:
    return ["check", "--router", urls["router"], "--prefill", urls["prefill"], "--decode", urls["decode"]]


def test_healthy_json_exit_0_and_text_fits_80_100_120_columns() -> None:
    with cluster_in_thread() as urls:
        result = CliRunner().invoke(cli, [*_args(urls), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output)
        assert doc["ok"] is True and doc["exit_code"] == 0 and doc["version"] == 1
        assert [c["id"] for c in doc["checks"]] == list(CHECKS)
        assert {c["status"] for c in doc["checks"]} <= {"pass", "info"}
        for width in (80, 100, 120):
            text = CliRunner().invoke(cli, _args(urls), env={"COLUMNS": str(width)})
            assert text.exit_code == 0, text.output
            lines = text.output.splitlines()
            assert max(len(line) for line in lines) <= width, [ln for ln in lines if len(ln) > width]
            assert lines[-1].endswith("-> exit 0")
            assert sum(line.startswith("pass  ") for line in lines) >= 15


def test_misconfigured_exit_1_names_the_check_and_the_fix() -> None:
    with cluster_in_thread(d={"stream_kv_params": False}) as urls:
        result = CliRunner().invoke(cli, _args(urls), env={"COLUMNS": "80"})
        as_json = CliRunner().invoke(cli, [*_args(urls), "--json"])
    assert result.exit_code == 1
    assert re.search(r"^FAIL  D streams kv_transfer_params .*\[stream_kv_params\]", result.output, re.MULTILINE)
    assert "fix: run D on a vLLM with PR #40186" in result.output
    assert "seen: " in result.output  # evidence is shown for failures
    doc = json.loads(as_json.output)
    assert as_json.exit_code == 1 and doc["ok"] is False
    assert [c["id"] for c in doc["checks"] if c["status"] == "fail"] == ["stream_kv_params"]


def test_unreachable_exits_3_and_usage_errors_exit_2() -> None:
    dead = CliRunner().invoke(cli, ["check", "--router", "http://127.0.0.1:9", "--json"])
    assert dead.exit_code == 3
    doc = json.loads(dead.output)
    assert [c["id"] for c in doc["checks"] if c["status"] == "fail"] == ["router_reachable"]
    only_p = CliRunner().invoke(cli, ["check", "--prefill", "http://127.0.0.1:9"])
    assert only_p.exit_code == 2 and "give both --prefill and --decode" in only_p.output
    nothing = CliRunner().invoke(cli, ["check"])
    assert nothing.exit_code == 2 and "nothing to check" in nothing.output


def test_help_documents_the_exit_codes() -> None:
    out = CliRunner().invoke(cli, ["check", "--help"]).output
    for code, meaning in (("0", "nothing failed"), ("1", "a check failed"), ("2", "bad usage"),
                          ("3", "a component did not answer")):
        assert re.search(rf"^\s+{code}\s+{meaning}", out, re.MULTILINE), out


def test_render_never_exceeds_the_width_even_with_long_words() -> None:
    long_word = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}' * 2
    finding = Finding("d2p_read", CHECKS["d2p_read"], Status.FAIL, "detail " + long_word, "fix " + long_word,
                      [long_word])
    for width in (40, 80, 100):
        assert all(len(line) <= width for line in render_finding(finding, width))
    from kvdiag.check.findings import CheckReport

    report = CheckReport({"router": "http://r:8000", "prefill": None, "decode": None}, [finding])
    text = render_text(report, width=80)
    assert "FAIL  A D->P read happened and succeeded [d2p_read]" in text and text.endswith("-> exit 1\n")
