"""Several proxy logs: replicas of the router (a cluster sharing its store), each logging the requests it served.

A conversation's requests are spread over the replicas' logs. Its turns are numbered, and its previous turn found,
in the order of the lines' times (each log's own order kept), not log after log.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import pytest
from gen_logs_support import load_gen_logs

import kvdiag

_EVENT_FILES = ("client.jsonl", "router-events.jsonl", "prefill-events.jsonl")
_RID = re.compile(r": \[([0-9a-f]+)\] (?:conv=(.*?): )?")
_STORED = re.compile(r"cached D blocks \(remote_request_id=(?:chat)?cmpl-([0-9a-f]+)-")
_HEAD = re.compile(r": conv=(.*?): (?:cache HIT|cache MISS|stale cache entry)")


def _one_second_apart(proxy_log: Path) -> None:
    """Each line stamped a second after the one before it (the generated log packs a run into seconds): the times
    then tell the order of any two lines."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    t0 = 1_764_400_000
    proxy_log.write_text("".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 + i)) + line[19:]
                                 for i, line in enumerate(lines)), encoding="utf-8")


def _milliseconds_apart(proxy_log: Path) -> None:
    """Each line stamped a millisecond after the one before it, as ``%(asctime)s`` writes a stamp (",123"): many
    lines share a second, and only the fractions tell their order."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    t0 = 1_764_400_000_000
    proxy_log.write_text("".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime((t0 + i) // 1000))
                                 + f",{(t0 + i) % 1000:03d}" + line[19:] for i, line in enumerate(lines)),
                         encoding="utf-8")


def _iso_stamps(log: Path) -> None:
    """The stamps written ISO-style ("T" between the date and the time, "." before the fraction), as another
    replica's logging configuration may write them."""
    text = log.read_text(encoding="utf-8")
    iso = re.sub(r"^(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d),?",
                 lambda m: m[1] + "T" + m[2] + "." * m[0].endswith(","), text, flags=re.M)
    log.write_text(iso, encoding="utf-8")


def _split_by_request(proxy_log: Path, out: list[Path], rng: random.Random) -> None:
    """Each request's lines (its lookup line, its own lines, its stored handle) into one replica's log, drawn at
    random; the startup line into every log."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    owner: dict[int, str] = {}
    waiting: dict[str, list[int]] = {}  # a conversation's lookup lines, before its request's first own line
    for i, line in enumerate(lines):
        if m := _RID.search(line):
            owner[i] = m.group(1)
            for j in waiting.pop(m.group(2) or "", []):
                owner[j] = m.group(1)
        elif m := _STORED.search(line):
            owner[i] = m.group(1)
        elif m := _HEAD.search(line):
            waiting.setdefault(m.group(1), []).append(i)
    replica: dict[str, int] = {}
    texts: list[list[str]] = [[] for _ in out]
    for i, line in enumerate(lines):
        if i in owner:
            texts[replica.setdefault(owner[i], rng.randrange(len(out)))].append(line)
        else:
            for t in texts if "Ready: " in line else texts[:1]:
                t.append(line)
    proxy_log.unlink()
    for path, t in zip(out, texts, strict=True):
        path.write_text("".join(t), encoding="utf-8")


def _verdicts(folder: Path) -> dict[tuple[str, int], tuple[str, str | None, float | None]]:
    return {(c.conversation_id, t.turn): (t.verdict.value, t.request_id, t.entry_age_s)
            for c in kvdiag.load_turns([str(folder)]) for t in c.turns}


@pytest.mark.parametrize(("seed", "iso"), [(2, False), (4, True)])
def test_turns_spread_over_replicas_logs_are_the_turns_of_one_log(tmp_path: Path, seed: int, iso: bool) -> None:
    one, split = tmp_path / "one", tmp_path / "split"
    load_gen_logs().generate(one, 300_000, seed=seed, noise_per_turn=1)
    for name in _EVENT_FILES:  # (stock: the proxy's lines alone order a conversation's requests)
        (one / name).unlink()
    _one_second_apart(one / "proxy.log")
    shutil.copytree(one, split)
    _split_by_request(split / "proxy.log", [split / "proxy-a.log", split / "proxy-b.log"], random.Random(seed))
    if iso:  # (a replica writing its stamps another way)
        _iso_stamps(split / "proxy-b.log")
    want = _verdicts(one)
    assert len(want) > 40
    assert _verdicts(split) == want
    table = kvdiag.load_turn_table([str(split)])
    assert sorted(zip(table["conversation_id"], table["turn"], table["verdict"], strict=True)) == sorted(
        (c, t, v[0]) for (c, t), v in want.items())
    for conv in kvdiag.load_turns([str(split)])[:4]:
        alone = kvdiag.explain_conversation([str(split)], conv.conversation_id)
        assert [t.__dict__ for t in alone.turns] == [t.__dict__ for t in conv.turns]


def test_lines_of_one_second_keep_each_logs_order(tmp_path: Path) -> None:
    # the generated run packs its requests into a few seconds: within a second, each log's own order holds, and
    # a single log reads as it did
    load_gen_logs().generate(tmp_path, 300_000, seed=3, noise_per_turn=1)
    for name in _EVENT_FILES:
        (tmp_path / name).unlink()
    before = _verdicts(tmp_path)
    renamed = tmp_path / "replica-0.log"
    (tmp_path / "proxy.log").rename(renamed)
    assert _verdicts(tmp_path) == before


def test_fractions_of_a_second_order_the_replicas_lines(tmp_path: Path) -> None:
    # the stamps' fractions order the lines of one second across the logs, whichever way each log writes them
    one, split = tmp_path / "one", tmp_path / "split"
    load_gen_logs().generate(one, 300_000, seed=5, noise_per_turn=1)
    for name in _EVENT_FILES:
        (one / name).unlink()
    _milliseconds_apart(one / "proxy.log")
    shutil.copytree(one, split)
    logs = [split / "proxy-a.log", split / "proxy-b.log"]
    _split_by_request(split / "proxy.log", logs, random.Random(5))
    _iso_stamps(logs[1])
    want = _verdicts(one)
    assert len(want) > 40
    assert _verdicts(split) == want
    for conv in kvdiag.load_turns([str(split)])[:4]:
        alone = kvdiag.explain_conversation([str(split)], conv.conversation_id)
        assert [t.__dict__ for t in alone.turns] == [t.__dict__ for t in conv.turns]
