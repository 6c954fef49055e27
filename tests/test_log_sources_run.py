"""explain and report give the same answers on a real run's logs as bare files, as cluster-stored logs and from S3.

One ``kvdiag demo`` run (sim P and D, the router, every verdict and the agent traffic) is rewrapped by
the test as clusters store it: CRI pod logs under ``/var/log/pods/<ns>_<pod>_<uid>/<container>/``
(long lines cut into partial pieces, kubelet's rotation ``0.log.<time>.gz`` beside ``0.log``),
Docker's json-file, one ``kubectl logs --all-containers --prefix --timestamps`` file, and the bare
files in a bucket of a local S3-compatible server (moto's, a subprocess on loopback) read through
``s3://``. Every answer (each turn's verdict and numbers, the report's JSON) must equal the bare files';
evidence must name the file the user gave, at the same line.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.demo.run import run_demo
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report import build_report, load_turn_table
from kvdiag.diagnostics.turn_loader import UnreadableLogError, explain_conversation, load_turns

pytestmark = pytest.mark.slow  # minutes of real servers: `make test-fast` leaves it out

TS = "2026-11-20T10:00:{:02d}.{:09d}Z"
PARTIAL = 120  # lines longer than this are cut into CRI partial pieces (kubelet cuts at 16 KiB)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    run_demo(out)
    for junk in out.glob("*.console.log"):
        junk.unlink()
    (out / "report.html").unlink(missing_ok=True)
    return out


def _ts(i: int) -> bytes:
    return TS.format(i // 1_000_000 % 60, i % 1_000_000_000).encode()


def _cri(lines: list[bytes], start: int = 0) -> bytes:
    out = []
    for i, line in enumerate(lines, start):
        stream = b"stdout" if i % 2 else b"stderr"
        pieces = [line[j:j + PARTIAL] for j in range(0, len(line), PARTIAL)] or [b""]
        for k, piece in enumerate(pieces):
            out.append(_ts(i) + b" " + stream + (b" P " if k < len(pieces) - 1 else b" F ") + piece)
    return b"\n".join(out) + b"\n"


def _pod(name: str) -> str:
    return "vllm-" + name.split(".", maxsplit=1)[0].replace("_", "-")


def _write_pods(bare: Path, root: Path) -> dict[str, Path]:
    """Each bare file as one pod's container log, rotated (the first half gzipped) where it is line-based."""
    where: dict[str, Path] = {}
    for f in sorted(bare.iterdir()):
        lines = f.read_bytes().splitlines()
        folder = root / f"kvdiag_{_pod(f.name)}_5f0c2d8e-1111-4c4c-9e9e-{len(lines):012d}" / "main"
        folder.mkdir(parents=True)
        half = 0 if f.suffix == ".json" else len(lines) // 2  # a JSON document is one container's whole output
        if half:
            (folder / "0.log.20261120-090000.gz").write_bytes(gzip.compress(_cri(lines[:half])))
        (folder / "0.log").write_bytes(_cri(lines[half:], half))
        where[f.name] = folder
    return where


def _write_docker(bare: Path, root: Path) -> None:
    for i, f in enumerate(sorted(bare.iterdir())):
        # a container id, in the bare files' order: the demo's two decoders state different TTLs, and
        # explain takes the run's decode TTL from the last file that states one
        folder = root / (f"{i:04x}" + hashlib.sha256(f.name.encode()).hexdigest()[4:])
        folder.mkdir(parents=True)
        rows = []
        for i, line in enumerate(f.read_bytes().decode().splitlines()):
            pieces = [line[j:j + PARTIAL] for j in range(0, len(line), PARTIAL)] or [""]
            for k, piece in enumerate(pieces):
                rows.append(json.dumps({"log": piece + ("\n" if k == len(pieces) - 1 else ""),
                                        "stream": "stderr", "time": _ts(i).decode()}))
        (folder / f"{folder.name}-{f.stem.replace('.', '-')}-json.log").write_text("\n".join(rows) + "\n")


def _write_kubectl(bare: Path, root: Path) -> Path:
    """``kubectl logs --all-containers --prefix --timestamps`` of every pod, interleaved in one file."""
    streams = {f.name: f.read_bytes().splitlines() for f in sorted(bare.iterdir()) if f.suffix != ".json"}
    out, i = [], 0
    while any(streams.values()):
        for name, lines in streams.items():
            for _ in range(3):
                if lines:
                    out.append(f"[pod/{_pod(name)}/main] ".encode() + _ts(i) + b" " + lines.pop(0))
                    i += 1
    path = root / "kubectl-logs.txt"
    path.write_bytes(b"\n".join(out) + b"\n")
    for f in bare.iterdir():  # the client's JSON document is kept as a file of its own
        if f.suffix == ".json":
            (root / f.name).write_bytes(f.read_bytes())
    return path


def _answers(convs: list[ConversationRecord]) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for c in convs:
        for t in c.turns:
            d = t.to_json_dict()
            d.pop("evidence")
            out[(c.conversation_id, t.turn)] = d
    return out


def _report(inputs: list[str], tmp: Path) -> dict[str, Any]:
    return build_report(load_turn_table(inputs, cache_dir=tmp / "cache"), None).to_json_dict()


@pytest.fixture(scope="module")
def bare_answers(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], dict[str, Any]]:
    return _answers(load_turns([str(run)])), _report([str(run)], tmp_path_factory.mktemp("bare"))


