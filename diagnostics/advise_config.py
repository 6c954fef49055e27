"""What the logs say about the deployment's configuration: TTLs, threshold, bidirectional, failure policy.

A cheap line scan (substring test before any regex or JSON parse) over the same files explain
reads. Stock vLLM logs give the startup line (threshold and decode TTL, verbatim format in
docs/vllm-reference.md) and the KV-load-failure lines; the proxy log gives the router TTL on stale entries;
kvdiag events give ``ttl_s`` and ``engine_start`` attrs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from kvdiag.diagnostics.detect import detect, expand_paths, open_binary, role_hint
from kvdiag.diagnostics.json_logs import array_elements
from kvdiag.diagnostics.scan import grep_ere, grep_regex, is_events_document
from kvdiag.diagnostics.sources import StagedInputs

Role = Literal["prefill", "decode", "router", "client", "unknown"]

STARTUP_RE: Final = re.compile(
    r"Bidirectional KV transfer is enabled and the kv recompute threshold is set to (\d+) tokens"
    r"(?:\.\s*KV blocks on D are released after a TTL of (\d+(?:\.\d+)?) seconds)?")
HOLD_RE: Final = re.compile(r"request_finished\(([^)]*)\) waiting for (\d+) seconds before releasing blocks")
FAIL_POLICY_RE: Final = re.compile(r"due to KV load failure \(failure_policy=(\w+)")
STALE_RE: Final = re.compile(r"stale cache entry \(age=[\d.]+s > ttl=([\d.]+)s\)")
CONFIG_CACHE_VERSION: Final = 1
_TTL_FIELD: Final = re.compile(rb'"ttl_s"')
# the substrings a configuration line contains (STARTUP_RE, HOLD_RE, FAIL_POLICY_RE and recovery, STALE_RE, hang)
MARKERS: Final = ("Bidirectional KV transfer is enabled", "before releasing blocks", "KV load failure",
                  "stale cache entry", "WAITING_FOR_REMOTE_KVS")


@dataclass
class ConfigFact:
    """One configuration value and the log line it was read from."""

    value: Any
    source: str


@dataclass
class DeploymentConfig:
    """Configuration facts found in the logs (None: not found)."""

    decoder_ttl: ConfigFact | None = None
    router_ttl: ConfigFact | None = None
    recompute_threshold: ConfigFact | None = None
    bidirectional_prefill: ConfigFact | None = None
    bidirectional_decode: ConfigFact | None = None
    failure_policy: ConfigFact | None = None
    recompute_hang: ConfigFact | None = None
    files: dict[str, str] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON form (the cache stores it next to the turn table)."""
        return asdict(self)

    @classmethod
    def from_json_dict(cls, obj: dict[str, Any]) -> DeploymentConfig:
        """Inverse of :meth:`to_json_dict`."""
        facts = {k: ConfigFact(**v) if isinstance(v, dict) else None for k, v in obj.items() if k != "files"}
        return cls(**facts, files=dict(obj.get("files", {})))


def guess_role(path: Path) -> Role:
    """The log's role from its file name (prefill.log, decode-events.jsonl, proxy.log, client-stats.json)."""
    name = path.name.lower()
    for role, keys in (("prefill", ("prefill",)), ("decode", ("decode",)), ("router", ("router", "proxy")),
                       ("client", ("client", "workload", "stats"))):
        if any(k in name for k in keys):
            return role  # type: ignore[return-value]
    hint = role_hint(str(path))  # explain's rule: p0.log / d1.log and the like
    return hint if hint in ("prefill", "decode") else "unknown"  # type: ignore[return-value]


