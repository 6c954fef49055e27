"""Internal: byte-level prefilter: pull the lines that contain given needles out of big files without parsing the rest.

``bytes.find`` and a compiled regex with a literal prefix both run at C speed, so finding one
conversation's lines in a gigabyte costs about what ``grep -F`` costs; only those lines get parsed.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from kvdiag.diagnostics.detect import LogReadError, open_binary

CHUNK_BYTES: Final = 8 * 1024 * 1024
ProgressFn = Callable[[int], None]  # bytes read since the last call


def _chunks(path: str, progress: ProgressFn | None) -> Iterator[bytes]:
    """Yield chunks that end on a line boundary (the last one may not)."""
    try:
        with open_binary(path) as fh:
            tail = b""
            while True:
                block = fh.read(CHUNK_BYTES)
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
    except (OSError, EOFError) as exc:
        raise LogReadError(f"cannot read {path}: {exc}") from None


def grep_lines(path: str, needles: Sequence[bytes], progress: ProgressFn | None = None
               ) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, line) for every line containing any needle, in file order.

    Uses the system's ``grep -F`` (a multi-needle string matcher) for plain files when present;
    Python's ``re`` alternation is several times slower for many needles without a common prefix.
    """
    needles = sorted({n for n in needles if n and b"\n" not in n}, key=len, reverse=True)
    if not needles:
        return
    if GREP is not None and not path.endswith(".gz"):
        yield from _grep_fixed(path, needles, progress)
        return
    pattern = re.compile(b"|".join(re.escape(n) for n in needles))
    yield from grep_regex(path, pattern, progress)


GREP: Final = shutil.which("grep")


def _grep_fixed(path: str, needles: Sequence[bytes], progress: ProgressFn | None) -> Iterator[tuple[int, bytes]]:
    # Needles go through a file (-f) so no id is ever parsed as an option or hits ARG_MAX.
    with tempfile.NamedTemporaryFile("wb", prefix="kvdiag-needles-", suffix=".txt") as nf:
        nf.write(b"\n".join(needles) + b"\n")
        nf.flush()
        yield from _system_grep(path, ["-F", "-f", nf.name], progress)


def _system_grep(path: str, pattern_args: list[str], progress: ProgressFn | None) -> Iterator[tuple[int, bytes]]:
    env = {**os.environ, "LC_ALL": "C"}
    try:
        proc = subprocess.Popen([str(GREP), "-n", "-a", *pattern_args, "--", path],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc}") from None
    assert proc.stdout is not None and proc.stderr is not None
    read = False
    try:
        with proc.stdout, proc.stderr:
            for out in proc.stdout:
                num, _, line = out.partition(b":")
                yield int(num), line
            err = proc.stderr.read()
        read = True
    finally:
        # (only a consumer that stopped early, or failed, kills grep: one that read both pipes to their end
        # waits for grep's exit status, which a kill would turn from an error into "no line matched")
        if not read and proc.poll() is None:
            proc.kill()  # never leave grep behind
        code = proc.wait()
    if progress is not None:
        try:
            progress(os.path.getsize(path))
        except OSError:
            pass
    if code > 1:  # 1 means "no line matched"
        raise LogReadError(f"cannot read {path}: {err.decode(errors='replace').strip() or f'grep exit {code}'}")


