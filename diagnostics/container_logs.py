"""Logs as clusters store them: the wrappers container runtimes, kubectl and log shippers put around each line.

Recognised by content (never by file name), from the first lines of a file:

* ``cri``: the CRI format kubelet writes under ``/var/log/pods`` (containerd, CRI-O):
  ``2026-11-20T10:00:00.123456789Z stderr F <line>``; a line longer than the runtime's buffer is cut
  into ``P`` (partial) pieces ending with an ``F`` piece, which are joined;
* ``json``: Docker's json-file driver (``{"log": "<line>\\n", "stream": "stderr", "time": "..."}``,
  a piece without the trailing newline is partial and joined with the next) and the JSON lines log
  shippers write (fluent-bit: ``log`` plus ``kubernetes`` metadata; Vector: ``message`` plus
  ``kubernetes``), split per pod and container when the metadata names them;
* ``json`` also covers vLLM's own JSON records (``--logging-config.formatter json``: ``asctime``,
  ``levelname``, ``name``, ``processName``, ``process``, ``message``), each written back as the line vLLM's
  text formatter would write (``[<logger name>:0]`` stands for the file and line the records lack, and a
  message's line breaks become carriage returns, so it stays one line);
* ``kubectl``: ``kubectl logs --prefix`` (``[pod/<pod>/<container>] <line>``, split per pod and
  container: ``--all-containers`` interleaves them) and ``--timestamps`` (an RFC 3339 time before
  each line), alone or together.

:func:`unwrap_file` writes the bare lines to plain files, **one output line per input line**: a line
number in an unwrapped file is the line number in the original (a joined partial line sits at its
last piece's line, the pieces before it and other containers' lines are left empty). So every
``file:line`` explain prints points into the file the user gave.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, Final

from kvdiag.diagnostics.detect import LogReadError, open_binary, whole_line_blocks
from kvdiag.diagnostics.linestats import LineStats

SNIFF_LINES: Final = 50
MATCH_SHARE: Final = 0.9  # of the sampled lines, so a torn first or last line does not hide the format
CHUNK_BYTES: Final = 8 * 1024 * 1024
MAX_PARTIAL_BYTES: Final = 4 * 1024 * 1024  # a partial line that never ends is cut here (and counted)
MAX_STREAMS: Final = 256  # pods x containers one --prefix file may be split into

_TS: Final = rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d)"
CRI_RE: Final = re.compile(rb"^" + _TS + rb" (?:stdout|stderr) ([FP])(?: (.*))?$", re.DOTALL)
TIMESTAMP_RE: Final = re.compile(rb"^" + _TS + rb" ")
_TIMESTAMP_SUB: Final = re.compile(rb"^" + _TS + rb" ", re.MULTILINE)
PREFIX_RE: Final = re.compile(rb"^\[pod/([^/\]\s]+)/([^\]\s]+)\] ")
KINDS: Final = ("cri", "json", "kubectl")


@dataclass(frozen=True)
class Wrapper:
    """What wraps a file's lines: ``kind`` (cri, json, kubectl) and, for kubectl, which prefixes."""

    kind: str
    prefix: bool = False     # kubectl --prefix: "[pod/<pod>/<container>] "
    timestamps: bool = False  # kubectl --timestamps: "<RFC 3339> "


@dataclass
class Unwrapped:
    """One bare file written by :func:`unwrap_file` and the stream it holds (``pod/container`` or "")."""

    path: str
    stream: str = ""


@dataclass
class UnwrapResult:
    """The files written for one input, and what was skipped (``stats.notes`` name the input's lines)."""

    files: list[Unwrapped] = field(default_factory=list)
    stats: LineStats = field(default_factory=LineStats)


def _json_wrapper(line: bytes) -> bool:
    # every wrapper names a "log" or "message" key, as written or with an escaped letter: a line with neither is
    # not one, and most JSON lines (kvdiag's events, the benchmark client's statistics) are told so unparsed
    if b'"log"' not in line and b'"message"' not in line and b"\\u" not in line:
        return False
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    if isinstance(obj.get("log"), str) and ({"stream", "time", "kubernetes", "logtag"} & obj.keys()):
        return True
    if "log" not in obj and vllm_json_line(obj) is not None:
        return True
    return isinstance(obj.get("message"), str) and isinstance(obj.get("kubernetes"), dict)


