"""The inputs explain/report/advise read, made local and bare: object storage copied, container wrappers removed.

:func:`stage_inputs` takes what the user gave (files, folders, globs, ``s3://`` URLs) and yields
:class:`StagedInputs`: plain local files the parsers read as they read bare logs, in reading order.
A bare local file is used where it is (no copy, no cost beyond sniffing its first 64 KiB); a
wrapped one (container_logs: CRI, Docker/shipper JSON, kubectl prefixes) is unwrapped into a
temporary folder, one output line per input line, named so that the role (``prefill``/``decode``
in a pod or container name) and the rotation order (``.1``, ``.2.gz``, kubelet's
``0.log.<time>.gz``) carry over. :meth:`StagedInputs.display` turns any text naming a staged file
back into the name the user knows (the original path or ``s3://`` URL; line numbers are the same).
"""

from __future__ import annotations

import contextlib
import gzip
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from kvdiag.diagnostics.container_logs import Wrapper, sniff_wrapper, unwrap_file
from kvdiag.diagnostics.detect import SNIFF_BYTES, LogReadError, expand_paths, open_binary
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.object_store import is_object_url, mirror
from kvdiag.diagnostics.records import ConversationRecord

# kubelet: /var/log/pods/<namespace>_<pod>_<uid>/<container>/<restart>.log[.<YYYYMMDD-hhmmss>][.gz]
_POD_DIR_RE: Final = re.compile(r"^(?P<ns>[^_/]+)_(?P<pod>[^_/]+)_(?P<uid>[0-9a-fA-F-]{8,})$")
_KUBELET_ROTATED_RE: Final = re.compile(r"^(?P<base>.+\.log)\.(?P<ts>\d{8}-\d{6})(?:\.gz)?$")
_NUMBERED_RE: Final = re.compile(r"^(?P<base>.*?)(?:\.(?P<n>\d+))?(?:\.gz)?$")
_UNSAFE_RE: Final = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class StagedInputs:
    """Local bare files to read (``paths``), what identifies the inputs (``identity``: for cache keys),
    the user's name of every staged file, and the lines unwrapping skipped (``stats``)."""

    bare: list[str] = field(default_factory=list)
    identity: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # staged file -> the identity file it came from
    stats: LineStats = field(default_factory=LineStats)
    _pattern: re.Pattern[str] | None = None
    # wrapped inputs, unwrapped on first use of ``paths`` (a cached report never needs them)
    pending: list[Callable[[], None]] = field(default_factory=list)
    unwrapped: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        """Every local bare file to read (wrapped inputs are unwrapped now, once)."""
        while self.pending:
            self.pending.pop(0)()
        return [*self.bare, *self.unwrapped]

    @property
    def renamed(self) -> bool:
        """True when some file read is not the file the user gave (unwrapped or copied)."""
        return bool(self.names) or bool(self.pending)

    def display(self, text: str) -> str:
        """``text`` with every staged file's path replaced by the user's name for it."""
        if not self.names:
            return text
        if self._pattern is None:
            self._pattern = re.compile("|".join(re.escape(p) for p in sorted(self.names, key=len, reverse=True)))
        return self._pattern.sub(lambda m: self.names[m.group(0)], text)

    def display_records(self, convs: Iterable[ConversationRecord]) -> None:
        """Rewrite the evidence sources (and reasons) of ``convs`` in place to the user's names."""
        if not self.names:
            return
        for conv in convs:
            for t in conv.turns:
                t.evidence = [replace(e, source=self.display(e.source)) for e in t.evidence]
                t.reason = self.display(t.reason)

    def display_stats(self, stats: LineStats) -> None:
        """Rewrite the notes and unrecognised file names of ``stats`` in place."""
        if self.names:
            stats.notes[:] = [self.display(n) for n in stats.notes]
            stats.unrecognised_files[:] = [self.display(n) for n in stats.unrecognised_files]


def _head(path: str, display: str) -> bytes:
    try:
        with open_binary(path) as fh:
            return fh.read(SNIFF_BYTES)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        if isinstance(exc, (EOFError, gzip.BadGzipFile)):
            why = f"truncated or corrupt gzip file ({exc}); re-copy it or decompress what is left with zcat"
        else:
            why = exc.strerror or str(exc)
        raise LogReadError(f"cannot read {display}: {why}") from None


def _safe(name: str) -> str:
    return _UNSAFE_RE.sub("_", name).strip("._") or "log"