def grep_prefixed(path: str, prefix: bytes | Sequence[bytes], needles: Sequence[bytes],
                  progress: ProgressFn | None = None, suffix: bytes = b"", also: Sequence[bytes] = ()
                  ) -> Iterator[tuple[int, bytes]]:
    """Lines containing a ``prefix`` + one of ``needles`` + ``suffix`` (e.g. ``cmpl-`` + request ids), or
    one of the fixed strings ``also``; ``prefix`` may be several alternatives.

    With a literal around the alternatives, GNU grep's (and Python's) matcher skips to candidates at
    memchr speed, where a plain multi-needle search (``grep -F -f``) is several times slower; grep's
    PCRE matcher (``-P``, where grep has it) is faster still: it searches the whole buffer, not each line.
    """
    prefixes = [prefix] if isinstance(prefix, bytes) else list(prefix)
    needles = sorted({n for n in needles if n}, key=len, reverse=True)
    if not needles:
        return grep_lines(path, also, progress) if also else iter(())
    if GREP is not None and not path.endswith(".gz") and all(_SAFE_RE.fullmatch(n) for n in needles):
        alternatives = b"|".join(n.replace(b".", b"\\.") for n in needles)
        if has_pcre():
            pcre = (b"(?:" + b"|".join(re.escape(p) for p in prefixes) + b")(?:" + alternatives + b")"
                    + re.escape(suffix) + b"".join(b"|" + re.escape(a) for a in also))
            try:
                return iter(list(_system_grep(path, ["-P", "-e", pcre.decode("latin-1")], progress)))
            except LogReadError:
                pass  # (a line PCRE's limits refuse): the POSIX matcher reads the file
        ere = (b"(" + b"|".join(_ere_escape(p) for p in prefixes) + b")(" + alternatives + b")"
               + _ere_escape(suffix))
        extra = [arg for a in also for arg in ("-e", _ere_escape(a).decode("latin-1"))]
        return _system_grep(path, ["-E", "-e", ere.decode("latin-1"), *extra], progress)
    pattern = re.compile(b"(?:" + b"|".join(re.escape(p) for p in prefixes) + b")(?:"
                         + b"|".join(re.escape(n) for n in needles) + b")" + re.escape(suffix)
                         + b"".join(b"|" + re.escape(a) for a in also))
    return grep_regex(path, pattern, progress)


@functools.cache
def has_pcre() -> bool:
    """True when the system's grep has ``-P`` (GNU grep built with PCRE)."""
    if GREP is None:
        return False
    try:
        done = subprocess.run([str(GREP), "-P", "-e", "x", "--", os.devnull], capture_output=True, check=False,
                              env={**os.environ, "LC_ALL": "C"})
    except OSError:
        return False
    return done.returncode in (0, 1)


def grep_ere(path: str, ere: str, progress: ProgressFn | None = None) -> Iterator[tuple[int, bytes]]:
    """Lines matching a POSIX extended regex that Python's ``re`` reads the same way (no back-references)."""
    if GREP is not None and not path.endswith(".gz"):
        return _system_grep(path, ["-E", "-e", ere], progress)
    return grep_regex(path, re.compile(ere.encode("utf-8"), re.MULTILINE), progress)


def grep_ere_to_file(path: str, ere: str, out: str, progress: ProgressFn | None = None,
                     also: Sequence[str] = (), pcre: str | None = None) -> None:
    """``grep -n`` of a POSIX extended regex (or any of the fixed strings ``also``) into the file ``out``
    ("N:line" per matching line), so the kept lines never pass through Python; raises LogReadError. ``pcre``: a
    Perl pattern for the same lines, which grep -P runs instead when there is no ``also`` (PCRE skips ahead to the
    pattern's first character; strings beside it would give several first characters to try instead)."""
    if GREP is None:
        raise LogReadError(f"cannot read {path}: grep is not on PATH")
    done = False
    if pcre is not None and not also and has_pcre():
        try:
            _grep_to_file(path, ["-P", "-e", pcre], out)
            done = True
        except LogReadError:
            pass  # (a line PCRE's limits refuse): the POSIX matcher reads the file
    if not done:
        _grep_to_file(path, ["-E", *(arg for s in (ere, *(_ere_escape(a.encode()).decode() for a in also))
                                     for arg in ("-e", s))], out)
    if progress is not None:
        try:
            progress(os.path.getsize(path))
        except OSError:
            pass


def _grep_to_file(path: str, pattern_args: list[str], out: str) -> None:
    try:
        with open(out, "wb") as fh:
            done = subprocess.run([str(GREP), "-n", "-a", *pattern_args, "--", path], stdout=fh,
                                  stderr=subprocess.PIPE, env={**os.environ, "LC_ALL": "C"}, check=False)
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    if done.returncode > 1:  # 1 means "no line matched"
        err = done.stderr.decode(errors="replace").strip()
        raise LogReadError(f"cannot read {path}: {err or f'grep exit {done.returncode}'}")