_ASCTIME_RE: Final = re.compile(r"\d{4}-(\d\d-\d\d)[ T](\d\d:\d\d:\d\d)")


def vllm_json_line(obj: dict[str, Any]) -> str | None:
    """The text line vLLM writes for the record its JSON formatter wrote as ``obj`` (None: not such a record)."""
    level, stamp, msg = obj.get("levelname"), obj.get("asctime"), obj.get("message")
    if not (isinstance(level, str) and isinstance(stamp, str) and isinstance(msg, str)):
        return None
    m = _ASCTIME_RE.match(stamp)
    if m is None:
        return None
    proc = obj.get("vllm_process_name") or obj.get("processName")
    pid = obj.get("process")
    head = f"({proc} pid={pid}) " if isinstance(proc, str) and isinstance(pid, int) else ""
    name = obj.get("name") if isinstance(obj.get("name"), str) else "vllm"
    exc = obj.get("exc_info")
    if isinstance(exc, str) and exc:  # (the traceback the text formatter writes after the message)
        msg = f"{msg}\n{exc}"
    return f"{head}{level} {m.group(1)} {m.group(2)} [{name}:0] " + msg.replace("\r\n", "\n").replace("\n", "\r")


def sniff_wrapper(head: bytes) -> Wrapper | None:
    """The wrapper around the lines of a file starting with ``head``, or None for bare lines."""
    lines = [ln for ln in head.split(b"\n")[:SNIFF_LINES + 1] if ln.strip()]
    if len(head.split(b"\n")) > SNIFF_LINES:
        lines = lines[:SNIFF_LINES]
    elif lines and not head.endswith(b"\n") and len(lines) > 1:
        lines = lines[:-1]  # the sample may end inside a line
    if not lines:
        return None
    need = max(1, int(len(lines) * MATCH_SHARE))

    def share(test: Callable[[bytes], bool]) -> bool:
        return sum(1 for ln in lines if test(ln)) >= need

    if share(lambda ln: CRI_RE.match(ln.rstrip(b"\r")) is not None):
        return Wrapper("cri")
    if share(lambda ln: ln.startswith(b"{") and _json_wrapper(ln)):
        return Wrapper("json")
    prefixed = share(lambda ln: PREFIX_RE.match(ln) is not None)
    inner = [PREFIX_RE.sub(b"", ln, count=1) for ln in lines] if prefixed else lines
    stamped = sum(1 for ln in inner if TIMESTAMP_RE.match(ln)) >= need
    if prefixed or stamped:
        return Wrapper("kubectl", prefix=prefixed, timestamps=stamped)
    return None


class _Writers:
    """One output file per stream, each given one line per input line (empty where the line is another's)."""

    def __init__(self, make_path: Callable[[str], str]) -> None:
        self.make_path = make_path
        self.files: dict[str, IO[bytes]] = {}
        self.lines: dict[str, int] = {}
        self.order: list[str] = []
        self.total = 0

    def write(self, stream: str, line: bytes) -> None:
        """Write ``line`` (no newline) as this input line of ``stream``; every other stream gets a blank."""
        fh = self.files.get(stream)
        if fh is None:
            if len(self.files) >= MAX_STREAMS:
                raise LogReadError(f"more than {MAX_STREAMS} pod/container streams in one file")
            path = self.make_path(stream)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fh = self.files[stream] = open(path, "wb")  # closed in close() or abort()
            self.order.append(stream)
            self.lines[stream] = 0
        gap = self.total - self.lines[stream]
        if gap:
            fh.write(b"\n" * gap)
        fh.write(line + b"\n")
        self.total += 1
        self.lines[stream] = self.total

    def blank(self) -> None:
        """An input line that belongs to no stream (a partial piece, a skipped line)."""
        self.total += 1

    def write_block(self, stream: str, block: bytes, lines: int) -> None:
        """``lines`` whole lines of ``stream`` at once (the fast path: no partial, no other stream)."""
        if stream not in self.files:  # the first line opens the file
            first = block.index(b"\n")
            self.write(stream, block[:first])
            block, lines = block[first + 1:], lines - 1
            if not lines:
                return
        fh = self.files[stream]
        gap = self.total - self.lines[stream]
        if gap:
            fh.write(b"\n" * gap)
        fh.write(block)
        self.total += lines
        self.lines[stream] = self.total

    def close(self) -> list[Unwrapped]:
        out = []
        for stream in self.order:
            fh = self.files[stream]
            gap = self.total - self.lines[stream]
            if gap:  # the same line count as the input: a line number past the end stays past it
                fh.write(b"\n" * gap)
            fh.close()
            out.append(Unwrapped(path=fh.name if isinstance(fh.name, str) else str(fh.name), stream=stream))
        return out

    def abort(self) -> None:
        for fh in self.files.values():
            fh.close()