@pytest.mark.parametrize("layout", ["pods", "docker", "kubectl"])
def test_cluster_logs_give_the_bare_files_answers(run: Path, tmp_path: Path, layout: str,
                                                  bare_answers: tuple[dict[Any, Any], dict[str, Any]]) -> None:
    root = tmp_path / layout
    root.mkdir()
    if layout == "pods":
        where = _write_pods(run, root)
    elif layout == "docker":
        _write_docker(run, root)
    else:
        _write_kubectl(run, root)
    stats = LineStats()
    convs = load_turns([str(root)], stats=stats)
    assert stats.corrupt == 0 and not stats.unrecognised_files, (stats.notes, stats.unrecognised_files)
    answers, report = bare_answers
    got = _answers(convs)
    assert got.keys() == answers.keys()
    assert got == answers
    assert _report([str(root)], tmp_path) == report
    if layout == "pods":
        # evidence names the pod log the user gave, at the line the record ends on there
        conv = explain_conversation([str(root)], "demo-late")
        ev = conv.turns[-1].evidence[0]
        path, _, lineno = ev.source.rpartition(":")
        assert Path(path).parent == where["router-events.jsonl"], ev.source
        assert ev.text[:40] in _unwrapped_line(Path(path), int(lineno))


def _unwrapped_line(path: Path, lineno: int) -> str:
    raw = (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).splitlines()
    # the record is the partial pieces up to this line, each after its CRI header
    pieces = []
    for line in raw[:lineno][::-1]:
        parts = line.split(b" ", 3)
        if pieces and parts[2] == b"F":
            break
        pieces.append(parts[3] if len(parts) > 3 else b"")
    return b"".join(reversed(pieces)).decode()


def test_a_cached_report_of_wrapped_logs_needs_no_unwrapping(run: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "pods"
    root.mkdir()
    _write_pods(run, root)
    first = load_turn_table([str(root)], cache_dir=tmp_path / "cache")
    from kvdiag.diagnostics import sources

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unwrapped again on a cache hit")

    monkeypatch.setattr(sources, "unwrap_file", refuse)
    assert load_turn_table([str(root)], cache_dir=tmp_path / "cache").equals(first)
    with pytest.raises(AssertionError, match="unwrapped again"):  # the control: a miss does unwrap
        load_turn_table([str(root)], cache_dir=tmp_path / "other-cache")


# ------------------------------------------------------------------------------------------------ S3

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    """moto's S3-compatible server as a subprocess on loopback; yields its URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto's server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def s3(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = {"AWS_ACCESS_KEY_ID": "kvdiag-test", "AWS_SECRET_ACCESS_KEY": "kvdiag-test", "AWS_REGION": "us-east-1"}
    with _moto_server() as url:
        saved = {k: os.environ.get(k) for k in (*env, "AWS_ENDPOINT_URL_S3")}
        os.environ.update(env, AWS_ENDPOINT_URL_S3=url)
        try:
            client = boto3.client("s3")
            client.create_bucket(Bucket="logs")
            for f in sorted(run.iterdir()):
                client.upload_file(str(f), "logs", f"runs/run1/{f.name}")
            pods = tmp_path_factory.mktemp("s3pods")
            _write_pods(run, pods)
            for f in sorted(p for p in pods.rglob("*") if p.is_file()):
                client.upload_file(str(f), "logs", f"var/log/pods/{f.relative_to(pods)}")
            client.put_object(Bucket="logs", Key="other/unrelated.txt", Body=b"not a log\n")
            yield client
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.mark.parametrize("url", ["s3://logs/runs/run1", "s3://logs/runs/run1/", "s3://logs/var/log/pods"])
def test_s3_inputs_give_the_bare_files_answers(s3: Any, url: str, tmp_path: Path,
                                               bare_answers: tuple[dict[Any, Any], dict[str, Any]]) -> None:
    answers, report = bare_answers
    convs = load_turns([url])
    assert _answers(convs) == answers
    sources = {e.source for c in convs for t in c.turns for e in t.evidence}
    assert sources and all(s.startswith(url.rstrip("/") + "/") for s in sources), sorted(sources)[:3]
    assert _report([url], tmp_path) == report
    # the second run reads the mirror: nothing is fetched again while the ETags hold
    copies = sorted(p for p in (tmp_path / "cache" / "s3" / "logs").rglob("*") if p.is_file())
    before = {p: p.stat().st_ino for p in copies}
    assert copies and _report([url], tmp_path) == report
    assert {p: p.stat().st_ino for p in copies} == before


def test_s3_cli_and_errors(s3: Any, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["explain", "s3://logs/runs/run1", "--conversation-id", "demo-late",
                                   "--width", "100"])
    assert res.exit_code == 0, res.output
    assert "expired_remote_read" in res.output and "s3://logs/runs/run1/router-events.jsonl:" in res.output
    res = CliRunner().invoke(cli, ["report", "s3://logs/runs/run1", "--cache-dir", str(tmp_path), "--width", "80"])
    assert res.exit_code == 0, res.output
    assert "remote_hit" in res.output
    for bad, why in (("s3://logs/no/such/prefix", "no object matches s3://logs/no/such/prefix"),
                     ("s3://no-such-bucket/x", "NoSuchBucket")):
        with pytest.raises(UnreadableLogError, match=why):
            load_turns([bad])
        res = CliRunner().invoke(cli, ["report", bad, "--no-cache"])
        assert res.exit_code == 1 and why in res.output, res.output