def head_lines(path: str, keywords: Sequence[bytes], limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the lines in the first ``limit`` bytes containing a keyword.

    Numbered by ``\n`` only, as grep numbers them (a lone ``\r`` continues a vLLM record); the file's
    last line counts even without a newline, a line the limit cuts does not.
    """
    try:
        with open_binary(path) as fh:
            head = fh.read(limit)
    except (OSError, EOFError) as exc:
        raise LogReadError(f"cannot read {path}: {exc}") from None
    body = head if len(head) < limit else head[:head.rfind(b"\n") + 1]
    if any(not k or b"\n" in k for k in keywords):  # (such a keyword is in every line, or in none)
        yield from _head_lines_split(body, keywords)
        return
    starts: set[int] = set()  # where each line holding a keyword starts (bytes.find, not a split into lines)
    for k in keywords:
        at = body.find(k)
        while at >= 0:
            starts.add(body.rfind(b"\n", 0, at) + 1)
            end = body.find(b"\n", at)
            at = body.find(k, end + 1) if end >= 0 else -1
    lineno, counted = 1, 0
    for start in sorted(starts):
        lineno += body.count(b"\n", counted, start)
        counted = start
        end = body.find(b"\n", start)
        yield lineno, body[start:end + 1] if end >= 0 else body[start:]


def _head_lines_split(body: bytes, keywords: Sequence[bytes]) -> Iterator[tuple[int, bytes]]:
    lines = [ln + b"\n" for ln in body.split(b"\n")]
    tail = lines.pop()[:-1]
    if tail:
        lines.append(tail)
    for lineno, line in enumerate(lines, start=1):
        if any(k in line for k in keywords):
            yield lineno, line


def _ere_escape(literal: bytes) -> bytes:
    return re.sub(rb"([.\[\]()*+?{}|^$\\])", rb"\\\1", literal)


_SAFE_RE: Final = re.compile(rb"[A-Za-z0-9._:-]+")  # ids that need no escaping beyond "."


def grep_regex(path: str, pattern: re.Pattern[bytes], progress: ProgressFn | None = None
               ) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, line) for every line where ``pattern`` matches, in file order."""
    if not path.endswith(".gz"):
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
        if size > 0:
            yield from _grep_mmap(path, pattern)
            if progress is not None:
                progress(size)
            return
    yield from _grep_chunks(path, pattern, progress)


def _count_newlines(mm: mmap.mmap, start: int, end: int) -> int:
    n = 0
    for lo in range(start, end, CHUNK_BYTES):
        n += mm[lo:min(end, lo + CHUNK_BYTES)].count(b"\n")
    return n


def _grep_mmap(path: str, pattern: re.Pattern[bytes]) -> Iterator[tuple[int, bytes]]:
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    with fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        lineno, counted = 1, 0  # newlines before ``counted`` are in lineno
        for m in pattern.finditer(mm):
            if m.start() < counted:
                continue  # another match on a line already yielded
            start = mm.rfind(b"\n", 0, m.start()) + 1
            lineno += _count_newlines(mm, counted, start)
            end = mm.find(b"\n", m.end())
            end = len(mm) if end < 0 else end + 1
            yield lineno, mm[start:end]
            lineno += 1
            counted = end


def _grep_chunks(path: str, pattern: re.Pattern[bytes], progress: ProgressFn | None
                 ) -> Iterator[tuple[int, bytes]]:
    lineno = 1
    for chunk in _chunks(path, progress):
        pos = 0  # position up to which newlines were counted
        for m in pattern.finditer(chunk):
            if m.start() < pos:
                continue
            start = chunk.rfind(b"\n", 0, m.start()) + 1
            lineno += chunk.count(b"\n", pos, start)
            end = chunk.find(b"\n", m.end())
            end = len(chunk) if end < 0 else end + 1
            yield lineno, chunk[start:end]
            lineno += 1
            pos = end
        lineno += chunk.count(b"\n", pos)


def is_json_document(path: str) -> bool:
    """True for a client-statistics file that is one JSON document (an array), not JSON lines."""
    with open_binary(path) as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def read_all_lines(path: str, progress: ProgressFn | None = None) -> Iterator[tuple[int, bytes]]:
    """Every line with its number (the no-prefilter path)."""
    lineno = 1
    for chunk in _chunks(path, progress):
        for line in chunk.splitlines(keepends=True):
            yield lineno, line
            lineno += 1