def _lines(path: Path, needles: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    # Byte-level prefilter at C speed; only matching lines are decoded and parsed. (grep -E's alternation of
    # the literals finds the lines grep -F -f finds, a fifth faster: 0.066 against 0.083 s on a 60 MB proxy log)
    ere = "|".join(re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", n) for n in needles)
    for lineno, raw in grep_ere(str(path), ere):
        yield lineno, raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _set(cfg: DeploymentConfig, name: str, value: Any, source: str) -> None:
    if getattr(cfg, name) is None:
        setattr(cfg, name, ConfigFact(value, source))


def _from_event(cfg: DeploymentConfig, obj: dict[str, Any], role: Role, where: str) -> None:
    source = obj.get("source") if isinstance(obj.get("source"), str) else role
    raw_attrs = obj.get("attrs")
    attrs: dict[str, Any] = raw_attrs if isinstance(raw_attrs, dict) else {}
    ttl = obj.get("ttl_s")
    if source == "router" and isinstance(ttl, int | float):
        _set(cfg, "router_ttl", float(ttl), where)
    if source == "decode" and isinstance(ttl, int | float):
        _set(cfg, "decoder_ttl", float(ttl), where)
    if obj.get("event") != "engine_start":
        return
    for key, target in (("decoder_kv_blocks_ttl", "decoder_ttl"), ("kv_recompute_threshold", "recompute_threshold"),
                        ("kv_load_failure_policy", "failure_policy")):
        if key in attrs and (key != "decoder_kv_blocks_ttl" or source == "decode"):
            _set(cfg, target, attrs[key], where)
    if "bidirectional_kv_xfer" in attrs and source in ("prefill", "decode"):
        _set(cfg, f"bidirectional_{source}", bool(attrs["bidirectional_kv_xfer"]), where)


Effect = tuple[Any, ...]  # what one line says: ("startup", threshold, ttl), ("hold", ttl), ("policy", name), ...


def _effect(line: str, role: Role) -> Effect | None:
    """What a marker line says about the configuration (each regex only where its marker is in the line)."""
    if MARKERS[0] in line and (m := STARTUP_RE.search(line)):
        return ("startup", int(m.group(1)), float(m.group(2)) if m.group(2) else None)
    if role == "decode" and MARKERS[1] in line and (m := HOLD_RE.search(line)):
        return ("hold", float(m.group(2)))
    if MARKERS[2] in line:
        if m := FAIL_POLICY_RE.search(line):
            return ("policy", m.group(1))
        if "Recovered from KV load failure" in line:
            return ("policy", "recompute")
    if MARKERS[4] in line:
        return ("hang",)
    if MARKERS[3] in line and (m := STALE_RE.search(line)):
        return ("stale", float(m.group(1)))
    return None


def line_effects(numbered: Iterable[tuple[int, str]], role: Role, present: Collection[str] | None = None
                 ) -> list[tuple[int, Effect]]:
    """(line number, effect) of the marker lines of one file that can still set a value: the first of each
    kind. A later line of a kind seen in the file only sets values that first one set (values are never
    overwritten), so dropping it changes nothing; only a startup line with the TTL after one without can
    add a value. A line whose every marker's kind was seen is not parsed at all. ``present``: the MARKERS
    the file holds, when known; once each one's kind is seen, no further line is read."""
    seen: set[object] = set()
    out: list[tuple[int, Effect]] = []
    pending = None if present is None else {kind for marker, kind in _MARKER_KINDS if marker in present}
    for lineno, line in numbered:
        if pending is not None and pending <= seen:
            break
        if all(kind in seen for marker, kind in _MARKER_KINDS if marker in line):
            continue  # (a line without a marker too: it says nothing)
        e = _effect(line, role)
        if e is None:
            continue
        kind = ("startup", e[2] is not None) if e[0] == "startup" else e[0]
        if kind not in seen:
            seen.add(kind)
            out.append((lineno, e))
    return out


# each marker with the kind of effect a line holding it can have (a startup line: at most the one with a TTL)
_MARKER_KINDS: Final = tuple(zip(MARKERS, (("startup", True), "hold", "policy", "stale", "hang"), strict=True))


def _apply(cfg: DeploymentConfig, e: Effect, role: Role, where: str) -> None:
    kind = e[0]
    if kind == "startup":
        if role in ("prefill", "decode"):
            _set(cfg, f"bidirectional_{role}", True, where)
        if role == "prefill" or cfg.recompute_threshold is None:
            _set(cfg, "recompute_threshold", e[1], where)
        if e[2] is not None and role in ("decode", "unknown"):
            _set(cfg, "decoder_ttl", e[2], where)
    elif kind == "hold":
        _set(cfg, "decoder_ttl", e[1], where)
    elif kind == "policy":
        _set(cfg, "failure_policy", e[1], where)
    elif kind == "hang":
        _set(cfg, "failure_policy", "recompute", where)
        _set(cfg, "recompute_hang", True, where)
    else:
        _set(cfg, "router_ttl", e[1], where)


# The marker lines' effects of vLLM and proxy logs the verdict engine just read (its grep keeps the vLLM logs'
# marker lines too; it reads the proxy log whole), by (path, size, mtime): scan_config takes them once instead
# of reading those logs again.
_ENGINE_EFFECTS: dict[tuple[str, int, int], list[tuple[int, Effect]]] = {}
_ENGINE_EFFECTS_MAX: Final = 64


def _identity(path: str) -> tuple[str, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_size, st.st_mtime_ns)


def remember_marker_lines(path: str, numbered: Iterable[tuple[int, str]], present: Collection[str] | None = None
                          ) -> None:
    """Record a vLLM or proxy log's marker lines (every line containing one of MARKERS, in order, numbered as
    grep numbers them, decoded with replacement characters, line end removed; ``present``: the markers among
    them, when known, so reading stops early) for the next scan_config of that file."""
    key = _identity(path)
    if key is None:
        return
    _ENGINE_EFFECTS.pop(key, None)
    _ENGINE_EFFECTS[key] = line_effects(numbered, guess_role(Path(path)), present)
    while len(_ENGINE_EFFECTS) > _ENGINE_EFFECTS_MAX:
        del _ENGINE_EFFECTS[next(iter(_ENGINE_EFFECTS))]


def _scan_events(cfg: DeploymentConfig, path: Path, role: Role, *, document: bool) -> None:
    if document:  # (one JSON array over many lines: its elements, at the lines they open on)
        with open_binary(str(path)) as fh:
            elements = array_elements(fh.read())
        if elements is not None:  # (as from lines: every engine_start, then the first event with ttl_s)
            objs = [(lineno, obj) for lineno, obj in elements if isinstance(obj, dict)]
            for lineno, obj in [*((n, o) for n, o in objs if o.get("event") == "engine_start"),
                                *[(n, o) for n, o in objs if "ttl_s" in o][:1]]:
                _from_event(cfg, obj, role, f"{path}:{lineno}")
            return
    for lineno, line in _lines(path, ('"engine_start"',)):
        _from_json(cfg, line, role, f"{path}:{lineno}")
    # Every router/decode event may carry ttl_s: the first one is enough. grep_regex (in-process)
    # stops cleanly when abandoned early.
    for lineno, raw in grep_regex(str(path), _TTL_FIELD):
        _from_json(cfg, raw.decode("utf-8", errors="replace"), role, f"{path}:{lineno}")
        break


def _from_json(cfg: DeploymentConfig, line: str, role: Role, where: str) -> None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # (not JSON; an integer past 4300 digits; deep nesting)
        return
    for item in obj if isinstance(obj, list) else [obj]:  # (a line may hold a batch of events)
        if isinstance(item, dict):
            _from_event(cfg, item, role, where)


def scan_config(paths: Sequence[str | Path]) -> DeploymentConfig:
    """Read the configuration facts out of ``paths`` (files, globs, folders); raises LogReadError."""
    cfg = DeploymentConfig()
    for f in detect([str(p) for p in paths]):
        path = Path(f.path)
        role = guess_role(path)
        cfg.files[f.path] = f"{f.fmt}/{role}"
        if f.fmt == "events":
            _scan_events(cfg, path, role, document=is_events_document(f))
        elif f.fmt in ("vllm", "proxy", "unknown"):
            key = _identity(f.path) if f.fmt in ("vllm", "proxy") else None
            effects = _ENGINE_EFFECTS.pop(key, None) if key is not None else None
            if effects is None:
                effects = line_effects(_lines(path, MARKERS), role)
            for lineno, e in effects:
                _apply(cfg, e, role, f"{path}:{lineno}")
    return cfg


def display_config(cfg: DeploymentConfig, display: Callable[[str], str]) -> DeploymentConfig:
    """``cfg`` with every file name and ``file:line`` source passed through ``display`` (staged inputs)."""
    def walk(obj: Any) -> Any:
        if isinstance(obj, str):
            return display(obj)
        if isinstance(obj, dict):
            return {display(k) if isinstance(k, str) else k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return DeploymentConfig.from_json_dict(walk(cfg.to_json_dict()))


def scan_config_cached(paths: Sequence[str | Path] | StagedInputs, cache_dir: Path | None) -> DeploymentConfig:
    """:func:`scan_config` through a JSON cache keyed like the turn table's (path, size, mtime).

    Staged inputs (kvdiag.diagnostics.sources) are keyed by the files as given, so a hit unwraps nothing;
    sources then name those files."""
    staged = paths if isinstance(paths, StagedInputs) else None
    if cache_dir is None:
        if staged is None:
            return scan_config(paths)  # type: ignore[arg-type]
        return display_config(scan_config(staged.paths), staged.display)
    from kvdiag.diagnostics.report_cache import cache_key  # noqa: PLC0415 - pandas, for the cached path only

    files = list(staged.identity) if staged is not None else expand_paths([str(p) for p in paths])  # type: ignore[union-attr]
    target = cache_dir / f"config-{cache_key(files, CONFIG_CACHE_VERSION)}.json"
    try:
        return DeploymentConfig.from_json_dict(json.loads(target.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass  # a miss or a torn file: scan again
    cfg = scan_config(files) if staged is None else display_config(scan_config(staged.paths), staged.display)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cfg.to_json_dict()), encoding="utf-8")
        tmp.replace(target)
    except OSError:
        pass  # the cache is an optimisation; the scan result stands
    return cfg
