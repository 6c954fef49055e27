"""``explain --all`` lists every conversation from the engine's verdicts alone (no record, reason or evidence is
built): the same conversations, turns, verdicts and order as the full records give, on every log fixture, on the
benchmark generator's logs and on kvdiag events; and the same text from the CLI either way."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner
from gen_logs_support import load_gen_logs

from kvdiag.cli.main import cli
from kvdiag.diagnostics.records import ConversationSummary
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations
from kvdiag.diagnostics.turn_loader import load_turns, summarize_conversations
from kvdiag.schema.verdicts import Verdict

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
RUNS = sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name != "__pycache__")


def _files(run: Path) -> list[str]:
    return sorted(str(p) for p in run.iterdir() if p.is_file())


def _from_records(files: list[str]) -> list[ConversationSummary]:
    return [c.summary() for c in load_turns(files)]


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_summaries_equal_the_records_on_every_fixture(run: Path) -> None:
    files = _files(run)
    want = _from_records(files)
    assert want
    assert summarize_conversations(files) == want


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("gen")
    load_gen_logs().generate(out, 400_000, seed=11, noise_per_turn=1)
    return _files(out)


def test_summaries_equal_the_records_on_generated_logs(generated: list[str]) -> None:
    want = _from_records(generated)
    got = summarize_conversations(generated)
    assert len(got) > 20 and got == want
    # the order is the severity order, not the ids' (else the comparison above would not test it)
    assert [s.conversation_id for s in got] != sorted(s.conversation_id for s in got)


def test_summaries_equal_the_records_on_events(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=300, seed=5))
    with (tmp_path / "client.jsonl").open("w") as fh:
        fh.writelines(line + "\n" for line in client_events(convs))
    with (tmp_path / "router.jsonl").open("w") as fh:
        fh.writelines(line + "\n" for line in router_events(convs))
    files = _files(tmp_path)
    want = _from_records(files)
    assert len(want) == 300 and summarize_conversations(files) == want


def test_the_comparison_sees_one_changed_verdict(generated: list[str]) -> None:
    # control: one turn's verdict changed in one conversation is a difference
    got = summarize_conversations(generated)
    first = got[0]
    other = Verdict.UNKNOWN if first.verdicts[-1] is not Verdict.UNKNOWN else Verdict.LOCAL_HIT
    changed = [dataclasses.replace(first, verdicts=(*first.verdicts[:-1], other)), *got[1:]]
    assert changed != _from_records(generated)


@pytest.mark.parametrize("view", [[], ["--wide"]], ids=["compact", "wide"])
def test_the_cli_prints_the_same_list_either_way(generated: list[str], tmp_path: Path, view: list[str]) -> None:
    # --html needs every record (the timeline draws them), so it lists from the records: the same text
    args = ["explain", *generated, "--all", "--no-progress", "--width", "120", *view]
    lean = CliRunner().invoke(cli, args)
    full = CliRunner().invoke(cli, [*args, "--html", str(tmp_path / "t.html")])
    assert lean.exit_code == 0 and full.exit_code == 0, (lean.output, full.output)
    assert "conversations, worst first" in lean.stdout
    assert lean.stdout == full.stdout
