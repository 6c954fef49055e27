"""Parser for stock vLLM text logs (the lines: docs/vllm-reference.md).

Handles ANSI colours, an optional ``VLLM_LOGGING_PREFIX``, the ``(EngineCore_DP0 pid=N)`` process
prefix, ``[file.py:N]`` (INFO) and ``[distributed/.../file.py:N]`` (DEBUG) forms, ``\\r``-continued
multi-line messages and bare traceback lines (folded into the previous record). Messages are
classified by their TEXT, never by the file name: the file moved three times across vLLM versions.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.diagnostics.linestats import LineStats, decode_line

ANSI_RE: Final = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The formatter's header, searched (not anchored) so any VLLM_LOGGING_PREFIX may precede the level.
HEADER_RE: Final = re.compile(
    r"^(?:\((?P<proc>[\w.-]+) pid=(?P<pid>\d+)\) )?(?P<prefix>.{0,200}?)"
    r"(?P<lvl>DEBUG|INFO|WARNING|ERROR|CRITICAL) +(?P<ts>\d\d-\d\d \d\d:\d\d:\d\d) "
    r"\[(?P<file>[^\]]{1,300}):(?P<line>\d+)\] ?(?P<msg>.*)$", re.DOTALL)
# Lines that belong to the previous record although they carry no header (tracebacks, raw dumps).
_TRACEBACK_RE: Final = re.compile(
    r"^(?:\s|Traceback |During handling|The above exception|[\w.]+(?:Error|Exception|Again)\b)")

# A request id as vLLM prints it: external ``chatcmpl-<x>`` / ``cmpl-<x>``, or an internal id.
_ID: Final = r"[\w.:-]+"


@dataclass(slots=True)
class VllmRecord:
    """One logical vLLM log record (continuation lines folded in)."""

    path: str
    lineno: int
    level: str
    ts: str  # "MM-DD HH:MM:SS": no year, no milliseconds
    fileinfo: str
    msg: str
    proc: str | None = None
    pid: int | None = None
    kind: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """``file:line`` of the record's first line."""
        return f"{self.path}:{self.lineno}"

    @property
    def text(self) -> str:
        """The first line as the operator would grep it (no continuation lines)."""
        head = self.msg.split("\n", 1)[0]
        proc = f"({self.proc} pid={self.pid}) " if self.proc else ""
        return f"{proc}{self.level} {self.ts} [{self.fileinfo}] {head}"[:500]


# request ids named in free text (a KV load failure's list when it quotes none)
IDS_IN_TEXT_RE: Final = re.compile(r"(?:chat)?cmpl-[\w-]+|[0-9a-f]{8}-[0-9a-f-]{27,}[\w-]*")


def _ids_in(text: str) -> list[str]:
    return IDS_IN_TEXT_RE.findall(text)


def _context(text: str) -> dict[str, Any]:
    """Parse the ``Context: {...}`` dict repr of a NIXL failure; tolerate truncation."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    out: dict[str, Any] = {}
    for key, val in re.findall(r"'(\w+)': '([^']*)'", text):
        out[key] = val
    return out


def _params_fields(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("remote_request_id", "remote_engine_id"):
        m = re.search(rf"'{key}': '([^']*)'", text)
        if m:
            out[key] = m.group(1)
    m = re.search(r"'remote_num_tokens': (\d+)", text)
    if m:
        out["remote_num_tokens"] = int(m.group(1))
    out["do_remote_decode"] = "'do_remote_decode': True" in text
    return out


_RATES: Final = {name: re.compile(rf"(?:^|, ){re.escape(name)}: ([\d.]+)%")
                 for name in ("Prefix cache hit rate", "External prefix cache hit rate")}


def _rate(text: str, name: str) -> float | None:
    """A ``<name>: N%`` part of vLLM's periodic ``Engine NNN:`` line (absent: None)."""
    if name not in text:
        return None
    m = _RATES[name].search(text)
    return float(m.group(1)) if m else None


