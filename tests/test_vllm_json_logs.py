"""vLLM's JSON logs (``--logging-config.formatter json``) are read as its text logs are.

The JSON files are written by vLLM's own logging setup with its JSON formatter (python-json-logger, a vLLM
dependency), replaying the messages of a real INFO run at their own times; every turn must get the verdict
the text logs give it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvdiag
from kvdiag.diagnostics.container_logs import sniff_wrapper, vllm_json_line

RUN = Path(__file__).parent / "fixtures" / "logs" / "real_vllm_info"

# (run in a child: vLLM's logging setup replaces the handlers of the "vllm" logger for the whole process)
_REPLAY = """
import calendar, logging, sys, time
from vllm.config.logging import LoggingConfig
import vllm.logger as vllm_logger
from kvdiag.diagnostics.vllm_log_parser import HEADER_RE

src, dst, year = sys.argv[1], sys.argv[2], int(sys.argv[3])
vllm_logger._configure_vllm_root_logger(LoggingConfig(formatter="json"))
handler = logging.getLogger("vllm").handlers[0]
out = open(dst, "w")
handler.setStream(out)
at = [0.0]

class Stamp(logging.Filter):
    def filter(self, record):
        record.created, record.msecs = at[0], 0.0
        return True

handler.addFilter(Stamp())
log = vllm_logger.init_logger("vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector")
for line in open(src).read().splitlines():
    m = HEADER_RE.match(line)
    if m:
        at[0] = calendar.timegm(time.strptime(f"{year}-{m.group('ts')}", "%Y-%m-%d %H:%M:%S"))
        log.log(getattr(logging, m.group("lvl")), "%s", m.group("msg"))
out.close()
"""


def _verdicts(folder: Path) -> dict[tuple[str, int], tuple[str, str, float | None]]:
    return {(c.conversation_id, t.turn): (t.verdict.value, t.confidence.value, t.prefill_ms)
            for c in kvdiag.load_turns([str(folder)]) for t in c.turns}


@pytest.mark.vllm
def test_logs_vllm_writes_as_json_give_the_verdicts_its_text_logs_give(tmp_path: Path) -> None:
    for name in ("proxy.log", "client-stats.json"):
        shutil.copy(RUN / name, tmp_path / name)
    for name in ("prefill.log", "decode.log"):
        subprocess.run([sys.executable, "-c", _REPLAY, str(RUN / name), str(tmp_path / name), "2026"], check=True,
                       env={**os.environ, "TZ": "UTC"}, timeout=120)
        first = json.loads((tmp_path / name).read_text().splitlines()[0])
        assert {"asctime", "levelname", "name", "process", "message"} <= first.keys()
    text, as_json = _verdicts(RUN), _verdicts(tmp_path)
    assert as_json == text
    # the stats windows decide some turns: the engine lines were read, not just the proxy's
    assert {v for v, _, _ in as_json.values()} >= {"remote_hit", "below_threshold", "expired_remote_read"}


def test_a_vllm_json_record_reads_as_its_text_line() -> None:
    record = {"asctime": "2026-11-29 10:00:01,123", "levelname": "ERROR", "name": "vllm.v1.engine.core",
              "processName": "EngineCore_DP0", "process": 11, "message": "NIXL transfer failure: handshake_failed",
              "exc_info": "Traceback (most recent call last):\n  ...\nRuntimeError: boom"}
    line = vllm_json_line(record)
    assert line is not None and "\n" not in line
    assert line.startswith("(EngineCore_DP0 pid=11) ERROR 11-29 10:00:01 [vllm.v1.engine.core:0] NIXL transfer")
    assert line.endswith("\rRuntimeError: boom")
    assert vllm_json_line({**record, "asctime": "yesterday"}) is None


def test_event_and_statistics_lines_are_not_taken_for_vllm_records() -> None:
    event = {"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "conversation_id": "c", "turn": 1}
    stat = {"ttft_ms": 1.0, "conversation_id": "c", "input_num_tokens": 10}
    assert sniff_wrapper(b"".join(json.dumps(o).encode() + b"\n" for o in (event, stat) * 5)) is None
    stamped = {"asctime": "2026-11-29 10:00:01,000", "levelname": "INFO", "message": "x"}
    wrapper = sniff_wrapper(json.dumps(stamped).encode() + b"\n")
    assert wrapper is not None and wrapper.kind == "json"