def _lines(path: str, display: str) -> Iterator[bytes]:
    """Chunks of whole lines (each ending in ``\\n``; a last line without one gets one)."""
    try:
        with open_binary(path) as fh:
            for block in whole_line_blocks(fh, CHUNK_BYTES):
                yield block if block.endswith(b"\n") else block + b"\n"
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, (EOFError, gzip.BadGzipFile)):
            why = f"truncated or corrupt gzip file ({exc}); re-copy it or decompress what is left with zcat"
        raise LogReadError(f"cannot read {display}: {why}") from None


class _Partial:
    """A line being joined from partial pieces (bounded)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, piece: bytes) -> bool:
        """Append a piece; False once the line outgrew MAX_PARTIAL_BYTES (the rest is dropped)."""
        if self.size + len(piece) > MAX_PARTIAL_BYTES:
            return False
        self.parts.append(piece)
        self.size += len(piece)
        return True

    def take(self, last: bytes = b"") -> bytes:
        line = b"".join(self.parts) + last
        self.parts, self.size = [], 0
        return line


def unwrap_file(path: str, wrapper: Wrapper, make_path: Callable[[str], str], display: str) -> UnwrapResult:
    """Write the bare lines of ``path`` to the files ``make_path(stream)`` names; ``display`` names the input.

    Lines that are not in the wrapper's format are counted as corrupt (named ``display:line``) and left empty.
    """
    result = UnwrapResult()
    out = _Writers(make_path)
    try:
        if wrapper.kind == "cri":
            _unwrap_cri(path, display, out, result.stats)
        elif wrapper.kind == "json":
            _unwrap_json(path, display, out, result.stats)
        else:
            _unwrap_kubectl(path, display, wrapper, out, result.stats)
    except BaseException:
        out.abort()
        raise
    result.files = out.close()
    return result


def _bad(stats: LineStats, display: str, lineno: int, what: str, out: _Writers) -> None:
    stats.corrupt += 1
    stats.note(display, lineno, what)
    out.blank()


def _unwrap_cri(path: str, display: str, out: _Writers, stats: LineStats) -> None:
    partial = _Partial()
    overflow = False
    streams = (b"stdout", b"stderr")
    for chunk in _lines(path, display):
        lines = chunk.split(b"\n")[:-1]
        stats.lines += len(lines)
        for line in lines:
            # split, not a regex: "<time> <stream> <F|P> <text>" is cut at its first three spaces at
            # C speed; the time only needs its shape (a digit first, "T" at 10)
            parts = line.split(b" ", 3)
            if len(parts) < 3 or parts[1] not in streams or len(parts[0]) < 20 or parts[0][10:11] != b"T" \
                    or not parts[0][:1].isdigit():
                _bad(stats, display, out.total + 1, "not a CRI log line (<time> <stream> <F|P> <text>)", out)
                continue
            tag, piece = parts[2], parts[3] if len(parts) == 4 else b""
            if tag == b"F":
                out.write("", partial.take(b"" if overflow else piece) if partial.parts or overflow else piece)
                overflow = False
            elif tag == b"P":
                if not overflow and not partial.add(piece):
                    overflow = True
                    stats.corrupt += 1
                    stats.note(display, out.total + 1, f"a partial line longer than {MAX_PARTIAL_BYTES} bytes, cut")
                out.blank()
            else:
                _bad(stats, display, out.total + 1, "not a CRI log line (<time> <stream> <F|P> <text>)", out)
    if partial.parts:
        out.write("", partial.take())  # the file ended inside a partial line: keep what there is


def _unwrap_json(path: str, display: str, out: _Writers, stats: LineStats) -> None:
    partial: dict[str, _Partial] = {}
    for chunk in _lines(path, display):
        lines = chunk.splitlines()
        stats.lines += len(lines)
        try:
            # One decoder call for the whole chunk is several times faster than one per line.
            objs: list[object] = json.loads(b"[" + b",".join(ln if ln.strip() else b"null" for ln in lines) + b"]")
        except ValueError:
            objs = [_loads(ln) for ln in lines]
        for line, obj in zip(lines, objs, strict=True):
            lineno = out.total + 1
            if not line.strip():
                out.blank()
                continue
            text, stream, done = _json_record(obj)
            if text is None:
                _bad(stats, display, lineno, "not a container log record (a JSON object with log or message)", out)
                continue
            buf = partial.setdefault(stream, _Partial())
            if not done:
                if not buf.add(text):
                    stats.corrupt += 1
                    stats.note(display, lineno, f"a partial line longer than {MAX_PARTIAL_BYTES} bytes, cut")
                out.blank()
                continue
            out.write(stream, buf.take(text))
    for stream, buf in partial.items():
        if buf.parts:
            out.write(stream, buf.take())


_BAD: Final = object()


def _loads(line: bytes) -> object:
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except ValueError:
        return _BAD


def _json_record(obj: object) -> tuple[bytes | None, str, bool]:
    """(text, stream, complete) of one record; text None when it is not one."""
    if not isinstance(obj, dict):
        return None, "", True
    if "log" not in obj and (line := vllm_json_line(obj)) is not None:
        return line.encode("utf-8", errors="replace"), "", True
    raw = obj.get("log")
    if not isinstance(raw, str):
        raw = obj.get("message")
    if not isinstance(raw, str):
        return None, "", True
    k8s = obj.get("kubernetes")
    stream = ""
    if isinstance(k8s, dict):
        pod, container = k8s.get("pod_name"), k8s.get("container_name")
        if isinstance(pod, str) and isinstance(container, str):
            stream = f"{pod}/{container}"
    # Docker's json-file ends a complete line with "\n"; fluent-bit's CRI parser says so with logtag.
    tag = obj.get("logtag")
    if tag == "P":
        done = False
    elif tag == "F" or ("message" in obj and "log" not in obj):
        done = True
    else:
        done = raw.endswith("\n") or "time" not in obj or "stream" not in obj
    text = raw[:-1] if raw.endswith("\n") else raw
    return text.encode("utf-8", errors="replace"), stream, done


def _unwrap_kubectl(path: str, display: str, wrapper: Wrapper, out: _Writers, stats: LineStats) -> None:
    for chunk in _lines(path, display):
        n = chunk.count(b"\n")
        stats.lines += n
        if not wrapper.prefix:
            bare, hits = _TIMESTAMP_SUB.subn(b"", chunk)
            if hits == n:
                out.write_block("", bare, n)
                continue
        for line in chunk.splitlines():
            lineno = out.total + 1
            stream = ""
            if wrapper.prefix:
                m = PREFIX_RE.match(line)
                if m is None:
                    _bad(stats, display, lineno, "no kubectl --prefix ([pod/<pod>/<container>])", out)
                    continue
                stream = f"{m.group(1).decode('utf-8', 'replace')}/{m.group(2).decode('utf-8', 'replace')}"
                line = line[m.end():]
            if wrapper.timestamps:
                m = TIMESTAMP_RE.match(line)
                if m is None:
                    _bad(stats, display, lineno, "no kubectl --timestamps time (RFC 3339) before the line", out)
                    continue
                line = line[m.end():]
            out.write(stream, line)
