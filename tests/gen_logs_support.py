"""benchmarks/gen_logs.py loaded as a module, for tests that need its mixed (stock + instrumented) log sets."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gen_logs.py"


def load_gen_logs() -> ModuleType:
    """The benchmark's generator module (``generate(out, size, seed=..., noise_per_turn=...)``)."""
    spec = importlib.util.spec_from_file_location("gen_logs", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the generator's kvdiag event files: without them a set is what an unmodified deployment leaves
EVENT_FILES = ("client.jsonl", "router-events.jsonl", "prefill-events.jsonl")


def stock_only(out: Path) -> None:
    """Remove a generated set's event files, leaving its stock logs."""
    for name in EVENT_FILES:
        (out / name).unlink()
