"""The real-vLLM engine's scratch folder (its process group's rendezvous file) goes when the engine stops.

Each engine start left a ``kvdiag-vllm-<role>-*`` folder behind in the system's temp folder. The engine itself is
stood in for here (the real one takes a minute to start; the real-vLLM tests start it); what runs is the server's
own start and stop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvdiag.sim.vllm_backend import api_server
from kvdiag.sim.vllm_backend.options import parse_args


class _Engine:
    side_channel_port = 0


class _Backend:
    made: list[Path] = []

    def __init__(self, opts: Any, work: Path) -> None:
        assert work.is_dir()
        (work / "rendezvous").write_text("", encoding="utf-8")  # (what the process group writes there)
        _Backend.made.append(work)
        self.engine = _Engine()
        self.engine_id = "e"

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def log_stats(self) -> None:
        await asyncio.Event().wait()

    def close(self) -> None:
        pass


class _Runner:
    async def cleanup(self) -> None:
        pass


async def _listen(app: Any, host: str, port: int) -> tuple[_Runner, int]:
    return _Runner(), 1


async def _stopped() -> None:
    await asyncio.sleep(0)


@pytest.mark.parametrize("fails", [False, True])
def test_the_scratch_folder_goes_when_the_engine_stops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         fails: bool) -> None:
    monkeypatch.setattr(api_server, "VllmBackend", _Backend)
    monkeypatch.setattr(api_server, "make_app", lambda backend: None)
    monkeypatch.setattr(api_server.api, "listen", _listen)
    monkeypatch.setattr(api_server, "wait_for_stop_signal", _stopped)
    if fails:  # (an engine that fails to start leaves nothing either)
        async def refused(app: Any, host: str, port: int) -> tuple[_Runner, int]:
            raise OSError("address in use")
        monkeypatch.setattr(api_server.api, "listen", refused)
    monkeypatch.setattr(api_server.tempfile, "tempdir", str(tmp_path))
    _Backend.made.clear()
    opts = parse_args(["prefill", "--port", "0"])
    if fails:
        with pytest.raises(OSError):
            asyncio.run(api_server.serve(opts))
    else:
        asyncio.run(api_server.serve(opts))
    assert len(_Backend.made) == 1 and _Backend.made[0].parent == tmp_path
    assert not _Backend.made[0].exists()
    assert not list(tmp_path.glob("kvdiag-vllm-*"))
