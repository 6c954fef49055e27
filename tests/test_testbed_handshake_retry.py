"""The real-vLLM testbed runs a scenario again only when vLLM itself logged a failed NIXL handshake (or its side
channel could not listen: another process took the port)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_harness.testbed import (
    HANDSHAKE_FAILED,
    LISTENER_THREAD,
    attempt_dirs,
    handshake_failed,
    run_retrying_handshake,
)

# a line as vLLM's NIXL worker writes it when the peer's side channel misses its 5 s answer
TIMED_OUT = ("ERROR 12-01 20:28:26 [base_worker.py:1375] NIXL transfer failure: handshake_setup_failed | "
             "Context: {'failure_type': 'handshake_setup_failed', 'request_id': None, 'engine_id': 'e0'}\n"
             "Traceback (most recent call last):\nzmq.error.Again: Resource temporarily unavailable\n")


@pytest.mark.vllm  # (reads the installed vLLM's source: `make test-fast` runs without the vLLM environment)
def test_the_failure_type_is_the_one_installed_vllm_logs() -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.fail("vLLM is not installed: run `make vllm-env`")
    nixl = Path(spec.origin).parent / "distributed/kv_transfer/kv_connector/v1/nixl"
    assert f'failure_type="{HANDSHAKE_FAILED}"' in (nixl / "base_worker.py").read_text()
    # (the side channel's listener thread, whose death Python reports as "Exception in thread <name>:")
    assert f'name="{LISTENER_THREAD.rsplit(" ", 1)[1]}"' in (nixl / "base_scheduler.py").read_text()


# D's log when another process took its side channel's port (a CI run on a shared machine)
PORT_TAKEN_LOG = ("Exception in thread nixl_handshake_listener:\nTraceback (most recent call last):\n"
                  "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:28447')\n")


def _failing_once(first_log: str, failure: Exception) -> tuple[Callable[[Path], None], list[Path]]:
    """A scenario whose first attempt writes ``first_log`` into D's log and raises ``failure``; the directories
    it ran in."""
    seen: list[Path] = []

    def run(d: Path) -> None:
        seen.append(d)
        if len(seen) == 1:
            (d / "decode.log").write_text("INFO started\n" + first_log)
            raise failure
        (d / "decode.log").write_text("INFO started\n")

    return run, seen


def test_a_side_channel_whose_port_was_taken_is_run_again(tmp_path: Path) -> None:
    run, seen = _failing_once(PORT_TAKEN_LOG, RuntimeError("decode wrote no ready file within 120 s"))
    assert run_retrying_handshake(attempt_dirs(tmp_path), run) == seen[1]
    # negative control: a port taken elsewhere in the log (no listener died) is some other failure
    other = tmp_path / "other"
    other.mkdir()
    (other / "decode.log").write_text("ERROR OSError: [Errno 98] Address already in use\n")
    assert not handshake_failed(other)


def test_a_handshake_timeout_is_run_again_in_a_fresh_directory(tmp_path: Path) -> None:
    run, seen = _failing_once(TIMED_OUT, AssertionError({"ok": 2, "error": 1}))
    got = run_retrying_handshake(attempt_dirs(tmp_path), run)
    assert got == seen[1] != seen[0]
    assert handshake_failed(seen[0]) and not handshake_failed(got)


def test_any_other_failure_is_not_retried(tmp_path: Path) -> None:
    calls = []

    def run(d: Path) -> None:
        calls.append(d)
        (d / "prefill.log").write_text("ERROR something else broke\n")
        raise AssertionError({"ok": 2, "error": 1})

    with pytest.raises(AssertionError):
        run_retrying_handshake(attempt_dirs(tmp_path), run)
    assert len(calls) == 1


def test_the_last_attempt_failure_propagates(tmp_path: Path) -> None:
    calls = []

    def run(d: Path) -> None:
        calls.append(d)
        (d / "prefill.log").write_text(TIMED_OUT)
        raise AssertionError("still failing")

    with pytest.raises(AssertionError, match="still failing"):
        run_retrying_handshake(attempt_dirs(tmp_path), run, attempts=2)
    assert len(calls) == 2


def test_a_first_success_runs_once(tmp_path: Path) -> None:
    calls = []
    got = run_retrying_handshake(attempt_dirs(tmp_path), calls.append)
    assert calls == [got]


def test_a_run_that_came_back_despite_a_timeout_is_run_again(tmp_path: Path) -> None:
    # vLLM recomputes or fails the turn whose handshake timed out, and the workload may still return 200s:
    # the run's records then hold a turn the test never planned
    seen: list[Path] = []

    def run(d: Path) -> None:
        seen.append(d)
        (d / "prefill.log").write_text("INFO started\n" + (TIMED_OUT if len(seen) == 1 else ""))

    got = run_retrying_handshake(attempt_dirs(tmp_path), run)
    assert got == seen[1] != seen[0] and not handshake_failed(got)


def test_the_last_attempt_is_returned_for_the_test_to_judge(tmp_path: Path) -> None:
    seen: list[Path] = []

    def run(d: Path) -> None:
        seen.append(d)
        (d / "decode.log").write_text(TIMED_OUT)

    got = run_retrying_handshake(attempt_dirs(tmp_path), run, attempts=3)
    assert len(seen) == 3 and got == seen[-1] and handshake_failed(got)