def _config_fields(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    m = re.search(r"\benable_prefix_caching=(True|False)\b", text)
    if m:
        out["prefix_caching"] = m.group(1) == "True"
    m = re.search(r"\btensor_parallel_size=(\d+)", text)
    if m:
        out["tensor_parallel_size"] = int(m.group(1))
    return out


class DeferredPattern:
    """A regular expression compiled where it is first matched: a conversation's run reads a few of vLLM's kinds
    (the engine's SQL needs only the patterns' text), and compiling every classifier cost 8 ms of its start."""

    __slots__ = ("_compiled", "flags", "pattern")

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self.pattern = pattern
        self.flags = flags
        self._compiled: re.Pattern[str] | None = None

    @property
    def compiled(self) -> re.Pattern[str]:
        """The compiled pattern (once)."""
        if self._compiled is None:
            self._compiled = re.compile(self.pattern, self.flags)
        return self._compiled

    def match(self, text: str) -> re.Match[str] | None:
        """As re.Pattern.match."""
        return self.compiled.match(text)


# (kind, regex, converter of the match into fields). Order matters only for shared prefixes.
_Conv = Any
_CLASSIFIERS: Final[list[tuple[str, DeferredPattern, _Conv]]] = [
    ("bidir_enabled", DeferredPattern(
        r"^Bidirectional KV transfer is enabled and the kv recompute threshold is set to (\d+) tokens"
        r"(?:\.\s*KV blocks on D are released after a TTL of (\d+) seconds)?"),
     lambda m: {"threshold": int(m.group(1)), "ttl_s": int(m.group(2)) if m.group(2) else None}),
    ("declining_expired", DeferredPattern(rf"^Declining expired remote read for ({_ID}) from engine ({_ID})"),
     lambda m: {"request_id": m.group(1), "engine_id": m.group(2).rstrip(".;")}),
    ("releasing_expired", DeferredPattern(
        rf"^Releasing expired KV blocks for request ({_ID}) which were retrieved by (\d+) "),
     lambda m: {"request_id": m.group(1), "count": int(m.group(2))}),
    ("invalid_unrecognized", DeferredPattern(rf"^Potentially invalid KV blocks for unrecognized request ({_ID})"),
     lambda m: {"request_id": m.group(1)}),
    ("nixl_failure", DeferredPattern(r"^NIXL transfer failure: ([\w]+)(?:\. (.*?))? \| Context: (.*)$", re.DOTALL),
     lambda m: {"failure_type": m.group(1), "detail": m.group(2), "context": _context(m.group(3))}),
    ("kv_load_failed", DeferredPattern(
        r"^Failing (\d+) request\(s\) due to KV load failure \(failure_policy=(\w+), (\d+) tokens affected\)\. "
        r"Request IDs: (.*)$", re.DOTALL),
     lambda m: {"count": int(m.group(1)), "policy": m.group(2), "tokens": int(m.group(3)),
                "request_ids": re.findall(r"'([^']+)'", m.group(4)) or _ids_in(m.group(4))}),
    ("kv_load_recovered", DeferredPattern(r"^Recovered from KV load failure: (\d+) request\(s\) rescheduled"),
     lambda m: {"count": int(m.group(1))}),
    ("skip_post_processing", DeferredPattern(rf"^Skipping KV post-processing for failed request ({_ID})"),
     lambda m: {"request_id": m.group(1)}),
    ("skip_remote_pull", DeferredPattern(rf"^Skipping remote pull for ({_ID}): (\d+) remote tokens < threshold (\d+)"),
     lambda m: {"request_id": m.group(1), "remote_tokens": int(m.group(2)), "threshold": int(m.group(3))}),
    ("matched_tokens", DeferredPattern(
        r"^NIXLConnector get_num_new_matched_tokens: num_computed_tokens=(\d+), kv_transfer_params=(.*)$",
        re.DOTALL),
     lambda m: {"num_computed_tokens": int(m.group(1)), **_params_fields(m.group(2))}),
    ("start_load_kv", DeferredPattern(
        rf"^start_load_kv for request ({_ID}) from remote engine ({_ID})\. Num local_block_ids: (\d+)\. "
        r"Num remote_block_ids: (\d+)"),
     lambda m: {"request_id": m.group(1), "remote_engine_id": m.group(2), "local_blocks": int(m.group(3)),
                "remote_blocks": int(m.group(4))}),
    ("read_blocks", DeferredPattern(
        rf"^Remote agent ({_ID}) available, calling _read_blocks on remote rank \d+ with remote block size "
        rf"(\d+) for req ({_ID})"),
     lambda m: {"remote_engine_id": m.group(1), "block_size": int(m.group(2)), "request_id": m.group(3)}),
    ("finished_recving", DeferredPattern(rf"^Finished recving KV transfer for request ({_ID})"),
     lambda m: {"request_id": m.group(1)}),
    ("finished_sending", DeferredPattern(rf"^Finished sending KV transfer for request ({_ID})"),
     lambda m: {"request_id": m.group(1)}),
    ("request_finished_wait", DeferredPattern(
        rf"^NIXLConnector request_finished\(({_ID})\) waiting for (\d+) seconds"),
     lambda m: {"request_id": m.group(1), "seconds": int(m.group(2))}),
    ("request_finished_status", DeferredPattern(
        rf"^NIXLConnector request_finished\(({_ID})\), request_status=(\w+)"),
     lambda m: {"request_id": m.group(1), "status": m.group(2)}),
    ("waiting_remote_kvs", DeferredPattern(rf"^({_ID}) is still in WAITING_FOR_REMOTE_KVS state"),
     lambda m: {"request_id": m.group(1)}),
    ("invalid_params",
     DeferredPattern(r"^Got invalid KVTransferParams: (.*)\. This request will not utilize", re.DOTALL),
     lambda m: _params_fields(m.group(1))),
    ("no_connector", DeferredPattern(r"^Got kv_transfer_params, but no KVConnector found"), lambda m: {}),
    ("received_request", DeferredPattern(rf"^Received request ({_ID}):"), lambda m: {"request_id": m.group(1)}),
    ("generated_response", DeferredPattern(
        rf"^Generated response ({_ID})(?: \(streaming (?:delta|complete)\))?: .*finish_reason: (\w+)",
        re.DOTALL),
     lambda m: {"request_id": m.group(1), "finish_reason": m.group(2)}),
    ("added_request", DeferredPattern(rf"^Added request ({_ID})\."), lambda m: {"request_id": m.group(1)}),
    ("aborted", DeferredPattern(r"^Aborted request\(s\) (.*)\.$"),
     lambda m: {"request_ids": [s.strip(" '\"[]{}") for s in re.split(r"[,\s]+", m.group(1)) if s.strip(" '\"[]{}")]}),
    ("aborted", DeferredPattern(rf"^Request ({_ID}) aborted\."), lambda m: {"request_ids": [m.group(1)]}),
    ("request_failed", DeferredPattern(rf"^Request ({_ID}) failed(?: \(([\w ]+)\))?(?:: (.*?))?\.?$", re.DOTALL),
     lambda m: {"request_id": m.group(1), "why": m.group(2) or "error", "detail": m.group(3)}),
    # vLLM 0.33's API server when a request finished with an error (HTTP 500 to the caller), e.g. P's
    # request failed on a KV load failure under failure_policy=fail
    ("request_failed", DeferredPattern(rf"^Request ({_ID}) failed with an internal error during generation"),
     lambda m: {"request_id": m.group(1), "why": "internal error, HTTP 500", "detail": None}),
    ("kv_metrics", DeferredPattern(r"^KV Transfer metrics: (.*)$"),
     lambda m: {k.strip(): v for k, _, v in (p.partition("=") for p in m.group(1).split(", "))}),
    ("engine_stats", DeferredPattern(
        r"^Engine (\d+): Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
        r"Running: (\d+) reqs, Waiting: (\d+) reqs(.*)$", re.DOTALL),
     lambda m: {"engine": int(m.group(1)), "prompt_throughput": float(m.group(2)),
                "generation_throughput": float(m.group(3)), "running": int(m.group(4)), "waiting": int(m.group(5)),
                "prefix_hit_rate": _rate(m.group(6), "Prefix cache hit rate"),
                "external_hit_rate": _rate(m.group(6), "External prefix cache hit rate")}),
    ("transfer_plan", DeferredPattern(r"^Transfer plan: TransferTopology\((.*)\)"),
     lambda m: {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", m.group(1))}),
    ("engine_config", DeferredPattern(r"^Initializing a V1 LLM engine \(v([^)]*)\) with config: (.*)$", re.DOTALL),
     lambda m: {"version": m.group(1), **_config_fields(m.group(2))}),
]


def _first_word(pattern: str) -> str | None:
    m = re.match(r"\^([A-Za-z_]+)(?=[ (:])", pattern)
    return m.group(1) if m else None


# Classifiers by the literal first word of their message (most lines need one regex try, not 25).
_BY_WORD: Final[dict[str, list[tuple[str, DeferredPattern, _Conv]]]] = {}
_ANY_WORD: Final[list[tuple[str, DeferredPattern, _Conv]]] = []
for _entry in _CLASSIFIERS:
    _word = _first_word(_entry[1].pattern)
    if _word is None:
        _ANY_WORD.append(_entry)
    else:
        _BY_WORD.setdefault(_word, []).append(_entry)


def classify_message(msg: str) -> tuple[str | None, dict[str, Any]]:
    """Return (kind, fields) for a vLLM message, or (None, {}) for one kvdiag does not use."""
    for kind, regex, conv in (*_BY_WORD.get(msg.split(" ", 1)[0].split("(", 1)[0], ()), *_ANY_WORD):
        m = regex.match(msg)
        if m:
            try:
                return kind, dict(conv(m))
            except (ValueError, TypeError):
                return None, {}
    return None, {}


_CONTEXT_KINDS: Final = frozenset({"nixl_failure"})


def parse_vllm_log(lines: Iterable[bytes | str], path: str = "<stdin>",
                   stats: LineStats | None = None) -> Iterator[VllmRecord]:
    """Yield vLLM records from raw lines; a line that is no vLLM record is counted and skipped."""
    return parse_vllm_numbered(enumerate(lines, start=1), path, stats)


def parse_vllm_numbered(numbered: Iterable[tuple[int, bytes | str]], path: str = "<stdin>",
                        stats: LineStats | None = None) -> Iterator[VllmRecord]:
    """Like parse_vllm_log over (line number, line) pairs, e.g. the prefiltered lines of a big file."""
    stats = stats if stats is not None else LineStats()
    current: VllmRecord | None = None
    continued = False  # the previous physical line ended in "\r": the next one is its continuation
    prev_lineno = -1
    for lineno, raw in numbered:
        if lineno != prev_lineno + 1:
            continued = False  # a prefilter skipped lines: nothing carries over
        prev_lineno = lineno
        text, ok = decode_line(raw)
        if not ok:
            stats.corrupt += 1
            stats.note(path, lineno, "invalid UTF-8 or oversized line")
        text = text.rstrip("\n")
        ends_cr = text.endswith("\r")
        text = text.rstrip("\r")
        if "\x1b" in text:  # colours are rare in files; skip the substitution otherwise
            text = ANSI_RE.sub("", text)
        if not text.strip():
            continued = False
            continue
        stats.lines += 1
        m = HEADER_RE.match(text) if len(text) < 1_000_000 else None
        if m is None:
            if current is not None and (continued or _TRACEBACK_RE.match(text)):
                current.msg += "\n" + text[:2000]
            else:
                stats.other += 1
            continued = ends_cr
            continue
        msg = m.group("msg")
        if continued and current is not None and m.group("ts") == current.ts and m.group("lvl") == current.level:
            current.msg += "\n" + msg[:2000]
            continued = ends_cr
            continue
        if current is not None:
            _finish(current)
            yield current
        pid = m.group("pid")
        current = VllmRecord(path=path, lineno=lineno, level=m.group("lvl"), ts=m.group("ts"),
                             fileinfo=f"{m.group('file')}:{m.group('line')}", msg=msg, proc=m.group("proc"),
                             pid=int(pid) if pid and len(pid) <= 18 else None)  # (no 4300-digit int())
        stats.records += 1
        continued = ends_cr
    if current is not None:
        _finish(current)
        yield current


def _finish(rec: VllmRecord) -> None:
    head = rec.msg if "\n" not in rec.msg else rec.msg.split("\n", 1)[0]
    kind, fields = classify_message(head)
    if kind is None and "\n" in rec.msg:
        kind, fields = classify_message(rec.msg)
    rec.kind, rec.fields = kind, fields
