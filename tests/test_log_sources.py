"""Container log wrappers: recognised by content, unwrapped line for line, bad lines named by file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvdiag.diagnostics.container_logs import Wrapper, sniff_wrapper
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.sources import stage_inputs
from kvdiag.diagnostics.turn_loader import UnreadableLogError, load_turns

TS = b"2026-11-20T10:00:00.123456789Z"
VLLM = b"(APIServer pid=7) INFO 11-20 10:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s"
EVENT = b'{"v":1,"ts":1796121216.375,"source":"router","event":"router_turn","conversation_id":"c1","turn":1}'


@pytest.mark.parametrize("head, expected", [
    (TS + b" stderr F " + VLLM + b"\n", Wrapper("cri")),
    (json.dumps({"log": VLLM.decode() + "\n", "stream": "stderr", "time": TS.decode()}).encode() + b"\n",
     Wrapper("json")),
    (json.dumps({"message": "x", "kubernetes": {"pod_name": "p", "container_name": "c"}}).encode() + b"\n",
     Wrapper("json")),
    (b"[pod/vllm-prefill-0/main] " + TS + b" " + VLLM + b"\n", Wrapper("kubectl", prefix=True, timestamps=True)),
    (b"[pod/vllm-prefill-0/main] " + VLLM + b"\n", Wrapper("kubectl", prefix=True)),
    (TS + b" " + VLLM + b"\n", Wrapper("kubectl", timestamps=True)),
    # bare formats stay bare: vLLM text, kvdiag events, the proxy's lines, a benchmark console, JSON arrays
    (VLLM + b"\n", None), (EVENT + b"\n", None), (b"[transformers] PyTorch was not found\n", None),
    (b'[{"conversation_id": "c1", "ttft_ms": 1.0}]\n', None), (b"", None),
    (b"2026-11-20 10:00:00,123 - INFO - [abc] conv=c1: cache MISS\n", None),
    # a writer may escape any letter of a key: the wrapper is still told by its keys (and no escape fakes one)
    (b'{"\\u006cog": "' + VLLM + b'\\n", "stream": "stderr", "time": "' + TS + b'"}\n', Wrapper("json")),
    (b'{"mess\\u0061ge": "x", "kubernetes": {"pod_name": "p"}}\n', Wrapper("json")),
    (b'{"v": 1, "source": "client", "note": "\\u006cog"}\n', None),
])
def test_wrappers_are_recognised_by_content(head: bytes, expected: Wrapper | None) -> None:
    assert sniff_wrapper(head * 5) == expected


def test_cri_partial_lines_are_joined_and_bad_lines_named(tmp_path: Path) -> None:
    long_event = EVENT[:-1] + b',"reason":"' + b"x" * 300 + b'"}'
    lines = [TS + b" stderr F " + EVENT, TS + b" stdout P " + long_event[:100],
             TS + b" stdout P " + long_event[100:200], TS + b" stdout F " + long_event[200:],
             b"garbage that is no CRI line", TS + b" stderr F "]
    src = tmp_path / "router-events.log.1.gz"
    src.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    with stage_inputs([str(src)]) as staged:
        (out,) = staged.paths
        bare = Path(out).read_bytes().split(b"\n")
        # one output line per input line: the joined line at its last piece, the pieces before it empty
        assert bare[:6] == [EVENT, b"", b"", long_event, b"", b""]
        assert staged.display(f"{out}:4") == f"{src}:4"
        assert Path(out).name == "router-events.log.1"  # the rotation carries over
        assert staged.stats.corrupt == 1 and staged.stats.notes == [f"{src}:5: not a CRI log line (<time> <stream> "
                                                                    "<F|P> <text>)"]
    stats = LineStats()
    load_turns([str(src)], stats=stats)
    assert any(n.startswith(f"{src}:5:") for n in stats.notes)


def test_kubectl_prefix_files_split_per_container_keep_line_numbers(tmp_path: Path) -> None:
    src = tmp_path / "all.txt"
    rows = [b"[pod/vllm-prefill-0/main] " + TS + b" " + VLLM, b"[pod/vllm-decode-0/main] " + TS + b" " + VLLM,
            b"[pod/vllm-prefill-0/main] " + TS + b" " + VLLM + b" 2"]
    src.write_bytes(b"\n".join(rows) + b"\n")
    with stage_inputs([str(src)]) as staged:
        by_name = {Path(p).name: Path(p).read_bytes().split(b"\n") for p in staged.paths}
    assert set(by_name) == {"vllm-prefill-0_main_all.txt", "vllm-decode-0_main_all.txt"}
    assert by_name["vllm-prefill-0_main_all.txt"][:3] == [VLLM, b"", VLLM + b" 2"]
    assert by_name["vllm-decode-0_main_all.txt"][:3] == [b"", VLLM, b""]


def test_kubelet_rotations_are_read_oldest_first_and_named_by_pod(tmp_path: Path) -> None:
    folder = tmp_path / "llm_vllm-decode-0_0f0e0d0c-1111-2222-3333-444455556666" / "vllm"
    folder.mkdir(parents=True)
    for name, n in (("0.log.20261120-090000.gz", 1), ("0.log.20261120-100000", 2), ("0.log", 3)):
        body = TS + b" stderr F " + VLLM + b" %d\n" % n
        (folder / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    with stage_inputs([str(tmp_path)]) as staged:
        from kvdiag.diagnostics.detect import detect
        files = detect(staged.paths)
        assert [Path(f.path).read_bytes().strip()[-1:] for f in files] == [b"1", b"2", b"3"]
        assert {f.role for f in files} == {"decode"}


def test_a_truncated_gzip_names_the_file(tmp_path: Path) -> None:
    src = tmp_path / "decode.log.2.gz"
    src.write_bytes(gzip.compress((TS + b" stderr F " + VLLM + b"\n") * 20000)[:-40])
    with pytest.raises(UnreadableLogError, match=r"decode\.log\.2\.gz: truncated or corrupt gzip"):
        load_turns([str(src)])
