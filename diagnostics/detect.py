"""Find log files (globs, folders, ``.gz``, rotated ``.1``) and sniff each one's format from its content."""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from kvdiag.diagnostics.proxy_log_parser import is_proxy_line
from kvdiag.diagnostics.vllm_log_parser import ANSI_RE, HEADER_RE
from kvdiag.schema.errors import KVDiagError

SNIFF_BYTES: Final = 64 * 1024
FORMATS: Final = ("events", "client_stats", "proxy", "vllm", "unknown")
_ROTATED_RE: Final = re.compile(r"^(?P<base>.*?)(?:\.(?P<n>\d+))?(?P<gz>\.gz)?$")


class LogReadError(KVDiagError, OSError):
    """A log file cannot be read; the message names it."""


@dataclass(frozen=True)
class LogFile:
    """One input file, its sniffed format and a role hint (prefill/decode) from its name."""

    path: str
    fmt: str
    role: str | None = None
    size: int = 0


def open_binary(path: str) -> IO[bytes]:
    """Open a log for reading bytes, transparently gunzipping ``.gz`` files."""
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")  # type: ignore[return-value]  # GzipFile is a binary IO
        return open(path, "rb")
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None


def whole_line_blocks(fh: IO[bytes], size: int, progress: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """Blocks of about ``size`` bytes read from ``fh``, each cut after its last newline; the file's last line
    comes last, without one if it has none. ``progress`` is told the bytes of each read."""
    tail = b""
    while True:
        block = fh.read(size)
        if progress is not None:
            progress(len(block))
        if not block:
            if tail:
                yield tail
            return
        block = tail + block
        cut = block.rfind(b"\n")
        if cut < 0:
            tail = block
            continue
        tail = block[cut + 1:]
        yield block[:cut + 1]


def _rotation_key(path: str) -> tuple[str, int]:
    m = _ROTATED_RE.match(os.path.basename(path))
    base, n = (m.group("base"), int(m.group("n") or 0)) if m else (path, 0)
    # Older rotations have higher numbers: read them first so in-file order stays chronological.
    return (os.path.join(os.path.dirname(path), base), -n)


@functools.lru_cache(maxsize=1024)
def rotation_base(path: str) -> str:
    """The log a rotated file belongs to (``prefill.log.2.gz`` -> ``prefill.log``, same folder)."""
    return _rotation_key(path)[0]


def expand_paths(paths: Iterable[str]) -> list[str]:
    """Expand globs and folders (recursively) into files; raise LogReadError naming a missing input."""
    out: list[str] = []
    for spec in paths:
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise LogReadError(f"no file matches {spec!r}")
        for match in matches:
            if os.path.isdir(match):
                out.extend(str(p) for p in sorted(Path(match).rglob("*")) if p.is_file())
            elif os.path.exists(match):
                out.append(match)
            else:
                raise LogReadError(f"cannot read {match}: no such file")
    unique = list(dict.fromkeys(out))
    return sorted(unique, key=_rotation_key)


def role_hint(path: str) -> str | None:
    """prefill/decode from the file name, if it says so."""
    name = os.path.basename(path).lower()
    if "prefill" in name or re.search(r"(^|[-_.])p\d*([-_.]|$)", name):
        return "prefill"
    if "decode" in name or re.search(r"(^|[-_.])d\d*([-_.]|$)", name):
        return "decode"
    return None


# the keys every TurnEvent has, which no other record's object does
_EVENT_KEYS: Final = ("v", "source", "event")


def sniff_format(head: bytes) -> str:
    """The format of a file from its first bytes: events, client_stats, proxy, vllm or unknown."""
    text = head.decode("utf-8", errors="replace")
    array = _json_array_kind(text)
    if array is not None:
        return array
    votes = dict.fromkeys(FORMATS, 0)
    for line in text.splitlines()[:50]:
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # (not JSON; an integer past 4300 digits; deep nesting)
                continue
            if isinstance(obj, dict) and set(_EVENT_KEYS) <= obj.keys():
                votes["events"] += 1
            elif isinstance(obj, dict) and "conversation_id" in obj:
                votes["client_stats"] += 1
        elif is_proxy_line(line):
            votes["proxy"] += 1
        elif HEADER_RE.match(ANSI_RE.sub("", line)):
            votes["vllm"] += 1
    best = max(FORMATS[:-1], key=lambda f: votes[f])
    return best if votes[best] else "unknown"


def _json_array_kind(text: str) -> str | None:
    """``events`` or ``client_stats`` when the text opens a JSON array of objects, by its first object (a batch
    of events written as one line, or ``--stats-json-output``); None when it opens no such array.

    A leading ``[`` alone proves nothing: console output starts with ``[transformers] ...`` too.
    """
    stripped = text.lstrip()
    if not stripped.startswith("["):
        return None
    body = stripped[1:].lstrip()
    if body.startswith("]"):
        return "client_stats"
    if not body.startswith("{"):
        return None
    try:
        first, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        # an element longer than the sniffed head is cut: a quoted key still says JSON
        if re.match(r'\{\s*"', body) is None:
            return None
        return "events" if all(re.search(rf'"{k}"\s*:', body) for k in _EVENT_KEYS) else "client_stats"
    if not isinstance(first, dict):
        return None
    return "events" if set(_EVENT_KEYS) <= first.keys() else "client_stats"


def detect(paths: Iterable[str]) -> list[LogFile]:
    """Expand and sniff every input; raise LogReadError naming an unreadable file."""
    files: list[LogFile] = []
    for path in expand_paths(paths):
        try:
            size = os.path.getsize(path)
            with open_binary(path) as fh:
                head = fh.read(SNIFF_BYTES)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise LogReadError(f"cannot read {path}: {_why(exc)}") from None
        files.append(LogFile(path=path, fmt=sniff_format(head), role=role_hint(path), size=size))
    return files


def iter_lines(path: str) -> Iterator[bytes]:
    """Yield raw lines of a (possibly gzipped) file; raise LogReadError naming it on I/O failure."""
    try:
        with open_binary(path) as fh:
            yield from fh
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise LogReadError(f"cannot read {path}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    # A log copied mid-rotation ends early: say so rather than repeat zlib's wording alone.
    if isinstance(exc, (EOFError, gzip.BadGzipFile)):
        return f"truncated or corrupt gzip file ({exc}); re-copy it or decompress what is left with zcat"
    return str(exc)
