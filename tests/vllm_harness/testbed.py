"""Real-vLLM testbed for tests: P and D as ``kvdiag sim <role> --engine vllm`` plus ``kvdiag router``.

Built on the demo's process handling (kvdiag.demo.processes.Component): each component runs in
its own process group, announces itself through its ready file and is stopped group-wide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvdiag.demo.processes import Component

ENGINE_READY_TIMEOUT_S = 120.0  # vLLM's imports alone take ~10 s on a loaded 2-core machine
ROUTER_READY_TIMEOUT_S = 30.0
# vLLM's NIXL worker gives the peer's side channel a fixed 5 s to answer its handshake (zmq RCVTIMEO) and
# logs this failure type when it does not: a loaded 2-core machine sometimes misses it, before kvdiag runs.
HANDSHAKE_FAILED = "handshake_setup_failed"
# The side channel's port is probed free before vLLM binds it, seconds later; on a shared machine another
# process may bind it first. vLLM's listener thread then dies and the engine never gets ready.
LISTENER_THREAD = "Exception in thread nixl_handshake_listener"
PORT_TAKEN = "Address already in use"
HANDSHAKE_ATTEMPTS = 3


@dataclass
class Testbed:
    """The running components; their logs and events are in ``dir``."""

    dir: Path
    prefill: Component
    decode: Component
    router: Component


@contextmanager
def real_vllm_testbed(tmp: Path, *, p_flags: Sequence[str] = (), d_flags: Sequence[str] = (),
                      router_flags: Sequence[str] = (), console_suffix: str = ".console.log") -> Iterator[Testbed]:
    """Start P, D (prefix caching off, events and vLLM logs in ``tmp``) and the router; stop all on exit.

    ``console_suffix`` names the processes' stdout files, so a test that hands ``tmp`` to explain can
    keep them out of its inputs.
    """
    started: list[Component] = []
    try:
        engines = []
        for role, flags in (("prefill", p_flags), ("decode", d_flags)):
            comp = Component.launch(
                role, ["sim", role, "--engine", "vllm", "--no-prefix-caching", *flags,
                       "--events-file", str(tmp / f"{role}-events.jsonl"), "--log-file", str(tmp / f"{role}.log")],
                tmp, console_name=role + console_suffix)
            started.append(comp)
            engines.append(comp)
        for comp in engines:
            comp.wait_ready(ENGINE_READY_TIMEOUT_S)
        p, d = engines
        router = Component.start(
            "router", ["router", "--host", "127.0.0.1", "--port", "0", "--prefiller-hosts", "127.0.0.1",
                       "--prefiller-ports", str(p.port), "--decoder-hosts", "127.0.0.1", "--decoder-ports",
                       str(d.port), "--events-file", str(tmp / "router-events.jsonl"), *router_flags],
            tmp, ready_timeout=ROUTER_READY_TIMEOUT_S, console_name="router" + console_suffix)
        started.append(router)
        yield Testbed(tmp, p, d, router)
    finally:
        failures: list[Exception] = []
        for comp in reversed(started):
            try:
                comp.stop()
            except Exception as exc:  # stop the others first, then report
                failures.append(exc)
        if failures:
            raise failures[0]


def handshake_failed(tmp: Path) -> bool:
    """Whether P's or D's vLLM log in ``tmp`` records a failed NIXL handshake, or a side channel that could not
    listen because its port was taken."""
    for role in ("prefill", "decode"):
        log = tmp / f"{role}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if HANDSHAKE_FAILED in text or (LISTENER_THREAD in text and PORT_TAKEN in text):
            return True
    return False


def attempt_dirs(parent: Path) -> Callable[[], Path]:
    """New empty folders ``parent/attempt-1``, ``attempt-2``, ...: one per call (for run_retrying_handshake)."""
    count = itertools.count(1)

    def new_dir() -> Path:
        path = parent / f"attempt-{next(count)}"
        path.mkdir()
        return path
    return new_dir


def run_retrying_handshake(new_dir: Callable[[], Path], run: Callable[[Path], None],
                           attempts: int = HANDSHAKE_ATTEMPTS) -> Path:
    """``run`` a testbed scenario in a fresh ``new_dir()``; return that directory.

    A run whose P or D logged vLLM's own handshake timeout (or a side channel whose port another process took)
    is not the scenario the test planned, whether it failed or came back with a recomputed or failed turn in its
    records: it is run again, in a new directory (a partial run's lines must not mix with the next). Any other
    failure propagates; so does the last attempt's, and the last attempt's directory is returned for the test
    to judge.
    """
    for attempt in range(1, attempts + 1):
        tmp = new_dir()
        last = attempt == attempts
        try:
            run(tmp)
        except Exception:
            if last or not handshake_failed(tmp):
                raise
            continue
        if last or not handshake_failed(tmp):
            return tmp
    raise ValueError("attempts must be at least 1")