def _staged_name(path: str) -> tuple[str, str, int | str]:
    """(group, base name, rotation) of an input: files of one group are one log's rotations."""
    p = Path(path)
    name = p.name
    rotation: int | str = 0
    m = _KUBELET_ROTATED_RE.match(name)
    if m:
        name, rotation = m.group("base"), m.group("ts")
    else:
        n = _NUMBERED_RE.match(name)
        if n:
            name, rotation = n.group("base"), int(n.group("n") or 0)
    pod = _POD_DIR_RE.match(p.parent.parent.name) if len(p.parts) >= 3 else None
    if pod is not None:  # the pod and container names say the role; "0.log" alone does not
        name = f"{_safe(pod.group('pod'))}_{_safe(p.parent.name)}_{name}"
    return str(p.parent / name), name, rotation


def _rotation_numbers(members: list[tuple[str, int | str]]) -> dict[str, int]:
    """Rotation numbers that sort like detect's (older = higher); kubelet's times become numbers."""
    stamped = sorted({r for _, r in members if isinstance(r, str)}, reverse=True)  # newest first
    top = max([r for _, r in members if isinstance(r, int)] or [0])
    out: dict[str, int] = {}
    for path, r in members:
        out[path] = r if isinstance(r, int) else top + 1 + stamped.index(r)
    return out


@contextlib.contextmanager
def stage_inputs(specs: Sequence[str | Path], *, mirror_dir: Path | None = None) -> Iterator[StagedInputs]:
    """Make ``specs`` local and bare for the duration of the block; raise LogReadError naming a bad input.

    ``mirror_dir``: where ``s3://`` objects are kept between runs (default: a temporary folder).
    """
    work = Path(tempfile.mkdtemp(prefix="kvdiag-inputs-"))
    try:
        yield _stage([str(s) for s in specs], work, mirror_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stage(specs: list[str], work: Path, mirror_dir: Path | None) -> StagedInputs:
    staged = StagedInputs()
    local: list[str] = []
    remote: dict[str, str] = {}  # mirror copy -> URL
    plain = [s for s in specs if not is_object_url(s)]
    if plain:
        local = expand_paths(plain)
    for spec in specs:
        if is_object_url(spec):
            for obj in mirror(spec, mirror_dir or work / "s3"):
                remote[obj.local_path] = obj.url
    if remote:
        local = list(dict.fromkeys(local + expand_paths(list(remote))))
    staged.identity = list(local)
    wrapped: list[tuple[str, Wrapper]] = []
    for path in local:
        display = remote.get(path, path)
        wrapper = sniff_wrapper(_head(path, display))
        if wrapper is None:
            staged.bare.append(path)
            if path in remote:
                staged.names[path] = display
        else:
            wrapped.append((path, wrapper))
    if not wrapped:
        return staged
    groups: dict[str, list[tuple[str, int | str]]] = {}
    base_names: dict[str, tuple[str, str]] = {}
    for path, _ in wrapped:
        group, name, rotation = _staged_name(path)
        groups.setdefault(group, []).append((path, rotation))
        base_names[path] = (group, name)
    group_dirs = {g: work / "unwrapped" / f"{i:04d}" for i, g in enumerate(groups)}
    numbers = {p: n for members in groups.values() for p, n in _rotation_numbers(members).items()}
    for path, wrapper in wrapped:
        group, name = base_names[path]
        suffix = f".{numbers[path]}" if numbers[path] else ""
        folder = group_dirs[group]

        def make_path(stream: str, folder: Path = folder, name: str = name, suffix: str = suffix) -> str:
            # a stream's pod/container name says its role (prefill/decode) where the file's name may not
            stem = f"{_safe(stream.replace('/', '_'))}_{name}" if stream else name
            return str(folder / f"{stem}{suffix}")

        def unwrap(path: str = path, wrapper: Wrapper = wrapper, make_path: Callable[[str], str] = make_path) -> None:
            display = remote.get(path, path)
            result = unwrap_file(path, wrapper, make_path, display)
            staged.stats.merge(result.stats)
            for f in result.files:
                staged.unwrapped.append(f.path)
                staged.names[f.path] = display
                staged.origin[f.path] = path

        staged.pending.append(unwrap)
    return staged


def staged_or_given(paths: Sequence[str | Path] | StagedInputs) -> StagedInputs | None:
    """The StagedInputs passed in, or None for plain paths (the caller stages them)."""
    return paths if isinstance(paths, StagedInputs) else None


__all__ = ["StagedInputs", "stage_inputs", "staged_or_given"]
