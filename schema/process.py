"""The contract between a kvdiag server process and whoever starts it (the demo, tests, an operator).

Once listening, a server writes a JSON *ready file* (at least ``port`` and ``pid``) atomically; it
stops on SIGTERM or SIGINT. Shared by the emulated engines, the router and the real-vLLM backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any


def write_ready_file(path: str | Path, info: dict[str, Any]) -> None:
    """Write ``info`` plus this process's pid to ``path`` atomically (readers never see half a file)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(target)


async def wait_for_stop_signal() -> None:
    """Return once SIGTERM or SIGINT arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # platforms without loop signal handlers
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop where it is installed (a Linux dependency), else on asyncio's loop."""
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
