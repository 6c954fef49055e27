"""Writes vLLM's own log lines (format of vllm/logger.py, messages verbatim from vLLM 0.33).

Line format: ``(<Process> pid=N) LEVEL MM-DD HH:MM:SS [file:line] message``. Engine-side lines
(scheduler, NIXL worker) carry ``EngineCore_DP0``; request logging and the periodic stat lines carry
``APIServer``. At DEBUG the ``[file:line]`` part is vLLM's shortened path (``distributed/.../nixl/
pull_worker.py``). A multi-line message repeats the whole prefix after ``\\r\\n`` as vLLM's
NewLineFormatter does. Writing never raises: a failed write is counted and dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import IO, Final

_logger = logging.getLogger(__name__)

LEVELS: Final = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}

ENGINE: Final = "EngineCore_DP0"
API: Final = "APIServer"

# Where each message comes from: (INFO basename, DEBUG path form, line number) as vLLM 0.33 logs them.
_N = "distributed/.../nixl/"
SITES: Final[dict[str, tuple[str, str, int]]] = {
    "startup_bidir": ("base_scheduler.py", _N + "base_scheduler.py", 188),
    "compat_ok": ("base_worker.py", _N + "base_worker.py", 1210),
    "transfer_plan": ("base_worker.py", _N + "base_worker.py", 2525),
    "handshake_setup_failed": ("base_worker.py", _N + "base_worker.py", 1435),
    "handshake_failed": ("base_worker.py", _N + "base_worker.py", 1471),
    "transfer_failed": ("base_worker.py", _N + "base_worker.py", 2873),
    "transfer_setup_failed": ("base_worker.py", _N + "base_worker.py", 2799),
    "notification_failed": ("base_worker.py", _N + "base_worker.py", 2911),
    "releasing_expired": ("base_worker.py", _N + "base_worker.py", 3370),
    "skip_post": ("base_worker.py", _N + "base_worker.py", 3253),
    "get_finished": ("base_worker.py", _N + "base_worker.py", 3230),
    "querying_metadata": ("base_worker.py", _N + "base_worker.py", 1149),
    "declining": ("pull_worker.py", _N + "pull_worker.py", 161),
    "potentially_invalid": ("pull_worker.py", _N + "pull_worker.py", 3004),
    "start_load_kv": ("pull_worker.py", _N + "pull_worker.py", 61),
    "remote_agent": ("pull_worker.py", _N + "pull_worker.py", 325),
    "get_num_new_matched": ("pull_scheduler.py", _N + "pull_scheduler.py", 52),
    "skip_pull": ("pull_scheduler.py", _N + "pull_scheduler.py", 96),
    "update_state_after_alloc": ("pull_scheduler.py", _N + "pull_scheduler.py", 112),
    "request_finished_wait": ("pull_scheduler.py", _N + "pull_scheduler.py", 258),
    "invalid_params": ("pull_scheduler.py", _N + "pull_scheduler.py", 140),
    "failing": ("scheduler.py", "v1/core/sched/scheduler.py", 3764),
    "recovered": ("scheduler.py", "v1/core/sched/scheduler.py", 3781),
    "still_waiting": ("scheduler.py", "v1/core/sched/scheduler.py", 3526),
    "finished_recving": ("scheduler.py", "v1/core/sched/scheduler.py", 3570),
    "finished_sending": ("scheduler.py", "v1/core/sched/scheduler.py", 3580),
    "received_request": ("logger.py", "entrypoints/logger.py", 45),
    "generated_response": ("logger.py", "entrypoints/logger.py", 73),
    "added_request": ("async_llm.py", "v1/engine/async_llm.py", 377),
    "request_failed": ("async_llm.py", "v1/engine/async_llm.py", 540),
    "generation_error": ("serving.py", "entrypoints/.../base/serving.py", 203),
    "kv_metrics": ("metrics.py", "distributed/.../v1/metrics.py", 108),
    "engine_stats": ("loggers.py", "v1/metrics/loggers.py", 335),
    "connector_created": ("factory.py", "distributed/.../kv_connector/factory.py", 56),
    "init_scheduler": ("base_scheduler.py", _N + "base_scheduler.py", 160),
}

# Verbatim vLLM 0.33 format strings.
MSG_STARTUP_BIDIR: Final = ("Bidirectional KV transfer is enabled and the kv recompute threshold is set to %d "
                            "tokens.KV blocks on D are released after a TTL of %d seconds.")
MSG_RELEASING_EXPIRED: Final = ("Releasing expired KV blocks for request %s which were retrieved by %d remote "
                                "worker(s) before lease expired.")
MSG_POTENTIALLY_INVALID: Final = ("Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                                  "decode worker. They may have expired.")
MSG_DECLINING: Final = "Declining expired remote read for %s from engine %s."
MSG_SKIP_POST: Final = "Skipping KV post-processing for failed request %s"
MSG_FAILING: Final = ("Failing %d request(s) due to KV load failure (failure_policy=fail, %d tokens affected). "
                      "Request IDs: %s")
MSG_RECOVERED: Final = "Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected)."
MSG_TRANSFER_FAILURE: Final = "NIXL transfer failure: %s | Context: %s"
MSG_SKIP_PULL: Final = "Skipping remote pull for %s: %d remote tokens < threshold %d"
MSG_REQUEST_FINISHED_WAIT: Final = "NIXLConnector request_finished(%s) waiting for %d seconds before releasing blocks"
MSG_FINISHED_RECVING: Final = "Finished recving KV transfer for request %s"
MSG_FINISHED_SENDING: Final = "Finished sending KV transfer for request %s"
MSG_START_LOAD_KV: Final = ("start_load_kv for request %s from remote engine %s. Num local_block_ids: %s. "
                            "Num remote_block_ids: %s. ")
MSG_GET_NUM_NEW_MATCHED: Final = ("NIXLConnector get_num_new_matched_tokens: num_computed_tokens=%s, "
                                  "kv_transfer_params=%s")
MSG_UPDATE_STATE: Final = "NIXLConnector update_state_after_alloc: num_external_tokens=%s, kv_transfer_params=%s"
MSG_STILL_WAITING: Final = "%s is still in WAITING_FOR_REMOTE_KVS state."
MSG_INVALID_PARAMS: Final = "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer"
MSG_GET_FINISHED: Final = "Rank %s, get_finished: %s requests done sending and %s requests done recving (%s failed)"
MSG_QUERYING: Final = "Querying metadata on path: %s at remote pp rank %s, tp rank %s"
MSG_REMOTE_AGENT: Final = ("Remote agent %s available, calling _read_blocks on remote rank %s with remote block "
                           "size %s for req %s")
MSG_COMPAT_OK: Final = "NIXL compatibility check passed (hash: %s)"
MSG_RECEIVED_REQUEST: Final = "Received request %s: params: %s, lora_request: %s."
MSG_ADDED_REQUEST: Final = "Added request %s."
MSG_GENERATED_RESPONSE: Final = "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s"
MSG_REQUEST_FAILED: Final = "Request %s failed."
MSG_GENERATION_ERROR: Final = "Request %s failed with an internal error during generation"
MSG_KV_METRICS: Final = "KV Transfer metrics: %s"
MSG_TRANSFER_PLAN: Final = ("Transfer plan: TransferTopology(tp_ratio=%d, num_kv_heads=%d, local_tp=%d, remote_tp=%d, "
                            "remote_pp=%d, local_dcp=%d, remote_dcp=%d, local_rank=%d, remote_block_len=%d)")
MSG_CONNECTOR_CREATED: Final = "Creating v1 connector with name: %s and engine_id: %s"
MSG_INIT_SCHEDULER: Final = "Initializing NIXL Scheduler %s"


def format_msg(fmt: str, *args: object) -> str:
    """Apply logging's %-formatting as vLLM's logger does."""
    return fmt % args if args else fmt


class VllmLogWriter:
    """Appends vLLM-format lines to a file (or to nothing when ``path`` is None)."""

    def __init__(self, path: str | None, level: str = "INFO", pid: int | None = None) -> None:
        self.level = LEVELS.get(level.upper(), 20)
        self.debug_paths = self.level <= 10
        self.pid = pid if pid is not None else os.getpid()
        self.errors = 0
        self._lock = threading.Lock()
        self._fh: IO[str] | None = None
        if path is not None:
            self._fh = open(path, "a", encoding="utf-8", buffering=1)

    def enabled(self, level: str) -> bool:
        """True if a line at ``level`` would be written."""
        return self._fh is not None and LEVELS[level] >= self.level

    def log(self, level: str, site: str, fmt: str, *args: object, process: str = ENGINE,
            extra_lines: tuple[str, ...] = ()) -> str | None:
        """Write one line (and continuation lines, e.g. a traceback); return it, or None when filtered."""
        if not self.enabled(level):
            return None
        base, debug_path, lineno = SITES[site]
        fileinfo = debug_path if self.debug_paths else base
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime())
        prefix = f"({process} pid={self.pid}) {level} {stamp} [{fileinfo}:{lineno}] "
        try:
            msg = format_msg(fmt, *args)
        except (TypeError, ValueError):
            msg = f"{fmt} {args!r}"
        text = prefix + msg
        for extra in extra_lines:
            text += "\r\n" + prefix + extra
        try:
            with self._lock:
                assert self._fh is not None
                self._fh.write(text + "\n")
        except (OSError, ValueError) as exc:
            self.errors += 1
            _logger.warning("vLLM log write failed: %s", exc)
        return text

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
